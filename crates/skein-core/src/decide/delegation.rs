//! A `call_agent` call checked: a resume of a paused child, or a new child whose agent,
//! mission, depth, number in the turn, budget and plan tasks are within what this session
//! may ask for. A refusal is the text the model reads.

use std::collections::BTreeSet;

use serde_json::Value;

use super::turn::Turn;
use super::{join, CallAgentArgs, Delegation, Resume};
use crate::agent::AgentDef;
use crate::limits::Budget;
use crate::message::ToolCall;
use crate::runtime_tool::RuntimeTool;

impl Turn<'_> {
    /// The child `call` starts, or why it is refused. The turn's counters advance only
    /// for a child that starts.
    pub(super) fn delegate(&mut self, call: &ToolCall) -> Result<Delegation, String> {
        let args: CallAgentArgs = serde_json::from_value(call.args.clone())
            .map_err(|e| format!("call_agent: invalid arguments: {e}"))?;
        if let Some(token) = &args.resume_token {
            // The claims are read here; the signature and the child's state are checked by
            // the shell, which holds the secret.
            let claims = crate::token::peek(token)
                .map_err(|e| format!("call_agent: resume_token refused: {e}"))?;
            let Some(child) = self
                .state
                .children
                .values()
                .find(|c| c.child == claims.session)
            else {
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
                depth: self.depth.saturating_add(1),
                budget: Budget::default(),
                ancestry: self.path.clone(),
                resume: Some(Resume {
                    token: token.clone(),
                    answers,
                }),
                grant: None,
                request: None,
                allowed_tools: None,
                team: None,
            });
        }
        if args.planning_strategy.is_some() {
            return Err(
                "call_agent: `planning_strategy` is not supported: a sub-agent does not \
                        take a planning strategy per call. To have it plan, give its agent \
                        `update_plan`; to hand it tasks of your plan, pass `owns_tasks`; to \
                        shape how it works, say so in `mission` or in a custom \
                        `agent_definition.system_prompt`"
                    .into(),
            );
        }
        if args.shared_context.is_some() {
            return Err(
                "call_agent: `shared_context` is not supported: a sub-agent reads only what \
                 its own call gives it. Put what it needs in this call's `context` (text, or \
                 an object shown to it as JSON); what every session of the tree needs \
                 belongs in the root submission's `context`, which you can pass on"
                    .into(),
            );
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
                let allowed: BTreeSet<String> = self
                    .def
                    .allowed_tools()
                    .into_iter()
                    .filter(|t| !RuntimeTool::CallAgent.is(t))
                    .collect();
                let extra: Vec<&String> = custom
                    .tools
                    .iter()
                    .filter(|t| !crate::agent::tool_allowed(&allowed, t))
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
                        self.def.name(),
                        join(&allowed)
                    ));
                }
                // The definition the child would run with must be one that loads (it is
                // within the size of an agent file): refused here, the model reads why.
                AgentDef::custom(self.def, &custom.system_prompt, &custom.tools)
                    .map_err(|e| format!("call_agent: agent_definition refused: {e}"))?;
                ("custom".to_string(), Some(custom.clone()))
            }
            (Some(a), None) => {
                if !self.def.front.agents.iter().any(|x| x == a) {
                    let what = if self.catalog.agent(a).is_some() {
                        "not allowed:"
                    } else {
                        "unknown"
                    };
                    return Err(format!(
                        "call_agent: {what} agent `{a}`; `{}` may call: {}",
                        self.def.name(),
                        self.def.front.agents.join(", ")
                    ));
                }
                let Some(target) = self.catalog.agent(a) else {
                    return Err(format!("call_agent: unknown agent `{a}`"));
                };
                if self.path.iter().any(|p| p == a) && !target.front.recursive {
                    return Err(format!(
                        "call_agent: agent `{a}` is already on this delegation path ({}); \
                         an agent may appear once unless its definition says \
                         `recursive: true`",
                        self.path.join(" → ")
                    ));
                }
                (a.clone(), None)
            }
            (None, None) => {
                return Err("call_agent: name an `agent` or give an `agent_definition`".into())
            }
        };
        if let Some(only) = &args.allowed_tools {
            let has: BTreeSet<String> = match &custom {
                Some(c) => c.tools.iter().cloned().collect(),
                None => self
                    .catalog
                    .agent(&agent)
                    .map(AgentDef::allowed_tools)
                    .unwrap_or_default(),
            };
            // A tool of a server the agent has whole (`SERVER__*`) is one it has.
            let extra: Vec<String> = only
                .iter()
                .filter(|t| !has.contains(*t) && !crate::agent::tool_allowed(&has, t))
                .map(|t| format!("`{t}`"))
                .collect();
            if !extra.is_empty() {
                return Err(format!(
                    "call_agent: allowed_tools narrows the tools of `{agent}` and cannot add \
                     any: it does not have {}; it has: {}",
                    extra.join(", "),
                    join(&has)
                ));
            }
        }
        if self.depth >= self.limits.max_depth {
            return Err(format!(
                "call_agent: depth limit: the child would run at depth {}, the limit is {}",
                self.depth.saturating_add(1),
                self.limits.max_depth
            ));
        }
        if self.children >= self.max_children {
            return Err(format!(
                "call_agent: at most {} sub-agents per turn; this call would be \
                 number {}",
                self.max_children,
                self.children + 1
            ));
        }
        if let (Some(free), Some(b)) =
            (self.state.tokens_free(), args.budget.and_then(|b| b.tokens))
        {
            if b > free {
                return Err(format!(
                    "call_agent: budget: asks for {b} tokens, {free} remain of this \
                     session's budget"
                ));
            }
        }
        let child_budget = args.budget.unwrap_or_default().tokens.or_else(|| {
            self.catalog
                .agent(&agent)
                .and_then(|d| d.front.limits.max_tokens)
        });
        let Some(id) = &self.state.id else {
            return Err("call_agent: the session has no id yet".into());
        };
        let grant = if args.owns_tasks.is_empty() {
            None
        } else {
            let mut tasks = vec![];
            for t in &args.owns_tasks {
                match self.state.planning.plan.get(t) {
                    Some(task) if !tasks.contains(task) => tasks.push(task.clone()),
                    Some(_) => {}
                    None => {
                        return Err(format!(
                            "call_agent: owns_tasks: no task `{t}` in your plan (version {}); \
                             add it with `update_plan` first",
                            self.state.planning.plan.version
                        ));
                    }
                }
            }
            Some(crate::event::PlanGrant {
                version: self.state.planning.plan.version,
                tasks,
            })
        };
        // Counted only now that the call is sure to start a child.
        self.children += 1;
        self.delegations += 1;
        Ok(Delegation {
            call: call.id.clone(),
            child: id.child(&agent, self.delegations),
            agent,
            mission,
            context: args.context,
            inputs: args.inputs.unwrap_or(Value::Null),
            custom,
            depth: self.depth.saturating_add(1),
            budget: Budget {
                tokens: child_budget,
                max_steps: args.budget.and_then(|b| b.max_steps),
            },
            ancestry: self.path.clone(),
            resume: None,
            grant,
            request: None,
            allowed_tools: args.allowed_tools,
            team: None,
        })
    }
}
