//! skein-core: the pure domain of skein.
//!
//! Session ids, the event catalogue and its hash-chained envelope, agent definitions,
//! limits, the mission hash, resume tokens, and the two functions everything else leans
//! on: [`SessionState::apply`] (fold one event) and [`SessionState::next`] (decide the
//! next step). This crate must never depend on an async runtime, a clock, randomness or
//! any IO: whatever is not a pure function of the log enters only as an event.

pub mod agent;
mod constructors;
pub mod decide;
pub mod definitions;
pub mod duration;
pub mod event;
pub mod hash;
pub mod id;
pub mod limits;
pub mod message;
pub mod plan;
pub mod replay;
pub mod runtime_tool;
pub mod state;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
pub mod token;

pub use agent::{AgentDef, AgentSet};
pub use decide::{Delegation, Refusal, Step, ToolRun};
pub use definitions::Definitions;
pub use event::{Envelope, Event, Record};
pub use id::SessionId;
pub use limits::{Budget, Limits};
pub use message::{Message, ModelRequest, ModelResponse, ToolCall, ToolSpec, Usage};
pub use runtime_tool::{RuntimeTool, DELEGATE_TO_AGENT};
pub use state::{SessionState, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid session id: {0}")]
    InvalidId(String),
    #[error("{origin}: {reason}")]
    AgentDef { origin: String, reason: String },
    #[error("agent definitions rejected:\n  {}", .0.join("\n  "))]
    AgentSet(Vec<String>),
    #[error("encode: {0}")]
    Encode(String),
    #[error("decode: {0}")]
    Decode(String),
    /// A record written in a format newer than this process reads: a worker of a later
    /// release wrote it. Not damage: the work goes to a worker that reads it.
    #[error(
        "a record of {session} (seq {seq}) is in format {found}, newer than this worker \
         reads ({reads}): a worker of a later release wrote it"
    )]
    NewerFormat {
        session: String,
        seq: u64,
        found: u16,
        reads: u16,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
