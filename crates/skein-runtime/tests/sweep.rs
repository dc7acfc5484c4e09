//! A wake-up lost by the backend (a job gone with a reset replica) is made good by the
//! sweep of the open trees that backend trouble schedules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use skein_core::{AgentSet, Event};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::sled_backend::SledStore;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_tools::ToolBox;

#[tokio::test]
async fn a_lost_job_is_found_again_by_the_sweep_and_the_tree_completes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("solo.yaml"), "turns:\n  - answer: done\n").unwrap();
    let agents = AgentSet::load(
        &[(
            "solo.md".into(),
            "---\nname: solo\nmodel: scripted:solo\n---\nAnswer.\n".into(),
        )],
        &[],
    )
    .unwrap();
    let store = SledStore::open(&dir.path().join("data"), &dir.path().join("ws")).unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir.path())));
    let rt = Runtime::new(
        store.backend(),
        Arc::new(agents),
        models,
        ToolBox::new(),
        RuntimeConfig::default(),
    );
    let id = rt
        .submit(Submission {
            agent: "solo".into(),
            mission: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let jobs = &rt.backend.jobs;
    // The job is lost: taken and acked without being processed.
    let j = jobs
        .claim("default", Duration::from_secs(30), Duration::from_secs(1))
        .await
        .unwrap()
        .unwrap();
    jobs.ack(&j).await.unwrap();
    assert!(jobs
        .claim(
            "default",
            Duration::from_secs(30),
            Duration::from_millis(100)
        )
        .await
        .unwrap()
        .is_none());
    assert_eq!(rt.sweep_open_trees().await.unwrap(), 1);
    let j = jobs
        .claim("default", Duration::from_secs(30), Duration::from_secs(1))
        .await
        .unwrap()
        .expect("the sweep woke the session again");
    rt.process(&j).await.unwrap();
    jobs.ack(&j).await.unwrap();
    let last = rt.backend.log.last(&id).await.unwrap().unwrap();
    assert!(
        matches!(last.env.body, Event::Completed(_)),
        "{}",
        last.env.body.kind()
    );
    // A finished tree is left alone.
    assert_eq!(rt.sweep_open_trees().await.unwrap(), 0);
}
