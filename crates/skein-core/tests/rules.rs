//! One given/when/then example per rule of the decide step: given a session's log, when
//! it is decided, then the step it must take or the refusal that names why.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::{
    agents, call, child_completed, delegated, given, plan_applied, returned, root, submitted,
    submitted_with, turn,
};
use serde_json::json;
use skein_core::{AgentSet, Limits, SessionId};

/// boss delegates to expert (which takes follow-ups) and writer (which does not); writer
/// may call expert; looper calls itself (it is recursive).
fn team() -> AgentSet {
    agents(&[
        (
            "boss",
            "agents: [expert, writer]\ntools: [read_file, write_file, update_plan, ask_clarification]\n",
        ),
        ("expert", "chat: true\n"),
        ("writer", "agents: [expert]\n"),
        ("looper", "recursive: true\nagents: [looper]\n"),
        ("outsider", ""),
    ])
}

fn expert_child() -> SessionId {
    root().child("expert", 1)
}

// ---- allowlist ----------------------------------------------------------------------

#[test]
fn a_tool_the_agent_does_not_list_is_refused_and_one_it_lists_runs() {
    given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("c1", "shell", json!({"cmd": "ls"}))], 10),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            "not allowed: tool `shell`: agent `boss` may use only:",
        );
    given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("c1", "read_file", json!({"path": "x"}))], 10),
        ])
        .when_deciding()
        .then_runs(&[("c1", "read_file")]);
}

#[test]
fn an_agent_the_caller_may_not_call_is_refused() {
    given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("c1", "call_agent", call("outsider", "do it"))], 10),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            "not allowed: agent `outsider`; `boss` may call: expert, writer",
        );
}

// ---- ancestry -----------------------------------------------------------------------

