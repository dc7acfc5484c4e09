//! Schemas of the tools the runtime itself handles (the model sees them like any tool).

use serde_json::{json, Value};
use skein_core::{AgentDef, RuntimeTool, ToolSpec};

/// `call_agent`, with `agent` an enum of the sub-agents `def` may call.
pub fn call_agent_spec(def: &AgentDef) -> ToolSpec {
    let mut agent = json!({
        "type": "string",
        "description": "The specialist to delegate to.",
    });
    if !def.front.agents.is_empty() {
        agent["enum"] = Value::from(def.front.agents.clone());
    }
    if def.delegation_tool() == skein_core::DELEGATE_TO_AGENT {
        return delegate_to_agent_spec(agent);
    }
    ToolSpec {
        name: RuntimeTool::CallAgent.as_str().into(),
        description: "Delegate a sub-mission to a specialist agent. It runs in its own \
                      session with its own context and returns \
                      {success, result, session_id, steps_taken, usage, error?}. Several \
                      calls in one turn run in parallel."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "agent": agent,
                "mission": {"type": "string", "description": "What the sub-agent must do."},
                "context": {"type": "string", "description": "Background it needs."},
                "inputs": {"type": "object", "description": "Structured inputs."},
                "agent_definition": {
                    "type": "object",
                    "description": "A custom agent made for this call; its tools must be a \
                                    subset of yours.",
                    "properties": {
                        "system_prompt": {"type": "string"},
                        "tools": {"type": "array", "items": {"type": "string"}}
                    },
                    "required": ["system_prompt"]
                },
                "budget": {
                    "type": "object",
                    "properties": {
                        "tokens": {"type": "integer", "minimum": 0},
                        "max_steps": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "Model turns it may make (fewer than its own limit)."
                        }
                    }
                },
                "allowed_tools": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Only these of the sub-agent's tools (narrows, never widens)."
                },
                "resume_token": {"type": "string"},
                "answers": {"type": "object"},
                "owns_tasks": {"type": "array", "items": {"type": "string"}}
            },
            "additionalProperties": false
        })
        .into(),
    }
}

/// `call_agent` under the name and argument names of references 002-004:
/// `delegate_to_agent(agent, task, context)` (also read: `agent_name`, `skill_name`; and
/// every other `call_agent` argument).
fn delegate_to_agent_spec(agent: Value) -> ToolSpec {
    ToolSpec {
        name: skein_core::DELEGATE_TO_AGENT.into(),
        description: "Delegate a task to a specialist agent. It runs in its own session \
                      and returns {success, result, agent_name, depth, session_id, \
                      steps_taken, usage, error?, error_type?}. Several calls in one turn \
                      run in parallel."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "agent": agent,
                "task": {"type": "string", "description": "What the specialist must do."},
                "context": {
                    "description": "Background it needs: text, or an object.",
                    "anyOf": [{"type": "string"}, {"type": "object"}]
                },
                "inputs": {"type": "object", "description": "Structured inputs."},
                "allowed_tools": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Only these of the specialist's tools (narrows, never widens)."
                },
                "budget": {
                    "type": "object",
                    "properties": {
                        "tokens": {"type": "integer", "minimum": 0},
                        "max_steps": {"type": "integer", "minimum": 1}
                    }
                },
                "resume_token": {"type": "string"},
                "answers": {"type": "object"}
            },
            "required": ["agent", "task"],
            "additionalProperties": false
        })
        .into(),
    }
}

/// `handoff_to`: a router's exit, with `agent` an enum of its destinations. None for an
/// agent that is not a router.
pub fn handoff_to_spec(def: &AgentDef) -> Option<ToolSpec> {
    let router = def.front.router.as_ref()?;
    Some(ToolSpec {
        name: RuntimeTool::HandoffTo.as_str().into(),
        description: "Hand the user's request on to one of your destinations and end your \
                      session: the destination answers in your place. Call it alone in its \
                      turn. Answer yourself instead when the request needs no specialist."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "agent": {
                    "type": "string",
                    "enum": router.destinations,
                    "description": "The destination that takes the request."
                },
                "message": {
                    "type": "string",
                    "description": "A note for the destination, shown beside the request."
                }
            },
            "required": ["agent"],
            "additionalProperties": false
        })
        .into(),
    })
}

/// `team_broadcast`: a message to every other member of the team and its supervisor.
pub fn team_broadcast_spec() -> ToolSpec {
    ToolSpec {
        name: RuntimeTool::TeamBroadcast.as_str().into(),
        description: "Tell the rest of your team something: every member still at work and \
                      the supervisor read it before their next turn. Your final answer is \
                      your last broadcast."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {
                    "type": "string",
                    "enum": ["update", "failure"],
                    "description": "`failure` when you are stuck or something went wrong."
                }
            },
            "required": ["message"],
            "additionalProperties": false
        })
        .into(),
    }
}

