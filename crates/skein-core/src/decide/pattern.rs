//! The orchestration patterns decided: the handoff of a finished answer, a router's
//! `handoff_to`, the advisors before the first model call, and the children of a pattern
//! turn (started like `call_agent` children, under the same depth, path and budget rules,
//! but by the front matter's leave rather than the `agents` list).

use serde::Deserialize;

use super::turn::Turn;
use super::{mission_message, Delegation, Refusal, Step};
use crate::agent::AgentDef;
use crate::event::{
    AdvisorsConsulted, Event, HandedOff, PatternCall, Routed, TeamRole, TeamSeat, TeamStarted,
};
use crate::limits::Budget;
use crate::message::ToolCall;
use crate::runtime_tool::RuntimeTool;
use crate::state::{
    handoff_mission, route_mission, split_call, PatternKind, SessionState, SlotState, MEMBER,
    SUPERVISOR,
};

/// The arguments of `handoff_to`, as the model sends them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandoffToArgs {
    agent: String,
    #[serde(default)]
    message: Option<String>,
}

impl SessionState {
    /// The request a pattern passes on: the one the chain started from, or this
    /// session's own mission as its model first read it.
    pub fn original_request(&self) -> String {
        let Some(sub) = &self.submitted else {
            return String::new();
        };
        sub.request
            .clone()
            .unwrap_or_else(|| mission_message(&sub.mission, sub.context.as_deref(), &sub.inputs))
    }

    /// The agent whose answer is pending: a handoff target's, a route's destination's,
    /// or this session's own.
    fn answer_author(&self) -> String {
        self.pattern
            .answer_from
            .clone()
            .or_else(|| self.submitted.as_ref().map(|s| s.agent.clone()))
            .unwrap_or_default()
    }

    /// An answer is pending: it goes on to the agent's `handoff`, once.
    pub(super) fn hand_off(&self, def: &AgentDef, answer: &str) -> Option<Step> {
        let to = def.front.handoff.as_ref()?;
        if self.pattern.handed_off {
            return None;
        }
        let from = self.answer_author();
        let mission = handoff_mission(&self.original_request(), &from, answer);
        Some(Step::Orchestrate(Box::new(Event::HandedOff(HandedOff {
            from,
            next: PatternCall {
                call: format!(
                    "{}.{}",
                    PatternKind::Handoff.call_name(),
                    self.accounting.delegations + 1
                ),
                agent: to.clone(),
                mission,
            },
        }))))
    }

    /// Before the first model call, the agent's advisors are consulted on its input.
    pub(super) fn consult(&self, def: &AgentDef) -> Option<Step> {
        if def.front.advisors.is_empty() || self.pattern.advice.is_some() || self.steps > 0 {
            return None;
        }
        let sub = self.submitted.as_ref()?;
        let advisors = def
            .front
            .advisors
            .iter()
            .enumerate()
            .map(|(i, a)| PatternCall {
                call: format!(
                    "{}.{}",
                    PatternKind::Advisors.call_name(),
                    self.accounting.delegations + 1 + i as u32
                ),
                agent: a.clone(),
                mission: sub.mission.clone(),
            })
            .collect();
        Some(Step::Orchestrate(Box::new(Event::AdvisorsConsulted(
            AdvisorsConsulted { advisors },
        ))))
    }
}

impl SessionState {
    /// A session whose agent has a `team` starts it instead of calling its own model:
    /// every member and the supervisor at once.
    pub(super) fn start_team(&self, def: &AgentDef) -> Option<Step> {
        let team = def.front.team.as_ref()?;
        if self.team.ran || self.steps > 0 {
            return None;
        }
        let sub = self.submitted.as_ref()?;
        let first = self.accounting.delegations + 1;
        let call = |name: &str, n: u32, agent: &str| PatternCall {
            call: format!("{name}.{n}"),
            agent: agent.to_string(),
            mission: sub.mission.clone(),
        };
        let members: Vec<PatternCall> = team
            .members
            .iter()
            .enumerate()
            .map(|(i, a)| call(MEMBER, first + i as u32, a))
            .collect();
        let supervisor = call(SUPERVISOR, first + members.len() as u32, &team.supervisor);
        Some(Step::Orchestrate(Box::new(Event::TeamStarted(
            TeamStarted {
                members,
                supervisor,
            },
        ))))
    }
}

