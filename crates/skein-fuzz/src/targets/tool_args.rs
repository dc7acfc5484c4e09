//! `tool_args`: the tool calls a model sends, as the runtime handles them. The calls are
//! recorded in a `ModelCalled` on a session of an agent allowed every tool (with a
//! finished `chat: true` child and a child paused on a question, so follow-ups and
//! resumes have something to name), the pure core decides what to do with them, and the
//! workspace tools it decides to run run for real on a scratch workspace, their
//! arguments checked against their schemas first. `http_fetch` and `shell` calls are
//! checked against their schemas but never run (they would reach the network or run
//! commands).
//!
//! Input: `{"tool": NAME, "args": ARGS}`, or an array of such calls (one model turn).

use std::path::PathBuf;
use std::sync::Arc;

use rand::Rng as _;
use serde_json::{json, Value};
use skein_core::event::{ChildSettled, Delegated, ModelCalled, Outcome, Submitted};
use skein_core::{
    AgentDef, AgentSet, Envelope, Event, Limits, ModelResponse, SessionId, SessionState, Step,
    ToolCall,
};
use skein_tools::{schema, LocalWorkspace, Tool, ToolBox, ToolContext, ToolsConfig};

use super::{tokio_runtime, Spec, Target};
use crate::fixtures::catalog;
use crate::mutate::Dict;
use crate::structured::reshape_json;
use crate::{Error, Result, Rng};

pub const SPEC: Spec = Spec {
    name: "tool_args",
    about: "a model's tool calls: decided by the pure core, workspace tools run on a \
            scratch directory, every argument object checked against its schema",
    max_len: 64 * 1024,
    make: || Ok(Box::new(ToolArgs::new()?)),
    reshape,
    tokens: &[
        "tool",
        "args",
        "read_file",
        "write_file",
        "list_dir",
        "search_files",
        "http_fetch",
        "shell",
        "call_agent",
        "ask_user",
        "update_plan",
        "propose_patch",
        "handoff_to",
        "team_broadcast",
        "ask_clarification",
        "path",
        "offset",
        "content",
        "pattern",
        "regex",
        "case_sensitive",
        "max_matches",
        "url",
        "method",
        "headers",
        "body",
        "command",
        "agent",
        "mission",
        "context",
        "inputs",
        "budget",
        "resume_token",
        "answers",
        "agent_definition",
        "system_prompt",
        "owns_tasks",
        "questions",
        "proposed_defaults",
        "question",
        "session_id",
        "ops",
        "op",
        "add",
        "remove",
        "update",
        "link",
        "unlink",
        "task",
        "status",
        "base_version",
        "(?i)",
        ".*",
        "(a+)+$",
        "\\p{L}",
        "notes.md",
        "data/report.txt",
        "../",
        "/etc/passwd",
    ],
};

/// Calls of one model turn at most (a turn of more calls is cut, not refused).
const MAX_CALLS: usize = 64;
/// The scratch workspace is made anew after this many inputs.
const FRESH_WORKSPACE_EVERY: u64 = 5_000;

pub struct ToolArgs {
    tokio: tokio::runtime::Runtime,
    catalog: AgentSet,
    def: AgentDef,
    limits: Limits,
    /// The session before the fuzzed turn.
    base: SessionState,
    session: SessionId,
    next_seq: u64,
    tools: ToolBox,
    /// Tools whose arguments are checked but that are never run.
    check_only: Vec<Arc<dyn Tool>>,
    workspace: tempfile::TempDir,
    runs: u64,
}

fn env(session: &SessionId, seq: u64, body: Event) -> Envelope {
    Envelope::new(
        session.clone(),
        seq,
        1_700_000_000_000 + seq,
        String::new(),
        body,
    )
}

/// The token id of the question `researcher` paused on (its token, signed with the test
/// secret, is in the seeds).
pub const RESUME_TOKEN_ID: &str = "a1a1a1a1a1a1a1a1a1a1a1a1";

