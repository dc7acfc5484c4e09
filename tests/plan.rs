//! The master plan end to end on the embedded backend: the planner demo (two analysts in
//! parallel patch their own tasks, one patch meets a stale version and is rebased), the
//! ownership guard as a model sees it, and a kill -9 in the middle of the patching.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

use common::*;
use skein_core::SessionId;

fn events_of(config: &Path, data: &Path, id: &str) -> Vec<serde_json::Value> {
    let mut c = skein(config, data);
    c.args(["events", id, "--json"]);
    let out = run_ok(c);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn of_kind<'a>(events: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

/// Checks the planner tree's plan and patch history, wherever it was interrupted.
fn check_planner_tree(data: &Path, root: &str) {
    let config = demo_config();
    let ev = events_of(&config, data, root);
    let applied = of_kind(&ev, "PatchApplied");
    let rejected = of_kind(&ev, "PatchRejected");
    // The planner's two edits and one accepted patch per analyst.
    assert_eq!(applied.len(), 4, "{applied:?}");
    let versions: Vec<u64> = applied
        .iter()
        .map(|e| e["body"]["data"]["version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, vec![1, 2, 3, 4]);
    // The analysts both started from version 1: whichever came second was refused as a
    // conflict naming version 2, and rebased.
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    let reason = &rejected[0]["body"]["data"]["reason"];
    assert_eq!(reason["kind"], "conflict", "{reason}");
    assert_eq!(reason["current_version"], 2, "{reason}");
    assert_eq!(reason["base_version"], 1, "{reason}");
    let loser = rejected[0]["body"]["data"]["from"].as_str().unwrap();
    assert!(
        applied
            .iter()
            .any(|e| e["body"]["data"]["from"] == loser && e["body"]["data"]["base_version"] == 2),
        "the refused analyst rebased on version 2: {applied:?}"
    );
    // No proposal was merged twice.
    let mut seen = BTreeSet::new();
    for e in applied.iter().chain(&rejected) {
        let d = &e["body"]["data"];
        if d["from"] != "self" {
            assert!(
                seen.insert((d["from"].to_string(), d["call"].to_string())),
                "merged twice: {d}"
            );
        }
    }

    let mut c = skein(&config, data);
    c.args(["plan", root, "--json"]);
    let plan = json_of(&run_ok(c));
    assert_eq!(plan["version"], 4, "{plan}");
    let tasks = plan["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 3);
    for t in tasks {
        assert_eq!(t["status"], "COMPLETED", "{t}");
    }
    let owners: Vec<&str> = tasks
        .iter()
        .map(|t| t["owner_agent"].as_str().unwrap())
        .collect();
    assert_eq!(owners, vec!["analyst", "analyst", "planner"]);

    // The Markdown view is the same bytes every time, and the plan at any seq is there.
    let render = |extra: &[&str]| {
        let mut c = skein(&config, data);
        c.args(["plan", root]).args(extra);
        String::from_utf8(run_ok(c).stdout).unwrap()
    };
    let md = render(&[]);
    assert_eq!(md, render(&[]));
    assert!(md.starts_with("# Plan (version 4)\n"), "{md}");
    assert!(
        md.contains("## analyst") && md.contains("## planner"),
        "{md}"
    );
    let first = applied[0]["seq"].as_u64().unwrap().to_string();
    let at_first = render(&["--at", &first]);
    assert!(at_first.starts_with("# Plan (version 1)\n"), "{at_first}");
    assert_eq!(at_first.matches("(PENDING)").count(), 3, "{at_first}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = rt.block_on(audit_tree(
        data,
        &SessionId::parse(root).unwrap(),
        &repo().join("config/agents"),
    ));
    assert_eq!(n, 3, "planner and two analysts");
}

#[test]
fn planner_demo_children_patch_their_tasks_and_a_stale_patch_is_rebased() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut c = skein(&demo_config(), &data);
    c.args([
        "run",
        "--agent",
        "planner",
        "--json",
        "Adopt event sourcing",
    ]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    let answer = out["answer"].as_str().unwrap();
    assert!(answer.contains("plan at version 4"), "{answer}");
    assert!(answer.contains("after a rebase"), "{answer}");
    let root = out["session"].as_str().unwrap().to_string();
    check_planner_tree(&data, &root);

    // `skein tree` shows the plan under the table.
    let mut c = skein(&demo_config(), &data);
    c.args(["tree", &root]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    assert!(text.contains("# Plan (version 4)"), "{text}");
}

#[test]
fn kill9_while_analysts_patch_then_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut c = skein(&demo_config(), &data);
    c.args(["run", "--agent", "planner", "Plan under fire"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut root = None;
    let mut seen = vec![];
    let mut patches = 0;
    for line in stderr.lines() {
        let line = line.unwrap();
        if let Some(id) = line.strip_prefix("root ") {
            root = Some(id.trim().to_string());
        }
        seen.push(line.clone());
        // The planner's own edit is the first; kill on the first analyst's patch.
        if line.contains("PatchApplied") {
            patches += 1;
            if patches == 2 {
                break;
            }
        }
    }
    let killed = std::process::Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(
        !child.wait().unwrap().success(),
        "the run finished before the kill; saw {seen:?}"
    );
    let root = root.expect("the run printed its root id");
    let mut c = skein(&demo_config(), &data);
    c.args(["resume", &root, "--json"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    check_planner_tree(&data, &root);
}

#[test]
fn a_child_writing_a_task_it_does_not_own_is_forbidden_and_sees_why() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [helper]\ntools: [update_plan]\n",
        r#"
turns:
  - tool_calls:
      - tool: update_plan
        args:
          ops:
            - {op: add, task: {id: mine, title: "Mine"}}
            - {op: add, task: {id: theirs, title: "Theirs"}}
  - tool_calls:
      - tool: call_agent
        args: {agent: helper, mission: "work", owns_tasks: [nope]}
  - tool_calls:
      - tool: call_agent
        args: {agent: helper, mission: "work", owns_tasks: [mine]}
  - answer: "{{ results[0].result }} | {{ all_results[1] }} | result patch {{ results[0].patch.status }} v{{ results[0].patch.version }}"
"#,
    )
    .agent(
        "helper",
        "",
        r#"
turns:
  - tool_calls:
      - tool: propose_patch
        args:
          base_version: "{{ plan.version }}"
          ops: [{op: update, task_id: theirs, fields: {status: COMPLETED}}]
  - tool_calls:
      - tool: propose_patch
        args:
          base_version: "{{ plan.version }}"
          ops: [{op: link_dep, task_id: mine, depends_on: mine}]
  - tool_calls:
      - tool: propose_patch
        args:
          base_version: "{{ plan.version }}"
          ops: [{op: update, task_id: mine, fields: {status: BLOCKED, notes: "waiting"}}]
  - answer: |
      {{ all_results[0].status }}/{{ all_results[0].code }}, {{ all_results[1].detail.kind }}, {{ all_results[2].status }}
      ```patch
      {"base_version": {{ all_results[2].version }}, "ops": [{"op": "update", "task_id": "mine", "fields": {"notes": "closed by the answer"}}]}
      ```
"#,
    );
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "boss", "--json", "ownership"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed", "{out}");
    let answer = out["answer"].as_str().unwrap();
    // The child saw a 403 for the task it does not own, a cycle refusal, then success.
    assert!(
        answer.starts_with("forbidden/403, cycle, accepted"),
        "{answer}"
    );
    // The unknown task in owns_tasks was refused before any child started.
    assert!(
        answer.contains("owns_tasks: no task `nope` in your plan"),
        "{answer}"
    );
    // The patch in the child's final answer was merged when it settled.
    assert!(answer.ends_with("| result patch accepted v3"), "{answer}");
    let root = out["session"].as_str().unwrap();
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["plan", root, "--json"]);
    let plan = json_of(&run_ok(c));
    assert_eq!(plan["version"], 3, "{plan}");
    assert_eq!(plan["tasks"][0]["notes"], "closed by the answer", "{plan}");
    let theirs = &plan["tasks"][1];
    assert_eq!(theirs["id"], "theirs");
    assert_eq!(theirs["status"], "PENDING", "untouched: {plan}");
    assert_eq!(plan["tasks"][0]["status"], "BLOCKED", "{plan}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
    assert_eq!(n, 2);
}
