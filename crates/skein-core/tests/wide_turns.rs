//! Given a wide turn (more calls than the fold reads through, so their slots are found by
//! index), when its children settle in any order, then the fold gives what a narrow turn
//! gives: the session waits until the last one settles, and the results join the
//! transcript in the model's order. A repeated call id, a settlement naming a call the
//! turn lacks, and a turn that replaces an earlier one are folded as before.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
mod kit;

use kit::{
    agents, answered, call, child_completed, child_failed, delegated, given, returned, root,
    submitted, turn,
};
use skein_core::state::Status;
use skein_core::{Event, Message, SessionId, SessionState};

fn team() -> skein_core::AgentSet {
    agents(&[("boss", "agents: [expert]\n"), ("expert", "")])
}

fn kid(i: usize) -> SessionId {
    root().child("expert", i as u32)
}

/// One model turn of `call_agent` calls with these ids, in this order.
fn turn_of(ids: impl IntoIterator<Item = String>, mission: &str) -> Event {
    let calls: Vec<(String, serde_json::Value)> = ids
        .into_iter()
        .map(|id| (id, call("expert", mission)))
        .collect();
    let refs: Vec<(&str, &str, serde_json::Value)> = calls
        .iter()
        .map(|(id, args)| (id.as_str(), "call_agent", args.clone()))
        .collect();
    turn(&refs, 1)
}

/// A turn of `n` delegations, call ids `{round}0…`, each delegated to `kid(i + 1)`.
fn wide(n: usize, round: &str) -> Vec<Event> {
    let mut out = vec![turn_of((0..n).map(|i| format!("{round}{i}")), "part")];
    for i in 0..n {
        out.push(delegated(
            &format!("{round}{i}"),
            &kid(i + 1),
            "expert",
            &[],
        ));
    }
    out
}

fn fold(events: Vec<Event>) -> SessionState {
    given(team(), "boss").events(events).state()
}

