//! Shared helpers of the end-to-end suites: run the real `skein` binary.
#![allow(dead_code)]

pub mod cluster;
pub mod ui;
pub mod wire;
pub mod world;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use skein_core::replay::verify;
use skein_core::{AgentDef, AgentSet, Event, Limits, SessionId};
use skein_sled::SledStore;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_skein"))
}

/// `skein --config <config> --data <data> …`, quiet logs, no colours.
pub fn skein(config: &Path, data: &Path) -> Command {
    let mut c = Command::new(bin());
    c.arg("--config").arg(config).arg("--data").arg(data);
    c.env("SKEIN_LOG", "warn")
        .env_remove("SKEIN_NATS_URL")
        .stdin(Stdio::null());
    c
}

pub fn demo_config() -> PathBuf {
    repo().join("config/skein.toml")
}

pub fn run_ok(mut c: Command) -> Output {
    let out = c.output().expect("skein runs");
    assert!(
        out.status.success(),
        "skein failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A config directory of its own: `skein.toml`, `agents/`, `scripts/`.
pub struct Sandbox {
    pub dir: tempfile::TempDir,
}

impl Sandbox {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("agents")).expect("agents dir");
        std::fs::create_dir_all(dir.path().join("scripts")).expect("scripts dir");
        std::fs::write(
            dir.path().join("skein.toml"),
            "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n",
        )
        .expect("config");
        Self { dir }
    }

    pub fn agent(&self, name: &str, front: &str, script: &str) -> &Self {
        std::fs::write(
            self.dir.path().join(format!("agents/{name}.md")),
            format!("---\nname: {name}\nmodel: scripted:{name}\n{front}---\nYou are {name}.\n"),
        )
        .expect("agent");
        std::fs::write(self.dir.path().join(format!("scripts/{name}.yaml")), script)
            .expect("script");
        self
    }

    pub fn config(&self) -> PathBuf {
        self.dir.path().join("skein.toml")
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }
}

/// Opens a store left by finished processes and checks every log of the tree: the hash
/// chain, every decision re-derived from its prefix, and no duplicated step. Returns the
/// number of sessions checked.
pub async fn audit_tree(data: &Path, root: &SessionId, agents_dir: &Path) -> usize {
    let store = SledStore::open(data, &data.join("workspaces")).expect("open store");
    audit_tree_in(&store.backend(), root, agents_dir).await
}

/// [`audit_tree`] on an open store.
pub async fn audit_tree_in(
    b: &skein_runtime::Backend,
    root: &SessionId,
    agents_dir: &Path,
) -> usize {
    let files: Vec<(String, String)> = std::fs::read_dir(agents_dir)
        .expect("agents")
        .map(|e| {
            let p = e.expect("entry").path();
            (
                p.display().to_string(),
                std::fs::read_to_string(&p).expect("read"),
            )
        })
        .collect();
    let catalog = AgentSet::load(&files, &[]).expect("agents");
    let ids = b.log.tree(root).await.expect("tree");
    for id in &ids {
        let records = b.log.read(id, 1).await.expect("read");
        skein_core::event::verify_chain(id, &records)
            .unwrap_or_else(|e| panic!("{id}: chain broken: {e:?}"));
        let Event::Submitted(sub) = &records[0].env.body else {
            panic!("{id}: first is not Submitted")
        };
        let text = b
            .def_text(&sub.def_digest)
            .await
            .expect("stored definition");
        let def = AgentDef::parse("stored", &text).expect("definition");
        let envs: Vec<_> = records.iter().map(|r| r.env.clone()).collect();
        verify(&envs, &def, &Limits::default(), &catalog)
            .unwrap_or_else(|d| panic!("{id}: replay diverges: {d}"));
        let mut called = std::collections::BTreeSet::new();
        let mut returned = std::collections::BTreeSet::new();
        let mut terminal = 0;
        let mut reopened = 0;
        for r in &records {
            match &r.env.body {
                Event::ToolCalled(t) => assert!(
                    called.insert(t.call.clone()),
                    "{id}: {} called twice",
                    t.call
                ),
                Event::ToolReturned(t) => assert!(
                    returned.insert(t.call.clone()),
                    "{id}: {} returned twice",
                    t.call
                ),
                Event::ClarificationRequested(_) => reopened += 1,
                e if e.is_terminal() => terminal += 1,
                _ => {}
            }
        }
        // A `chat: true` session answers once more for every follow-up question.
        assert_eq!(terminal, 1 + reopened, "{id}: {terminal} terminal events");
    }
    ids.len()
}

/// Audits every tree in a data directory (see [`audit_tree`]), with one opening of the
/// store: opening it again right after closing it can find sled's lock still held.
pub fn audit_all(data: &Path, agents_dir: &Path) -> usize {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let store = SledStore::open(data, &data.join("workspaces")).expect("open store");
        let b = store.backend();
        let mut n = 0;
        for root in b.log.roots().await.expect("roots") {
            n += audit_tree_in(&b, &root, agents_dir).await;
        }
        n
    })
}

/// Starts a `skein … worker` command (stderr piped) and returns once it says `ready`;
/// its later output is drained so that it never blocks on a full pipe.
pub fn start_worker(c: Command, name: &str) -> std::process::Child {
    start_worker_logged(c, name, None)
}

