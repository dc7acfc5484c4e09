//! `SessionState`: a session's state as a fold over its log. The fold itself is in
//! `fold.rs`; what a child's outcome tells its parent's model in `outcome.rs`.

mod fold;
mod outcome;
mod pattern;

pub use outcome::{call_agent_result, error_type, resume_reference, usage_since, Answerer};
pub use pattern::{
    block_nonce, broadcast_text, handoff_mission, route_mission, split_call, Advice, AdviceNote,
    PatternKind, MEMBER, SUPERVISOR,
};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::{DelegationKind, Envelope, Event, Outcome, Refused, Submitted};
use crate::id::SessionId;
use crate::message::{Message, ToolCall, Usage};
use crate::runtime_tool::RuntimeTool;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// No `Submitted` yet.
    New,
    Running,
    /// Waiting for children of the current turn.
    Waiting,
    AwaitingInput,
    AwaitingApproval,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Completed | Status::Failed | Status::Cancelled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::New => "new",
            Status::Running => "running",
            Status::Waiting => "waiting",
            Status::AwaitingInput => "awaiting_input",
            Status::AwaitingApproval => "awaiting_approval",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where one tool call of the current turn stands.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum SlotState {
    /// Asked for by the model; nothing recorded yet.
    Pending,
    /// `ToolCalled` recorded, no `ToolReturned` yet.
    Running,
    /// A child session answers this call (`shared`: a run started by someone else).
    Delegated {
        child: SessionId,
        allotted: Option<u64>,
        shared: bool,
    },
    /// `ask_user`: waiting for a person's (or the parent's) answers.
    Asked { token_id: String },
    /// A tool that needs approval: waiting for it.
    AwaitingApproval { token_id: String },
    /// Approval given: the tool may run.
    Approved,
    /// The outcome the model will be shown.
    Done { output: String, error: bool },
}

/// An open question of this session.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PendingInput {
    pub call: String,
    /// Seq of the `InputRequested` event.
    pub seq: u64,
    pub token_id: String,
    pub questions: Value,
    pub context: Option<String>,
    pub defaults: Value,
}

/// An open approval of this session.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PendingApproval {
    pub call: String,
    pub seq: u64,
    pub token_id: String,
    pub tool: String,
    pub preview: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Slot {
    pub call: ToolCall,
    pub state: SlotState,
}

/// How a child last settled (see [`ChildSettled`](crate::event::ChildSettled)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChildOutcome {
    Completed,
    Failed,
    /// It paused on a question; it may settle again once answered.
    NeedsInput,
}

impl ChildOutcome {
    /// The kind of `outcome`.
    pub fn of(outcome: &crate::event::Outcome) -> Self {
        match outcome {
            crate::event::Outcome::Completed { .. } => ChildOutcome::Completed,
            crate::event::Outcome::Failed { .. } => ChildOutcome::Failed,
            crate::event::Outcome::NeedsInput { .. } => ChildOutcome::NeedsInput,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ChildOutcome::Completed => "completed",
            ChildOutcome::Failed => "failed",
            ChildOutcome::NeedsInput => "needs_input",
        }
    }
}

