//! Where features meet: who answers a pattern child's question, what may join a log after
//! its end, which children an ended session leaves behind, and which agents never join an
//! identical run under way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::*;
use serde_json::{json, Value};
use skein_core::event::{
    Cancelled, ChildSettled, ClarificationRequested, InputProvided, Outcome, ParentRef,
};
use skein_core::{Envelope, Event, SessionState};

/// The fold of a session `id` whose parent started it for `call`.
fn child_of(call: Option<&str>, extra: &[Event]) -> SessionState {
    let mut sub = match submitted_with("target", 1, &["boss"], None) {
        Event::Submitted(s) => s,
        _ => unreachable!(),
    };
    let id = match call {
        Some(c) => {
            sub.parent = Some(ParentRef {
                session: root(),
                call: c.into(),
                pool: None,
            });
            root().child("target", 1)
        }
        None => root(),
    };
    let mut log = vec![Event::Submitted(sub)];
    log.extend(extra.iter().cloned());
    let envs: Vec<Envelope> = log
        .into_iter()
        .enumerate()
        .map(|(i, e)| Envelope::new(id.clone(), i as u64 + 1, 1, String::new(), e))
        .collect();
    SessionState::fold(&envs)
}

#[test]
fn a_person_answers_the_questions_of_a_root_and_of_every_pattern_child_but_not_of_a_call() {
    assert!(child_of(None, &[]).asks_a_person(), "a root");
    for call in ["handoff.2", "route.1", "member.3", "supervisor.4"] {
        assert!(child_of(Some(call), &[]).asks_a_person(), "{call}");
    }
    // A `call_agent` child's question goes to its parent's model; an advisor's question
    // becomes a failure note of its advice.
    for call in ["c1", "call_7", "advisor.1"] {
        assert!(!child_of(Some(call), &[]).asks_a_person(), "{call}");
    }
}

fn provided() -> Event {
    Event::InputProvided(InputProvided {
        answers: json!({}),
        token_id: "t".into(),
        by: None,
    })
}

#[test]
fn nothing_joins_a_log_after_its_end_but_a_follow_up_to_a_completed_session() {
    let open = child_of(None, &[]);
    assert!(open.admits_from_outside(&provided()).is_ok());
    let cancelled = child_of(
        None,
        &[Event::Cancelled(Cancelled {
            reason: "stopped by a person".into(),
        })],
    );
    let why = cancelled.admits_from_outside(&provided()).unwrap_err();
    assert!(
        why.contains("has ended (cancelled: stopped by a person)"),
        "{why}"
    );
    assert!(why.contains("tokens no longer answer"), "{why}");
    let follow_up = Event::ClarificationRequested(ClarificationRequested {
        from: root(),
        call: "c9".into(),
        question: "which one?".into(),
    });
    assert!(cancelled.admits_from_outside(&follow_up).is_err());
    let completed = child_of(
        Some("c1"),
        &[
            answered("done"),
            Event::completed("done", Default::default(), 1),
        ],
    );
    assert!(completed.admits_from_outside(&follow_up).is_ok());
    assert!(completed.admits_from_outside(&provided()).is_err());
}

#[test]
fn an_ended_session_leaves_behind_the_children_nobody_reads_any_more() {
    let asking = root().child("researcher", 1);
    let done = root().child("researcher", 2);
    let g = given(
        agents(&[("boss", "agents: [researcher]\n"), ("researcher", "")]),
        "boss",
    )
    .events([
        submitted("boss"),
        turn(
            &[
                ("c1", "call_agent", call("researcher", "a")),
                ("c2", "call_agent", call("researcher", "b")),
            ],
            10,
        ),
        delegated("c1", &asking, "researcher", &[]),
        delegated("c2", &done, "researcher", &[]),
        Event::ChildSettled(ChildSettled {
            call: "c1".into(),
            child: asking.clone(),
            outcome: Outcome::NeedsInput {
                questions: json!(["which year?"]),
                context: None,
                defaults: Value::Null,
                token: String::new(),
                token_id: "tok".into(),
                seq: 3,
                usage: Default::default(),
            },
        }),
        child_completed("c2", &done, "found it"),
    ]);
    assert!(g.state().abandoned_children().is_empty(), "it still runs");
    // The model answers without resuming the child that asked: it is left behind.
    let g = g.events([
        answered("my answer"),
        Event::completed("my answer", Default::default(), 2),
    ]);
    assert_eq!(g.state().abandoned_children(), vec![asking]);
}

#[test]
fn the_agents_a_session_may_start_are_reachable_through_calls_and_patterns() {
    let set = agents(&[
        ("a", "recursive: true\nagents: [b]\n"),
        ("b", "recursive: true\nagents: [a]\n"),
        ("top", "agents: [a, leaf]\n"),
        ("leaf", ""),
        ("chain1", "handoff: chain2\n"),
        ("chain2", ""),
    ]);
    assert!(
        set.reachable("a").contains("a"),
        "a recursive pair reaches itself"
    );
    assert!(!set.reachable("leaf").contains("leaf"));
    assert_eq!(
        set.reachable("chain1").into_iter().collect::<Vec<_>>(),
        ["chain2"]
    );
    assert_eq!(
        set.reachable("top").into_iter().collect::<Vec<_>>(),
        ["a", "b", "leaf"]
    );
}
