//! Events of the orchestration patterns an agent's front matter declares: a handoff of
//! its answer, a router's choice, the advisors consulted before its first model call.
//! Each opens a turn of pattern calls whose children are then delegated, cached, shared
//! and settled like those of `call_agent`.

use serde::{Deserialize, Serialize};

/// One child a pattern starts: the call id that stands for it in the session's turn, the
/// agent, and the mission it is given (whole, as its first prompt reads it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatternCall {
    pub call: String,
    pub agent: String,
    pub mission: String,
}

/// The session's answer goes on to its `handoff` agent, whose answer (at the end of its
/// own chain) becomes this session's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HandedOff {
    /// The agent whose answer is handed on (this session's, or a router's destination).
    pub from: String,
    pub next: PatternCall,
}

/// A router's `handoff_to` call: the router's session ends in the chosen destination,
/// whose answer becomes the router's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Routed {
    /// The model's `handoff_to` call.
    pub call: String,
    #[serde(default)]
    pub message: Option<String>,
    pub next: PatternCall,
}

/// The agent's advisors, started together on its input before its first model call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdvisorsConsulted {
    pub advisors: Vec<PatternCall>,
}
