//! Given calls that shared runs other sessions started, when those runs were cancelled by
//! their starters, then each call delegates again to the child its own delegation was
//! numbered for (which sharing left uncreated): the same child whichever calls are
//! decided together, so a step run again after a crash, with more calls to redo than its
//! first try had, takes each child it created for the call it was created for.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::{agents, call, given, root, submitted, turn};
use skein_core::event::{Delegated, DelegationKind};
use skein_core::{Event, Limits, SessionId};

fn shared(call: &str, run: &SessionId) -> Event {
    Event::Delegated(Delegated {
        call: call.into(),
        child: run.clone(),
        agent: "expert".into(),
        mission_hash: "x".into(),
        allotted_tokens: None,
        kind: DelegationKind::Shared,
        owns_tasks: vec![],
        max_steps: None,
    })
}

#[test]
fn each_call_delegates_again_to_its_own_number_whichever_calls_go_together() {
    let set = agents(&[("boss", "agents: [expert]\n"), ("expert", "")]);
    let other = SessionId::parse("other").unwrap();
    let g = given(set.clone(), "boss").events([
        submitted("boss"),
        turn(
            &[
                ("a", "call_agent", call("expert", "one")),
                ("b", "call_agent", call("expert", "two")),
            ],
            1,
        ),
        shared("a", &other.child("expert", 1)),
        shared("b", &other.child("expert", 2)),
    ]);
    let state = g.state();
    let def = set.get("boss").unwrap();
    let limits = Limits::default();
    let again = |calls: &[&str]| {
        let calls: Vec<String> = calls.iter().map(|c| c.to_string()).collect();
        state
            .delegations_again(def, &limits, &set, &calls)
            .into_iter()
            .map(|d| (d.call, d.child))
            .collect::<Vec<_>>()
    };
    let a = ("a".to_string(), root().child("expert", 1));
    let b = ("b".to_string(), root().child("expert", 2));
    assert_eq!(again(&["b"]), vec![b.clone()]);
    assert_eq!(again(&["a"]), vec![a.clone()]);
    assert_eq!(again(&["a", "b"]), vec![a, b]);
}
