//! A wake-up lost by the backend (a job gone with a reset replica) is made good by the
//! sweep of the open trees that backend trouble schedules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use skein_core::Event;
use skein_runtime::worker::RuntimeConfig;

#[tokio::test]
async fn a_lost_job_is_found_again_by_the_sweep_and_the_tree_completes() {
    let (_dir, rt, id) = common::solo(RuntimeConfig::default()).await;
    let jobs = &rt.backend.jobs;
    // The job is lost: taken and acked without being processed.
    common::take_job_unrun(&rt).await;
    assert!(jobs
        .claim("default", Duration::from_millis(100))
        .await
        .unwrap()
        .is_none());
    assert_eq!(rt.sweep_open_trees().await.unwrap(), 1);
    let j = jobs
        .claim("default", Duration::from_secs(1))
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
