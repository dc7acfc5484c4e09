//! End to end on the embedded backend, with the real binary.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;
use skein_core::SessionId;

#[test]
fn demo_brief_runs_researchers_in_parallel_then_the_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut c = skein(&demo_config(), &data);
    c.args(["run", "--json", "Brief on event sourcing"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    let answer = out["answer"].as_str().unwrap();
    assert!(
        answer.starts_with("# Brief: Brief on event sourcing"),
        "{answer}"
    );
    for angle in [
        "Origins and history",
        "Core mechanics",
        "Practice and pitfalls",
    ] {
        assert!(
            answer.contains(angle),
            "the brief lacks the finding on {angle}: {answer}"
        );
    }

    let id = out["session"].as_str().unwrap().to_string();
    let mut c = skein(&demo_config(), &data);
    c.args(["tree", &id, "--json"]);
    let tree = json_of(&run_ok(c));
    let sessions = tree["sessions"].as_array().unwrap();
    assert_eq!(sessions[0]["agent"], "orchestrator");
    let researchers: Vec<_> = sessions
        .iter()
        .filter(|s| s["agent"] == "researcher")
        .collect();
    assert!(researchers.len() >= 3, "{tree}");
    assert!(sessions.iter().any(|s| s["agent"] == "writer"));
    // The researchers ran concurrently: every pair's [start, end] intervals overlap.
    for a in &researchers {
        for b in &researchers {
            let (s1, e1) = (
                a["started_at"].as_u64().unwrap(),
                a["ended_at"].as_u64().unwrap(),
            );
            let (s2, e2) = (
                b["started_at"].as_u64().unwrap(),
                b["ended_at"].as_u64().unwrap(),
            );
            assert!(s1 < e2 && s2 < e1, "researchers did not overlap: {a} {b}");
        }
    }
    assert!(
        sessions.iter().all(|s| s["status"] == "completed"),
        "{tree}"
    );

    // Human-readable tree and events work too.
    let mut c = skein(&demo_config(), &data);
    c.args(["tree", &id]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    assert!(
        text.contains("researcher-1") && text.contains("writer-4"),
        "{text}"
    );
    let mut c = skein(&demo_config(), &data);
    c.args(["events", &format!("{id}/researcher-2")]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    assert!(
        text.contains("ToolCalled") && text.contains("list_dir"),
        "{text}"
    );
    assert_eq!(audit_all(&data, &repo().join("config/agents")), 5);
}

/// A demo run started with its progress lines on a pipe, read up to a trigger.
struct Started {
    child: std::process::Child,
    root: String,
    /// The progress lines read, the trigger's last.
    seen: Vec<String>,
    /// The progress lines still to come.
    rest: std::io::Lines<BufReader<std::process::ChildStderr>>,
}

/// Starts the demo tree on `mission` in `data` and reads its progress until a line
/// contains `trigger`.
fn start_until(data: &std::path::Path, mission: &str, trigger: &str) -> Started {
    let mut c = skein(&demo_config(), data);
    c.args(["run", "--no-cache", mission])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut rest = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut root = None;
    let mut seen = vec![];
    for line in rest.by_ref() {
        let line = line.unwrap();
        if let Some(id) = line.strip_prefix("root ") {
            root = Some(id.trim().to_string());
        }
        seen.push(line.clone());
        if line.contains(trigger) {
            break;
        }
    }
    let root = root.expect("the run printed its root id");
    Started {
        child,
        root,
        seen,
        rest,
    }
}

/// Sends `child` the signal `sig` (`-9`, `-INT`).
fn signal(child: &std::process::Child, sig: &str) {
    let sent = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// Runs the demo, kills the process with SIGKILL when `trigger` first shows in its
/// progress output, resumes, and checks that the tree completes with clean logs.
fn kill_and_resume(trigger: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let Started {
        mut child,
        root,
        seen,
        ..
    } = start_until(&data, "Brief on crash safety", trigger);
    signal(&child, "-9");
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the run finished before the kill; saw {seen:?}"
    );

    let mut c = skein(&demo_config(), &data);
    c.args(["resume", &root, "--json"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    assert!(
        out["answer"]
            .as_str()
            .unwrap()
            .contains("Practice and pitfalls"),
        "{out}"
    );

    audits_as_the_demo_tree(&data, &root);
}

#[test]
fn kill9_after_the_delegation_then_resume() {
    kill_and_resume("researcher-3");
}

#[test]
fn kill9_while_researchers_call_tools_then_resume() {
    kill_and_resume("ToolReturned");
}

#[test]
fn kill9_while_the_writer_works_then_resume() {
    kill_and_resume("writer-4");
}

/// Every log of the demo tree under `root` passes the audit: the orchestrator, three
/// researchers and the writer.
fn audits_as_the_demo_tree(data: &std::path::Path, root: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = rt.block_on(audit_tree(
        data,
        &SessionId::parse(root).unwrap(),
        &repo().join("config/agents"),
    ));
    assert_eq!(n, 5, "orchestrator, three researchers and the writer");
}

/// A `skein run` without the cache never opens sled (its open, its I/O threads and the
/// flush with which it closes would cost a short run milliseconds): definitions are stored
/// in the event log file, and what sled holds of the run is rebuilt from the logs. The
/// next processes find every definition and record, resume finds the tree finished, and
/// another run in the same directory completes.
#[test]
fn a_run_never_opens_sled_and_the_next_process_misses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut c = skein(&demo_config(), &data);
    c.args(["run", "--no-cache", "--json", "Brief on group commit"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    let root = out["session"].as_str().unwrap().to_string();
    assert!(
        !data.join("db").exists(),
        "the run opened sled, which it had no reason to write into"
    );

    audits_as_the_demo_tree(&data, &root);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = skein_sled::SledStore::open(&data, &data.join("workspaces")).unwrap();
        let be = store.backend();
        let root = SessionId::parse(&root).unwrap();
        for id in be.log.tree(&root).await.unwrap() {
            let records = be.log.read(&id, 1).await.unwrap();
            let skein_core::Event::Submitted(sub) = &records[0].env.body else {
                panic!("{id} does not start with its submission");
            };
            let def = be.blobs.get(&sub.def_digest).await.unwrap();
            assert!(def.is_some(), "the definition of {id} is not stored");
        }
    });

    let mut c = skein(&demo_config(), &data);
    c.args(["resume", &root, "--json"]);
    let again = json_of(&run_ok(c));
    assert_eq!(again["status"], "completed", "{again}");
    assert_eq!(again["answer"], out["answer"]);
    let mut c = skein(&demo_config(), &data);
    c.args(["run", "--no-cache", "--json", "Brief on torn writes"]);
    let next = json_of(&run_ok(c));
    assert_eq!(next["status"], "completed", "{next}");
}

/// A run interrupted (Ctrl-C) leaves jobs for sessions that have not ended: those are
/// flushed on the way out, for the next process (`skein ui`, `resume`) to take.
#[test]
fn an_interrupted_run_keeps_its_unfinished_jobs_for_the_next_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let Started {
        mut child,
        root,
        rest,
        ..
    } = start_until(&data, "Brief on interruptions", "researcher-2");
    let root = SessionId::parse(&root).unwrap();
    signal(&child, "-INT");
    let rest: Vec<String> = rest.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{rest:?}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = skein_sled::SledStore::open(&data, &data.join("workspaces")).unwrap();
        let be = store.backend();
        let unfinished = {
            let mut n = 0;
            for id in be.log.tree(&root).await.unwrap() {
                let last = be.log.last(&id).await.unwrap().unwrap();
                n += usize::from(!last.env.body.is_terminal());
            }
            n
        };
        assert!(unfinished > 0, "the tree ended before the interruption");
        assert!(
            be.jobs.depth("default").await.unwrap() > 0,
            "the interrupted run's jobs were not kept"
        );
    });

    let mut c = skein(&demo_config(), &data);
    c.args(["resume", root.as_str(), "--json"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
}

#[test]
fn refusals_are_tool_errors_the_model_reads() {
    let sb = Sandbox::new();
    sb.agent(
        "probe",
        "tools: [list_dir]\nagents: [helper]\n",
        r#"
turns:
  - tool_calls:
      - tool: shell
        args: {cmd: "id"}
      - tool: call_agent
        args: {agent: ghost, mission: "boo"}
      - tool: call_agent
        args: {agent: helper, mission: "go deeper"}
      - tool: call_agent
        args: {agent: helper}
  - answer: "{{ results | tojson }}"
"#,
    )
    .agent(
        "helper",
        "agents: [deep]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: deep, mission: "one level too far"}
  - answer: "helper saw: {{ results[0] }}"
"#,
    )
    .agent("deep", "", "turns:\n  - answer: unreachable\n");
    let mut c = skein(&sb.config(), &sb.data());
    c.env("SKEIN__LIMITS__MAX_DEPTH", "1").args([
        "run",
        "--agent",
        "probe",
        "--json",
        "probe the limits",
    ]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    let answer = out["answer"].as_str().unwrap();
    assert!(answer.contains("not allowed: tool `shell`"), "{answer}");
    assert!(answer.contains("unknown agent `ghost`"), "{answer}");
    assert!(answer.contains("`mission` is required"), "{answer}");
    assert!(
        answer.contains("depth limit: the child would run at depth 2, the limit is 1"),
        "{answer}"
    );
}

#[test]
fn agents_check_names_the_file_and_the_cycle() {
    let sb = Sandbox::new();
    sb.agent("a", "agents: [b]\n", "turns: [{answer: x}]\n")
        .agent("b", "agents: [a]\n", "turns: [{answer: x}]\n")
        .agent("c", "agents: [nobody]\n", "turns: [{answer: x}]\n");
    let out = skein(&sb.config(), &sb.data())
        .args(["agents", "check"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("a.md: cycle a → b → a"), "{err}");
    assert!(
        err.contains("c.md: agent `c` agents names unknown agent `nobody`"),
        "{err}"
    );

    let out = skein(&demo_config(), &sb.data())
        .args(["agents", "check"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_submissions_are_refused_with_the_reason_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    for (args, reason) in [
        (
            vec!["run", "--agent", "ghost", "x"],
            "unknown agent `ghost`",
        ),
        (vec!["run", "   "], "mission is empty"),
        (vec!["run", "--id", "Bad Id", "x"], "token `Bad Id`"),
        (
            vec!["run", "--inputs", "[1]", "x"],
            "inputs must be a JSON object",
        ),
        (
            vec!["run", "--inputs", "{nope", "x"],
            "--inputs must be a JSON object",
        ),
    ] {
        let out = skein(&demo_config(), &data).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(reason), "{args:?}: {err}");
    }
    let out = run_ok({
        let mut c = skein(&demo_config(), &data);
        c.args(["sessions", "--json"]);
        c
    });
    assert_eq!(
        json_of(&out),
        serde_json::json!([]),
        "a refused submission left a session"
    );
}

#[test]
fn sessions_page_through_a_cursor_and_gc_archives_then_removes_finished_trees() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    for (id, mission) in [("first", "Brief on logs"), ("second", "Brief on folds")] {
        let mut c = skein(&demo_config(), &data);
        c.args(["run", "--json", "--id", id, mission]);
        assert_eq!(json_of(&run_ok(c))["status"], "completed");
    }
    // Newest first, one a page: the first page names the next page's cursor on stderr.
    let mut c = skein(&demo_config(), &data);
    c.args(["sessions", "--json", "--limit", "1"]);
    let out = run_ok(c);
    assert_eq!(json_of(&out)[0]["session"], "second");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let cursor = stderr
        .lines()
        .find_map(|l| l.strip_prefix("more: --cursor "))
        .unwrap_or_else(|| panic!("no cursor in {stderr}"))
        .to_string();
    let mut c = skein(&demo_config(), &data);
    c.args(["sessions", "--json", "--limit", "1", "--cursor", &cursor]);
    let out = run_ok(c);
    assert_eq!(json_of(&out)[0]["session"], "first");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("more:"));
    let mut c = skein(&demo_config(), &data);
    c.args(["sessions", "--json", "--text", "FOLDS", "--since", "1h"]);
    let rows = json_of(&run_ok(c));
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{rows}");

    // Retention: both trees are archived (each export verifies), then removed.
    let archive = tmp.path().join("archive");
    let mut c = skein(&demo_config(), &data);
    c.args(["gc", "--older-than", "0s", "--json", "--archive"])
        .arg(&archive);
    let out = json_of(&run_ok(c));
    assert_eq!(out["removed"]["trees"], 2, "{out}");
    for id in ["first", "second"] {
        let mut c = skein(&demo_config(), &tmp.path().join("other"));
        c.args(["audit", "verify"])
            .arg(archive.join(format!("{id}.jsonl")));
        run_ok(c);
    }
    let mut c = skein(&demo_config(), &data);
    c.args(["sessions", "--json"]);
    assert_eq!(json_of(&run_ok(c)), serde_json::json!([]));
}

/// Writes a wide tree's agents into `dir` with a config naming them: `wide` delegates
/// `inputs.n` calls in one turn to `leaf`, which lists its workspace once and answers; a
/// turn's delegations are recorded in batches from one call up.
fn wide_tree_config(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.join("agents")).unwrap();
    std::fs::create_dir_all(dir.join("scripts")).unwrap();
    std::fs::write(
        dir.join("agents/wide.md"),
        "---\nname: wide\nmodel: scripted:wide\nagents: [leaf]\ncache: false\n\
         limits: {max_children_per_turn: 1000, max_tool_calls_per_turn: 1000}\n---\nFan out.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("agents/leaf.md"),
        "---\nname: leaf\nmodel: scripted:leaf\ntools: [list_dir]\ncache: false\n---\nLook.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("scripts/wide.yaml"),
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        repeat: \"{{ inputs.n }}\"\n        \
         args: {agent: leaf, mission: \"part {{ i }}\"}\n  - answer: \"{{ results | length }} parts done\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("scripts/leaf.yaml"),
        "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {path: \".\"}\n  \
         - answer: \"done with {{ mission }}\"\n",
    )
    .unwrap();
    let config = dir.join("skein.toml");
    std::fs::write(
        &config,
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n\n[runtime]\ndelegation_batch = 1\n\n\
         [limits]\nmax_children_per_turn = 1000\nmax_tool_calls_per_turn = 1000\n",
    )
    .unwrap();
    config
}

/// Starts `run` (a `skein run` command) with its progress piped, kills it with SIGKILL at
/// the first progress line holding `marker`, and returns the root id it printed and how
/// it exited.
fn kill9_at_progress(
    mut run: std::process::Command,
    marker: &str,
) -> (SessionId, std::process::ExitStatus) {
    run.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = run.spawn().unwrap();
    let mut root = None;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(id) = line.strip_prefix("root ") {
            root = Some(id.trim().to_string());
        }
        if line.contains(marker) {
            break;
        }
    }
    signal(&child, "-9");
    let status = child.wait().unwrap();
    let root = SessionId::parse(&root.expect("the run printed its root id")).unwrap();
    (root, status)
}

/// A wide turn's delegations are recorded in batches (`[runtime] delegation_batch`), the
/// children of each starting while the next is made. A kill -9 that falls between two
/// batches leaves the parent with some of its calls recorded: the resumed run delegates
/// the rest, each call once, every child runs once, and every log replays exactly.
#[test]
fn kill9_between_the_batches_of_a_wide_turn_then_resume() {
    const N: usize = 300;
    let mut landed_within = vec![];
    // Where the kill falls depends on timing: up to three runs, until one falls within
    // the turn; every run is checked whole after its resume.
    for attempt in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let config = wide_tree_config(tmp.path());
        let data = tmp.path().join("data");
        let mut c = skein(&config, &data);
        c.args(["run", "--agent", "wide", "--no-cache", "--inputs"])
            .arg(format!("{{\"n\": {N}}}"))
            .arg(format!("wide turn {attempt}"));
        // The first child's first record: its batch is written.
        let (root, status) = kill9_at_progress(c, "leaf-1 ");
        assert!(!status.success(), "the run finished before the kill");

        let count = |data: &std::path::Path, kind: &str| -> usize {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let store = skein_sled::SledStore::open(data, &data.join("workspaces")).unwrap();
                let b = store.backend();
                b.log
                    .read(&root, 1)
                    .await
                    .unwrap()
                    .iter()
                    .filter(|r| r.env.body.kind() == kind)
                    .count()
            })
        };
        let before = count(&data, "Delegated");

        let mut c = skein(&config, &data);
        c.args(["resume", root.as_str(), "--json"]);
        let out = json_of(&run_ok(c));
        assert_eq!(out["status"], "completed", "{out}");
        assert_eq!(out["answer"], format!("{N} parts done"), "{out}");
        assert_eq!(
            count(&data, "Delegated"),
            N,
            "each call delegated once (the kill fell after {before})"
        );
        assert_eq!(count(&data, "ChildSettled"), N);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let sessions = rt.block_on(audit_tree(&data, &root, &tmp.path().join("agents")));
        assert_eq!(sessions, N + 1, "one child per call, none twice");
        if before > 0 && before < N {
            landed_within.push(before);
            break;
        }
    }
    assert!(
        !landed_within.is_empty(),
        "no kill fell between two batches of the turn in three runs"
    );
}