/// The tool results at the end of the transcript, by call id.
fn results(s: &SessionState) -> Vec<String> {
    s.transcript
        .iter()
        .filter_map(|m| match m {
            Message::Tool { call_id, .. } => Some(call_id.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_wide_turn_settled_out_of_order_waits_for_the_last_child_then_keeps_the_models_order() {
    let n = 40;
    let mut events = vec![submitted("boss")];
    events.extend(wide(n, "c"));
    // Settled in a scrambled order: odd calls backwards, then even calls forwards.
    let order: Vec<usize> = (0..n)
        .rev()
        .filter(|i| i % 2 == 1)
        .chain((0..n).filter(|i| i % 2 == 0))
        .collect();
    for (k, &i) in order.iter().enumerate() {
        events.push(child_completed(&format!("c{i}"), &kid(i + 1), "ok"));
        let s = fold(events.clone());
        if k + 1 < n {
            assert_eq!(s.status, Status::Waiting, "after {} of {n} settled", k + 1);
            assert_eq!(s.outstanding_children().len(), n - k - 1);
        } else {
            assert_eq!(s.status, Status::Running);
            assert!(s.turn.is_empty());
        }
    }
    let s = fold(events);
    let want: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
    assert_eq!(results(&s), want);
}

#[test]
fn a_settlement_for_a_call_the_wide_turn_lacks_or_from_another_child_changes_nothing() {
    let n = 20;
    let mut events = vec![submitted("boss")];
    events.extend(wide(n, "c"));
    let before = fold(events.clone());
    // No such call; and the right call, but a child it was not delegated to.
    events.push(child_completed("nope", &kid(1), "ok"));
    events.push(child_completed("c3", &kid(9), "ok"));
    let after = fold(events);
    assert_eq!(after.turn, before.turn);
    assert_eq!(after.status, Status::Waiting);
    assert_eq!(after.outstanding_children().len(), n);
}

#[test]
fn a_repeated_call_id_in_a_wide_turn_settles_each_of_its_slots() {
    // A log this runtime would not write (it makes call ids unique), folded all the same:
    // two slots share `dup`, delegated to two children; each settlement finds its own.
    let ids = (0..18)
        .map(|i| format!("c{i}"))
        .chain(["dup".to_string(), "dup".to_string()]);
    let mut events = vec![submitted("boss"), turn_of(ids, "x")];
    for i in 0..18 {
        events.push(delegated(&format!("c{i}"), &kid(i + 1), "expert", &[]));
        events.push(child_completed(&format!("c{i}"), &kid(i + 1), "ok"));
    }
    // Both `Delegated` events name `dup`: the fold marks its first slot each time, as it
    // always did, so the second slot stays pending and the turn stays open.
    events.push(delegated("dup", &kid(19), "expert", &[]));
    events.push(delegated("dup", &kid(20), "expert", &[]));
    events.push(child_completed("dup", &kid(20), "second"));
    let s = fold(events.clone());
    assert_eq!(s.turn.len(), 20);
    assert!(
        matches!(&s.turn[18].state, skein_core::state::SlotState::Done { .. }),
        "the first `dup` slot, last delegated to the second child, settles: {:?}",
        s.turn[18].state
    );
    assert!(matches!(
        s.turn[19].state,
        skein_core::state::SlotState::Pending
    ));
    // The first child's settlement no longer fits any slot.
    events.push(child_completed("dup", &kid(19), "first"));
    assert_eq!(fold(events).turn, s.turn);
}

#[test]
fn a_wide_turn_after_another_with_the_same_ids_in_another_order_finds_the_new_slots() {
    // Call ids may come again in a later turn (a provider that numbers its calls per
    // turn). Here the second turn has the first turn's ids, backwards: a lookup left over
    // from the first turn would mark the wrong slot.
    let n = 24;
    let mut events = vec![submitted("boss")];
    events.extend(wide(n, "c"));
    for i in 0..n {
        events.push(child_completed(&format!("c{i}"), &kid(i + 1), "ok"));
    }
    events.push(turn_of((0..n).rev().map(|i| format!("c{i}")), "again"));
    // Only `c0` (now the last slot) is delegated and settles.
    events.push(delegated("c0", &kid(n + 1), "expert", &[]));
    let s = fold(events.clone());
    assert!(matches!(
        s.turn[n - 1].state,
        skein_core::state::SlotState::Delegated { .. }
    ));
    assert!(matches!(
        s.turn[0].state,
        skein_core::state::SlotState::Pending
    ));
    events.push(child_completed("c0", &kid(n + 1), "ok"));
    let s = fold(events.clone());
    assert!(matches!(
        s.turn[n - 1].state,
        skein_core::state::SlotState::Done { .. }
    ));
    assert_eq!(s.status, Status::Running);
    // The rest, settled, close the turn in the model's (backwards) order.
    for i in 1..n {
        events.push(delegated(&format!("c{i}"), &kid(n + i + 1), "expert", &[]));
        events.push(child_completed(&format!("c{i}"), &kid(n + i + 1), "ok"));
    }
    events.push(answered("all done"));
    let s = fold(events);
    let mut want: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
    want.extend((0..n).rev().map(|i| format!("c{i}")));
    assert_eq!(results(&s), want);
    assert_eq!(s.ending.pending_answer.as_deref(), Some("all done"));
}

/// What the session's status is, read from the turn slot by slot (as the fold once did
/// for every event) rather than from the fold's running count.
fn status_by_reading_the_turn(s: &SessionState) -> Status {
    use skein_core::state::SlotState;
    if s.status.is_terminal() || s.status == Status::New {
        return s.status;
    }
    let any = |f: fn(&SlotState) -> bool| s.turn.iter().any(|x| f(&x.state));
    if any(|x| matches!(x, SlotState::Asked { .. })) {
        Status::AwaitingInput
    } else if any(|x| matches!(x, SlotState::AwaitingApproval { .. })) {
        Status::AwaitingApproval
    } else if any(|x| matches!(x, SlotState::Delegated { .. }))
        && !any(|x| {
            matches!(
                x,
                SlotState::Pending | SlotState::Running | SlotState::Approved
            )
        })
    {
        Status::Waiting
    } else {
        Status::Running
    }
}

#[test]
fn a_wide_mixed_turn_has_the_status_a_slot_by_slot_reading_gives_after_every_event() {
    // 30 delegations and 10 plain tool calls in one turn; the tool calls return between
    // the delegations and the settlements (one child fails), then a second turn follows.
    let (n, tools) = (30, 10);
    let mut calls: Vec<(String, String, serde_json::Value)> = (0..n)
        .map(|i| (format!("c{i}"), "call_agent".into(), call("expert", "part")))
        .collect();
    calls.extend((0..tools).map(|i| (format!("t{i}"), "list_dir".into(), serde_json::json!({}))));
    let refs: Vec<(&str, &str, serde_json::Value)> = calls
        .iter()
        .map(|(id, name, args)| (id.as_str(), name.as_str(), args.clone()))
        .collect();
    let mut events = vec![submitted("boss"), turn(&refs, 1)];
    for i in 0..n {
        events.push(delegated(&format!("c{i}"), &kid(i + 1), "expert", &[]));
        if i % 3 == 0 {
            events.push(returned(&format!("t{}", i / 3), "a.txt"));
        }
    }
    for i in (0..n).rev() {
        events.push(if i == 7 {
            child_failed(&format!("c{i}"), &kid(i + 1), "no")
        } else {
            child_completed(&format!("c{i}"), &kid(i + 1), "ok")
        });
    }
    events.extend(wide(20, "d"));
    let mut seen = std::collections::BTreeSet::new();
    for k in 1..=events.len() {
        let s = fold(events[..k].to_vec());
        assert_eq!(
            s.status,
            status_by_reading_the_turn(&s),
            "after {k} of {} events",
            events.len()
        );
        seen.insert(format!("{:?}", s.status));
    }
    // The run went through each of the states the count decides between.
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["Running", "Waiting"],
        "statuses seen"
    );
}
