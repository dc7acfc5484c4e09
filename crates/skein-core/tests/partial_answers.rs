//! An answer made without some child's answer is partial, and a partial answer is never
//! cached: a fresh run of the same mission might have had that child's answer. A child
//! that failed or was cancelled (a transient failure, a timeout under a slow provider, a
//! person's cancel, another tree's cancel it could not redo) makes it so; so does a
//! child's own partial answer, at any depth. A team's members cut off when its supervisor
//! answered take nothing from the answer (features: cache, cancel, patterns).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::{agents, call, child_completed, child_failed, delegated, given, root, submitted, turn};
use skein_core::event::{ChildSettled, Outcome};
use skein_core::{AgentSet, Event, SessionState, Usage};

fn set() -> AgentSet {
    agents(&[
        ("boss", "agents: [helper]\n"),
        ("helper", ""),
        (
            "lead",
            "team: {members: [analyst, coder], supervisor: chief}\n",
        ),
        ("analyst", ""),
        ("coder", ""),
        ("chief", ""),
    ])
}

/// The boss's two calls of one turn, delegated, with `a`'s and `b`'s settlements.
fn boss_with(a: Event, b: Event) -> SessionState {
    let (h1, h2) = (root().child("helper", 1), root().child("helper", 2));
    given(set(), "boss")
        .events([
            submitted("boss"),
            turn(
                &[
                    ("a", "call_agent", call("helper", "one")),
                    ("b", "call_agent", call("helper", "two")),
                ],
                1,
            ),
            delegated("a", &h1, "helper", &[]),
            delegated("b", &h2, "helper", &[]),
            a,
            b,
        ])
        .state()
}

fn partial_completion(child: &skein_core::SessionId, call: &str) -> Event {
    Event::ChildSettled(ChildSettled {
        call: call.into(),
        child: child.clone(),
        outcome: Outcome::Completed {
            answer: "half of it".into(),
            patch: None,
            usage: Usage::default(),
            steps: 1,
            partial: true,
        },
    })
}

fn completion_is_partial(s: &SessionState) -> bool {
    match s.completion("done") {
        Event::Completed(c) => c.partial,
        e => panic!("{e:?}"),
    }
}

#[test]
fn an_answer_is_partial_when_a_child_failed_or_answered_partially_and_not_otherwise() {
    let (h1, h2) = (root().child("helper", 1), root().child("helper", 2));
    let whole = boss_with(
        child_completed("a", &h1, "x"),
        child_completed("b", &h2, "y"),
    );
    assert!(!whole.accounting.partial);
    assert!(!completion_is_partial(&whole));

    let failed = boss_with(
        child_completed("a", &h1, "x"),
        child_failed("b", &h2, "cancelled: by an operator"),
    );
    assert!(failed.accounting.partial);
    assert!(completion_is_partial(&failed));

    // A child's partial answer makes this one partial too: the flag climbs the tree.
    let below = boss_with(child_completed("a", &h1, "x"), partial_completion(&h2, "b"));
    assert!(below.accounting.partial);
    assert!(completion_is_partial(&below));
}

#[test]
fn a_partial_answer_is_written_with_its_end_and_read_back_from_older_logs_as_whole() {
    let mut e = SessionState::default().completion("done");
    if let Event::Completed(c) = &mut e {
        c.partial = true;
    }
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(json["data"]["partial"], true, "{json}");
    // An older log has no such field; a whole answer writes none.
    let whole = SessionState::default().completion("done");
    let json = serde_json::to_value(&whole).unwrap();
    assert!(json["data"].get("partial").is_none(), "{json}");
    let back: Event = serde_json::from_value(json).unwrap();
    assert_eq!(back, whole);
}

#[test]
fn a_team_member_cut_off_by_the_supervisors_answer_takes_nothing_from_it() {
    let started = given(set(), "lead")
        .events([submitted("lead")])
        .when_deciding()
        .then_orchestrates();
    let (analyst, coder, chief) = (
        root().child("analyst", 1),
        root().child("coder", 2),
        root().child("chief", 3),
    );
    let team = || {
        given(set(), "lead").events([
            submitted("lead"),
            started.clone(),
            delegated("member.1", &analyst, "analyst", &[]),
            delegated("member.2", &coder, "coder", &[]),
            delegated("supervisor.3", &chief, "chief", &[]),
        ])
    };
    // The supervisor answers; the members still running are cancelled then.
    let ended = team().events([
        child_completed("supervisor.3", &chief, "the team's answer"),
        child_failed(
            "member.1",
            &analyst,
            "cancelled: the team's supervisor has answered",
        ),
        child_failed(
            "member.2",
            &coder,
            "cancelled: the team's supervisor has answered",
        ),
    ]);
    assert!(!ended.state().accounting.partial);
    // One that ended as it was cut off, with a partial answer of its own, neither.
    let raced = team().events([
        child_completed("supervisor.3", &chief, "the team's answer"),
        partial_completion(&analyst, "member.1"),
    ]);
    assert!(!raced.state().accounting.partial);
    // A member that failed while the team still worked is missing from the answer.
    let short = team().events([
        child_failed("member.1", &analyst, "the model failed"),
        child_completed("supervisor.3", &chief, "the team's answer"),
        child_failed(
            "member.2",
            &coder,
            "cancelled: the team's supervisor has answered",
        ),
    ]);
    assert!(short.state().accounting.partial);
}