/// A child this session started, and how it ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChildInfo {
    pub call: String,
    pub child: SessionId,
    pub agent: String,
    pub mission_hash: String,
    /// None while it runs.
    pub outcome: Option<ChildOutcome>,
    pub cached: bool,
    /// Answered by an identical run someone else started (single-flight).
    pub shared: bool,
    /// Model turns the child had made when it last settled.
    pub steps: u32,
    /// For a follow-up question: the model turns the child may make in all.
    pub max_steps: Option<u32>,
    /// The delegation's number among the session's (its `Delegated`, counted as
    /// `accounting.delegations` counts them): the number decided for its child's id. A
    /// shared run or a cache hit created no child of that number, which stays the call's
    /// own ([`SessionState::delegations_again`]).
    #[serde(skip)]
    pub number: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionState {
    pub id: Option<SessionId>,
    pub submitted: Option<Submitted>,
    pub status: Status,
    /// Messages after the system prompt and the mission: assistant turns and tool results.
    pub transcript: Vec<Message>,
    /// The tool calls of the current model turn, in the model's order.
    pub turn: Vec<Slot>,
    /// Model turns recorded.
    pub steps: u32,
    /// Failed model calls and unreadable model turns.
    #[serde(flatten)]
    pub failures: Failures,
    /// What the session and its children spent, and what was saved.
    #[serde(flatten)]
    pub accounting: Accounting,
    pub children: BTreeMap<String, ChildInfo>,
    /// The answer being settled, and what the session ended with.
    #[serde(flatten)]
    pub ending: Ending,
    pub last_seq: u64,
    /// Time of the first and of the latest event (ms).
    pub started_at: u64,
    pub updated_at: u64,
    /// Events of kinds this build does not know, kept for display.
    pub unknown_events: u32,
    /// Questions and approvals: open, answered, and the children's that were passed on.
    #[serde(flatten)]
    pub pauses: Pauses,
    /// The plan this session owns, and the verdicts on patches to it.
    #[serde(flatten)]
    pub planning: Planning,
    /// Follow-up questions put to this session after it had answered (`chat: true`): its
    /// latest answer is to the last of them, not to the mission it was started with.
    pub follow_ups: u32,
    /// The reason the current turn's delegations were refused for the session's budget,
    /// once the first of those refusals is recorded: the rest of the turn is refused alike.
    pub turn_over_budget: Option<String>,
    /// A pattern's turn (handoff, route, advisors) and what it left.
    #[serde(flatten)]
    pub pattern: PatternState,
    /// This session's place in a team.
    #[serde(flatten)]
    pub team: TeamState,
    /// Where each call of `turn` sits, by call id: a lookup, not state.
    #[serde(skip)]
    slot_index: SlotIndex,
    /// How many calls of `turn` are in each state: a count kept beside it, not state.
    #[serde(skip)]
    slot_tally: SlotTally,
}

/// The answer a session is settling, and what it ended with.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Ending {
    /// The text of the last model answer that had no tool calls (the answer to settle).
    pub pending_answer: Option<String>,
    pub answer: Option<String>,
    pub error: Option<String>,
    /// The summary of a long final answer (the agent's `summarize` setting), and the
    /// answer it summarises.
    pub summary: Option<String>,
    pub full_answer: Option<String>,
}

/// Failed model calls and model turns that could not be read.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Failures {
    /// Failed model calls since the last successful one.
    pub model_failures: u32,
    pub last_model_error: Option<String>,
    /// The last model failure cannot succeed on a retry.
    pub model_failure_fatal: bool,
    /// Model turns in a row whose every tool call could not be read (arguments that are
    /// not JSON, or no readable call at all), and the reason of the last one.
    pub unreadable_turns: u32,
    pub last_unreadable: Option<String>,
}

/// What a session spent (its own model calls, its children's), and what it saved.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Accounting {
    pub usage_own: Usage,
    /// Usage rolled up from settled children.
    pub usage_children: Usage,
    /// What cache hits saved.
    pub saved: Usage,
    pub cache_hits: u32,
    /// Delegations decided so far (the `N` of the next child id is this + 1).
    pub delegations: u32,
    /// Per child, the usage already rolled up into `usage_children`: a child that settles
    /// again (after a follow-up question) reports its whole usage, of which only what is
    /// new is added.
    pub child_usage: BTreeMap<SessionId, Usage>,
    /// The answer goes on without some child's answer: a child failed or was cancelled
    /// (members a team's end cut off aside), or answered with a partial answer itself
    /// (`Completed::partial`). Such an answer is not cached.
    pub partial: bool,
}

