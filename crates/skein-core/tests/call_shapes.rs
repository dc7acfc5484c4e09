//! The `call_agent` shapes other agent systems send, one given/when/then example each:
//! the aliases, a structured context, a custom agent's `tool_allowlist`, `allowed_tools`,
//! `budget.max_steps`, `planning_strategy`; and the front matter's `top_p` and `top_k`.
//! Each is accepted or refused with its reason, never dropped.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::{agents, answered, given, submitted, turn};
use serde_json::json;
use skein_core::event::Event;
use skein_core::AgentSet;

/// `boss` may call `expert` (which reads and writes files) and make custom agents.
fn set() -> AgentSet {
    agents(&[
        ("boss", "agents: [expert]\ntools: [read_file, list_dir]\n"),
        ("expert", "tools: [read_file, write_file]\n"),
        ("sampler", "top_p: 0.9\ntop_k: 40\ntemperature: 0.3\n"),
    ])
}

fn call_with(args: serde_json::Value) -> kit::Given {
    given(set(), "boss").events([submitted("boss"), turn(&[("c1", "call_agent", args)], 10)])
}

#[test]
fn task_agent_name_and_skill_name_are_read_as_mission_and_agent() {
    for args in [
        json!({"agent_name": "expert", "task": "check the logs"}),
        json!({"skill_name": "expert", "mission": "check the logs"}),
        json!({"specialist": "expert", "task": "check the logs"}),
    ] {
        let ds = call_with(args).when_deciding().then_delegates(&["c1"]);
        assert_eq!(
            (ds[0].agent.as_str(), ds[0].mission.as_str()),
            ("expert", "check the logs")
        );
    }
}

#[test]
fn a_name_and_its_alias_together_are_refused_not_one_dropped() {
    call_with(json!({"agent": "expert", "agent_name": "expert", "mission": "m"}))
        .when_deciding()
        .then_refused("c1", "duplicate field `agent`");
}

#[test]
fn an_unknown_field_is_refused_with_its_name() {
    call_with(json!({"agent": "expert", "mission": "m", "priority": "high"}))
        .when_deciding()
        .then_refused("c1", "unknown field `priority`");
}

#[test]
fn a_structured_context_reaches_the_child_as_json() {
    let ds = call_with(json!({
        "agent": "expert", "mission": "m", "context": {"ticket": 42, "area": "billing"}
    }))
    .when_deciding()
    .then_delegates(&["c1"]);
    assert_eq!(
        ds[0].context.as_deref(),
        Some(r#"{"area":"billing","ticket":42}"#)
    );
}

#[test]
fn a_custom_agents_tool_allowlist_is_its_tools() {
    let ds = call_with(json!({
        "task": "m",
        "agent_definition": {"system_prompt": "You list.", "tool_allowlist": ["list_dir"]}
    }))
    .when_deciding()
    .then_delegates(&["c1"]);
    assert_eq!(
        ds[0].custom.as_ref().unwrap().tools,
        vec!["list_dir".to_string()]
    );
    // A field of the definition this build does not know is refused, not dropped.
    call_with(json!({
        "task": "m",
        "agent_definition": {"system_prompt": "You list.", "model": "gpt-5"}
    }))
    .when_deciding()
    .then_refused("c1", "unknown field `model`");
}

#[test]
fn allowed_tools_may_name_tools_of_a_server_the_child_has_whole() {
    let call = |only: serde_json::Value| {
        let set = agents(&[("boss", "agents: [gitter]\n"), ("gitter", "mcp: [git]\n")]);
        let args = json!({"agent": "gitter", "mission": "m", "allowed_tools": only});
        given(set, "boss").events([submitted("boss"), turn(&[("c1", "call_agent", args)], 10)])
    };
    for only in [json!(["git__status"]), json!(["git__*"])] {
        let ds = call(only.clone()).when_deciding().then_delegates(&["c1"]);
        assert_eq!(json!(ds[0].allowed_tools), only);
    }
    call(json!(["git__status", "hg__log"]))
        .when_deciding()
        .then_refused("c1", "it does not have `hg__log`");
}

#[test]
fn allowed_tools_narrows_the_child_and_cannot_widen_it() {
    let ds = call_with(json!({"agent": "expert", "mission": "m", "allowed_tools": ["read_file"]}))
        .when_deciding()
        .then_delegates(&["c1"]);
    assert_eq!(ds[0].allowed_tools, Some(vec!["read_file".to_string()]));
    call_with(json!({"agent": "expert", "mission": "m", "allowed_tools": ["read_file", "shell"]}))
        .when_deciding()
        .then_refused("c1", "cannot add any: it does not have `shell`");
    // The narrowed child may not call what it was not allowed, though its file lists it.
    let Event::Submitted(mut sub) = kit::submitted_with("expert", 1, &["boss"], None) else {
        unreachable!()
    };
    sub.allowed_tools = Some(vec!["read_file".into()]);
    let g = given(set(), "expert").events([
        Event::Submitted(sub),
        turn(
            &[
                ("c1", "write_file", json!({"path": "a", "content": "x"})),
                ("c2", "read_file", json!({"path": "a"})),
            ],
            10,
        ),
    ]);
    g.when_deciding()
        .then_refused("c1", "may use only: read_file");
}

#[test]
fn budget_max_steps_caps_the_childs_turns() {
    let ds = call_with(json!({"agent": "expert", "mission": "m", "budget": {"max_steps": 1}}))
        .when_deciding()
        .then_delegates(&["c1"]);
    assert_eq!(ds[0].budget.max_steps, Some(1));
    let Event::Submitted(mut sub) = kit::submitted_with("expert", 1, &["boss"], None) else {
        unreachable!()
    };
    sub.budget.max_steps = Some(1);
    given(set(), "expert")
        .events([
            Event::Submitted(sub),
            turn(&[("c1", "read_file", json!({"path": "a"}))], 10),
            kit::returned("c1", "text"),
        ])
        .when_deciding()
        .then_fails("step limit reached: 1 model turns");
}

#[test]
fn planning_strategy_is_refused_with_the_alternatives() {
    let r = call_with(json!({"agent": "expert", "mission": "m", "planning_strategy": "react"}))
        .when_deciding()
        .then_refused("c1", "`planning_strategy` is not supported");
    assert!(
        r.error.contains("owns_tasks") && r.error.contains("update_plan"),
        "{}",
        r.error
    );
}

#[test]
fn top_p_and_top_k_of_the_front_matter_reach_the_model_request() {
    let agents = set();
    let def = agents.get("sampler").unwrap();
    let g = given(set(), "sampler").events([submitted("sampler")]);
    let req = g.state().model_request(def);
    assert_eq!(
        (req.top_p, req.top_k, req.temperature),
        (Some(0.9), Some(40), Some(0.3))
    );
    // Unset, they are left out of the request's encoding (its digest is as before).
    let plain = given(set(), "boss").events([submitted("boss"), answered("x")]);
    let req = plain.state().model_request(agents.get("boss").unwrap());
    let v = serde_json::to_value(&req).unwrap();
    assert!(v.get("top_p").is_none() && v.get("top_k").is_none(), "{v}");
}

#[test]
fn a_timeout_that_does_not_read_is_refused_when_the_agent_loads() {
    for (bad, why) in [("soon", "limits.timeout"), ("0s", "longer than zero")] {
        let text =
            format!("---\nname: a\nmodel: scripted:a\nlimits: {{timeout: {bad}}}\n---\nA.\n");
        let e = AgentSet::load(&[("a.md".into(), text)], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(why) && e.contains("a.md"), "{e}");
    }
}
