//! What comes from outside — ids, agent files, submissions, model output, a reader that
//! goes away — can neither crash the `skein` binary nor mislead the person at its
//! terminal. Every test drives the real binary on a real store (and a real nats-server
//! where a cluster is needed).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn run(sb: &Sandbox, args: &[&str]) -> Output {
    skein(&sb.config(), &sb.data()).args(args).output().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_no_panic(what: &str, out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("panicked") && out.status.code() != Some(101),
        "{what} panicked: {}",
        text(out)
    );
}

/// An agent that answers at once.
fn plain(sb: &Sandbox) {
    sb.agent("plain", "", "turns:\n  - answer: \"done: {{ mission }}\"\n");
}

// ---- item: ids ---------------------------------------------------------------------

/// 15 ASCII bytes, a 3-byte character across byte 16, then enough to pass 64 bytes.
fn multibyte_long_id() -> String {
    format!("{}€{}", "a".repeat(15), "b".repeat(60))
}

#[test]
fn an_over_long_id_with_a_multibyte_character_is_an_error_not_a_crash() {
    let sb = Sandbox::new();
    plain(&sb);
    let id = multibyte_long_id();
    let out = run(&sb, &["run", "--agent", "plain", "--id", &id, "hello"]);
    assert_no_panic("run --id", &out);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid session id") && err.contains("at most 64"),
        "{err}"
    );
    // Nothing was created.
    let out = run(&sb, &["sessions", "--json"]);
    assert_eq!(json_of(&out), json!([]));
    // Every command that reads an id refuses it the same way.
    for cmd in [
        vec!["events", id.as_str()],
        vec!["tree", id.as_str()],
        vec!["replay", id.as_str()],
        vec!["inbox", id.as_str()],
    ] {
        let out = run(&sb, &cmd);
        assert_no_panic(cmd[0], &out);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("at most 64"),
            "{}",
            text(&out)
        );
    }
}

#[test]
fn nats_intake_parsing_refuses_such_an_id_in_the_message_id_header() {
    // The intake names a root by the `Nats-Msg-Id` header when the payload has no id; the
    // header goes through the same id check.
    let id = multibyte_long_id();
    let payload = br#"{"agent": "plain", "mission": "m"}"#;
    let e = skein_nats_worker::intake::parse(payload, None, Some(&id)).unwrap_err();
    assert!(e.contains("at most 64"), "{e}");
}

// ---- item: a closed pipe ---------------------------------------------------------------

