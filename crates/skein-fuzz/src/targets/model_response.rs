//! `model_response`: what a model server answers. The body is read by the OpenAI and the
//! Anthropic parsers (native tool calls and JSON-mode text), and each completion is
//! recorded and folded into a session the way a worker does, usage included.

use serde_json::Value;
use skein_core::event::{ModelCalled, Submitted};
use skein_core::message::RequestMeta;
use skein_core::{
    AgentDef, AgentSet, Envelope, Event, Limits, Message, ModelRequest, SessionId, SessionState,
};
use skein_llm::{anthropic, json_tool, openai, Completion};

use super::{text, Spec, Target};
use crate::fixtures::catalog;
use crate::structured::reshape_json;
use crate::{Error, Result};

pub const SPEC: Spec = Spec {
    name: "model_response",
    about: "model server answers (openai and anthropic parse_response, JSON-mode text), \
            folded into a session",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Responses::new()?)),
    reshape: |rng, seed, dict| reshape_json(rng, seed, dict),
    tokens: &[
        "choices",
        "message",
        "content",
        "tool_calls",
        "function",
        "arguments",
        "name",
        "id",
        "finish_reason",
        "usage",
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
        "type",
        "text",
        "tool_use",
        "input",
        "stop_reason",
        "error",
        "function_call",
        "read_file",
        "call_agent",
    ],
};

pub struct Responses {
    catalog: AgentSet,
    def: AgentDef,
    limits: Limits,
    base: SessionState,
    session: SessionId,
    req: ModelRequest,
}

impl Responses {
    pub fn new() -> Result<Self> {
        let setup = |e: &dyn std::fmt::Display| Error::setup(SPEC.name, e);
        let catalog = catalog().map_err(|e| setup(&e))?;
        let def = catalog
            .get("fuzzer")
            .cloned()
            .ok_or_else(|| setup(&"no `fuzzer` agent"))?;
        let session = SessionId::root("fuzz-model").map_err(|e| setup(&e))?;
        let submitted = Event::Submitted(Submitted {
            def_digest: def.digest.clone(),
            mission: "Compare three queue designs".into(),
            mission_hash: "0".repeat(64),
            budget: skein_core::Budget {
                tokens: Some(100_000),
                max_steps: None,
            },
            ..Submitted::for_test("fuzzer")
        });
        let base = SessionState::fold(&[Envelope::new(
            session.clone(),
            1,
            1,
            String::new(),
            submitted,
        )]);
        let req = ModelRequest {
            model: def.front.model.clone(),
            messages: vec![
                Message::System {
                    content: def.prompt.clone(),
                },
                Message::User {
                    content: "Compare three queue designs".into(),
                },
            ],
            tools: vec![],
            temperature: None,
            max_tokens: None,
            top_p: None,
            top_k: None,
            prompt_cache: false,
            meta: RequestMeta::default(),
        };
        Ok(Self {
            catalog,
            def,
            limits: Limits::default(),
            base,
            session,
            req,
        })
    }

    /// The request the answers are read for.
    pub(crate) fn request(&self) -> &ModelRequest {
        &self.req
    }

    /// Records two turns answered with `c` and decides what comes next.
    pub(crate) fn fold(&self, c: &Completion) {
        let mut state = self.base.clone();
        for seq in [2, 3] {
            state.apply(&Envelope::new(
                self.session.clone(),
                seq,
                seq,
                String::new(),
                Event::ModelCalled(ModelCalled {
                    model: self.def.front.model.clone(),
                    request_digest: String::new(),
                    response: c.response.clone(),
                    usage: c.usage,
                    latency_ms: 1,
                    worker: "fuzz".into(),
                }),
            ));
        }
        let _ = (state.usage_total(), state.tokens_free());
        let _ = state.next(&self.def, &self.limits, &self.catalog);
    }
}

impl Target for Responses {
    fn run(&mut self, data: &[u8]) -> bool {
        let Ok(body) = serde_json::from_slice::<Value>(data) else {
            // Not JSON at all: as the text of a JSON-mode answer.
            let _ = json_tool::response_from_text(&text(data), None);
            return false;
        };
        let mut any = false;
        for json_mode in [false, true] {
            let parsed = [
                openai::parse_response(&body, &self.req, json_mode),
                anthropic::parse_response(&body, &self.req, json_mode),
            ];
            for c in parsed.iter().flatten() {
                self.fold(c);
                any = true;
            }
        }
        any
    }
}
