//! Given a log, when it is folded, then: what a parent counts of a child asked a follow-up
//! question, what a log keeps of a paused child's resume token (and how an old log that
//! kept the token itself still folds), and an approved delegation becoming a delegation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use skein_core::decide::Step;
use skein_core::event::{
    ApprovalGiven, ChildSettled, ClarificationRequested, Delegated, DelegationKind, ModelCalled,
    Outcome, Submitted,
};
use skein_core::state::ChildOutcome;
use skein_core::token::{peek, reference, Claims, REF_PREFIX};
use skein_core::{
    AgentSet, Budget, Envelope, Event, Limits, Message, ModelResponse, SessionId, SessionState,
    ToolCall, Usage,
};

fn agents() -> AgentSet {
    let f = |name: &str, extra: &str| {
        (
            format!("{name}.md"),
            format!("---\nname: {name}\nmodel: scripted:{name}\n{extra}---\nYou are {name}.\n"),
        )
    };
    AgentSet::load(
        &[
            f(
                "boss",
                "agents: [expert]\ntools: [ask_clarification]\nrequires_approval: [call_agent]\n",
            ),
            f("expert", "chat: true\n"),
        ],
        &[],
    )
    .unwrap()
}

fn root() -> SessionId {
    SessionId::root("r1").unwrap()
}

fn child() -> SessionId {
    root().child("expert", 1)
}

fn usage(input: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
        ..Usage::default()
    }
}

fn submitted(budget: Option<u64>) -> Event {
    Event::Submitted(Submitted {
        def_digest: "d".into(),
        mission: "m".into(),
        mission_hash: "h".into(),
        budget: Budget {
            tokens: budget,
            max_steps: None,
        },
        ..Submitted::for_test("boss")
    })
}

fn turn(call: &str, tool: &str, args: Value, u: Usage) -> Event {
    Event::ModelCalled(ModelCalled {
        model: "scripted:boss".into(),
        request_digest: String::new(),
        response: ModelResponse {
            content: None,
            tool_calls: vec![ToolCall {
                id: call.into(),
                name: tool.into(),
                args,
            }],
            finish_reason: None,
        },
        usage: u,
        latency_ms: 0,
        worker: String::new(),
    })
}

fn delegated(call: &str, resumed: bool) -> Event {
    Event::Delegated(Delegated {
        call: call.into(),
        child: child(),
        agent: "expert".into(),
        mission_hash: "x".into(),
        allotted_tokens: None,
        kind: if resumed {
            skein_core::event::DelegationKind::Resumed
        } else {
            skein_core::event::DelegationKind::Started
        },
        owns_tasks: vec![],
        max_steps: None,
    })
}

fn completed(call: &str, answer: &str, u: Usage) -> Event {
    Event::ChildSettled(ChildSettled {
        call: call.into(),
        child: child(),
        outcome: Outcome::Completed {
            answer: answer.into(),
            patch: None,
            usage: u,
            steps: 1,
            partial: false,
        },
    })
}

fn fold(events: Vec<Event>) -> SessionState {
    let envs: Vec<Envelope> = events
        .into_iter()
        .enumerate()
        .map(|(i, e)| Envelope::new(root(), i as u64 + 1, 1, String::new(), e))
        .collect();
    SessionState::fold(&envs)
}

#[test]
fn a_child_that_answers_a_follow_up_is_counted_once_in_the_total_and_the_budget() {
    let s = fold(vec![
        submitted(Some(1000)),
        turn(
            "c1",
            "call_agent",
            json!({"agent": "expert", "mission": "estimate"}),
            usage(10, 5),
        ),
        delegated("c1", false),
        // The child's whole usage when it first answered.
        completed("c1", "42", usage(100, 20)),
        turn(
            "c2",
            "ask_clarification",
            json!({"session_id": child().display(), "question": "error bars?"}),
            usage(10, 5),
        ),
        delegated("c2", true),
        // Its whole usage after the follow-up: the first run and the follow-up.
        completed("c2", "plus or minus 3", usage(160, 30)),
    ]);
    assert_eq!(s.accounting.usage_children.input_tokens, 160);
    assert_eq!(s.accounting.usage_children.output_tokens, 30);
    assert_eq!(s.usage_total().total_tokens(), 30 + 190);
    assert_eq!(s.tokens_free(), Some(1000 - 220));
}

#[test]
fn a_follow_up_is_counted_so_the_answer_after_it_is_not_taken_for_the_missions() {
    let mut s = fold(vec![submitted(None)]);
    assert_eq!(s.follow_ups, 0);
    s.apply(&Envelope::new(
        root(),
        2,
        1,
        String::new(),
        Event::ClarificationRequested(ClarificationRequested {
            from: root(),
            call: "c".into(),
            question: "q".into(),
        }),
    ));
    assert_eq!(s.follow_ups, 1);
}

