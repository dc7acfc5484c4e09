//! The references' call names and contracts with the real binary, on both backends, one
//! test per section of the fidelity table (docs/references.md), each tree checked with
//! `replay --tree --verify`: the planner ADR's files as written (layout, bare model name,
//! tools, `{{tool_descriptions}}`) delegated to with `delegate_to_agent`; the fields of a
//! child's result; a follow-up to a child with no turns left; a router's `handoff_to` and
//! a team member's failure.

mod common;

use common::world::*;
use common::*;

/// A sandbox holding a copy of `config/reference`.
fn reference() -> Sandbox {
    let sb = Sandbox::new();
    let src = repo().join("config/reference");
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    };
    for agent in ["planner", "orchestrator"] {
        copy(
            &src.join(format!("agents/{agent}/agent.md")),
            &sb.dir.path().join(format!("agents/{agent}/agent.md")),
        );
    }
    for script in ["gemini-flash-latest.yaml", "orchestrator-model.yaml"] {
        copy(
            &src.join("scripts").join(script),
            &sb.dir.path().join("scripts").join(script),
        );
    }
    copy(&src.join("skein.toml"), &sb.config());
    sb
}

#[test]
fn the_planner_adr_files_as_written_are_delegated_to_with_delegate_to_agent() {
    both(reference, |w| {
        let out = w.cli(&["agents", "check"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            w.start("orchestrator", "adr", "a health endpoint"),
            "completed"
        );
        let answer = w.answer_of("adr");
        assert!(
            answer.starts_with("The planner (planner, depth 1) planned it"),
            "{answer}"
        );
        assert!(
            answer.contains("PLAN: Create a detailed plan for: a health endpoint"),
            "{answer}"
        );
        let events = w.cli(&["events", "adr/planner-1", "--json"]);
        let text = String::from_utf8_lossy(&events.stdout);
        for tool in ["list_directory", "get_file_info"] {
            assert!(
                text.contains(&format!("\"tool\":\"{tool}\"")),
                "{}: {tool}: {text}",
                w.name()
            );
        }
        w.verify("adr");
    });
}

#[test]
fn a_childs_result_names_its_agent_depth_error_type_and_new_facts() {
    let sandbox = || {
        let sb = Sandbox::new();
        sb.agent(
            "boss",
            "agents: [scout, spender]\n",
            "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: scout, mission: look}\n      - tool: call_agent\n        args: {agent: spender, mission: spend, budget: {tokens: 1}}\n  - answer: \"{{ results[0].agent_name }}@{{ results[0].depth }} facts={{ results[0].new_facts.lang }} next={{ results[0].suggested_next_action }} | {{ results[1].agent_name }} {{ results[1].error_type }}\"\n",
        )
        .agent(
            "scout",
            "",
            "turns:\n  - answer: '{\"result\": \"found\", \"new_facts\": {\"lang\": \"rust\"}, \"suggested_next_action\": \"build\"}'\n",
        )
        .agent(
            "spender",
            "tools: [list_dir]\n",
            "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {}\n  - answer: never\n",
        );
        sb
    };
    both(sandbox, |w| {
        assert_eq!(
            w.start("boss", "results", "go"),
            "completed",
            "{}",
            w.tree("results")
        );
        assert_eq!(
            w.answer_of("results"),
            "scout@1 facts=rust next=build | spender budget",
            "{}",
            w.name()
        );
        w.verify("results");
    });
}

#[test]
fn a_follow_up_to_a_child_with_no_turns_left_is_refused_and_its_answer_stands() {
    let sandbox = || {
        let sb = Sandbox::new();
        sb.agent(
            "boss",
            "agents: [expert]\ntools: [ask_clarification]\n",
            "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: expert, mission: estimate, budget: {max_steps: 1}}\n  - tool_calls:\n      - tool: ask_clarification\n        args: {session_id: \"{{ results[0].session_id }}\", question: \"error bars?\"}\n  - answer: \"{{ results[0] }}\"\n",
        )
        .agent("expert", "chat: true\n", "turns:\n  - answer: \"42\"\n  - answer: \"± 2\"\n");
        sb
    };
    both(sandbox, |w| {
        assert_eq!(w.start("boss", "followup", "go"), "completed");
        let answer = w.answer_of("followup");
        assert!(
            answer.contains("has no turns left: it made 1 of its 1 model turns"),
            "{answer}"
        );
        let t = w.tree("followup");
        assert_eq!(t["sessions"][1]["status"], "completed", "{}: {t}", w.name());
        assert_eq!(t["sessions"][1]["answer"], "42");
        w.verify("followup");
    });
}

#[test]
fn an_approved_handoff_to_runs_on_and_a_failed_member_is_announced_as_a_failure() {
    let sandbox = || {
        let sb = Sandbox::new();
        sb.agent(
            "desk",
            "router: {destinations: [billing]}\nrequires_approval: [handoff_to]\n",
            "turns:\n  - tool_calls:\n      - tool: handoff_to\n        args: {agent: billing}\n",
        )
        .agent("billing", "", "turns:\n  - answer: \"billing took it\"\n")
        .agent(
            "crew",
            "team: {members: [flaky], supervisor: lead}\n",
            "turns:\n  - answer: unused\n",
        )
        .agent(
            "flaky",
            "limits:\n  max_steps: 1\ntools: [list_dir]\n",
            "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {}\n",
        )
        .agent(
            "lead",
            "",
            "turns:\n  - answer: \"lead heard: {{ user_messages | join(' / ') }}\"\n",
        );
        sb
    };
    both(sandbox, |w| {
        assert_eq!(
            w.start("desk", "routed", "refund please"),
            "awaiting_approval"
        );
        let items = w.inbox("routed");
        assert_eq!(items.len(), 1, "{}: {items:?}", w.name());
        assert_eq!(items[0]["tool"], "handoff_to");
        let token = items[0]["token"].as_str().unwrap().to_string();
        let (out, status) = w.act("routed", &["approve", &token]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(status, "completed");
        assert_eq!(w.answer_of("routed"), "billing took it");
        w.verify("routed");

        assert_eq!(
            w.start("crew", "team", "go"),
            "completed",
            "{}",
            w.tree("team")
        );
        let answer = w.answer_of("team");
        assert!(
            answer.contains("(failure, after 1 turn)")
                && answer.contains("member `flaky` failed and is no longer in the team. Reason: step limit reached"),
            "{}: {answer}",
            w.name()
        );
        w.verify("team");
    });
}

#[test]
fn members_of_a_supervisor_that_failed_are_cancelled_saying_so() {
    let sandbox = || {
        let sb = Sandbox::new();
        sb.agent(
            "crew",
            "team: {members: [slow], supervisor: boss}\n",
            "turns:\n  - answer: unused\n",
        )
        .agent(
            "slow",
            "",
            "turns:\n  - tool_calls:\n      - tool: team_broadcast\n        args: {message: started}\n  - latency_ms: 3000\n    answer: done\n",
        )
        .agent(
            "boss",
            "limits:\n  max_steps: 1\ntools: [list_dir]\n",
            "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {}\n",
        );
        sb
    };
    both(sandbox, |w| {
        assert_eq!(w.start("crew", "sup", "go"), "failed", "{}", w.tree("sup"));
        let t = w.tree("sup");
        let member = t["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["agent"] == "slow")
            .cloned()
            .unwrap();
        assert_eq!(member["status"], "cancelled", "{}: {t}", w.name());
        let why = member["error"].as_str().unwrap_or_default();
        assert!(
            why.contains("the team's supervisor `boss` failed") && why.contains("the team is over"),
            "{}: {why}",
            w.name()
        );
        w.verify("sup");
    });
}
