//! What a settled child tells its parent's model: the `call_agent` result, and the
//! reference that stands for a paused child's resume token.

use serde_json::{json, Value};

use crate::event::Outcome;
use crate::id::SessionId;
use crate::message::Usage;

/// What `now` adds to `before` (a child's cumulative usage at two settlements).
pub fn usage_since(now: &Usage, before: &Usage) -> Usage {
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

/// The category of a child's failure, as the references name them: `cancelled`,
/// `timeout`, `budget` (tokens or model turns), `depth`, `denied`, `model`, `tool`,
/// `dead_letter` (the worker gave up on its job), or `error`. Read from the failure's text,
/// which skein's own rules write (a pattern's failure names its child's, so the innermost
/// cause decides).
pub fn error_type(error: &str) -> &'static str {
    // The innermost cause of a chain of pattern failures ("the handoff to `b` failed: …").
    let cause = error.rsplit(" failed: ").next().unwrap_or(error);
    let cause = cause
        .trim_start_matches("handoff: ")
        .trim_start_matches("route: ");
    if error.starts_with(crate::event::DEAD_LETTER_PREFIX) {
        "dead_letter"
    } else if cause.starts_with("cancelled: timed out") || cause.starts_with("timed out") {
        "timeout"
    } else if cause.starts_with("cancelled") {
        "cancelled"
    } else if cause.starts_with("token budget exhausted")
        || cause.starts_with("step limit reached")
        || cause.starts_with("budget:")
    {
        "budget"
    } else if cause.starts_with("depth limit") {
        "depth"
    } else if cause.contains("was denied by") {
        "denied"
    } else if cause.starts_with("model call failed")
        || cause.starts_with("the model's tool calls could not be read")
    {
        "model"
    } else if cause.starts_with("tool ") || cause.contains("tool `") {
        "tool"
    } else {
        "error"
    }
}

/// Who answered a `call_agent` call, shown with every result: the agent's name and the
/// depth its session ran at.
#[derive(Debug, Clone, Copy)]
pub struct Answerer<'a> {
    pub agent: &'a str,
    pub depth: u32,
}

/// The JSON a parent's model is shown for a `call_agent` call.
pub fn call_agent_result(
    child: &SessionId,
    outcome: &Outcome,
    cached: bool,
    by: Answerer<'_>,
) -> (String, bool) {
    let mut v = match outcome {
        Outcome::Completed {
            answer,
            usage,
            steps,
            patch,
            ..
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
            structured_fields(answer, &mut v);
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
            "error_type": error_type(error),
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
    v["agent_name"] = Value::String(by.agent.to_string());
    v["depth"] = json!(by.depth);
    let error = !matches!(outcome, Outcome::Completed { .. });
    (v.to_string(), error)
}

/// A child whose final answer is a JSON object with `new_facts` or `suggested_next_action`
/// (reference 002's finished child) has them passed on beside its `result`.
fn structured_fields(answer: &str, v: &mut Value) {
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(answer.trim()) else {
        return;
    };
    for key in ["new_facts", "suggested_next_action"] {
        if let Some(x) = o.get(key).filter(|x| !x.is_null()) {
            v[key] = x.clone();
        }
    }
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
                kind: crate::token::TokenKind::Input,
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
