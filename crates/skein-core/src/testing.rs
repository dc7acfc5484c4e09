//! A given/when/then kit for the core's decide step, for tests of this crate and of the
//! crates that build on it (the fuzzer's targets, the benchmarks). Built only with the
//! `testing` feature.
//!
//! - **given** a session's log (the events, in order) under a set of agents and limits,
//! - **when** the log is folded and `next` decides (or a sub-agent's patch is merged into
//!   the plan the log folds to),
//! - **then** an expected [`Step`], or a refusal whose text names the reason.
//!
//! The events are built by the small constructors below, so each example reads as the log
//! it stands for.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::decide::{ApprovalAsk, Clarify, Delegation, PlanEdit, Refusal, Step};
use crate::event::{
    ChildSettled, Delegated, ModelCalled, Outcome, PatchApplied, Submitted, ToolReturned,
};
use crate::plan::{Author, Patch, Rejection};
use crate::{
    AgentSet, Budget, Envelope, Event, Limits, ModelResponse, SessionId, SessionState, ToolCall,
    Usage,
};
use serde_json::{json, Value};

/// The world a session is decided in: its agents, the limits in force, and whose session
/// the log is.
pub struct Given {
    agents: AgentSet,
    agent: String,
    limits: Limits,
    log: Vec<Event>,
}

/// Agents from `(name, front matter lines)`: each runs `scripted:<name>`.
pub fn agents(defs: &[(&str, &str)]) -> AgentSet {
    let files: Vec<(String, String)> = defs
        .iter()
        .map(|(name, extra)| {
            (
                format!("{name}.md"),
                format!("---\nname: {name}\nmodel: scripted:{name}\n{extra}---\nYou are {name}.\n"),
            )
        })
        .collect();
    AgentSet::load(&files, &[]).expect("the kit's agents load")
}

/// Agents from `(name, front matter lines, script)`, as [`agents`], each one's script
/// for the scripted model written to `dir` as `<name>.yaml`.
pub fn scripted_agents(dir: &std::path::Path, defs: &[(&str, &str, &str)]) -> AgentSet {
    for (name, _, script) in defs {
        std::fs::write(dir.join(format!("{name}.yaml")), script).expect("the script is written");
    }
    let fronts: Vec<(&str, &str)> = defs
        .iter()
        .map(|(name, front, _)| (*name, *front))
        .collect();
    agents(&fronts)
}

/// Given a session of `agent` (one of `agents`), under the default limits.
pub fn given(agents: AgentSet, agent: &str) -> Given {
    assert!(agents.get(agent).is_some(), "no agent `{agent}` in the set");
    Given {
        agents,
        agent: agent.into(),
        limits: Limits::default(),
        log: vec![],
    }
}

impl Given {
    /// The limits in force instead of the defaults.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// These events, appended to the log.
    pub fn events(mut self, events: impl IntoIterator<Item = Event>) -> Self {
        self.log.extend(events);
        self
    }

    /// The log as envelopes of the root session, numbered from 1.
    pub fn log_envelopes(&self) -> Vec<Envelope> {
        let id = root();
        self.log
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, e)| Envelope::new(id.clone(), i as u64 + 1, 1, String::new(), e))
            .collect()
    }

    /// The log folded.
    pub fn state(&self) -> SessionState {
        SessionState::fold(&self.log_envelopes())
    }

    /// When the folded log is decided.
    pub fn when_deciding(&self) -> Then {
        let def = self.agents.get(&self.agent).unwrap();
        Then {
            step: self.state().next(def, &self.limits, &self.agents),
        }
    }

    /// When the sub-agent `child` (running `agent`) proposes `patch` (the `propose_patch`
    /// arguments) to the plan the log folds to, merged as the shell merges it.
    pub fn when_proposing(&self, child: &SessionId, agent: &str, patch: Value) -> Verdict {
        let patch = Patch::from_args(&patch).expect("the kit's patch reads");
        let from = child.to_string();
        let author = Author::Delegate {
            session: &from,
            agent,
        };
        Verdict(
            self.state()
                .planning
                .plan
                .merge(author, &patch, self.limits.plan_unlink)
                .map(|p| p.version),
        )
    }
}

/// What the decide step said.
#[derive(Debug)]
pub struct Then {
    pub step: Step,
}

impl Then {
    /// Then the call `call` is refused, and the reason names `reason`.
    pub fn then_refused(self, call: &str, reason: &str) -> Refusal {
        let Step::Refuse(refusals) = &self.step else {
            panic!("expected a refusal of `{call}`, decided {:?}", self.step)
        };
        let Some(r) = refusals.iter().find(|r| r.call == call) else {
            panic!("expected a refusal of `{call}`, refused {refusals:?}")
        };
        assert!(
            r.error.contains(reason),
            "the refusal of `{call}` does not name `{reason}`: {}",
            r.error
        );
        r.clone()
    }