#[test]
fn an_agent_already_on_the_delegation_path_is_refused_unless_recursive() {
    // A catalogue with a cycle of agents that are not recursive does not load, so the path
    // here was recorded under another catalogue (expert called writer before a redeploy):
    // the decide step still refuses to loop.
    given(team(), "writer")
        .events([
            submitted_with("writer", 2, &["boss", "expert"], None),
            turn(&[("c1", "call_agent", call("expert", "again"))], 10),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            "agent `expert` is already on this delegation path (boss → expert → writer)",
        );
    let ds = given(team(), "looper")
        .events([
            submitted_with("looper", 1, &["boss"], None),
            turn(&[("c1", "call_agent", call("looper", "again"))], 10),
        ])
        .when_deciding()
        .then_delegates(&["c1"]);
    assert_eq!(ds[0].ancestry, ["boss", "looper"]);
}

// ---- depth --------------------------------------------------------------------------

#[test]
fn a_delegation_past_max_depth_is_refused() {
    let limits = Limits {
        max_depth: 1,
        ..Limits::default()
    };
    given(team(), "boss")
        .limits(limits.clone())
        .events([
            submitted_with("boss", 1, &["top"], None),
            turn(&[("c1", "call_agent", call("expert", "estimate"))], 10),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            "depth limit: the child would run at depth 2, the limit is 1",
        );
    let ds = given(team(), "boss")
        .limits(limits)
        .events([
            submitted("boss"),
            turn(&[("c1", "call_agent", call("expert", "estimate"))], 10),
        ])
        .when_deciding()
        .then_delegates(&["c1"]);
    assert_eq!(ds[0].depth, 1);
}

#[test]
fn a_log_claiming_the_deepest_depth_is_refused_not_overflowed() {
    // A forged or damaged record may claim any depth: the child's would not fit in a u32.
    given(team(), "boss")
        .limits(Limits {
            max_depth: u32::MAX,
            ..Limits::default()
        })
        .events([
            submitted_with("boss", u32::MAX, &["top"], None),
            turn(&[("c1", "call_agent", call("expert", "estimate"))], 10),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            &format!(
                "depth limit: the child would run at depth {m}, the limit is {m}",
                m = u32::MAX
            ),
        );
}

// ---- per-turn limits ----------------------------------------------------------------

#[test]
fn sub_agents_past_max_children_per_turn_are_refused() {
    given(team(), "boss")
        .limits(Limits {
            max_children_per_turn: 2,
            ..Limits::default()
        })
        .events([
            submitted("boss"),
            turn(
                &[
                    ("c1", "call_agent", call("expert", "one")),
                    ("c2", "call_agent", call("expert", "two")),
                    ("c3", "call_agent", call("expert", "three")),
                ],
                10,
            ),
        ])
        .when_deciding()
        .then_refused(
            "c3",
            "at most 2 sub-agents per turn; this call would be number 3",
        );
}

#[test]
fn tool_calls_past_max_tool_calls_per_turn_are_refused_and_none_of_them_runs() {
    let then = given(team(), "boss")
        .limits(Limits {
            max_tool_calls_per_turn: 2,
            ..Limits::default()
        })
        .events([
            submitted("boss"),
            turn(
                &[
                    ("c1", "read_file", json!({"path": "a"})),
                    ("c2", "read_file", json!({"path": "b"})),
                    ("c3", "read_file", json!({"path": "c"})),
                ],
                10,
            ),
        ])
        .when_deciding();
    let refused = then.then_refused(
        "c3",
        "read_file: not run: this turn made 3 tool calls and at most 2 run per turn \
         (`max_tool_calls_per_turn`); this was call number 3",
    );
    assert_eq!(refused.tool, "read_file");
}

// ---- budget -------------------------------------------------------------------------

#[test]
fn a_delegation_asking_more_tokens_than_remain_is_refused() {
    given(team(), "boss")
        .events([
            submitted_with("boss", 0, &[], Some(1000)),
            turn(
                &[(
                    "c1",
                    "call_agent",
                    json!({"agent": "expert", "mission": "m", "budget": {"tokens": 5000}}),
                )],
                100,
            ),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            "budget: asks for 5000 tokens, 900 remain of this session's budget",
        );
}

#[test]
fn a_turn_whose_delegations_together_ask_more_than_remains_is_refused_whole() {
    let asks = |call: &'static str| {
        (
            call,
            "call_agent",
            json!({"agent": "expert", "mission": call, "budget": {"tokens": 600}}),
        )
    };
    let then = given(team(), "boss")
        .events([
            submitted_with("boss", 0, &[], Some(1000)),
            turn(&[asks("c1"), asks("c2")], 100),
        ])
        .when_deciding();
    let reason = "this turn's delegations ask for 1200 tokens, 900 remain";
    let skein_core::Step::Refuse(rs) = &then.step else {
        panic!("expected the turn refused, decided {:?}", then.step)
    };
    assert_eq!(rs.len(), 2, "{rs:?}");
    then.then_refused("c2", reason);
}

/// The turn of `a_turn_whose_delegations_together_ask_more_than_remains_is_refused_whole`
/// after its first refusal is recorded: c2 alone would fit (600 of 900), yet it is refused
/// with the same reason, read back from the recorded refusal's kind.
#[test]
fn the_rest_of_a_turn_refused_for_its_budget_is_refused_the_same_way() {
    let asks = |call: &'static str| {
        (
            call,
            "call_agent",
            json!({"agent": "expert", "mission": call, "budget": {"tokens": 600}}),
        )
    };
    let reason = "budget: this turn's delegations ask for 1200 tokens, 900 remain of this \
                  session's budget";
    let first = skein_core::Event::refusal(
        "c1",
        reason,
        Some(skein_core::event::Refused::TurnOverBudget),
    );
    let log = [
        submitted_with("boss", 0, &[], Some(1000)),
        turn(&[asks("c1"), asks("c2")], 100),
        first,
    ];
    let r = given(team(), "boss")
        .events(log.clone())
        .when_deciding()
        .then_refused("c2", reason);
    assert_eq!(r.kind, Some(skein_core::event::Refused::TurnOverBudget));
    // Any other refusal of c1 leaves c2, which fits alone, to start.
    let mut other = log.clone();
    other[2] = skein_core::Event::tool_error("c1", "unavailable: try later");
    given(team(), "boss")
        .events(other)
        .when_deciding()
        .then_delegates(&["c2"]);
}

/// A log written before refusal kinds were recorded carries the turn's budget refusal only
/// in its text: it still decides (and so replays) as it was decided.
#[test]
fn a_log_from_before_refusal_kinds_decides_as_it_did() {
    let asks = |call: &'static str| {
        (
            call,
            "call_agent",
            json!({"agent": "expert", "mission": call, "budget": {"tokens": 600}}),
        )
    };
    let reason = "budget: this turn's delegations ask for 1200 tokens, 900 remain of this \
                  session's budget";
    let legacy = skein_core::Event::tool_error("c1", reason);
    let skein_core::Event::ToolReturned(t) = &legacy else {
        unreachable!()
    };
    assert_eq!(t.refused, None, "written without a kind");
    // The turn as boss's model recorded it, so the log also replays.
    let mut the_turn = turn(&[asks("c1"), asks("c2")], 100);
    if let skein_core::Event::ModelCalled(m) = &mut the_turn {
        m.model = "scripted:boss".into();
    }
    let given = given(team(), "boss").events([
        submitted_with("boss", 0, &[], Some(1000)),
        the_turn,
        legacy.clone(),
    ]);
    given.when_deciding().then_refused("c2", reason);
    // Replay verification admits the legacy record where the new decision names a kind.
    let def = team();
    let mut log = given.log_envelopes();
    let c2 = skein_core::Event::tool_error("c2", reason);
    let at = log.len() as u64 + 1;
    log.push(skein_core::Envelope::new(root(), at, 1, String::new(), c2));
    skein_core::replay::verify(&log, def.get("boss").unwrap(), &Limits::default(), &def)
        .expect("the legacy log verifies");
}

#[test]
fn a_session_that_spent_its_token_budget_fails_instead_of_calling_the_model() {
    given(team(), "boss")
        .events([
            submitted_with("boss", 0, &[], Some(100)),
            turn(&[("c1", "read_file", json!({"path": "x"}))], 150),
            returned("c1", "contents"),
        ])
        .when_deciding()
        .then_fails("token budget exhausted: used 150 of 100 tokens");
    given(team(), "boss")
        .events([
            submitted_with("boss", 0, &[], Some(1000)),
            turn(&[("c1", "read_file", json!({"path": "x"}))], 150),
            returned("c1", "contents"),
        ])
        .when_deciding()
        .then_calls_model();
}

// ---- custom-agent tool subset -------------------------------------------------------

#[test]
fn a_custom_agent_may_use_only_tools_its_caller_has() {
    let custom = |tools: serde_json::Value| {
        json!({
            "mission": "summarise",
            "agent_definition": {"system_prompt": "You summarise.", "tools": tools},
        })
    };
    given(team(), "boss")
        .events([
            submitted("boss"),
            turn(
                &[("c1", "call_agent", custom(json!(["read_file", "shell"])))],
                10,
            ),
        ])
        .when_deciding()
        .then_refused(
            "c1",
            "agent_definition asks for tools `shell` that `boss` does not have",
        );
    let ds = given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("c1", "call_agent", custom(json!(["read_file"])))], 10),
        ])
        .when_deciding()
        .then_delegates(&["c1"]);
    assert_eq!(ds[0].agent, "custom");
}

