//! One model turn's tool calls, classified: the owner's plan edits first, then every call
//! sorted into what happens to it (refused, delegated, run, asked of a person, approved
//! first, a follow-up to a child, a patch proposed), then one step chosen in a fixed order.

use std::collections::BTreeSet;

use serde_json::Value;

use super::{
    join, ApprovalAsk, Ask, Catalog, Clarify, Delegation, PlanEdit, Proposal, Refusal, Step,
    ToolRun,
};
use crate::agent::AgentDef;
use crate::event::Refused;
use crate::id::SessionId;
use crate::limits::Limits;
use crate::message::ToolCall;
use crate::runtime_tool::RuntimeTool;
use crate::state::{ChildOutcome, SessionState, SlotState};

/// The context every check of a turn reads, and the counters its delegations advance.
pub(super) struct Turn<'a> {
    pub(super) state: &'a SessionState,
    pub(super) def: &'a AgentDef,
    pub(super) limits: &'a Limits,
    pub(super) catalog: &'a dyn Catalog,
    allowed: BTreeSet<String>,
    /// Calls past this many in the turn are refused.
    max_calls: usize,
    /// The session's depth, and the agents on its delegation path.
    pub(super) depth: u32,
    pub(super) path: Vec<String>,
    pub(super) max_children: u32,
    /// Children of this turn started, or decided so far.
    pub(super) children: u32,
    /// Delegations of the session decided so far: the next child's number is this + 1.
    pub(super) delegations: u32,
}

/// The calls of a turn by what happens to them.
#[derive(Default)]
struct Sorted {
    refusals: Vec<Refusal>,
    delegations: Vec<Delegation>,
    runs: Vec<ToolRun>,
    resumed: Vec<ToolRun>,
    asks: Vec<Ask>,
    approvals: Vec<ApprovalAsk>,
    clarifications: Vec<Clarify>,
    proposals: Vec<Proposal>,
    routes: Vec<crate::event::Routed>,
    broadcasts: Vec<super::Broadcast>,
}

fn refusal(call: &ToolCall, error: String) -> Refusal {
    Refusal {
        call: call.id.clone(),
        tool: call.name.clone(),
        error,
        kind: None,
    }
}

fn run_of(call: &ToolCall, resumed: bool) -> ToolRun {
    ToolRun {
        call: call.id.clone(),
        tool: call.name.clone(),
        args: call.args.clone(),
        resumed,
    }
}

impl SessionState {
    pub(super) fn next_in_turn(
        &self,
        def: &AgentDef,
        limits: &Limits,
        catalog: &dyn Catalog,
    ) -> Step {
        let mut turn = Turn::new(self, def, limits, catalog);
        if let Some(kind) = self.pattern.kind {
            return turn.pattern_step(kind);
        }
        if let Some(step) = turn.plan_edit() {
            return step;
        }
        let sorted = turn.sort();
        turn.choose(sorted)
    }
}

impl<'a> Turn<'a> {
    fn new(
        state: &'a SessionState,
        def: &'a AgentDef,
        limits: &'a Limits,
        catalog: &'a dyn Catalog,
    ) -> Self {
        let front = &def.front.limits;
        let children = state
            .turn
            .iter()
            .filter(|s| {
                RuntimeTool::CallAgent.is(&s.call.name)
                    && match &s.state {
                        SlotState::Delegated { .. } => true,
                        SlotState::Done { error, .. } => !error,
                        _ => false,
                    }
            })
            .count() as u32;
        Turn {
            state,
            def,
            limits,
            catalog,
            allowed: state.allowed_tools(def, limits),
            max_calls: front
                .max_tool_calls_per_turn
                .unwrap_or(limits.max_tool_calls_per_turn) as usize,
            depth: state.submitted.as_ref().map(|s| s.depth).unwrap_or(0),
            path: state.path_agents(),
            max_children: front
                .max_children_per_turn
                .unwrap_or(limits.max_children_per_turn),
            children,
            delegations: state.accounting.delegations,
        }
    }

    /// The owner's own plan edits go first, one at a time and in the model's order, so a
    /// delegation of the same turn may hand out tasks they add.
    fn plan_edit(&self) -> Option<Step> {
        let st = self.state;
        let slot = st.turn.iter().take(self.max_calls).find(|s| {
            RuntimeTool::UpdatePlan.is(&s.call.name)
                && matches!(s.state, SlotState::Pending)
                && self.allowed.contains(RuntimeTool::UpdatePlan.as_str())
        })?;
        let agent = st
            .submitted
            .as_ref()
            .map(|s| s.agent.clone())
            .unwrap_or_default();
        Some(match crate::plan::Patch::from_args(&slot.call.args) {
            Ok(patch) => {
                let verdict = st
                    .planning
                    .plan
                    .merge(
                        crate::plan::Author::Owner { agent: &agent },
                        &patch,
                        self.limits.plan_unlink,
                    )
                    .map(|p| p.version);
                Step::EditPlan(PlanEdit {
                    call: slot.call.id.clone(),
                    agent,
                    patch,
                    verdict,
                })
            }
            Err(e) => Step::Refuse(vec![Refusal {
                call: slot.call.id.clone(),
                tool: RuntimeTool::UpdatePlan.as_str().into(),
                error: format!("update_plan: {e}"),
                kind: None,
            }]),
        })
    }

