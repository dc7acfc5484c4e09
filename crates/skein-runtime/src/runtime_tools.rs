//! Schemas of the tools the runtime itself handles (the model sees them like any tool).

use serde_json::{json, Value};
use skein_core::{AgentDef, ToolSpec};

/// `call_agent`, with `agent` an enum of the sub-agents `def` may call.
pub fn call_agent_spec(def: &AgentDef) -> ToolSpec {
    let mut agent = json!({
        "type": "string",
        "description": "The specialist to delegate to.",
    });
    if !def.front.agents.is_empty() {
        agent["enum"] = Value::from(def.front.agents.clone());
    }
    ToolSpec {
        name: "call_agent".into(),
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
                    "properties": {"tokens": {"type": "integer", "minimum": 0}}
                },
                "resume_token": {"type": "string"},
                "answers": {"type": "object"},
                "owns_tasks": {"type": "array", "items": {"type": "string"}}
            },
            "additionalProperties": false
        }),
    }
}
