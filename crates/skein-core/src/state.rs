//! `SessionState`: a session's state as a fold over its log.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

use crate::event::{Envelope, Event, Outcome, Refused, Submitted};
use crate::id::SessionId;
use crate::message::{Message, ToolCall, Usage};
use crate::runtime_tool::RuntimeTool;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

/// A child this session started, and how it ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChildInfo {
    pub call: String,
    pub child: SessionId,
    pub agent: String,
    pub mission_hash: String,
    /// None while it runs.
    pub outcome: Option<&'static str>,
    pub cached: bool,
    /// Answered by an identical run someone else started (single-flight).
    pub shared: bool,
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
    /// The text of the last model answer that had no tool calls (the answer to settle).
    pub pending_answer: Option<String>,
    /// Model turns recorded.
    pub steps: u32,
    /// Failed model calls since the last successful one.
    pub model_failures: u32,
    pub last_model_error: Option<String>,
    /// The last model failure cannot succeed on a retry.
    pub model_failure_fatal: bool,
    /// Model turns in a row whose every tool call could not be read (arguments that are
    /// not JSON, or no readable call at all), and the reason of the last one.
    pub unreadable_turns: u32,
    pub last_unreadable: Option<String>,
    pub usage_own: Usage,
    /// Usage rolled up from settled children.
    pub usage_children: Usage,
    /// What cache hits saved.
    pub saved: Usage,
    pub cache_hits: u32,
    /// Delegations decided so far (the `N` of the next child id is this + 1).
    pub delegations: u32,
    pub children: BTreeMap<String, ChildInfo>,
    pub answer: Option<String>,
    pub error: Option<String>,
    pub last_seq: u64,
    /// Time of the first and of the latest event (ms).
    pub started_at: u64,
    pub updated_at: u64,
    /// Events of kinds this build does not know, kept for display.
    pub unknown_events: u32,
    /// The summary of a long final answer (the agent's `summarize` setting), and the
    /// answer it summarises.
    pub summary: Option<String>,
    pub full_answer: Option<String>,
    pub pending_inputs: Vec<PendingInput>,
    pub pending_approvals: Vec<PendingApproval>,
    /// Token ids already answered (a token is good once).
    pub used_tokens: std::collections::BTreeSet<String>,
    /// The plan this session owns (empty unless it used `update_plan`).
    pub plan: crate::plan::Plan,
    /// Patches to this session's plan that were refused.
    pub patches_rejected: u32,
    /// Verdicts on sub-agents' proposals, by `from/call`: a proposal whose verdict is
    /// recorded is never merged twice.
    pub plan_verdicts: BTreeMap<String, Result<u64, crate::plan::Rejection>>,
    /// Follow-up questions put to this session after it had answered (`chat: true`): its
    /// latest answer is to the last of them, not to the mission it was started with.
    pub follow_ups: u32,
    /// Per child, the usage already rolled up into `usage_children`: a child that settles
    /// again (after a follow-up question) reports its whole usage, of which only what is
    /// new is added.
    pub child_usage: BTreeMap<SessionId, Usage>,
    /// References to resume tokens of paused children, as this session's model was shown
    /// them: the runtime shows the model the tokens they stand for, and only these.
    pub resume_refs: std::collections::BTreeSet<String>,
    /// The reason the current turn's delegations were refused for the session's budget,
    /// once the first of those refusals is recorded: the rest of the turn is refused alike.
    pub turn_over_budget: Option<String>,
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
            pending_answer: None,
            steps: 0,
            model_failures: 0,
            last_model_error: None,
            model_failure_fatal: false,
            unreadable_turns: 0,
            last_unreadable: None,
            usage_own: Usage::default(),
            usage_children: Usage::default(),
            saved: Usage::default(),
            cache_hits: 0,
            delegations: 0,
            children: BTreeMap::new(),
            answer: None,
            error: None,
            last_seq: 0,
            started_at: 0,
            updated_at: 0,
            unknown_events: 0,
            summary: None,
            full_answer: None,
            pending_inputs: vec![],
            pending_approvals: vec![],
            used_tokens: Default::default(),
            plan: Default::default(),
            patches_rejected: 0,
            plan_verdicts: Default::default(),
            follow_ups: 0,
            child_usage: BTreeMap::new(),
            resume_refs: Default::default(),
            turn_over_budget: None,
        }
    }
}