/// A team of `members` hands and a lead that answers only once every hand has left the
/// team (its last word heard); delegations are configured in batches from one call up,
/// which a team's turn must not follow.
fn large_team_config(dir: &std::path::Path, members: usize) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.join("agents")).unwrap();
    std::fs::create_dir_all(dir.join("scripts")).unwrap();
    let hands = vec!["hand"; members].join(", ");
    std::fs::write(
        dir.join("agents/crew.md"),
        format!(
            "---\nname: crew\nmodel: scripted:crew\nteam: {{members: [{hands}], supervisor: lead, \
             supervisor_max_turns: {}}}\nlimits: {{max_children_per_turn: {}, max_tool_calls_per_turn: {}}}\n\
             ---\nA crew.\n",
            members + 5,
            members + 1,
            members + 1
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("scripts/crew.yaml"),
        "turns:\n  - answer: unused\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("agents/hand.md"),
        "---\nname: hand\nmodel: scripted:hand\n---\nA hand.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("scripts/hand.yaml"),
        "turns:\n  - answer: \"hand done\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("agents/lead.md"),
        "---\nname: lead\nmodel: scripted:lead\n---\nThe lead.\n",
    )
    .unwrap();
    let heard = "user_messages | select('endingwith', 'hand done') | list | length";
    let turn = format!(
        "  - choose:\n      - when: \"({heard}) >= {members}\"\n        answer: \"heard from {{{{ {heard} }}}} hands\"\n      \
         - tool_calls:\n          - tool: team_broadcast\n            args: {{message: \"heard {{{{ {heard} }}}} so far\"}}\n"
    );
    std::fs::write(
        dir.join("scripts/lead.yaml"),
        format!("turns:\n{}", turn.repeat(members + 5)),
    )
    .unwrap();
    let config = dir.join("skein.toml");
    std::fs::write(
        &config,
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n\n[runtime]\ndelegation_batch = 1\n",
    )
    .unwrap();
    config
}

