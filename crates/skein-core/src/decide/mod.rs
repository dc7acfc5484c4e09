//! `SessionState::next`: the decide step. Given the folded state, the agent definition the
//! session was submitted with, the limits in force and the agent catalogue, it says what
//! happens next. Pure: the same log always yields the same step, which is what replay
//! verification checks with [`Step::admits`].
//!
//! Here: the steps and what each admits, and the decision between turns. A turn of tool
//! calls is classified in `turn.rs`, and a `call_agent` call checked in `delegation.rs`.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::AgentDef;
use crate::event::{CustomAgent, DelegationKind, Event};
use crate::id::SessionId;
use crate::limits::{Budget, Limits};
use crate::message::{Message, ModelRequest, RequestMeta};

mod delegation;
mod pattern;
mod turn;
use crate::event::Refused;
use crate::runtime_tool::RuntimeTool;
use crate::state::SessionState;

/// Model calls that fail with a retryable error are tried this many times in a row.
pub const MAX_MODEL_ATTEMPTS: u32 = 4;

/// Looks up agent definitions by name (the catalogue in force when a delegation is made).
pub trait Catalog {
    fn agent(&self, name: &str) -> Option<&AgentDef>;
}

impl Catalog for crate::agent::AgentSet {
    fn agent(&self, name: &str) -> Option<&AgentDef> {
        self.get(name)
    }
}

/// The arguments of `call_agent`, as the model sends them. The names other agent systems
/// use are accepted as aliases (`task` for `mission`; `agent_name`, `skill_name` and
/// `specialist` for `agent`); a field this build does not know is refused with its name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallAgentArgs {
    #[serde(
        default,
        alias = "specialist",
        alias = "agent_name",
        alias = "skill_name"
    )]
    pub agent: Option<String>,
    #[serde(default, alias = "task")]
    pub mission: Option<String>,
    /// Background for the child: text, or an object (shown to it as JSON).
    #[serde(default, deserialize_with = "context_text")]
    pub context: Option<String>,
    #[serde(default)]
    pub inputs: Option<Value>,
    #[serde(default)]
    pub agent_definition: Option<CustomAgent>,
    #[serde(default)]
    pub budget: Option<Budget>,
    #[serde(default)]
    pub resume_token: Option<String>,
    #[serde(default)]
    pub answers: Option<Value>,
    #[serde(default)]
    pub owns_tasks: Vec<String>,
    /// Narrows the tools the child may use to these (each one it has); never widens.
    #[serde(default)]
    pub allowed_tools: Option<Vec<String>>,
    /// Named by other systems; refused with the alternatives (see `delegate`).
    #[serde(default)]
    pub planning_strategy: Option<Value>,
    /// Reference 002's context shared by every child of a tree; refused with the
    /// alternative (see `delegate`).
    #[serde(default)]
    pub shared_context: Option<Value>,
}

/// `context` as text: a string as it is, an object or a list as canonical JSON.
fn context_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::Null => None,
        Value::String(s) => Some(s),
        other => Some(crate::hash::canonical_json(&other)),
    })
}

/// A tool call the runtime refuses; the model is shown `error`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Refusal {
    pub call: String,
    pub tool: String,
    pub error: String,
    /// Recorded with the refusal when a later decision reads it back.
    pub kind: Option<Refused>,
}

/// A child session to start for a `call_agent` call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Delegation {
    pub call: String,
    pub child: SessionId,
    /// Agent name (`custom` for a run-time definition).
    pub agent: String,
    pub mission: String,
    pub context: Option<String>,
    pub inputs: Value,
    pub custom: Option<CustomAgent>,
    pub depth: u32,
    pub budget: Budget,
    /// Agents from the root to the parent (this session), root first.
    pub ancestry: Vec<String>,
    /// Set when this call continues a paused child instead of starting one.
    pub resume: Option<Resume>,
    /// Tasks of this session's plan handed to the child, as they stand now.
    pub grant: Option<crate::event::PlanGrant>,
    /// The original request, for a child that is a step of a pattern chain.
    pub request: Option<String>,
    /// The tools the child is narrowed to (`call_agent {allowed_tools}`).
    pub allowed_tools: Option<Vec<String>>,
    /// The child's seat, when it is a member or the supervisor of this session's team.
    pub team: Option<crate::event::TeamSeat>,
}

