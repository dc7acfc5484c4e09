//! The fold: one event applied to a session's state.

use super::outcome::{usage_since, Answerer};
use super::*;

impl SessionState {
    fn slot_mut(&mut self, call: &str) -> Option<&mut Slot> {
        let i = self.slot_pos(call)?;
        self.turn.get_mut(i)
    }

    /// Where the first slot of `call` is in the turn. A wide turn (a fan-out of hundreds
    /// of children, each settling with an event of its own) is looked up through its
    /// index, so folding its events is not quadratic in its width.
    fn slot_pos(&mut self, call: &str) -> Option<usize> {
        const INDEXED_FROM: usize = 16;
        if self.turn.len() >= INDEXED_FROM {
            let index = &mut self.slot_index.0;
            if index.is_empty() {
                for (i, s) in self.turn.iter().enumerate() {
                    index.entry(s.call.id.clone()).or_insert(i);
                }
            }
            if let Some(&i) = index.get(call) {
                if self.turn.get(i).is_some_and(|s| s.call.id == call) {
                    return Some(i);
                }
            }
        }
        // A narrow turn, a call that is not in it, or an index that no longer fits (the
        // turn was replaced without `replace_turn`): read the turn through.
        let found = self.turn.iter().position(|s| s.call.id == call);
        if found.is_some() {
            self.slot_index.0.clear();
        }
        found
    }

    /// Makes `slots` the turn, and returns the turn it replaces.
    pub(super) fn replace_turn(&mut self, slots: Vec<Slot>) -> Vec<Slot> {
        self.slot_index.0.clear();
        self.slot_tally = SlotTally::count(&slots);
        std::mem::replace(&mut self.turn, slots)
    }

    /// The turn's tally, counted again if it is not known to fit the turn.
    fn tally(&mut self) -> &SlotTally {
        if !self.slot_tally.fits(&self.turn) {
            self.slot_tally = SlotTally::count(&self.turn);
        }
        &self.slot_tally
    }

    /// Puts the first slot of `call` in `state` (and counts it there); none if the call
    /// is not in the turn.
    pub(crate) fn set_slot(&mut self, call: &str, state: SlotState) {
        let Some(i) = self.slot_pos(call) else {
            return;
        };
        let to = SlotTally::kind(&state);
        let from = SlotTally::kind(&self.turn[i].state);
        self.turn[i].state = state;
        if self.slot_tally.fits(&self.turn) {
            self.slot_tally.moved(from, to);
        }
    }

    fn finish_slot(&mut self, call: &str, output: String, error: bool) {
        self.set_slot(call, SlotState::Done { output, error });
        self.close_turn_if_done();
    }