impl Turn<'_> {
    /// A router's `handoff_to` call, checked.
    pub(super) fn route_of(&self, call: &ToolCall) -> Result<Routed, String> {
        let name = RuntimeTool::HandoffTo.as_str();
        let Some(router) = &self.def.front.router else {
            return Err(format!(
                "{name}: agent `{}` is not a router",
                self.def.name()
            ));
        };
        let destinations = router.destinations.join(", ");
        if self.state.turn.len() > 1 {
            return Err(format!(
                "{name} ends your session and hands the request on: call it alone in its \
                 turn, with no other tool call"
            ));
        }
        let args: HandoffToArgs = serde_json::from_value(call.args.clone()).map_err(|e| {
            format!("{name}: invalid arguments: {e}; expected {{agent, message?}}, agent one of: {destinations}")
        })?;
        if !router.destinations.contains(&args.agent) {
            return Err(format!(
                "{name}: `{}` is not a destination of `{}`; choose one of: {destinations}",
                args.agent,
                self.def.name()
            ));
        }
        let request = self.state.original_request();
        let mission = route_mission(&request, self.def.name(), args.message.as_deref());
        Ok(Routed {
            call: call.id.clone(),
            message: args.message,
            next: PatternCall {
                call: format!(
                    "{}.{}",
                    PatternKind::Route.call_name(),
                    self.state.accounting.delegations + 1
                ),
                agent: args.agent,
                mission,
            },
        })
    }

    /// The step of a pattern turn: its calls not yet started are delegated (or refused
    /// when depth, path or the catalogue forbid them); then it waits.
    pub(super) fn pattern_step(&mut self, kind: PatternKind) -> Step {
        let mut refusals = vec![];
        let mut delegations = vec![];
        let st = self.state;
        let mut approvals = vec![];
        // A child a pattern starts passes the gate a `call_agent` child passes: when its
        // agent's delegations wait for approval, so do these.
        let gated = self.needs_approval(RuntimeTool::CallAgent.as_str());
        for slot in &st.turn {
            let approved = matches!(slot.state, SlotState::Approved);
            if !matches!(slot.state, SlotState::Pending) && !approved {
                continue;
            }
            if gated && !approved {
                approvals.push(super::ApprovalAsk {
                    call: slot.call.id.clone(),
                    tool: slot.call.name.clone(),
                    preview: slot.call.args.to_string(),
                });
                continue;
            }
            match self.pattern_child(kind, &slot.call) {
                Ok(d) => delegations.push(d),
                Err(error) => refusals.push(Refusal {
                    call: slot.call.id.clone(),
                    tool: slot.call.name.clone(),
                    error,
                    kind: None,
                }),
            }
        }
        if !refusals.is_empty() {
            return Step::Refuse(refusals);
        }
        if delegations.is_empty() {
            if !approvals.is_empty() {
                return Step::RequestApproval(approvals);
            }
            return Step::Wait;
        }
        st.share_budget(&mut delegations);
        Step::Delegate(delegations)
    }

    fn pattern_child(&mut self, kind: PatternKind, call: &ToolCall) -> Result<Delegation, String> {
        let field = |k: &str| {
            call.args
                .get(k)
                .and_then(serde_json::Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let (agent, mission) = (field("agent"), field("mission"));
        let what = kind.call_name();
        let Some(target) = self.catalog.agent(&agent) else {
            return Err(format!("{what}: unknown agent `{agent}`"));
        };
        if self.path.contains(&agent) && !target.front.recursive {
            return Err(format!(
                "{what}: agent `{agent}` is already on this delegation path ({}); an agent \
                 may appear once unless its definition says `recursive: true`",
                self.path.join(" → ")
            ));
        }
        // A handoff or a route is a transfer, not a nesting: the next agent takes over at
        // the depth of the session that started the chain, so a chain of any length (its
        // cycles are refused at load) runs wherever its first agent may run. Advisors and
        // a team's participants work under this session, one level down.
        let transfer = matches!(kind, PatternKind::Handoff | PatternKind::Route);
        let depth = if transfer {
            self.depth
        } else {
            self.depth.saturating_add(1)
        };
        if depth > self.limits.max_depth {
            return Err(format!(
                "{what}: depth limit: `{agent}` would run at depth {depth}, the limit is {}",
                self.limits.max_depth
            ));
        }
        let Some(id) = &self.state.id else {
            return Err(format!("{what}: the session has no id yet"));
        };
        let sub = self.state.submitted.as_ref();
        // Advisors and team participants read the agent's own input; the steps of a chain
        // read the request in their mission's blocks.
        let own_input = matches!(kind, PatternKind::Advisors | PatternKind::Team);
        self.delegations += 1;
        // A team's participants are numbered by their call ids, so that each knows the
        // others' sessions before any is started.
        let number = match kind {
            PatternKind::Team => split_call(&call.id).map_or(self.delegations, |(_, n)| n),
            _ => self.delegations,
        };
        let (team, max_steps) = match (kind, self.def.front.team.as_ref()) {
            (PatternKind::Team, Some(t)) => {
                let supervisor = call.name == SUPERVISOR;
                let peers = self
                    .state
                    .turn
                    .iter()
                    .filter(|s| s.call.id != call.id)
                    .filter_map(|s| {
                        let (_, n) = split_call(&s.call.id)?;
                        let a = s.call.args.get("agent")?.as_str()?;
                        Some(id.child(a, n))
                    })
                    .collect();
                let seat = TeamSeat {
                    host: id.clone(),
                    role: if supervisor {
                        TeamRole::Supervisor
                    } else {
                        TeamRole::Member
                    },
                    peers,
                    members: t.members.len() as u32,
                };
                let turns = if supervisor {
                    t.supervisor_max_turns
                } else {
                    t.member_max_turns
                };
                (Some(seat), turns)
            }
            _ => (None, None),
        };
        Ok(Delegation {
            call: call.id.clone(),
            child: id.child(&agent, number),
            mission,
            context: sub.filter(|_| own_input).and_then(|s| s.context.clone()),
            inputs: sub
                .filter(|_| own_input)
                .map(|s| s.inputs.clone())
                .unwrap_or_default(),
            custom: None,
            depth,
            budget: Budget {
                tokens: target.front.limits.max_tokens,
                max_steps,
            },
            ancestry: self.path.clone(),
            resume: None,
            grant: None,
            request: (!own_input).then(|| self.state.original_request()),
            allowed_tools: None,
            team,
            agent,
        })
    }
}
