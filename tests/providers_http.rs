//! End to end over HTTP: the real `skein` binary runs an orchestrator and two parallel
//! researchers against an in-process server that speaks the OpenAI chat-completions or
//! the Anthropic Messages wire format. The server decides every answer from the request
//! itself (who is asking, whether tool results came back) and records each request, so
//! the tests check what skein sent as well as what it made of the answers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Obviously not a real key; it must never show up anywhere but its one header.
const FAKE_KEY: &str = "sk-test-not-a-secret";
const KEY_ENV: &str = "SKEIN_TEST_FAKE_KEY";
const ROOT_MISSION: &str = "Brief me on event sourcing";
const MISSIONS: [&str; 2] = [
    "Trace the origins of event sourcing",
    "List the pitfalls of event sourcing",
];
const ORCHESTRATOR_PROMPT: &str = "You are the orchestrator. Split the mission in two, \
                                   delegate each part to a researcher, then write the brief.";
const RESEARCHER_PROMPT: &str = "You are a researcher. Answer your mission in one sentence.";

// ---- the in-process server ----------------------------------------------------------------

/// One request the server received.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    /// Names lower-cased.
    headers: BTreeMap<String, String>,
    body: Value,
    at: Instant,
}

/// What the server answers.
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Value,
}

impl Reply {
    fn ok(body: Value) -> Self {
        Self::status(200, body)
    }

    fn status(status: u16, body: Value) -> Self {
        Self {
            status,
            headers: vec![],
            body,
        }
    }

    fn header(mut self, name: &'static str, value: &str) -> Self {
        self.headers.push((name, value.to_string()));
        self
    }

    /// A refusal for a request the test did not expect: not retryable, so the session
    /// fails at once with this text instead of the test hanging on retries.
    fn unexpected(what: &str) -> Self {
        Self::status(
            400,
            json!({"error": {"message": format!("mock: unexpected request: {what}")}}),
        )
    }
}

type Responder = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

/// An HTTP/1.1 server on 127.0.0.1 with its own tokio runtime on a background thread,
/// alive until dropped. The responder runs on the blocking pool, so it may wait.
struct Server {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(respond: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Self {
        let seen = Arc::new(Mutex::new(vec![]));
        let log = seen.clone();
        let respond: Responder = Arc::new(respond);
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let (stop, mut stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("server runtime");
            rt.block_on(async move {
                let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
                let port = listener.local_addr().expect("local address").port();
                port_tx.send(port).expect("send the port");
                loop {
                    tokio::select! {
                        _ = &mut stopped => break,
                        accepted = listener.accept() => {
                            if let Ok((stream, _)) = accepted {
                                tokio::spawn(serve(stream, respond.clone(), log.clone()));
                            }
                        }
                    }
                }
            });
        });
        let port = port_rx.recv().expect("the server's port");
        Self {
            port,
            seen,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn requests(&self) -> Vec<Seen> {
        self.seen.lock().expect("request log").clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves one connection: requests one after another (keep-alive) until the client
/// closes it.
async fn serve(stream: TcpStream, respond: Responder, log: Arc<Mutex<Vec<Seen>>>) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut request_line = String::new();
        match read.read_line(&mut request_line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let path = request_line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let mut headers = BTreeMap::new();
        loop {
            let mut line = String::new();
            if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
            }
        }
        let len: usize = headers
            .get("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; len];
        if read.read_exact(&mut body).await.is_err() {
            return;
        }
        let seen = Seen {
            path,
            headers,
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            at: Instant::now(),
        };
        log.lock().expect("request log").push(seen.clone());
        let respond = respond.clone();
        let reply = match tokio::task::spawn_blocking(move || respond(&seen)).await {
            Ok(r) => r,
            Err(_) => Reply::status(
                500,
                json!({"error": {"message": "mock responder panicked"}}),
            ),
        };
        let text = reply.body.to_string();
        let reason = match reply.status {
            200 => "OK",
            400 => "Bad Request",
            401 => "Unauthorized",
            429 => "Too Many Requests",
            _ => "Other",
        };
        let mut head = format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            reply.status,
            text.len()
        );
        for (name, value) in &reply.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        if write.write_all(head.as_bytes()).await.is_err()
            || write.write_all(text.as_bytes()).await.is_err()
        {
            return;
        }
    }
}

// ---- the two wire formats ------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq)]
enum Wire {
    OpenAi,
    Anthropic,
}

/// The text of a `content` field: a string, or the text blocks of a list.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect(),
        _ => String::new(),
    }
}

