//! The event catalogue and the versioned, hash-chained envelope.
//!
//! Every envelope carries `prev`, the blake3 hash of the previous record's encoded bytes
//! (for seq 1: the hash of the session id), so a log is tamper-evident. Bodies are encoded
//! with named fields; a body whose `type` this build does not know decodes as
//! [`Event::Unknown`] and is kept, shown and re-encoded unchanged, never dropped.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::id::SessionId;
use crate::limits::Budget;
use crate::message::{ModelResponse, Usage};
mod pattern;
mod record;

pub use pattern::{
    AdvisorsConsulted, BroadcastKind, HandedOff, PatternCall, Routed, TeamBroadcast, TeamRole,
    TeamSeat, TeamStarted, EXIT_CALL,
};

pub use record::{genesis_hash, record_hash, verify_chain, ChainBreak, Envelope, Record};

/// The first record format (the envelope's `v`): what a record is written in unless
/// every live worker of a cluster reads a newer one.
pub const ENVELOPE_VERSION: u16 = 1;

/// The newest record format this build reads; it reads every older one too. A build may
/// write a format only when every worker that could read the record reads it (see
/// docs/operations.md, "Changing a running cluster").
pub const READ_FORMAT: u16 = 1;

/// The newest record format this process reads: [`READ_FORMAT`], or one more in a
/// process told to act as the next release (see [`act_as_next_format`]).
pub fn read_format() -> u16 {
    NEXT.load(std::sync::atomic::Ordering::Relaxed)
}

static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(READ_FORMAT);

/// Makes this process read (and, where every live worker reads it, write) the format
/// after [`READ_FORMAT`], as the next release will: how the rolling-upgrade suites run
/// two releases side by side with one binary. Set once, at start, by the binary when
/// `SKEIN_TEST_NEXT_FORMAT` is set; never in production.
pub fn act_as_next_format() {
    NEXT.store(READ_FORMAT + 1, std::sync::atomic::Ordering::Relaxed);
}

/// The tool call (within the session's log) that a delegation answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParentRef {
    pub session: SessionId,
    pub call: String,
    /// The pool whose workers run the parent (to wake it).
    #[serde(default)]
    pub pool: Option<String>,
}

/// The pool of a session that names none.
pub const DEFAULT_POOL: &str = "default";

impl ParentRef {
    /// The pool whose workers run the parent: its own, or the default one.
    pub fn pool(&self) -> String {
        self.pool.clone().unwrap_or_else(|| DEFAULT_POOL.into())
    }
}

impl Submitted {
    /// The pool whose workers run this session: the one it names, or the default one.
    pub fn pool(&self) -> String {
        self.pool.clone().unwrap_or_else(|| DEFAULT_POOL.into())
    }
}

/// Where a forked session came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    pub session: SessionId,
    pub at_seq: u64,
}