/// What `now` adds to `before` (a child's cumulative usage at two settlements).
fn usage_since(now: &Usage, before: &Usage) -> Usage {
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

impl SessionState {
    pub fn fold<'a>(events: impl IntoIterator<Item = &'a Envelope>) -> Self {
        let mut s = Self::default();
        for e in events {
            s.apply(e);
        }
        s
    }

    /// Usage of this session and everything it started.
    pub fn usage_total(&self) -> Usage {
        let mut u = self.usage_own;
        u.add(&self.usage_children);
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

    fn slot_mut(&mut self, call: &str) -> Option<&mut Slot> {
        self.turn.iter_mut().find(|s| s.call.id == call)
    }

    fn finish_slot(&mut self, call: &str, output: String, error: bool) {
        if let Some(slot) = self.slot_mut(call) {
            slot.state = SlotState::Done { output, error };
        }
        self.close_turn_if_done();
    }

    /// When every call of the turn has its outcome, the results join the transcript in
    /// the model's order and the next model call may be made.
    fn close_turn_if_done(&mut self) {
        if self.turn.is_empty()
            || !self
                .turn
                .iter()
                .all(|s| matches!(s.state, SlotState::Done { .. }))
        {
            return;
        }
        self.turn_over_budget = None;
        for slot in std::mem::take(&mut self.turn) {
            if let SlotState::Done { output, error } = slot.state {
                self.transcript.push(Message::Tool {
                    call_id: slot.call.id,
                    name: slot.call.name,
                    content: output,
                    is_error: error,
                });
            }
        }
    }

    /// Folds one event. Total: a valid log never makes it fail, and an event that does
    /// not fit (unknown kind, a call id not in the turn) changes nothing but the counters.
    pub fn apply(&mut self, env: &Envelope) {
        self.last_seq = env.seq;
        if self.started_at == 0 {
            self.started_at = env.at;
        }
        self.updated_at = env.at;
        match &env.body {
            Event::Submitted(s) => {
                self.id = Some(env.session.clone());
                self.submitted = Some(s.clone());
                self.status = Status::Running;
            }
            // A model call after the final answer is its summary.
            Event::ModelCalled(m) if self.pending_answer.is_some() && self.summary.is_none() => {
                self.steps += 1;
                self.model_failures = 0;
                self.usage_own.add(&m.usage);
                self.full_answer = self.pending_answer.clone();
                self.summary = Some(m.response.content.clone().unwrap_or_default());
            }
            Event::ModelCalled(m) => {
                self.steps += 1;
                self.model_failures = 0;
                self.last_model_error = None;
                self.model_failure_fatal = false;
                self.usage_own.add(&m.usage);
                let unreadable: Vec<&str> = m
                    .response
                    .tool_calls
                    .iter()
                    .filter_map(|c| c.args.get("_error").and_then(serde_json::Value::as_str))
                    .collect();
                if !m.response.tool_calls.is_empty()
                    && unreadable.len() == m.response.tool_calls.len()
                {
                    self.unreadable_turns += 1;
                    self.last_unreadable = unreadable.last().map(|e| e.to_string());
                } else {
                    self.unreadable_turns = 0;
                    self.last_unreadable = None;
                }
                self.transcript.push(Message::Assistant {
                    content: m.response.content.clone(),
                    tool_calls: m.response.tool_calls.clone(),
                });
                if m.response.tool_calls.is_empty() {
                    self.pending_answer = Some(m.response.content.clone().unwrap_or_default());
                } else {
                    self.turn = m
                        .response
                        .tool_calls
                        .iter()
                        .map(|c| Slot {
                            call: c.clone(),
                            state: SlotState::Pending,
                        })
                        .collect();
                }
            }
            Event::ModelFailed(f) => {
                self.model_failures += 1;
                self.last_model_error = Some(f.error.clone());
                self.model_failure_fatal = !f.retryable;
            }
            Event::ToolCalled(t) => {
                if let Some(slot) = self.slot_mut(&t.call) {
                    slot.state = SlotState::Running;
                }
            }
            Event::ToolReturned(t) => {
                let of_delegation = self
                    .slot_mut(&t.call)
                    .is_some_and(|s| RuntimeTool::CallAgent.is(&s.call.name));
                if of_delegation && t.refusal_kind() == Some(Refused::TurnOverBudget) {
                    self.turn_over_budget = Some(t.output.clone());
                }
                self.finish_slot(&t.call, t.output.clone(), t.error)
            }
            Event::Delegated(d) => {
                if !d.resumed {
                    self.delegations += 1;
                }
                if !d.owns_tasks.is_empty() {
                    self.plan
                        .grant(&d.owns_tasks, &d.agent, &d.child.to_string());
                }
                if let Some(slot) = self.slot_mut(&d.call) {
                    slot.state = SlotState::Delegated {
                        child: d.child.clone(),
                        allotted: d.allotted_tokens,
                        shared: d.shared,
                    };
                }
                self.children.insert(
                    d.call.clone(),
                    ChildInfo {
                        call: d.call.clone(),
                        child: d.child.clone(),
                        agent: d.agent.clone(),
                        mission_hash: d.mission_hash.clone(),
                        outcome: None,
                        cached: false,
                        shared: d.shared,
                    },
                );
            }
            // A root answered from the cache (no call: nothing delegated).
            Event::CacheHit(h) if h.call.is_empty() => {
                self.cache_hits += 1;
                self.saved.add(&h.saved);
                self.pending_answer = Some(h.answer.clone());
                self.summary = Some(h.answer.clone());
            }
            Event::CacheHit(h) => {
                self.delegations += 1;
                self.cache_hits += 1;
                self.saved.add(&h.saved);
                let outcome = Outcome::Completed {
                    answer: h.answer.clone(),
                    patch: None,
                    usage: Usage::default(),
                    steps: h.steps,
                };
                let (output, error) = call_agent_result(&h.source, &outcome, true);
                let agent = self
                    .slot_mut(&h.call)
                    .and_then(|s| s.call.args.get("agent").and_then(Value::as_str))
                    .unwrap_or("custom")
                    .to_string();
                self.children.insert(
                    h.call.clone(),
                    ChildInfo {
                        call: h.call.clone(),
                        child: h.source.clone(),
                        agent,
                        mission_hash: h.mission_hash.clone(),
                        outcome: Some("completed"),
                        cached: true,
                        shared: false,
                    },
                );
                self.finish_slot(&h.call, output, error);
            }
            Event::ChildSettled(c) => {
                let slot = self.turn.iter().find_map(|s| match &s.state {
                    SlotState::Delegated { child, shared, .. }
                        if s.call.id == c.call && *child == c.child =>
                    {
                        Some(*shared)
                    }
                    _ => None,
                });
                let Some(shared) = slot else { return };
                match &c.outcome {
                    // A shared run was paid for by whoever started it: what it cost is
                    // what this call saved.
                    Outcome::Completed { usage, .. } | Outcome::Failed { usage, .. } if shared => {
                        self.saved.add(usage)
                    }
                    Outcome::Completed { usage, .. } | Outcome::Failed { usage, .. } => {
                        let counted = self.child_usage.entry(c.child.clone()).or_default();
                        let new = usage_since(usage, counted);
                        *counted = *usage;
                        self.usage_children.add(&new)
                    }
                    Outcome::NeedsInput { token_id, .. } => {
                        if !token_id.is_empty() {
                            self.resume_refs
                                .insert(resume_reference(&c.child, &c.outcome));
                        }
                    }
                }
                if let Some(info) = self.children.get_mut(&c.call) {
                    info.outcome = Some(match &c.outcome {
                        Outcome::Completed { .. } => "completed",
                        Outcome::Failed { .. } => "failed",
                        Outcome::NeedsInput { .. } => "needs_input",
                    });
                }
                let (output, error) = call_agent_result(&c.child, &c.outcome, false);
                self.finish_slot(&c.call, output, error);
            }
            Event::InputRequested(q) => {
                let call = q.call.clone().unwrap_or_default();
                if let Some(slot) = self.slot_mut(&call) {
                    slot.state = SlotState::Asked {
                        token_id: q.token_id.clone(),
                    };
                }
                self.pending_inputs.push(PendingInput {
                    call,
                    seq: env.seq,
                    token_id: q.token_id.clone(),
                    questions: q.questions.clone(),
                    context: q.context.clone(),
                    defaults: q.defaults.clone(),
                });
            }
            Event::InputProvided(a) => {
                self.used_tokens.insert(a.token_id.clone());
                if let Some(i) = self
                    .pending_inputs
                    .iter()
                    .position(|p| p.token_id == a.token_id)
                {
                    let p = self.pending_inputs.remove(i);
                    let output = serde_json::json!({"answers": a.answers}).to_string();
                    self.finish_slot(&p.call, output, false);
                }
            }
            Event::ApprovalRequested(r) => {
                if let Some(slot) = self.slot_mut(&r.call) {
                    slot.state = SlotState::AwaitingApproval {
                        token_id: r.token_id.clone(),
                    };
                }
                self.pending_approvals.push(PendingApproval {
                    call: r.call.clone(),
                    seq: env.seq,
                    token_id: r.token_id.clone(),
                    tool: r.tool.clone(),
                    preview: r.preview.clone(),
                });
            }
            Event::ApprovalGiven(g) => {
                self.used_tokens.insert(g.token_id.clone());
                if let Some(i) = self
                    .pending_approvals
                    .iter()
                    .position(|p| p.token_id == g.token_id)
                {
                    let p = self.pending_approvals.remove(i);
                    if g.approved {
                        if let Some(slot) = self.slot_mut(&p.call) {
                            slot.state = SlotState::Approved;
                        }
                    } else {
                        let who = g.by.as_deref().unwrap_or("a person");
                        let why = g
                            .reason
                            .as_deref()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default();
                        let output =
                            format!("`{}` was denied by {who}{why}; it did not run", p.tool);
                        self.finish_slot(&p.call, output, true);
                    }
                }
            }
            Event::PatchApplied(p) => {
                self.plan.apply_accepted(
                    crate::plan::Author::of(&p.from, &p.agent),
                    &p.ops,
                    p.version,
                );
                match (p.from.as_str(), &p.call) {
                    (crate::plan::SELF, Some(call)) => {
                        let (mut j, error) = crate::plan::verdict_json(&Ok(p.version));
                        j["plan"] = Value::String(self.plan.render_markdown());
                        self.finish_slot(call, j.to_string(), error);
                    }
                    (from, call) => {
                        let call = call.as_deref().unwrap_or(RESULT_PATCH);
                        self.plan_verdicts
                            .insert(verdict_key(from, call), Ok(p.version));
                    }
                }
            }
            Event::PatchRejected(p) => {
                self.patches_rejected += 1;
                match (p.from.as_str(), &p.call) {
                    (crate::plan::SELF, Some(call)) => {
                        let (j, error) = crate::plan::verdict_json(&Err(p.reason.clone()));
                        self.finish_slot(call, j.to_string(), error);
                    }
                    (from, call) => {
                        let call = call.as_deref().unwrap_or(RESULT_PATCH);
                        self.plan_verdicts
                            .insert(verdict_key(from, call), Err(p.reason.clone()));
                    }
                }
            }
            Event::ClarificationRequested(c) => {
                self.follow_ups += 1;
                // A finished session is asked again: it reopens with the question.
                if self.status == Status::Completed {
                    self.status = Status::Running;
                    self.answer = None;
                    self.pending_answer = None;
                    self.summary = None;
                    self.full_answer = None;
                }
                self.transcript.push(Message::User {
                    content: format!(
                        "## CLARIFICATION REQUEST FROM {}\n\n{}",
                        c.from.display(),
                        c.question
                    ),
                });
            }
            Event::Completed(c) => {
                self.status = Status::Completed;
                self.answer = Some(c.answer.clone());
                self.pending_answer = None;
            }
            Event::Failed(f) => {
                self.status = Status::Failed;
                self.error = Some(f.error.clone());
            }
            Event::Cancelled(c) => {
                self.status = Status::Cancelled;
                self.error = Some(c.reason.clone());
            }
            Event::Unknown { .. } => self.unknown_events += 1,
        }
        self.refresh_waiting();
    }

    fn refresh_waiting(&mut self) {
        if self.status.is_terminal() || self.status == Status::New {
            return;
        }
        let any = |f: fn(&SlotState) -> bool| self.turn.iter().any(|s| f(&s.state));
        self.status = if any(|s| matches!(s, SlotState::Asked { .. })) {
            Status::AwaitingInput
        } else if any(|s| matches!(s, SlotState::AwaitingApproval { .. })) {
            Status::AwaitingApproval
        } else if any(|s| matches!(s, SlotState::Delegated { .. }))
            && self.turn.iter().all(|s| {
                matches!(
                    s.state,
                    SlotState::Delegated { .. } | SlotState::Done { .. }
                )
            })
        {
            Status::Waiting
        } else {
            Status::Running
        };
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
