//! The embedded job queue across a restart: its index in memory is rebuilt from the
//! records, and leases held by the process that is gone are released.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use skein_core::SessionId;
use skein_runtime::ports::JobQueue;
use skein_sled::SledStore;

fn sid(s: &str) -> SessionId {
    SessionId::root(s).unwrap()
}

/// Runs `f` on a runtime of its own, dropped afterwards with every task of the store (as
/// when the process ends), so the database can be opened again.
fn in_runtime<T>(f: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(f);
    drop(rt);
    out
}

#[test]
fn a_reopened_queue_has_every_job_and_frees_the_held_ones() {
    let dir = tempfile::tempdir().unwrap();
    let held = in_runtime(async {
        let store = SledStore::open(dir.path(), dir.path()).unwrap();
        for s in ["a", "b", "c"] {
            store.push("p", &sid(s)).await.unwrap();
        }
        store.push("q", &sid("d")).await.unwrap();
        let held = store
            .claim("p", Duration::from_millis(10))
            .await
            .unwrap()
            .expect("a job");
        let other = store
            .claim("p", Duration::from_millis(10))
            .await
            .unwrap()
            .expect("another job");
        store.ack(&other).await.unwrap();
        assert_eq!(store.depth("p").await.unwrap(), 2);
        store.flush().await.unwrap();
        held
    });
    in_runtime(async {
        let store = SledStore::open(dir.path(), dir.path()).unwrap();
        assert_eq!(store.depth("p").await.unwrap(), 2);
        assert_eq!(store.depth("q").await.unwrap(), 1);
        // The job held when the process went is claimable at once, on its next attempt.
        let mut got = vec![];
        while let Some(j) = store.claim("p", Duration::from_millis(10)).await.unwrap() {
            got.push((j.session.clone(), j.attempt));
        }
        got.sort();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got.contains(&(held.session.clone(), 2)), "{got:?}");
        let only_b_or_c = |s: &SessionId| s.as_str() == "b" || s.as_str() == "c";
        assert_eq!(store.depth_matching("p", &only_b_or_c).await.unwrap(), {
            got.iter().filter(|(s, _)| only_b_or_c(s)).count() as u64
        });
    });
}

#[tokio::test]
async fn a_retried_job_waits_its_delay_and_a_dirty_ack_makes_it_ready_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path(), dir.path()).unwrap();
    store.push("p", &sid("a")).await.unwrap();
    let j = store.claim("p", Duration::ZERO).await.unwrap().unwrap();
    store.retry(&j, Duration::from_secs(30)).await.unwrap();
    assert!(store
        .claim("p", Duration::from_millis(50))
        .await
        .unwrap()
        .is_none());
    assert_eq!(store.depth("p").await.unwrap(), 1);
    store.push("p", &sid("b")).await.unwrap();
    let j = store.claim("p", Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(j.session.as_str(), "b");
    // Pushed again while held: the ack leaves it ready instead of removing it.
    store.push("p", &sid("b")).await.unwrap();
    store.ack(&j).await.unwrap();
    let again = store.claim("p", Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(again.session.as_str(), "b");
    store.ack(&again).await.unwrap();
    assert_eq!(
        store.depth("p").await.unwrap(),
        1,
        "only the delayed job is left"
    );
}
