//! Recorded conversations with a real model server ("cassettes"), and the two HTTP
//! servers that make and play them.
//!
//! [`Proxy`] stands between skein and a real server: it forwards every request, passes
//! the answer through as it arrives (so a stream stays a stream), and records both.
//! [`Replay`] answers from a cassette: each request is first checked against the JSON
//! schema the real server published for its requests (saved beside the cassettes), and
//! refused with 422 as the real server refuses it when it does not conform; a request
//! that conforms gets the recorded answer to the same request.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request and the answer it got.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Interaction {
    pub path: String,
    pub request: Value,
    pub status: u16,
    pub content_type: String,
    /// The answer's bytes as text: a JSON body, or the whole event stream.
    pub body: String,
}

/// A tree's run against a real server: what skein asked, what the server said, and how
/// the tree ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cassette {
    pub server: String,
    pub model: String,
    pub tree: String,
    /// `{status, answer, error}` of the root.
    pub outcome: Value,
    pub interactions: Vec<Interaction>,
}

impl Cassette {
    pub fn load(path: &Path) -> Self {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("cassette {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("cassette {}: {e}", path.display()))
    }

    pub fn save(&self, path: &Path) {
        let text = serde_json::to_string_pretty(self).expect("cassette to JSON");
        std::fs::write(path, text + "\n").expect("write cassette");
    }
}

/// Where the cassettes of one server version live.
pub fn cassette_dir() -> PathBuf {
    super::repo().join("tests/cassettes/llama-cpp-python-0.3.36")
}

/// The request schema the real server publishes (its OpenAPI document's
/// `CreateChatCompletionRequest`, with its components as `$defs`).
pub fn schema_from_openapi(openapi: &Value) -> Value {
    let text = serde_json::to_string(&openapi["components"]["schemas"]).expect("schemas");
    let defs: Value = serde_json::from_str(&text.replace("#/components/schemas/", "#/$defs/"))
        .expect("schemas back");
    serde_json::json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": "#/$defs/CreateChatCompletionRequest",
        "$defs": defs,
    })
}

/// The saved request schema, compiled.
pub fn request_validator() -> jsonschema::Validator {
    let path = cassette_dir().join("request.schema.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("request schema {}: {e}", path.display()));
    let schema: Value = serde_json::from_str(&text).expect("schema is JSON");
    jsonschema::validator_for(&schema).expect("the schema compiles")
}

/// Every way `request` breaks the schema, one line each; empty when it conforms.
pub fn violations(v: &jsonschema::Validator, request: &Value) -> Vec<String> {
    v.iter_errors(request)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// One HTTP/1.1 request read off a socket: (method, path, body).
async fn read_request(sock: &mut TcpStream) -> Option<(String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut first = head.lines().next()?.split(' ');
    let method = first.next()?.to_string();
    let path = first.next()?.to_string();
    let len: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((method, path, body))
}

async fn write_head(sock: &mut TcpStream, status: u16, content_type: &str) {
    let head =
        format!("HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\nconnection: close\r\n\r\n");
    let _ = sock.write_all(head.as_bytes()).await;
}

/// Listens on a free loopback port with its own runtime on a thread.
fn serve<F, Fut>(handle: F) -> String
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let url = format!("http://{}", std_listener.local_addr().expect("addr"));
    let handle = Arc::new(handle);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = TcpListener::from_std(std_listener).expect("listener");
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(handle(sock));
            }
        });
    });
    url
}

/// A recording pass-through to a real server.
pub struct Proxy {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    log: Arc<Mutex<Vec<Interaction>>>,
}

impl Proxy {
    pub fn start(upstream: &str) -> Self {
        let log: Arc<Mutex<Vec<Interaction>>> = Arc::default();
        let (l, upstream) = (log.clone(), upstream.trim_end_matches('/').to_string());
        let client = reqwest::Client::new();
        let url = serve(move |mut sock| {
            let (log, upstream, client) = (l.clone(), upstream.clone(), client.clone());
            async move {
                let Some((_, path, body)) = read_request(&mut sock).await else {
                    return;
                };
                let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let resp = client
                    .post(format!("{upstream}{path}"))
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                let Ok(mut resp) = resp else {
                    write_head(&mut sock, 502, "text/plain").await;
                    return;
                };
                let status = resp.status().as_u16();
                let content_type = resp
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                write_head(&mut sock, status, &content_type).await;
                let mut all = Vec::new();
                while let Ok(Some(chunk)) = resp.chunk().await {
                    let _ = sock.write_all(&chunk).await;
                    let _ = sock.flush().await;
                    all.extend_from_slice(&chunk);
                }
                let _ = sock.shutdown().await;
                log.lock().expect("log").push(Interaction {
                    path,
                    request,
                    status,
                    content_type,
                    body: String::from_utf8_lossy(&all).to_string(),
                });
            }
        });
        Self { url, log }
    }