    /// When every call of the turn has its outcome, the results join the transcript in
    /// the model's order and the next model call may be made.
    fn close_turn_if_done(&mut self) {
        if self.turn.is_empty() || self.tally().of(SlotTally::DONE) != self.turn.len() {
            return;
        }
        self.turn_over_budget = None;
        if let Some(kind) = self.pattern.kind.take() {
            let slots = self.replace_turn(vec![]);
            self.close_pattern(kind, slots);
            return;
        }
        for slot in self.replace_turn(vec![]) {
            if let SlotState::Done { output, error } = slot.state {
                self.transcript.push(Message::Tool {
                    call_id: slot.call.id,
                    name: slot.call.name,
                    content: output,
                    is_error: error,
                });
            }
        }
        for content in std::mem::take(&mut self.team.queue) {
            self.transcript.push(Message::User { content });
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
            Event::ModelCalled(m)
                if self.ending.pending_answer.is_some() && self.ending.summary.is_none() =>
            {
                self.steps += 1;
                self.failures.model_failures = 0;
                self.accounting.usage_own.add(&m.usage);
                self.ending.full_answer = self.ending.pending_answer.clone();
                self.ending.summary = Some(m.response.content.clone().unwrap_or_default());
            }
            Event::ModelCalled(m) => {
                self.steps += 1;
                self.team.unread = 0;
                self.failures.model_failures = 0;
                self.failures.last_model_error = None;
                self.failures.model_failure_fatal = false;
                self.accounting.usage_own.add(&m.usage);
                let unreadable: Vec<&str> = m
                    .response
                    .tool_calls
                    .iter()
                    .filter_map(|c| c.args.get("_error").and_then(serde_json::Value::as_str))
                    .collect();
                if !m.response.tool_calls.is_empty()
                    && unreadable.len() == m.response.tool_calls.len()
                {
                    self.failures.unreadable_turns += 1;
                    self.failures.last_unreadable = unreadable.last().map(|e| e.to_string());
                } else {
                    self.failures.unreadable_turns = 0;
                    self.failures.last_unreadable = None;
                }
                self.transcript.push(Message::Assistant {
                    content: m.response.content.clone(),
                    tool_calls: m.response.tool_calls.clone(),
                });
                if m.response.tool_calls.is_empty() {
                    self.ending.pending_answer =
                        Some(m.response.content.clone().unwrap_or_default());
                } else {
                    self.replace_turn(
                        m.response
                            .tool_calls
                            .iter()
                            .map(|c| Slot {
                                call: c.clone(),
                                state: SlotState::Pending,
                            })
                            .collect(),
                    );
                }
            }
            Event::ModelFailed(f) => {
                self.failures.model_failures += 1;
                self.failures.last_model_error = Some(f.error.clone());
                self.failures.model_failure_fatal = !f.retryable;
            }
            Event::ToolCalled(t) => self.set_slot(&t.call, SlotState::Running),
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
                if d.kind != DelegationKind::Resumed {
                    self.accounting.delegations += 1;
                }
                if !d.owns_tasks.is_empty() {
                    self.planning
                        .plan
                        .grant(&d.owns_tasks, &d.agent, &d.child.to_string());
                }
                self.set_slot(
                    &d.call,
                    SlotState::Delegated {
                        child: d.child.clone(),
                        allotted: d.allotted_tokens,
                        shared: d.kind == DelegationKind::Shared,
                    },
                );
                // A child asked again keeps the turns it had made (looked up only then: a
                // wide fan-out's new children would make the lookup quadratic).
                let steps = if d.kind == DelegationKind::Resumed {
                    self.children
                        .values()
                        .filter(|c| c.child == d.child)
                        .map(|c| c.steps)
                        .max()
                        .unwrap_or(0)
                } else {
                    0
                };
                self.children.insert(
                    d.call.clone(),
                    ChildInfo {
                        call: d.call.clone(),
                        child: d.child.clone(),
                        agent: d.agent.clone(),
                        mission_hash: d.mission_hash.clone(),
                        outcome: None,
                        cached: false,
                        shared: d.kind == DelegationKind::Shared,
                        steps,
                        max_steps: d.max_steps,
                        number: self.accounting.delegations,
                    },
                );
            }
            // A root answered from the cache (no call: nothing delegated). The answer is
            // the cached run's whole answer, its own handoff already made: it is neither
            // handed on again nor summarised a second time.
            Event::CacheHit(h) if h.call.is_empty() => {
                self.accounting.cache_hits += 1;
                self.accounting.saved.add(&h.saved);
                self.ending.pending_answer = Some(h.answer.clone());
                self.ending.summary = Some(h.answer.clone());
                self.pattern.handed_off = true;
            }
            Event::CacheHit(h) => {
                self.accounting.delegations += 1;
                self.accounting.cache_hits += 1;
                self.accounting.saved.add(&h.saved);
                let outcome = Outcome::Completed {
                    answer: h.answer.clone(),
                    patch: None,
                    usage: Usage::default(),
                    steps: h.steps,
                    partial: false,
                };
                let agent = self
                    .slot_mut(&h.call)
                    .and_then(|s| {
                        let a = &s.call.args;
                        ["agent", "agent_name", "skill_name", "specialist"]
                            .iter()
                            .find_map(|k| a.get(*k).and_then(Value::as_str))
                    })
                    .unwrap_or("custom")
                    .to_string();
                let (output, error) = if self.pattern.kind.is_some() {
                    (h.answer.clone(), false)
                } else {
                    let by = Answerer {
                        agent: &agent,
                        depth: self.child_depth(),
                    };
                    call_agent_result(&h.source, &outcome, true, by)
                };
                self.children.insert(
                    h.call.clone(),
                    ChildInfo {
                        call: h.call.clone(),
                        child: h.source.clone(),
                        agent,
                        mission_hash: h.mission_hash.clone(),
                        outcome: Some(ChildOutcome::Completed),
                        cached: true,
                        shared: false,
                        steps: h.steps,
                        max_steps: None,
                        number: self.accounting.delegations,
                    },
                );
                self.finish_slot(&h.call, output, error);
            }
            Event::ChildSettled(c) => {
                let delegated = |s: &Slot| match &s.state {
                    SlotState::Delegated { child, shared, .. }
                        if s.call.id == c.call && *child == c.child =>
                    {
                        Some(*shared)
                    }
                    _ => None,
                };
                // The call's slot, or (a log that repeats a call id) a later one of it.
                let slot = self
                    .slot_pos(&c.call)
                    .and_then(|i| delegated(&self.turn[i]))
                    .or_else(|| self.turn.iter().find_map(delegated));
                let Some(shared) = slot else { return };
                if self.goes_on_without(&c.call, &c.outcome) {
                    self.accounting.partial = true;
                }
                match &c.outcome {
                    // A shared run was paid for by whoever started it: what it cost is
                    // what this call saved.
                    Outcome::Completed { usage, .. } | Outcome::Failed { usage, .. } if shared => {
                        self.accounting.saved.add(usage)
                    }
                    Outcome::Completed { usage, .. } | Outcome::Failed { usage, .. } => {
                        let counted = self
                            .accounting
                            .child_usage
                            .entry(c.child.clone())
                            .or_default();
                        let new = usage_since(usage, counted);
                        *counted = *usage;
                        self.accounting.usage_children.add(&new)
                    }
                    Outcome::NeedsInput {
                        token_id, usage, ..
                    } => {
                        if !token_id.is_empty() {
                            self.pauses
                                .resume_refs
                                .insert(resume_reference(&c.child, &c.outcome));
                        }
                        // What it spent before it paused counts now (a question nobody
                        // answers must not hide it); what it spends after, at its end.
                        if !shared {
                            let counted = self
                                .accounting
                                .child_usage
                                .entry(c.child.clone())
                                .or_default();
                            let new = usage_since(usage, counted);
                            if usage.total_tokens() >= counted.total_tokens() {
                                *counted = *usage;
                            }
                            self.accounting.usage_children.add(&new)
                        }
                    }
                }
                let mut follow_up = None;
                if let Some(info) = self.children.get_mut(&c.call) {
                    info.outcome = Some(ChildOutcome::of(&c.outcome));
                    if let Outcome::Completed { steps, .. } | Outcome::Failed { steps, .. } =
                        &c.outcome
                    {
                        info.steps = *steps;
                    }
                    follow_up = info.max_steps.map(|m| m.saturating_sub(info.steps));
                }
                let agent = self
                    .children
                    .get(&c.call)
                    .map(|i| i.agent.clone())
                    .unwrap_or_default();
                let by = Answerer {
                    agent: &agent,
                    depth: self.child_depth(),
                };
                let (output, error) = match (self.pattern.kind, &c.outcome) {
                    (None, _) => {
                        let (out, error) = call_agent_result(&c.child, &c.outcome, false, by);
                        match follow_up {
                            // The answer to a follow-up question (reference 001's reply).
                            Some(left) => {
                                let mut v: Value =
                                    serde_json::from_str(&out).unwrap_or(Value::Null);
                                v["clarification_id"] = Value::String(c.call.clone());
                                v["turns_remaining"] = Value::from(left);
                                (v.to_string(), error)
                            }
                            None => (out, error),
                        }
                    }
                    (Some(_), Outcome::Completed { answer, .. }) => (answer.clone(), false),
                    (Some(_), Outcome::Failed { error, .. }) => (error.clone(), true),
                    (Some(PatternKind::Advisors), Outcome::NeedsInput { questions, .. }) => (
                        format!(
                            "it stopped to ask questions, which an advisor cannot: {questions}"
                        ),
                        true,
                    ),
                    // A handoff target or a route's destination that asks a question waits
                    // for its answer (the question is in the tree's inbox); this session
                    // waits with it.
                    (Some(_), Outcome::NeedsInput { .. }) => return self.refresh_waiting(),
                };
                self.finish_slot(&c.call, output, error);
            }
            Event::InputRequested(q) => {
                let call = q.call.clone().unwrap_or_default();
                self.set_slot(
                    &call,
                    SlotState::Asked {
                        token_id: q.token_id.clone(),
                    },
                );
                self.pauses.pending_inputs.push(PendingInput {
                    call,
                    seq: env.seq,
                    token_id: q.token_id.clone(),
                    questions: q.questions.clone(),
                    context: q.context.clone(),
                    defaults: q.defaults.clone(),
                });
            }
            Event::InputProvided(a) => {
                self.pauses.answers_received += 1;
                self.pauses.used_tokens.insert(a.token_id.clone());
                if let Some(i) = self
                    .pauses
                    .pending_inputs
                    .iter()
                    .position(|p| p.token_id == a.token_id)
                {
                    let p = self.pauses.pending_inputs.remove(i);
                    let output = serde_json::json!({"answers": a.answers}).to_string();
                    self.finish_slot(&p.call, output, false);
                }
            }
            Event::ApprovalRequested(r) => {
                self.set_slot(
                    &r.call,
                    SlotState::AwaitingApproval {
                        token_id: r.token_id.clone(),
                    },
                );
                self.pauses.pending_approvals.push(PendingApproval {
                    call: r.call.clone(),
                    seq: env.seq,
                    token_id: r.token_id.clone(),
                    tool: r.tool.clone(),
                    preview: r.preview.clone(),
                });
            }
            Event::ApprovalGiven(g) => {
                self.pauses.used_tokens.insert(g.token_id.clone());
                if let Some(i) = self
                    .pauses
                    .pending_approvals
                    .iter()
                    .position(|p| p.token_id == g.token_id)
                {
                    let p = self.pauses.pending_approvals.remove(i);
                    if g.approved {
                        self.set_slot(&p.call, SlotState::Approved);
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
                self.planning.plan.apply_accepted(
                    crate::plan::Author::of(&p.from, &p.agent),
                    &p.ops,
                    p.version,
                );
                match (p.from.as_str(), &p.call) {
                    (crate::plan::SELF, Some(call)) => {
                        let (mut j, error) = crate::plan::verdict_json(&Ok(p.version));
                        j["plan"] = Value::String(self.planning.plan.render_markdown());
                        self.finish_slot(call, j.to_string(), error);
                    }
                    (from, call) => {
                        let call = call.as_deref().unwrap_or(RESULT_PATCH);
                        self.planning
                            .plan_verdicts
                            .insert(verdict_key(from, call), Ok(p.version));
                    }
                }
            }
            Event::PatchRejected(p) => {
                self.planning.patches_rejected += 1;
                match (p.from.as_str(), &p.call) {
                    (crate::plan::SELF, Some(call)) => {
                        let (j, error) = crate::plan::verdict_json(&Err(p.reason.clone()));
                        self.finish_slot(call, j.to_string(), error);
                    }
                    (from, call) => {
                        let call = call.as_deref().unwrap_or(RESULT_PATCH);
                        self.planning
                            .plan_verdicts
                            .insert(verdict_key(from, call), Err(p.reason.clone()));
                    }
                }
            }
            Event::ClarificationRequested(c) => {
                self.follow_ups += 1;
                // A finished session is asked again: it reopens with the question.
                if self.status == Status::Completed {
                    self.status = Status::Running;
                    self.pattern.handed_off = false;
                    self.pattern.answer_from = None;
                    self.ending.answer = None;
                    self.ending.pending_answer = None;
                    self.ending.summary = None;
                    self.ending.full_answer = None;
                }
                self.transcript.push(Message::User {
                    content: format!(
                        "## CLARIFICATION REQUEST FROM {}\n\n{}",
                        c.from.display(),
                        c.question
                    ),
                });
            }
            Event::HandedOff(h) => {
                self.open_pattern(PatternKind::Handoff, std::slice::from_ref(&h.next))
            }
            Event::Routed(r) => {
                // The model's `handoff_to` call is answered, its turn closes, and the
                // destination's call opens the next.
                let output = format!("handed to `{}`", r.next.agent);
                self.finish_slot(&r.call, output, false);
                self.open_pattern(PatternKind::Route, std::slice::from_ref(&r.next));
            }
            Event::AdvisorsConsulted(a) => self.open_pattern(PatternKind::Advisors, &a.advisors),
            Event::TeamStarted(t) => {
                let mut calls = t.members.clone();
                calls.push(t.supervisor.clone());
                self.open_pattern(PatternKind::Team, &calls)
            }
            Event::TeamBroadcast(b) => self.hear(b),
            Event::Completed(c) => {
                self.status = Status::Completed;
                self.ending.answer = Some(c.answer.clone());
                self.ending.pending_answer = None;
            }
            Event::Failed(f) => {
                self.status = Status::Failed;
                self.ending.error = Some(f.error.clone());
            }
            Event::Cancelled(c) => {
                self.status = Status::Cancelled;
                self.ending.error = Some(c.reason.clone());
            }
            Event::Unknown { .. } => self.unknown_events += 1,
        }
        self.refresh_waiting();
    }

    /// The depth a `call_agent` child of this session runs at.
    fn child_depth(&self) -> u32 {
        self.submitted
            .as_ref()
            .map_or(1, |s| s.depth.saturating_add(1))
    }

    fn refresh_waiting(&mut self) {
        if self.status.is_terminal() || self.status == Status::New {
            return;
        }
        // From the turn's tally: no pass over the turn, however wide.
        let t = self.tally();
        let asked = t.of(SlotTally::ASKED) > 0;
        let approval = t.of(SlotTally::APPROVAL) > 0;
        let delegated = t.of(SlotTally::DELEGATED) > 0;
        let only_delegated_or_done = t.of(SlotTally::OTHER) == 0;
        self.status = if self.team_gated() {
            Status::Waiting
        } else if asked {
            Status::AwaitingInput
        } else if approval {
            Status::AwaitingApproval
        } else if delegated && only_delegated_or_done {
            Status::Waiting
        } else {
            Status::Running
        };
    }
}
