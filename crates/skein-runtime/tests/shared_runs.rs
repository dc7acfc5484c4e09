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
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use skein_core::event::DelegationKind;
use skein_core::{AgentSet, Event, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::ports::Job;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::ToolBox;

fn runtime(dir: &std::path::Path, agents: Arc<AgentSet>) -> (Arc<SledStore>, Arc<Runtime>) {
    let store = SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir)));
    let rt = Runtime::new(
        store.backend(),
        agents,
        models,
        ToolBox::new(),
        RuntimeConfig::default(),
    );
    (store, rt)
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

/// What `id`'s log says it delegated to, with how.
async fn delegations(rt: &Runtime, id: &SessionId) -> Vec<(SessionId, DelegationKind)> {
    rt.backend
        .log
        .read(id, 1)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|r| match r.env.body {
            Event::Delegated(d) => Some((d.child, d.kind)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_tree_whose_run_another_tree_still_shares_is_not_removed() {
    let dir = tempfile::tempdir().unwrap();
    let agents = Arc::new(skein_core::testing::scripted_agents(
        dir.path(),
        &[
            (
                "boss",
                "agents: [helper]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"boss: {{ results[0].result }}\"\n",
            ),
            ("helper", "", "turns:\n  - answer: helped\n"),
        ],
    ));
    let (store, rt) = runtime(dir.path(), agents.clone());
    let submit = |id: &'static str| {
        let rt = rt.clone();
        async move {
            rt.submit(Submission {
                agent: "boss".into(),
                mission: "m".into(),
                id: Some(id.into()),
                ..Default::default()
            })
            .await
            .unwrap()
        }
    };
    // Tree `first` starts its helper; tree `second` asks for the same mission while that
    // run is in flight, and shares it.
    let first = submit("first").await;
    run_job_of(&rt, &first).await;
    let helper = SessionId::parse("first.helper-1").unwrap();
    let helpers_job = claim(&rt).await.expect("the helper's job");
    assert_eq!(helpers_job.session, helper);
    let second = submit("second").await;
    run_job_of(&rt, &second).await;
    assert_eq!(
        delegations(&rt, &second).await,
        vec![(helper.clone(), DelegationKind::Shared)],
        "the second tree did not share the first's run"
    );
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
    let removable: Vec<String> = store
        .removable_trees(later)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.root)
        .collect();
    assert!(
        removable.is_empty(),
        "a tree whose run the open second tree shares is removable: {removable:?}"
    );

    // The second tree settles the shared run and ends; the first is removable then, and
    // both trees are once the second has ended.
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
    let mut removable: Vec<String> = store
        .removable_trees(later)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.root)
        .collect();
    removable.sort();
    assert_eq!(removable, vec!["first".to_string(), "second".to_string()]);
}