fn messages(body: &Value) -> &[Value] {
    body["messages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

impl Wire {
    /// The system prompt: the first message (OpenAI) or the top-level field (Anthropic).
    fn system(self, body: &Value) -> String {
        match self {
            Wire::OpenAi => messages(body)
                .iter()
                .find(|m| m["role"] == "system")
                .map(|m| text_of(&m["content"]))
                .unwrap_or_default(),
            Wire::Anthropic => text_of(&body["system"]),
        }
    }

    /// The first user message's text: the mission.
    fn mission(self, body: &Value) -> String {
        messages(body)
            .iter()
            .find(|m| m["role"] == "user")
            .map(|m| text_of(&m["content"]))
            .unwrap_or_default()
    }

    /// `(call id, content)` of every tool result sent back, in order.
    fn results(self, body: &Value) -> Vec<(String, String)> {
        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
        match self {
            Wire::OpenAi => messages(body)
                .iter()
                .filter(|m| m["role"] == "tool")
                .map(|m| (s(&m["tool_call_id"]), text_of(&m["content"])))
                .collect(),
            Wire::Anthropic => messages(body)
                .iter()
                .filter(|m| m["role"] == "user")
                .filter_map(|m| m["content"].as_array())
                .flatten()
                .filter(|b| b["type"] == "tool_result")
                .map(|b| (s(&b["tool_use_id"]), text_of(&b["content"])))
                .collect(),
        }
    }

    /// An answer asking for tools: `(id, name, arguments)`.
    fn calls(self, calls: &[(&str, &str, Value)]) -> Value {
        match self {
            Wire::OpenAi => openai_calls(
                &calls
                    .iter()
                    .map(|(id, name, args)| (*id, *name, args.to_string()))
                    .collect::<Vec<_>>(),
            ),
            Wire::Anthropic => {
                let mut content = vec![json!({"type": "text", "text": "Delegating."})];
                content.extend(calls.iter().map(|(id, name, input)| {
                    json!({"type": "tool_use", "id": id, "name": name, "input": input})
                }));
                anthropic_message(content, "tool_use")
            }
        }
    }

    /// A final answer.
    fn text(self, text: &str) -> Value {
        match self {
            Wire::OpenAi => json!({
                "id": "chatcmpl-e2e",
                "object": "chat.completion",
                "created": 1_700_000_000,
                "model": "test-model",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop"
                }],
                "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
            }),
            Wire::Anthropic => {
                anthropic_message(vec![json!({"type": "text", "text": text})], "end_turn")
            }
        }
    }

    /// Ids the server gives its two `call_agent` calls.
    fn call_ids(self) -> [&'static str; 2] {
        match self {
            Wire::OpenAi => ["call_Origins7q", "call_Pitfalls9x"],
            Wire::Anthropic => ["toolu_01Origins", "toolu_02Pitfalls"],
        }
    }
}

/// A chat completion with tool calls whose `arguments` are the given texts, verbatim.
fn openai_calls(calls: &[(&str, &str, String)]) -> Value {
    let tool_calls: Vec<Value> = calls
        .iter()
        .map(|(id, name, arguments)| {
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
        })
        .collect();
    json!({
        "id": "chatcmpl-e2e",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "test-model",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": null, "tool_calls": tool_calls},
            "finish_reason": "tool_calls"
        }],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    })
}

fn anthropic_message(content: Vec<Value>, stop_reason: &str) -> Value {
    json!({
        "id": "msg_01E2e",
        "type": "message",
        "role": "assistant",
        "model": "test-model",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": {"input_tokens": 100, "output_tokens": 20}
    })
}

/// Holds each caller until `n` have arrived (or `within` passes): proof that they were
/// in flight at the same time.
#[derive(Default)]
struct Gate {
    arrived: Mutex<usize>,
    cv: Condvar,
}

impl Gate {
    /// Whether all `n` arrived in time.
    fn meet(&self, n: usize, within: Duration) -> bool {
        let mut count = self.arrived.lock().expect("gate");
        *count += 1;
        self.cv.notify_all();
        let (count, _) = self
            .cv
            .wait_timeout_while(count, within, |c| *c < n)
            .expect("gate");
        *count >= n
    }
}

/// The orchestrator's `call_agent` arguments for mission `i`.
fn delegation(i: usize) -> Value {
    json!({"agent": "researcher", "mission": MISSIONS[i]})
}

/// The researchers' answer to a mission.
fn finding(mission: &str) -> String {
    format!("Finding on: {mission}")
}

