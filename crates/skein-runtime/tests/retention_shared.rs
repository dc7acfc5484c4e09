//! Retention meets the cache's single flight (features: retention, shared runs, cache).
//!
//! A call that finds its mission in flight in another tree shares that run: it waits for
//! the other tree's child and settles from its log. The other tree may end before the
//! sharer has settled (its worker was slow, or the cluster was down for a while). Its
//! tree has then ended whole, and once old enough it looks removable; removed, the
//! sharer would find no log where the shared run had been, and its call would fail with
//! "never started", though the run completed. A tree is therefore not removable while a
//! session outside it that has not ended watches one of its sessions.
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