/// A `team_broadcast` call: the shell records it in every teammate's log
/// (`TeamBroadcast`), then its result here.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Broadcast {
    pub call: String,
    pub kind: crate::event::BroadcastKind,
    pub message: String,
}

/// The plan owner's own `update_plan` call, merged by the rules: the shell records
/// `PatchApplied` (version `verdict`) or `PatchRejected` — the event is the tool's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanEdit {
    pub call: String,
    pub agent: String,
    pub patch: crate::plan::Patch,
    pub verdict: Result<u64, crate::plan::Rejection>,
}

impl PlanEdit {
    /// The event that records this edit's verdict.
    pub fn into_event(self) -> Event {
        Event::patch_verdict(
            crate::plan::SELF,
            self.agent,
            Some(self.call),
            self.patch,
            &self.verdict,
        )
    }
}

/// A sub-agent's `propose_patch` call: the shell merges it into the parent's plan (in the
/// parent's log) and records the verdict here as the tool's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Proposal {
    pub call: String,
    pub patch: crate::plan::Patch,
}

/// A question to put (`ask_user`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ask {
    pub call: String,
    pub questions: Value,
    pub context: Option<String>,
    pub defaults: Value,
}

/// A tool call that must wait for approval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ApprovalAsk {
    pub call: String,
    pub tool: String,
    pub preview: String,
}

/// Continuing a paused sub-agent: its token (checked by the shell) and the answers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Resume {
    pub token: String,
    pub answers: Value,
}

/// The keys a set of questions expects answers for, with each question's text: an object
/// question `{key, question}` names its key; a plain string question is `q1`, `q2`, ….
pub fn expected_keys(questions: &Value) -> Vec<(String, String)> {
    let items = match questions {
        Value::Array(a) => a.clone(),
        Value::Null => vec![],
        other => vec![other.clone()],
    };
    items
        .iter()
        .enumerate()
        .map(|(i, q)| match q {
            Value::Object(o) => (
                o.get("key")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or(format!("q{}", i + 1)),
                o.get("question")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            ),
            Value::String(s) => (format!("q{}", i + 1), s.clone()),
            other => (format!("q{}", i + 1), other.to_string()),
        })
        .collect()
}

/// Checks answers against the questions: returns every expected key that has no answer,
/// with its question. Nothing is guessed from proposed defaults.
pub fn missing_answers(questions: &Value, answers: &Value) -> Vec<(String, String)> {
    expected_keys(questions)
        .into_iter()
        .filter(|(k, _)| answers.get(k).is_none_or(Value::is_null))
        .collect()
}

/// A follow-up question for a finished `chat: true` child.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Clarify {
    pub call: String,
    pub child: SessionId,
    pub agent: String,
    pub question: String,
    /// The model turns the child may make in all.
    pub max_steps: u32,
}

/// An ordinary tool call to run. `resumed` means `ToolCalled` is already in the log: a
/// crash hid the outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolRun {
    pub call: String,
    pub tool: String,
    pub args: Value,
    pub resumed: bool,
}