    /// Every call of the turn that is still to be decided, by what happens to it.
    fn sort(&mut self) -> Sorted {
        let mut out = Sorted::default();
        let st = self.state;
        for (i, slot) in st.turn.iter().enumerate() {
            let call = &slot.call;
            match &slot.state {
                SlotState::Running => out.resumed.push(run_of(call, true)),
                // An approved call of a runtime tool (a delegation, a router's `handoff_to`,
                // …) is decided like any other (below); an approved ordinary tool runs.
                SlotState::Approved if RuntimeTool::parse(&call.name).is_none() => {
                    out.runs.push(run_of(call, false))
                }
                SlotState::Pending | SlotState::Approved => {
                    let approved = matches!(slot.state, SlotState::Approved);
                    self.sort_call(i, call, approved, &mut out);
                }
                _ => {}
            }
        }
        out
    }

    /// Why the call at `index` cannot run whatever it is: past the per-turn limit,
    /// arguments that could not be read, a tool this agent may not use.
    fn gate(&self, index: usize, call: &ToolCall) -> Option<String> {
        // Calls past the per-turn limit are refused, in the model's order, whatever they
        // are: none of them runs.
        if index >= self.max_calls {
            return Some(format!(
                "{}: not run: this turn made {} tool calls and at most {} run per turn \
                 (`max_tool_calls_per_turn`); this was call number {}. Make fewer calls \
                 per turn.",
                call.name,
                self.state.turn.len(),
                self.max_calls,
                index + 1
            ));
        }
        // A provider could not read the call's arguments (`{_raw, _error}`), or could not
        // read a tool call out of a text answer at all: the model is told why.
        if let Some(err) = call.args.get("_error").and_then(Value::as_str) {
            let raw = call.args.get("_raw").and_then(Value::as_str).unwrap_or("");
            let raw = crate::text::clip_with_ellipsis(raw, 300);
            return Some(format!(
                "{}: the arguments could not be read ({err}); you sent: {raw}",
                call.name
            ));
        }
        if !crate::agent::tool_allowed(&self.allowed, &call.name) {
            let known = crate::agent::BUILTIN_TOOLS.contains(&call.name.as_str());
            return Some(format!(
                "{} tool `{}`: agent `{}` may use only: {}",
                if known { "not allowed:" } else { "unknown" },
                call.name,
                self.def.name(),
                join(&self.allowed)
            ));
        }
        None
    }

    fn sort_call(&mut self, index: usize, call: &ToolCall, approved: bool, out: &mut Sorted) {
        if let Some(why) = self.gate(index, call) {
            out.refusals.push(refusal(call, why));
            return;
        }
        let tool = RuntimeTool::parse(&call.name);
        // Every tool the model can call waits for a person's approval when its agent or
        // the limits say so, the runtime's own as well (`handoff_to` hands the request on,
        // `call_agent` starts a session); only a question to the person has nothing to
        // approve.
        if !approved && tool != Some(RuntimeTool::AskUser) && self.needs_approval(&call.name) {
            out.approvals.push(ApprovalAsk {
                call: call.id.clone(),
                tool: call.name.clone(),
                preview: call.args.to_string(),
            });
            return;
        }
        match tool {
            Some(RuntimeTool::AskClarification) => match self.clarify_of(call) {
                Ok(c) => out.clarifications.push(c),
                Err(e) => out.refusals.push(refusal(call, e)),
            },
            Some(RuntimeTool::ProposePatch) => match crate::plan::Patch::from_args(&call.args) {
                Ok(patch) => out.proposals.push(Proposal {
                    call: call.id.clone(),
                    patch,
                }),
                Err(e) => out
                    .refusals
                    .push(refusal(call, format!("propose_patch: {e}"))),
            },
            Some(RuntimeTool::TeamBroadcast) => match broadcast_of(call) {
                Ok(b) => out.broadcasts.push(b),
                Err(e) => out.refusals.push(refusal(call, e)),
            },
            Some(RuntimeTool::HandoffTo) => match self.route_of(call) {
                Ok(r) => out.routes.push(r),
                Err(e) => out.refusals.push(refusal(call, e)),
            },
            Some(RuntimeTool::AskUser) => match ask_of(call) {
                Ok(a) => out.asks.push(a),
                Err(e) => out.refusals.push(refusal(call, e)),
            },
            Some(RuntimeTool::CallAgent) => match self.delegate(call) {
                Ok(d) => out.delegations.push(d),
                Err(e) => out.refusals.push(refusal(call, e)),
            },
            _ => out.runs.push(run_of(call, false)),
        }
    }