/// The whole tree: the orchestrator delegates both missions in one turn, each researcher
/// answers (only once both are in flight), and the orchestrator writes the brief from
/// the results it is shown.
fn tree(wire: Wire) -> impl Fn(&Seen) -> Reply + Send + Sync + 'static {
    let gate = Arc::new(Gate::default());
    move |req| {
        let system = wire.system(&req.body);
        if system.starts_with("You are the orchestrator") {
            let results = wire.results(&req.body);
            if results.is_empty() {
                let ids = wire.call_ids();
                return Reply::ok(wire.calls(&[
                    (ids[0], "call_agent", delegation(0)),
                    (ids[1], "call_agent", delegation(1)),
                ]));
            }
            let findings: Vec<String> = results
                .iter()
                .map(|(_, content)| {
                    serde_json::from_str::<Value>(content)
                        .ok()
                        .and_then(|v| v["result"].as_str().map(str::to_string))
                        .unwrap_or_else(|| content.clone())
                })
                .collect();
            return Reply::ok(wire.text(&format!("Brief: {}", findings.join(" | "))));
        }
        if system.starts_with("You are a researcher") {
            let mission = wire.mission(&req.body);
            if !gate.meet(2, Duration::from_secs(5)) {
                return Reply::ok(wire.text("the researchers did not run in parallel"));
            }
            return Reply::ok(wire.text(&finding(&mission)));
        }
        Reply::unexpected(&system)
    }
}

// ---- a sandbox with its own config, agents and store ---------------------------------------

struct Site {
    dir: tempfile::TempDir,
    server: Server,
}

impl Site {
    /// A sandbox whose provider `local` speaks `wire` to a new server answering with
    /// `respond`. `provider_extra` goes into `[models.providers.local]`, `tail` at the end
    /// of `skein.toml`.
    fn new(
        wire: Wire,
        provider_extra: &str,
        tail: &str,
        respond: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let server = Server::start(respond);
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("agents")).expect("agents dir");
        std::fs::create_dir_all(dir.path().join("scripts")).expect("scripts dir");
        let port = server.port;
        let provider = match wire {
            Wire::OpenAi => format!("kind = \"openai\"\nbase_url = \"http://127.0.0.1:{port}/v1\""),
            Wire::Anthropic => {
                format!("kind = \"anthropic\"\nbase_url = \"http://127.0.0.1:{port}\"")
            }
        };
        let config = format!(
            "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n\n\
             [models.providers.local]\n{provider}\napi_key_env = \"{KEY_ENV}\"\n\
             timeout = \"20s\"\nconnect_timeout = \"2s\"\n{provider_extra}\n{tail}\n"
        );
        std::fs::write(dir.path().join("skein.toml"), config).expect("config");
        Self { dir, server }
    }

    fn agent(&self, name: &str, front: &str, prompt: &str) {
        std::fs::write(
            self.dir.path().join(format!("agents/{name}.md")),
            format!("---\nname: {name}\n{front}---\n{prompt}\n"),
        )
        .expect("agent file");
    }

    /// `orchestrator` (which may call `researcher`) and `researcher`, both on `model`.
    fn tree_agents(&self, model: &str) {
        self.agent(
            "orchestrator",
            &format!("model: {model}\nagents: [researcher]\n"),
            ORCHESTRATOR_PROMPT,
        );
        self.agent(
            "researcher",
            &format!("model: {model}\n"),
            RESEARCHER_PROMPT,
        );
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `skein --config … --data … ARGS` with the fake key in its environment.
    fn skein(&self, args: &[&str]) -> Output {
        let out = Command::new(env!("CARGO_BIN_EXE_skein"))
            .arg("--config")
            .arg(self.dir.path().join("skein.toml"))
            .arg("--data")
            .arg(self.data())
            .args(args)
            .current_dir(self.dir.path())
            .env(KEY_ENV, FAKE_KEY)
            .env("SKEIN_LOG", "warn")
            .env_remove("SKEIN_NATS_URL")
            .env_remove("SKEIN_CONFIG")
            .env_remove("SKEIN_DATA")
            .stdin(Stdio::null())
            .output()
            .expect("skein runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "skein panicked: {stderr}");
        out
    }

    fn skein_ok(&self, args: &[&str]) -> Output {
        let out = self.skein(args);
        assert!(
            out.status.success(),
            "skein {args:?} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `skein run --json ARGS MISSION`, whatever its exit status.
    fn run(&self, args: &[&str]) -> (Output, Value) {
        let mut all = vec!["run", "--json"];
        all.extend_from_slice(args);
        all.push(ROOT_MISSION);
        let out = self.skein(&all);
        let v = json_of(&out);
        (out, v)
    }

    fn tree_json(&self, root: &str) -> Value {
        json_of(&self.skein_ok(&["tree", root, "--json"]))
    }

    /// Every event of one session, as `events --json` prints them.
    fn events(&self, session: &str) -> Vec<Value> {
        let out = self.skein_ok(&["events", session, "--json"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("an event line is JSON"))
            .collect()
    }

    /// The fake key is nowhere: not in `outputs`, the events of any session of the tree,
    /// `tree --json`, `--dump-config`, nor any byte of the store on disk.
    fn assert_key_kept_secret(&self, root: &str, outputs: &[&Output]) {
        let mut texts: Vec<(String, String)> = vec![];
        for (i, o) in outputs.iter().enumerate() {
            texts.push((format!("output {i} stdout"), lossy(&o.stdout)));
            texts.push((format!("output {i} stderr"), lossy(&o.stderr)));
        }
        let tree = self.tree_json(root);
        texts.push(("tree --json".into(), tree.to_string()));
        for s in tree["sessions"].as_array().expect("sessions") {
            let id = s["session"].as_str().expect("session id");
            let out = self.skein_ok(&["events", id, "--json"]);
            texts.push((format!("events {id}"), lossy(&out.stdout)));
        }
        let dump = self.skein_ok(&["--dump-config", "sessions"]);
        texts.push(("--dump-config".into(), lossy(&dump.stdout)));
        for (what, text) in &texts {
            assert!(
                !text.contains(FAKE_KEY),
                "the API key leaked into {what}: {text}"
            );
        }
        for file in files_under(&self.data()) {
            let bytes = std::fs::read(&file).expect("read a store file");
            assert!(
                !bytes
                    .windows(FAKE_KEY.len())
                    .any(|w| w == FAKE_KEY.as_bytes()),
                "the API key leaked into {}",
                file.display()
            );
        }
    }
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\nstdout: {}\nstderr: {}",
            lossy(&out.stdout),
            lossy(&out.stderr)
        )
    })
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read a store directory") {
            let p = e.expect("directory entry").path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// The requests whose system prompt starts with `prefix`, in arrival order.
fn asked_by<'a>(wire: Wire, reqs: &'a [Seen], prefix: &str) -> Vec<&'a Seen> {
    reqs.iter()
        .filter(|r| wire.system(&r.body).starts_with(prefix))
        .collect()
}