/// What the shell must do next for a session.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    /// Call the model (the request is [`SessionState::model_request`], plus the tool
    /// schemas for `tool_names`) and record `ModelCalled` or `ModelFailed`.
    CallModel {
        model: String,
        tool_names: Vec<String>,
    },
    /// Record these refusals as tool errors.
    Refuse(Vec<Refusal>),
    /// Start these children (or answer them from the cache).
    Delegate(Vec<Delegation>),
    /// Run these tools: `ToolCalled` first, then the tool, then `ToolReturned`.
    RunTools(Vec<ToolRun>),
    /// Record the verdict on this `update_plan` call.
    EditPlan(PlanEdit),
    /// Take these patches to the parent's plan and record each verdict (`ToolReturned`).
    ProposePatch(Vec<Proposal>),
    /// Put these questions (`InputRequested`, each with a fresh token id) and pause.
    AskUser(Vec<Ask>),
    /// Ask approval for these tool calls (`ApprovalRequested`) and pause.
    RequestApproval(Vec<ApprovalAsk>),
    /// Put follow-up questions to finished children (`ClarificationRequested` in the
    /// child's log, `Delegated {resumed}` here) and wait for their new answers.
    Clarify(Vec<Clarify>),
    /// Children of this turn are still running: nothing to do until one settles.
    Wait,
    /// The final answer is longer than the agent's `summarize.max_chars`: ask `model` for
    /// a summary (recorded as `ModelCalled`); the full answer goes to the blob store.
    Summarize { model: String, max_chars: usize },
    /// Send these broadcasts to the session's teammates, then record each call's result.
    Broadcast(Vec<Broadcast>),
    /// Record this pattern event (`HandedOff`, `Routed`, `AdvisorsConsulted`,
    /// `TeamStarted`): it opens
    /// a turn of the pattern's children, delegated next like any.
    Orchestrate(Box<Event>),
    /// Finish with this answer.
    Complete { answer: String },
    /// Finish with this error.
    Fail { error: String },
    /// The session is over (or not yet submitted): nothing to do.
    Idle,
}