    /// Whether a call of `tool` waits for a person's approval (the approver is shown every
    /// byte that would run: the whole arguments, never a cut of them). `call_agent` and
    /// `delegate_to_agent` are one tool: naming either asks for both.
    pub(super) fn needs_approval(&self, tool: &str) -> bool {
        let named = |t: &String| {
            t == tool || (RuntimeTool::CallAgent.is(t) && RuntimeTool::CallAgent.is(tool))
        };
        crate::agent::ALWAYS_APPROVED.contains(&tool)
            || self.def.front.requires_approval.iter().any(named)
            || self.limits.approval_required.iter().any(named)
    }

    /// One step for the turn, in a fixed order: refusals, delegations (refused whole when
    /// they do not fit the budget), tools, patch proposals, tools whose run was recorded,
    /// follow-ups, questions, approvals; else wait.
    fn choose(&self, s: Sorted) -> Step {
        if !s.refusals.is_empty() {
            return Step::Refuse(s.refusals);
        }
        if let Some(r) = s.routes.into_iter().next() {
            return Step::Orchestrate(Box::new(crate::event::Event::Routed(r)));
        }
        if !s.delegations.is_empty() {
            return self.fit_budget(s.delegations);
        }
        if !s.runs.is_empty() {
            return Step::RunTools(s.runs);
        }
        if !s.broadcasts.is_empty() {
            return Step::Broadcast(s.broadcasts);
        }
        if !s.proposals.is_empty() {
            return Step::ProposePatch(s.proposals);
        }
        // Calls whose `ToolCalled` is recorded come before new pauses: while a tool runs
        // its result is the next event (and after a crash its outcome is settled first).
        if !s.resumed.is_empty() {
            return Step::RunTools(s.resumed);
        }
        if !s.clarifications.is_empty() {
            return Step::Clarify(s.clarifications);
        }
        if !s.asks.is_empty() {
            return Step::AskUser(s.asks);
        }
        if !s.approvals.is_empty() {
            return Step::RequestApproval(s.approvals);
        }
        Step::Wait
    }

    /// The turn's delegations, with a share of the free budget for those that name none;
    /// or, when together they ask for more than is free, a refusal of each.
    fn fit_budget(&self, mut delegations: Vec<Delegation>) -> Step {
        let refuse_all = |delegations: &[Delegation], error: &str| {
            Step::Refuse(
                delegations
                    .iter()
                    .map(|d| Refusal {
                        call: d.call.clone(),
                        tool: RuntimeTool::CallAgent.as_str().into(),
                        error: error.to_string(),
                        kind: Some(Refused::TurnOverBudget),
                    })
                    .collect(),
            )
        };
        // A turn whose delegations did not fit is refused as a whole. Its refusals are
        // recorded one at a time, and the ones left would fit once the first are gone:
        // they are refused with the same reason, so every prefix of the log decides the
        // same.
        if let Some(reason) = &self.state.turn_over_budget {
            return refuse_all(&delegations, reason);
        }
        self.state.share_budget(&mut delegations);
        if let Some(free) = self.state.tokens_free() {
            let asked: u64 = delegations.iter().filter_map(|d| d.budget.tokens).sum();
            if asked > free {
                // Refuse the explicit requests that do not fit, with the figures.
                return refuse_all(
                    &delegations,
                    &format!(
                        "budget: this turn's delegations ask for {asked} tokens, {free} remain \
                     of this session's budget"
                    ),
                );
            }
        }
        Step::Delegate(delegations)
    }

