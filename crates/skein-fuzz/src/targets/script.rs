//! `script`: a script of the `scripted` model, parsed, then asked for its first turns the
//! way the provider asks it (templates rendered, conditions evaluated, calls repeated).

use serde_json::json;
use skein_core::message::RequestMeta;
use skein_core::{Message, ModelRequest, ToolCall};
use skein_llm::scripted::{answer, parse_script};

use super::{text, Spec, Target};
use crate::mutate::Dict;
use crate::structured::reshape_yaml;
use crate::Rng;

pub const SPEC: Spec = Spec {
    name: "script",
    about: "scripts of the scripted model (parse_script, then answer for turns 1 to 3)",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Scripts::new())),
    reshape,
    tokens: &[
        "turns:\n",
        "  - answer: ",
        "  - tool_calls:\n",
        "      - tool: ",
        "        args: ",
        "repeat: ",
        "choose:\n",
        "when: ",
        "say: ",
        "latency_ms: ",
        "{{ ",
        " }}",
        "{% for r in results %}",
        "{% endfor %}",
        "{% if ",
        "{% endif %}",
        "mission",
        "inputs",
        "results",
        "all_results",
        "loop.index",
        "range(",
        "| join",
        "| length",
        "&a ",
        "*a",
    ],
};

pub struct Scripts {
    requests: Vec<ModelRequest>,
}

/// The requests of a session in its first three turns: the second and third carry the
/// earlier turns' tool results.
fn requests() -> Vec<ModelRequest> {
    let meta = RequestMeta {
        session: "01jfuzz0000000000000000000".into(),
        agent: "fuzzer".into(),
        mission: "Compare three queue designs".into(),
        context: Some("for a small team".into()),
        inputs: json!({"n": 2, "key": "version", "topic": "queues"}),
        plan: serde_json::Value::Null,
    };
    let mut messages = vec![
        Message::System {
            content: "You may call every tool.".into(),
        },
        Message::User {
            content: "Compare three queue designs".into(),
        },
    ];
    let mut out = vec![];
    for turn in 0..3 {
        out.push(ModelRequest {
            model: "scripted:fuzzer".into(),
            messages: messages.clone(),
            tools: vec![],
            temperature: None,
            max_tokens: None,
            top_p: None,
            top_k: None,
            prompt_cache: false,
            meta: meta.clone(),
        });
        let call = format!("call_{}_1", turn + 1);
        messages.push(Message::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: call.clone(),
                name: "call_agent".into(),
                args: json!({"agent": "researcher", "mission": "one angle"}),
            }],
        });
        messages.push(Message::Tool {
            call_id: call,
            name: "call_agent".into(),
            content: json!({
                "session_id": format!("01jfuzz0000000000000000000.researcher-{}", turn + 1),
                "status": "completed",
                "result": "three findings",
                "answers": {"version": "3.12"},
                "resume_token": "skt1.00.00",
            })
            .to_string(),
            is_error: false,
        });
    }
    out
}

impl Scripts {
    pub fn new() -> Self {
        Self {
            requests: requests(),
        }
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}

impl Target for Scripts {
    fn run(&mut self, data: &[u8]) -> bool {
        let text = text(data);
        let Ok(script) = parse_script("fuzz.yaml", &text) else {
            return false;
        };
        let turns = script.turns.len().min(self.requests.len());
        let mut answered = true;
        for req in &self.requests[..turns] {
            answered &= answer(&script, req).is_ok();
        }
        answered
    }
}

fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(seed).ok()?;
    reshape_yaml(rng, text, dict).map(String::into_bytes)
}
