//! The orchestration-pattern demos of `config/patterns`, run by the real binary: a handoff
//! chain of three, a router choosing each destination (and answering itself), advisors
//! with one failing; embedded and on a real nats-server, each followed by
//! `replay --tree --verify` and the log checks, and each killed with SIGKILL mid-pattern
//! and finished by `resume` (embedded) or a new worker (NATS) with no step twice.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use skein_core::{Event, Record, SessionId};
use skein_testnats::NatsServer;

fn config() -> PathBuf {
    repo().join("config/patterns/skein.toml")
}

/// A copy of the demos whose every model call takes 400 ms instead of 50, so that a kill
/// lands inside the pattern, not after it. Returns the config file of the copy.
fn slow_config(dir: &Path) -> PathBuf {
    let src = repo().join("config/patterns");
    for sub in ["agents", "scripts"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        for e in std::fs::read_dir(src.join(sub)).unwrap() {
            let p = e.unwrap().path();
            let text = std::fs::read_to_string(&p).unwrap();
            let text = text.replace("latency_ms: 50", "latency_ms: 400");
            std::fs::write(dir.join(sub).join(p.file_name().unwrap()), text).unwrap();
        }
    }
    std::fs::copy(src.join("skein.toml"), dir.join("skein.toml")).unwrap();
    dir.join("skein.toml")
}

/// Resume tokens are signed with a secret every process of a cluster shares.
const SECRET: &str = "patterns-secret-for-tests-only";

/// A demo and what it must end with.
struct Case {
    agent: &'static str,
    mission: &'static str,
    answer: &'static str,
    /// Every session of the tree: its path below the root (`""` for the root), agent,
    /// the pattern that started it, and its status.
    sessions: &'static [(
        &'static str,
        &'static str,
        Option<&'static str>,
        &'static str,
    )],
}

const CHAIN: Case = Case {
    agent: "drafter",
    mission: "Brief on the refund policy",
    answer:
        "Final copy, edited after the reviewer's notes: three short sentences, the source named.",
    sessions: &[
        ("", "drafter", None, "completed"),
        ("reviewer-1", "reviewer", Some("handoff"), "completed"),
        (
            "reviewer-1/editor-1",
            "editor",
            Some("handoff"),
            "completed",
        ),
    ],
};

const TO_BILLING: Case = Case {
    agent: "triage",
    mission: "I want a refund for invoice 42",
    answer: "Billing here: the refund is on its way (the front desk's note was read).",
    sessions: &[
        ("", "triage", None, "completed"),
        ("billing-1", "billing", Some("route"), "completed"),
    ],
};

const TO_TECH: Case = Case {
    agent: "triage",
    mission: "My server crashes at night",
    answer: "Tech here: restart the service, then send the log if it happens again.",
    sessions: &[
        ("", "triage", None, "completed"),
        ("tech-1", "tech", Some("route"), "completed"),
    ],
};

const ROUTER_ANSWERS: Case = Case {
    agent: "triage",
    mission: "hello",
    answer: "Hello! Ask me about an invoice or a technical problem.",
    sessions: &[("", "triage", None, "completed")],
};

const ADVISORS: Case = Case {
    agent: "manager",
    mission: "Move the release to Friday",
    answer: "Decision: go ahead, with legal's and risk's points covered; flaky gave no advice.",
    sessions: &[
        ("", "manager", None, "completed"),
        ("legal-1", "legal", Some("advisor"), "completed"),
        ("risk-2", "risk", Some("advisor"), "completed"),
        ("flaky-3", "flaky", Some("advisor"), "failed"),
    ],
};

const TEAM: Case = Case {
    agent: "squad",
    mission: "The checkout page is down",
    answer: "Decision: roll back the 14:02 deploy, as the scout reported.",
    sessions: &[
        ("", "squad", None, "completed"),
        ("scout-1", "scout", Some("member"), "completed"),
        ("builder-2", "builder", Some("member"), "cancelled"),
        ("chief-3", "chief", Some("supervisor"), "completed"),
    ],
};