    /// Then the delegations are started, one per call named, in order.
    pub fn then_delegates(self, calls: &[&str]) -> Vec<Delegation> {
        let Step::Delegate(ds) = self.step else {
            panic!("expected delegations {calls:?}, decided {:?}", self.step)
        };
        let got: Vec<&str> = ds.iter().map(|d| d.call.as_str()).collect();
        assert_eq!(got, calls, "delegated calls");
        ds
    }

    /// Then these tools run (`(call, tool)` in order).
    pub fn then_runs(self, runs: &[(&str, &str)]) {
        let Step::RunTools(rs) = &self.step else {
            panic!("expected tools {runs:?} to run, decided {:?}", self.step)
        };
        let got: Vec<(&str, &str)> = rs
            .iter()
            .map(|r| (r.call.as_str(), r.tool.as_str()))
            .collect();
        assert_eq!(got, runs, "tools run");
    }

    /// Then approval is asked for these calls (`(call, tool)` in order).
    pub fn then_asks_approval(self, asks: &[(&str, &str)]) -> Vec<ApprovalAsk> {
        let Step::RequestApproval(v) = self.step else {
            panic!("expected approval for {asks:?}, decided {:?}", self.step)
        };
        let got: Vec<(&str, &str)> = v
            .iter()
            .map(|a| (a.call.as_str(), a.tool.as_str()))
            .collect();
        assert_eq!(got, asks, "approval asked for");
        v
    }

    /// Then a follow-up question goes to a finished sub-agent.
    pub fn then_clarifies(self, call: &str) -> Clarify {
        let Step::Clarify(v) = &self.step else {
            panic!("expected a follow-up for `{call}`, decided {:?}", self.step)
        };
        let Some(c) = v.iter().find(|c| c.call == call) else {
            panic!("no follow-up for `{call}` in {v:?}")
        };
        c.clone()
    }

    /// Then the owner's own plan edit is recorded with this verdict.
    pub fn then_edits_plan(self, call: &str) -> PlanEdit {
        let Step::EditPlan(e) = self.step else {
            panic!("expected the plan edit `{call}`, decided {:?}", self.step)
        };
        assert_eq!(e.call, call, "the plan edit decided");
        e
    }

    /// Then the model is called.
    pub fn then_calls_model(self) {
        assert!(
            matches!(self.step, Step::CallModel { .. }),
            "expected a model call, decided {:?}",
            self.step
        );
    }

    /// Then a pattern event is recorded (a handoff, a route, the advisors consulted).
    pub fn then_orchestrates(self) -> Event {
        let Step::Orchestrate(e) = self.step else {
            panic!("expected a pattern event, decided {:?}", self.step)
        };
        *e
    }

    /// Then the session completes with this answer.
    pub fn then_completes(self, answer: &str) {
        let Step::Complete { answer: got } = &self.step else {
            panic!(
                "expected completion with {answer:?}, decided {:?}",
                self.step
            )
        };
        assert_eq!(got, answer, "the answer");
    }

    /// Then the session fails, and the error names `reason`.
    pub fn then_fails(self, reason: &str) -> String {
        let Step::Fail { error } = self.step else {
            panic!(
                "expected a failure naming `{reason}`, decided {:?}",
                self.step
            )
        };
        assert!(
            error.contains(reason),
            "the failure does not name `{reason}`: {error}"
        );
        error
    }
}

/// What merging a sub-agent's patch said: the new plan version, or why not.
#[derive(Debug)]
pub struct Verdict(pub Result<u64, Rejection>);

impl Verdict {
    /// Then the patch is rejected, and the reason (as the model reads it) names `reason`.
    pub fn then_rejected(self, reason: &str) -> Rejection {
        let Err(r) = self.0 else {
            panic!(
                "expected a rejection naming `{reason}`, accepted as {:?}",
                self.0
            )
        };
        assert!(
            r.to_string().contains(reason),
            "the rejection does not name `{reason}`: {r}"
        );
        r
    }

    /// Then the patch is accepted as this version.
    pub fn then_accepted(self, version: u64) {
        assert_eq!(self.0, Ok(version), "the patch's verdict");
    }
}

// ---- events -------------------------------------------------------------------------

impl Submitted {
    /// A root session of `agent`, with placeholder digests and mission, no parent, no
    /// budget, the default pool: change what a test is about with `..Submitted::for_test`.
    pub fn for_test(agent: &str) -> Self {
        Submitted {
            agent: agent.into(),
            def_digest: "digest".into(),
            mission: "the mission".into(),
            context: None,
            inputs: Value::Null,
            mission_hash: "hash".into(),
            parent: None,
            depth: 0,
            budget: Budget::default(),
            trace: None,
            ancestry: vec![],
            no_cache: false,
            forked_from: None,
            pool: None,
            plan: None,
            request: None,
            allowed_tools: None,
            team: None,
            defs: None,
            priority: None,
        }
    }
}