/// The `fuzzer` root after one turn that started two children: `chatty` (finished, takes
/// follow-ups) and `researcher` (paused on a question).
fn base_log(def: &AgentDef, root: &SessionId) -> Vec<Envelope> {
    let chatty = root.child("chatty", 1);
    let researcher = root.child("researcher", 2);
    let call = |id: &str, agent: &str| ToolCall {
        id: id.into(),
        name: "call_agent".into(),
        args: json!({"agent": agent, "mission": format!("{agent}'s part")}),
    };
    let bodies = vec![
        Event::Submitted(Submitted {
            def_digest: def.digest.clone(),
            mission: "Compare three queue designs".into(),
            inputs: json!({"topic": "queues"}),
            mission_hash: "0".repeat(64),
            // A member of a team, so that `team_broadcast` reaches its rules.
            team: Some(Box::new(skein_core::event::TeamSeat {
                host: root.clone(),
                role: skein_core::event::TeamRole::Member,
                peers: vec![],
                members: 1,
            })),
            ..Submitted::for_test("fuzzer")
        }),
        Event::ModelCalled(ModelCalled {
            model: def.front.model.clone(),
            request_digest: String::new(),
            response: ModelResponse {
                content: None,
                tool_calls: vec![call("call_1_1", "chatty"), call("call_1_2", "researcher")],
                finish_reason: Some("tool_calls".into()),
            },
            usage: Default::default(),
            latency_ms: 0,
            worker: "fuzz".into(),
        }),
        Event::Delegated(Delegated {
            call: "call_1_1".into(),
            child: chatty.clone(),
            agent: "chatty".into(),
            mission_hash: "1".repeat(64),
            allotted_tokens: None,
            kind: skein_core::event::DelegationKind::Started,
            owns_tasks: vec![],
            max_steps: None,
        }),
        Event::Delegated(Delegated {
            call: "call_1_2".into(),
            child: researcher.clone(),
            agent: "researcher".into(),
            mission_hash: "2".repeat(64),
            allotted_tokens: None,
            kind: skein_core::event::DelegationKind::Started,
            owns_tasks: vec![],
            max_steps: None,
        }),
        Event::ChildSettled(ChildSettled {
            call: "call_1_1".into(),
            child: chatty,
            outcome: Outcome::Completed {
                answer: "three designs compared".into(),
                patch: None,
                usage: Default::default(),
                steps: 1,
                partial: false,
            },
        }),
        Event::ChildSettled(ChildSettled {
            call: "call_1_2".into(),
            child: researcher,
            outcome: Outcome::NeedsInput {
                questions: json!([{"key": "depth", "question": "How deep?"}]),
                context: None,
                defaults: Value::Null,
                token: String::new(),
                token_id: RESUME_TOKEN_ID.into(),
                seq: 3,
                usage: Default::default(),
            },
        }),
    ];
    bodies
        .into_iter()
        .enumerate()
        .map(|(i, b)| env(root, i as u64 + 1, b))
        .collect()
}

fn scratch_workspace() -> std::io::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    std::fs::create_dir_all(dir.path().join("data/deep/er"))?;
    std::fs::write(
        dir.path().join("notes.md"),
        "# Notes\nqueues: three designs\n",
    )?;
    std::fs::write(
        dir.path().join("data/report.txt"),
        "line one\nline two: é€😀\n".repeat(200),
    )?;
    std::fs::write(
        dir.path().join("data/deep/er/blob.bin"),
        [0u8, 159, 146, 150, 255],
    )?;
    Ok(dir)
}

