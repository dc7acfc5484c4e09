//! Where features meet, with the real binary on both backends: a question asked by a
//! handoff's target, a route's destination or a team's member reaches the inbox and its
//! answer runs the tree on; two recursive agents delegating one mission to each other end;
//! a child run under narrowed tools never answers a call with its full tools from the
//! cache; a handoff chain longer than the depth limit runs; a cancelled session's
//! tokens no longer answer; and an approval asked by a child two trees share (single-flight)
//! is in both trees' inboxes. Every tree is checked with `replay --tree --verify`.

mod common;

use common::world::*;
use common::*;

const ASKS: &str = r#"turns:
  - tool_calls:
      - tool: ask_user
        args: {questions: [{key: year, question: "Which year?"}]}
  - answer: "clerk used {{ results[0].answers.year }}"
"#;

fn pattern_askers() -> Sandbox {
    let sb = Sandbox::new();
    sb.agent(
        "front",
        "handoff: clerk\n",
        "turns:\n  - answer: \"front's note\"\n",
    )
    .agent(
        "desk",
        "router: {destinations: [clerk]}\n",
        "turns:\n  - tool_calls:\n      - tool: handoff_to\n        args: {agent: clerk}\n",
    )
    .agent(
        "crew",
        "team: {members: [clerk], supervisor: lead}\n",
        "turns:\n  - answer: \"unused\"\n",
    )
    .agent(
        "lead",
        "",
        "turns:\n  - answer: \"lead heard: {{ user_messages | join(' / ') }}\"\n",
    )
    .agent("clerk", "tools: [ask_user]\n", ASKS);
    sb
}