/// Where a session waits for answers: its own questions and approvals, the tokens used,
/// and the references to its children's questions that its model was shown.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Pauses {
    pub pending_inputs: Vec<PendingInput>,
    pub pending_approvals: Vec<PendingApproval>,
    /// Token ids already answered (a token is good once).
    pub used_tokens: std::collections::BTreeSet<String>,
    /// Answers this session received (`InputProvided`): from a person, or from its parent
    /// resuming it. Its answer then depends on more than its mission.
    pub answers_received: u32,
    /// References to resume tokens of paused children, as this session's model was shown
    /// them: the runtime shows the model the tokens they stand for, and only these.
    pub resume_refs: std::collections::BTreeSet<String>,
}

/// The plan a session owns and what became of patches to it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Planning {
    /// The plan this session owns (empty unless it used `update_plan`).
    pub plan: crate::plan::Plan,
    /// Patches to this session's plan that were refused.
    pub patches_rejected: u32,
    /// Verdicts on sub-agents' proposals, by `from/call`: a proposal whose verdict is
    /// recorded is never merged twice.
    pub plan_verdicts: BTreeMap<String, Result<u64, crate::plan::Rejection>>,
}

/// A pattern's turn (a handoff, a route, the advisors) and what it left behind.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PatternState {
    /// The pattern whose calls make up the current turn, if the turn is a pattern's.
    #[serde(rename = "pattern")]
    pub kind: Option<PatternKind>,
    /// The pending answer is the end of a handoff already made: it is not handed on again.
    pub handed_off: bool,
    /// The agent whose answer is pending, when it is not this session's own (a handoff
    /// target's or a router's destination's).
    pub answer_from: Option<String>,
    /// What the advisors said, once they all have: it enters the first prompt.
    pub advice: Option<Advice>,
    /// A handoff or a route whose child failed: the session fails with this.
    #[serde(rename = "pattern_error")]
    pub error: Option<String>,
}

/// A session's part in a team: whether its team started, and the broadcasts it got.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TeamState {
    /// This session's `team` was started (it runs once).
    #[serde(rename = "team_ran")]
    pub ran: bool,
    /// Teammates' broadcasts received since the last model turn, and members that left.
    #[serde(rename = "team_unread")]
    pub unread: u32,
    #[serde(rename = "team_exits")]
    pub exits: u32,
    /// Broadcasts received, by sender and call: each is delivered once.
    #[serde(rename = "team_seen")]
    pub seen: std::collections::BTreeSet<String>,
    /// Broadcasts received mid-turn, read once the turn's results are in.
    #[serde(rename = "team_queue")]
    pub queue: Vec<String>,
}

/// The position in the turn of each call id (its first, should a log repeat one), so
/// that folding an event of a wide turn finds its slot without reading the whole turn.
/// Emptied whenever the turn is replaced, and filled again at the next lookup. Not part
/// of the state: two folds are equal whatever their indexes hold.
#[derive(Debug, Clone, Default)]
struct SlotIndex(std::collections::HashMap<String, usize>);

impl PartialEq for SlotIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// How many slots of the turn are in each state, so that folding an event of a wide turn
/// learns whether the session now waits (or whether the turn is over) without reading
/// the whole turn: a fan-out of 1,024 children read all 1,024 slots twice per child.
/// Kept up to date by the fold's own changes to a slot; counted again from the turn when
/// it is not known to fit it (a state built another way, a turn of another length). Not
/// part of the state: two folds are equal whatever their tallies hold.
#[derive(Debug, Clone, Default)]
pub(super) struct SlotTally {
    /// Whether the counts below are those of the turn (of `len` slots).
    known: bool,
    len: usize,
    /// Slots per [`SlotTally::kind`].
    by_kind: [usize; 5],
}

impl PartialEq for SlotTally {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl SlotTally {
    pub(super) const ASKED: usize = 0;
    pub(super) const APPROVAL: usize = 1;
    pub(super) const DELEGATED: usize = 2;
    pub(super) const DONE: usize = 3;
    /// Pending, running or approved: a call that still has work of its own to do.
    pub(super) const OTHER: usize = 4;