    pub fn interactions(&self) -> Vec<Interaction> {
        self.log.lock().expect("log").clone()
    }
}

/// Requests refused for breaking the schema: (request, violations).
pub type Refused = Arc<Mutex<Vec<(Value, Vec<String>)>>>;

/// A server that answers from a cassette, after the real server's request checks.
pub struct Replay {
    pub url: String,
    pub refused: Refused,
    /// Requests no recorded interaction matches.
    pub unknown: Arc<Mutex<Vec<Value>>>,
    used: Arc<Mutex<BTreeSet<usize>>>,
}

impl Replay {
    pub fn start(cassette: &Cassette) -> Self {
        let validator = Arc::new(request_validator());
        let interactions = Arc::new(cassette.interactions.clone());
        let refused: Refused = Arc::default();
        let unknown: Arc<Mutex<Vec<Value>>> = Arc::default();
        let used: Arc<Mutex<BTreeSet<usize>>> = Arc::default();
        let (r, u, us) = (refused.clone(), unknown.clone(), used.clone());
        let url = serve(move |mut sock| {
            let (validator, interactions) = (validator.clone(), interactions.clone());
            let (refused, unknown, used) = (r.clone(), u.clone(), us.clone());
            async move {
                let Some((_, path, body)) = read_request(&mut sock).await else {
                    return;
                };
                let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let bad = violations(&validator, &request);
                if !bad.is_empty() {
                    refused
                        .lock()
                        .expect("refused")
                        .push((request, bad.clone()));
                    let body = serde_json::json!({"error": {"message": bad.join("\n")}});
                    write_head(&mut sock, 422, "application/json").await;
                    let _ = sock.write_all(body.to_string().as_bytes()).await;
                    let _ = sock.shutdown().await;
                    return;
                }
                // The first unused interaction with this path and request; a request
                // asked again (a retry) may get an answer already given.
                let pick = {
                    let mut used = used.lock().expect("used");
                    let same =
                        |i: &&(usize, &Interaction)| i.1.path == path && i.1.request == request;
                    let all: Vec<(usize, &Interaction)> = interactions.iter().enumerate().collect();
                    let found = all
                        .iter()
                        .filter(same)
                        .find(|(n, _)| !used.contains(n))
                        .or_else(|| all.iter().rfind(|i| same(i)))
                        .map(|(n, i)| (*n, (*i).clone()));
                    if let Some((n, _)) = &found {
                        used.insert(*n);
                    }
                    found
                };
                let Some((_, it)) = pick else {
                    unknown.lock().expect("unknown").push(request);
                    let body =
                        r#"{"error":{"message":"replay: no recorded answer to this request"}}"#;
                    write_head(&mut sock, 400, "application/json").await;
                    let _ = sock.write_all(body.as_bytes()).await;
                    let _ = sock.shutdown().await;
                    return;
                };
                write_head(&mut sock, it.status, &it.content_type).await;
                let _ = sock.write_all(it.body.as_bytes()).await;
                let _ = sock.shutdown().await;
            }
        });
        Self {
            url,
            refused,
            unknown,
            used,
        }
    }

    /// How many recorded interactions were answered.
    pub fn used(&self) -> usize {
        self.used.lock().expect("used").len()
    }
}

/// One tree of the real-model suite: run with `skein run --agent AGENT --id ID MISSION`
/// on the config in `tests/real_model/config`.
pub struct Tree {
    pub name: &'static str,
    pub agent: &'static str,
    pub mission: &'static str,
}

/// Every tree, in the order the suite runs them.
pub const TREES: &[Tree] = &[
    // Text streamed by the server, shown by `skein run` while it arrives.
    Tree {
        name: "stream",
        agent: "helper",
        mission: "Say hello to the team in one sentence.",
    },
    // A scripted orchestrator fans three questions out to helpers on the real model.
    Tree {
        name: "fanout",
        agent: "orchestrator",
        mission: "Three small questions.",
    },
    // Native tool calls: a list_dir round trip (the second request carries the call).
    Tree {
        name: "tools",
        agent: "lister",
        mission: "List the files in the workspace.",
    },
    // The same with tools described in the prompt (tool_mode = "json").
    Tree {
        name: "json",
        agent: "jsonlister",
        mission: "List the files in the workspace.",
    },
];

