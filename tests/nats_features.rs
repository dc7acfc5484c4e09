//! Human in the loop, single-flight and forks on NATS with real worker processes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use skein_testnats::NatsServer;

const SECRET: &str = "features-secret-not-for-production";

fn worker(sb: &Sandbox, url: &str, name: &str) -> Child {
    worker_of(sb, url, name, &[])
}

/// A worker process taking jobs of `pools` (every pool when empty).
fn worker_of(sb: &Sandbox, url: &str, name: &str, pools: &[&str]) -> Child {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url, "worker", "--concurrency", "16"]);
    if !pools.is_empty() {
        c.args(["--pools", &pools.join(",")]);
    }
    c.env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__RUNTIME__WORKER_ID", name);
    start_worker(c, name)
}

fn cli(sb: &Sandbox, url: &str, args: &[&str]) -> std::process::Output {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url])
        .args(args)
        .env("SKEIN_TOKEN_SECRET", SECRET);
    c.output().unwrap()
}

fn status(sb: &Sandbox, url: &str, id: &str) -> serde_json::Value {
    let out = cli(sb, url, &["tree", id, "--json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

fn wait_status(sb: &Sandbox, url: &str, id: &str, want: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let t = status(sb, url, id);
        if t["sessions"][0]["status"] == want {
            return t;
        }
        assert!(Instant::now() < deadline, "{id} never became {want}: {t}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn raw_pub(url: &str, subject: &str, payload: &str) {
    let mut s = TcpStream::connect(url.trim_start_matches("nats://")).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut info = String::new();
    r.read_line(&mut info).unwrap();
    s.write_all(b"CONNECT {\"verbose\":false}\r\n").unwrap();
    s.write_all(format!("PUB {subject} {}\r\n{payload}\r\nPING\r\n", payload.len()).as_bytes())
        .unwrap();
    let mut line = String::new();
    while !line.starts_with("PONG") {
        line.clear();
        r.read_line(&mut line).unwrap();
    }
}

#[test]
fn a_question_bubbles_up_across_workers_and_a_raw_answer_resumes_the_tree() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [helper]\ntools: [ask_user]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: helper, mission: "set up the project"}
  - tool_calls:
      - tool: ask_user
        args: {questions: [{key: version, question: "{{ results[0].need_user_input.questions[0].question }}"}]}
  - tool_calls:
      - tool: call_agent
        args: {resume_token: "{{ all_results[0].resume_token }}", answers: {version: "{{ results[0].answers.version }}"}}
  - answer: "{{ results[0].result }}"
"#,
    )
    .agent(
        "helper",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [{key: version, question: \"Which Python version?\"}]}\n  - answer: \"helper used {{ results[0].answers.version }}\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![worker(&sb, &url, "h1"), worker(&sb, &url, "h2")]);
    let out = cli(
        &sb,
        &url,
        &["submit", "--agent", "boss", "--id", "hitl-nats", "set up"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_status(&sb, &url, "hitl-nats", "awaiting_input");
    // Paused: no job is waiting or held anywhere.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let depth = rt.block_on(async {
        let cfg = skein_nats::NatsConfig {
            urls: vec![url.clone()],
            ..Default::default()
        };
        let st = skein_nats::NatsStore::connect(&cfg, Duration::from_secs(30))
            .await
            .unwrap();
        st.backend().jobs.depth("default").await.unwrap()
    });
    assert_eq!(depth, 0, "a job is claimed or waiting during the pause");
    let inbox: Vec<serde_json::Value> =
        serde_json::from_slice(&cli(&sb, &url, &["inbox", "--json"]).stdout).unwrap();
    assert_eq!(inbox.len(), 1);
    let token = inbox[0]["token"].as_str().unwrap();
    raw_pub(
        &url,
        "skein.answers",
        &serde_json::json!({"token": token, "answers": {"version": "3.13"}}).to_string(),
    );
    let t = wait_status(&sb, &url, "hitl-nats", "completed");
    assert_eq!(t["sessions"][0]["answer"], "helper used 3.13");
    let out = cli(&sb, &url, &["replay", "hitl-nats", "--verify", "--tree"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn eight_identical_delegations_run_one_child_across_workers_and_forks_work_on_nats() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [worker]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        repeat: 8
        args: {agent: worker, mission: "the same question"}
  - answer: "{{ results | selectattr('success') | list | length }} answers"
"#,
    )
    .agent(
        "worker",
        "",
        "latency_ms: 300\nturns:\n  - answer: \"answer to {{ mission }}\"\n",
    );
    std::fs::write(
        sb.dir.path().join("scripts/alt.yaml"),
        "turns:\n  - answer: never\n  - answer: \"forked with {{ results | length }} results\"\n",
    )
    .unwrap();
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![worker(&sb, &url, "s1"), worker(&sb, &url, "s2")]);
    let out = cli(
        &sb,
        &url,
        &[
            "submit", "--agent", "boss", "--id", "sf-nats", "--wait", "go",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "8 answers");
    let t = status(&sb, &url, "sf-nats");
    assert_eq!(
        t["sessions"].as_array().unwrap().len(),
        2,
        "one child for eight calls: {t}"
    );

    let out = cli(
        &sb,
        &url,
        &[
            "fork",
            "sf-nats",
            "--at",
            "2",
            "--model",
            "scripted:alt",
            "--new-id",
            "sf-fork",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t = wait_status(&sb, &url, "sf-fork", "completed");
    assert_eq!(t["sessions"][0]["answer"], "forked with 8 results");
    let out = cli(&sb, &url, &["replay", "sf-fork", "--verify", "--tree"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Two trees share one run (single flight), and the tree that started it is cancelled
/// before it answers: the run is cancelled with it, and the other tree's call runs the
/// mission itself rather than fail with another tree's cancel.
#[test]
fn a_call_sharing_a_run_whose_tree_is_cancelled_runs_the_mission_itself() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [worker]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: worker, mission: "the long job"}
  - answer: "boss: {{ results[0].result }}"
"#,
    )
    .agent(
        "worker",
        "",
        "latency_ms: 3000\nturns:\n  - answer: \"answer to {{ mission }}\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![worker(&sb, &url, "s1"), worker(&sb, &url, "s2")]);
    let submit = |id: &str| {
        let out = cli(&sb, &url, &["submit", "--agent", "boss", "--id", id, "go"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // The first tree's run is under way (its model call takes 3 s) when the second asks
    // for the same mission.
    submit("sh-first");
    let deadline = Instant::now() + Duration::from_secs(30);
    while status(&sb, &url, "sh-first")["sessions"]
        .as_array()
        .map_or(0, Vec::len)
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "the first tree's run never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    submit("sh-second");
    let shared = |id: &str| {
        let out = cli(&sb, &url, &["events", id, "--json"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|e| {
                e["body"]["type"] == "Delegated"
                    && e["body"]["data"]["child"] == "sh-first.worker-1"
            })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !shared("sh-second") {
        assert!(
            Instant::now() < deadline,
            "the second tree never shared the run"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = cli(
        &sb,
        &url,
        &["cancel", "sh-first", "--reason", "changed my mind"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_status(&sb, &url, "sh-first", "cancelled");
    let t = wait_status(&sb, &url, "sh-second", "completed");
    assert_eq!(
        t["sessions"][0]["answer"], "boss: answer to the long job",
        "another tree's cancel reached the second tree's call: {t}"
    );
    // Its own run of the mission, in its own tree.
    let ids: Vec<&str> = t["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["session"].as_str())
        .collect();
    assert!(ids.contains(&"sh-second/worker-1"), "{t}");
    let out = cli(&sb, &url, &["replay", "sh-second", "--verify", "--tree"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_file_a_child_writes_on_one_worker_is_read_by_its_parent_on_another() {
    share_a_file(None);
}

/// The same with workspaces on a volume both workers mount (`nats.workspace_dir`): the
/// file is a plain file there.
#[test]
fn a_shared_volume_workspace_works_across_workers_too() {
    let volume = tempfile::tempdir().unwrap();
    share_a_file(Some(volume.path()));
    let on_disk = volume.path().join("ws-nats/notes/findings.md");
    assert_eq!(
        std::fs::read_to_string(&on_disk).unwrap(),
        "written by ws-nats.scribe-1"
    );
}

fn share_a_file(volume: Option<&std::path::Path>) {
    let sb = Sandbox::new();
    // Writing needs no approval here; the pools pin each agent to one worker.
    let mut cfg = std::fs::read_to_string(sb.config()).unwrap();
    cfg.push_str("\n[limits]\napproval_required = [\"shell\"]\n");
    if let Some(v) = volume {
        cfg.push_str(&format!(
            "\n[nats]\nworkspace_dir = {:?}\n",
            v.display().to_string()
        ));
    }
    std::fs::write(sb.config(), cfg).unwrap();
    sb.agent(
        "boss",
        "pool: alpha\nagents: [scribe]\ntools: [read_file, list_dir]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: scribe, mission: "write the findings down"}
  - tool_calls:
      - tool: list_dir
        args: {path: notes}
      - tool: read_file
        args: {path: notes/findings.md}
  - answer: "{{ results[1] }} | {{ results[0] }}"
"#,
    )
    .agent(
        "scribe",
        "pool: beta\ntools: [write_file]\n",
        r#"
turns:
  - tool_calls:
      - tool: write_file
        args: {path: notes/findings.md, content: "written by {{ session }}"}
  - answer: "saved"
"#,
    );
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![
        worker_of(&sb, &url, "wa", &["alpha"]),
        worker_of(&sb, &url, "wb", &["beta"]),
    ]);
    raw_pub(
        &url,
        "skein.missions.submit",
        r#"{"id": "ws-nats", "agent": "boss", "mission": "share a file"}"#,
    );
    let t = wait_status(&sb, &url, "ws-nats", "completed");
    let answer = t["sessions"][0]["answer"].as_str().unwrap();
    assert!(
        answer.starts_with("written by ws-nats.scribe-1 | "),
        "the parent did not read the child's file: {answer}"
    );
    assert!(answer.contains("findings.md"), "{answer}");

    // Who ran what: the write on `wb`, the read on `wa`.
    let workers_of = |id: &str, tool: &str| -> Vec<String> {
        let out = cli(&sb, &url, &["events", id, "--json"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|e| e["kind"] == "ToolCalled" && e["body"]["data"]["tool"] == tool)
            .map(|e| e["body"]["data"]["worker"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(workers_of("ws-nats.scribe-1", "write_file"), vec!["wb"]);
    assert_eq!(workers_of("ws-nats", "read_file"), vec!["wa"]);
    let out = cli(&sb, &url, &["replay", "ws-nats", "--verify", "--tree"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A child's end rides in its parent's notice only where nothing can follow it: a
/// `chat: true` child, which may be asked a follow-up, is settled from its log each time,
/// and the tree's answer and its audit come out as on the embedded store (`hitl.rs`).
#[test]
fn a_notice_carries_a_childs_end_only_where_nothing_can_follow_it() {
    let sb = follow_ups();
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![worker(&sb, &url, "e1")]);
    let out = cli(
        &sb,
        &url,
        &[
            "submit",
            "--agent",
            "boss",
            "--id",
            "ends-nats",
            "--wait",
            "go",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer = String::from_utf8_lossy(&out.stdout);
    follow_ups_answered(&answer);
    // The root's notices, with whether each carried an end.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let notices: Vec<(String, bool)> = rt.block_on(async {
        let client = async_nats::connect(url.as_str()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream("SKEIN_NOTICES").await.unwrap();
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                filter_subject: "skein.notices.ends-nats".into(),
                ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut batch = consumer
            .fetch()
            .max_messages(100)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .unwrap();
        let mut out = vec![];
        while let Some(m) = futures::StreamExt::next(&mut batch).await {
            let m = m.unwrap();
            let carried = m
                .headers
                .as_ref()
                .is_some_and(|h| h.get("Skein-End").is_some());
            out.push((String::from_utf8_lossy(&m.payload).to_string(), carried));
        }
        out
    });
    let of = |agent: &str| -> Vec<bool> {
        notices
            .iter()
            .filter(|(c, _)| c.contains(agent))
            .map(|(_, carried)| *carried)
            .collect()
    };
    assert_eq!(of("plain"), vec![true], "{notices:?}");
    assert_eq!(of("expert"), vec![false, false], "{notices:?}");
    // The same judgement acks the children's last jobs: the one that ended for good is
    // acked and its message left in `SKEIN_JOBS` (no delete); the `chat: true` one, which
    // was asked again after its first end, has its job deleted each time, or the push of
    // the follow-up would have been refused for good.
    let jobs_left = || {
        rt.block_on(async {
            let client = async_nats::connect(url.as_str()).await.unwrap();
            let js = async_nats::jetstream::new(client);
            let stream = js.get_stream("SKEIN_JOBS").await.unwrap();
            let mut subjects = stream.info_with_subjects("skein.jobs.>").await.unwrap();
            let mut out = vec![];
            while let Some(s) = futures::StreamExt::next(&mut subjects).await {
                out.push(s.unwrap().0);
            }
            out
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let left = loop {
        let left = jobs_left();
        // The expert's last delete may still be on its way when the root's answer is.
        if !left.iter().any(|s| s.contains("expert")) || std::time::Instant::now() > deadline {
            break left;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(left.iter().any(|s| s.contains("plain")), "{left:?}");
    assert!(!left.iter().any(|s| s.contains("expert")), "{left:?}");
    let out = cli(&sb, &url, &["replay", "ends-nats", "--verify", "--tree"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Kills a worker with SIGKILL at a moment its log names, and checks that nothing is lost.
/// `start(name, log filter, log)` starts a worker. The first, logging at `filter`, is given
/// fan-outs of 64 children one after another (ids `prefix-N`) until its log has a line with
/// `mark` (within 60 s; `never` says what it means when it does not). Then it is killed and
/// a second is started. Every tree ends with its answer, each child delegated and settled
/// once, each log replaying as recorded.
fn killed_at_a_mark(
    sb: &Sandbox,
    url: &str,
    start: impl Fn(&str, &str, Option<common::cluster::LogLines>) -> Child,
    (filter, mark): (&str, &str),
    prefix: &str,
    never: &str,
) {
    let log = common::cluster::LogLines::default();
    let mut workers = Workers(vec![start("k1", filter, Some(log.clone()))]);
    let n = 64;
    let marked = || {
        log.lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|l| l.contains(mark))
    };
    let mut roots = vec![];
    let deadline = Instant::now() + Duration::from_secs(60);
    'trees: while Instant::now() < deadline {
        let id = format!("{prefix}-{}", roots.len());
        let inputs = format!("{{\"n\": {n}}}");
        let out = cli(
            sb,
            url,
            &[
                "submit", "--agent", "fanout", "--id", &id, "--inputs", &inputs, "go",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        roots.push(id);
        let next = Instant::now() + Duration::from_secs(1);
        while Instant::now() < next {
            if marked() {
                break 'trees;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(marked(), "in {} trees {never}", roots.len());
    common::cluster::kill9(&mut workers.0[0]);
    workers.0.push(start("k2", "warn", None));
    for id in &roots {
        let t = wait_status(sb, url, id, "completed");
        assert_eq!(t["sessions"][0]["answer"], format!("{n} parts done"));
        let out = cli(sb, url, &["events", id, "--json"]);
        let mut kinds = std::collections::BTreeMap::<String, usize>::new();
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            let e = serde_json::from_str::<serde_json::Value>(l).unwrap();
            *kinds
                .entry(e["kind"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
        }
        assert_eq!(
            (kinds.get("Delegated"), kinds.get("ChildSettled")),
            (Some(&n), Some(&n)),
            "{id}: each child delegated and settled once: {kinds:?}"
        );
        let out = cli(sb, url, &["replay", id, "--verify", "--tree"]);
        assert!(
            out.status.success(),
            "{id}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// A worker on `url` (a sandbox's config, 64 sessions at once, a 2 s lease, and the
/// environment `env`), logging at `filter` into `log` when given.
fn leasing_worker(
    sb: &Sandbox,
    url: &str,
    env: &[(&str, &str)],
    (name, filter, log): (&str, &str, Option<common::cluster::LogLines>),
) -> Child {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url, "worker", "--concurrency", "64"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__RUNTIME__LEASE", "2s")
        .env("SKEIN__RUNTIME__WORKER_ID", name)
        .env("SKEIN_LOG", filter)
        .envs(env.iter().copied());
    start_worker_logged(c, name, log)
}

/// A push for a session whose job the pushing worker holds marks the hold there instead of
/// leaving a wake marker on the server. Here the worker is killed with SIGKILL the moment a
/// child's push has marked its parent's hold (trees are submitted one after another until
/// one such push is logged): the mark dies with the process, the parent's delivery comes
/// back after its lease, and every tree still ends, each child settled once, each log
/// replaying as recorded. Both workers lease jobs for 2 s (the pool's consumer takes the
/// ack wait of the last worker that opened it).
#[test]
fn a_worker_killed_after_a_push_marked_its_hold_loses_no_wake_up() {
    let sb = fan_out(2);
    let server = NatsServer::start();
    let url = server.url();
    killed_at_a_mark(
        &sb,
        &url,
        |name, filter, log| leasing_worker(&sb, &url, &[], (name, filter, log)),
        (
            "warn,skein_nats::backend::jobs=trace",
            "push marked the job held here",
        ),
        "marked",
        "no child's push found its parent's job held by its worker",
    );
}

/// With every write fsynced and `group_commit` on, a worker's appends go in atomic batches.
/// A worker killed with SIGKILL once its batches are under way (trees are submitted one
/// after another until a batch is logged as committed) loses nothing: every tree ends,
/// each child delegated and settled once, each log replaying as recorded. Needs
/// nats-server 2.15.1 or later, where the store gathers appends.
#[test]
fn a_worker_killed_while_its_appends_go_in_batches_loses_no_step() {
    let sb = fan_out(2);
    let server = NatsServer::start_with_sync(Some("always"));
    let url = server.url();
    let never = format!(
        "no batch of appends was committed (nats-server {}; group commit needs 2.15.1 or later)",
        skein_testnats::nats_server_version()
    );
    killed_at_a_mark(
        &sb,
        &url,
        |name, filter, log| {
            let env = [("SKEIN__NATS__GROUP_COMMIT", "true")];
            leasing_worker(&sb, &url, &env, (name, filter, log))
        },
        (
            "warn,skein_nats::backend::group=debug",
            "appends committed as one batch",
        ),
        "grouped",
        &never,
    );
}