fn settled_needing_input(outcome: Outcome) -> SessionState {
    fold(vec![
        submitted(None),
        turn(
            "c1",
            "call_agent",
            json!({"agent": "expert", "mission": "estimate"}),
            usage(1, 1),
        ),
        delegated("c1", false),
        Event::ChildSettled(ChildSettled {
            call: "c1".into(),
            child: child(),
            outcome,
        }),
    ])
}

fn tool_result(s: &SessionState) -> Value {
    let Some(Message::Tool { content, .. }) = s.transcript.last() else {
        panic!("no tool result: {:?}", s.transcript)
    };
    serde_json::from_str(content).unwrap()
}

#[test]
fn a_paused_child_is_recorded_by_its_token_id_and_shown_as_a_reference() {
    let s = settled_needing_input(Outcome::NeedsInput {
        questions: json!(["which?"]),
        context: None,
        defaults: Value::Null,
        token: String::new(),
        token_id: "abc123".into(),
        seq: 3,
        usage: Default::default(),
    });
    let shown = tool_result(&s);
    let r = shown["resume_token"].as_str().unwrap();
    assert!(r.starts_with(REF_PREFIX), "{shown}");
    let want = Claims {
        session: child(),
        seq: 3,
        nonce: "abc123".into(),
        kind: skein_core::token::TokenKind::Input,
    };
    assert_eq!(peek(r).unwrap(), want);
    assert_eq!(r, reference(&want));
    assert!(s.pauses.resume_refs.contains(r));
}

#[test]
fn an_old_log_that_kept_the_token_itself_still_folds_and_shows_it() {
    // The body as an older build wrote it: `token`, no `token_id`, no `seq`.
    let old = json!({
        "type": "ChildSettled",
        "data": {
            "call": "c1",
            "child": child(),
            "outcome": {
                "status": "needs_input",
                "questions": ["which?"],
                "token": "skt1.aa.bb",
            },
        },
    });
    let body: Event = serde_json::from_value(old).unwrap();
    let env = Envelope::new(root(), 4, 1, String::new(), body);
    let decoded = Envelope::decode(&env.encode().unwrap()).unwrap();
    let Event::ChildSettled(c) = decoded.body else {
        panic!("not a ChildSettled")
    };
    let s = settled_needing_input(c.outcome);
    assert_eq!(tool_result(&s)["resume_token"], "skt1.aa.bb");
    assert!(s.pauses.resume_refs.is_empty());
}

#[test]
fn an_approved_delegation_is_started_and_a_denied_one_is_a_tool_error() {
    let set = agents();
    let boss = set.get("boss").unwrap();
    let limits = Limits::default();
    let asked = vec![
        submitted(None),
        turn(
            "c1",
            "call_agent",
            json!({"agent": "expert", "mission": "estimate"}),
            usage(1, 1),
        ),
    ];
    let s = fold(asked.clone());
    assert!(
        matches!(s.next(boss, &limits, &set), Step::RequestApproval(_)),
        "{:?}",
        s.next(boss, &limits, &set)
    );
    let with = |approved: bool| {
        let mut events = asked.clone();
        events.push(Event::ApprovalRequested(
            skein_core::event::ApprovalRequested {
                call: "c1".into(),
                tool: "call_agent".into(),
                preview: String::new(),
                token_id: "t".into(),
            },
        ));
        events.push(Event::ApprovalGiven(ApprovalGiven {
            call: "c1".into(),
            approved,
            by: Some("ops".into()),
            reason: Some("not now".into()),
            token_id: "t".into(),
        }));
        fold(events)
    };
    match with(true).next(boss, &limits, &set) {
        Step::Delegate(ds) => {
            assert_eq!(ds.len(), 1);
            assert_eq!(ds[0].child, child());
            assert_eq!(ds[0].mission, "estimate");
        }
        other => panic!("an approved delegation: {other:?}"),
    }
    let denied = with(false);
    let Some(Message::Tool {
        content, is_error, ..
    }) = denied.transcript.last()
    else {
        panic!("no tool result")
    };
    assert!(*is_error);
    assert!(
        content.contains("`call_agent` was denied by ops: not now"),
        "{content}"
    );
}

/// A `Delegated` as logs store it (and as every log before `DelegationKind` stored it):
/// the kind as two flags.
fn stored_delegation(call: &str, shared: bool, resumed: bool) -> Event {
    let stored = json!({
        "type": "Delegated",
        "data": {
            "call": call,
            "child": child(),
            "agent": "expert",
            "mission_hash": "x",
            "allotted_tokens": null,
            "shared": shared,
            "resumed": resumed,
        }
    });
    let bytes = rmp_serde::to_vec_named(&stored).unwrap();
    rmp_serde::from_slice(&bytes).unwrap()
}

