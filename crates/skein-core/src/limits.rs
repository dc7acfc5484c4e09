//! Limits that bound a tree, and the token budget a session may spend.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Longest mission text accepted (bytes), from a person or from `call_agent`.
pub const MAX_MISSION_BYTES: usize = 64 * 1024;
/// Longest `context` accepted with a mission (bytes).
pub const MAX_CONTEXT_BYTES: usize = 256 * 1024;
/// Largest `inputs` accepted with a mission, measured as compact JSON (bytes). Mission,
/// context and inputs together stay well below the 1 MiB a NATS message may carry, since
/// the session's first event holds all three.
pub const MAX_INPUTS_BYTES: usize = 256 * 1024;

/// Checks what a mission is made of, for a root submission and a `call_agent` delegation
/// alike: the mission is not empty and each part is within its limit. The error names the
/// part, its size and the limit.
pub fn check_mission(mission: &str, context: Option<&str>, inputs: &Value) -> Result<(), String> {
    if mission.trim().is_empty() {
        return Err("mission is empty".into());
    }
    if mission.len() > MAX_MISSION_BYTES {
        return Err(format!(
            "mission is {} bytes; at most {MAX_MISSION_BYTES} are accepted",
            mission.len()
        ));
    }
    if let Some(c) = context {
        if c.len() > MAX_CONTEXT_BYTES {
            return Err(format!(
                "context is {} bytes; at most {MAX_CONTEXT_BYTES} are accepted",
                c.len()
            ));
        }
    }
    let size = json_len(inputs);
    if size > MAX_INPUTS_BYTES {
        return Err(format!(
            "inputs are {size} bytes as JSON; at most {MAX_INPUTS_BYTES} are accepted"
        ));
    }
    Ok(())
}

/// Bytes of `v` as compact JSON, counted without building the text.
fn json_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    match serde_json::to_writer(&mut c, v) {
        Ok(()) => c.0,
        Err(_) => usize::MAX,
    }
}

/// Runtime-wide limits (config `[limits]`); an agent's front matter may set `max_steps`,
/// `max_children_per_turn` and `max_tool_calls_per_turn` for itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Deepest delegation level: the root is depth 0, so 3 allows root → a → b → c.
    pub max_depth: u32,
    /// Model turns per session.
    pub max_steps: u32,
    /// `call_agent` calls one model turn may make.
    pub max_children_per_turn: u32,
    /// Tool calls of any kind one model turn may make; the calls past it are refused (each
    /// gets an error the model reads) and none of them runs.
    pub max_tool_calls_per_turn: u32,
    /// Model turns in a row whose tool calls could not be read (each is shown to the
    /// model as a tool error) before the session fails with the reason.
    pub max_unreadable_turns: u32,
    /// Tokens a whole tree may spend; none for no limit.
    pub max_tokens: Option<u64>,
    /// Tools that always wait for a person's approval (an agent may add more with
    /// `requires_approval`).
    pub approval_required: Vec<String>,
    /// Whether a sub-agent may remove a dependency link of its parent's plan: `owner`
    /// (only from a task it owns), `any`, or `never`.
    pub plan_unlink: crate::plan::UnlinkPolicy,
    /// Reference 000's global bound on sub-agents' tools: a session below the root may
    /// use only the tools listed here (besides `propose_patch` and `team_broadcast`, which
    /// the runtime gives it), whatever its agent file lists. None: no global bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sub_agent_tool_allowlist: Option<Vec<String>>,
}

impl Limits {
    /// Whether the global sub-agent bound lets a session at `depth` use `tool`.
    pub fn sub_agent_may_use(&self, depth: u32, tool: &str) -> bool {
        match &self.sub_agent_tool_allowlist {
            Some(only) if depth > 0 => {
                only.iter().any(|t| {
                    t == tool
                        || (crate::RuntimeTool::CallAgent.is(t)
                            && crate::RuntimeTool::CallAgent.is(tool))
                }) || crate::RuntimeTool::ProposePatch.is(tool)
                    || crate::RuntimeTool::TeamBroadcast.is(tool)
            }
            _ => true,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_depth: 3,
            max_steps: 24,
            max_children_per_turn: 16,
            max_tool_calls_per_turn: 64,
            max_unreadable_turns: 3,
            max_tokens: None,
            approval_required: vec!["shell".into(), "write_file".into()],
            plan_unlink: crate::plan::UnlinkPolicy::Owner,
            sub_agent_tool_allowlist: None,
        }
    }
}

/// What one session may spend, its children included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Budget {
    pub tokens: Option<u64>,
    /// Model turns the session may make (fewer than its agent's `max_steps`, never more).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn mission_parts_are_capped_with_their_size_named() {
        assert!(check_mission("do it", Some("bg"), &json!({"a": 1})).is_ok());
        assert!(check_mission("do it", None, &Value::Null).is_ok());
        let e = check_mission("  ", None, &Value::Null).unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = check_mission(&"m".repeat(MAX_MISSION_BYTES + 1), None, &Value::Null).unwrap_err();
        assert!(e.contains("mission is 65537 bytes"), "{e}");
        let big = "c".repeat(MAX_CONTEXT_BYTES + 1);
        let e = check_mission("ok", Some(&big), &Value::Null).unwrap_err();
        assert!(
            e.contains("context is 262145 bytes") && e.contains("262144"),
            "{e}"
        );
        assert!(check_mission("ok", Some(&big[1..]), &Value::Null).is_ok());
        let inputs = json!({"blob": "i".repeat(MAX_INPUTS_BYTES)});
        let e = check_mission("ok", None, &inputs).unwrap_err();
        assert!(e.contains("inputs are 262155 bytes as JSON"), "{e}");
        assert_eq!(json_len(&json!({"a": [1, "b"]})), r#"{"a":[1,"b"]}"#.len());
    }
}
