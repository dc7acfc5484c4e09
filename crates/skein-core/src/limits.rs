//! Limits that bound a tree, and the token budget a session may spend.

use serde::{Deserialize, Serialize};

/// Runtime-wide limits (config `[limits]`); an agent's front matter may tighten
/// `max_steps` and `max_children_per_turn` for itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Deepest delegation level: the root is depth 0, so 3 allows root → a → b → c.
    pub max_depth: u32,
    /// Model turns per session.
    pub max_steps: u32,
    /// `call_agent` calls one model turn may make.
    pub max_children_per_turn: u32,
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
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_depth: 3,
            max_steps: 24,
            max_children_per_turn: 16,
            max_unreadable_turns: 3,
            max_tokens: None,
            approval_required: vec!["shell".into(), "write_file".into()],
            plan_unlink: crate::plan::UnlinkPolicy::Owner,
        }
    }
}

/// What one session may spend, its children included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Budget {
    pub tokens: Option<u64>,
}