// ---- clarification preconditions ----------------------------------------------------

/// boss ran `agent` for `c1`, which `finished` or not, then asks it a follow-up (`c2`).
fn follow_up_after(agent: &str, finished: bool) -> kit::Given {
    let child = root().child(agent, 1);
    let mut events = vec![
        submitted("boss"),
        turn(&[("c1", "call_agent", call(agent, "estimate"))], 10),
        delegated("c1", &child, agent, &[]),
    ];
    if finished {
        events.push(child_completed("c1", &child, "42"));
    }
    events.push(turn(
        &[(
            "c2",
            "ask_clarification",
            json!({"session_id": child.display(), "question": "error bars?"}),
        )],
        10,
    ));
    given(team(), "boss").events(events)
}

#[test]
fn a_follow_up_goes_only_to_a_finished_sub_agent_that_takes_them() {
    let c = follow_up_after("expert", true)
        .when_deciding()
        .then_clarifies("c2");
    assert_eq!(c.child, expert_child());
    assert_eq!(c.question, "error bars?");
    follow_up_after("writer", true)
        .when_deciding()
        .then_refused("c2", "agent `writer` does not take follow-up questions");
}

#[test]
fn a_follow_up_to_a_session_this_one_did_not_run_is_refused() {
    let stranger = SessionId::root("elsewhere").unwrap();
    let child = expert_child();
    given(team(), "boss")
        .events([
            submitted("boss"),
            // boss did run a sub-agent, and it finished: just not the one asked.
            turn(&[("c0", "call_agent", call("expert", "estimate"))], 10),
            delegated("c0", &child, "expert", &[]),
            child_completed("c0", &child, "42"),
            turn(
                &[(
                    "c1",
                    "ask_clarification",
                    json!({"session_id": stranger.display(), "question": "why?"}),
                )],
                10,
            ),
        ])
        .when_deciding()
        .then_refused("c1", "is not a sub-agent this session ran");
}