#[tokio::test]
async fn a_call_sharing_a_run_whose_tree_is_cancelled_gets_the_answer_all_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let agents = Arc::new(skein_core::testing::scripted_agents(
        dir.path(),
        &[
            (
                "boss",
                "agents: [helper]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"boss: {{ results[0].result }}\"\n",
            ),
            ("helper", "", "turns:\n  - answer: helped\n"),
        ],
    ));
    let (_store, rt) = runtime(dir.path(), agents.clone());
    let submit = |id: &'static str| {
        let rt = rt.clone();
        async move {
            rt.submit(Submission {
                agent: "boss".into(),
                mission: "m".into(),
                id: Some(id.into()),
                ..Default::default()
            })
            .await
            .unwrap()
        }
    };
    let first = submit("first").await;
    run_job_of(&rt, &first).await;
    let helper = SessionId::parse("first.helper-1").unwrap();
    let helpers_job = claim(&rt).await.expect("the helper's job");
    let second = submit("second").await;
    run_job_of(&rt, &second).await;
    assert_eq!(
        delegations(&rt, &second).await,
        vec![(helper.clone(), DelegationKind::Shared)]
    );
    // The first tree is cancelled with its run of the mission still to go.
    skein_runtime::control::cancel(&rt, &first, "cancelled by an operator")
        .await
        .unwrap();
    rt.backend.jobs.ack(&helpers_job).await.unwrap();
    rt.requeue_tree(&second).await.unwrap();
    rt.run_tree(&second, 2).await.unwrap();
    let last = rt.backend.log.last(&second).await.unwrap().unwrap();
    match &last.env.body {
        Event::Completed(c) => assert_eq!(
            c.answer, "boss: helped",
            "another tree's cancel reached the second tree's call"
        ),
        other => panic!("the second tree did not complete: {}", other.kind()),
    }
    // The call delegated again, to a run of its own: the child its own delegation was
    // numbered for, which sharing left uncreated. Its tokens are the tree's.
    let own = SessionId::parse("second.helper-1").unwrap();
    assert_eq!(
        delegations(&rt, &second).await,
        vec![
            (helper.clone(), DelegationKind::Shared),
            (own.clone(), DelegationKind::Started)
        ]
    );
    let Event::Completed(c) = &last.env.body else {
        unreachable!()
    };
    let mut spent = skein_core::message::Usage::default();
    for id in [&second, &own] {
        for r in rt.backend.log.read(id, 1).await.unwrap() {
            if let Event::ModelCalled(m) = &r.env.body {
                spent.add(&m.usage);
            }
        }
    }
    assert_eq!(c.usage_total, spent);
    // Replayed, every decision of the tree holds, the second delegation included.
    let verdicts =
        skein_runtime::replay::verify_tree(&rt.backend, &second, &agents, &Default::default())
            .await
            .unwrap();
    assert_eq!(verdicts.len(), 2);
    for v in verdicts {
        assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
    }
}

#[tokio::test]
async fn two_calls_sharing_a_cancelled_run_each_delegate_again_to_a_child_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let twice = "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"{{ results[0].result }} and {{ results[1].result }}\"\n";
    let agents = Arc::new(skein_core::testing::scripted_agents(
        dir.path(),
        &[
            (
                "boss",
                "agents: [helper]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"boss: {{ results[0].result }}\"\n",
            ),
            ("twice", "agents: [helper]\n", twice),
            ("helper", "", "turns:\n  - answer: helped\n"),
        ],
    ));
    let (_store, rt) = runtime(dir.path(), agents.clone());
    let submit = |agent: &'static str, id: &'static str| {
        let rt = rt.clone();
        async move {
            rt.submit(Submission {
                agent: agent.into(),
                mission: "m".into(),
                id: Some(id.into()),
                ..Default::default()
            })
            .await
            .unwrap()
        }
    };
    let first = submit("boss", "first").await;
    run_job_of(&rt, &first).await;
    let helper = SessionId::parse("first.helper-1").unwrap();
    let helpers_job = claim(&rt).await.expect("the helper's job");
    let second = submit("twice", "second").await;
    run_job_of(&rt, &second).await;
    assert_eq!(
        delegations(&rt, &second).await,
        vec![
            (helper.clone(), DelegationKind::Shared),
            (helper.clone(), DelegationKind::Shared)
        ]
    );
    skein_runtime::control::cancel(&rt, &first, "cancelled by an operator")
        .await
        .unwrap();
    rt.backend.jobs.ack(&helpers_job).await.unwrap();
    rt.requeue_tree(&second).await.unwrap();
    rt.run_tree(&second, 2).await.unwrap();
    let last = rt.backend.log.last(&second).await.unwrap().unwrap();
    match &last.env.body {
        Event::Completed(c) => assert_eq!(c.answer, "helped and helped"),
        other => panic!("the second tree did not complete: {}", other.kind()),
    }
    // The two calls delegated again together: one started a run, the other started one
    // too or shared it; no two `Started` name one child.
    let again: Vec<_> = delegations(&rt, &second)
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
    let verdicts =
        skein_runtime::replay::verify_tree(&rt.backend, &second, &agents, &Default::default())
            .await
            .unwrap();
    for v in verdicts {
        assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
    }
}