/// [`start_worker`], keeping what the worker logs after "ready" in `log` when one is given.
pub fn start_worker_logged(
    mut c: Command,
    name: &str,
    log: Option<cluster::LogLines>,
) -> std::process::Child {
    use std::io::BufRead;
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("the worker starts");
    let mut err = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            err.read_line(&mut line).expect("read stderr") > 0,
            "worker {name} exited"
        );
        if line.contains("ready") {
            break;
        }
    }
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if let Some(log) = &log {
                log.lock().unwrap_or_else(|p| p.into_inner()).push(l);
            }
        }
    });
    child
}

/// Kills the worker processes it holds when the test ends, however it ends.
pub struct Workers(pub Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A root that delegates to `n` leaves (`--inputs {"n": …}`), each of which lists its
/// workspace twice with `latency_ms` per model turn, then answers.
pub fn fan_out(latency_ms: u64) -> Sandbox {
    let sb = Sandbox::new();
    sb.agent(
        "fanout",
        "agents: [leaf]\ncache: false\nlimits: {max_children_per_turn: 1000, max_steps: 4}\n",
        "latency_ms: 0\nturns:\n  - tool_calls:\n      - tool: call_agent\n        \
         repeat: \"{{ inputs.n }}\"\n        args: {agent: leaf, mission: \"part {{ i }}\"}\n  \
         - answer: \"{{ results | length }} parts done\"\n",
    )
    .agent(
        "leaf",
        "tools: [list_dir]\nidempotent_tools: [list_dir]\ncache: false\n",
        &format!(
            "latency_ms: {latency_ms}\nturns:\n  - tool_calls:\n      - tool: list_dir\n        \
             args: {{path: \".\"}}\n  - tool_calls:\n      - tool: list_dir\n        \
             args: {{path: \".\"}}\n  - answer: \"done with {{{{ mission }}}}\"\n"
        ),
    );
    sb
}

/// A root (`boss`) that asks two children, then puts a follow-up question to each: the
/// `chat: true` expert answers it and its log simply continues; `plain` takes no follow-up
/// questions, so that one is refused. The root's answer starts with "first: the load is 42
/// | then: error bars are plus or minus 3".
pub fn follow_ups() -> Sandbox {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [expert, plain]\ntools: [ask_clarification]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: expert, mission: "estimate the load"}
      - tool: call_agent
        args: {agent: plain, mission: "say hi"}
  - tool_calls:
      - tool: ask_clarification
        args: {session_id: "{{ results[0].session_id }}", question: "and the error bars?"}
      - tool: ask_clarification
        args: {session_id: "{{ results[1].session_id }}", question: "anything else?"}
  - answer: "first: {{ all_results[0].result }} | then: {{ results[0].result }} | plain: {{ results[1] }}"
"#,
    )
    .agent(
        "expert",
        "chat: true\n",
        "turns:\n  - answer: \"the load is 42\"\n  - answer: \"error bars are plus or minus 3\"\n",
    )
    .agent("plain", "", "turns:\n  - answer: hi\n");
    sb
}

/// Checks the root's answer of [`follow_ups`]: the expert answered both questions, and
/// the follow-up to `plain` was refused.
pub fn follow_ups_answered(answer: &str) {
    assert!(
        answer.starts_with("first: the load is 42 | then: error bars are plus or minus 3"),
        "{answer}"
    );
    assert!(
        answer.contains("does not take follow-up questions"),
        "{answer}"
    );
}

/// Appends `toml` to the sandbox's config file.
pub fn configure(sb: &Sandbox, toml: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(sb.config())
        .unwrap();
    f.write_all(toml.as_bytes()).unwrap();
}

/// `skein ARGS…` on the sandbox's config and data, its output taken.
pub fn run(sb: &Sandbox, args: &[&str]) -> Output {
    skein(&sb.config(), &sb.data()).args(args).output().unwrap()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every event of a session, as `skein events ID --json` prints them.
pub fn events(sb: &Sandbox, id: &str) -> Vec<serde_json::Value> {
    let out = run(sb, &["events", id, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The events of `kind`.
pub fn of_kind<'a>(events: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

/// The items the MCP tool `list_inbox` (no root) answers with, from `skein mcp` over
/// stdio started as `cmd` (a `skein` command with its global options, not yet its
/// subcommand).
pub fn mcp_list_inbox(mut cmd: Command) -> Vec<serde_json::Value> {
    use std::io::{BufRead, BufReader, Write};
    let mut child = cmd
        .arg("mcp")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("skein mcp starts");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout"))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(&l.expect("line")).expect("JSON"));
    // The call is sent once the server has answered `initialize` (it takes messages
    // concurrently, so one sent sooner could be read first).
    let mut send = |msg: &str| {
        writeln!(stdin, "{msg}").expect("write");
        stdin.flush().expect("flush");
    };
    send(
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"inbox-check","version":"1"}}}"#,
    );
    let init = lines.by_ref().find(|v| v["id"] == 1);
    assert!(
        init.as_ref().is_some_and(|v| v["result"].is_object()),
        "initialize: {init:?}"
    );
    send(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    send(
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"list_inbox","arguments":{}}}"#,
    );
    let answer = lines.find(|v| v["id"] == 2);
    // The server ends when its input does.
    drop(stdin);
    let _ = child.wait();
    let answer = answer.expect("an answer to list_inbox");
    assert_ne!(answer["result"]["isError"], true, "{answer}");
    answer["result"]["structuredContent"]["items"]
        .as_array()
        .unwrap_or_else(|| panic!("no items: {answer}"))
        .clone()
}
