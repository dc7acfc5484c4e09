//! What a settled child tells its parent's model: the `call_agent` result, and the
//! reference that stands for a paused child's resume token.

use serde_json::{json, Value};

use crate::event::Outcome;
use crate::id::SessionId;
use crate::message::Usage;

/// What `now` adds to `before` (a child's cumulative usage at two settlements).
pub(super) fn usage_since(now: &Usage, before: &Usage) -> Usage {
    Usage {
        input_tokens: now.input_tokens.saturating_sub(before.input_tokens),
        output_tokens: now.output_tokens.saturating_sub(before.output_tokens),
        cost: (now.cost - before.cost).max(0.0),
        estimated: now.estimated,
        cache_read_tokens: now
            .cache_read_tokens
            .saturating_sub(before.cache_read_tokens),
        cache_write_tokens: now
            .cache_write_tokens
            .saturating_sub(before.cache_write_tokens),
    }
}

/// The JSON a parent's model is shown for a `call_agent` call.
pub fn call_agent_result(child: &SessionId, outcome: &Outcome, cached: bool) -> (String, bool) {
    let v = match outcome {
        Outcome::Completed {
            answer,
            usage,
            steps,
            patch,
        } => {
            let mut v = json!({
                "success": true,
                "result": answer,
                "session_id": child.display(),
                "steps_taken": steps,
                "usage": usage_json(usage),
            });
            if cached {
                v["cached"] = Value::Bool(true);
            }
            if let Some(p) = patch {
                v["patch"] = p.clone();
            }
            v
        }
        Outcome::Failed {
            error,
            usage,
            steps,
        } => json!({
            "success": false,
            "result": Value::Null,
            "session_id": child.display(),
            "steps_taken": steps,
            "usage": usage_json(usage),
            "error": error,
        }),
        Outcome::NeedsInput {
            questions,
            context,
            defaults,
            ..
        } => json!({
            "success": false,
            "session_id": child.display(),
            "need_user_input": {
                "questions": questions,
                "context": context,
                "proposed_defaults": defaults,
            },
            "resume_token": resume_reference(child, outcome),
        }),
    };
    let error = !matches!(outcome, Outcome::Completed { .. });
    (v.to_string(), error)
}

/// What a log shows of a paused child's resume token: a reference to it
/// ([`crate::token::reference`]), or the token itself in logs written before references.
pub fn resume_reference(child: &SessionId, outcome: &Outcome) -> String {
    match outcome {
        Outcome::NeedsInput { token_id, seq, .. } if !token_id.is_empty() => {
            crate::token::reference(&crate::token::Claims {
                session: child.clone(),
                seq: *seq,
                nonce: token_id.clone(),
                kind: "input".into(),
            })
        }
        Outcome::NeedsInput { token, .. } => token.clone(),
        _ => String::new(),
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cost": u.cost,
    })
}
