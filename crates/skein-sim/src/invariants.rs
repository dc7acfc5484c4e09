//! The invariants checked after every run, over every log the run left.

use std::collections::{BTreeMap, BTreeSet};

use skein_core::event::Outcome;
use skein_core::replay::verify;
use skein_core::{AgentDef, Event, SessionId, SessionState, Usage};

use crate::world::Run;

/// What a run left: the violations found (empty when every invariant holds) and counts
/// of what it exercised.
#[derive(Debug, Default)]
pub struct Verdict {
    pub violations: Vec<String>,
    pub sessions: usize,
    pub events: usize,
    /// Events by kind, over every log.
    pub kinds: BTreeMap<String, u64>,
    pub failed_roots: usize,
    /// The session whose job was claimed most often in the run, and how often.
    pub most_claimed: Option<(SessionId, u64)>,
}

/// How many times one session's job may be claimed in a run: [`CLAIMS_BASE`], and one
/// more for every [`CLAIMS_EVERY_MS`] of the run's virtual time. A session is woken by
/// each child that ends, each answer, approval and cancel, each redelivery after a crash
/// or a lost lease, and at its deadline; one that waits for a model's quota comes back
/// for it again and again, at least 25 ms apart (the shortest wait it is handed back
/// for, 50 ms, less the 25 ms it comes back early). In the 20,000 worlds CI runs the most
/// was 436; the largest counts are sessions that waited a minute or two for quota. A
/// session woken again and again with nothing to do was claimed every few milliseconds:
/// 130,574 times in one run.
pub const CLAIMS_BASE: u64 = 200;
pub const CLAIMS_EVERY_MS: u64 = 25;