fn root_of(run: &Value) -> String {
    run["session"]
        .as_str()
        .expect("run --json names its root")
        .to_string()
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// The run completed with a brief made of both researchers' findings.
fn assert_brief(run: &Value) {
    assert_eq!(run["status"], "completed", "{run:#}");
    let answer = run["answer"].as_str().expect("an answer");
    for m in MISSIONS {
        assert!(
            answer.contains(&finding(m)),
            "the brief lacks `{m}`: {answer}"
        );
    }
    assert!(
        !answer.contains("did not run in parallel"),
        "the researchers ran one after the other: {answer}"
    );
}

/// `replay ROOT --verify --tree` passes for the whole tree of `sessions` sessions.
fn assert_replays(site: &Site, root: &str, sessions: usize) {
    let out = site.skein_ok(&["replay", root, "--verify", "--tree", "--json"]);
    let v = json_of(&out);
    assert_eq!(v["ok"], true, "{v:#}");
    assert_eq!(
        v["sessions"].as_array().map(Vec::len),
        Some(sessions),
        "{v:#}"
    );
}

fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

// ---- a. OpenAI-compatible ------------------------------------------------------------------

#[test]
fn openai_compatible_tree_runs_over_http() {
    let wire = Wire::OpenAi;
    let site = Site::new(
        wire,
        "",
        "[models.prices.\"local:test-model\"]\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\n",
        tree(wire),
    );
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert!(out.status.success(), "{run:#}");
    assert_brief(&run);
    let root = root_of(&run);

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 4, "{reqs:#?}");
    for r in &reqs {
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(
            r.headers.get("authorization").map(String::as_str),
            Some(format!("Bearer {FAKE_KEY}").as_str())
        );
        assert_eq!(r.body["model"], "test-model");
    }

    let orch = asked_by(wire, &reqs, "You are the orchestrator");
    assert_eq!(orch.len(), 2);
    let first = &orch[0].body;
    let msgs = messages(first);
    assert_eq!(msgs[0]["role"], "system", "{first:#}");
    assert_eq!(msgs[0]["content"], ORCHESTRATOR_PROMPT);
    assert_eq!(msgs[1]["role"], "user");
    assert_eq!(msgs[1]["content"], ROOT_MISSION);
    assert_eq!(msgs.len(), 2, "{first:#}");
    let tools = first["tools"].as_array().expect("tools");
    let call_agent = tools
        .iter()
        .find(|t| t["function"]["name"] == "call_agent")
        .unwrap_or_else(|| panic!("no call_agent in {tools:#?}"));
    assert_eq!(call_agent["type"], "function");
    let params = &call_agent["function"]["parameters"];
    assert_eq!(params["type"], "object", "{params:#}");
    assert_eq!(params["properties"]["mission"]["type"], "string");
    assert_eq!(params["properties"]["agent"]["enum"], json!(["researcher"]));
    assert_eq!(first["tool_choice"], "auto");

    // The second turn: the assistant's calls, then one tool message per call, answered
    // under the ids the server issued, carrying each child's answer.
    let second = &orch[1].body;
    let msgs = messages(second);
    let assistant = msgs
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("the assistant turn is sent back");
    let sent_ids: Vec<&str> = assistant["tool_calls"]
        .as_array()
        .expect("tool_calls")
        .iter()
        .map(|c| c["id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(sent_ids, wire.call_ids());
    let tool_msgs: Vec<&Value> = msgs.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(tool_msgs.len(), 2, "{second:#}");
    for (i, m) in tool_msgs.iter().enumerate() {
        assert_eq!(m["tool_call_id"], wire.call_ids()[i], "{m:#}");
        let result: Value =
            serde_json::from_str(m["content"].as_str().expect("content")).expect("JSON result");
        assert_eq!(result["success"], true, "{result:#}");
        assert_eq!(result["result"], finding(MISSIONS[i]));
    }

    let researchers = asked_by(wire, &reqs, "You are a researcher");
    assert_eq!(researchers.len(), 2);
    let missions: BTreeSet<String> = researchers.iter().map(|r| wire.mission(&r.body)).collect();
    assert_eq!(missions, MISSIONS.iter().map(|m| m.to_string()).collect());
    for r in &researchers {
        assert!(
            r.body.get("tools").is_none(),
            "a researcher has no tools: {:#}",
            r.body
        );
        assert_eq!(messages(&r.body)[0]["content"], RESEARCHER_PROMPT);
    }

    // Usage as reported (100 in, 20 out a call) and priced at 1 and 2 $/Mtok.
    let tree = site.tree_json(&root);
    let sessions = tree["sessions"].as_array().expect("sessions");
    assert_eq!(sessions.len(), 3, "{tree:#}");
    let top = &sessions[0];
    assert_eq!(top["agent"], "orchestrator");
    assert_eq!(top["usage"]["input_tokens"], 200);
    assert_eq!(top["usage"]["output_tokens"], 40);
    assert_eq!(top["usage_total"]["input_tokens"], 400, "{tree:#}");
    assert_eq!(top["usage_total"]["output_tokens"], 80);
    assert_eq!(top["usage_total"]["estimated"], false);
    let cost = top["usage_total"]["cost"].as_f64().expect("cost");
    assert!(approx(cost, 400.0 / 1e6 + 80.0 * 2.0 / 1e6), "{cost}");
    for child in &sessions[1..] {
        assert_eq!(child["agent"], "researcher");
        assert_eq!(child["status"], "completed");
        let c = child["usage"]["cost"].as_f64().expect("cost");
        assert!(approx(c, 100.0 / 1e6 + 20.0 * 2.0 / 1e6), "{c}");
    }
    assert!(approx(
        tree["summary"]["usage"]["cost"]
            .as_f64()
            .expect("summary cost"),
        cost
    ));

    assert_replays(&site, &root, 3);
    site.assert_key_kept_secret(&root, &[&out]);
}

// ---- b. Anthropic --------------------------------------------------------------------------

#[test]
fn anthropic_tree_runs_over_http() {
    let wire = Wire::Anthropic;
    let site = Site::new(wire, "", "", tree(wire));
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert!(out.status.success(), "{run:#}");
    assert_brief(&run);
    let root = root_of(&run);

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 4, "{reqs:#?}");
    for r in &reqs {
        assert_eq!(r.path, "/v1/messages");
        assert_eq!(
            r.headers.get("x-api-key").map(String::as_str),
            Some(FAKE_KEY)
        );
        assert_eq!(
            r.headers.get("anthropic-version").map(String::as_str),
            Some("2023-06-01")
        );
        assert!(!r.headers.contains_key("authorization"), "{:?}", r.headers);
        assert_eq!(r.body["model"], "test-model");
        assert!(r.body["max_tokens"].as_u64().is_some_and(|n| n > 0));
        assert!(
            messages(&r.body).iter().all(|m| m["role"] != "system"),
            "the system prompt goes in the top-level field: {:#}",
            r.body
        );
    }

    let orch = asked_by(wire, &reqs, "You are the orchestrator");
    assert_eq!(orch.len(), 2);
    let first = &orch[0].body;
    assert_eq!(first["system"], ORCHESTRATOR_PROMPT);
    assert_eq!(messages(first).len(), 1, "{first:#}");
    assert_eq!(wire.mission(first), ROOT_MISSION);
    let tools = first["tools"].as_array().expect("tools");
    let call_agent = tools
        .iter()
        .find(|t| t["name"] == "call_agent")
        .unwrap_or_else(|| panic!("no call_agent in {tools:#?}"));
    assert_eq!(
        call_agent["input_schema"]["type"], "object",
        "{call_agent:#}"
    );
    assert_eq!(
        call_agent["input_schema"]["properties"]["agent"]["enum"],
        json!(["researcher"])
    );

    // user → assistant (text, tool_use, tool_use) → user (tool_result, tool_result).
    let second = &orch[1].body;
    let msgs = messages(second);
    assert_eq!(msgs.len(), 3, "{second:#}");
    assert_eq!(msgs[1]["role"], "assistant");
    let uses: Vec<&str> = msgs[1]["content"]
        .as_array()
        .expect("assistant blocks")
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| b["id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(uses, wire.call_ids());
    assert_eq!(msgs[2]["role"], "user");
    let blocks = msgs[2]["content"].as_array().expect("result blocks");
    assert_eq!(
        blocks.len(),
        2,
        "both results in one user message: {second:#}"
    );
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b["type"], "tool_result");
        assert_eq!(b["tool_use_id"], wire.call_ids()[i]);
        assert!(b.get("is_error").is_none(), "{b:#}");
        let result: Value = serde_json::from_str(&text_of(&b["content"])).expect("JSON result");
        assert_eq!(result["result"], finding(MISSIONS[i]));
    }

    let researchers = asked_by(wire, &reqs, "You are a researcher");
    let missions: BTreeSet<String> = researchers.iter().map(|r| wire.mission(&r.body)).collect();
    assert_eq!(missions, MISSIONS.iter().map(|m| m.to_string()).collect());
    for r in &researchers {
        assert!(r.body.get("tools").is_none(), "{:#}", r.body);
    }

    // Usage as reported; no price configured, so no cost.
    let tree = site.tree_json(&root);
    let top = &tree["sessions"][0];
    assert_eq!(top["usage_total"]["input_tokens"], 400, "{tree:#}");
    assert_eq!(top["usage_total"]["output_tokens"], 80);
    assert_eq!(top["usage_total"]["cost"].as_f64(), Some(0.0));

    assert_replays(&site, &root, 3);
    site.assert_key_kept_secret(&root, &[&out]);
}