#[test]
fn delegations_stored_as_two_flags_fold_to_their_kind() {
    let first = stored_delegation("c1", false, false);
    let again = stored_delegation("c2", false, true);
    let Event::Delegated(d) = &again else {
        panic!("not a delegation: {again:?}")
    };
    assert_eq!(d.kind, DelegationKind::Resumed);
    // The follow-up's usage is counted once, as with delegations built in memory.
    let s = fold(vec![
        submitted(Some(1000)),
        turn(
            "c1",
            "call_agent",
            json!({"agent": "expert", "mission": "estimate"}),
            usage(10, 5),
        ),
        first,
        completed("c1", "42", usage(100, 20)),
        turn(
            "c2",
            "ask_clarification",
            json!({"session_id": child().display(), "question": "error bars?"}),
            usage(10, 5),
        ),
        again,
        completed("c2", "plus or minus 3", usage(160, 30)),
    ]);
    assert_eq!(s.accounting.usage_children.input_tokens, 160);
    assert_eq!(
        s.accounting.delegations, 1,
        "a resumed child is not a new delegation"
    );
    assert_eq!(s.children["c2"].outcome, Some(ChildOutcome::Completed));

    // A shared run: what it cost is what this call saved, not what it spent.
    let s = fold(vec![
        submitted(None),
        turn(
            "c1",
            "call_agent",
            json!({"agent": "expert", "mission": "estimate"}),
            usage(1, 1),
        ),
        stored_delegation("c1", true, false),
        completed("c1", "42", usage(100, 20)),
    ]);
    assert!(s.children["c1"].shared);
    assert_eq!(s.accounting.usage_children.total_tokens(), 0);
    assert_eq!(s.accounting.saved.total_tokens(), 120);
}

#[test]
fn a_delegation_is_stored_as_the_two_flags_and_both_at_once_is_refused() {
    let Event::Delegated(mut d) = delegated("c1", false) else {
        unreachable!()
    };
    d.kind = DelegationKind::Shared;
    let stored: Value =
        rmp_serde::from_slice(&rmp_serde::to_vec_named(&Event::Delegated(d)).unwrap()).unwrap();
    assert_eq!(stored["data"]["shared"], true);
    assert_eq!(stored["data"]["resumed"], false);
    assert!(stored["data"].get("kind").is_none(), "{stored}");

    let both = json!({"type": "Delegated", "data": {
        "call": "c1", "child": child(), "agent": "expert", "mission_hash": "x",
        "shared": true, "resumed": true}});
    let bytes = rmp_serde::to_vec_named(&both).unwrap();
    let err = rmp_serde::from_slice::<Event>(&bytes).unwrap_err();
    assert!(
        err.to_string().contains("not both shared and resumed"),
        "{err}"
    );
}

#[test]
fn the_grouped_state_still_shows_as_one_flat_object() {
    // `skein replay --json` and the UI's state view show the fold: its groups add no level.
    let s = settled_needing_input(Outcome::Failed {
        error: "no".into(),
        usage: usage(3, 4),
        steps: 1,
    });
    let shown = serde_json::to_value(&s).unwrap();
    for key in [
        "usage_own",
        "usage_children",
        "model_failures",
        "pending_inputs",
        "resume_refs",
        "plan",
        "plan_verdicts",
        "pattern",
        "pattern_error",
        "handed_off",
        "team_ran",
        "team_queue",
        "answer",
        "error",
        "pending_answer",
        "summary",
        "full_answer",
    ] {
        assert!(shown.get(key).is_some(), "no `{key}` in {shown}");
    }
    for group in [
        "ending",
        "accounting",
        "failures",
        "pauses",
        "planning",
        "team",
    ] {
        assert!(shown.get(group).is_none(), "`{group}` shown as a level");
    }
    assert_eq!(shown["usage_children"]["input_tokens"], 3);
}

#[test]
fn a_session_or_parent_naming_no_pool_runs_in_the_default_one() {
    let own = Submitted {
        pool: Some("gpu".into()),
        ..Submitted::for_test("boss")
    };
    assert_eq!(own.pool(), "gpu");
    assert_eq!(Submitted::for_test("boss").pool(), "default");
    let parent = skein_core::event::ParentRef {
        session: root(),
        call: "c1".into(),
        pool: None,
    };
    assert_eq!(parent.pool(), skein_core::event::DEFAULT_POOL);
    assert_eq!(SessionState::default().pool(), "default");
    assert_eq!(fold(vec![Event::Submitted(own)]).pool(), "gpu");
}