impl ToolArgs {
    pub fn new() -> Result<Self> {
        let setup = |e: &dyn std::fmt::Display| Error::setup(SPEC.name, e);
        let catalog = catalog().map_err(|e| setup(&e))?;
        let def = catalog
            .get("fuzzer")
            .cloned()
            .ok_or_else(|| setup(&"no `fuzzer` agent"))?;
        let limits = Limits {
            approval_required: vec![],
            ..Limits::default()
        };
        let session = SessionId::root("fuzz-tools").map_err(|e| setup(&e))?;
        let log = base_log(&def, &session);
        let base = SessionState::fold(&log);
        match base.next(&def, &limits, &catalog) {
            Step::CallModel { .. } => {}
            other => return Err(setup(&format!("the base session decides {other:?}"))),
        }
        let mut cfg = ToolsConfig::default();
        cfg.http.enabled = false;
        cfg.shell.enabled = false;
        let check_only: Vec<Arc<dyn Tool>> = vec![
            Arc::new(skein_tools::http::HttpFetch::new(Default::default())),
            Arc::new(skein_tools::shell::Shell::new(Default::default())),
        ];
        Ok(Self {
            tokio: tokio_runtime(SPEC.name)?,
            catalog,
            def,
            limits,
            base,
            session,
            next_seq: log.len() as u64 + 1,
            tools: ToolBox::builtin(&cfg),
            check_only,
            workspace: scratch_workspace().map_err(|e| setup(&e))?,
            runs: 0,
        })
    }

    fn root(&self) -> PathBuf {
        self.workspace.path().to_path_buf()
    }
}

/// The calls of the input: one `{tool, args}` or an array of them.
fn calls(v: &Value) -> Vec<ToolCall> {
    let items: Vec<&Value> = match v {
        Value::Array(a) => a.iter().take(MAX_CALLS).collect(),
        one => vec![one],
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, c)| ToolCall {
            id: format!("call_2_{}", i + 1),
            name: c
                .get("tool")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            args: c.get("args").cloned().unwrap_or(Value::Null),
        })
        .collect()
}

impl Target for ToolArgs {
    fn run(&mut self, data: &[u8]) -> bool {
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return false;
        };
        self.runs += 1;
        if self.runs.is_multiple_of(FRESH_WORKSPACE_EVERY) {
            if let Ok(w) = scratch_workspace() {
                self.workspace = w;
            }
        }
        let mut state = self.base.clone();
        state.apply(&env(
            &self.session,
            self.next_seq,
            Event::ModelCalled(ModelCalled {
                model: self.def.front.model.clone(),
                request_digest: String::new(),
                response: ModelResponse {
                    content: None,
                    tool_calls: calls(&v),
                    finish_reason: Some("tool_calls".into()),
                },
                usage: Default::default(),
                latency_ms: 0,
                worker: "fuzz".into(),
            }),
        ));
        // The next request shows the calls to the model again.
        let _ = state.model_request(&self.def);
        let step = state.next(&self.def, &self.limits, &self.catalog);
        let Step::RunTools(runs) = step else {
            return !matches!(step, Step::Refuse(_) | Step::Fail { .. });
        };
        let ctx = ToolContext {
            session: self.session.clone(),
            workspace: Arc::new(LocalWorkspace::new(self.root())),
            blobs: None,
            progress: None,
        };
        let mut ok = true;
        for r in runs {
            if let Some(t) = self.check_only.iter().find(|t| t.name() == r.tool) {
                let args = match &r.args {
                    Value::Null => json!({}),
                    a => a.clone(),
                };
                ok &= schema::validate(&t.parameters(), &args).is_ok();
                continue;
            }
            let out = self
                .tokio
                .block_on(self.tools.try_run(&ctx, &r.tool, &r.args));
            ok &= out.is_ok();
        }
        ok
    }
}

fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    if rng.gen_bool(0.15) {
        // Another tool, same arguments.
        let mut v: Value = serde_json::from_slice(seed).ok()?;
        if let Some(o) = v.as_object_mut() {
            let names = &SPEC.tokens[2..15];
            o.insert(
                "tool".into(),
                Value::String(names[rng.gen_range(0..names.len())].into()),
            );
        }
        return serde_json::to_vec(&v).ok();
    }
    reshape_json(rng, seed, dict)
}
