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

/// The members and the supervisor of the session's `team`, started together. The
/// supervisor's answer is the team's; members talk only through `team_broadcast`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamStarted {
    pub members: Vec<PatternCall>,
    pub supervisor: PatternCall,
}

/// Where a session sits in a team: given to every member and to the supervisor with
/// its `Submitted`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamSeat {
    /// The session whose `team` this is.
    pub host: crate::id::SessionId,
    pub role: TeamRole,
    /// Every other participant: what this session broadcasts reaches them.
    pub peers: Vec<crate::id::SessionId>,
    /// How many members the team has (the supervisor waits for them).
    pub members: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TeamRole {
    Member,
    Supervisor,
}

/// What a broadcast is: news, a participant's trouble, or a member's last word (its
/// answer, or the reason it ended) as it leaves the team.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BroadcastKind {
    Update,
    Failure,
    Exit,
}

impl BroadcastKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BroadcastKind::Update => "update",
            BroadcastKind::Failure => "failure",
            BroadcastKind::Exit => "exit",
        }
    }
}

/// A teammate's broadcast, as the receiving session's log records it (appended from
/// outside, by the sender's worker). The model reads it before its next turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamBroadcast {
    pub from: crate::id::SessionId,
    pub agent: String,
    /// The sender's `team_broadcast` call, or `exit` for a member's last word: with
    /// `from`, what makes a delivery happen once.
    pub call: String,
    pub kind: BroadcastKind,
    pub message: String,
    /// Model turns the sender had made when it sent this (absent in older logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<u32>,
}

/// The call id of a member's last word, sent as it leaves the team.
pub const EXIT_CALL: &str = "exit";

impl TeamBroadcast {
    /// The key a receiving session remembers the broadcast by.
    pub fn key(&self) -> String {
        format!("{}/{}", self.from, self.call)
    }

    /// Whether this is a member's last word: its answer (`exit`), or the news that it
    /// failed (`failure`), sent as it leaves the team.
    pub fn is_leaving(&self) -> bool {
        self.kind == BroadcastKind::Exit
            || (self.call == EXIT_CALL && self.kind == BroadcastKind::Failure)
    }
}
