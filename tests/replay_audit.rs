//! Replay, fork and audit, end to end on the embedded backend.

mod common;

use common::*;

fn demo_tree(data: &std::path::Path) -> String {
    let mut c = skein(&demo_config(), data);
    c.args(["run", "--json", "--no-cache", "Brief on audits"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["status"], "completed");
    out["session"].as_str().unwrap().to_string()
}

#[test]
fn verify_passes_on_a_whole_tree_and_state_at_seq_is_shown() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let id = demo_tree(&data);
    let mut c = skein(&demo_config(), &data);
    c.args(["replay", &id, "--verify", "--tree", "--json"]);
    let v = json_of(&run_ok(c));
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["sessions"].as_array().unwrap().len(), 5);

    let mut c = skein(&demo_config(), &data);
    c.args(["replay", &id, "--at", "5", "--json"]);
    let st = json_of(&run_ok(c));
    assert_eq!(st["status"], "waiting", "{st}");
    assert_eq!(st["children"].as_object().unwrap().len(), 3);

    let mut c = skein(&demo_config(), &data);
    c.args(["replay", &id, "--tree"]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    assert!(
        text.contains("researcher-3") && text.contains("ChildSettled"),
        "{text}"
    );
}

fn export(data: &std::path::Path, id: &str) -> Vec<String> {
    let file = data.parent().unwrap().join("export.jsonl");
    let mut c = skein(&demo_config(), data);
    c.args(["audit", "export", id, "-o"]).arg(&file);
    run_ok(c);
    std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn audit_verify(data: &std::path::Path, lines: &[String]) -> (bool, String) {
    let file = data.parent().unwrap().join("check.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = skein(&demo_config(), data)
        .args(["audit", "verify"])
        .arg(&file)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn audit_verify_catches_altered_missing_and_reordered_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let id = demo_tree(&data);
    let lines = export(&data, &id);
    assert!(lines.len() > 30);
    let (ok, out) = audit_verify(&data, &lines);
    assert!(ok, "{out}");
    // Every line is plain JSON an auditor can read without skein.
    let first: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(first["kind"], "Submitted");
    assert_eq!(first["payload"]["data"]["mission"], "Brief on audits");

    // Altered: change the answer in a Completed event (line numbers are 1-based).
    let i = lines
        .iter()
        .position(|l| l.contains("\"kind\":\"Completed\""))
        .unwrap();
    let mut altered = lines.clone();
    altered[i] = altered[i].replacen("\"answer\":\"", "\"answer\":\"FORGED ", 1);
    let (ok, out) = audit_verify(&data, &altered);
    assert!(!ok);
    assert!(
        out.contains(&format!("line {}:", i + 1)) && out.contains("altered: `payload`"),
        "{out}"
    );

    // Missing: drop an event in the middle of a session.
    let mut dropped = lines.clone();
    dropped.remove(2);
    let (ok, out) = audit_verify(&data, &dropped);
    assert!(!ok);
    assert!(
        out.contains("line 3:") && out.contains("missing: seq 3 to 3"),
        "{out}"
    );

    // Reordered: swap two events of the same session.
    let mut swapped = lines.clone();
    swapped.swap(2, 3);
    let (ok, out) = audit_verify(&data, &swapped);
    assert!(!ok);
    assert!(out.contains("line 3:") && out.contains("missing"), "{out}");
    assert!(
        out.contains("line 4:") && out.contains("reordered"),
        "{out}"
    );
}

#[test]
fn fork_continues_with_another_answer_and_leaves_the_source_untouched() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [worker]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: worker, mission: "part one"}
      - tool: call_agent
        args: {agent: worker, mission: "part two"}
  - answer: "ORIGINAL with {{ results | length }} parts"
"#,
    )
    .agent("worker", "", "turns:\n  - answer: \"did {{ mission }}\"\n");
    std::fs::write(
        sb.dir.path().join("scripts/alt.yaml"),
        "turns:\n  - answer: never asked\n  - answer: \"ALTERNATIVE from {{ results[1].result }}\"\n",
    )
    .unwrap();
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "boss", "--json", "two parts"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["answer"], "ORIGINAL with 2 parts");
    let src = out["session"].as_str().unwrap().to_string();
    let before = {
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["events", &src, "--json"]);
        String::from_utf8(run_ok(c).stdout).unwrap()
    };

    // Seq 2 is the first ModelCalled: its calls are decided but no child exists yet.
    let mut c = skein(&sb.config(), &sb.data());
    c.args([
        "fork",
        &src,
        "--at",
        "2",
        "--model",
        "scripted:alt",
        "--json",
    ]);
    let forked = json_of(&run_ok(c));
    assert_eq!(forked["status"], "completed", "{forked}");
    assert_eq!(forked["answer"], "ALTERNATIVE from did part two");
    let fid = forked["session"].as_str().unwrap().to_string();
    assert_ne!(fid, src);

    let after = {
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["events", &src, "--json"]);
        String::from_utf8(run_ok(c).stdout).unwrap()
    };
    assert_eq!(before, after, "the source log changed");

    let mut c = skein(&sb.config(), &sb.data());
    c.args(["events", &fid, "--json"]);
    let first: serde_json::Value = serde_json::from_str(
        String::from_utf8(run_ok(c).stdout)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["body"]["data"]["forked_from"]["session"], src);
    assert_eq!(first["body"]["data"]["forked_from"]["at_seq"], 2);

    // The fork verifies like any tree.
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["replay", &fid, "--verify", "--tree"]);
    run_ok(c);

    // A fork while children are outstanding is refused with the seqs that work.
    let out = skein(&sb.config(), &sb.data())
        .args(["fork", &src, "--at", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("outstanding") && err.contains("(e.g. seq 1, 2, 6"),
        "{err}"
    );
}