    fn clarify_of(&self, call: &ToolCall) -> Result<Clarify, String> {
        let sid = call
            .args
            .get("session_id")
            .and_then(Value::as_str)
            .unwrap_or("");
        let question = call
            .args
            .get("question")
            .and_then(Value::as_str)
            .unwrap_or("")
            .trim();
        if question.is_empty() {
            return Err("ask_clarification: `question` is required".into());
        }
        let child =
            SessionId::parse(sid).map_err(|e| format!("ask_clarification: `session_id`: {e}"))?;
        let Some(info) = self
            .state
            .children
            .values()
            .find(|c| c.child == child && !c.cached && !c.shared)
        else {
            return Err(format!(
                "ask_clarification: {} is not a sub-agent this session ran",
                child.display()
            ));
        };
        if info.outcome != Some(ChildOutcome::Completed) {
            return Err(format!(
                "ask_clarification: {} has not completed; only a finished sub-agent can be \
                 asked a follow-up",
                child.display()
            ));
        }
        if !self
            .catalog
            .agent(&info.agent)
            .is_some_and(|d| d.front.chat)
        {
            return Err(format!(
                "ask_clarification: agent `{}` does not take follow-up questions (its \
                 definition would say `chat: true`)",
                info.agent
            ));
        }
        // A follow-up is at least one more model turn of the child: one with none left is
        // refused here, and its answer stays the completed answer it was.
        let max_steps = self.child_max_steps(&info.call, &info.agent);
        if info.steps >= max_steps {
            return Err(format!(
                "ask_clarification: {} (`{}`) has no turns left: it made {} of its {} model \
                 turns (clarification_no_turns); its answer stands. Start a new `call_agent` \
                 for more",
                child.display(),
                info.agent,
                info.steps,
                max_steps
            ));
        }
        Ok(Clarify {
            call: call.id.clone(),
            child,
            agent: info.agent.clone(),
            question: question.to_string(),
            max_steps,
        })
    }

    /// The model turns a child started for `call` may make in all: its agent's limit,
    /// or the runtime's, within the call's `budget.max_steps`.
    fn child_max_steps(&self, call: &str, agent: &str) -> u32 {
        let own = self
            .catalog
            .agent(agent)
            .and_then(|d| d.front.limits.max_steps)
            .unwrap_or(self.limits.max_steps);
        let asked = self
            .state
            .transcript
            .iter()
            .filter_map(|m| match m {
                crate::message::Message::Assistant { tool_calls, .. } => Some(tool_calls),
                _ => None,
            })
            .flatten()
            .find(|c| c.id == call)
            .and_then(|c| c.args.get("budget")?.get("max_steps")?.as_u64())
            .map_or(u32::MAX, |m| u32::try_from(m).unwrap_or(u32::MAX));
        own.min(asked)
    }
}

impl SessionState {
    /// Children without an explicit budget get an equal share of what is free.
    pub(super) fn share_budget(&self, ds: &mut [Delegation]) {
        let Some(free) = self.tokens_free() else {
            return;
        };
        let explicit: u64 = ds.iter().filter_map(|d| d.budget.tokens).sum();
        let implicit = ds
            .iter()
            .filter(|d| d.budget.tokens.is_none() && d.resume.is_none())
            .count() as u64;
        if implicit == 0 {
            return;
        }
        let share = free.saturating_sub(explicit) / implicit;
        for d in ds
            .iter_mut()
            .filter(|d| d.budget.tokens.is_none() && d.resume.is_none())
        {
            d.budget.tokens = Some(share);
        }
    }
}

/// A `team_broadcast` call's arguments: `{message, type?: update|failure}`.
fn broadcast_of(call: &ToolCall) -> Result<super::Broadcast, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Args {
        message: String,
        #[serde(default, rename = "type")]
        kind: Option<String>,
    }
    let name = RuntimeTool::TeamBroadcast.as_str();
    let a: Args = serde_json::from_value(call.args.clone())
        .map_err(|e| format!("{name}: invalid arguments: {e}; expected {{message, type?}}"))?;
    if a.message.trim().is_empty() {
        return Err(format!("{name}: `message` must not be empty"));
    }
    let kind = match a.kind.as_deref() {
        None | Some("update") => crate::event::BroadcastKind::Update,
        Some("failure") => crate::event::BroadcastKind::Failure,
        Some(other) => {
            return Err(format!(
                "{name}: `type` is `update` or `failure`, not `{other}`"
            ))
        }
    };
    Ok(super::Broadcast {
        call: call.id.clone(),
        kind,
        message: a.message,
    })
}

fn ask_of(call: &ToolCall) -> Result<Ask, String> {
    let q = call.args.get("questions").cloned().unwrap_or(Value::Null);
    let ok = match &q {
        Value::Array(a) => {
            !a.is_empty()
                && a.iter()
                    .all(|x| x.is_string() || x.get("question").and_then(Value::as_str).is_some())
        }
        _ => false,
    };
    if !ok {
        return Err(
            "ask_user: `questions` must be a non-empty list of strings or of \
                    {key, question} objects"
                .into(),
        );
    }
    Ok(Ask {
        call: call.id.clone(),
        questions: q,
        context: call
            .args
            .get("context")
            .and_then(Value::as_str)
            .map(str::to_string),
        defaults: call
            .args
            .get("proposed_defaults")
            .cloned()
            .unwrap_or(Value::Null),
    })
}
