//! `SessionState::next`: the decide step. Given the folded state, the agent definition the
//! session was submitted with, the limits in force and the agent catalogue, it says what
//! happens next. Pure: the same log always yields the same step, which is what replay
//! verification checks with [`Step::admits`].

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::AgentDef;
use crate::event::{CustomAgent, Event};
use crate::id::SessionId;
use crate::limits::{Budget, Limits};
use crate::message::{Message, ModelRequest, RequestMeta};
use crate::runtime_tool::RuntimeTool;
use crate::state::{SessionState, SlotState};

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

/// The arguments of `call_agent`, as the model sends them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallAgentArgs {
    #[serde(default, alias = "specialist")]
    pub agent: Option<String>,
    #[serde(default)]
    pub mission: Option<String>,
    #[serde(default)]
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
}

/// A tool call the runtime refuses; the model is shown `error`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Refusal {
    pub call: String,
    pub tool: String,
    pub error: String,
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
        // A sub-agent's patch arrives from outside, whatever this session is doing.
        match ev {
            Event::PatchApplied(p) if p.from != crate::plan::SELF => return Ok(()),
            Event::PatchRejected(p) if p.from != crate::plan::SELF => return Ok(()),
            _ => {}
        }
        let ok = match (self, ev) {
            (Step::CallModel { model, .. }, Event::ModelCalled(m)) => m.model == *model,
            (Step::CallModel { model, .. }, Event::ModelFailed(m)) => m.model == *model,
            (Step::Refuse(rs), Event::ToolReturned(t)) => {
                t.error && rs.iter().any(|r| r.call == t.call && r.error == t.output)
            }
            (Step::Delegate(ds), Event::Delegated(d)) => ds.iter().any(|x| {
                x.call == d.call && x.agent == d.agent && (d.shared || x.child == d.child)
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
                d.resumed && v.iter().any(|c| c.call == d.call && c.child == d.child)
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
            (Step::EditPlan(e), Event::PatchApplied(p)) => {
                p.call.as_deref() == Some(e.call.as_str()) && e.verdict == Ok(p.version)
            }
            (Step::EditPlan(e), Event::PatchRejected(p)) => {
                p.call.as_deref() == Some(e.call.as_str())
                    && e.verdict.as_ref().err() == Some(&p.reason)
            }
            (Step::ProposePatch(v), Event::ToolReturned(t)) => v.iter().any(|p| p.call == t.call),
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

/// How the refusal of a turn whose delegations do not fit the budget begins (the core
/// writes it, and reads it back to refuse the rest of that turn the same way).
const TURN_OVER_BUDGET: &str = "budget: this turn's delegations ask for";

impl SessionState {
    /// Decides the next step. `def` must be the definition recorded at submission.
    pub fn next(&self, def: &AgentDef, limits: &Limits, catalog: &dyn Catalog) -> Step {
        let Some(sub) = &self.submitted else {
            return Step::Idle;
        };
        if self.status.is_terminal() {
            return Step::Idle;
        }
        if let Some(answer) = &self.pending_answer {
            if let Some(summary) = &self.summary {
                let full = self.full_answer.as_deref().unwrap_or(answer);
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
                let failed_out = self.model_failures >= MAX_MODEL_ATTEMPTS;
                if answer.chars().count() > sz.max_chars && !failed_out && !self.model_failure_fatal
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
        if self.model_failure_fatal || self.model_failures >= MAX_MODEL_ATTEMPTS {
            return Step::Fail {
                error: format!(
                    "model call failed {} times: {}",
                    self.model_failures,
                    self.last_model_error.as_deref().unwrap_or("unknown error")
                ),
            };
        }
        if self.unreadable_turns >= limits.max_unreadable_turns.max(1) {
            return Step::Fail {
                error: format!(
                    "the model's tool calls could not be read in {} turns in a row; the last: {}",
                    self.unreadable_turns,
                    self.last_unreadable.as_deref().unwrap_or("unknown")
                ),
            };
        }
        let max_steps = def.front.limits.max_steps.unwrap_or(limits.max_steps);
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
        Step::CallModel {
            model: def.front.model.clone(),
            tool_names: self.allowed_tools(def).into_iter().collect(),
        }
    }

    /// The tools this session may use: its definition's, plus `propose_patch` when it was
    /// handed tasks of its parent's plan.
    pub fn allowed_tools(&self, def: &AgentDef) -> BTreeSet<String> {
        let mut t = def.allowed_tools();
        if self.submitted.as_ref().is_some_and(|s| s.plan.is_some()) {
            t.insert(RuntimeTool::ProposePatch.as_str().into());
        }
        t
    }

    /// What the model is told of plans: this session's own plan, and the tasks it was
    /// handed of its parent's.
    fn plan_notes(&self) -> (Option<String>, Option<String>, Value) {
        let own = (!self.plan.is_empty()).then(|| {
            format!(
                "The plan you own (change it with `update_plan`; sub-agents you hand tasks \
                 with `call_agent {{owns_tasks}}` may patch those):\n\n{}",
                self.plan.render_markdown()
            )
        });
        let grant = self.submitted.as_ref().and_then(|s| s.plan.as_ref());
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
                "version": self.plan.version,
                "tasks": self.plan.tasks.iter().map(|t| t.id.clone()).collect::<Vec<_>>(),
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

    fn next_in_turn(&self, def: &AgentDef, limits: &Limits, catalog: &dyn Catalog) -> Step {
        let allowed = self.allowed_tools(def);
        // The owner's own plan edits go first, one at a time and in the model's order, so
        // a delegation of the same turn may hand out tasks they add.
        let max_calls = def
            .front
            .limits
            .max_tool_calls_per_turn
            .unwrap_or(limits.max_tool_calls_per_turn) as usize;
        if let Some(slot) = self.turn.iter().take(max_calls).find(|s| {
            RuntimeTool::UpdatePlan.is(&s.call.name)
                && matches!(s.state, SlotState::Pending)
                && allowed.contains(RuntimeTool::UpdatePlan.as_str())
        }) {
            let agent = self
                .submitted
                .as_ref()
                .map(|s| s.agent.clone())
                .unwrap_or_default();
            return match crate::plan::Patch::from_args(&slot.call.args) {
                Ok(patch) => {
                    let verdict = self
                        .plan
                        .merge(
                            crate::plan::Author::Owner { agent: &agent },
                            &patch,
                            limits.plan_unlink,
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
                }]),
            };
        }
        let sub = self.submitted.as_ref();
        let depth = sub.map(|s| s.depth).unwrap_or(0);
        let path = self.path_agents();
        let max_children = def
            .front
            .limits
            .max_children_per_turn
            .unwrap_or(limits.max_children_per_turn);
        let mut children_in_turn = self
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

        let mut refusals = vec![];
        let mut delegations: Vec<Delegation> = vec![];
        let mut runs = vec![];
        let mut resumed = vec![];
        let mut asks = vec![];
        let mut approvals = vec![];
        let mut clarifications = vec![];
        let mut proposals = vec![];
        let mut n = self.delegations;

        for (i, slot) in self.turn.iter().enumerate() {
            let call = &slot.call;
            match &slot.state {
                SlotState::Running => {
                    resumed.push(ToolRun {
                        call: call.id.clone(),
                        tool: call.name.clone(),
                        args: call.args.clone(),
                        resumed: true,
                    });
                    continue;
                }
                // An approved delegation is started like any other (below).
                SlotState::Approved if !RuntimeTool::CallAgent.is(&call.name) => {
                    runs.push(ToolRun {
                        call: call.id.clone(),
                        tool: call.name.clone(),
                        args: call.args.clone(),
                        resumed: false,
                    });
                    continue;
                }
                SlotState::Pending | SlotState::Approved => {}
                _ => continue,
            }
            let approved = matches!(slot.state, SlotState::Approved);
            let refuse = |error: String| Refusal {
                call: call.id.clone(),
                tool: call.name.clone(),
                error,
            };
            // Calls past the per-turn limit are refused, in the model's order, whatever
            // they are: none of them runs.
            if i >= max_calls {
                refusals.push(refuse(format!(
                    "{}: not run: this turn made {} tool calls and at most {max_calls} run per \
                     turn (`max_tool_calls_per_turn`); this was call number {}. Make fewer \
                     calls per turn.",
                    call.name,
                    self.turn.len(),
                    i + 1
                )));
                continue;
            }
            // A provider could not read the call's arguments (`{_raw, _error}`), or could
            // not read a tool call out of a text answer at all: the model is told why.
            if let Some(err) = call.args.get("_error").and_then(Value::as_str) {
                let raw = call.args.get("_raw").and_then(Value::as_str).unwrap_or("");
                let mut raw = raw.to_string();
                if raw.len() > 300 {
                    let mut cut = 300;
                    while !raw.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    raw.truncate(cut);
                    raw.push('…');
                }
                refusals.push(refuse(format!(
                    "{}: the arguments could not be read ({err}); you sent: {raw}",
                    call.name
                )));
                continue;
            }
            if !allowed.contains(&call.name) {
                let known = crate::agent::BUILTIN_TOOLS.contains(&call.name.as_str());
                refusals.push(refuse(format!(
                    "{} tool `{}`: agent `{}` may use only: {}",
                    if known { "not allowed:" } else { "unknown" },
                    call.name,
                    def.name(),
                    join(&allowed)
                )));
                continue;
            }
            if RuntimeTool::AskClarification.is(&call.name) {
                match self.clarify_of(call, catalog) {
                    Ok(c) => clarifications.push(c),
                    Err(e) => refusals.push(refuse(e)),
                }
                continue;
            }
            if RuntimeTool::ProposePatch.is(&call.name) {
                match crate::plan::Patch::from_args(&call.args) {
                    Ok(patch) => proposals.push(Proposal {
                        call: call.id.clone(),
                        patch,
                    }),
                    Err(e) => refusals.push(refuse(format!("propose_patch: {e}"))),
                }
                continue;
            }
            if RuntimeTool::AskUser.is(&call.name) {
                match ask_of(call) {
                    Ok(a) => asks.push(a),
                    Err(e) => refusals.push(refuse(e)),
                }
                continue;
            }
            if !approved
                && (crate::agent::ALWAYS_APPROVED.contains(&call.name.as_str())
                    || def.front.requires_approval.contains(&call.name)
                    || limits.approval_required.contains(&call.name))
            {
                // The approver is shown every byte that would run: the whole arguments,
                // never a cut of them.
                approvals.push(ApprovalAsk {
                    call: call.id.clone(),
                    tool: call.name.clone(),
                    preview: call.args.to_string(),
                });
                continue;
            }
            if !RuntimeTool::CallAgent.is(&call.name) {
                runs.push(ToolRun {
                    call: call.id.clone(),
                    tool: call.name.clone(),
                    args: call.args.clone(),
                    resumed: false,
                });
                continue;
            }
            match self.check_delegation(
                def,
                limits,
                catalog,
                call,
                depth,
                &path,
                &mut children_in_turn,
                max_children,
                &mut n,
            ) {
                Ok(d) => delegations.push(d),
                Err(e) => refusals.push(refuse(e)),
            }
        }
        if !refusals.is_empty() {
            return Step::Refuse(refusals);
        }
        if !delegations.is_empty() {
            // A turn whose delegations did not fit is refused as a whole. Its refusals are
            // recorded one at a time, and the ones left would fit once the first are gone:
            // they are refused with the same reason, so every prefix of the log decides
            // the same.
            if let Some(reason) = self.turn_refused_for_budget() {
                return Step::Refuse(
                    delegations
                        .iter()
                        .map(|d| Refusal {
                            call: d.call.clone(),
                            tool: RuntimeTool::CallAgent.as_str().into(),
                            error: reason.clone(),
                        })
                        .collect(),
                );
            }
            self.share_budget(&mut delegations);
            if let Some(free) = self.tokens_free() {
                let asked: u64 = delegations.iter().filter_map(|d| d.budget.tokens).sum();
                if asked > free {
                    // Refuse the explicit requests that do not fit, with the figures.
                    let refusals = delegations
                        .iter()
                        .map(|d| Refusal {
                            call: d.call.clone(),
                            tool: RuntimeTool::CallAgent.as_str().into(),
                            error: format!(
                                "{TURN_OVER_BUDGET} {asked} tokens, {free} remain of this \
                                 session's budget"
                            ),
                        })
                        .collect();
                    return Step::Refuse(refusals);
                }
            }
            return Step::Delegate(delegations);
        }
        if !runs.is_empty() {
            return Step::RunTools(runs);
        }
        if !proposals.is_empty() {
            return Step::ProposePatch(proposals);
        }
        // Calls whose `ToolCalled` is recorded come before new pauses: while a tool runs
        // its result is the next event (and after a crash its outcome is settled first).
        if !resumed.is_empty() {
            return Step::RunTools(resumed);
        }
        if !clarifications.is_empty() {
            return Step::Clarify(clarifications);
        }
        if !asks.is_empty() {
            return Step::AskUser(asks);
        }
        if !approvals.is_empty() {
            return Step::RequestApproval(approvals);
        }
        Step::Wait
    }

    fn clarify_of(
        &self,
        call: &crate::message::ToolCall,
        catalog: &dyn Catalog,
    ) -> Result<Clarify, String> {
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
            .children
            .values()
            .find(|c| c.child == child && !c.cached && !c.shared)
        else {
            return Err(format!(
                "ask_clarification: {} is not a sub-agent this session ran",
                child.display()
            ));
        };
        if info.outcome != Some("completed") {
            return Err(format!(
                "ask_clarification: {} has not completed; only a finished sub-agent can be \
                 asked a follow-up",
                child.display()
            ));
        }
        if !catalog.agent(&info.agent).is_some_and(|d| d.front.chat) {
            return Err(format!(
                "ask_clarification: agent `{}` does not take follow-up questions (its \
                 definition would say `chat: true`)",
                info.agent
            ));
        }
        Ok(Clarify {
            call: call.id.clone(),
            child,
            agent: info.agent.clone(),
            question: question.to_string(),
        })
    }

    /// Children without an explicit budget get an equal share of what is free.
    fn share_budget(&self, ds: &mut [Delegation]) {
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

    #[allow(clippy::too_many_arguments)]
    fn check_delegation(
        &self,
        def: &AgentDef,
        limits: &Limits,
        catalog: &dyn Catalog,
        call: &crate::message::ToolCall,
        depth: u32,
        path: &[String],
        children_in_turn: &mut u32,
        max_children: u32,
        n: &mut u32,
    ) -> Result<Delegation, String> {
        let args: CallAgentArgs = serde_json::from_value(call.args.clone())
            .map_err(|e| format!("call_agent: invalid arguments: {e}"))?;
        if let Some(token) = &args.resume_token {
            // The claims are read here; the signature and the child's state are checked by
            // the shell, which holds the secret.
            let claims = crate::token::peek(token)
                .map_err(|e| format!("call_agent: resume_token refused: {e}"))?;
            let Some(child) = self.children.values().find(|c| c.child == claims.session) else {
                return Err(format!(
                    "call_agent: resume_token refused: it belongs to session {}, which is not \
                     a sub-agent of this session",
                    claims.session.display()
                ));
            };
            let answers = args
                .answers
                .clone()
                .unwrap_or(Value::Object(Default::default()));
            if !answers.is_object() {
                return Err("call_agent: `answers` must be an object".into());
            }
            return Ok(Delegation {
                call: call.id.clone(),
                child: claims.session.clone(),
                agent: child.agent.clone(),
                mission: String::new(),
                context: None,
                inputs: Value::Null,
                custom: None,
                depth: depth + 1,
                budget: Budget::default(),
                ancestry: path.to_vec(),
                resume: Some(Resume {
                    token: token.clone(),
                    answers,
                }),
                grant: None,
            });
        }
        let mission = args
            .mission
            .filter(|m| !m.trim().is_empty())
            .ok_or("call_agent: `mission` is required and must not be empty")?;
        crate::limits::check_mission(
            &mission,
            args.context.as_deref(),
            args.inputs.as_ref().unwrap_or(&Value::Null),
        )
        .map_err(|e| format!("call_agent: {e}"))?;
        let (agent, custom) = match (&args.agent, &args.agent_definition) {
            (_, Some(custom)) => {
                let allowed: BTreeSet<String> = def
                    .allowed_tools()
                    .into_iter()
                    .filter(|t| !RuntimeTool::CallAgent.is(t))
                    .collect();
                let extra: Vec<&String> = custom
                    .tools
                    .iter()
                    .filter(|t| !allowed.contains(*t))
                    .collect();
                if !extra.is_empty() {
                    return Err(format!(
                        "call_agent: agent_definition asks for tools {} that `{}` does not \
                         have; a custom agent may use only: {}",
                        extra
                            .iter()
                            .map(|s| format!("`{s}`"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        def.name(),
                        join(&allowed)
                    ));
                }
                // The definition the child would run with must be one that loads (it is
                // within the size of an agent file): refused here, the model reads why.
                AgentDef::custom(def, &custom.system_prompt, &custom.tools)
                    .map_err(|e| format!("call_agent: agent_definition refused: {e}"))?;
                ("custom".to_string(), Some(custom.clone()))
            }
            (Some(a), None) => {
                if !def.front.agents.iter().any(|x| x == a) {
                    let what = if catalog.agent(a).is_some() {
                        "not allowed:"
                    } else {
                        "unknown"
                    };
                    return Err(format!(
                        "call_agent: {what} agent `{a}`; `{}` may call: {}",
                        def.name(),
                        def.front.agents.join(", ")
                    ));
                }
                let Some(target) = catalog.agent(a) else {
                    return Err(format!("call_agent: unknown agent `{a}`"));
                };
                if path.iter().any(|p| p == a) && !target.front.recursive {
                    return Err(format!(
                        "call_agent: agent `{a}` is already on this delegation path ({}); \
                         an agent may appear once unless its definition says \
                         `recursive: true`",
                        path.join(" → ")
                    ));
                }
                (a.clone(), None)
            }
            (None, None) => {
                return Err("call_agent: name an `agent` or give an `agent_definition`".into())
            }
        };
        if depth + 1 > limits.max_depth {
            return Err(format!(
                "call_agent: depth limit: the child would run at depth {}, the limit is {}",
                depth + 1,
                limits.max_depth
            ));
        }
        if *children_in_turn >= max_children {
            return Err(format!(
                "call_agent: at most {max_children} sub-agents per turn; this call would be \
                 number {}",
                *children_in_turn + 1
            ));
        }
        if let (Some(free), Some(b)) = (self.tokens_free(), args.budget.and_then(|b| b.tokens)) {
            if b > free {
                return Err(format!(
                    "call_agent: budget: asks for {b} tokens, {free} remain of this \
                     session's budget"
                ));
            }
        }
        *children_in_turn += 1;
        *n += 1;
        let child_budget = args.budget.unwrap_or_default().tokens.or_else(|| {
            catalog
                .agent(&agent)
                .and_then(|d| d.front.limits.max_tokens)
        });
        let Some(id) = &self.id else {
            return Err("call_agent: the session has no id yet".into());
        };
        let grant = if args.owns_tasks.is_empty() {
            None
        } else {
            let mut tasks = vec![];
            for t in &args.owns_tasks {
                match self.plan.get(t) {
                    Some(task) if !tasks.contains(task) => tasks.push(task.clone()),
                    Some(_) => {}
                    None => {
                        *children_in_turn -= 1;
                        *n -= 1;
                        return Err(format!(
                            "call_agent: owns_tasks: no task `{t}` in your plan (version {}); \
                             add it with `update_plan` first",
                            self.plan.version
                        ));
                    }
                }
            }
            Some(crate::event::PlanGrant {
                version: self.plan.version,
                tasks,
            })
        };
        Ok(Delegation {
            call: call.id.clone(),
            child: id.child(&agent, *n),
            agent,
            mission,
            context: args.context,
            inputs: args.inputs.unwrap_or(Value::Null),
            custom,
            depth: depth + 1,
            budget: Budget {
                tokens: child_budget,
            },
            ancestry: path.to_vec(),
            resume: None,
            grant,
        })
    }
}

fn ask_of(call: &crate::message::ToolCall) -> Result<Ask, String> {
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

fn join(set: &BTreeSet<String>) -> String {
    if set.is_empty() {
        "(no tools)".into()
    } else {
        set.iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl SessionState {
    /// The reason a delegation of the current turn was refused for the turn's budget, if
    /// one was.
    fn turn_refused_for_budget(&self) -> Option<String> {
        self.turn.iter().find_map(|slot| match &slot.state {
            crate::state::SlotState::Done {
                output,
                error: true,
            } if RuntimeTool::CallAgent.is(&slot.call.name)
                && output.starts_with(TURN_OVER_BUDGET) =>
            {
                Some(output.clone())
            }
            _ => None,
        })
    }
}