#[test]
fn a_question_of_a_handoff_target_a_route_destination_or_a_team_member_reaches_the_inbox() {
    both(pattern_askers, |w| {
        for (agent, expect) in [
            ("front", "clerk used 2024"),
            ("desk", "clerk used 2024"),
            ("crew", "lead heard"),
        ] {
            let id = format!("ask-{agent}");
            let status = w.start(agent, &id, "file the report");
            assert_eq!(status, "waiting", "{}: {agent}: {}", w.name(), w.tree(&id));
            let items = w.inbox(&id);
            assert_eq!(items.len(), 1, "{}: {agent}: {items:?}", w.name());
            assert_eq!(items[0]["kind"], "question");
            assert_eq!(items[0]["agent"], "clerk");
            let token = items[0]["token"].as_str().unwrap().to_string();
            let (out, status) = w.act(&id, &["answer", &token, "--set", "year=2024"]);
            assert!(
                out.status.success(),
                "{}: {agent}: {}",
                w.name(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(
                status,
                "completed",
                "{}: {agent}: {}",
                w.name(),
                w.tree(&id)
            );
            let answer = w.answer_of(&id);
            assert!(answer.contains(expect), "{}: {agent}: {answer}", w.name());
            if agent == "crew" {
                assert!(answer.contains("clerk used 2024"), "{answer}");
            }
            w.verify(&id);
        }
    });
}

#[test]
fn two_recursive_agents_delegating_one_mission_to_each_other_end() {
    let sandbox = || {
        let sb = Sandbox::new();
        let script = |other: &str| {
            format!(
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {{agent: {other}, mission: \"{{{{ mission }}}}\"}}\n  - answer: \"{{{{ agent }}}} < {{{{ results[0].result or results[0] }}}}\"\n"
            )
        };
        sb.agent("orch", "agents: [ping]\n", &script("ping"))
            .agent("ping", "recursive: true\nagents: [pong]\n", &script("pong"))
            .agent("pong", "recursive: true\nagents: [ping]\n", &script("ping"));
        sb
    };
    both(sandbox, |w| {
        let status = w.start("orch", "recursive", "the same mission");
        assert_eq!(status, "completed", "{}: {}", w.name(), w.tree("recursive"));
        // The depth limit (3) is the backstop: the deepest call is refused for it.
        let answer = w.answer_of("recursive");
        assert!(answer.contains("depth limit"), "{}: {answer}", w.name());
        let sessions = w.tree("recursive")["sessions"].as_array().unwrap().len();
        assert_eq!(sessions, 4, "{}: orch, ping, pong, ping", w.name());
        w.verify("recursive");
    });
}

#[test]
fn a_child_run_under_narrowed_tools_never_answers_a_call_with_its_full_tools() {
    let sandbox = || {
        let sb = Sandbox::new();
        let call = |narrow: &str| {
            format!(
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {{agent: reader, mission: \"read the notes\"{narrow}}}\n  - answer: \"{{{{ results[0].result }}}}\"\n"
            )
        };
        sb.agent("narrow", "agents: [reader]\n", &call(", allowed_tools: [list_dir]"))
            .agent("full", "agents: [reader]\n", &call(""))
            .agent(
                "reader",
                "tools: [list_dir, read_file]\n",
                "turns:\n  - tool_calls:\n      - tool: read_file\n        args: {path: notes.txt}\n  - answer: \"reader saw: {{ results[0] }}\"\n",
            );
        sb
    };
    both(sandbox, |w| {
        assert_eq!(w.start("narrow", "narrow-1", "go"), "completed");
        let narrowed = w.answer_of("narrow-1");
        assert!(narrowed.contains("not allowed"), "{}: {narrowed}", w.name());
        assert_eq!(w.start("full", "full-1", "go"), "completed");
        let full = w.answer_of("full-1");
        assert!(
            !full.contains("not allowed"),
            "{}: a narrowed run answered: {full}",
            w.name()
        );
        let t = w.tree("full-1");
        assert_eq!(t["sessions"][0]["cache_hits"], 0, "{}: {t}", w.name());
        // The same call again (from a root that is not itself a hit) is a hit, and the
        // tree shows what its key covered.
        assert_eq!(w.start("full", "full-2", "go again"), "completed");
        assert_eq!(w.answer_of("full-2"), full);
        let t = w.tree("full-2");
        let hit = &t["sessions"][0]["hits"][0];
        assert_eq!(hit["source"], "full-1/reader-1", "{}: {t}", w.name());
        assert_eq!(
            hit["key"]["tools"],
            serde_json::json!(["list_dir", "read_file"]),
            "{}: {t}",
            w.name()
        );
        assert_eq!(hit["key"]["depth_left"], 2, "{}: {t}", w.name());
        for id in ["narrow-1", "full-1", "full-2"] {
            w.verify(id);
        }
    });
}

#[test]
fn a_handoff_chain_longer_than_the_depth_limit_runs_to_its_end() {
    let sandbox = || {
        let sb = Sandbox::new();
        for i in 1..=5 {
            let front = if i < 5 {
                format!("handoff: c{}\n", i + 1)
            } else {
                String::new()
            };
            sb.agent(
                &format!("c{i}"),
                &front,
                &format!("turns:\n  - answer: \"c{i} was here\"\n"),
            );
        }
        sb
    };
    both(sandbox, |w| {
        assert_eq!(
            w.start("c1", "chain", "pass it on"),
            "completed",
            "{}",
            w.tree("chain")
        );
        assert_eq!(w.answer_of("chain"), "c5 was here");
        let t = w.tree("chain");
        let sessions = t["sessions"].as_array().unwrap();
        assert_eq!(sessions.len(), 5, "{}: {t}", w.name());
        w.verify("chain");
    });
}

#[test]
fn a_cancelled_sessions_tokens_no_longer_answer_from_any_entry_point() {
    let sandbox = || {
        let sb = Sandbox::new();
        sb.agent(
            "asker",
            "tools: [ask_user, write_file]\n",
            "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [{key: name, question: \"Which name?\"}]}\n      - tool: write_file\n        args: {path: out.txt, content: hello}\n  - answer: done\n",
        );
        sb
    };
    both(sandbox, |w| {
        let status = w.start("asker", "cancelled", "ask then write");
        assert_eq!(
            status,
            "awaiting_input",
            "{}: {}",
            w.name(),
            w.tree("cancelled")
        );
        let items = w.inbox("cancelled");
        let token = |kind: &str| {
            items
                .iter()
                .find(|i| i["kind"] == kind)
                .and_then(|i| i["token"].as_str())
                .unwrap_or_else(|| panic!("{}: no {kind} in {items:?}", w.name()))
                .to_string()
        };
        let (question, approval) = (token("question"), token("approval"));
        let out = w.cli(&["cancel", "cancelled", "--reason", "changed my mind"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(w.settle("cancelled"), "cancelled");
        for args in [
            vec!["answer", question.as_str(), "--set", "name=x"],
            vec!["approve", approval.as_str()],
            vec!["deny", approval.as_str()],
        ] {
            let out = w.cli(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{}: {args:?} was accepted", w.name());
            assert!(
                err.contains("has ended (cancelled: changed my mind)"),
                "{}: {args:?}: {err}",
                w.name()
            );
        }
        assert!(w.inbox("cancelled").is_empty());
        w.verify("cancelled");
    });
}

#[test]
fn an_approval_asked_by_a_child_two_trees_share_is_in_both_inboxes() {
    let sandbox = || {
        let sb = Sandbox::new();
        sb.agent(
            "boss",
            "agents: [looker]\n",
            "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: looker, mission: \"look around\"}\n  - answer: \"boss: {{ results[0].result or results[0] }}\"\n",
        )
        .agent(
            "looker",
            "tools: [list_dir]\n",
            "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {path: \".\"}\n  - answer: looked\n",
        );
        configure(&sb, "[limits]\napproval_required = [\"list_dir\"]\n");
        sb
    };
    // Single-flight across trees is the cluster's (the embedded store's claims of runs in
    // flight live in its one process, and each `skein run` is one).
    {
        let w = &World::nats(sandbox());
        assert_eq!(w.start("boss", "first", "go"), "waiting");
        let first = w.inbox("first");
        assert_eq!(first.len(), 1, "{}: {first:?}", w.name());
        // The second tree joins the first one's child, which waits for the approval: the
        // second tree waits on it too, and its inbox says so.
        assert_eq!(w.start("boss", "second", "go"), "waiting");
        let tree = w.tree("second");
        let sessions = tree["sessions"].as_array().unwrap();
        assert_eq!(
            sessions.len(),
            1,
            "{}: the child is shared: {tree}",
            w.name()
        );
        let second = w.inbox("second");
        assert_eq!(second, first, "{}", w.name());
        assert_eq!(second[0]["session"], "first/looker-1");
        let token = second[0]["token"].as_str().unwrap().to_string();
        let (out, status) = w.act("first", &["approve", &token]);
        assert!(
            out.status.success(),
            "{}: {}",
            w.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(status, "completed", "{}: {}", w.name(), w.tree("first"));
        assert_eq!(w.settle("second"), "completed", "{}", w.name());
        assert_eq!(w.answer_of("second"), "boss: looked", "{}", w.name());
        assert!(w.inbox("second").is_empty());
        w.verify("first");
        w.verify("second");
    }
}