    pub(super) fn kind(s: &SlotState) -> usize {
        match s {
            SlotState::Asked { .. } => Self::ASKED,
            SlotState::AwaitingApproval { .. } => Self::APPROVAL,
            SlotState::Delegated { .. } => Self::DELEGATED,
            SlotState::Done { .. } => Self::DONE,
            SlotState::Pending | SlotState::Running | SlotState::Approved => Self::OTHER,
        }
    }

    pub(super) fn count(turn: &[Slot]) -> Self {
        let mut by_kind = [0; 5];
        for s in turn {
            by_kind[Self::kind(&s.state)] += 1;
        }
        Self {
            known: true,
            len: turn.len(),
            by_kind,
        }
    }

    pub(super) fn fits(&self, turn: &[Slot]) -> bool {
        self.known && self.len == turn.len()
    }

    pub(super) fn of(&self, kind: usize) -> usize {
        self.by_kind[kind]
    }

    /// One slot went from `from` to `to` (kinds).
    pub(super) fn moved(&mut self, from: usize, to: usize) {
        if self.known {
            self.by_kind[from] -= 1;
            self.by_kind[to] += 1;
        }
    }
}

/// What stands for the call of a patch carried by a child's final answer.
pub const RESULT_PATCH: &str = "result";

/// The key of a sub-agent's proposal in [`SessionState::plan_verdicts`].
pub fn verdict_key(from: &str, call: &str) -> String {
    format!("{from}/{call}")
}

impl Default for SessionState {
    fn default() -> Self {
        Self {
            id: None,
            submitted: None,
            status: Status::New,
            transcript: vec![],
            turn: vec![],
            steps: 0,
            failures: Failures::default(),
            accounting: Accounting::default(),
            children: BTreeMap::new(),
            ending: Ending::default(),
            last_seq: 0,
            started_at: 0,
            updated_at: 0,
            unknown_events: 0,
            pauses: Pauses::default(),
            planning: Planning::default(),
            follow_ups: 0,
            turn_over_budget: None,
            pattern: PatternState::default(),
            team: TeamState::default(),
            slot_index: SlotIndex::default(),
            slot_tally: SlotTally::default(),
        }
    }
}

impl SessionState {
    pub fn fold<'a>(events: impl IntoIterator<Item = &'a Envelope>) -> Self {
        let mut s = Self::default();
        for e in events {
            s.apply(e);
        }
        s
    }

    /// The record that ends this session with `answer`: its usage and steps, and whether
    /// the answer was made without some child's answer ([`Accounting::partial`]).
    pub fn completion(&self, answer: impl Into<String>) -> Event {
        Event::Completed(crate::event::Completed {
            answer: answer.into(),
            usage_total: self.usage_total(),
            steps: self.steps,
            partial: self.accounting.partial,
        })
    }

    /// Whether settling `call` with `outcome` leaves this session going on without a
    /// child's answer: the child failed or was cancelled, or its answer is partial itself.
    /// A team's members still running when its supervisor answered are cancelled then
    /// (their work was not waited for): their ends, whatever they are, take nothing from
    /// the answer.
    pub(crate) fn goes_on_without(&self, call: &str, outcome: &crate::event::Outcome) -> bool {
        use crate::event::Outcome;
        let team_over = self.pattern.kind == Some(PatternKind::Team)
            && self
                .turn
                .iter()
                .any(|s| s.call.name == SUPERVISOR && matches!(s.state, SlotState::Done { .. }));
        let cut_off = team_over
            && self
                .turn
                .iter()
                .any(|s| s.call.id == call && s.call.name == MEMBER);
        match outcome {
            _ if cut_off => false,
            Outcome::Completed { partial, .. } => *partial,
            Outcome::NeedsInput { .. } => false,
            Outcome::Failed { .. } => true,
        }
    }

