//! A cancel tried again after a failure (features: cancel, a root's announced end, a
//! parent told of its child's end).
//!
//! `cancel` appends `Cancelled`, then pushes the session's job so that its worker tells its
//! parent, or announces the tree's end. If the backend fails between the two, the
//! operator (or `skein cancel`) tries again. That try found the session ended and passed
//! it by, so nobody pushed its job: a cancelled root was never announced (swarm seed 17701
//! of the simulation, once it checked announcements).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use skein_core::event::Cancelled;
use skein_core::Event;
use skein_runtime::session::Outside;
use skein_runtime::worker::RuntimeConfig;

#[tokio::test]
async fn a_cancel_tried_again_wakes_the_session_its_first_try_ended() {
    let (_dir, rt, id) = common::solo(RuntimeConfig::default()).await;
    let jobs = &rt.backend.jobs;
    // The submission's job, taken away unrun.
    common::take_job_unrun(&rt).await;
    // What the first try left when the backend failed right after its append: the session
    // cancelled, no job.
    let (f, _) = rt.load(&id).await.unwrap();
    let body = Event::Cancelled(Cancelled {
        reason: "cancelled by an operator".into(),
    });
    match rt.append_from_outside(f, body, |_| true).await.unwrap() {
        Outside::Appended(_) => {}
        Outside::Moot(m) => panic!("not appended: {m:?}"),
    }
    assert!(jobs
        .claim("default", Duration::from_millis(100))
        .await
        .unwrap()
        .is_none());
    // The second try cancels nothing more, and wakes the session.
    let n = skein_runtime::control::cancel(&rt, &id, "cancelled by an operator")
        .await
        .unwrap();
    assert_eq!(n, 0);
    let j = jobs
        .claim("default", Duration::from_secs(1))
        .await
        .unwrap()
        .expect("the cancelled session's job");
    assert_eq!(j.session, id);
    // Its worker does what an end needs, and the log stays as it was.
    rt.process(&j).await.unwrap();
    jobs.ack(&j).await.unwrap();
    let records = rt.backend.log.read(&id, 1).await.unwrap();
    assert!(matches!(
        records.last().map(|r| &r.env.body),
        Some(Event::Cancelled(_))
    ));
    assert_eq!(
        records.iter().filter(|r| r.env.body.is_terminal()).count(),
        1
    );
}
