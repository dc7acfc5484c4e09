//! Shared runs (single flight) where they meet retention and cancel (features: cache's
//! single flight, retention, cancel, usage, replay).
//!
//! - A call that finds its mission in flight in another tree shares that run: it waits for
//!   the other tree's child and settles from its log. The other tree may end before the
//!   sharer has settled (its worker was slow, or the cluster was down for a while). Its
//!   tree has then ended whole, and once old enough it looked removable; removed, the
//!   sharer found no log where the shared run had been, and its call failed with "never
//!   started", though the run completed. A tree is therefore not removable while a
//!   session outside it that has not ended watches one of its sessions.
//! - The tree that started a shared run may be cancelled (by a person, a timeout, its
//!   parent ending without it) before the run answers, and the run is cancelled with it.
//!   That cancel is not the sharer's: its call delegates again, to a run of its own,
//!   rather than fail with another tree's cancel.
//!   A handoff or a route that shares a run meets the same cancel the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::delegations;
use skein_core::event::DelegationKind;
use skein_core::{AgentSet, Event, SessionId};
use skein_runtime::ports::Job;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;

fn runtime(dir: &std::path::Path, agents: Arc<AgentSet>) -> (Arc<SledStore>, Arc<Runtime>) {
    common::scripted_runtime(dir, agents, RuntimeConfig::default())
}

/// The next job of the default pool, if one comes within half a second.
async fn claim(rt: &Runtime) -> Option<Job> {
    rt.backend
        .jobs
        .claim("default", Duration::from_millis(500))
        .await
        .unwrap()
}

/// Claims and runs the next job, which must be `want`'s.
async fn run_job_of(rt: &Runtime, want: &SessionId) {
    let job = claim(rt).await.expect("a job");
    assert_eq!(&job.session, want, "the next job is another session's");
    run(rt, &job).await;
}

/// Runs a claimed job and acks it, as a worker does.
async fn run(rt: &Runtime, job: &Job) {
    rt.process(job).await.unwrap();
    rt.backend.jobs.ack(job).await.unwrap();
}

/// One `call_agent` call of a scripted turn: `helper` on "the same job".
const SAME_JOB: &str =
    "      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n";

/// Two trees on one store: `first`, a `boss`, has started its helper, whose job is claimed
/// and not run; `second`, of the agent asked for, has run its first step, which shared
/// that run.
struct Sharing {
    dir: tempfile::TempDir,
    store: Arc<SledStore>,
    rt: Arc<Runtime>,
    agents: Arc<AgentSet>,
    first: SessionId,
    second: SessionId,
    helper: SessionId,
    helpers_job: Job,
}

async fn sharing(second_agent: &str) -> Sharing {
    sharing_of("boss", second_agent).await
}

/// [`sharing`] with the first tree's agent given too: a handoff or a route shares a run
/// only with another chain's step at its depth.
async fn sharing_of(first_agent: &str, second_agent: &str) -> Sharing {
    let dir = tempfile::tempdir().unwrap();
    let boss = format!(
        "turns:\n  - tool_calls:\n{SAME_JOB}  - answer: \"boss: {{{{ results[0].result }}}}\"\n"
    );
    let twice = format!(
        "turns:\n  - tool_calls:\n{SAME_JOB}{SAME_JOB}  - answer: \"{{{{ results[0].result }}}} and {{{{ results[1].result }}}}\"\n"
    );
    let agents = Arc::new(skein_core::testing::scripted_agents(
        dir.path(),
        &[
            ("boss", "agents: [helper]\n", &boss),
            ("twice", "agents: [helper]\n", &twice),
            ("helper", "", "turns:\n  - answer: helped\n"),
            ("drafter", "handoff: helper\n", "turns:\n  - answer: drafted\n"),
            (
                "desk",
                "router: {destinations: [helper]}\n",
                "turns:\n  - tool_calls:\n      - tool: handoff_to\n        args: {agent: helper}\n",
            ),
        ],
    ));
    let (store, rt) = runtime(dir.path(), agents.clone());
    let submit = |agent: &str, id: &str| {
        rt.submit(Submission {
            agent: agent.into(),
            mission: "m".into(),
            id: Some(id.into()),
            ..Default::default()
        })
    };
    let first = submit(first_agent, "first").await.unwrap();
    run_job_of(&rt, &first).await;
    let helper = SessionId::parse("first.helper-1").unwrap();
    let helpers_job = claim(&rt).await.expect("the helper's job");
    assert_eq!(helpers_job.session, helper);
    let second = submit(second_agent, "second").await.unwrap();
    run_job_of(&rt, &second).await;
    let shared = delegations(&rt, &second).await;
    assert!(
        !shared.is_empty()
            && shared
                .iter()
                .all(|d| *d == (helper.clone(), DelegationKind::Shared)),
        "the second tree did not share the first's run: {shared:?}"
    );
    Sharing {
        dir,
        store,
        rt,
        agents,
        first,
        second,
        helper,
        helpers_job,
    }
}

