//! Caching by mission hash and single-flight, end to end on the embedded backend.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;
use skein_core::SessionId;

fn run_json(sb: &Sandbox, args: &[&str]) -> serde_json::Value {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(args);
    json_of(&run_ok(c))
}

fn count(tree: &serde_json::Value, key: &str) -> u64 {
    tree["tree"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s[key].as_u64().unwrap_or(0))
        .sum()
}

fn boss_and_worker(sb: &Sandbox, worker_front: &str) {
    sb.agent(
        "boss",
        "agents: [worker]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: worker, mission: "summarise the topic"}
  - answer: "{{ results[0].result }} (cached: {{ (results[0].cached or false) | tojson }})"
"#,
    )
    .agent(
        "worker",
        worker_front,
        "turns:\n  - answer: \"summary of {{ mission }}\"\n",
    );
}

#[test]
fn miss_then_hit_and_the_tree_shows_the_saving() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let first = {
        let mut c = skein(&demo_config(), &data);
        c.args(["run", "--json", "Brief on caching"]);
        json_of(&run_ok(c))
    };
    assert_eq!(count(&first, "cache_hits"), 0);
    let second = {
        let mut c = skein(&demo_config(), &data);
        c.args([
            "run",
            "--json",
            "--context",
            "second run",
            "Brief on caching",
        ]);
        json_of(&run_ok(c))
    };
    assert_eq!(
        second["answer"], first["answer"],
        "a hit gives the same answer"
    );
    // Three researchers and the writer are answered from the cache: no child runs.
    assert_eq!(count(&second, "cache_hits"), 4, "{second}");
    assert_eq!(
        second["tree"].as_array().unwrap().len(),
        1,
        "only the root ran"
    );
    assert!(second["summary"]["saved"]["input_tokens"].as_u64().unwrap() > 0);

    let id = second["session"].as_str().unwrap();
    let mut c = skein(&demo_config(), &data);
    c.args(["tree", id]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    assert!(text.contains("cache hits 4 (saved"), "{text}");

    // --no-cache misses.
    let third = {
        let mut c = skein(&demo_config(), &data);
        c.args(["run", "--json", "--no-cache", "Brief on caching"]);
        json_of(&run_ok(c))
    };
    assert_eq!(count(&third, "cache_hits"), 0);
    assert_eq!(third["tree"].as_array().unwrap().len(), 5);
    assert!(audit_all(&data, &repo().join("config/agents")) >= 11);
}

#[test]
fn ttl_expiry_and_a_changed_prompt_miss() {
    let sb = Sandbox::new();
    boss_and_worker(&sb, "cache: {ttl: 1s}\n");
    let a = run_json(&sb, &["run", "--agent", "boss", "--json", "x1"]);
    assert_eq!(
        a["answer"],
        "summary of summarise the topic (cached: false)"
    );
    let b = run_json(&sb, &["run", "--agent", "boss", "--json", "x2"]);
    assert_eq!(b["answer"], "summary of summarise the topic (cached: true)");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let c = run_json(&sb, &["run", "--agent", "boss", "--json", "x3"]);
    assert_eq!(
        c["answer"], "summary of summarise the topic (cached: false)",
        "the entry expired"
    );

    // A changed system prompt is a new definition digest, so a new mission hash.
    let path = sb.dir.path().join("agents/worker.md");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("You are worker.", "You are a worker.");
    std::fs::write(&path, text).unwrap();
    let d = run_json(&sb, &["run", "--agent", "boss", "--json", "x4"]);
    assert_eq!(
        d["answer"],
        "summary of summarise the topic (cached: false)"
    );
}

#[test]
fn failed_children_are_not_cached() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [flaky]\n",
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: flaky, mission: \"try\"}\n  - answer: \"{{ results[0].success | tojson }}\"\n",
    )
    // The script has no second turn: the child fails after its refused tool call.
    .agent("flaky", "", "turns:\n  - tool_calls:\n      - tool: shell\n        args: {cmd: x}\n");
    for i in 0..2 {
        let out = run_json(
            &sb,
            &["run", "--agent", "boss", "--json", &format!("go {i}")],
        );
        assert_eq!(out["answer"], "false");
        assert_eq!(count(&out, "cache_hits"), 0);
        assert_eq!(
            out["tree"].as_array().unwrap().len(),
            2,
            "the child ran again"
        );
    }
    audit_all(&sb.data(), &sb.dir.path().join("agents"));
}

fn eight_identical(sb: &Sandbox, latency: u64) {
    sb.agent(
        "boss",
        "agents: [worker]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        repeat: 8
        args: {agent: worker, mission: "the same question"}
  - answer: "{{ results | selectattr('success') | list | length }} answers: {{ results | map(attribute='result') | unique | join(',') }}"
"#,
    )
    .agent("worker", "", &format!("latency_ms: {latency}\nturns:\n  - answer: \"answer to {{{{ mission }}}}\"\n"));
}