#[test]
fn a_follow_up_to_a_sub_agent_that_did_not_complete_is_refused() {
    let child = expert_child();
    given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("c1", "call_agent", call("expert", "estimate"))], 10),
            delegated("c1", &child, "expert", &[]),
            skein_core::Event::ChildSettled(skein_core::event::ChildSettled {
                call: "c1".into(),
                child: child.clone(),
                outcome: skein_core::event::Outcome::Failed {
                    error: "boom".into(),
                    usage: Default::default(),
                    steps: 1,
                },
            }),
            turn(
                &[(
                    "c2",
                    "ask_clarification",
                    json!({"session_id": child.display(), "question": "why?"}),
                )],
                10,
            ),
        ])
        .when_deciding()
        .then_refused("c2", "has not completed; only a finished sub-agent");
}

// ---- approvals ----------------------------------------------------------------------

#[test]
fn a_tool_that_requires_approval_asks_for_it_instead_of_running() {
    let write = || {
        turn(
            &[("c1", "write_file", json!({"path": "x", "content": "y"}))],
            10,
        )
    };
    // The default limits ask approval for `write_file`.
    let asks = given(team(), "boss")
        .events([submitted("boss"), write()])
        .when_deciding()
        .then_asks_approval(&[("c1", "write_file")]);
    // The approver is shown the whole arguments.
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&asks[0].preview).unwrap(),
        json!({"path": "x", "content": "y"})
    );
    given(team(), "boss")
        .limits(Limits {
            approval_required: vec![],
            ..Limits::default()
        })
        .events([submitted("boss"), write()])
        .when_deciding()
        .then_runs(&[("c1", "write_file")]);
}

// ---- plan ownership -----------------------------------------------------------------

fn two_tasks() -> serde_json::Value {
    json!({"ops": [
        {"op": "add", "task": {"id": "t1", "title": "Measure"}},
        {"op": "add", "task": {"id": "t2", "title": "Report"}},
    ]})
}

/// boss made a plan of t1 and t2 (version 1) and handed t1 to expert.
fn plan_with_t1_handed_to_expert() -> kit::Given {
    let with_t1 = json!({"agent": "expert", "mission": "measure", "owns_tasks": ["t1"]});
    given(team(), "boss").events([
        submitted("boss"),
        turn(&[("p1", "update_plan", two_tasks())], 10),
        plan_applied("p1", "boss", two_tasks(), 1),
        turn(&[("c1", "call_agent", with_t1)], 10),
        delegated("c1", &expert_child(), "expert", &["t1"]),
    ])
}

#[test]
fn the_owner_edits_its_own_plan() {
    let edit = given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("p1", "update_plan", two_tasks())], 10),
        ])
        .when_deciding()
        .then_edits_plan("p1");
    assert_eq!(edit.verdict, Ok(1));
}

#[test]
fn a_sub_agent_patch_to_a_task_it_does_not_own_is_rejected() {
    let done = |task: &str| {
        json!({"base_version": 1, "ops": [
            {"op": "update", "task_id": task, "fields": {"status": "COMPLETED"}},
        ]})
    };
    let given = plan_with_t1_handed_to_expert();
    given
        .when_proposing(&expert_child(), "expert", done("t2"))
        .then_rejected("forbidden: `update` writes task `t2`, which belongs to boss");
    given
        .when_proposing(&expert_child(), "expert", done("t1"))
        .then_accepted(2);
}

#[test]
fn tasks_handed_to_a_sub_agent_must_be_in_the_plan() {
    given(team(), "boss")
        .events([
            submitted("boss"),
            turn(&[("p1", "update_plan", two_tasks())], 10),
            plan_applied("p1", "boss", two_tasks(), 1),
            turn(
                &[(
                    "c1",
                    "call_agent",
                    json!({"agent": "expert", "mission": "m", "owns_tasks": ["t9"]}),
                )],
                10,
            ),
        ])
        .when_deciding()
        .then_refused("c1", "owns_tasks: no task `t9` in your plan (version 1)");
}

/// boss's plan of t1 and t2, and a turn whose c1 hands out a task that is not in it and
/// whose c2 asks for a plain child; `more` is appended after the turn.
fn plan_then_c1_bad_task(more: Vec<skein_core::Event>) -> kit::Given {
    let bad = json!({"agent": "expert", "mission": "m", "owns_tasks": ["t9"]});
    let mut log = vec![
        submitted("boss"),
        turn(&[("p1", "update_plan", two_tasks())], 10),
        plan_applied("p1", "boss", two_tasks(), 1),
        turn(
            &[
                ("c1", "call_agent", bad),
                ("c2", "call_agent", call("expert", "measure")),
            ],
            10,
        ),
    ];
    log.extend(more);
    given(team(), "boss").events(log)
}

