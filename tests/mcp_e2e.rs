//! Agents using MCP servers end to end through the real binary with the scripted model:
//! the reference filesystem server from npm (a read runs, a write waits for approval);
//! the "everything" server's long call (its progress shows in `skein run`'s live view and
//! is not recorded); a FastMCP server of the Python SDK that adds a tool while a session
//! runs (called on the next turn without a restart, not by a child its caller narrowed
//! with `allowed_tools`; the trees replay exactly), and one
//! killed with the worker mid-call (kill -9, then resume: the call's outcome is recorded
//! once, the server is not called again, and the tree replays exactly). About 25 s on two
//! cores once the servers are installed.

mod common;
#[path = "../crates/skein-mcp/tests/common/mod.rs"]
mod mcp_servers;

use std::io::BufReader;
use std::process::Stdio;

use common::*;
use serde_json::Value;

fn toml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

#[test]
fn an_agent_reads_through_the_filesystem_server_and_a_write_waits_for_approval() {
    let bin = mcp_servers::npm_bin();
    let sb = Sandbox::new();
    let files = sb.dir.path().join("shared");
    std::fs::create_dir_all(&files).unwrap();
    std::fs::write(files.join("notes.txt"), "the launch is on Tuesday\n").unwrap();
    let server = bin.join("mcp-server-filesystem");
    configure(
        &sb,
        &format!(
            "\n[mcp.servers.fs]\ncommand = {}\nargs = [{}]\n",
            toml_str(server.to_str().unwrap()),
            toml_str(files.to_str().unwrap())
        ),
    );
    let notes = files.join("notes.txt");
    sb.agent(
        "librarian",
        "mcp: [fs]\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: fs__read_text_file
        args: {{path: {}}}
  - answer: "{{{{ results[0] }}}}"
"#,
            toml_str(notes.to_str().unwrap())
        ),
    );
    sb.agent(
        "scribe",
        "tools: [fs.write_file]\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: fs__write_file
        args: {{path: {}, content: "new"}}
  - answer: "{{{{ results[0] }}}}"
"#,
            toml_str(files.join("out.txt").to_str().unwrap())
        ),
    );
    let out = run(&sb, &["agents", "check", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["mcp_tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == "fs__read_text_file"),
        "{v}"
    );
    assert_eq!(v["caching"]["librarian"]["cached"], false, "{v}");

    let out = run(
        &sb,
        &["run", "--agent", "librarian", "--id", "lib", "--json", "go"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    assert!(
        v["answer"]
            .as_str()
            .unwrap()
            .contains("the launch is on Tuesday"),
        "{v}"
    );
    let log = events(&sb, "lib");
    let called = of_kind(&log, "ToolCalled");
    assert_eq!(called.len(), 1);
    assert_eq!(
        called[0]["body"]["data"]["tool"], "fs__read_text_file",
        "{log:?}"
    );
    assert_eq!(of_kind(&log, "ToolReturned").len(), 1);
    let verified = run(&sb, &["replay", "lib", "--verify"]);
    assert!(verified.status.success(), "{}", stderr(&verified));

    // The writer is marked destructive: it waits for a person, and nothing is written.
    let out = run(
        &sb,
        &["run", "--agent", "scribe", "--id", "scr", "--json", "go"],
    );
    assert_eq!(out.status.code(), Some(3), "paused: {}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "awaiting_approval", "{v}");
    assert!(!files.join("out.txt").exists());
    let out = run(&sb, &["inbox", "--json"]);
    let items: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(items[0]["tool"], "fs__write_file", "{items:?}");
    let token = items[0]["token"].as_str().unwrap().to_string();
    let out = run(&sb, &["approve", &token]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(files.join("out.txt")).unwrap(),
        "new"
    );
    // The approval is re-derived on replay: the tool's annotations are part of the rules.
    let verified = run(&sb, &["replay", "scr", "--verify"]);
    assert!(verified.status.success(), "{}", stderr(&verified));
}

#[test]
fn a_long_calls_progress_shows_in_the_live_view_and_is_not_recorded() {
    let bin = mcp_servers::npm_bin();
    let sb = Sandbox::new();
    let server = bin.join("mcp-server-everything");
    configure(
        &sb,
        &format!(
            "\n[mcp.servers.ev]\ncommand = {}\nargs = [\"stdio\"]\n",
            toml_str(server.to_str().unwrap())
        ),
    );
    sb.agent(
        "waiter",
        "mcp: [ev]\n",
        r#"
turns:
  - tool_calls:
      - tool: ev__trigger-long-running-operation
        args: {duration: 1.2, steps: 4}
  - answer: "{{ results[0] }}"
"#,
    );
    // Without --json, the live view goes to stderr (plain lines, as it is no terminal).
    let out = run(&sb, &["run", "--agent", "waiter", "--id", "lro", "go"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // The first of the four notifications always shows; the rest may be held back.
    assert!(
        err.contains("⋯ ev__trigger-long-running-operation 1/4"),
        "no progress line in:\n{err}"
    );
    let shown = err.matches("ev__trigger-long-running-operation ").count();
    assert!((1..=4).contains(&shown), "{shown} lines:\n{err}");
    let log = events(&sb, "lro");
    assert!(
        log.iter().all(|e| !e.to_string().contains("tool_progress")),
        "progress was recorded: {log:?}"
    );
    assert_eq!(of_kind(&log, "ToolReturned").len(), 1, "{log:?}");
    let verified = run(&sb, &["replay", "lro", "--verify"]);
    assert!(verified.status.success(), "{}", stderr(&verified));
}

#[test]
fn a_tool_a_server_adds_while_a_session_runs_is_called_on_its_next_turn() {
    let py = mcp_servers::python();
    let sb = Sandbox::new();
    let script = mcp_servers::write_fastmcp(sb.dir.path());
    configure(
        &sb,
        &format!(
            "\n[mcp.servers.py]\ncommand = {}\nargs = [{}, \"stdio\"]\n",
            toml_str(py.to_str().unwrap()),
            toml_str(script.to_str().unwrap())
        ),
    );
    // `grow` adds `extra` (read-only) and `risky` (no annotations: it would need approval,
    // which the rules fixed at start do not name), and says the list changed.
    sb.agent(
        "grower",
        "mcp: [py]\n",
        r#"
turns:
  - tool_calls:
      - tool: py__grow
        args: {}
  - tool_calls:
      - tool: py__extra
        args: {}
      - tool: py__risky
        args: {}
  - answer: "{{ results[0] }} / {{ results[1] }}"
"#,
    )
    .agent(
        "narrow",
        "agents: [grower]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: grower, mission: "grow", allowed_tools: [py__grow]}
  - answer: "{{ results[0].result }}"
"#,
    );
    let out = run(
        &sb,
        &["run", "--agent", "grower", "--id", "grow", "--json", "go"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    let answer = v["answer"].as_str().unwrap();
    assert!(answer.starts_with("extra / "), "{v}");
    assert!(answer.contains("after the worker started"), "{v}");
    let log = events(&sb, "grow");
    assert_eq!(of_kind(&log, "ToolReturned").len(), 3, "{log:?}");
    assert!(of_kind(&log, "ApprovalRequested").is_empty(), "{log:?}");
    // Replay starts the server afresh (it lists neither new tool) and derives the same
    // decisions from the log alone.
    let verified = run(&sb, &["replay", "grow", "--verify"]);
    assert!(verified.status.success(), "{}", stderr(&verified));

    // Narrowed by its caller to `py__grow`, the same agent may not call what `grow` adds.
    let out = run(
        &sb,
        &["run", "--agent", "narrow", "--id", "narrow", "--json", "go"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let answer = v["answer"].as_str().unwrap();
    assert_eq!(answer.matches("may use only: py__grow").count(), 2, "{v}");
    let verified = run(&sb, &["replay", "narrow", "--verify"]);
    assert!(verified.status.success(), "{}", stderr(&verified));
}

#[test]
fn kill9_during_an_mcp_call_then_resume_records_the_call_once() {
    let py = mcp_servers::python();
    let sb = Sandbox::new();
    let script = mcp_servers::write_fastmcp(sb.dir.path());
    let marks = sb.dir.path().join("marks.txt");
    configure(
        &sb,
        &format!(
            "\n[mcp.servers.py]\ncommand = {}\nargs = [{}, \"stdio\"]\napproval = \"never\"\n",
            toml_str(py.to_str().unwrap()),
            toml_str(script.to_str().unwrap())
        ),
    );
    sb.agent(
        "marker",
        "mcp: [py]\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: py__mark
        args: {{path: {}, seconds: 30}}
  - answer: "{{{{ results[0] }}}}"
"#,
            toml_str(marks.to_str().unwrap())
        ),
    );
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "marker", "--id", "mk", "go"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    // The server has the call once it wrote its mark.
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&marks).is_ok_and(|s| s.ends_with('\n')) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the server was never called"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let server_pid = std::fs::read_to_string(&marks).unwrap().trim().to_string();
    let _orphan = KillOnDrop(server_pid.clone());
    std::process::Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(!child.wait().unwrap().success());
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);

    let out = run(&sb, &["resume", "mk", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    // Not run again: the tool is not read-only, so its outcome is reported unknown.
    assert!(v["answer"].as_str().unwrap().contains("unknown"), "{v}");
    let marked = std::fs::read_to_string(&marks).unwrap();
    assert_eq!(
        marked.lines().count(),
        1,
        "the server was called again: {marked}"
    );
    let log = events(&sb, "mk");
    assert_eq!(of_kind(&log, "ToolCalled").len(), 1, "{log:?}");
    assert_eq!(of_kind(&log, "ToolReturned").len(), 1, "{log:?}");
    let verified = run(&sb, &["replay", "mk", "--verify"]);
    assert!(verified.status.success(), "{}", stderr(&verified));
}

#[test]
fn a_session_that_times_out_cancels_its_call_at_the_server() {
    let py = mcp_servers::python();
    let sb = Sandbox::new();
    let script = mcp_servers::write_fastmcp(sb.dir.path());
    let naps = sb.dir.path().join("naps.txt");
    configure(
        &sb,
        &format!(
            "\n[mcp.servers.py]\ncommand = {}\nargs = [{}, \"stdio\"]\napproval = \"never\"\n",
            toml_str(py.to_str().unwrap()),
            toml_str(script.to_str().unwrap())
        ),
    );
    sb.agent(
        "napper",
        "mcp: [py]\nlimits: {timeout: 2s}\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: py__nap
        args: {{path: {}, seconds: 60}}
  - answer: "{{{{ results[0] }}}}"
"#,
            toml_str(naps.to_str().unwrap())
        ),
    );
    let out = run(
        &sb,
        &["run", "--agent", "napper", "--id", "nap", "--json", "go"],
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert!(v.to_string().contains("timed out"), "{v} {}", stderr(&out));
    // The server heard the call was cancelled (written by the tool as it was stopped).
    let started = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(&naps).unwrap_or_default();
        if text.contains("cancelled") {
            assert_eq!(text.matches("started").count(), 1, "{text}");
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the server was not told the call was cancelled: {text:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn agents_check_reports_a_server_that_will_not_start_and_unknown_mcp_names() {
    let sb = Sandbox::new();
    configure(
        &sb,
        "\n[mcp.servers.ghost]\ncommand = \"/nonexistent/mcp-server\"\n",
    );
    sb.agent(
        "a",
        "mcp: [ghost, nowhere]\ntools: [elsewhere.tool]\n",
        "turns:\n  - answer: ok\n",
    );
    let out = run(&sb, &["agents", "check"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("MCP server `ghost` will not start"), "{err}");
    assert!(err.contains("/nonexistent/mcp-server"), "{err}");
    assert!(
        err.contains("MCP server `nowhere`, which is not configured"),
        "{err}"
    );
    assert!(err.contains("`elsewhere__tool`"), "{err}");
    // A bad entry is refused when the configuration loads, naming its table.
    configure(
        &sb,
        "\n[mcp.servers.both]\ncommand = \"x\"\nurl = \"http://127.0.0.1:1/mcp\"\n",
    );
    let out = run(&sb, &["agents", "check"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("[mcp.servers.both]"),
        "{}",
        stderr(&out)
    );
}

/// Kills the server a SIGKILLed worker left behind.
struct KillOnDrop(String);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-9", &self.0])
            .status();
    }
}