// ---- c. error paths through the runtime ----------------------------------------------------

/// The tree, with the first request answered 429 `Retry-After: 1`.
fn rate_limited_once(wire: Wire) -> impl Fn(&Seen) -> Reply + Send + Sync + 'static {
    let n = AtomicUsize::new(0);
    let rest = tree(wire);
    move |req| {
        if n.fetch_add(1, Ordering::SeqCst) == 0 {
            return Reply::status(
                429,
                json!({"error": {
                    "message": "Rate limit reached for test-model",
                    "type": "requests",
                    "code": "rate_limit_exceeded"
                }}),
            )
            .header("retry-after", "1");
        }
        rest(req)
    }
}

/// With the default `max_retries`, the provider itself waits what `Retry-After` says and
/// tries again: the runtime sees one successful call and records no failure.
#[test]
fn rate_limit_is_retried_by_the_provider_after_retry_after() {
    let wire = Wire::OpenAi;
    let site = Site::new(wire, "", "", rate_limited_once(wire));
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert!(out.status.success(), "{run:#}");
    assert_brief(&run);
    let root = root_of(&run);

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 5, "one request repeated: {reqs:#?}");
    assert_eq!(reqs[0].body, reqs[1].body, "the same request is sent again");
    let waited = reqs[1].at.duration_since(reqs[0].at);
    assert!(
        waited >= Duration::from_millis(950),
        "Retry-After: 1 was not honoured: the retry came after {waited:?}"
    );
    let events = site.events(&root);
    let kinds = kinds(&events);
    assert!(!kinds.iter().any(|k| k == "ModelFailed"), "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "ModelCalled").count(), 2);
}