#[test]
fn eight_identical_parallel_delegations_run_one_child() {
    let sb = Sandbox::new();
    eight_identical(&sb, 300);
    let out = run_json(&sb, &["run", "--agent", "boss", "--json", "go"]);
    assert_eq!(
        out["answer"], "8 answers: answer to the same question",
        "{out}"
    );
    let tree = out["tree"].as_array().unwrap();
    assert_eq!(tree.len(), 2, "one child for eight calls: {out}");
    assert_eq!(tree[1]["steps"], 1);
    audit_all(&sb.data(), &sb.dir.path().join("agents"));
}

#[test]
fn killing_the_shared_run_does_not_strand_its_waiters() {
    let sb = Sandbox::new();
    eight_identical(&sb, 1500);
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "boss", "go"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut root = None;
    let mut delegated = 0;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(id) = line.strip_prefix("root ") {
            root = Some(id.trim().to_string());
        }
        delegated += usize::from(line.contains("Delegated"));
        if delegated == 8 {
            break; // the worker's model call (1.5 s) is under way
        }
    }
    std::process::Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    let root = root.unwrap();
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["resume", &root, "--json"]);
    let out = json_of(&run_ok(c));
    assert_eq!(
        out["answer"], "8 answers: answer to the same question",
        "{out}"
    );
    assert_eq!(out["tree"].as_array().unwrap().len(), 2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(&root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
}

#[test]
fn a_root_mission_is_answered_from_the_cache_when_its_agent_allows() {
    let sb = Sandbox::new();
    boss_and_worker(&sb, "");
    let a = run_json(&sb, &["run", "--agent", "boss", "--json", "same root"]);
    let b = run_json(&sb, &["run", "--agent", "boss", "--json", "same root"]);
    assert_eq!(b["answer"], a["answer"]);
    let tree = b["tree"].as_array().unwrap();
    assert_eq!(tree.len(), 1, "nothing ran below the root: {b}");
    assert_eq!(tree[0]["steps"], 0, "no model call for a cached root");
    assert_eq!(tree[0]["cache_hits"], 1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let id = SessionId::parse(b["session"].as_str().unwrap()).unwrap();
    rt.block_on(audit_tree(&sb.data(), &id, &sb.dir.path().join("agents")));
    // An agent with `cache: false` is never answered from the cache.
    let sb = Sandbox::new();
    boss_and_worker(&sb, "");
    let path = sb.dir.path().join("agents/boss.md");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("agents: [worker]", "agents: [worker]\ncache: false");
    std::fs::write(&path, text).unwrap();
    run_json(&sb, &["run", "--agent", "boss", "--json", "same root"]);
    let b = run_json(&sb, &["run", "--agent", "boss", "--json", "same root"]);
    assert_eq!(b["tree"].as_array().unwrap()[0]["steps"], 2);
}

#[test]
fn a_long_child_answer_reaches_the_parent_summarised_with_the_full_answer_stored() {
    let sb = Sandbox::new();
    let long = "x".repeat(50) + " the important finding is 42 " + &"y".repeat(150);
    sb.agent(
        "boss",
        "agents: [verbose]\n",
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: verbose, mission: \"dig\"}\n  - answer: \"{{ results[0].result }}\"\n",
    )
    .agent(
        "verbose",
        "summarize: {max_chars: 60, model: \"scripted:brief\"}\n",
        &format!("turns:\n  - answer: \"{long}\"\n"),
    );
    std::fs::write(
        sb.dir.path().join("scripts/brief.yaml"),
        "turns:\n  - answer: \"brief of {{ context | length }} chars: finding is 42\"\n",
    )
    .unwrap();
    let out = run_json(&sb, &["run", "--agent", "boss", "--json", "go"]);
    let answer = out["answer"].as_str().unwrap();
    let hash = skein_core::event::record_hash(long.as_bytes());
    assert_eq!(
        answer,
        format!(
            "brief of {} chars: finding is 42\n\n[full answer: {} characters, blob {hash}]",
            long.len(),
            long.len()
        )
    );
    let tree = out["tree"].as_array().unwrap();
    assert_eq!(
        tree[1]["steps"], 2,
        "the summary is a recorded model call in the child's log"
    );

    let stored = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = skein_sled::SledStore::open(&sb.data(), &sb.data().join("workspaces")).unwrap();
        store.backend().blobs.get(&hash).await.unwrap()
    });
    assert_eq!(
        stored.as_deref(),
        Some(long.as_bytes()),
        "the full answer is in the blob store"
    );
    let id = SessionId::parse(out["session"].as_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(audit_tree(&sb.data(), &id, &sb.dir.path().join("agents")));
}

#[test]
fn a_follow_up_answer_never_replaces_the_cached_answer_to_the_mission() {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "agents: [expert]\ntools: [ask_clarification]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: expert, mission: "estimate the load"}
  - tool_calls:
      - tool: ask_clarification
        args: {session_id: "{{ results[0].session_id }}", question: "and the error bars?"}
  - answer: "first: {{ all_results[0].result }} | then: {{ results[0].result }}"
"#,
    )
    .agent(
        "expert",
        "chat: true\n",
        "turns:\n  - answer: \"the load is 42\"\n  - answer: \"error bars are plus or minus 3\"\n",
    );
    boss_and_worker(&sb, "");
    // The boss delegates the expert's mission as the asker did.
    sb.agent(
        "boss",
        "agents: [expert]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: expert, mission: "estimate the load"}
  - answer: "{{ results[0].result }} (cached: {{ (results[0].cached or false) | tojson }})"
"#,
    );
    let first = run_json(&sb, &["run", "--agent", "asker", "--json", "tree one"]);
    assert_eq!(
        first["answer"], "first: the load is 42 | then: error bars are plus or minus 3",
        "{first}"
    );
    let second = run_json(&sb, &["run", "--agent", "boss", "--json", "tree two"]);
    assert_eq!(
        second["answer"], "the load is 42 (cached: true)",
        "the cache holds the answer to the mission, not to the follow-up: {second}"
    );
    audit_all(&sb.data(), &sb.dir.path().join("agents"));
}

