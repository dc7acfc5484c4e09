//! `answers`: the body of `skein.answers` / `skein.api.answer` (`{"token", "answers"}`),
//! checked the way `hitl::answer` checks it before writing anything: the token's form and
//! signature, the pause it names in a real store's log, and the answers against that
//! pause's questions. A root paused on a question is set up once; its token is in the
//! seeds, and the fuzzer re-signs mutated claims with the test secret.

use std::sync::Arc;

use rand::Rng as _;
use serde_json::{json, Value};
use skein_core::event::{InputRequested, ModelCalled};
use skein_core::{Event, ModelResponse, SessionId, ToolCall};
use skein_runtime::hitl::{self, Secret};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;

use super::{tokio_runtime, Spec, Target};
use crate::fixtures::{
    catalog, paused_questions, sign_raw, PAUSED_ROOT, PAUSED_SEQ, PAUSED_TOKEN_ID, TEST_SECRET,
};
use crate::mutate::Dict;
use crate::structured::{mutate_value, reshape_json};
use crate::{Error, Result, Rng};

pub const SPEC: Spec = Spec {
    name: "answers",
    about: "answers to a paused root (skein.answers body: token checked against a sled \
            log, answers against its questions)",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Answers::new()?)),
    reshape,
    tokens: &[
        "token", "answers", "version", "license", "q3", "skt1.", "input", "approval",
    ],
};

pub struct Answers {
    tokio: tokio::runtime::Runtime,
    rt: Arc<Runtime>,
    _dir: tempfile::TempDir,
}

impl Answers {
    pub fn new() -> Result<Self> {
        let setup = |e: &dyn std::fmt::Display| Error::setup(SPEC.name, e);
        let tokio = tokio_runtime(SPEC.name)?;
        let dir = tempfile::tempdir().map_err(|e| setup(&e))?;
        let store = {
            let _enter = tokio.enter();
            SledStore::open(&dir.path().join("data"), &dir.path().join("ws"))
                .map_err(|e| setup(&e))?
        };
        let rt = Runtime::new(
            store.backend(),
            Arc::new(catalog().map_err(|e| setup(&e))?),
            skein_llm::Registry::new(),
            skein_tools::ToolBox::new(),
            RuntimeConfig {
                token_secret: Secret(TEST_SECRET.to_vec()),
                ..RuntimeConfig::default()
            },
        );
        tokio
            .block_on(pause(&rt))
            .map_err(|e| setup(&format!("pausing {PAUSED_ROOT}: {e}")))?;
        Ok(Self {
            tokio,
            rt,
            _dir: dir,
        })
    }
}

/// Records a root that asked the person a question: `Submitted`, the model's `ask_user`
/// call, and `InputRequested` with a fixed token id.
async fn pause(rt: &Runtime) -> skein_runtime::Result<()> {
    let id = rt
        .submit(Submission {
            agent: "fuzzer".into(),
            mission: "Set up the project".into(),
            id: Some(PAUSED_ROOT.into()),
            context: None,
            inputs: Value::Null,
            budget: None,
            no_cache: true,
            traceparent: None,
            priority: None,
        })
        .await?;
    let (mut f, _) = rt.load(&id).await?;
    let call = "call_1_1".to_string();
    let args = json!({"questions": paused_questions(), "context": "setting up"});
    rt.append(
        &mut f,
        Event::ModelCalled(ModelCalled {
            model: "scripted:fuzzer".into(),
            request_digest: String::new(),
            response: ModelResponse {
                content: None,
                tool_calls: vec![ToolCall {
                    id: call.clone(),
                    name: "ask_user".into(),
                    args,
                }],
                finish_reason: Some("tool_calls".into()),
            },
            usage: Default::default(),
            latency_ms: 0,
            worker: "fuzz".into(),
        }),
    )
    .await?;
    rt.append(
        &mut f,
        Event::InputRequested(InputRequested {
            call: Some(call),
            questions: paused_questions(),
            context: Some("setting up".into()),
            defaults: Value::Null,
            token_id: PAUSED_TOKEN_ID.into(),
        }),
    )
    .await?;
    let paused = f
        .state
        .pauses
        .pending_inputs
        .iter()
        .any(|p| p.token_id == PAUSED_TOKEN_ID && p.seq == PAUSED_SEQ);
    rt.keep_state(f);
    if paused {
        Ok(())
    } else {
        Err(skein_runtime::Error::invalid(
            "the root did not pause on its question",
        ))
    }
}

impl Target for Answers {
    fn run(&mut self, data: &[u8]) -> bool {
        let Ok(req) = skein_nats_worker::service::parse_answer_request(data) else {
            return false;
        };
        let rt = &self.rt;
        self.tokio.block_on(async {
            let Ok((claims, f)) =
                hitl::check_token(rt, &req.token, skein_core::token::TokenKind::Input).await
            else {
                return false;
            };
            let pending = f
                .state
                .pauses
                .pending_inputs
                .iter()
                .find(|p| p.token_id == claims.nonce)
                .cloned();
            rt.keep_state(f);
            let Some(p) = pending else {
                return false;
            };
            claims.session.is_root() && hitl::check_answers(&p.questions, &req.answers).is_ok()
        })
    }
}

fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(seed).ok()?;
    if rng.gen_bool(0.5) {
        return reshape_json(rng, seed, dict);
    }
    // Keep the answers, change the claims, sign them validly: reaches the log checks.
    let token = v.get("token")?.as_str()?;
    let body = hex::decode(token.split('.').nth(1)?).ok()?;
    let mut claims: Value = serde_json::from_slice(&body).ok()?;
    mutate_value(rng, &mut claims, dict);
    if let Some(c) = claims.as_object_mut().filter(|_| rng.gen_bool(0.3)) {
        // A child of the paused root: a token a person may not answer.
        let child = SessionId::root(PAUSED_ROOT)
            .map(|r| r.child("fuzzer", rng.gen_range(0..3)).to_string())
            .unwrap_or_default();
        c.insert("s".into(), Value::String(child));
    }
    v["token"] = Value::String(sign_raw(&serde_json::to_vec(&claims).ok()?));
    serde_json::to_vec(&v).ok()
}