/// Runs `skein ARGS` with stdout a pipe whose reading end is already closed, as after
/// `| head -1` has read its line: every write fails with EPIPE.
fn with_closed_stdout(sb: &Sandbox, args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    skein(&sb.config(), &sb.data())
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

#[test]
fn every_command_ends_quietly_when_its_reader_has_gone() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "tools: [ask_user]\n",
        r#"
turns:
  - tool_calls:
      - tool: ask_user
        args: {questions: [{key: colour, question: "Which colour?"}]}
  - answer: "you said {{ results[0].answers.colour }}"
"#,
    );
    plain(&sb);
    let out = run(&sb, &["run", "--agent", "plain", "--id", "done1", "m"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&sb, &["run", "--agent", "boss", "--id", "paused1", "m"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let cases: Vec<Vec<&str>> = vec![
        vec!["events", "done1", "--json"],
        vec!["events", "done1"],
        vec!["sessions"],
        vec!["sessions", "--json"],
        vec!["tree", "done1"],
        vec!["replay", "done1"],
        vec!["replay", "done1", "--at", "2"],
        vec!["replay", "done1", "--verify"],
        vec!["inbox"],
        vec!["inbox", "--json"],
        vec!["plan", "done1"],
        vec!["agents", "check"],
        vec!["audit", "export", "done1"],
        vec!["--dump-config", "sessions"],
        vec!["run", "--agent", "plain", "--id", "fresh1", "again"],
    ];
    for args in cases {
        let out = with_closed_stdout(&sb, &args);
        assert_no_panic(&args.join(" "), &out);
        assert_eq!(
            out.status.code(),
            Some(0),
            "`skein {}` with its reader gone: {}",
            args.join(" "),
            text(&out)
        );
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("error"),
            "`skein {}` reports a closed pipe as an error: {}",
            args.join(" "),
            text(&out)
        );
    }
    // The run whose output went nowhere still finished, and its store is whole.
    let out = run(&sb, &["tree", "fresh1", "--json"]);
    assert_eq!(json_of(&out)["sessions"][0]["status"], "completed");
    let out = run(&sb, &["replay", "fresh1", "--verify"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_reader_that_stops_after_one_line_ends_the_command_quietly() {
    // `skein events ID --json | head -1`, with more output than a pipe holds.
    let sb = Sandbox::new();
    // An answer of four times the mission: the log is far more than a pipe buffers.
    sb.agent(
        "echo",
        "",
        "turns:\n  - answer: \"{% for i in range(4) %}{{ mission }}{% endfor %}\"\n",
    );
    let mission = "m".repeat(60 * 1024);
    let out = run(&sb, &["run", "--agent", "echo", "--id", "big1", &mission]);
    assert!(out.status.success(), "{}", text(&out));
    let mut child = skein(&sb.config(), &sb.data())
        .args(["events", "big1", "--json", "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("Submitted"), "{first}");
    // The reader is dropped here: the writes still to come find the pipe closed.
    let out = child.wait_with_output().unwrap();
    assert_no_panic("events | head -1", &out);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[test]
fn a_closed_stderr_does_not_stop_a_run() {
    let sb = Sandbox::new();
    plain(&sb);
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = skein(&sb.config(), &sb.data())
        .args(["run", "--agent", "plain", "--id", "noerr", "quietly"])
        .stderr(writer)
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "done: quietly\n");
}

// ---- item: agent files -----------------------------------------------------------------

fn check(sb: &Sandbox) -> (Output, Duration) {
    let t = Instant::now();
    let out = run(sb, &["agents", "check"]);
    (out, t.elapsed())
}

#[test]
fn an_alias_bomb_in_an_agent_file_is_refused_by_name_without_expanding() {
    let sb = Sandbox::new();
    plain(&sb);
    // 120 KiB behind an anchor, repeated 30,000 times: 3.6 GB once resolved, from a
    // file under the 256 KiB limit.
    let big = "x".repeat(120 * 1024);
    let aliases = vec!["*s"; 30_000].join(", ");
    let file = sb.dir.path().join("agents/bomb.md");
    std::fs::write(
        &file,
        format!(
            "---\nname: bomb\nmodel: scripted:plain\ndescription: &s {big}\ntools: [{aliases}]\n---\nboom\n"
        ),
    )
    .unwrap();
    assert!(std::fs::metadata(&file).unwrap().len() < 256 * 1024);
    let (out, took) = check(&sb);
    assert_no_panic("agents check", &out);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bomb.md") && err.contains("aliases are resolved"),
        "{}",
        text(&out)
    );
    assert!(err.len() < 4096, "a short error: {} bytes", err.len());
    assert!(took < Duration::from_secs(20), "took {took:?}");
    // A run loads the same files and refuses the same way.
    let out = run(&sb, &["run", "--agent", "plain", "m"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bomb.md"));
}

#[test]
fn an_oversized_agent_file_is_refused_by_name_and_size() {
    let sb = Sandbox::new();
    plain(&sb);
    // The shape of the original report: a 1 MiB anchor and its aliases.
    let big = "x".repeat(1024 * 1024);
    let aliases = vec!["*s"; 1000].join(", ");
    let file = sb.dir.path().join("agents/huge.md");
    std::fs::write(
        &file,
        format!(
            "---\nname: huge\nmodel: scripted:plain\ndescription: &s {big}\ntools: [{aliases}]\n---\nboom\n"
        ),
    )
    .unwrap();
    let size = std::fs::metadata(&file).unwrap().len();
    let (out, took) = check(&sb);
    assert_no_panic("agents check", &out);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("huge.md")
            && err.contains(&format!("{size} bytes"))
            && err.contains("at most 262144 bytes"),
        "{}",
        text(&out)
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_pool_that_is_not_one_subject_token_fails_agents_check() {
    for bad in ["a.>", "../../x", "has space", "*"] {
        let sb = Sandbox::new();
        plain(&sb);
        sb.agent("pooled", &format!("pool: {}\n", json!(bad)), "turns: []\n");
        let (out, _) = check(&sb);
        assert_eq!(out.status.code(), Some(1), "pool {bad}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("pooled.md")
                && err.contains("agent `pooled`")
                && err.contains(&format!("`{bad}`")),
            "pool {bad}: {}",
            text(&out)
        );
    }
    let sb = Sandbox::new();
    plain(&sb);
    sb.agent("pooled", "pool: gpu-eu_1\n", "turns:\n  - answer: ok\n");
    let (out, _) = check(&sb);
    assert!(out.status.success(), "{}", text(&out));
}

// ---- item: the approval preview --------------------------------------------------------

#[test]
fn the_approver_sees_every_byte_of_a_long_command_before_it_runs() {
    let sb = Sandbox::new();
    std::fs::write(
        sb.config(),
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n[tools.shell]\nenabled = true\n",
    )
    .unwrap();
    let command = format!("echo {}; touch hidden-tail", "A".repeat(600));
    sb.agent(
        "ops",
        "tools: [shell]\n",
        &format!(
            "turns:\n  - tool_calls:\n      - tool: shell\n        args: {{command: {}}}\n  - answer: ran\n",
            json!(command)
        ),
    );
    let out = run(&sb, &["run", "--agent", "ops", "--id", "ops1", "do it"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let paused = String::from_utf8_lossy(&out.stdout);
    assert!(
        paused.contains(&command),
        "the pause message shows the whole command: {paused}"
    );

    let out = run(&sb, &["inbox"]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains(&command), "inbox: {shown}");

    let out = run(&sb, &["inbox", "--json"]);
    let items = json_of(&out);
    let preview = items[0]["preview"].as_str().unwrap();
    let args: Value = serde_json::from_str(preview).unwrap();
    assert_eq!(args["command"], command.as_str(), "inbox --json: {preview}");
    // The recorded request holds it whole too.
    let out = run(&sb, &["events", "ops1", "--json"]);
    let log = String::from_utf8_lossy(&out.stdout);
    let req: Value = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["kind"] == "ApprovalRequested")
        .unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(req["body"]["data"]["preview"].as_str().unwrap()).unwrap(),
        json!({"command": command})
    );

    // What was shown is what runs.
    let token = items[0]["token"].as_str().unwrap();
    let out = run(&sb, &["approve", token]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(sb.data().join("workspaces/ops1/hidden-tail").exists());
}

// ---- item: control characters from a model ---------------------------------------------

const HOSTILE: &str = "\\e]0;pwned\\a\\e[2K";

fn no_raw_controls(what: &str, out: &Output) {
    for (stream, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        assert!(
            !bytes.iter().any(|b| *b == 0x1b || *b == 0x07),
            "{what}: raw ESC/BEL on {stream}: {:?}",
            String::from_utf8_lossy(bytes)
        );
    }
}

#[test]
fn text_from_a_model_reaches_the_terminal_escaped() {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{{key: "k{HOSTILE}", question: "Which{HOSTILE} one?"}}]
          context: "ctx{HOSTILE}"
          proposed_defaults: {{"k{HOSTILE}": "d{HOSTILE}"}}
  - answer: "final{HOSTILE} answer: {{{{ results[0].answers }}}}"
"#
        ),
    );
    let out = run(&sb, &["run", "--agent", "asker", "--id", "esc1", "ask"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    no_raw_controls("run (paused)", &out);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("k\\x1b]0;pwned\\x07\\x1b[2K") && shown.contains("Which\\x1b"),
        "the characters are shown, escaped: {shown}"
    );

    let out = run(&sb, &["inbox"]);
    no_raw_controls("inbox", &out);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("ctx\\x1b]0;pwned\\x07") && shown.contains("d\\u001b"),
        "{shown}"
    );
    // JSON stays JSON: the same text, escaped by JSON's own rules.
    let out = run(&sb, &["inbox", "--json"]);
    no_raw_controls("inbox --json", &out);
    let items = json_of(&out);
    assert_eq!(items[0]["context"], "ctx\u{1b}]0;pwned\u{7}\u{1b}[2K");
    let token = items[0]["token"].as_str().unwrap().to_string();

    for args in [
        vec!["events", "esc1"],
        vec!["replay", "esc1"],
        vec!["replay", "esc1", "--at", "2", "--full"],
        vec!["tree", "esc1"],
        vec!["sessions"],
    ] {
        let out = run(&sb, &args);
        assert!(out.status.success(), "{}", text(&out));
        no_raw_controls(&args.join(" "), &out);
    }

    let answers = json!({"k\u{1b}]0;pwned\u{7}\u{1b}[2K": "v\u{1b}[2K"}).to_string();
    let out = run(&sb, &["answer", &token, "--json", &answers]);
    assert!(out.status.success(), "{}", text(&out));
    no_raw_controls("answer", &out);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.starts_with("final\\x1b]0;pwned\\x07\\x1b[2K answer"),
        "{shown}"
    );
    for args in [vec!["events", "esc1"], vec!["replay", "esc1", "--full"]] {
        let out = run(&sb, &args);
        no_raw_controls(&args.join(" "), &out);
    }
    // The answer itself is kept as the model wrote it.
    let out = run(&sb, &["events", "esc1", "--json"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("final\\u001b]0;pwned"));
}

#[test]
fn an_error_quoting_outside_text_is_escaped() {
    let sb = Sandbox::new();
    plain(&sb);
    let out = run(&sb, &["events", "x\u{1b}]0;pwned\u{7}"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    no_raw_controls("events with a hostile id", &out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("pwned"));
}

// ---- item: limits on what a submission and a model turn may carry ----------------------

#[test]
fn tool_calls_past_the_per_turn_limit_are_refused_and_the_log_replays() {
    let sb = Sandbox::new();
    let calls: String = (0..70)
        .map(|_| "      - tool: list_dir\n        args: {path: \".\"}\n")
        .collect();
    sb.agent(
        "busy",
        "tools: [list_dir]\n",
        &format!("turns:\n  - tool_calls:\n{calls}  - answer: \"{{{{ results[69] }}}}\"\n"),
    );
    let out = run(&sb, &["run", "--agent", "busy", "--id", "busy1", "list"]);
    assert!(out.status.success(), "{}", text(&out));
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer.contains("at most 64 run per turn") && answer.contains("number 70"),
        "the model read why: {answer}"
    );
    let out = run(&sb, &["events", "busy1", "--json"]);
    let events: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let called = events.iter().filter(|e| e["kind"] == "ToolCalled").count();
    let refused = events
        .iter()
        .filter(|e| {
            e["kind"] == "ToolReturned"
                && e["body"]["data"]["error"] == true
                && e["body"]["data"]["output"]
                    .as_str()
                    .is_some_and(|o| o.contains("max_tool_calls_per_turn"))
        })
        .count();
    assert_eq!((called, refused), (64, 6));
    let out = run(&sb, &["replay", "busy1", "--verify"]);
    assert!(out.status.success(), "{}", text(&out));

    // `[limits] max_tool_calls_per_turn` sets it for every agent.
    std::fs::write(
        sb.config(),
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n[limits]\nmax_tool_calls_per_turn = 10\n",
    )
    .unwrap();
    let out = run(
        &sb,
        &[
            "run",
            "--agent",
            "busy",
            "--id",
            "busy2",
            "--no-cache",
            "list",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("at most 10 run per turn"));
}

// ---- the same limits on a cluster --------------------------------------------------------

const SECRET: &str = "outside-input-test-secret-not-for-production";

fn nats_worker(sb: &Sandbox, url: &str) -> Child {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url, "worker", "--concurrency", "4"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the worker exited");
        if line.contains("ready") {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    child
}

#[test]
fn a_cluster_refuses_oversized_submissions_on_intake_and_the_api() {
    let server = skein_testnats::NatsServer::start();
    let url = server.url();
    let sb = Sandbox::new();
    plain(&sb);
    let _workers = Workers(vec![nats_worker(&sb, &url)]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = async_nats::connect(url.clone()).await.unwrap();
        let mut rejected = client.subscribe("skein.missions.rejected").await.unwrap();
        client.flush().await.unwrap();
        let context = "c".repeat(300 * 1024);
        let payload = json!({"agent": "plain", "mission": "m", "id": "bigctx", "context": context});
        client
            .publish("skein.missions.submit", payload.to_string().into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        let m = tokio::time::timeout(
            Duration::from_secs(30),
            futures::StreamExt::next(&mut rejected),
        )
        .await
        .expect("a rejection")
        .unwrap();
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        let reason = v["reason"].as_str().unwrap();
        assert!(
            reason.contains("context is 307200 bytes; at most 262144"),
            "{v}"
        );

        let body =
            json!({"agent": "plain", "mission": "m", "inputs": {"x": "i".repeat(300 * 1024)}});
        let reply = tokio::time::timeout(
            Duration::from_secs(30),
            client.request("skein.api.submit", body.to_string().into()),
        )
        .await
        .expect("a reply")
        .unwrap();
        let err = reply
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::service::NATS_SERVICE_ERROR))
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        assert!(
            err.contains("inputs are") && err.contains("at most 262144"),
            "{err}"
        );
    });
    // Nothing was created.
    let out = skein(&sb.config(), &sb.data())
        .args(["--nats", &url, "sessions", "--json"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .output()
        .unwrap();
    assert_eq!(json_of(&out), json!([]), "{}", text(&out));
}