/// The first record of `session`'s log, sealed as a log stores it, with `body`.
pub fn first_record(session: &SessionId, body: Event) -> crate::Record {
    let env = Envelope::new(
        session.clone(),
        1,
        1_700_000_000_000,
        crate::event::genesis_hash(session),
        body,
    );
    crate::Record::decode(env.encode().expect("an envelope encodes"))
        .expect("an encoded envelope decodes")
}

/// The root session of `agent` was submitted (no budget).
pub fn submitted(agent: &str) -> Event {
    submitted_with(agent, 0, &[], None)
}

/// A session of `agent` was submitted at `depth`, below the agents of `ancestry` (root
/// first), with a token `budget`.
pub fn submitted_with(agent: &str, depth: u32, ancestry: &[&str], budget: Option<u64>) -> Event {
    Event::Submitted(Submitted {
        depth,
        budget: Budget {
            tokens: budget,
            max_steps: None,
        },
        ancestry: ancestry.iter().map(|a| a.to_string()).collect(),
        ..Submitted::for_test(agent)
    })
}

/// One model turn that made these calls `(id, tool, args)` and spent `tokens` (input).
pub fn turn(calls: &[(&str, &str, Value)], tokens: u64) -> Event {
    Event::ModelCalled(ModelCalled {
        model: "scripted".into(),
        request_digest: String::new(),
        response: ModelResponse {
            content: None,
            tool_calls: calls
                .iter()
                .map(|(id, name, args)| ToolCall {
                    id: id.to_string(),
                    name: name.to_string(),
                    args: args.clone(),
                })
                .collect(),
            finish_reason: None,
        },
        usage: Usage {
            input_tokens: tokens,
            ..Usage::default()
        },
        latency_ms: 0,
        worker: String::new(),
    })
}

/// A `call_agent` call's arguments: `agent` on `mission`.
pub fn call(agent: &str, mission: &str) -> Value {
    json!({"agent": agent, "mission": mission})
}

/// The sub-agent `child` of `agent` was started for `call`, handed `owns_tasks`.
pub fn delegated(call: &str, child: &SessionId, agent: &str, owns_tasks: &[&str]) -> Event {
    Event::Delegated(Delegated {
        call: call.into(),
        child: child.clone(),
        agent: agent.into(),
        mission_hash: "x".into(),
        allotted_tokens: None,
        kind: crate::event::DelegationKind::Started,
        owns_tasks: owns_tasks.iter().map(|t| t.to_string()).collect(),
        max_steps: None,
    })
}

/// The sub-agent `child` started for `call` answered `answer`.
pub fn child_completed(call: &str, child: &SessionId, answer: &str) -> Event {
    Event::ChildSettled(ChildSettled {
        call: call.into(),
        child: child.clone(),
        outcome: Outcome::Completed {
            answer: answer.into(),
            patch: None,
            usage: Usage::default(),
            steps: 1,
            partial: false,
        },
    })
}

/// The sub-agent `child` started for `call` failed with `error`.
pub fn child_failed(call: &str, child: &SessionId, error: &str) -> Event {
    Event::ChildSettled(ChildSettled {
        call: call.into(),
        child: child.clone(),
        outcome: Outcome::Failed {
            error: error.into(),
            usage: Usage::default(),
            steps: 1,
        },
    })
}

/// A model turn that answered `text` (no tool calls).
pub fn answered(text: &str) -> Event {
    Event::ModelCalled(ModelCalled {
        model: "scripted".into(),
        request_digest: String::new(),
        response: ModelResponse {
            content: Some(text.into()),
            tool_calls: vec![],
            finish_reason: None,
        },
        usage: Usage::default(),
        latency_ms: 0,
        worker: String::new(),
    })
}

/// The tool call `call` returned `output`.
pub fn returned(call: &str, output: &str) -> Event {
    Event::ToolReturned(ToolReturned {
        call: call.into(),
        output: output.into(),
        error: false,
        ms: 0,
        blob: None,
        refused: None,
    })
}

/// The session's own plan edit `call` was applied as `version`.
pub fn plan_applied(call: &str, agent: &str, patch: Value, version: u64) -> Event {
    let patch = Patch::from_args(&patch).expect("the kit's patch reads");
    Event::PatchApplied(PatchApplied {
        from: crate::plan::SELF.into(),
        agent: agent.into(),
        call: Some(call.into()),
        base_version: patch.base_version,
        ops: patch.ops,
        version,
    })
}

/// The root's id, `r1`.
pub fn root() -> SessionId {
    SessionId::root("r1").unwrap()
}