/// Checks every log of the run.
pub async fn check(run: &Run) -> Verdict {
    let mut v = Verdict::default();
    let b = run.store.backend();
    let limits = run.limits.clone();
    for root in &run.roots {
        match run.logs.get(root).and_then(|l| l.last()) {
            Some(r) if r.env.body.is_terminal() => {
                if !matches!(r.env.body, Event::Completed(_)) {
                    v.failed_roots += 1;
                }
            }
            Some(r) => v.violations.push(format!(
                "{root}: the tree did not end (its last event is {} at seq {})",
                r.env.body.kind(),
                r.env.seq
            )),
            None => v
                .violations
                .push(format!("{root}: submitted but has no log")),
        }
    }
    announced_once(run, &mut v);
    v.most_claimed = run.store.most_claimed();
    if let Some((id, n)) = &v.most_claimed {
        let bound = CLAIMS_BASE + run.virtual_ms / CLAIMS_EVERY_MS;
        if *n > bound {
            v.violations.push(format!(
                "{id}: its job was claimed {n} times in {} virtual ms (more than {bound}): \
                 it is woken again and again",
                run.virtual_ms
            ));
        }
    }
    if let Some(q) = &run.quota {
        crate::quota::check(q, &mut v);
    }
    for root in &run.unlisted {
        v.violations.push(format!(
            "{root}: the tree had not ended when the run's time was up, and nothing of it \
             was in the inbox"
        ));
    }
    for (id, recs) in &run.logs {
        v.sessions += 1;
        v.events += recs.len();
        for r in recs {
            *v.kinds.entry(r.env.body.kind().to_string()).or_default() += 1;
        }
        let mut bad = |what: String| v.violations.push(format!("{id}: {what}"));
        if let Err(e) = skein_core::event::verify_chain(id, recs) {
            bad(format!("hash chain broken: {e:?}"));
            continue;
        }
        for (i, r) in recs.iter().enumerate() {
            if r.env.seq != i as u64 + 1 {
                bad(format!("record {} has seq {}", i + 1, r.env.seq));
            }
        }
        let terminal: Vec<usize> = recs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.env.body.is_terminal())
            .map(|(i, _)| i)
            .collect();
        // A `chat: true` session that answered may be asked again: a follow-up question
        // (`ClarificationRequested`) reopens it, and it ends once more. Nothing else
        // follows an end.
        let reopened = |i: &usize| {
            matches!(
                recs.get(*i + 1).map(|r| &r.env.body),
                Some(Event::ClarificationRequested(_))
            )
        };
        let closing: Vec<&usize> = terminal.iter().filter(|i| !reopened(i)).collect();
        if closing.len() > 1 {
            bad(format!("{} terminal events", terminal.len()));
        }
        if closing.first().is_some_and(|i| **i + 1 != recs.len()) {
            bad("events after its terminal event".into());
        }
        let Some(Event::Submitted(sub)) = recs.first().map(|r| &r.env.body) else {
            bad("does not start with Submitted".into());
            continue;
        };
        match b.def_text(&sub.def_digest).await {
            Ok(text) => match AgentDef::parse("stored", &text) {
                Ok(def) => {
                    let envs: Vec<_> = recs.iter().map(|r| r.env.clone()).collect();
                    let agents = run.mix.as_ref().map_or_else(
                        || run.agents.clone(),
                        |m| m.agents_of(sub.defs.as_deref(), &run.agents),
                    );
                    if let Err(d) = verify(&envs, &def, &limits, agents.as_ref()) {
                        bad(format!("replay diverges: {d}"));
                    }
                }
                Err(e) => bad(format!("its stored definition does not parse: {e}")),
            },
            Err(e) => bad(format!("its definition is not stored: {e}")),
        }
        // Depth: one under its parent's (its parent's own, for a handoff's or a route's
        // next agent, which takes over rather than nests), and within the limit.
        let expected = match &sub.parent {
            None => 0,
            Some(p) => {
                let parent_depth = run
                    .logs
                    .get(&p.session)
                    .and_then(|r| match r.first().map(|r| &r.env.body) {
                        Some(Event::Submitted(ps)) => Some(ps.depth),
                        _ => None,
                    })
                    .unwrap_or(0);
                let transfer = matches!(
                    skein_core::state::PatternKind::of_call(&p.call),
                    Some(
                        skein_core::state::PatternKind::Handoff
                            | skein_core::state::PatternKind::Route
                    )
                );
                parent_depth + u32::from(!transfer)
            }
        };
        if sub.depth != expected || sub.depth > limits.max_depth {
            bad(format!(
                "runs at depth {} (its parent's depth makes it {expected}, the limit is {})",
                sub.depth, limits.max_depth
            ));
        }
        // Budget: no model call once the session's tokens were spent, and no child given
        // more than was free.
        if sub.budget.tokens.is_some() {
            for i in 1..recs.len() {
                let before = || {
                    let envs: Vec<_> = recs[..i].iter().map(|r| r.env.clone()).collect();
                    SessionState::fold(&envs)
                };
                match &recs[i].env.body {
                    Event::ModelCalled(_) if before().tokens_free() == Some(0) => bad(format!(
                        "model called at seq {} with its token budget spent",
                        i + 1
                    )),
                    Event::Delegated(d) => {
                        if let (Some(a), Some(free)) = (d.allotted_tokens, before().tokens_free()) {
                            if a > free {
                                bad(format!("gave {} {a} tokens, {free} were free", d.child));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        // A cache hit answers what its source's run answered, for the same mission.
        for r in recs {
            let Event::CacheHit(h) = &r.env.body else {
                continue;
            };
            let source = run.logs.get(&h.source);
            let same_mission = matches!(
                source.and_then(|l| l.first()).map(|r| &r.env.body),
                Some(Event::Submitted(s)) if s.mission_hash == h.mission_hash
            );
            let answered = source
                .and_then(|l| mission_answer(l))
                .is_some_and(|a| a == h.answer);
            // What a person told the source is not what a fresh run would answer.
            let asked = source.is_some_and(|l| {
                l.iter()
                    .any(|r| matches!(r.env.body, Event::InputProvided(_)))
            });
            if asked {
                bad(format!(
                    "cache hit for {} answers from {}, whose answer came from a person",
                    h.call, h.source
                ));
            }
            // Made with the definitions this call runs on: the agent's own and those of
            // every agent it may start (where versions of the definitions differ).
            if let (Some(m), Some(Event::Submitted(src))) = (
                &run.mix,
                source.and_then(|l| l.first()).map(|r| &r.env.body),
            ) {
                let mine = m.agents_of(sub.defs.as_deref(), &run.agents);
                let theirs = m.agents_of(src.defs.as_deref(), &run.agents);
                if let Some(other) = defined_otherwise(&mine, &theirs, &src.agent) {
                    bad(format!(
                        "cache hit for {} answers from {}, whose run had another definition \
                         of {other}",
                        h.call, h.source
                    ));
                }
            }
            if !same_mission || !answered {
                bad(format!(
                    "cache hit for {} does not answer what {} answered for that mission",
                    h.call, h.source
                ));
            }
        }
        // A tool that is not idempotent ran at most as often as calls of it were started.
        let started = recs
            .iter()
            .filter(|r| matches!(&r.env.body, Event::ToolCalled(t) if t.tool == "append_note"))
            .count() as u32;
        let ran = run.writes.get(id).copied().unwrap_or(0);
        if ran > started {
            bad(format!(
                "append_note ran {ran} times for {started} started calls"
            ));
        }
        // A token is used at most once.
        let mut tokens = BTreeSet::new();
        for r in recs {
            let used = match &r.env.body {
                Event::InputProvided(p) => Some(&p.token_id),
                Event::ApprovalGiven(g) => Some(&g.token_id),
                _ => None,
            };
            if let Some(t) = used {
                if !tokens.insert(t.clone()) {
                    bad(format!("token {t} used twice"));
                }
            }
        }
        let mut called = BTreeSet::new();
        let mut settled = BTreeSet::new();
        let mut delegated = BTreeMap::new();
        let mut answered = BTreeSet::new();
        for r in recs {
            match &r.env.body {
                Event::ToolCalled(t) if !called.insert(t.call.clone()) => {
                    bad(format!("tool call {} recorded as started twice", t.call))
                }
                Event::Delegated(d) => {
                    delegated.insert(d.call.clone(), d.child.clone());
                }
                // A call whose shared run was cancelled by its starter delegates again,
                // and may be answered from the cache then: the hit is its answer.
                Event::CacheHit(h) if !h.call.is_empty() => {
                    delegated.remove(&h.call);
                }
                Event::ChildSettled(c) => {
                    // A child paused on a question is settled for this call as paused;
                    // its parent resumes it under a call of its own.
                    answered.insert((c.call.clone(), c.child.clone()));
                    let paused = matches!(c.outcome, Outcome::NeedsInput { .. });
                    if !paused && !settled.insert((c.call.clone(), c.child.clone())) {
                        bad(format!("child {} settled twice for {}", c.child, c.call));
                    }
                }
                _ => {}
            }
        }
        if matches!(recs.last().map(|r| &r.env.body), Some(Event::Completed(_))) {
            for (call, child) in &delegated {
                if !answered.contains(&(call.clone(), child.clone())) {
                    bad(format!(
                        "completed with child {child} ({call}) never settled"
                    ));
                }
            }
        }
    }
    // Usage rolls up exactly: a finished root's total is what every session of its tree
    // spent on its own. A failed root's total is what was counted when it failed: the
    // sessions under it may still spend (a model call under way) before they are
    // cancelled, so it may be less, but never more.
    for root in &run.roots {
        let (total, failed) = match run
            .logs
            .get(root)
            .and_then(|l| l.last())
            .map(|r| &r.env.body)
        {
            Some(Event::Completed(c)) => (&c.usage_total, false),
            Some(Event::Failed(f)) => (&f.usage_total, true),
            _ => continue,
        };
        let mut own = Usage::default();
        for (id, recs) in run.logs.range(root.clone()..) {
            if !root.contains(id) {
                break;
            }
            for r in recs {
                if let Event::ModelCalled(m) = &r.env.body {
                    own.add(&m.usage);
                }
            }
        }
        let (spent, said) = (own.total_tokens(), total.total_tokens());
        if said > spent || (!failed && said < spent) {
            v.violations.push(format!(
                "{root}: the tree's sessions spent {spent} tokens, its total{} says {said}",
                if failed { " at its failure" } else { "" }
            ));
        }
    }
    // The disk: nothing acknowledged that a sync did not cover, no acknowledged record
    // lost across a restart, damage refused; and no tree failed for a disk's fault, which
    // passes (a full disk waits, a stopped store is reopened).
    if let Some(disk) = run.store.disk() {
        v.violations.extend(disk.violations(&run.logs));
        for (id, recs) in &run.logs {
            if let Some(Event::Failed(f)) = recs.last().map(|r| &r.env.body) {
                if f.error.contains("simulated disk") {
                    v.violations
                        .push(format!("{id}: failed for a disk fault: {}", f.error));
                }
            }
        }
    }
    v.violations
        .extend(run.person.taken_after_end.iter().cloned());
    if run.person.reused_accepted > 0 {
        v.violations.push(format!(
            "a used token was accepted again {} time(s)",
            run.person.reused_accepted
        ));
    }
    if let Some(m) = &run.mix {
        m.check(&run.logs, &run.roots, &run.agents, &mut v.violations);
    }
    let _: Option<SessionId> = None;
    v
}

/// Each tree's result is announced once, whatever its tree met: the root's ending is
/// announced, as its log ends (seq, status, answer, error, total), and no other ending
/// was (none the log does not end with, such as an ending a restart's disk lost).
fn announced_once(run: &Run, v: &mut Verdict) {
    let results = run.store.results();
    for root in &run.roots {
        let Some(end) = run.logs.get(root).and_then(|l| l.last()) else {
            continue;
        };
        if !end.env.body.is_terminal() {
            continue;
        }
        let announced = results.get(root).map(Vec::as_slice).unwrap_or_default();
        let mut f = skein_runtime::session::Folded::new(root.clone());
        if let Err(e) = f.absorb(&run.logs[root]) {
            v.violations
                .push(format!("{root}: the log does not fold: {e}"));
            continue;
        }
        let expected = (
            end.env.seq,
            f.state.status,
            f.state.ending.answer.clone(),
            f.state.ending.error.clone(),
            f.state.usage_total(),
        );
        match announced {
            [] => v.violations.push(format!(
                "{root}: ended ({} at seq {}) and was never announced",
                end.env.body.kind(),
                end.env.seq
            )),
            [one] => {
                let got = (
                    one.seq,
                    one.status,
                    one.answer.clone(),
                    one.error.clone(),
                    one.usage,
                );
                if got != expected {
                    v.violations.push(format!(
                        "{root}: announced {got:?}, but its log ends {expected:?}"
                    ));
                }
            }
            many => v.violations.push(format!(
                "{root}: announced {} endings (at seqs {:?}); its log ends once, at seq {}",
                many.len(),
                many.iter().map(|r| r.seq).collect::<Vec<_>>(),
                end.env.seq
            )),
        }
    }
}

/// Cache soundness: each hit of `run` answers what a fresh run of that child answers
/// (`reference`: the same world with no fault and no cache, whose session ids follow the
/// same paths). A hit is compared when the reference has the same session, with a
/// completed child under the same call that no person answered. Returns the hits compared
/// and those that could not be.
pub fn cache_sound(run: &Run, reference: &Run, v: &mut Verdict) -> (u64, u64) {
    let (mut checked, mut unmatched) = (0, 0);
    let answered_by_person = |root: &SessionId| {
        reference
            .logs
            .range(root.clone()..)
            .take_while(|(id, _)| root.contains(id))
            .any(|(_, recs)| {
                recs.iter()
                    .any(|r| matches!(r.env.body, Event::InputProvided(_)))
            })
    };
    for (id, recs) in &run.logs {
        for r in recs {
            let Event::CacheHit(h) = &r.env.body else {
                continue;
            };
            let child = reference.logs.get(id).and_then(|l| {
                l.iter().find_map(|r| match &r.env.body {
                    Event::Delegated(d) if d.call == h.call => Some(d.child.clone()),
                    _ => None,
                })
            });
            let fresh = child
                .as_ref()
                .filter(|c| !answered_by_person(c))
                .and_then(|c| reference.logs.get(c))
                .and_then(|l| mission_answer(l));
            match fresh {
                Some(answer) => {
                    checked += 1;
                    if answer != h.answer {
                        v.violations.push(format!(
                            "{id}: cache hit for {} answered {:?} (from {}); a fresh run of \
                             that child answers {answer:?}",
                            h.call, h.answer, h.source
                        ));
                    }
                }
                None => unmatched += 1,
            }
        }
    }
    (checked, unmatched)
}

/// The first agent of `agent` and those it may start whose definition differs between the
/// two sets (or that one of them lacks).
fn defined_otherwise(
    a: &skein_core::AgentSet,
    b: &skein_core::AgentSet,
    agent: &str,
) -> Option<String> {
    let mut names = a.reachable(agent);
    names.extend(b.reachable(agent));
    names.insert(agent.to_string());
    names
        .into_iter()
        .find(|n| a.get(n).map(|d| d.digest.as_str()) != b.get(n).map(|d| d.digest.as_str()))
}

/// The answer a session gave to its mission: its first end, if that was a completion (a
/// `chat: true` session asked again ends again, with answers to the follow-ups).
fn mission_answer(recs: &[skein_core::Record]) -> Option<String> {
    match recs.iter().map(|r| &r.env.body).find(|e| e.is_terminal()) {
        Some(Event::Completed(c)) => Some(c.answer.clone()),
        _ => None,
    }
}
