//! Human in the loop, end to end on the embedded backend: questions that bubble up,
//! answers from outside, approvals, and token safety.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;
use skein_core::SessionId;
use skein_sled::SledStore;

const HELPER: &str = r#"
turns:
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{key: version, question: "Which Python version?"}]
          context: "setting up the project"
          proposed_defaults: {version: "3.12"}
  - answer: "helper used {{ results[0].answers.version }}"
"#;

/// The root delegates to a helper that asks; the question bubbles up; the root asks the
/// person itself, then resumes the helper with the answer.
fn bubbling(sb: &Sandbox) {
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
        args:
          questions: [{key: version, question: "{{ results[0].need_user_input.questions[0].question }}"}]
          context: "my helper asks: {{ results[0].need_user_input.context }}"
  - tool_calls:
      - tool: call_agent
        args:
          resume_token: "{{ all_results[0].resume_token }}"
          answers: {version: "{{ results[0].answers.version }}"}
  - answer: "{{ results[0].result }}"
"#,
    )
    .agent("helper", "tools: [ask_user]\n", HELPER);
}

fn run(sb: &Sandbox, args: &[&str]) -> std::process::Output {
    skein(&sb.config(), &sb.data()).args(args).output().unwrap()
}

fn inbox(sb: &Sandbox) -> Vec<serde_json::Value> {
    let out = run(sb, &["inbox", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout).unwrap()
}

/// Every log of every tree, as text, to show that a refusal changed nothing.
fn all_logs(sb: &Sandbox) -> String {
    let out = run(sb, &["sessions", "--json"]);
    let roots: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut all = String::new();
    for r in roots {
        let tree = run(sb, &["tree", r["session"].as_str().unwrap(), "--json"]);
        let tree: serde_json::Value = serde_json::from_slice(&tree.stdout).unwrap();
        for s in tree["sessions"].as_array().unwrap() {
            let ev = run(sb, &["events", s["session"].as_str().unwrap(), "--json"]);
            all.push_str(&String::from_utf8_lossy(&ev.stdout));
        }
    }
    all
}

fn no_jobs(sb: &Sandbox) -> u64 {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = SledStore::open(&sb.data(), &sb.data().join("workspaces")).unwrap();
        store.backend().jobs.depth("default").await.unwrap()
    })
}

/// The token of `session`'s first open question, derived as the runtime derives it: from
/// its log and the data directory's secret.
fn token_of(sb: &Sandbox, session: &str) -> String {
    let secret = std::fs::read(sb.data().join("token.secret")).unwrap();
    let secret = skein_runtime::hitl::Secret(secret.trim_ascii().to_vec());
    let id = SessionId::parse(session).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = SledStore::open(&sb.data(), &sb.data().join("workspaces")).unwrap();
        let records = store.backend().log.read(&id, 1).await.unwrap();
        let f = skein_runtime::inspect::fold_records(&id, &records).unwrap();
        let p = f
            .state
            .pauses
            .pending_inputs
            .first()
            .unwrap_or_else(|| panic!("{session} asks nothing"));
        skein_runtime::hitl::input_token(&secret, &id, p)
    })
}

/// The stored bytes of every record of every session of every tree.
fn raw_records(sb: &Sandbox) -> Vec<Vec<u8>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = SledStore::open(&sb.data(), &sb.data().join("workspaces")).unwrap();
        let b = store.backend();
        let mut out = vec![];
        for root in b.log.roots().await.unwrap() {
            for id in b.log.tree(&root).await.unwrap() {
                for r in b.log.read(&id, 1).await.unwrap() {
                    out.push(r.bytes);
                }
            }
        }
        out
    })
}