impl Sharing {
    /// Cancels the first tree with its helper still to run, then runs the second tree to
    /// its end; the second's last record.
    async fn cancel_first_and_finish_second(&self) -> skein_core::Record {
        let rt = &self.rt;
        skein_runtime::control::cancel(rt, &self.first, "cancelled by an operator")
            .await
            .unwrap();
        rt.backend.jobs.ack(&self.helpers_job).await.unwrap();
        rt.requeue_tree(&self.second).await.unwrap();
        rt.run_tree(&self.second, 2).await.unwrap();
        rt.backend.log.last(&self.second).await.unwrap().unwrap()
    }

    /// Replays the second tree: every decision holds.
    async fn second_replays(&self) {
        let verdicts = skein_runtime::replay::verify_tree(
            &self.rt.backend,
            &self.second,
            &self.agents,
            &Default::default(),
        )
        .await
        .unwrap();
        assert!(verdicts.len() >= 2, "{verdicts:?}");
        for v in verdicts {
            assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
        }
    }
}

#[tokio::test]
async fn a_tree_whose_run_another_tree_still_shares_is_not_removed() {
    let Sharing {
        dir,
        store,
        rt,
        agents,
        first,
        second,
        helpers_job,
        ..
    } = sharing("boss").await;
    // The helper ends, and so does the first tree; the second tree's step that would
    // settle the shared run has not run yet.
    run(&rt, &helpers_job).await;
    // The second tree's job is claimed and held, never run: it is ready again when the
    // store is opened anew.
    let mut held = vec![];
    while let Some(job) = claim(&rt).await {
        if job.session == second {
            held.push(job);
        } else {
            run(&rt, &job).await;
        }
    }
    assert_eq!(held.len(), 1, "the second tree was not woken once");
    let ended = rt.backend.log.last(&first).await.unwrap().unwrap();
    assert!(ended.env.body.is_terminal(), "the first tree did not end");

    // Every record is older than a cut-off in the future: only the sharer keeps the first
    // tree from being removable.
    let later = skein_runtime::now_ms() + 60_000;
    let removable = |store: Arc<SledStore>| async move {
        let mut roots: Vec<String> = store
            .removable_trees(later)
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.root)
            .collect();
        roots.sort();
        roots
    };
    assert_eq!(
        removable(store.clone()).await,
        Vec::<String>::new(),
        "a tree whose run the open second tree shares is removable"
    );

    // The second tree settles the shared run and ends; both trees are removable then.
    drop(rt);
    drop(store);
    let (store, rt) = runtime(dir.path(), agents);
    rt.requeue_tree(&second).await.unwrap();
    rt.run_tree(&second, 2).await.unwrap();
    let last = rt.backend.log.last(&second).await.unwrap().unwrap();
    match &last.env.body {
        Event::Completed(c) => assert_eq!(c.answer, "boss: helped"),
        other => panic!("the second tree did not complete: {}", other.kind()),
    }
    assert_eq!(removable(store).await, vec!["first", "second"]);
}

#[tokio::test]
async fn a_call_sharing_a_run_whose_tree_is_cancelled_gets_the_answer_all_the_same() {
    let s = sharing("boss").await;
    let last = s.cancel_first_and_finish_second().await;
    let Event::Completed(c) = &last.env.body else {
        panic!("the second tree did not complete: {}", last.env.body.kind())
    };
    assert_eq!(
        c.answer, "boss: helped",
        "another tree's cancel reached the second tree's call"
    );
    // The call delegated again, to a run of its own: the child its own delegation was
    // numbered for, which sharing left uncreated. Its tokens are the tree's.
    let own = SessionId::parse("second.helper-1").unwrap();
    assert_eq!(
        delegations(&s.rt, &s.second).await,
        vec![
            (s.helper.clone(), DelegationKind::Shared),
            (own.clone(), DelegationKind::Started)
        ]
    );
    let mut spent = skein_core::message::Usage::default();
    for id in [&s.second, &own] {
        for r in s.rt.backend.log.read(id, 1).await.unwrap() {
            if let Event::ModelCalled(m) = &r.env.body {
                spent.add(&m.usage);
            }
        }
    }
    assert_eq!(c.usage_total, spent);
    s.second_replays().await;
}

