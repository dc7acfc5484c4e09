//! A job delivered more than `max_deliver` times fails its session with a dead-letter
//! reason instead of being retried forever.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use skein_core::Event;
use skein_runtime::ports::Durability;
use skein_runtime::worker::RuntimeConfig;

/// The next job of the default pool (one must come within a second).
async fn claim(jobs: &dyn skein_runtime::ports::JobQueue) -> skein_runtime::ports::Job {
    jobs.claim("default", Duration::from_secs(1))
        .await
        .unwrap()
        .expect("a job within a second")
}

#[tokio::test]
async fn a_job_past_max_deliver_fails_its_session_with_the_reason() {
    // A short lease: the log must stand still for max_deliver leases before the session is
    // dead-lettered.
    let cfg = RuntimeConfig {
        max_deliver: 3,
        lease: Duration::from_millis(20),
        ..RuntimeConfig::default()
    };
    let (_dir, rt, id) = common::solo(cfg).await;
    let jobs = &rt.backend.jobs;
    // Three deliveries that never finish (as if each worker died mid-step).
    for attempt in 1..=3 {
        let j = claim(jobs.as_ref()).await;
        assert_eq!(j.attempt, attempt);
        jobs.retry(&j, Duration::ZERO).await.unwrap();
    }
    // The log stood still for 3 leases of 20 ms.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let j = claim(jobs.as_ref()).await;
    assert_eq!(j.attempt, 4);
    rt.process(&j).await.unwrap();
    jobs.ack(&j).await.unwrap();
    let last = rt.backend.log.last(&id).await.unwrap().unwrap();
    match &last.env.body {
        Event::Failed(f) => {
            assert!(
                f.dead_letter && f.error.contains("dead-lettered"),
                "{}",
                f.error
            );
            assert!(f.error.contains("delivered 3 times"), "{}", f.error);
            assert!(
                f.error
                    .contains("the step it could not get past: call_model(scripted:solo)"),
                "{}",
                f.error
            );
        }
        other => panic!("expected Failed, got {}", other.kind()),
    }
    // The failure is the worker's, not a decision: replay admits it.
    let agents = skein_core::AgentSet::load(
        &[(
            "solo.md".into(),
            "---\nname: solo\nmodel: scripted:solo\n---\nAnswer.\n".into(),
        )],
        &[],
    )
    .unwrap();
    let verdicts = skein_runtime::replay::verify_tree(
        &rt.backend,
        &id,
        &agents,
        &skein_core::Limits::default(),
    )
    .await
    .unwrap();
    assert!(verdicts.iter().all(|v| v.ok), "{verdicts:?}");
    // The model was never called: the session failed before any step.
    let records = rt.backend.log.read(&id, 1).await.unwrap();
    assert!(!records
        .iter()
        .any(|r| matches!(r.env.body, Event::ModelCalled(_))));
}

#[tokio::test]
async fn deliveries_that_ran_out_while_the_log_moves_do_not_fail_the_session() {
    // Deliveries that run out quickly (heartbeats lost in a leader election) while the log
    // was written a moment ago: the fourth one runs the step.
    let cfg = RuntimeConfig {
        max_deliver: 3,
        lease: Duration::from_secs(30),
        ..RuntimeConfig::default()
    };
    let (_dir, rt, id) = common::solo(cfg).await;
    let jobs = &rt.backend.jobs;
    // Three deliveries that never finish (as if each worker died mid-step).
    for attempt in 1..=3 {
        let j = claim(jobs.as_ref()).await;
        assert_eq!(j.attempt, attempt);
        jobs.retry(&j, Duration::ZERO).await.unwrap();
    }
    let j = claim(jobs.as_ref()).await;
    assert_eq!(j.attempt, 4);
    rt.process(&j).await.unwrap();
    jobs.ack(&j).await.unwrap();
    let last = rt.backend.log.last(&id).await.unwrap().unwrap();
    assert!(
        matches!(last.env.body, Event::Completed(_)),
        "expected Completed, got {}",
        last.env.body.kind()
    );
}

/// A runtime on its own store (no blob put in it) with `agents` as its catalogue.
fn bare_runtime(
    dir: &std::path::Path,
    agents: skein_core::AgentSet,
    cfg: RuntimeConfig,
) -> std::sync::Arc<skein_runtime::worker::Runtime> {
    let store = skein_sled::SledStore::open(&dir.join("data2"), &dir.join("ws2")).unwrap();
    let mut models = skein_llm::Registry::new();
    models.insert(
        "scripted",
        std::sync::Arc::new(skein_llm::scripted::ScriptedProvider::new(dir)),
    );
    skein_runtime::worker::Runtime::new(
        store.backend(),
        std::sync::Arc::new(agents),
        models,
        skein_tools::ToolBox::new(),
        cfg,
    )
}

/// Copies the session's log from `from` into `to` and queues its job there: `to` has the
/// session but not the definition's blob.
async fn move_session(
    from: &skein_runtime::worker::Runtime,
    to: &skein_runtime::worker::Runtime,
    id: &skein_core::SessionId,
) {
    let records = from.backend.log.read(id, 1).await.unwrap();
    to.backend
        .log
        .append(id, 0, &records, Durability::Now)
        .await
        .unwrap();
    to.backend.jobs.push("default", id).await.unwrap();
    // The first store's copy of the job is taken, so only one store runs it.
    let j = claim(from.backend.jobs.as_ref()).await;
    from.backend.jobs.ack(&j).await.unwrap();
}