    /// Usage of this session and everything it started.
    pub fn usage_total(&self) -> Usage {
        let mut u = self.accounting.usage_own;
        u.add(&self.accounting.usage_children);
        u
    }

    /// Tokens still free in this session's budget, after its own usage, its settled
    /// children and what outstanding children hold. None when unlimited.
    pub fn tokens_free(&self) -> Option<u64> {
        let budget = self.submitted.as_ref()?.budget.tokens?;
        let held: u64 = self
            .turn
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Delegated { allotted, .. } => *allotted,
                _ => None,
            })
            .sum();
        Some(
            budget
                .saturating_sub(self.usage_total().total_tokens())
                .saturating_sub(held),
        )
    }

    /// Agents on the path from the root to this session, root first.
    pub fn path_agents(&self) -> Vec<String> {
        let Some(sub) = &self.submitted else {
            return vec![];
        };
        let mut p = sub.ancestry.clone();
        p.push(sub.agent.clone());
        p
    }

    /// Whether a person answers this session's questions (the inbox lists them), rather
    /// than its parent's model: a root's, and those of a session that a pattern started in
    /// its parent's place (a handoff's target, a route's destination, a team's member or
    /// supervisor). Such a parent has no model turn to read a question in: it waits while
    /// the question waits, at any depth of the tree.
    pub fn asks_a_person(&self) -> bool {
        let Some(sub) = &self.submitted else {
            return self.id.as_ref().is_some_and(SessionId::is_root);
        };
        match &sub.parent {
            None => true,
            Some(p) => matches!(
                PatternKind::of_call(&p.call),
                Some(PatternKind::Handoff | PatternKind::Route | PatternKind::Team)
            ),
        }
    }

    /// Whether `body`, written by someone other than this session's own step (a person's
    /// answer, an approval, a cancel, a teammate's broadcast, a follow-up question), may
    /// still join its log; if not, why. Nothing joins a log after its terminal record but a
    /// follow-up question to a completed session, which reopens it.
    /// The pool whose workers run this session ([`Submitted::pool`]; the default pool
    /// before it is submitted).
    pub fn pool(&self) -> String {
        self.submitted.as_ref().map_or_else(
            || crate::event::DEFAULT_POOL.into(),
            crate::event::Submitted::pool,
        )
    }

    pub fn admits_from_outside(&self, body: &Event) -> Result<(), String> {
        if !self.status.is_terminal() {
            return Ok(());
        }
        if self.status == Status::Completed && matches!(body, Event::ClarificationRequested(_)) {
            return Ok(());
        }
        let id = self.id.as_ref().map(SessionId::display).unwrap_or_default();
        let why = self
            .ending
            .error
            .as_deref()
            .map(|e| format!(": {e}"))
            .unwrap_or_default();
        Err(format!(
            "session {id} has ended ({}{why}); nothing more is recorded in its log, and its \
             tokens no longer answer",
            self.status.as_str()
        ))
    }

    /// Children this session started that are still open although it has ended: a child
    /// whose question its parent's model left unanswered, or one still running when its
    /// parent failed or was cancelled. Nobody will read their outcome: they are to be
    /// cancelled. Runs shared with another tree and cache hits are not this session's.
    pub fn abandoned_children(&self) -> Vec<SessionId> {
        if !self.status.is_terminal() {
            return vec![];
        }
        let own = self.id.as_ref();
        self.children
            .values()
            .filter(|c| {
                !c.cached && !c.shared && matches!(c.outcome, None | Some(ChildOutcome::NeedsInput))
            })
            .filter(|c| own.is_some_and(|p| p.contains(&c.child) && *p != c.child))
            .map(|c| c.child.clone())
            // A child asked again is named by two calls: it is cancelled once.
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The children of the current turn that have not settled.
    pub fn outstanding_children(&self) -> Vec<(String, SessionId)> {
        self.turn
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Delegated { child, .. } => Some((s.call.id.clone(), child.clone())),
                _ => None,
            })
            .collect()
    }
}