#[test]
fn a_delegation_refused_for_its_plan_tasks_takes_no_child_number() {
    plan_then_c1_bad_task(vec![])
        .when_deciding()
        .then_refused("c1", "owns_tasks: no task `t9`");
    // Once c1's refusal is recorded, c2 is the session's first child.
    let refused = skein_core::Event::tool_error("c1", "call_agent: owns_tasks: no task `t9`");
    let ds = plan_then_c1_bad_task(vec![refused])
        .when_deciding()
        .then_delegates(&["c2"]);
    assert_eq!(ds[0].child, expert_child());
}

// ---- the worker's failures ----------------------------------------------------------

#[test]
fn replay_admits_the_workers_dead_letter_by_its_flag_and_old_records_by_their_text() {
    let def = team();
    let g = given(team(), "boss").events([submitted("boss")]);
    let verify_with_last = |last: skein_core::Event| {
        let mut log = g.log_envelopes();
        let at = log.len() as u64 + 1;
        log.push(skein_core::Envelope::new(
            root(),
            at,
            1,
            String::new(),
            last,
        ));
        skein_core::replay::verify(&log, def.get("boss").unwrap(), &Limits::default(), &def)
    };
    let usage = skein_core::Usage::default();
    verify_with_last(skein_core::Event::dead_lettered(
        "delivered 9 times",
        usage,
        0,
    ))
    .expect("a dead letter is the worker's, not a decision");
    let legacy = skein_core::Event::failed(
        format!("{}delivered 9 times", skein_core::event::DEAD_LETTER_PREFIX),
        usage,
        0,
    );
    verify_with_last(legacy).expect("a dead letter written before the flag");
    let d = verify_with_last(skein_core::Event::failed("gave up", usage, 0)).unwrap_err();
    assert_eq!(d.seq, 2, "any other failure must be decided: {d:?}");
}

#[test]
fn a_follow_up_to_a_sub_agent_with_no_turns_left_is_refused_up_front() {
    let child = expert_child();
    let asked = |max_steps: u64| {
        given(team(), "boss").events([
            submitted("boss"),
            turn(
                &[(
                    "c1",
                    "call_agent",
                    json!({"agent": "expert", "mission": "estimate", "budget": {"max_steps": max_steps}}),
                )],
                10,
            ),
            delegated("c1", &child, "expert", &[]),
            // It made one model turn of the `max_steps` it was given.
            child_completed("c1", &child, "42"),
            turn(
                &[(
                    "c2",
                    "ask_clarification",
                    json!({"session_id": child.display(), "question": "error bars?"}),
                )],
                10,
            ),
        ])
    };
    let r = asked(1)
        .when_deciding()
        .then_refused("c2", "has no turns left: it made 1 of its 1 model turns");
    assert!(r.error.contains("clarification_no_turns"), "{}", r.error);
    let c = asked(3).when_deciding().then_clarifies("c2");
    assert_eq!(c.max_steps, 3);
}

#[test]
fn the_answer_to_a_follow_up_carries_its_clarification_id_and_the_turns_left() {
    let child = expert_child();
    let g = follow_up_after("expert", true);
    let c = g.when_deciding().then_clarifies("c2");
    let g = g.events([
        skein_core::Event::Delegated(skein_core::event::Delegated {
            call: "c2".into(),
            child: child.clone(),
            agent: "expert".into(),
            mission_hash: String::new(),
            allotted_tokens: None,
            kind: skein_core::event::DelegationKind::Resumed,
            owns_tasks: vec![],
            max_steps: Some(c.max_steps),
        }),
        skein_core::Event::ChildSettled(skein_core::event::ChildSettled {
            call: "c2".into(),
            child: child.clone(),
            outcome: skein_core::event::Outcome::Completed {
                answer: "± 2".into(),
                patch: None,
                usage: Default::default(),
                steps: 2,
                partial: false,
            },
        }),
    ]);
    let st = g.state();
    let Some(skein_core::Message::Tool { content, .. }) = st.transcript.last() else {
        panic!(
            "the follow-up's result is in the transcript: {:?}",
            st.transcript.last()
        )
    };
    let v: serde_json::Value = serde_json::from_str(content).unwrap();
    assert_eq!(v["result"], "± 2");
    assert_eq!(v["clarification_id"], "c2");
    assert_eq!(v["turns_remaining"], c.max_steps - 2);
    assert_eq!(v["agent_name"], "expert");
}
