//! An agent's own `cache: {ttl: …}` sets how long its answers stay cached, in any form the
//! duration grammar accepts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use skein_core::{AgentSet, Status};
use skein_runtime::worker::{RuntimeConfig, Submission};

#[tokio::test]
async fn an_agent_with_ttl_1h30m_keeps_its_answer_for_5400_seconds() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("solo.yaml"), "turns:\n  - answer: done\n").unwrap();
    let agents = AgentSet::load(
        &[(
            "solo.md".into(),
            "---\nname: solo\nmodel: scripted:solo\ncache: {ttl: 1h30m}\n---\nAnswer.\n".into(),
        )],
        &[],
    )
    .unwrap();
    let (_store, rt) = common::scripted_runtime(dir.path(), agents, RuntimeConfig::default());
    let id = rt
        .submit(Submission {
            agent: "solo".into(),
            mission: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let f = rt.run_tree(&id, 2).await.unwrap();
    assert_eq!(f.state.status, Status::Completed);
    let hash = &f.state.submitted.as_ref().unwrap().mission_hash;

    let cache = &rt.backend.cache;
    let entry = cache
        .get(hash, 0)
        .await
        .unwrap()
        .expect("the answer is cached");
    assert_eq!(
        entry.expires.map(|e| e - entry.created),
        Some(5_400_000),
        "{entry:?}"
    );
    let at = |secs: u64| entry.created + secs * 1000;
    assert!(cache.get(hash, at(5399)).await.unwrap().is_some());
    assert!(cache.get(hash, at(5401)).await.unwrap().is_none());
}
