//! Pure constructors for the events the shell records after a step, so each is built one
//! way wherever it is recorded: a tool call's result, a plan patch's verdict, a question
//! or an approval asked for, the end of a session.

use crate::decide::{ApprovalAsk, Ask};
use crate::event::{
    ApprovalRequested, Completed, Event, Failed, InputRequested, PatchApplied, PatchRejected,
    Refused, ToolReturned,
};
use crate::message::Usage;
use crate::plan::{Patch, Rejection};

impl Event {
    /// A tool call's result with no blob and no running time: a refusal, a verdict, or an
    /// outcome the runtime gives itself instead of running a tool.
    pub fn tool_result(call: impl Into<String>, output: impl Into<String>, error: bool) -> Event {
        Event::ToolReturned(ToolReturned {
            call: call.into(),
            output: output.into(),
            error,
            ms: 0,
            blob: None,
            refused: None,
        })
    }

    /// A tool call's error: the model reads `output` as its result.
    pub fn tool_error(call: impl Into<String>, output: impl Into<String>) -> Event {
        Event::tool_result(call, output, true)
    }

    /// A tool call the runtime refused, with the reason's kind when a later decision reads
    /// it back.
    pub fn refusal(
        call: impl Into<String>,
        output: impl Into<String>,
        refused: Option<Refused>,
    ) -> Event {
        let mut e = Event::tool_error(call, output);
        if let Event::ToolReturned(t) = &mut e {
            t.refused = refused;
        }
        e
    }

    /// The verdict on `patch` to a plan: `PatchApplied` at the new version, or
    /// `PatchRejected` with the reason. `from` is [`crate::plan::SELF`] for the plan
    /// owner's own edit, else the proposing sub-agent's session id; `call` is none for a
    /// patch carried by a child's final answer.
    pub fn patch_verdict(
        from: impl Into<String>,
        agent: impl Into<String>,
        call: Option<String>,
        patch: Patch,
        verdict: &Result<u64, Rejection>,
    ) -> Event {
        match verdict {
            Ok(version) => Event::PatchApplied(PatchApplied {
                from: from.into(),
                agent: agent.into(),
                call,
                base_version: patch.base_version,
                ops: patch.ops,
                version: *version,
            }),
            Err(reason) => Event::PatchRejected(PatchRejected {
                from: from.into(),
                agent: agent.into(),
                call,
                base_version: patch.base_version,
                reason: reason.clone(),
            }),
        }
    }

    /// The session finished with `answer`, having used `usage_total` (its own and its
    /// children's) in `steps` model turns.
    pub fn completed(answer: impl Into<String>, usage_total: Usage, steps: u32) -> Event {
        Event::Completed(Completed {
            answer: answer.into(),
            usage_total,
            steps,
            partial: false,
        })
    }

    /// The session failed with `error`, having used `usage_total` in `steps` model turns.
    pub fn failed(error: impl Into<String>, usage_total: Usage, steps: u32) -> Event {
        Event::Failed(Failed {
            error: error.into(),
            usage_total,
            steps,
            dead_letter: false,
        })
    }

    /// The worker's failure of a session whose job was delivered too often
    /// ([`Failed::dead_letter`]); `why` follows [`crate::event::DEAD_LETTER_PREFIX`].
    pub fn dead_lettered(why: &str, usage_total: Usage, steps: u32) -> Event {
        Event::Failed(Failed {
            error: format!("{}{why}", crate::event::DEAD_LETTER_PREFIX),
            usage_total,
            steps,
            dead_letter: true,
        })
    }
}

impl Ask {
    /// The `InputRequested` that records this question, under `token_id` (the runtime's
    /// random id for the token that will answer it).
    pub fn into_event(self, token_id: String) -> Event {
        Event::InputRequested(InputRequested {
            call: Some(self.call),
            questions: self.questions,
            context: self.context,
            defaults: self.defaults,
            token_id,
        })
    }
}

impl ApprovalAsk {
    /// The `ApprovalRequested` that records this wait, under `token_id`.
    pub fn into_event(self, token_id: String) -> Event {
        Event::ApprovalRequested(ApprovalRequested {
            call: self.call,
            tool: self.tool,
            preview: self.preview,
            token_id,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn usage() -> Usage {
        Usage {
            input_tokens: 7,
            output_tokens: 3,
            ..Usage::default()
        }
    }

    #[test]
    fn a_tool_error_is_recorded_as_an_error_result_with_no_blob() {
        let e = Event::tool_error("c1", "no");
        assert_eq!(
            e.to_json(),
            json!({"type": "ToolReturned", "data": {
                "call": "c1", "output": "no", "error": true, "ms": 0, "blob": null,
            }})
        );
        let Event::ToolReturned(t) = Event::tool_result("c2", "{}", false) else {
            panic!("not a ToolReturned")
        };
        assert!(!t.error);
    }

    #[test]
    fn a_patch_verdict_is_applied_at_its_version_or_rejected_with_its_reason() {
        let patch = Patch::from_args(&json!({
            "base_version": 2,
            "ops": [{"op": "add", "task": {"id": "t1", "title": "T"}}],
        }))
        .unwrap();
        match Event::patch_verdict("self", "boss", Some("c1".into()), patch.clone(), &Ok(3)) {
            Event::PatchApplied(p) => {
                assert_eq!(
                    (p.from.as_str(), p.agent.as_str(), p.call.as_deref()),
                    ("self", "boss", Some("c1"))
                );
                assert_eq!((p.base_version, p.version), (Some(2), 3));
                assert_eq!(p.ops, patch.ops);
            }
            other => panic!("not applied: {other:?}"),
        }
        let reason = Rejection::Conflict {
            current_version: 4,
            base_version: Some(2),
        };
        match Event::patch_verdict("r1/expert-1", "expert", None, patch, &Err(reason.clone())) {
            Event::PatchRejected(p) => {
                assert_eq!((p.from.as_str(), p.call), ("r1/expert-1", None));
                assert_eq!((p.base_version, p.reason), (Some(2), reason));
            }
            other => panic!("not rejected: {other:?}"),
        }
    }

    #[test]
    fn the_end_of_a_session_carries_its_usage_and_steps() {
        assert_eq!(
            Event::completed("42", usage(), 5).to_json()["data"],
            json!({"answer": "42", "usage_total": serde_json::to_value(usage()).unwrap(), "steps": 5})
        );
        assert_eq!(
            Event::failed("boom", usage(), 2).to_json()["data"],
            json!({"error": "boom", "usage_total": serde_json::to_value(usage()).unwrap(), "steps": 2})
        );
    }
}