/// A custom agent made at run time by its caller (`call_agent.agent_definition`).
/// `tool_allowlist` is accepted for `tools`; a field it does not know is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomAgent {
    pub system_prompt: String,
    #[serde(default, alias = "tool_allowlist")]
    pub tools: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submitted {
    pub agent: String,
    /// Digest of the agent definition text this session runs with.
    pub def_digest: String,
    pub mission: String,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub inputs: Value,
    pub mission_hash: String,
    #[serde(default)]
    pub parent: Option<ParentRef>,
    #[serde(default)]
    pub depth: u32,
    #[serde(default)]
    pub budget: Budget,
    /// W3C traceparent of the tree.
    #[serde(default)]
    pub trace: Option<String>,
    /// Agents on the path from the root to this session's parent, root first.
    #[serde(default)]
    pub ancestry: Vec<String>,
    #[serde(default)]
    pub no_cache: bool,
    #[serde(default)]
    pub forked_from: Option<Box<Provenance>>,
    /// Pool whose workers run this session.
    #[serde(default)]
    pub pool: Option<String>,
    /// The tasks of the parent's plan this session was handed, as they stood then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Box<PlanGrant>>,
    /// The request a pattern chain started from, when this session is a step of one
    /// (a handoff target, a router's destination): what its own handoff passes on as
    /// the original request. Its mission holds it already, in a tagged block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// The tools this session is narrowed to by its caller (`call_agent
    /// {allowed_tools}`): of its agent's tools, only these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_tools: Option<Vec<String>>,
    /// This session's seat in a team, when it is a member or the supervisor of one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<Box<TeamSeat>>,
    /// The version of the cluster's definitions (the digest of a
    /// [`crate::Definitions`]) the tree was pinned to when its root was submitted: every
    /// session of the tree runs on it. None: the worker's own files (embedded use, or a
    /// cluster to which no definitions were pushed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defs: Option<String>,
    /// The tree's priority for model quotas, given at its submission (`--priority`);
    /// every session of the tree has it. None: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// Tasks of a parent's plan handed to a child with its delegation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanGrant {
    /// The plan's version when the child was started: its first `base_version`.
    pub version: u64,
    pub tasks: Vec<crate::plan::Task>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCalled {
    pub model: String,
    pub request_digest: String,
    pub response: ModelResponse,
    #[serde(default)]
    pub usage: Usage,
    #[serde(default)]
    pub latency_ms: u64,
    /// The worker that made the call.
    #[serde(default)]
    pub worker: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFailed {
    pub model: String,
    pub error: String,
    pub retryable: bool,
    pub attempt: u32,
    #[serde(default)]
    pub worker: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCalled {
    pub call: String,
    pub tool: String,
    #[serde(default)]
    pub args: Value,
    #[serde(default)]
    pub worker: String,
}

/// A large payload kept in the blob store; the event keeps its hash and size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlobRef {
    pub hash: String,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolReturned {
    pub call: String,
    /// What the model is shown (possibly a truncated preview when `blob` is set).
    pub output: String,
    #[serde(default)]
    pub error: bool,
    #[serde(default)]
    pub ms: u64,
    #[serde(default)]
    pub blob: Option<BlobRef>,
    /// Why the runtime refused the call, where a later decision depends on the reason.
    /// Absent from most refusals, and from every record written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<Refused>,
}

impl ToolReturned {
    /// The recorded refusal kind. A record written before kinds were recorded carries the
    /// turn's budget refusal only in its text, which began with [`LEGACY_TURN_OVER_BUDGET`]:
    /// such a record (an error without a kind) is read as that kind, so old logs fold and
    /// replay as they were decided. Records written now always carry the kind.
    pub fn refusal_kind(&self) -> Option<Refused> {
        self.refused.or_else(|| {
            (self.error && self.output.starts_with(LEGACY_TURN_OVER_BUDGET))
                .then_some(Refused::TurnOverBudget)
        })
    }
}

/// How the text of a turn's budget refusal began in logs written before the kind was
/// recorded. Read only for records without a kind ([`ToolReturned::refusal_kind`]).
pub const LEGACY_TURN_OVER_BUDGET: &str = "budget: this turn's delegations ask for";

/// How the error of a session the worker failed as dead-lettered begins, for the people
/// who read it; the record's `dead_letter` flag is what replay reads
/// ([`Failed::is_dead_letter`]).
pub const DEAD_LETTER_PREFIX: &str = "dead-lettered: ";

/// A refusal reason that later decisions read back from the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refused {
    /// The turn's delegations together asked for more tokens than the session had left.
    /// Its refusals are recorded one at a time; the rest of the turn is refused the same
    /// way, so every prefix of the log decides alike.
    TurnOverBudget,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DelegatedWire", into = "DelegatedWire")]
pub struct Delegated {
    pub call: String,
    pub child: SessionId,
    pub agent: String,
    pub mission_hash: String,
    /// Tokens set aside for the child out of this session's budget.
    pub allotted_tokens: Option<u64>,
    /// Whether the call started `child`, shares a run already going, or resumes it.
    pub kind: DelegationKind,
    /// Tasks of this session's plan handed to the child (it may write only those).
    pub owns_tasks: Vec<String>,
    /// A follow-up question's: the model turns the child may make in all, so that its
    /// answer can tell how many are left (`turns_remaining`).
    pub max_steps: Option<u32>,
}

/// What a delegation did with its child.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelegationKind {
    /// It started `child`, a new run.
    Started,
    /// Single-flight: `child` is an identical mission already running (possibly in
    /// another tree); this call shares its outcome instead of starting a run.
    Shared,
    /// This call continues `child`, which had paused for input (its answers were
    /// recorded in its log as `InputProvided`), or puts a follow-up question to it.
    Resumed,
}

/// [`Delegated`] as it is stored: the kind as the two flags `shared` and `resumed` that
/// every log has carried, so that a log reads the same to this version and to an older
/// worker still running beside it during an upgrade. At most one flag is set.
#[derive(Serialize, Deserialize)]
struct DelegatedWire {
    call: String,
    child: SessionId,
    agent: String,
    mission_hash: String,
    #[serde(default)]
    allotted_tokens: Option<u64>,
    #[serde(default)]
    shared: bool,
    #[serde(default)]
    resumed: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    owns_tasks: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_steps: Option<u32>,
}

impl TryFrom<DelegatedWire> for Delegated {
    type Error = String;

    fn try_from(w: DelegatedWire) -> Result<Self, String> {
        let kind = match (w.shared, w.resumed) {
            (false, false) => DelegationKind::Started,
            (true, false) => DelegationKind::Shared,
            (false, true) => DelegationKind::Resumed,
            (true, true) => {
                return Err(format!(
                    "Delegated of call `{}`: a delegation is not both shared and resumed",
                    w.call
                ))
            }
        };
        Ok(Delegated {
            call: w.call,
            child: w.child,
            agent: w.agent,
            mission_hash: w.mission_hash,
            allotted_tokens: w.allotted_tokens,
            kind,
            owns_tasks: w.owns_tasks,
            max_steps: w.max_steps,
        })
    }
}

impl From<Delegated> for DelegatedWire {
    fn from(d: Delegated) -> Self {
        DelegatedWire {
            call: d.call,
            child: d.child,
            agent: d.agent,
            mission_hash: d.mission_hash,
            allotted_tokens: d.allotted_tokens,
            shared: d.kind == DelegationKind::Shared,
            resumed: d.kind == DelegationKind::Resumed,
            owns_tasks: d.owns_tasks,
            max_steps: d.max_steps,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheHit {
    pub call: String,
    pub mission_hash: String,
    pub source: SessionId,
    pub answer: String,
    /// What the cached run cost (saved by this hit).
    #[serde(default)]
    pub saved: Usage,
    #[serde(default)]
    pub steps: u32,
    /// What the key covered, so that a person can see why it hit (absent in older logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<Box<crate::hash::KeyParts>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    Completed {
        answer: String,
        #[serde(default)]
        patch: Option<Value>,
        #[serde(default)]
        usage: Usage,
        #[serde(default)]
        steps: u32,
        /// The answer was made without some child's answer (`Completed::partial`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        partial: bool,
    },
    Failed {
        error: String,
        #[serde(default)]
        usage: Usage,
        #[serde(default)]
        steps: u32,
    },
    /// The child paused on a question. The log keeps the token's id and the seq of the
    /// child's `InputRequested`: the runtime derives the token from them (with its secret)
    /// when the parent's model is shown it. Logs written before that kept `token` itself.
    NeedsInput {
        questions: Value,
        #[serde(default)]
        context: Option<String>,
        #[serde(default)]
        defaults: Value,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        token: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        token_id: String,
        #[serde(default)]
        seq: u64,
        /// What the child had spent when it paused (absent in older logs): it rolls up
        /// now, so that a child whose question is never answered still counts.
        #[serde(default)]
        usage: Usage,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildSettled {
    pub call: String,
    pub child: SessionId,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputRequested {
    #[serde(default)]
    pub call: Option<String>,
    pub questions: Value,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub defaults: Value,
    pub token_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputProvided {
    pub answers: Value,
    pub token_id: String,
    #[serde(default)]
    pub by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalRequested {
    pub call: String,
    pub tool: String,
    pub preview: String,
    pub token_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalGiven {
    pub call: String,
    pub approved: bool,
    #[serde(default)]
    pub by: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    pub token_id: String,
}

/// A change to this session's plan, accepted. `from` is `"self"` for the owner's own
/// `update_plan`, else the proposing sub-agent's session id; `call` is the tool call that
/// proposed it (in `from`'s log), none for a patch carried by a child's final answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatchApplied {
    pub from: String,
    pub agent: String,
    #[serde(default)]
    pub call: Option<String>,
    #[serde(default)]
    pub base_version: Option<u64>,
    pub ops: Vec<crate::plan::PatchOp>,
    /// The plan's version after this patch.
    pub version: u64,
}

/// A proposed change to this session's plan, refused (nothing changed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatchRejected {
    pub from: String,
    pub agent: String,
    #[serde(default)]
    pub call: Option<String>,
    #[serde(default)]
    pub base_version: Option<u64>,
    pub reason: crate::plan::Rejection,
}

/// A follow-up question to a finished `chat: true` session; its log simply continues.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClarificationRequested {
    /// The asking session.
    pub from: SessionId,
    /// Its tool call.
    pub call: String,
    pub question: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completed {
    pub answer: String,
    #[serde(default)]
    pub usage_total: Usage,
    /// Model turns this session made.
    #[serde(default)]
    pub steps: u32,
    /// The answer was made without some child's answer: a child under it failed or was
    /// cancelled (by a person, a timeout, another tree's cancel it could not redo), here or
    /// further down. A fresh run might have had it, so such an answer is never cached.
    /// Absent (false) in older logs, and left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partial: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failed {
    pub error: String,
    #[serde(default)]
    pub usage_total: Usage,
    #[serde(default)]
    pub steps: u32,
    /// The worker failed the session after its job was delivered too often: a fact of the
    /// deliveries, which no log holds, not a decision of the rules. Absent (false) from
    /// every other failure and from records written before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dead_letter: bool,
}

impl Failed {
    /// Whether the worker failed this session as dead-lettered. A record written before the
    /// flag existed says so only in its text, which began with [`DEAD_LETTER_PREFIX`]: such
    /// a record is read as dead-lettered, so old logs replay as they did.
    pub fn is_dead_letter(&self) -> bool {
        self.dead_letter || self.error.starts_with(DEAD_LETTER_PREFIX)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cancelled {
    pub reason: String,
}

/// One fact in a session's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data")]
pub enum Event {
    Submitted(Submitted),
    ModelCalled(ModelCalled),
    ModelFailed(ModelFailed),
    ToolCalled(ToolCalled),
    ToolReturned(ToolReturned),
    Delegated(Delegated),
    CacheHit(CacheHit),
    ChildSettled(ChildSettled),
    InputRequested(InputRequested),
    InputProvided(InputProvided),
    ApprovalRequested(ApprovalRequested),
    ApprovalGiven(ApprovalGiven),
    PatchApplied(PatchApplied),
    PatchRejected(PatchRejected),
    ClarificationRequested(ClarificationRequested),
    HandedOff(HandedOff),
    Routed(Routed),
    AdvisorsConsulted(AdvisorsConsulted),
    TeamStarted(TeamStarted),
    TeamBroadcast(TeamBroadcast),
    Completed(Completed),
    Failed(Failed),
    Cancelled(Cancelled),
    /// A body this build does not know: kept as it was read.
    #[serde(skip)]
    Unknown {
        kind: String,
        data: Value,
    },
}

/// The `type` of every event this build knows. A stored body of one of these kinds that
/// does not read as that kind is damaged; only other kinds are [`Event::Unknown`].
pub const KINDS: &[&str] = &[
    "Submitted",
    "ModelCalled",
    "ModelFailed",
    "ToolCalled",
    "ToolReturned",
    "Delegated",
    "CacheHit",
    "ChildSettled",
    "InputRequested",
    "InputProvided",
    "ApprovalRequested",
    "ApprovalGiven",
    "PatchApplied",
    "PatchRejected",
    "ClarificationRequested",
    "HandedOff",
    "Routed",
    "AdvisorsConsulted",
    "TeamStarted",
    "TeamBroadcast",
    "Completed",
    "Failed",
    "Cancelled",
];

impl Event {
    pub fn kind(&self) -> &str {
        match self {
            Event::Submitted(_) => "Submitted",
            Event::ModelCalled(_) => "ModelCalled",
            Event::ModelFailed(_) => "ModelFailed",
            Event::ToolCalled(_) => "ToolCalled",
            Event::ToolReturned(_) => "ToolReturned",
            Event::Delegated(_) => "Delegated",
            Event::CacheHit(_) => "CacheHit",
            Event::ChildSettled(_) => "ChildSettled",
            Event::InputRequested(_) => "InputRequested",
            Event::InputProvided(_) => "InputProvided",
            Event::ApprovalRequested(_) => "ApprovalRequested",
            Event::ApprovalGiven(_) => "ApprovalGiven",
            Event::PatchApplied(_) => "PatchApplied",
            Event::PatchRejected(_) => "PatchRejected",
            Event::ClarificationRequested(_) => "ClarificationRequested",
            Event::HandedOff(_) => "HandedOff",
            Event::Routed(_) => "Routed",
            Event::AdvisorsConsulted(_) => "AdvisorsConsulted",
            Event::TeamStarted(_) => "TeamStarted",
            Event::TeamBroadcast(_) => "TeamBroadcast",
            Event::Completed(_) => "Completed",
            Event::Failed(_) => "Failed",
            Event::Cancelled(_) => "Cancelled",
            Event::Unknown { kind, .. } => kind,
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Event::Completed(_) | Event::Failed(_) | Event::Cancelled(_)
        )
    }

    /// The body as JSON (for `events --json`, audit export).
    pub fn to_json(&self) -> Value {
        match self {
            Event::Unknown { kind, data } => serde_json::json!({"type": kind, "data": data}),
            e => serde_json::to_value(e).unwrap_or(Value::Null),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> SessionId {
        SessionId::root("s").unwrap()
    }

    #[test]
    fn a_refusal_kind_is_written_only_where_there_is_one() {
        let plain = Envelope::new(id(), 2, 1, "p".into(), Event::tool_error("c1", "no"));
        let bytes = plain.encode().unwrap();
        // Written as before the kind existed: no `refused` key at all.
        assert!(!bytes.windows(7).any(|w| w == b"refused"));
        assert_eq!(Envelope::decode(&bytes).unwrap(), plain);
        let kind = Some(Refused::TurnOverBudget);
        let refused = Envelope::new(id(), 2, 1, "p".into(), Event::refusal("c1", "no", kind));
        let bytes = refused.encode().unwrap();
        let back = Envelope::decode(&bytes).unwrap();
        assert_eq!(back, refused);
        let Event::ToolReturned(t) = back.body else {
            panic!("{back:?}")
        };
        assert_eq!(t.refusal_kind(), kind);
    }

    #[test]
    fn kinds_lists_every_event_this_build_knows() {
        // serde names every variant when it meets an unknown one.
        let err = serde_json::from_value::<Event>(serde_json::json!({"type": "?", "data": {}}))
            .unwrap_err()
            .to_string();
        let expected = err.split("expected one of ").nth(1).unwrap();
        let named: Vec<&str> = expected
            .split(", ")
            .map(|k| k.trim_matches(|c: char| c == '`' || c.is_whitespace()))
            .map(|k| k.split('`').next().unwrap_or(k))
            .collect();
        assert_eq!(named, KINDS, "{err}");
    }

    #[test]
    fn a_known_kind_that_does_not_read_as_one_is_an_error() {
        let env = Envelope::new(
            id(),
            3,
            1,
            "p".into(),
            Event::Unknown {
                kind: "Completed".into(),
                data: serde_json::json!({"answer": 5}),
            },
        );
        let err = Envelope::decode(&env.encode().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("Completed record at seq 3"), "{err}");
        assert!(err.contains("invalid type"), "{err}");
    }

    /// msgpack written by hand: a `Submitted` whose `depth` appears twice.
    #[test]
    fn a_field_written_twice_is_an_error_not_an_unknown_event() {
        fn s(x: &str) -> Vec<u8> {
            let mut v = vec![0xa0 | x.len() as u8];
            v.extend_from_slice(x.as_bytes());
            v
        }
        let mut data = vec![0x86];
        for (k, v) in [("agent", "a"), ("def_digest", "d"), ("mission", "m")] {
            data.extend(s(k));
            data.extend(s(v));
        }
        data.extend(s("mission_hash"));
        data.extend(s("h"));
        data.extend(s("depth"));
        data.push(1);
        data.extend(s("depth"));
        data.push(2);
        let mut bytes = vec![0x86];
        bytes.extend(s("v"));
        bytes.push(1);
        bytes.extend(s("session"));
        bytes.extend(s("s"));
        bytes.extend(s("seq"));
        bytes.push(1);
        bytes.extend(s("at"));
        bytes.push(1);
        bytes.extend(s("prev"));
        bytes.extend(s("p"));
        bytes.extend(s("body"));
        bytes.push(0x82);
        bytes.extend(s("type"));
        bytes.extend(s("Submitted"));
        bytes.extend(s("data"));
        bytes.extend(data);
        let err = Envelope::decode(&bytes).unwrap_err().to_string();
        assert!(err.contains("duplicate field `depth`"), "{err}");
        // The same body without the second `depth` reads.
        let ok = Envelope::new(
            id(),
            1,
            1,
            "p".into(),
            Event::Unknown {
                kind: "FutureKind".into(),
                data: serde_json::json!({"depth": 1}),
            },
        );
        assert_eq!(Envelope::decode(&ok.encode().unwrap()).unwrap(), ok);
    }
}