fn stdout_of(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_child_question_bubbles_up_pauses_the_root_and_an_answer_finishes_the_tree() {
    let sb = Sandbox::new();
    bubbling(&sb);
    let out = run(&sb, &["run", "--agent", "boss", "--json", "set up"]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "paused: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let paused: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(paused["status"], "awaiting_input");
    let root = paused["session"].as_str().unwrap().to_string();
    // The helper paused too, and its question reached its parent, not the person.
    let tree = paused["tree"].as_array().unwrap();
    assert_eq!(tree[1]["status"], "awaiting_input");
    assert_eq!(
        no_jobs(&sb),
        0,
        "no job is held or waiting while the tree waits"
    );

    let items = inbox(&sb);
    assert_eq!(
        items.len(),
        1,
        "only the root's question is for the person: {items:?}"
    );
    // `run` reports what waits from its own read of the tree: the same as the inbox.
    assert_eq!(paused["waiting"], serde_json::json!(items), "{paused}");
    assert_eq!(items[0]["session"], root.as_str());
    assert_eq!(items[0]["questions"][0]["key"], "version");
    assert_eq!(
        items[0]["questions"][0]["question"],
        "Which Python version?"
    );
    assert_eq!(
        items[0]["context"],
        "my helper asks: setting up the project"
    );
    let token = items[0]["token"].as_str().unwrap().to_string();

    // Missing keys are reported, not guessed from the proposed defaults.
    let out = run(&sb, &["answer", &token, "--json", "{}"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("missing answers: `version` (Which Python version?)"));
    // Keys no question asked for are refused with the expected keys named, even beside a
    // complete answer, and nothing is recorded.
    for (answers, unasked) in [
        (r#"{"other":"1"}"#, "`other`"),
        (r#"{"version":"3.11","__proto__":{"x":1}}"#, "`__proto__`"),
    ] {
        let out = run(&sb, &["answer", &token, "--json", answers]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                "answers for questions that were not asked: {unasked}"
            )) && err.contains("the questions expect `version`"),
            "{err}"
        );
    }

    let out = run(&sb, &["answer", &token, "--set", "version=3.11"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().next(),
        Some("helper used 3.11")
    );
    assert!(inbox(&sb).is_empty());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(&root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
}

#[test]
fn two_children_waiting_at_once_each_get_their_own_answer_in_either_order() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [asker]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: asker, mission: "left", inputs: {key: a}}
      - tool: call_agent
        args: {agent: asker, mission: "right", inputs: {key: b}}
  - tool_calls:
      - tool: call_agent
        args: {resume_token: "{{ results[1].resume_token }}", answers: {b: "B-answer"}}
      - tool: call_agent
        args: {resume_token: "{{ results[0].resume_token }}", answers: {a: "A-answer"}}
  - answer: "{{ results[0].result }} | {{ results[1].result }}"
"#,
    )
    .agent(
        "asker",
        "tools: [ask_user]\n",
        r#"
turns:
  - tool_calls:
      - tool: ask_user
        args: {questions: [{key: "{{ inputs.key }}", question: "value for {{ mission }}?"}]}
  - answer: "{{ mission }} got {{ results[0].answers[inputs.key] }}"
"#,
    );
    let out = run(&sb, &["run", "--agent", "boss", "--json", "both"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["answer"], "right got B-answer | left got A-answer", "{v}");
    // Each child was asked once and resumed once.
    let id = v["session"].as_str().unwrap();
    for child in ["asker-1", "asker-2"] {
        let ev = run(&sb, &["events", &format!("{id}/{child}")]);
        let text = String::from_utf8_lossy(&ev.stdout);
        assert_eq!(text.matches("InputRequested").count(), 1, "{text}");
        assert_eq!(text.matches("InputProvided").count(), 1, "{text}");
    }
    audit_all(&sb.data(), &sb.dir.path().join("agents"));
}

#[test]
fn kill9_right_after_the_answer_is_recorded_still_resumes() {
    let sb = Sandbox::new();
    bubbling(&sb);
    // The helper takes its time after the answer, so the kill lands mid-tree.
    std::fs::write(
        sb.dir.path().join("scripts/helper.yaml"),
        HELPER.replace("turns:", "latency_ms: 400\nturns:"),
    )
    .unwrap();
    let out = run(&sb, &["run", "--agent", "boss", "--json", "set up"]);
    assert_eq!(out.status.code(), Some(3));
    let root = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["session"]
        .as_str()
        .unwrap()
        .to_string();
    let token = inbox(&sb)[0]["token"].as_str().unwrap().to_string();
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["answer", &token, "--set", "version=3.10"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        if line.unwrap().starts_with("recorded for") {
            break;
        }
    }
    std::process::Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    let out = run(&sb, &["resume", &root, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["answer"], "helper used 3.10");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(&root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
}

#[test]
fn bad_tokens_are_refused_with_their_reason_and_change_no_log() {
    let sb = Sandbox::new();
    bubbling(&sb);
    let out = run(&sb, &["run", "--agent", "boss", "--json", "set up"]);
    assert_eq!(out.status.code(), Some(3));
    let paused: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let root = paused["session"].as_str().unwrap().to_string();
    let token = inbox(&sb)[0]["token"].as_str().unwrap().to_string();
    // The helper's own token (shown to the parent model in its tool result).
    let child_token = token_of(&sb, &format!("{root}.helper-1"));

    let before = all_logs(&sb);
    let mut forged = token.clone();
    let last = forged.pop().unwrap();
    forged.push(if last == '0' { '1' } else { '0' });
    let cases = [
        (forged, "forged token"),
        ("skt1.nothex.00".to_string(), "malformed token"),
        ("hello".to_string(), "malformed token"),
        (child_token, "belongs to sub-agent"),
    ];
    for (t, reason) in &cases {
        let out = run(&sb, &["answer", t, "--set", "version=1"]);
        assert!(!out.status.success(), "{t} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(reason), "{t}: {err}");
        let out = run(&sb, &["approve", t]);
        assert!(!out.status.success());
    }
    assert_eq!(all_logs(&sb), before, "a refused token changed a log");

    // A good answer, then the same token again: reused.
    let out = run(&sb, &["answer", &token, "--set", "version=3.9"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = all_logs(&sb);
    let out = run(&sb, &["answer", &token, "--set", "version=2.7"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("reused token"));
    assert_eq!(all_logs(&sb), before);
}

#[test]
fn stale_tokens_of_a_session_that_moved_on_are_refused() {
    let sb = Sandbox::new();
    sb.agent(
        "twice",
        "tools: [ask_user]\n",
        r#"
turns:
  - tool_calls:
      - tool: ask_user
        args: {questions: ["first?"]}
  - tool_calls:
      - tool: ask_user
        args: {questions: ["second?"]}
  - answer: "{{ all_results | map(attribute='answers') | map(attribute='q1') | join(',') }}"
"#,
    );
    let out = run(&sb, &["run", "--agent", "twice", "--json", "ask twice"]);
    assert_eq!(out.status.code(), Some(3));
    let first = inbox(&sb)[0]["token"].as_str().unwrap().to_string();
    let out = run(&sb, &["answer", &first, "--set", "q1=one"]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "paused again on the second question"
    );
    let second = inbox(&sb)[0]["token"].as_str().unwrap().to_string();
    assert_ne!(first, second);
    let before = all_logs(&sb);
    let out = run(&sb, &["answer", &first, "--set", "q1=late"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("reused token") || err.contains("stale token"),
        "{err}"
    );
    assert_eq!(all_logs(&sb), before);
    let out = run(&sb, &["answer", &second, "--json", "{\"q1\": \"two\"}"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().next(),
        Some("one,two")
    );
}

fn writer_agent(sb: &Sandbox) {
    sb.agent(
        "scribe",
        "tools: [write_file, read_file]\n",
        r#"
turns:
  - tool_calls:
      - tool: write_file
        args: {path: "notes.txt", content: "approved content"}
  - answer: "{{ results[0] }}"
"#,
    );
}

#[test]
fn an_approved_tool_runs_and_a_denied_one_never_does() {
    for approve in [true, false] {
        let sb = Sandbox::new();
        writer_agent(&sb);
        let out = run(&sb, &["run", "--agent", "scribe", "--json", "write notes"]);
        assert_eq!(out.status.code(), Some(3));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["status"], "awaiting_approval");
        let root = v["session"].as_str().unwrap().to_string();
        let items = inbox(&sb);
        assert_eq!(items.len(), 1);
        assert_eq!(v["waiting"], serde_json::json!(items), "{v}");
        assert_eq!(items[0]["kind"], "approval");
        assert_eq!(items[0]["tool"], "write_file");
        assert!(items[0]["preview"].as_str().unwrap().contains("notes.txt"));
        let token = items[0]["token"].as_str().unwrap().to_string();
        let file = sb.data().join("workspaces").join(&root).join("notes.txt");
        assert!(!file.exists(), "nothing ran before the decision");
        let out = if approve {
            run(&sb, &["approve", &token])
        } else {
            run(&sb, &["deny", &token, "--reason", "not today"])
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let answer = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap()
            .to_string();
        if approve {
            assert_eq!(std::fs::read_to_string(&file).unwrap(), "approved content");
            assert!(answer.contains("wrote"), "{answer}");
        } else {
            assert!(!file.exists(), "a denied tool ran");
            assert!(
                answer.contains("`write_file` was denied") && answer.contains("not today"),
                "{answer}"
            );
        }
    }
}

#[test]
fn a_finished_chat_child_answers_a_follow_up_and_its_log_simply_continues() {
    let sb = follow_ups();
    let out = run(&sb, &["run", "--agent", "boss", "--json", "estimate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let answer = v["answer"].as_str().unwrap();
    follow_ups_answered(answer);
    let root = v["session"].as_str().unwrap().to_string();
    // The expert's log continued: question, a second model turn, a second answer.
    let ev = run(&sb, &["events", &format!("{root}/expert-1")]);
    let text = String::from_utf8_lossy(&ev.stdout);
    assert_eq!(text.matches("ClarificationRequested").count(), 1, "{text}");
    assert_eq!(text.matches("Completed").count(), 2, "{text}");
    let st = run(
        &sb,
        &["replay", &format!("{root}/expert-1"), "--at", "4", "--full"],
    );
    let st = String::from_utf8_lossy(&st.stdout);
    assert!(
        st.contains(&format!("## CLARIFICATION REQUEST FROM {root}")),
        "{st}"
    );
    assert!(st.contains("and the error bars?"), "{st}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(&root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
}

#[test]
fn a_bubbled_question_leaves_no_usable_token_in_any_log_or_audit_export() {
    let sb = Sandbox::new();
    bubbling(&sb);
    let out = run(&sb, &["run", "--agent", "boss", "--json", "set up"]);
    assert_eq!(out.status.code(), Some(3));
    let root = json_of(&out)["session"].as_str().unwrap().to_string();
    let child = format!("{root}.helper-1");
    let child_token = token_of(&sb, &child);
    let root_token = inbox(&sb)[0]["token"].as_str().unwrap().to_string();
    let no_token_anywhere = |when: &str| {
        let logs = all_logs(&sb);
        for t in [&child_token, &root_token] {
            assert!(
                !logs.contains(t.as_str()),
                "{when}: a log holds a token:\n{logs}"
            );
            let export = stdout_of(&run(&sb, &["audit", "export", &root]));
            assert!(
                !export.contains(t.as_str()),
                "{when}: the audit export holds a token"
            );
            for r in raw_records(&sb) {
                assert!(
                    !r.windows(t.len()).any(|w| w == t.as_bytes()),
                    "{when}: a stored record holds a token"
                );
            }
        }
    };
    no_token_anywhere("paused");
    // The root's log keeps the token's id; the parent's model was shown the token itself
    // (the replayed transcript shows the reference it stands for).
    let ev = stdout_of(&run(&sb, &["events", &root, "--json"]));
    let settled = ev
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["kind"] == "ChildSettled")
        .expect("ChildSettled");
    let outcome = &settled["body"]["data"]["outcome"];
    assert_eq!(outcome["status"], "needs_input", "{settled}");
    assert!(outcome.get("token").is_none(), "{settled}");
    assert_eq!(outcome["token_id"].as_str().unwrap().len(), 24, "{settled}");

    // The person answers the root; the root's model resumes its helper with the token it
    // was shown, and the log records the reference in its place.
    let out = run(&sb, &["answer", &root_token, "--set", "version=3.11"]);
    assert_eq!(
        stdout_of(&out).lines().next(),
        Some("helper used 3.11"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    no_token_anywhere("finished");
    let ev = stdout_of(&run(&sb, &["events", &root, "--json"]));
    assert!(ev.contains("\"resume_token\":\"skr1."), "{ev}");
    let verified = run(&sb, &["replay", &root, "--verify", "--tree"]);
    assert!(verified.status.success(), "{}", stdout_of(&verified));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(&root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
}

#[test]
fn a_reference_the_model_was_not_given_resumes_nothing() {
    // The boss makes up a reference to its helper's question (the right session, another
    // token id): refused as a tool error, and the helper's log is untouched.
    let sb = Sandbox::new();
    let made_up = skein_core::token::reference(&skein_core::token::Claims {
        session: SessionId::parse("made-up.helper-1").unwrap(),
        seq: 3,
        nonce: "0".repeat(24),
        kind: skein_core::token::TokenKind::Input,
    });
    sb.agent(
        "boss",
        "agents: [helper]\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {{agent: helper, mission: "set up the project"}}
  - tool_calls:
      - tool: call_agent
        args: {{resume_token: "{made_up}", answers: {{version: "1"}}}}
  - answer: "{{{{ results[0] }}}}"
"#
        ),
    )
    .agent("helper", "tools: [ask_user]\n", HELPER);
    let out = run(
        &sb,
        &["run", "--agent", "boss", "--id", "made-up", "--json", "go"],
    );
    let v = json_of(&out);
    assert_eq!(
        v["answer"],
        "call_agent: resume_token refused: it is not a token this session was given",
        "{v}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = stdout_of(&run(&sb, &["events", "made-up/helper-1"]));
    assert!(!ev.contains("InputProvided"), "{ev}");
    assert!(ev.contains("InputRequested"), "{ev}");
}

/// A boss whose delegations wait for a person's approval.
fn gated_boss(sb: &Sandbox) {
    sb.agent(
        "boss",
        "agents: [helper]\nrequires_approval: [call_agent]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: helper, mission: "count the files"}
  - answer: "{{ results[0] | tojson }}"
"#,
    )
    .agent(
        "helper",
        "",
        "turns:\n  - answer: \"helper did {{ mission }}\"\n",
    );
}

#[test]
fn an_approved_delegation_runs_its_child_and_a_denied_one_is_reported_to_the_model() {
    for approve in [true, false] {
        let sb = Sandbox::new();
        gated_boss(&sb);
        let out = run(&sb, &["run", "--agent", "boss", "--json", "delegate"]);
        assert_eq!(
            out.status.code(),
            Some(3),
            "{}",
            stdout_of(&run(&sb, &["sessions"]))
        );
        let v = json_of(&out);
        assert_eq!(v["status"], "awaiting_approval", "{v}");
        assert_eq!(
            v["tree"].as_array().unwrap().len(),
            1,
            "nothing started yet: {v}"
        );
        let root = v["session"].as_str().unwrap().to_string();
        let items = inbox(&sb);
        assert_eq!(items.len(), 1, "{items:?}");
        assert_eq!(items[0]["tool"], "call_agent");
        assert!(items[0]["preview"]
            .as_str()
            .unwrap()
            .contains("count the files"));
        let token = items[0]["token"].as_str().unwrap().to_string();
        let out = if approve {
            run(&sb, &["approve", &token])
        } else {
            run(&sb, &["deny", &token, "--reason", "not now"])
        };
        stdout_of(&out);
        let tree = json_of(&run_ok({
            let mut c = skein(&sb.config(), &sb.data());
            c.args(["tree", &root, "--json"]);
            c
        }));
        let sessions = tree["sessions"].as_array().unwrap();
        assert_eq!(sessions[0]["status"], "completed", "{tree}");
        let answer = sessions[0]["answer"].as_str().unwrap();
        let ev = stdout_of(&run(&sb, &["events", &root]));
        if approve {
            // A delegation like any other: Delegated in the parent, a child that ran.
            assert!(answer.contains("helper did count the files"), "{answer}");
            assert!(answer.contains("\"success\":true"), "{answer}");
            assert_eq!(sessions.len(), 2, "{tree}");
            assert_eq!(sessions[1]["agent"], "helper");
            assert_eq!(sessions[1]["status"], "completed");
            assert!(
                ev.contains("Delegated") && ev.contains("ChildSettled"),
                "{ev}"
            );
        } else {
            assert!(
                answer.contains("`call_agent` was denied") && answer.contains("not now"),
                "{answer}"
            );
            assert_eq!(
                sessions.len(),
                1,
                "a denied delegation started a child: {tree}"
            );
            assert!(!ev.contains("Delegated"), "{ev}");
        }
        let verified = run(&sb, &["replay", &root, "--verify", "--tree"]);
        assert!(verified.status.success(), "{}", stdout_of(&verified));
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(audit_tree(
            &sb.data(),
            &SessionId::parse(&root).unwrap(),
            &sb.dir.path().join("agents"),
        ));
    }
}

/// The kinds of a session's events, in order.
fn kinds(sb: &Sandbox, session: &str) -> Vec<String> {
    stdout_of(&run(sb, &["events", session, "--json"]))
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["kind"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn answer_no_run_keeps_its_tree_paused_while_another_tree_is_run() {
    let sb = Sandbox::new();
    writer_agent(&sb);
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [\"which?\"]}\n  - answer: \"got {{ results[0].answers.q1 }}\"\n",
    );
    let a = run(
        &sb,
        &["run", "--agent", "asker", "--id", "tree-a", "--json", "ask"],
    );
    assert_eq!(a.status.code(), Some(3));
    let b = run(
        &sb,
        &[
            "run", "--agent", "scribe", "--id", "tree-b", "--json", "write",
        ],
    );
    assert_eq!(b.status.code(), Some(3));
    let items = inbox(&sb);
    let token_of = |session: &str| {
        items
            .iter()
            .find(|i| i["session"] == session)
            .and_then(|i| i["token"].as_str())
            .unwrap()
            .to_string()
    };
    let (ta, tb) = (token_of("tree-a"), token_of("tree-b"));

    let out = run(&sb, &["answer", &ta, "--set", "q1=blue", "--no-run"]);
    assert_eq!(stdout_of(&out).trim(), "recorded for tree-a");
    let recorded = kinds(&sb, "tree-a");
    assert_eq!(recorded.last().map(String::as_str), Some("InputProvided"));

    // Running tree B runs tree B only.
    let out = run(&sb, &["deny", &tb, "--reason", "no"]);
    assert!(stdout_of(&out).contains("`write_file` was denied"));
    assert_eq!(kinds(&sb, "tree-a"), recorded, "tree A ran with tree B");
    let out = run(
        &sb,
        &[
            "run", "--agent", "asker", "--id", "tree-c", "--json", "again",
        ],
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(kinds(&sb, "tree-a"), recorded, "tree A ran with tree C");

    // Until it is resumed itself.
    let out = run(&sb, &["resume", "tree-a"]);
    assert_eq!(stdout_of(&out).lines().next(), Some("got blue"));
}

#[test]
fn answers_and_reasons_over_the_limit_are_refused_with_their_size_and_nothing_is_written() {
    let sb = Sandbox::new();
    writer_agent(&sb);
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [\"which?\"]}\n  - answer: \"got {{ results[0].answers.q1 | length }} bytes\"\n",
    );
    assert_eq!(
        run(
            &sb,
            &["run", "--agent", "asker", "--id", "q", "--json", "ask"]
        )
        .status
        .code(),
        Some(3)
    );
    assert_eq!(
        run(
            &sb,
            &["run", "--agent", "scribe", "--id", "w", "--json", "write"]
        )
        .status
        .code(),
        Some(3)
    );
    let items = inbox(&sb);
    let token = |s: &str| {
        items
            .iter()
            .find(|i| i["session"] == s)
            .and_then(|i| i["token"].as_str())
            .unwrap()
            .to_string()
    };
    let (question, approval) = (token("q"), token("w"));
    let before = all_logs(&sb);
    let big = "x".repeat(70_000);
    let set = format!("q1={big}");
    let json = serde_json::json!({ "q1": big }).to_string();
    let cases: [Vec<&str>; 4] = [
        vec!["answer", &question, "--set", &set],
        vec!["answer", &question, "--json", &json],
        vec!["deny", &approval, "--reason", &big],
        vec!["approve", &approval, "--reason", &big],
    ];
    for args in &cases {
        let out = run(&sb, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{} accepted", args[0]);
        assert!(
            err.contains("bytes; at most 65536 bytes are accepted")
                && (err.contains("answer is 70") || err.contains("reason is 70000 bytes")),
            "{}: {err}",
            args[0]
        );
        assert_eq!(all_logs(&sb), before, "{} wrote", args[0]);
    }
    // At the limit is fine.
    let fits = format!("q1={}", "y".repeat(60_000));
    let out = run(&sb, &["answer", &question, "--set", &fits]);
    assert_eq!(stdout_of(&out).lines().next(), Some("got 60000 bytes"));
}

#[test]
fn an_empty_or_short_token_secret_file_is_refused_and_a_token_forged_with_an_empty_key_answers_nothing(
) {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [\"which?\"]}\n  - answer: \"got {{ results[0].answers.q1 }}\"\n",
    );
    let out = run(
        &sb,
        &["run", "--agent", "asker", "--id", "sec", "--json", "ask"],
    );
    assert_eq!(out.status.code(), Some(3));
    let genuine = inbox(&sb)[0]["token"].as_str().unwrap().to_string();
    let claims = skein_core::token::peek(&genuine).unwrap();
    let forged = skein_core::token::sign(b"", &claims);
    assert_ne!(forged, genuine);
    let secret_file = sb.data().join("token.secret");
    let kept = std::fs::read(&secret_file).unwrap();
    let before = all_logs(&sb);
    for bad in [&b""[..], b"  \n", b"fifteen-bytes!!"] {
        std::fs::write(&secret_file, bad).unwrap();
        for args in [
            vec!["answer", forged.as_str(), "--set", "q1=forged"],
            vec!["inbox"],
        ] {
            let out = run(&sb, &args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{args:?} ran with secret {bad:?}");
            assert!(
                err.contains("token.secret")
                    && err.contains(&format!("holds {} bytes", bad.trim_ascii().len()))
                    && err.contains("at least 16"),
                "{err}"
            );
        }
        assert_eq!(
            std::fs::read(&secret_file).unwrap(),
            bad,
            "the file was replaced"
        );
    }
    assert_eq!(
        all_logs(&sb),
        before,
        "a refused secret let something through"
    );
    std::fs::write(&secret_file, &kept).unwrap();
    let out = run(&sb, &["answer", &forged, "--set", "q1=forged"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("forged token"));
    assert_eq!(all_logs(&sb), before);
    let out = run(&sb, &["answer", &genuine, "--set", "q1=real"]);
    assert_eq!(stdout_of(&out).lines().next(), Some("got real"));
}

#[test]
fn after_a_follow_up_question_every_token_is_counted_once() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [expert]\ntools: [ask_clarification]\n",
        r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: expert, mission: "estimate the load"}
  - tool_calls:
      - tool: ask_clarification
        args: {session_id: "{{ results[0].session_id }}", question: "and the error bars?"}
  - answer: "{{ results[0].result }}"
"#,
    )
    .agent(
        "expert",
        "chat: true\n",
        "turns:\n  - answer: \"the load is 42 after a long and careful estimate\"\n  - answer: \"error bars are plus or minus 3\"\n",
    );
    let out = run(&sb, &["run", "--agent", "boss", "--json", "estimate"]);
    let v = json_of(&out);
    assert_eq!(v["answer"], "error bars are plus or minus 3", "{v}");
    let tree = v["tree"].as_array().unwrap();
    let (boss, expert) = (&tree[0], &tree[1]);
    for k in ["input_tokens", "output_tokens"] {
        let own = |s: &serde_json::Value| s["usage"][k].as_u64().unwrap();
        let total = |s: &serde_json::Value| s["usage_total"][k].as_u64().unwrap();
        assert!(own(expert) > 0, "{expert}");
        assert_eq!(total(expert), own(expert), "{expert}");
        // The root's total is its own usage plus the expert's whole usage, once.
        assert_eq!(total(boss), own(boss) + own(expert), "{k}: {v}");
        assert_eq!(v["summary"]["usage"][k], total(boss), "{k}: {v}");
    }
    // What the root's budget sees is that total: a budget of exactly that many tokens
    // is enough for the whole tree.
    let used = tree[0]["usage_total"]["input_tokens"].as_u64().unwrap()
        + tree[0]["usage_total"]["output_tokens"].as_u64().unwrap();
    let root = v["session"].as_str().unwrap();
    let ev = stdout_of(&run(&sb, &["events", root, "--json"]));
    let completed = ev
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|e| e["kind"] == "Completed")
        .unwrap();
    let u = &completed["body"]["data"]["usage_total"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap(),
        used
    );
}

/// The inboxes read the open roots only: a question and an approval still waiting are
/// listed by `skein inbox` and the MCP tool, while a tree that asked and was then
/// cancelled, and one that finished, are not.
#[test]
fn the_inbox_lists_what_open_trees_wait_for_and_nothing_of_an_ended_tree() {
    let sb = Sandbox::new();
    writer_agent(&sb);
    sb.agent("helper", "tools: [ask_user]\n", HELPER).agent(
        "quick",
        "",
        "turns:\n  - answer: \"done\"\n",
    );
    for (agent, id) in [
        ("scribe", "approval"),
        ("helper", "asks"),
        ("helper", "ended"),
    ] {
        let out = run(&sb, &["run", "--agent", agent, "--id", id, "--json", "go"]);
        assert_eq!(
            out.status.code(),
            Some(3),
            "{id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    stdout_of(&run(
        &sb,
        &["run", "--agent", "quick", "--id", "finished", "go"],
    ));
    let before: Vec<String> = inbox(&sb)
        .iter()
        .map(|i| i["session"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(before, ["approval", "asks", "ended"], "{before:?}");
    stdout_of(&run(
        &sb,
        &["cancel", "ended", "--reason", "no longer needed"],
    ));
    for (via, items) in [
        ("skein inbox", inbox(&sb)),
        (
            "list_inbox",
            mcp_list_inbox(skein(&sb.config(), &sb.data())),
        ),
    ] {
        let listed: Vec<(String, String)> = items
            .iter()
            .map(|i| {
                (
                    i["session"].as_str().unwrap().to_string(),
                    i["kind"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            listed,
            [
                ("approval".to_string(), "approval".to_string()),
                ("asks".to_string(), "question".to_string())
            ],
            "{via}: {items:?}"
        );
    }
}