/// `ask_clarification`: a follow-up question to a finished `chat: true` sub-agent.
/// `children`: the session ids that can take one now (finished, `chat: true`), offered
/// as an enum when there are any.
pub fn ask_clarification_spec(children: &[String]) -> ToolSpec {
    let mut session_id = json!({"type": "string", "description": "The sub-agent's session id."});
    if !children.is_empty() {
        session_id["enum"] = Value::from(children.to_vec());
    }
    ToolSpec {
        name: RuntimeTool::AskClarification.as_str().into(),
        description: "Ask a sub-agent that already answered (one whose definition says \
                      `chat: true`) a follow-up question; it answers again with its whole \
                      conversation in mind."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "session_id": session_id,
                "question": {"type": "string"}
            },
            "required": ["session_id", "question"],
            "additionalProperties": false
        })
        .into(),
    }
}

/// `ask_user`: pause and ask a person (or, for a sub-agent, its parent).
pub fn ask_user_spec() -> ToolSpec {
    ToolSpec {
        name: RuntimeTool::AskUser.as_str().into(),
        description: "Ask for information you cannot find yourself. The session pauses \
                      until the answers arrive."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "questions": {
                    "type": "array",
                    "items": {"anyOf": [
                        {"type": "string"},
                        {"type": "object", "properties": {"key": {"type": "string"}, "question": {"type": "string"}}, "required": ["question"]}
                    ]}
                },
                "context": {"type": "string"},
                "proposed_defaults": {"type": "object"}
            },
            "required": ["questions"]
        })
        .into(),
    }
}

/// The operations of a plan patch, as the model sees them.
fn patch_ops_schema() -> Value {
    let task = json!({
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "string", "enum": ["PENDING", "IN_PROGRESS", "COMPLETED", "FAILED", "BLOCKED"]},
            "depends_on": {"type": "array", "items": {"type": "string"}},
            "notes": {"type": "string"},
            "owner_agent": {"type": "string"}
        },
        "required": ["id", "title"]
    });
    json!({
        "type": "array",
        "items": {"anyOf": [
            {"type": "object", "properties": {"op": {"const": "add"}, "task": task}, "required": ["op", "task"]},
            {"type": "object", "properties": {"op": {"const": "add_subtask"}, "parent_id": {"type": "string"}, "task": task}, "required": ["op", "parent_id", "task"]},
            {"type": "object", "properties": {"op": {"const": "update"}, "task_id": {"type": "string"}, "fields": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "status": {"type": "string", "enum": ["PENDING", "IN_PROGRESS", "COMPLETED", "FAILED", "BLOCKED"]},
                    "notes": {"type": "string"},
                    "owner_agent": {"type": "string"}
                }
            }}, "required": ["op", "task_id", "fields"]},
            {"type": "object", "properties": {"op": {"const": "link_dep"}, "task_id": {"type": "string"}, "depends_on": {"type": "string"}}, "required": ["op", "task_id", "depends_on"]},
            {"type": "object", "properties": {"op": {"const": "unlink_dep"}, "task_id": {"type": "string"}, "depends_on": {"type": "string"}}, "required": ["op", "task_id", "depends_on"]}
        ]}
    })
}

/// `update_plan`: the plan owner's own edits.
pub fn update_plan_spec() -> ToolSpec {
    ToolSpec {
        name: RuntimeTool::UpdatePlan.as_str().into(),
        description: "Change your plan (the todo list you own). Returns {status: \"accepted\", \
                      version, plan} with the plan as Markdown, or why the change was refused. \
                      Hand tasks to a sub-agent with `call_agent {owns_tasks}`."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "base_version": {"type": "integer", "minimum": 0, "description": "Optional: the version you edited."},
                "ops": patch_ops_schema()
            },
            "required": ["ops"],
            "additionalProperties": false
        })
        .into(),
    }
}

/// `propose_patch`: a sub-agent's change to the tasks its parent handed it.
pub fn propose_patch_spec() -> ToolSpec {
    ToolSpec {
        name: RuntimeTool::ProposePatch.as_str().into(),
        description: "Propose a change to your parent's plan: only tasks you were handed (or \
                      add yourself) may be written. Returns {status: \"accepted\", version}, \
                      or {status: \"conflict\", code: 409, current_version} — rebase on \
                      current_version and propose again — or {status: \"forbidden\", code: \
                      403, reason}."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "base_version": {"type": "integer", "minimum": 0, "description": "The plan version your change is based on."},
                "ops": patch_ops_schema()
            },
            "required": ["base_version", "ops"],
            "additionalProperties": false
        })
        .into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ask_clarification_offers_the_children_that_can_take_one() {
        let spec = super::ask_clarification_spec(&["r/expert-1".into(), "r/expert-2".into()]);
        assert_eq!(
            spec.parameters["properties"]["session_id"]["enum"],
            serde_json::json!(["r/expert-1", "r/expert-2"])
        );
        let none = super::ask_clarification_spec(&[]);
        assert!(none.parameters["properties"]["session_id"]
            .get("enum")
            .is_none());
    }
}