pub fn real_config() -> PathBuf {
    super::repo().join("tests/real_model/config/skein.toml")
}

/// Runs `tree` against the OpenAI-compatible server at `url` (no `/v1`) in `data`.
/// Returns the output and the outcome `{code, stdout}`.
pub fn run_tree(tree: &Tree, url: &str, data: &Path) -> (std::process::Output, Value) {
    // The workspace the tools see: one file, the same in every run.
    let ws = data.join("workspaces").join(tree.name);
    std::fs::create_dir_all(&ws).expect("workspace");
    std::fs::write(ws.join("notes.md"), "# Notes\n").expect("workspace file");
    let v1 = format!("{url}/v1");
    let out = super::skein(&real_config(), data)
        .args([
            "run",
            "--agent",
            tree.agent,
            "--id",
            tree.name,
            tree.mission,
        ])
        .env("OPENAI_BASE_URL", &v1)
        .env("SKEIN__MODELS__PROVIDERS__LLAMAJSON__BASE_URL", &v1)
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("skein runs");
    let outcome = serde_json::json!({
        "code": out.status.code(),
        "stdout": String::from_utf8_lossy(&out.stdout).trim_end(),
    });
    (out, outcome)
}

/// What must hold after a run of `tree`, on a live server or a replay: the tree ended
/// Completed, or Failed for a reason the model caused (never a request the server
/// refused), its logs replay, and each tree's own point holds.
pub fn check_tree(tree: &Tree, out: &std::process::Output, data: &Path) {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let ctx = format!("tree {}:\nstdout: {stdout}\nstderr: {stderr}", tree.name);
    let code = out.status.code();
    assert!(code == Some(0) || code == Some(1), "{ctx}");
    if code == Some(1) {
        assert!(
            stdout.starts_with("failed: step limit reached")
                || stdout.starts_with("failed: the model's tool calls could not be read"),
            "a failure the model did not cause: {ctx}"
        );
    }
    assert!(
        !stdout.contains("HTTP 4") && !stdout.contains("HTTP 5"),
        "{ctx}"
    );
    let root = skein_core::SessionId::parse(tree.name).expect("id");
    let agents = super::repo().join("tests/real_model/config/agents");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let logs = rt.block_on(async {
        let store =
            skein_sled::SledStore::open(data, &data.join("workspaces")).expect("open store");
        let b = store.backend();
        super::audit_tree_in(&b, &root, &agents).await;
        let mut logs = vec![];
        for s in b.log.tree(&root).await.expect("tree") {
            logs.push((s.clone(), b.log.read(&s, 1).await.expect("read")));
        }
        logs
    });
    let kinds = |recs: &[skein_core::Record]| -> Vec<String> {
        recs.iter().map(|r| r.env.body.kind().to_string()).collect()
    };
    match tree.name {
        "stream" => {
            assert_eq!(code, Some(0), "{ctx}");
            // The answer showed while it arrived: its lines, marked │, on stderr.
            let shown: Vec<&str> = stderr
                .lines()
                .filter_map(|l| l.split_once(" │ ").map(|(_, t)| t))
                .collect();
            assert!(!shown.is_empty(), "no streamed text shown: {ctx}");
            assert_eq!(shown.join("\n").trim(), stdout.trim(), "{ctx}");
        }
        "fanout" => {
            assert_eq!(code, Some(0), "{ctx}");
            let children: Vec<_> = logs.iter().filter(|(s, _)| !s.is_root()).collect();
            assert_eq!(children.len(), 3, "{ctx}");
            for (s, recs) in children {
                let k = kinds(recs);
                assert_eq!(
                    k.last().map(String::as_str),
                    Some("Completed"),
                    "{s}: {k:?}"
                );
                assert!(k.contains(&"ModelCalled".to_string()), "{s}: {k:?}");
            }
        }
        "tools" | "json" => {
            let (_, recs) = &logs[0];
            let k = kinds(recs);
            assert!(k.len() >= 3, "{k:?}: {ctx}");
            if tree.name == "tools" {
                // A tool ran and the model was asked again with its result: the request
                // that carries an assistant message with tool calls.
                let first_return = k.iter().position(|x| x == "ToolReturned");
                let first_return = first_return.unwrap_or_else(|| panic!("no tool ran: {k:?}"));
                assert!(
                    k[first_return..].iter().any(|x| x == "ModelCalled"),
                    "no model call after the tool's result: {k:?}"
                );
            }
        }
        other => panic!("no checks for tree {other}"),
    }
}