/// The tree's rows (`tree --json`) checked against the case: its sessions, how each was
/// started, and the root's usage holding every participant's.
fn check_rows(case: &Case, root: &str, rows: &Value) {
    let rows = rows.as_array().expect("rows");
    let got: BTreeMap<String, (String, Option<String>, String)> = rows
        .iter()
        .map(|r| {
            let s = r["session"].as_str().unwrap();
            let rel = s.strip_prefix(root).unwrap().trim_start_matches('/');
            (
                rel.to_string(),
                (
                    r["agent"].as_str().unwrap().to_string(),
                    r["via"].as_str().map(str::to_string),
                    r["status"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect();
    let want: BTreeMap<String, (String, Option<String>, String)> = case
        .sessions
        .iter()
        .map(|(p, a, v, s)| {
            (
                p.to_string(),
                (a.to_string(), v.map(str::to_string), s.to_string()),
            )
        })
        .collect();
    assert_eq!(got, want, "the tree of {}", case.agent);
    let sum = |k: &str| -> u64 {
        rows.iter()
            .map(|r| r["usage"][k].as_u64().unwrap_or(0))
            .sum()
    };
    assert_eq!(
        rows[0]["usage_total"]["input_tokens"].as_u64(),
        Some(sum("input_tokens")),
        "every participant's usage rolls up to the root"
    );
}

/// The checks of one pattern log that need only the log: the chain, no step twice, one
/// terminal event; and for a step of a chain, the blocks it was given.
fn check_log(id: &SessionId, recs: &[Record]) {
    skein_core::event::verify_chain(id, recs).unwrap_or_else(|e| panic!("{id}: {e:?}"));
    let mut delegated = std::collections::BTreeSet::new();
    let mut patterns = std::collections::BTreeSet::new();
    let mut terminal = 0;
    for r in recs {
        match &r.env.body {
            Event::Delegated(d) => {
                assert!(delegated.insert(d.call.clone()), "{id}: {} twice", d.call)
            }
            e @ (Event::HandedOff(_) | Event::Routed(_) | Event::AdvisorsConsulted(_)) => {
                assert!(
                    patterns.insert(e.kind().to_string()),
                    "{id}: {} twice",
                    e.kind()
                )
            }
            e if e.is_terminal() => terminal += 1,
            _ => {}
        }
    }
    assert_eq!(terminal, 1, "{id}");
    if let Event::Submitted(s) = &recs[0].env.body {
        if let Some(request) = &s.request {
            assert!(
                s.mission.contains("<original_user_request__") && s.mission.contains(request),
                "{id}: {}",
                s.mission
            );
        }
    }
}

// ---- embedded -----------------------------------------------------------------------

fn run_embedded(case: &Case, data: &Path) -> String {
    let mut c = skein(&config(), data);
    c.args(["run", "--agent", case.agent, "--json", case.mission]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    assert_eq!(out["answer"], case.answer, "{out}");
    let root = out["session"].as_str().unwrap().to_string();
    check_embedded(&config(), case, data, &root);
    root
}

/// `tree --json`, `replay --tree --verify`, and every log re-checked from the store.
fn check_embedded(cfg: &Path, case: &Case, data: &Path, root: &str) {
    let mut c = skein(cfg, data);
    c.args(["tree", root, "--json"]);
    let tree = json_of(&run_ok(c));
    check_rows(case, root, &tree["sessions"]);
    let mut c = skein(cfg, data);
    c.args(["replay", "--tree", "--verify", root]);
    run_ok(c);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = skein_sled::SledStore::open(data, &data.join("workspaces")).unwrap();
        let b = store.backend();
        let root = SessionId::parse(root).unwrap();
        let ids = b.log.tree(&root).await.unwrap();
        assert_eq!(ids.len(), case.sessions.len());
        for id in ids {
            check_log(&id, &b.log.read(&id, 1).await.unwrap());
        }
    });
}

#[test]
fn embedded_a_handoff_chain_of_three_answers_with_the_last_agent() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let root = run_embedded(&CHAIN, &data);
    // The editor read the original request and the reviewer's answer, nonce-tagged.
    let mut c = skein(&config(), &data);
    c.args(["events", &format!("{root}/reviewer-1/editor-1"), "--json"]);
    let out = run_ok(c);
    let first: Value = serde_json::from_slice(
        out.stdout
            .split(|b| *b == b'\n')
            .next()
            .expect("a first event"),
    )
    .expect("events --json prints one JSON object per line");
    let mission = first["body"]["data"]["mission"].as_str().expect("mission");
    assert!(
        mission.starts_with("<original_user_request__")
            && mission.contains("\nBrief on the refund policy\n")
            && mission.contains("agent=\"reviewer\">\nReview notes: the drafter's text was read;"),
        "{mission}"
    );
}

#[test]
fn embedded_a_router_chooses_each_destination_or_answers_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    for case in [&TO_BILLING, &TO_TECH, &ROUTER_ANSWERS] {
        run_embedded(case, &data);
    }
}

#[test]
fn embedded_advisors_run_first_and_a_failing_one_leaves_a_report() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    run_embedded(&ADVISORS, &data);
    // The manager went on without flaky's advice: its answer is partial, and is not
    // cached. The same request again asks flaky anew (it fails again: its script has
    // no case for it), legal and risk answering from the cache.
    let mut c = skein(&config(), &data);
    c.args(["run", "--agent", "manager", "--json", ADVISORS.mission]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["answer"], ADVISORS.answer, "{out}");
    assert_eq!(out["summary"]["cache_hits"], 2, "{out}");
    let tree = out["tree"].as_array().expect("the tree's rows");
    let row = |agent: &str| {
        tree.iter()
            .find(|r| r["agent"] == agent)
            .unwrap_or_else(|| panic!("no {agent} in {out}"))
    };
    assert_eq!(row("manager")["partial"], true, "{out}");
    assert_eq!(row("flaky")["status"], "failed", "{out}");
    let mut c = skein(&config(), &data);
    c.args([
        "replay",
        "--tree",
        "--verify",
        out["session"].as_str().unwrap(),
    ]);
    run_ok(c);
}

/// Runs `case`, kills the process with SIGKILL when `trigger` first shows in its
/// progress, resumes it, and checks the tree as after an undisturbed run.
fn kill_and_resume(case: &Case, trigger: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let cfg = slow_config(tmp.path());
    let mut c = skein(&cfg, &data);
    c.args(["run", "--no-cache", "--agent", case.agent, case.mission])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let (mut root, mut seen) = (None, vec![]);
    for line in stderr.lines() {
        let line = line.unwrap();
        if let Some(id) = line.strip_prefix("root ") {
            root = Some(id.trim().to_string());
        }
        let hit = line.contains(trigger);
        seen.push(line);
        if hit {
            break;
        }
    }
    let _ = child.kill();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the run ended before the kill: {seen:?}");
    let root = root.unwrap_or_else(|| panic!("no root id printed: {seen:?}"));
    let mut c = skein(&cfg, &data);
    c.args(["resume", &root, "--json"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    assert_eq!(out["answer"], case.answer, "{out}");
    check_embedded(&cfg, case, &data, &root);
}

#[test]
fn embedded_a_team_member_broadcasts_and_the_supervisors_answer_ends_a_member_at_work() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let root = run_embedded(&TEAM, &data);
    let events = |s: &str| -> Vec<Value> {
        let mut c = skein(&config(), &data);
        c.args(["events", &format!("{root}/{s}"), "--json"]);
        String::from_utf8(run_ok(c).stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    // The chief read the scout's broadcast, recorded in its own log.
    let heard: Vec<Value> = events("chief-3")
        .into_iter()
        .filter(|e| e["body"]["type"] == "TeamBroadcast")
        .map(|e| e["body"]["data"].clone())
        .collect();
    assert!(
        heard.iter().any(|b| b["agent"] == "scout"
            && b["kind"] == "update"
            && b["message"].as_str().unwrap().contains("14:02")),
        "{heard:?}"
    );
    // The builder was still at work when the chief answered: the team's end cancelled it.
    let last = events("builder-2").pop().unwrap();
    assert_eq!(last["body"]["type"], "Cancelled", "{last}");
    assert_eq!(
        last["body"]["data"]["reason"],
        "the team's supervisor `chief` has answered"
    );
}

#[test]
fn embedded_kill9_mid_team_then_resume() {
    kill_and_resume(&TEAM, "TeamStarted");
}

#[test]
fn embedded_kill9_mid_handoff_then_resume() {
    kill_and_resume(&CHAIN, "HandedOff");
}

#[test]
fn embedded_kill9_mid_route_then_resume() {
    kill_and_resume(&TO_BILLING, "Routed");
}

#[test]
fn embedded_kill9_while_advisors_run_then_resume() {
    kill_and_resume(&ADVISORS, "AdvisorsConsulted");
}

// ---- NATS ---------------------------------------------------------------------------

fn worker(cfg: &Path, url: &str, data: &Path, name: &str) -> Child {
    let mut c = skein(cfg, data);
    c.args(["--nats", url, "worker", "--concurrency", "8"])
        .env("SKEIN__RUNTIME__WORKER_ID", name)
        .env("SKEIN_TOKEN_SECRET", SECRET)
        // A killed worker's jobs are taken over once their lease runs out.
        .env("SKEIN__RUNTIME__LEASE", "3s");
    start_worker(c, name)
}

fn cli(cfg: &Path, url: &str, data: &Path, args: &[&str]) -> std::process::Output {
    let mut c = skein(cfg, data);
    c.args(["--nats", url])
        .args(args)
        .env("SKEIN_TOKEN_SECRET", SECRET);
    c.output().unwrap()
}

fn tree_json(cfg: &Path, url: &str, data: &Path, root: &str) -> Value {
    let out = cli(cfg, url, data, &["tree", root, "--json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// The tree's logs on the cluster, replayed and checked like the embedded ones.
fn check_nats(cfg: &Path, case: &Case, url: &str, data: &Path, root: &str) {
    check_rows(case, root, &tree_json(cfg, url, data, root)["sessions"]);
    let out = cli(cfg, url, data, &["replay", "--tree", "--verify", root]);
    assert!(
        out.status.success(),
        "replay --verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let st = common::cluster::store(url, 1).await;
        let b = st.backend();
        let root = SessionId::parse(root).unwrap();
        let ids = b.log.tree(&root).await.unwrap();
        assert_eq!(ids.len(), case.sessions.len());
        for id in ids {
            check_log(&id, &b.log.read(&id, 1).await.unwrap());
        }
    });
}

#[test]
fn nats_every_pattern_runs_on_a_cluster_worker() {
    let server = NatsServer::start();
    let url = server.url();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let cfg = config();
    let _w = Workers(vec![
        worker(&cfg, &url, &data, "p1"),
        worker(&cfg, &url, &data, "p2"),
    ]);
    for (i, case) in [
        &CHAIN,
        &TO_BILLING,
        &TO_TECH,
        &ROUTER_ANSWERS,
        &ADVISORS,
        &TEAM,
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("pattern-{i}");
        let out = cli(
            &cfg,
            &url,
            &data,
            &[
                "submit",
                "--agent",
                case.agent,
                "--id",
                &id,
                "--wait",
                "--json",
                case.mission,
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["answer"], case.answer, "{v}");
        check_nats(&cfg, case, &url, &data, &id);
    }
    // Any NATS client starts a pattern: a raw TCP publish of the submission.
    let payload = serde_json::json!({
        "agent": "squad", "mission": TEAM.mission, "id": "raw-team", "no_cache": true
    });
    common::cluster::raw_publish(
        &url,
        "skein.missions.submit",
        &[payload.to_string().into_bytes()],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = tree_json(&cfg, &url, &data, "raw-team");
        if t["sessions"][0]["status"] == "completed" {
            assert_eq!(t["sessions"][0]["answer"], TEAM.answer, "{t}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the raw submission never completed: {t}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    check_nats(&cfg, &TEAM, &url, &data, "raw-team");
}

/// Submits `case`, kills its only worker with SIGKILL once the tree holds `at_least`
/// sessions (the pattern is under way), starts another, and checks the finished tree.
fn nats_kill_and_restart(case: &Case, id: &str, at_least: usize) {
    let server = NatsServer::start();
    let url = server.url();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let cfg = slow_config(tmp.path());
    let mut first = worker(&cfg, &url, &data, "k1");
    let out = cli(
        &cfg,
        &url,
        &data,
        &[
            "submit",
            "--agent",
            case.agent,
            "--id",
            id,
            "--no-cache",
            case.mission,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = tree_json(&cfg, &url, &data, id);
        let n = t["sessions"].as_array().map_or(0, Vec::len);
        if n >= at_least {
            assert_ne!(
                t["sessions"][0]["status"], "completed",
                "the tree ended before the kill: {t}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "the pattern never started: {t}");
        std::thread::sleep(Duration::from_millis(5));
    }
    common::cluster::kill9(&mut first);
    let t = tree_json(&cfg, &url, &data, id);
    assert_ne!(
        t["sessions"][0]["status"], "completed",
        "the tree ended before the kill: {t}"
    );
    let _w = Workers(vec![worker(&cfg, &url, &data, "k2")]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let t = tree_json(&cfg, &url, &data, id);
        if t["sessions"][0]["status"] == "completed" {
            assert_eq!(t["sessions"][0]["answer"], case.answer, "{t}");
            break;
        }
        assert!(Instant::now() < deadline, "never completed: {t}");
        std::thread::sleep(Duration::from_millis(100));
    }
    check_nats(&cfg, case, &url, &data, id);
}

#[test]
fn nats_kill9_mid_team_then_a_new_worker_finishes() {
    nats_kill_and_restart(&TEAM, "kill-team", 4);
}

#[test]
fn nats_kill9_mid_handoff_then_a_new_worker_finishes() {
    nats_kill_and_restart(&CHAIN, "kill-chain", 2);
}

#[test]
fn nats_kill9_mid_route_then_a_new_worker_finishes() {
    nats_kill_and_restart(&TO_BILLING, "kill-route", 2);
}

#[test]
fn nats_kill9_while_advisors_run_then_a_new_worker_finishes() {
    nats_kill_and_restart(&ADVISORS, "kill-advisors", 2);
}

// ---- limits.timeout -----------------------------------------------------------------

/// `boss` calls `slow` (whose model takes 3 s, past its 400 ms timeout) and a `quick`
/// one, and answers with what each call returned.
fn timeout_sandbox() -> Sandbox {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [slow, quick]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: slow, mission: "take your time"}
      - tool: call_agent
        args: {agent: quick, mission: "be quick"}
  - answer: "slow: {{ results[0].error }} | quick: {{ results[1].result }}"
"#,
    )
    .agent(
        "slow",
        "limits: {timeout: 400ms}\n",
        "latency_ms: 3000\nturns:\n  - answer: \"too late\"\n",
    )
    .agent(
        "quick",
        "limits: {timeout: 10s}\n",
        "turns:\n  - answer: \"done in time\"\n",
    );
    sb
}

const TIMED_OUT: &str = "slow: cancelled: timed out: `slow` ran past its limits.timeout of 400ms \
                         | quick: done in time";

#[test]
fn embedded_a_sub_agent_past_its_timeout_ends_and_its_caller_reads_why() {
    let sb = timeout_sandbox();
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "boss", "--json", "go"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["answer"], TIMED_OUT, "{out}");
    let root = out["session"].as_str().unwrap();
    // The slow model call was cut short: it never answered, and the session ended.
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["events", &format!("{root}/slow-1"), "--json"]);
    let kinds: Vec<String> = String::from_utf8(run_ok(c).stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["body"]["type"].to_string())
        .collect();
    assert_eq!(kinds, ["\"Submitted\"", "\"Cancelled\""], "{kinds:?}");
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["replay", "--tree", "--verify", root]);
    run_ok(c);
}

#[test]
fn nats_a_sub_agent_past_its_timeout_ends_and_its_caller_reads_why() {
    let sb = timeout_sandbox();
    let server = NatsServer::start();
    let url = server.url();
    let cfg = sb.config();
    let _w = Workers(vec![worker(&cfg, &url, &sb.data(), "t1")]);
    let out = cli(
        &cfg,
        &url,
        &sb.data(),
        &[
            "submit",
            "--agent",
            "boss",
            "--id",
            "timeout-1",
            "--wait",
            "--json",
            "go",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["answer"], TIMED_OUT, "{v}");
    let out = cli(
        &cfg,
        &url,
        &sb.data(),
        &["replay", "--tree", "--verify", "timeout-1"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Two teams share a member and a supervisor; the second runs the same request after
/// the first. A team's participants talk with each other, so none is answered from the
/// cache of the first team's run (a cached member would never broadcast, and the
/// supervisor would wait for it forever).
#[test]
fn embedded_team_participants_are_never_answered_from_the_cache() {
    let sb = Sandbox::new();
    for host in ["first", "second"] {
        sb.agent(
            host,
            "team: {members: [teller], supervisor: boss}\n",
            "turns:\n  - answer: unused\n",
        );
    }
    sb.agent(
        "teller",
        "",
        "turns:\n  - tool_calls:\n      - tool: team_broadcast\n        args: {message: \"news\"}\n  - answer: \"told\"\n",
    )
    .agent(
        "boss",
        "",
        "turns:\n  - answer: \"heard {{ user_messages | length }}\"\n",
    );
    for host in ["first", "second"] {
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["run", "--agent", host, "--json", "the same request"]);
        let out = json_of(&run_ok(c));
        assert_eq!(out["status"], "completed", "{out}");
        assert_eq!(out["summary"]["cache_hits"], 0, "{out}");
        assert_eq!(out["summary"]["sessions"], 3, "{out}");
    }
}

/// A sub-agent with a `handoff`: its caller's `call_agent` result is the answer at the
/// end of the chain.
#[test]
fn embedded_a_sub_agent_with_a_handoff_returns_the_chains_answer_to_its_caller() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [first]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: first, mission: "write it"}
  - answer: "boss got: {{ results[0].result }}"
"#,
    )
    .agent("first", "handoff: second\n", "turns:\n  - answer: \"first draft\"\n")
    .agent(
        "second",
        "",
        "turns:\n  - answer: \"second polished {% if 'first draft' in mission %}the draft{% endif %}\"\n",
    );
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "boss", "--json", "go"]);
    let out = json_of(&run_ok(c));
    assert_eq!(
        out["answer"], "boss got: second polished the draft",
        "{out}"
    );
    let mut c = skein(&sb.config(), &sb.data());
    c.args([
        "replay",
        "--tree",
        "--verify",
        out["session"].as_str().unwrap(),
    ]);
    run_ok(c);
}