/// Without in-process retries the 429 reaches the runtime: a retryable `ModelFailed`
/// naming the status is recorded, and the next attempt goes through.
#[test]
fn rate_limit_without_provider_retries_is_a_model_failed_event_then_a_retry() {
    let wire = Wire::OpenAi;
    let site = Site::new(wire, "max_retries = 0", "", rate_limited_once(wire));
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert!(out.status.success(), "{run:#}");
    assert_brief(&run);
    let root = root_of(&run);

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 5, "{reqs:#?}");
    assert!(reqs[1].at.duration_since(reqs[0].at) >= Duration::from_millis(950));
    let events = site.events(&root);
    let failed: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "ModelFailed")
        .collect();
    assert_eq!(failed.len(), 1, "{:?}", kinds(&events));
    let f = &failed[0]["body"]["data"];
    assert_eq!(f["retryable"], true, "{f:#}");
    assert_eq!(f["attempt"], 1);
    assert_eq!(f["model"], "local:test-model");
    let error = f["error"].as_str().expect("error");
    assert!(
        error.contains("HTTP 429") && error.contains("Rate limit reached"),
        "{error}"
    );
    assert_replays(&site, &root, 3);
}

#[test]
fn unauthorized_fails_the_root_with_the_http_status() {
    let wire = Wire::OpenAi;
    // Real servers quote the key back; it must come out scrubbed.
    let site = Site::new(wire, "", "", |_req: &Seen| {
        Reply::status(
            401,
            json!({"error": {
                "message": format!("Incorrect API key provided: {FAKE_KEY}."),
                "type": "invalid_request_error",
                "param": null,
                "code": "invalid_api_key"
            }}),
        )
    });
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert_eq!(out.status.code(), Some(1), "{run:#}");
    assert_eq!(run["status"], "failed", "{run:#}");
    let error = run["error"].as_str().expect("a reason");
    assert!(
        error.contains("HTTP 401") && error.contains("Incorrect API key provided: ***"),
        "{error}"
    );
    // Not retryable: asked once, neither in process nor by the runtime again.
    assert_eq!(site.server.requests().len(), 1);
    let root = root_of(&run);
    let events = site.events(&root);
    let kinds = kinds(&events);
    assert_eq!(
        kinds
            .iter()
            .rev()
            .take(2)
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["Failed", "ModelFailed"],
        "{kinds:?}"
    );
    let failed = events
        .iter()
        .find(|e| e["kind"] == "ModelFailed")
        .expect("ModelFailed");
    assert_eq!(failed["body"]["data"]["retryable"], false);
    assert_replays(&site, &root, 1);
    site.assert_key_kept_secret(&root, &[&out]);
}