/// A team's participants must all exist before any starts: a hand that ended before the
/// lead's log was made would never be heard to leave, and the lead would wait for it for
/// ever. With delegations in batches from one call, a kill -9 as the first hand's record
/// shows, then a resume, used to leave such a lead waiting in most runs (the resumed run
/// ran the first hands before it made the rest). Now the team's turn is one batch: every
/// run ends with the lead having heard all sixty, and every log replays exactly.
#[test]
fn kill9_while_a_large_team_is_delegated_then_resume_hears_every_member() {
    const MEMBERS: usize = 60;
    for attempt in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let config = large_team_config(tmp.path(), MEMBERS);
        let data = tmp.path().join("data");
        let mut c = skein(&config, &data);
        c.args(["run", "--agent", "crew", &format!("the job {attempt}")]);
        let (root, _) = kill9_at_progress(c, "hand-");

        let mut c = skein(&config, &data);
        c.args(["resume", root.as_str(), "--json"]);
        let out = json_of(&run_ok(c));
        assert_eq!(out["status"], "completed", "run {attempt}: {out}");
        assert_eq!(
            out["answer"],
            format!("heard from {MEMBERS} hands"),
            "run {attempt}: {out}"
        );
        let rt = tokio::runtime::Runtime::new().unwrap();
        let sessions = rt.block_on(audit_tree(&data, &root, &tmp.path().join("agents")));
        assert_eq!(
            sessions,
            MEMBERS + 2,
            "run {attempt}: the host, its hands, the lead"
        );
    }
}