impl Step {
    pub fn name(&self) -> &'static str {
        match self {
            Step::CallModel { .. } => "call_model",
            Step::Refuse(_) => "refuse",
            Step::Delegate(_) => "delegate",
            Step::RunTools(_) => "run_tools",
            Step::EditPlan(_) => "edit_plan",
            Step::ProposePatch(_) => "propose_patch",
            Step::AskUser(_) => "ask_user",
            Step::Summarize { .. } => "summarize",
            Step::Clarify(_) => "clarify",
            Step::RequestApproval(_) => "request_approval",
            Step::Wait => "wait",
            Step::Orchestrate(_) => "orchestrate",
            Step::Broadcast(_) => "broadcast",
            Step::Complete { .. } => "complete",
            Step::Fail { .. } => "fail",
            Step::Idle => "idle",
        }
    }

    /// Whether `ev` is an event this step could have produced (or an input that may
    /// arrive while in it). Replay verification calls this for every event after the
    /// first: the prefix is folded, `next` decided, and the recorded event must fit.
    pub fn admits(&self, ev: &Event) -> Result<(), String> {
        if matches!(ev, Event::Cancelled(_) | Event::Unknown { .. }) {
            return Ok(());
        }
        if matches!(ev, Event::Failed(f) if f.is_dead_letter()) {
            return Ok(());
        }
        // A sub-agent's patch, a teammate's broadcast arrive from outside, whatever this
        // session is doing.
        match ev {
            Event::TeamBroadcast(_) => return Ok(()),
            Event::PatchApplied(p) if p.from != crate::plan::SELF => return Ok(()),
            Event::PatchRejected(p) if p.from != crate::plan::SELF => return Ok(()),
            _ => {}
        }
        let ok = match (self, ev) {
            (Step::CallModel { model, .. }, Event::ModelCalled(m)) => m.model == *model,
            (Step::CallModel { model, .. }, Event::ModelFailed(m)) => m.model == *model,
            (Step::Refuse(rs), Event::ToolReturned(t)) => {
                t.error
                    && rs.iter().any(|r| {
                        r.call == t.call && r.error == t.output && r.kind == t.refusal_kind()
                    })
            }
            (Step::Delegate(ds), Event::Delegated(d)) => ds.iter().any(|x| {
                x.call == d.call
                    && x.agent == d.agent
                    && (d.kind == DelegationKind::Shared || x.child == d.child)
            }),
            (Step::Delegate(ds), Event::CacheHit(h)) => ds.iter().any(|x| x.call == h.call),
            // The shell refuses a resume whose token does not hold.
            (Step::Delegate(ds), Event::ToolReturned(t)) => {
                t.error && ds.iter().any(|x| x.call == t.call && x.resume.is_some())
            }
            (Step::AskUser(asks), Event::InputRequested(q)) => {
                asks.iter().any(|a| Some(&a.call) == q.call.as_ref())
            }
            (Step::RequestApproval(v), Event::ApprovalRequested(r)) => {
                v.iter().any(|a| a.call == r.call && a.tool == r.tool)
            }
            (Step::Wait, Event::InputProvided(_) | Event::ApprovalGiven(_)) => true,
            (Step::Summarize { model, .. }, Event::ModelCalled(m)) => m.model == *model,
            (Step::Summarize { model, .. }, Event::ModelFailed(m)) => m.model == *model,
            (Step::Clarify(v), Event::Delegated(d)) => {
                d.kind == DelegationKind::Resumed
                    && v.iter().any(|c| c.call == d.call && c.child == d.child)
            }
            (Step::Clarify(v), Event::ToolReturned(t)) => {
                t.error && v.iter().any(|c| c.call == t.call)
            }
            // A finished session may be asked again (`chat: true`).
            (Step::Idle, Event::ClarificationRequested(_)) => true,
            // A root answered from the cache before its first model call.
            (Step::CallModel { .. }, Event::CacheHit(h)) => h.call.is_empty(),
            (Step::RunTools(rs), Event::ToolCalled(t)) => rs
                .iter()
                .any(|r| !r.resumed && r.call == t.call && r.tool == t.tool),
            (Step::RunTools(rs), Event::ToolReturned(t)) => {
                rs.iter().any(|r| r.resumed && r.call == t.call)
            }
            (Step::Wait, Event::ChildSettled(_)) => true,
            // A call whose shared run was cancelled by its starter delegates again
            // ([`SessionState::delegations_again`]): the new run is started, shared or
            // answered from the cache while the turn waits.
            (Step::Wait, Event::Delegated(d)) => d.kind != DelegationKind::Resumed,
            (Step::Wait, Event::CacheHit(h)) => !h.call.is_empty(),
            (Step::EditPlan(e), Event::PatchApplied(p)) => {
                p.call.as_deref() == Some(e.call.as_str()) && e.verdict == Ok(p.version)
            }
            (Step::EditPlan(e), Event::PatchRejected(p)) => {
                p.call.as_deref() == Some(e.call.as_str())
                    && e.verdict.as_ref().err() == Some(&p.reason)
            }
            (Step::ProposePatch(v), Event::ToolReturned(t)) => v.iter().any(|p| p.call == t.call),
            (Step::Orchestrate(e), ev) if **e == *ev => true,
            (Step::Broadcast(bs), Event::ToolReturned(t)) => {
                !t.error && bs.iter().any(|b| b.call == t.call)
            }
            // A root with advisors or a team answered from the cache before consulting
            // them or starting it (its first step is the pattern's, not a model call).
            (Step::Orchestrate(e), Event::CacheHit(h)) => {
                matches!(**e, Event::AdvisorsConsulted(_) | Event::TeamStarted(_))
                    && h.call.is_empty()
            }
            (Step::Complete { answer }, Event::Completed(c)) => c.answer == *answer,
            (Step::Fail { error }, Event::Failed(f)) => f.error == *error,
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "decided {}, log has {}",
                self.describe(),
                ev.kind()
            ))
        }
    }

    /// The step in a few words (`call_model(scripted:x)`, `run_tools(c1,c2)` …), for
    /// divergence reports and dead-letter reasons.
    pub fn describe(&self) -> String {
        match self {
            Step::CallModel { model, .. } => format!("call_model({model})"),
            Step::Refuse(rs) => format!(
                "refuse({})",
                rs.iter()
                    .map(|r| r.call.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Step::Delegate(ds) => format!(
                "delegate({})",
                ds.iter()
                    .map(|d| d.child.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Step::RunTools(rs) => format!(
                "run_tools({})",
                rs.iter()
                    .map(|r| r.call.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Step::Orchestrate(e) => format!("orchestrate({})", e.kind()),
            Step::Complete { .. } => "complete".into(),
            Step::Fail { error } => format!("fail({error})"),
            s => s.name().into(),
        }
    }
}

/// The mission as the model first reads it.
pub fn mission_message(mission: &str, context: Option<&str>, inputs: &Value) -> String {
    let mut m = mission.to_string();
    if let Some(c) = context.filter(|c| !c.is_empty()) {
        m.push_str("\n\nContext:\n");
        m.push_str(c);
    }
    if !inputs.is_null() && inputs != &Value::Object(Default::default()) {
        m.push_str("\n\nInputs:\n");
        m.push_str(&crate::hash::canonical_json(inputs));
    }
    m
}

impl SessionState {
    /// The delegations `calls` would make now if they had not delegated yet: for calls
    /// whose shared run (single flight: a run another session started) ended cancelled
    /// before it answered. That cancel was its starter's (its tree cancelled, or its parent
    /// ended without it), not these calls', so they run the mission anew rather than fail
    /// with it. Each names the child its call's own delegation was numbered for, which the
    /// shared run left uncreated: the same whichever calls are decided together and
    /// however often a step is run again after a crash, and no other call's. Empty when
    /// the calls would not start children now (refused, say, for the budget left): they
    /// settle with the cancel as any child does.
    pub fn delegations_again(
        &self,
        def: &AgentDef,
        limits: &Limits,
        catalog: &dyn Catalog,
        calls: &[String],
    ) -> Vec<Delegation> {
        let Some(id) = &self.id else {
            return vec![];
        };
        let mut again = self.clone();
        for call in calls {
            again.set_slot(call, crate::state::SlotState::Pending);
        }
        match again.next(def, limits, catalog) {
            Step::Delegate(ds) => ds
                .into_iter()
                .filter(|d| calls.contains(&d.call) && d.resume.is_none())
                .filter_map(|mut d| {
                    let number = self.children.get(&d.call)?.number;
                    d.child = id.child(&d.agent, number);
                    Some(d)
                })
                .collect(),
            _ => vec![],
        }
    }
}

impl SessionState {
    /// Decides the next step. `def` must be the definition recorded at submission.
    pub fn next(&self, def: &AgentDef, limits: &Limits, catalog: &dyn Catalog) -> Step {
        let Some(sub) = &self.submitted else {
            return Step::Idle;
        };
        if self.status.is_terminal() {
            return Step::Idle;
        }
        if let Some(error) = &self.pattern.error {
            return Step::Fail {
                error: error.clone(),
            };
        }
        if let Some(answer) = &self.ending.pending_answer {
            if let Some(step) = self.hand_off(def, answer) {
                return step;
            }
            if let Some(summary) = &self.ending.summary {
                let full = self.ending.full_answer.as_deref().unwrap_or(answer);
                // `max_chars` is a limit: a summary model that wrote more is cut to it (a
                // chain's answer, which was never summarised, is not).
                let cut;
                let summary = match (&def.front.summarize, &self.ending.full_answer) {
                    (Some(sz), Some(_)) if summary.chars().count() > sz.max_chars => {
                        cut = cut_chars(summary, sz.max_chars);
                        &cut
                    }
                    _ => summary,
                };
                let answer = if full == summary {
                    summary.clone()
                } else {
                    format!(
                        "{summary}\n\n[full answer: {} characters, blob {}]",
                        full.chars().count(),
                        blake3::hash(full.as_bytes()).to_hex()
                    )
                };
                return Step::Complete { answer };
            }
            if let Some(sz) = &def.front.summarize {
                let failed_out = self.failures.model_failures >= MAX_MODEL_ATTEMPTS;
                if answer.chars().count() > sz.max_chars
                    && !failed_out
                    && !self.failures.model_failure_fatal
                {
                    return Step::Summarize {
                        model: sz.model.clone().unwrap_or_else(|| def.front.model.clone()),
                        max_chars: sz.max_chars,
                    };
                }
            }
            return Step::Complete {
                answer: answer.clone(),
            };
        }
        if !self.turn.is_empty() {
            return self.next_in_turn(def, limits, catalog);
        }
        // A new model turn.
        if self.failures.model_failure_fatal || self.failures.model_failures >= MAX_MODEL_ATTEMPTS {
            return Step::Fail {
                error: format!(
                    "model call failed {} times: {}",
                    self.failures.model_failures,
                    self.failures
                        .last_model_error
                        .as_deref()
                        .unwrap_or("unknown error")
                ),
            };
        }
        if self.failures.unreadable_turns >= limits.max_unreadable_turns.max(1) {
            return Step::Fail {
                error: format!(
                    "the model's tool calls could not be read in {} turns in a row; the last: {}",
                    self.failures.unreadable_turns,
                    self.failures
                        .last_unreadable
                        .as_deref()
                        .unwrap_or("unknown")
                ),
            };
        }
        let max_steps = def
            .front
            .limits
            .max_steps
            .unwrap_or(limits.max_steps)
            .min(sub.budget.max_steps.unwrap_or(u32::MAX));
        if self.steps >= max_steps {
            return Step::Fail {
                error: format!("step limit reached: {max_steps} model turns without an answer"),
            };
        }
        if let Some(budget) = sub.budget.tokens {
            let used = self.usage_total().total_tokens();
            if used >= budget {
                return Step::Fail {
                    error: format!("token budget exhausted: used {used} of {budget} tokens"),
                };
            }
        }
        if let Some(step) = self.start_team(def) {
            return step;
        }
        if let Some(step) = self.consult(def) {
            return step;
        }
        // A supervisor takes its next turn once a teammate has said something, or every
        // member has left.
        if self.team_gated() {
            return Step::Wait;
        }
        Step::CallModel {
            model: def.front.model.clone(),
            tool_names: self.allowed_tools(def, limits).into_iter().collect(),
        }
    }

    /// The tools this session may use: its definition's (within the limits' global bound
    /// on sub-agents), plus `propose_patch` when it was handed tasks of its parent's plan.
    pub fn allowed_tools(&self, def: &AgentDef, limits: &Limits) -> BTreeSet<String> {
        let mut t = def.allowed_tools();
        let depth = self.submitted.as_ref().map_or(0, |s| s.depth);
        t.retain(|x| limits.sub_agent_may_use(depth, x));
        if let Some(only) = self
            .submitted
            .as_ref()
            .and_then(|s| s.allowed_tools.as_ref())
        {
            // A server's tools had whole (`SERVER__*`) narrow to those of them named.
            let covered: Vec<String> = only
                .iter()
                .filter(|o| t.iter().any(|x| crate::agent::wildcard_covers(x, o)))
                .cloned()
                .collect();
            t.retain(|x| only.contains(x));
            t.extend(covered);
        }
        if self.submitted.as_ref().is_some_and(|s| s.plan.is_some()) {
            t.insert(RuntimeTool::ProposePatch.as_str().into());
        }
        if self.submitted.as_ref().is_some_and(|s| s.team.is_some()) {
            t.insert(RuntimeTool::TeamBroadcast.as_str().into());
        }
        t
    }

    /// What the model is told of plans: this session's own plan, and the tasks it was
    /// handed of its parent's.
    fn plan_notes(&self) -> (Option<String>, Option<String>, Value) {
        let own = (!self.planning.plan.is_empty()).then(|| {
            format!(
                "The plan you own (change it with `update_plan`; sub-agents you hand tasks \
                 with `call_agent {{owns_tasks}}` may patch those):\n\n{}",
                self.planning.plan.render_markdown()
            )
        });
        let grant = self.submitted.as_ref().and_then(|s| s.plan.as_deref());
        let handed = grant.map(|g| {
            let mut m = format!(
                "You were handed these tasks of your parent's plan (version {}). Report \
                 progress with `propose_patch {{base_version, ops}}`; on a conflict, rebase \
                 on the version it names and propose again.\n",
                g.version
            );
            for t in &g.tasks {
                m.push_str(&format!(
                    "- {} — {} ({})\n",
                    t.id,
                    t.title,
                    t.status.as_str()
                ));
            }
            m
        });
        let meta = match (grant, own.is_some()) {
            (Some(g), _) => serde_json::json!({
                "version": g.version,
                "owns": g.tasks.iter().map(|t| t.id.clone()).collect::<Vec<_>>(),
            }),
            (None, true) => serde_json::json!({
                "version": self.planning.plan.version,
                "tasks": self.planning.plan.tasks.iter().map(|t| t.id.clone()).collect::<Vec<_>>(),
            }),
            (None, false) => Value::Null,
        };
        (own, handed, meta)
    }

    /// The request for the next model call: the system prompt, the mission, then the
    /// transcript. Tool schemas are the shell's to add.
    pub fn model_request(&self, def: &AgentDef) -> ModelRequest {
        let sub = self.submitted.as_ref();
        let (own_plan, handed, plan_meta) = self.plan_notes();
        let mut messages = Vec::with_capacity(self.transcript.len() + 2);
        let mut system = def.prompt.clone();
        if let Some(p) = own_plan {
            system.push_str("\n\n");
            system.push_str(&p);
        }
        messages.push(Message::System { content: system });
        let mut mission = sub
            .map(|s| mission_message(&s.mission, s.context.as_deref(), &s.inputs))
            .unwrap_or_default();
        if let Some(advice) = &self.pattern.advice {
            mission = advice.compose(&mission);
        }
        if let Some(h) = handed {
            mission.push_str("\n\n");
            mission.push_str(&h);
        }
        messages.push(Message::User { content: mission });
        messages.extend(self.transcript.iter().cloned());
        ModelRequest {
            model: def.front.model.clone(),
            messages,
            tools: vec![],
            temperature: def.front.temperature,
            max_tokens: def.front.max_tokens,
            top_p: def.front.top_p,
            top_k: def.front.top_k,
            prompt_cache: def.front.prompt_cache,
            meta: RequestMeta {
                session: self.id.as_ref().map(|i| i.to_string()).unwrap_or_default(),
                agent: sub.map(|s| s.agent.clone()).unwrap_or_default(),
                mission: sub.map(|s| s.mission.clone()).unwrap_or_default(),
                context: sub.and_then(|s| s.context.clone()),
                inputs: sub.map(|s| s.inputs.clone()).unwrap_or_default(),
                plan: plan_meta,
            },
        }
    }

    /// The request for the summary of the pending answer (the agent's `summarize`
    /// setting, decided as [`Step::Summarize`]): the answer alone, with no tools, to
    /// `model`, in at most `max_chars` characters.
    pub fn summary_request(&self, model: String, max_chars: usize) -> ModelRequest {
        let full = self.ending.pending_answer.clone().unwrap_or_default();
        ModelRequest {
            model,
            messages: vec![
                Message::System {
                    content: format!(
                        "Summarise the answer below in at most {max_chars} characters. Keep \
                         every fact, figure and name the requester needs; add nothing."
                    ),
                },
                Message::User {
                    content: full.clone(),
                },
            ],
            tools: vec![],
            temperature: None,
            max_tokens: None,
            top_p: None,
            top_k: None,
            prompt_cache: false,
            meta: RequestMeta {
                session: self.id.as_ref().map(|i| i.to_string()).unwrap_or_default(),
                agent: self
                    .submitted
                    .as_ref()
                    .map(|s| s.agent.clone())
                    .unwrap_or_default(),
                mission: "summarize".into(),
                context: Some(full),
                inputs: Value::Null,
                plan: Value::Null,
            },
        }
    }
}

pub(crate) fn join(set: &BTreeSet<String>) -> String {
    if set.is_empty() {
        "(no tools)".into()
    } else {
        set.iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The first `max` characters of `text`, the last of them an ellipsis when it was cut.
fn cut_chars(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}