/// The orchestrator's first answer is `first`; its second request must show it a tool
/// error for call `id` containing `expect`, and is then answered with a final text.
fn corrected_after_tool_error(
    first: Value,
    id: &'static str,
    expect: &'static str,
) -> impl Fn(&Seen) -> Reply + Send + Sync + 'static {
    let wire = Wire::OpenAi;
    move |req| {
        let results = wire.results(&req.body);
        match results.as_slice() {
            [] => Reply::ok(first.clone()),
            [(call, content)] if call == id && content.contains(expect) => {
                Reply::ok(wire.text("Corrected: answering without that call."))
            }
            other => Reply::unexpected(&format!("{other:?}")),
        }
    }
}

#[test]
fn unreadable_tool_arguments_are_shown_to_the_model_as_a_tool_error() {
    let raw = "{\"agent\": \"researcher\", \"mission\": \"Trace the orig";
    let first = openai_calls(&[("call_Cut1", "call_agent", raw.to_string())]);
    let site = Site::new(
        Wire::OpenAi,
        "",
        "",
        corrected_after_tool_error(first, "call_Cut1", "could not be read"),
    );
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert!(out.status.success(), "{run:#}");
    assert_eq!(run["answer"], "Corrected: answering without that call.");

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 2, "no child was started: {reqs:#?}");
    let msgs = messages(&reqs[1].body);
    let tool = msgs
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("a tool message");
    let content = tool["content"].as_str().expect("content");
    assert!(
        content.starts_with("Error:") && content.contains("could not be read"),
        "{content}"
    );
    // The model is shown its call as it wrote it.
    let assistant = msgs
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("assistant");
    assert_eq!(assistant["tool_calls"][0]["function"]["arguments"], raw);
    let root = root_of(&run);
    assert_eq!(
        site.tree_json(&root)["sessions"].as_array().map(Vec::len),
        Some(1)
    );
    assert_replays(&site, &root, 1);
}

#[test]
fn unknown_tool_is_shown_to_the_model_as_a_tool_error() {
    let first = openai_calls(&[("call_Tele1", "teleport", json!({"to": "mars"}).to_string())]);
    let site = Site::new(
        Wire::OpenAi,
        "",
        "",
        corrected_after_tool_error(first, "call_Tele1", "unknown tool `teleport`"),
    );
    site.tree_agents("local:test-model");
    let (out, run) = site.run(&[]);
    assert!(out.status.success(), "{run:#}");
    assert_eq!(run["answer"], "Corrected: answering without that call.");

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 2, "{reqs:#?}");
    let tool = messages(&reqs[1].body)
        .iter()
        .find(|m| m["role"] == "tool")
        .cloned()
        .expect("a tool message");
    let content = tool["content"].as_str().expect("content");
    assert!(
        content.starts_with("Error:") && content.contains("call_agent"),
        "the error names the tools allowed: {content}"
    );
    assert_replays(&site, &root_of(&run), 1);
}