/// A boss whose helper writes a report into the tree's workspace.
fn boss_and_scribe(sb: &Sandbox, scribe_front: &str) {
    std::fs::write(
        sb.config(),
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n[limits]\napproval_required = []\n",
    )
    .unwrap();
    sb.agent(
        "boss",
        "agents: [scribe]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: scribe, mission: "write the report"}
  - answer: "{{ results[0].result }} (cached: {{ (results[0].cached or false) | tojson }})"
"#,
    )
    .agent(
        "scribe",
        &format!("tools: [write_file]\n{scribe_front}"),
        r#"
turns:
  - tool_calls:
      - tool: write_file
        args: {path: report.md, content: "the report"}
  - answer: "report written"
"#,
    );
}

fn report_in(sb: &Sandbox, out: &serde_json::Value) -> bool {
    let root = out["session"].as_str().unwrap();
    sb.data()
        .join("workspaces")
        .join(root)
        .join("report.md")
        .exists()
}

#[test]
fn a_child_with_side_effects_runs_in_every_tree_unless_its_file_caches_it() {
    let sb = Sandbox::new();
    boss_and_scribe(&sb, "");
    for mission in ["tree one", "tree two"] {
        let out = run_json(&sb, &["run", "--agent", "boss", "--json", mission]);
        assert_eq!(out["answer"], "report written (cached: false)", "{out}");
        assert!(
            report_in(&sb, &out),
            "no report in the workspace of {mission}: {out}"
        );
        assert_eq!(count(&out, "cache_hits"), 0, "{out}");
    }
    // The boss starts the scribe, so it is not cached either (a root hit would skip the
    // report as well).
    let again = run_json(&sb, &["run", "--agent", "boss", "--json", "tree two"]);
    assert_eq!(again["tree"].as_array().unwrap().len(), 2, "{again}");
    assert!(report_in(&sb, &again));

    // `skein agents check` says which agents are cached, and why.
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["agents", "check"]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    let line = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("no line for {name}: {text}"))
            .to_string()
    };
    assert!(
        line("scribe").contains("not cached: it may call `write_file`"),
        "{text}"
    );
    assert!(
        line("boss").contains("not cached: it may start `scribe`, which may call `write_file`"),
        "{text}"
    );
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["agents", "check", "--json"]);
    let v = json_of(&run_ok(c));
    assert_eq!(v["caching"]["scribe"]["cached"], false, "{v}");
    assert_eq!(v["caching"]["boss"]["cached"], false, "{v}");

    // An explicit `cache:` in its file caches it all the same (and the hit skips the
    // write: the operator's choice).
    let sb = Sandbox::new();
    boss_and_scribe(&sb, "cache: true\n");
    let one = run_json(&sb, &["run", "--agent", "boss", "--json", "tree one"]);
    assert_eq!(one["answer"], "report written (cached: false)");
    let two = run_json(&sb, &["run", "--agent", "boss", "--json", "tree two"]);
    assert_eq!(two["answer"], "report written (cached: true)", "{two}");
    assert!(!report_in(&sb, &two));
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["agents", "check"]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    assert!(text.contains("cached: `cache: true` in its file"), "{text}");
    // (Replayed under this sandbox's limits: `write_file` needs no approval here.)
    for out in [&one, &two] {
        let mut c = skein(&sb.config(), &sb.data());
        c.args([
            "replay",
            out["session"].as_str().unwrap(),
            "--verify",
            "--tree",
        ]);
        run_ok(c);
    }
}

#[test]
fn read_only_agents_stay_cached_by_default() {
    let sb = Sandbox::new();
    boss_and_worker(&sb, "tools: [read_file, list_dir]\n");
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["agents", "check"]);
    let text = String::from_utf8(run_ok(c).stdout).unwrap();
    for name in ["boss", "worker"] {
        let l = text
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap();
        assert!(
            l.contains("cached: nothing it may do has side effects"),
            "{l}"
        );
    }
    run_json(&sb, &["run", "--agent", "boss", "--json", "one"]);
    let two = run_json(&sb, &["run", "--agent", "boss", "--json", "two"]);
    assert_eq!(
        two["answer"],
        "summary of summarise the topic (cached: true)"
    );
}
