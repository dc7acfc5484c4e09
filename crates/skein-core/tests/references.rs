//! The references' call names and result fields: `delegate_to_agent` as another name of
//! `call_agent`, `shared_context` refused with the alternative, a failed child's
//! `error_type`, every result's `agent_name` and `depth`, a structured answer's
//! `new_facts` and `suggested_next_action`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::*;
use serde_json::{json, Value};
use skein_core::event::Outcome;
use skein_core::state::{call_agent_result, error_type, Answerer};
use skein_core::{AgentSet, Step, Usage};

#[test]
fn delegate_to_agent_is_call_agent_under_the_name_the_agent_file_uses() {
    let set = agents(&[
        ("orch", "tools: [delegate_to_agent]\nagents: [planner]\n"),
        ("planner", ""),
    ]);
    let orch = set.get("orch").unwrap();
    assert_eq!(orch.delegation_tool(), "delegate_to_agent");
    assert!(orch.allowed_tools().contains("delegate_to_agent"));
    assert!(!orch.allowed_tools().contains("call_agent"));
    let g = given(set, "orch").events([
        submitted("orch"),
        turn(
            &[(
                "c1",
                "delegate_to_agent",
                json!({"agent": "planner", "task": "plan it", "context": {"dir": "."}}),
            )],
            10,
        ),
    ]);
    let ds = g.when_deciding().then_delegates(&["c1"]);
    assert_eq!(ds[0].agent, "planner");
    assert_eq!(ds[0].mission, "plan it");
    assert_eq!(ds[0].context.as_deref(), Some(r#"{"dir":"."}"#));
}

#[test]
fn delegating_without_agents_or_under_both_names_is_refused_at_load() {
    let files = |front: &str| {
        vec![(
            "orch.md".to_string(),
            format!("---\nname: orch\nmodel: scripted:orch\n{front}---\nHi.\n"),
        )]
    };
    let e = AgentSet::load(&files("tools: [delegate_to_agent]\n"), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lists `delegate_to_agent` but no `agents:`"),
        "{e}"
    );
    let e = AgentSet::load(
        &files("tools: [call_agent, delegate_to_agent]\nagents: [orch]\nrecursive: true\n"),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("two names of one tool"), "{e}");
}

#[test]
fn shared_context_is_refused_with_what_to_write_instead() {
    let set = agents(&[("orch", "agents: [planner]\n"), ("planner", "")]);
    let g = given(set, "orch").events([
        submitted("orch"),
        turn(
            &[(
                "c1",
                "call_agent",
                json!({"agent": "planner", "mission": "m", "shared_context": {"a": 1}}),
            )],
            10,
        ),
    ]);
    let r = g
        .when_deciding()
        .then_refused("c1", "`shared_context` is not supported");
    assert!(r.error.contains("this call's `context`"), "{}", r.error);
}

#[test]
fn a_failed_childs_result_names_its_error_type_and_every_result_its_agent_and_depth() {
    let by = Answerer {
        agent: "planner",
        depth: 2,
    };
    let child = root().child("planner", 1);
    let failed = |error: &str| Outcome::Failed {
        error: error.into(),
        usage: Usage::default(),
        steps: 1,
    };
    let (out, is_error) = call_agent_result(
        &child,
        &failed("token budget exhausted: used 10 of 5 tokens"),
        false,
        by,
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(is_error);
    assert_eq!(v["error_type"], "budget");
    assert_eq!(v["agent_name"], "planner");
    assert_eq!(v["depth"], 2);
    for (text, kind) in [
        ("cancelled: stopped by a person", "cancelled"),
        (
            "cancelled: timed out: `planner` ran past its limits.timeout of 1s",
            "timeout",
        ),
        ("step limit reached: 24 model turns without an answer", "budget"),
        ("model call failed 3 times: 500", "model"),
        (
            "the handoff to `b` failed: the handoff to `c` failed: handoff: depth limit: `c` would run at depth 4, the limit is 3",
            "depth",
        ),
        ("dead-lettered: delivered 5 times", "dead_letter"),
        ("something else", "error"),
    ] {
        assert_eq!(error_type(text), kind, "{text}");
    }
    let done = Outcome::Completed {
        answer: r#"{"result": "the plan", "new_facts": {"lang": "rust"}, "suggested_next_action": "review it"}"#.into(),
        patch: None,
        usage: Usage::default(),
        steps: 2,
        partial: false,
    };
    let (out, is_error) = call_agent_result(&child, &done, false, by);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(!is_error);
    assert_eq!(v["new_facts"], json!({"lang": "rust"}));
    assert_eq!(v["suggested_next_action"], "review it");
    assert_eq!(v["agent_name"], "planner");
    assert!(v.get("error_type").is_none());
}

fn approved(call: &str) -> skein_core::Event {
    skein_core::Event::ApprovalGiven(skein_core::event::ApprovalGiven {
        call: call.into(),
        approved: true,
        by: None,
        reason: None,
        token_id: format!("t-{call}"),
    })
}

fn approval_requested(call: &str, tool: &str) -> skein_core::Event {
    skein_core::Event::ApprovalRequested(skein_core::event::ApprovalRequested {
        call: call.into(),
        tool: tool.into(),
        preview: String::new(),
        token_id: format!("t-{call}"),
    })
}

#[test]
fn requires_approval_holds_for_handoff_to_and_for_the_children_a_pattern_starts() {
    let set = agents(&[
        (
            "desk",
            "router: {destinations: [billing]}\nrequires_approval: [handoff_to]\n",
        ),
        ("billing", ""),
        (
            "drafter",
            "handoff: billing\nrequires_approval: [call_agent]\n",
        ),
    ]);
    // A router's exit waits for approval, then hands the request on.
    let g = given(set.clone(), "desk").events([
        submitted("desk"),
        turn(&[("c1", "handoff_to", json!({"agent": "billing"}))], 10),
    ]);
    g.when_deciding()
        .then_asks_approval(&[("c1", "handoff_to")]);
    let g = g.events([approval_requested("c1", "handoff_to"), approved("c1")]);
    let routed = g.when_deciding().then_orchestrates();
    assert!(matches!(routed, skein_core::Event::Routed(_)), "{routed:?}");
    // An agent whose delegations need approval: its handoff's child waits for it too.
    let g = given(set, "drafter").events([submitted("drafter"), answered("draft")]);
    let h = g.when_deciding().then_orchestrates();
    let g = g.events([h]);
    g.when_deciding()
        .then_asks_approval(&[("handoff.1", "handoff")]);
    let g = g.events([
        approval_requested("handoff.1", "handoff"),
        approved("handoff.1"),
    ]);
    let ds = g.when_deciding().then_delegates(&["handoff.1"]);
    assert_eq!(ds[0].agent, "billing");
}

#[test]
fn a_global_sub_agent_tool_allowlist_bounds_every_sub_agents_tools() {
    let set = agents(&[("reader", "tools: [read_file, write_file, list_dir]\n")]);
    let limits = skein_core::Limits {
        sub_agent_tool_allowlist: Some(vec!["read_file".into(), "list_dir".into()]),
        ..Default::default()
    };
    let def = set.get("reader").unwrap().clone();
    let def = &def;
    let root = given(set.clone(), "reader")
        .events([submitted("reader")])
        .state();
    assert!(
        root.allowed_tools(def, &limits).contains("write_file"),
        "the root is not bounded"
    );
    let g = given(set, "reader").limits(limits.clone()).events([
        submitted_with("reader", 1, &["boss"], None),
        turn(
            &[("c1", "write_file", json!({"path": "x", "content": "y"}))],
            10,
        ),
    ]);
    assert!(!g.state().allowed_tools(def, &limits).contains("write_file"));
    g.when_deciding()
        .then_refused("c1", "not allowed: tool `write_file`");
}

#[test]
fn a_summary_longer_than_max_chars_is_cut_to_it() {
    let set = agents(&[("writer", "summarize: {max_chars: 20}\n")]);
    let long = "x".repeat(50);
    let g = given(set, "writer").events([submitted("writer"), answered(&long)]);
    let skein_core::Step::Summarize { model, max_chars } = g.when_deciding().step else {
        panic!("a long answer is summarised")
    };
    assert_eq!(max_chars, 20);
    // The summary is asked of the answer alone, with no tools and no transcript.
    let request = g.state().summary_request(model.clone(), max_chars);
    assert_eq!(request.model, model);
    assert!(request.tools.is_empty());
    assert_eq!(request.messages.len(), 2);
    assert!(
        matches!(&request.messages[0], skein_core::Message::System { content }
        if content.contains("at most 20 characters"))
    );
    assert!(
        matches!(&request.messages[1], skein_core::Message::User { content }
        if *content == long)
    );
    assert_eq!(request.meta.mission, "summarize");
    assert_eq!(request.meta.agent, "writer");
    // The summary model wrote 30 characters where 20 were asked for.
    let g = g.events([answered(&"s".repeat(30))]);
    let Step::Complete { answer } = g.when_deciding().step else {
        panic!("completes")
    };
    let summary = answer.split("\n\n[full answer").next().unwrap();
    assert_eq!(summary.chars().count(), 20, "{summary}");
    assert!(summary.ends_with('…'), "{summary}");
    assert!(answer.contains("[full answer: 50 characters"), "{answer}");
}