#[test]
fn a_key_echoed_in_an_answer_or_a_tool_output_is_recorded_scrubbed() {
    let wire = Wire::OpenAi;
    // A 200 answer that repeats the key in its text and reads a file holding it; the final
    // answer repeats it again.
    let mut first = openai_calls(&[(
        "call_Read1",
        "read_file",
        json!({"path": "notes.txt"}).to_string(),
    )]);
    first["choices"][0]["message"]["content"] = json!(format!("Using the key {FAKE_KEY}."));
    let site = Site::new(wire, "", "", move |req: &Seen| {
        match wire.results(&req.body).as_slice() {
            [] => Reply::ok(first.clone()),
            [(call, content)] if call == "call_Read1" => {
                // The tool's output reaches the model scrubbed, as it is recorded.
                if content.contains(FAKE_KEY) || !content.contains("the key: ***") {
                    return Reply::unexpected(content);
                }
                Reply::ok(wire.text(&format!("The key was {FAKE_KEY}.")))
            }
            other => Reply::unexpected(&format!("{other:?}")),
        }
    });
    site.agent(
        "orchestrator",
        "model: local:test-model\ntools: [read_file]\n",
        "Read notes.txt.",
    );
    // The tree's files outside the store, whose every byte is checked below.
    let config = site.dir.path().join("skein.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("workspace_dir = \"ws\"\n{text}")).unwrap();
    let ws = site.dir.path().join("ws/leaky");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("notes.txt"), format!("the key: {FAKE_KEY}\n")).unwrap();
    let (out, run) = site.run(&["--id", "leaky"]);
    assert!(out.status.success(), "{run:#}");
    assert_eq!(run["answer"], "The key was ***.", "{run:#}");
    let events = site.events("leaky");
    let called = events
        .iter()
        .find(|e| e["kind"] == "ModelCalled")
        .expect("ModelCalled");
    let response = &called["body"]["data"]["response"];
    assert_eq!(response["content"], "Using the key ***.", "{called:#}");
    site.assert_key_kept_secret("leaky", &[&out]);
    assert_replays(&site, "leaky", 1);
}

// ---- d. `run --model` ----------------------------------------------------------------------

#[test]
fn run_model_flag_puts_every_agent_on_the_http_model() {
    let wire = Wire::OpenAi;
    let site = Site::new(wire, "", "", tree(wire));
    // Scripted models with no scripts: only the override can make this tree run.
    site.agent(
        "orchestrator",
        "model: scripted:orchestrator\nagents: [researcher]\n",
        ORCHESTRATOR_PROMPT,
    );
    site.agent(
        "researcher",
        "model: scripted:researcher\n",
        RESEARCHER_PROMPT,
    );
    let (out, run) = site.run(&["--model", "local:test-model"]);
    assert!(out.status.success(), "{run:#}");
    assert_brief(&run);
    let root = root_of(&run);

    let reqs = site.server.requests();
    assert_eq!(reqs.len(), 4, "{reqs:#?}");
    assert!(reqs.iter().all(|r| r.body["model"] == "test-model"));
    let tree = site.tree_json(&root);
    for s in tree["sessions"].as_array().expect("sessions") {
        let id = s["session"].as_str().expect("id");
        let models: Vec<Value> = site
            .events(id)
            .iter()
            .filter(|e| e["kind"] == "ModelCalled")
            .map(|e| e["body"]["data"]["model"].clone())
            .collect();
        assert!(!models.is_empty(), "{id}");
        assert!(
            models.iter().all(|m| m == "local:test-model"),
            "{id}: {models:?}"
        );
    }
    // Every log re-derives its decisions from the definitions it recorded.
    let out = site.skein_ok(&["replay", &root, "--verify"]);
    assert!(
        lossy(&out.stdout).starts_with("ok"),
        "{}",
        lossy(&out.stdout)
    );
    assert_replays(&site, &root, 3);
}

#[test]
fn run_model_flag_rejects_a_malformed_name_or_an_unknown_provider() {
    let site = Site::new(Wire::OpenAi, "", "", |_req: &Seen| {
        Reply::unexpected("none expected")
    });
    site.tree_agents("scripted:orchestrator");
    for (model, expect) in [
        ("test-model", "is not of the form `provider:model`"),
        ("local:", "is not of the form `provider:model`"),
        ("nowhere:test-model", "no model provider `nowhere`"),
    ] {
        let out = site.skein(&["run", "--model", model, ROOT_MISSION]);
        assert_eq!(out.status.code(), Some(1), "--model {model}");
        let stderr = lossy(&out.stderr);
        assert!(stderr.contains(expect), "--model {model}: {stderr}");
        if model.starts_with("nowhere") {
            assert!(
                stderr.contains("local"),
                "the configured providers are listed: {stderr}"
            );
        }
    }
    assert!(site.server.requests().is_empty());
    assert!(
        !site.data().exists(),
        "nothing was stored for a refused run"
    );
}