#[tokio::test]
async fn a_definition_missing_from_the_blob_store_is_read_from_the_worker_s_own_catalogue() {
    let (dir, rt, id) = common::solo(RuntimeConfig::default()).await;
    let other = bare_runtime(
        dir.path(),
        rt.agents.as_ref().clone(),
        RuntimeConfig::default(),
    );
    move_session(&rt, &other, &id).await;
    let digest = rt.agents.agents["solo"].digest.clone();
    assert!(other.backend.blobs.get(&digest).await.unwrap().is_none());
    let j = claim(other.backend.jobs.as_ref()).await;
    other.process(&j).await.unwrap();
    let last = other.backend.log.last(&id).await.unwrap().unwrap();
    assert!(
        matches!(last.env.body, Event::Completed(_)),
        "expected Completed, got {}",
        last.env.body.kind()
    );
}

#[tokio::test]
async fn a_definition_no_one_can_read_is_retried_then_fails_the_session_in_its_log() {
    let (dir, rt, id) = common::solo(RuntimeConfig::default()).await;
    // A worker that knows no agent, on a store without the definition.
    let cfg = RuntimeConfig {
        max_deliver: 2,
        lease: Duration::from_millis(20),
        ..RuntimeConfig::default()
    };
    let other = bare_runtime(dir.path(), skein_core::AgentSet::default(), cfg);
    move_session(&rt, &other, &id).await;
    let jobs = &other.backend.jobs;
    for attempt in 1..=2 {
        let j = claim(jobs.as_ref()).await;
        assert_eq!(j.attempt, attempt);
        // Not a failure of the session: the store may not answer yet.
        let e = other.process(&j).await.unwrap_err();
        assert!(e.is_retryable(), "{}", e.report());
        assert!(e.to_string().contains("not in the blob store"), "{e}");
        jobs.retry(&j, Duration::ZERO).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let j = claim(jobs.as_ref()).await;
    assert_eq!(j.attempt, 3);
    other.process(&j).await.unwrap();
    let last = other.backend.log.last(&id).await.unwrap().unwrap();
    match &last.env.body {
        Event::Failed(f) => {
            assert!(f.dead_letter, "{}", f.error);
            assert!(
                f.error.contains("its definition cannot be read")
                    && f.error.contains("not in the blob store"),
                "{}",
                f.error
            );
        }
        other => panic!("expected Failed, got {}", other.kind()),
    }
}

/// A child whose definition no worker can read ends dead-lettered, and its parent still
/// hears of it: its end does not stop at the definition it could not read (which says
/// whether its mission could have been shared).
#[tokio::test]
async fn a_child_no_one_can_read_is_failed_and_its_parent_told() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("boss.yaml"),
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: solo, mission: \"m\"}\n  - answer: done\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("solo.yaml"), "turns:\n  - answer: done\n").unwrap();
    let agents = skein_core::AgentSet::load(
        &[
            (
                "boss.md".into(),
                "---\nname: boss\nmodel: scripted:boss\nagents: [solo]\n---\nDelegate.\n".into(),
            ),
            (
                "solo.md".into(),
                "---\nname: solo\nmodel: scripted:solo\ncache: false\n---\nAnswer.\n".into(),
            ),
        ],
        &[],
    )
    .unwrap();
    let store =
        skein_sled::SledStore::open(&dir.path().join("data"), &dir.path().join("ws")).unwrap();
    let mut models = skein_llm::Registry::new();
    models.insert(
        "scripted",
        std::sync::Arc::new(skein_llm::scripted::ScriptedProvider::new(dir.path())),
    );
    let rt = skein_runtime::worker::Runtime::new(
        store.backend(),
        std::sync::Arc::new(agents),
        models,
        skein_tools::ToolBox::new(),
        RuntimeConfig::default(),
    );
    let boss = rt
        .submit(skein_runtime::worker::Submission {
            agent: "boss".into(),
            mission: "delegate".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // The boss's first job delegates: the child's log is written and its job queued.
    let j = claim(rt.backend.jobs.as_ref()).await;
    assert_eq!(j.session, boss);
    rt.process(&j).await.unwrap();
    rt.backend.jobs.ack(&j).await.unwrap();
    let child = boss.child("solo", 1);
    assert!(rt.backend.log.last(&child).await.unwrap().is_some());
    // The child moves to a worker that knows no agent, on a store without the definition.
    let cfg = RuntimeConfig {
        max_deliver: 2,
        lease: Duration::from_millis(20),
        ..RuntimeConfig::default()
    };
    let other = bare_runtime(dir.path(), skein_core::AgentSet::default(), cfg);
    move_session(&rt, &other, &child).await;
    let jobs = &other.backend.jobs;
    for _ in 1..=2 {
        let j = claim(jobs.as_ref()).await;
        assert!(other.process(&j).await.unwrap_err().is_retryable());
        jobs.retry(&j, Duration::ZERO).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let j = claim(jobs.as_ref()).await;
    other.process(&j).await.unwrap();
    let last = other.backend.log.last(&child).await.unwrap().unwrap();
    assert!(
        matches!(&last.env.body, Event::Failed(f) if f.dead_letter),
        "expected a dead letter, got {}",
        last.env.body.kind()
    );
    let told = other.backend.notices.read(&boss, 0).await.unwrap();
    assert!(
        told.iter().any(|(_, c)| *c == child),
        "the parent was not told of its child's end: {told:?}"
    );
}