#[tokio::test]
async fn two_calls_sharing_a_cancelled_run_each_delegate_again_to_a_child_of_their_own() {
    let s = sharing("twice").await;
    let last = s.cancel_first_and_finish_second().await;
    match &last.env.body {
        Event::Completed(c) => assert_eq!(c.answer, "helped and helped"),
        other => panic!("the second tree did not complete: {}", other.kind()),
    }
    // The two calls delegated again together: one started a run, the other started one
    // too or shared it; no two `Started` name one child.
    let again: Vec<_> = delegations(&s.rt, &s.second)
        .await
        .into_iter()
        .skip(2)
        .collect();
    assert_eq!(again.len(), 2, "{again:?}");
    let started: Vec<_> = again
        .iter()
        .filter(|(_, k)| *k == DelegationKind::Started)
        .map(|(c, _)| c.clone())
        .collect();
    let mut distinct = started.clone();
    distinct.dedup();
    assert!(!started.is_empty() && started == distinct, "{again:?}");
    s.second_replays().await;
}

/// A handoff and a router's `handoff_to` start their next agent at the depth of the
/// chain's first, so they share a run with another chain's step of the same request, and
/// that run's cancel is not theirs either: each hands on to a run of its own, and the
/// chain ends with that run's answer.
#[tokio::test]
async fn a_handoff_or_a_route_sharing_a_cancelled_run_hands_on_to_a_run_of_its_own() {
    for agent in ["drafter", "desk"] {
        let s = sharing_of(agent, agent).await;
        let last = s.cancel_first_and_finish_second().await;
        match &last.env.body {
            Event::Completed(c) => assert_eq!(c.answer, "helped", "{agent}"),
            other => panic!(
                "{agent}: the second tree did not complete: {}",
                other.kind()
            ),
        }
        assert_eq!(
            delegations(&s.rt, &s.second).await,
            vec![
                (s.helper.clone(), DelegationKind::Shared),
                (
                    SessionId::parse("second.helper-1").unwrap(),
                    DelegationKind::Started
                )
            ],
            "{agent}"
        );
        s.second_replays().await;
    }
}

/// A call whose shared run was cancelled by its starter delegates again, and the cache
/// may answer it at once (a run of the same mission elsewhere ended meanwhile). No
/// child's end will wake the session then: the look that redid the call goes on itself.
#[tokio::test]
async fn a_call_redone_from_the_cache_goes_on_at_once() {
    let s = sharing("boss").await;
    let hash =
        s.rt.backend
            .log
            .read(&s.second, 1)
            .await
            .unwrap()
            .into_iter()
            .find_map(|r| match r.env.body {
                Event::Delegated(d) => Some(d.mission_hash),
                _ => None,
            })
            .expect("the shared call's delegation");
    let entry = skein_runtime::ports::CacheEntry {
        answer: "helped elsewhere".into(),
        usage: Default::default(),
        source: SessionId::parse("elsewhere.helper-1").unwrap(),
        steps: 1,
        created: skein_runtime::now_ms(),
        expires: None,
    };
    s.rt.backend.cache.put(&hash, &entry).await.unwrap();
    let last = tokio::time::timeout(Duration::from_secs(30), s.cancel_first_and_finish_second())
        .await
        .expect("the second tree's run ended");
    match &last.env.body {
        Event::Completed(c) => assert_eq!(c.answer, "boss: helped elsewhere"),
        other => panic!("the second tree stopped at {}", other.kind()),
    }
    // The tree is its root alone (the cache answered), and replay verifies it.
    let verdicts = skein_runtime::replay::verify_tree(
        &s.rt.backend,
        &s.second,
        &s.agents,
        &Default::default(),
    )
    .await
    .unwrap();
    assert!(verdicts.len() == 1 && verdicts[0].ok, "{verdicts:?}");
}
