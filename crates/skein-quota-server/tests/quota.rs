//! Shared model quotas against a server that enforces one (its own process): a tree of
//! 32 parts with a small tree submitted after it, at 600 requests a minute (20 per 2 s
//! window), on the embedded store and on NATS with 3 workers; with the limit declared
//! and with only what the server's answers say; two trees of one size, the later at a
//! higher priority. Order and counts only, no timings.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use skein_core::Status;
use skein_quota_server::harness::{wide_then_small, Figures, Fleet, ServerProcess, Setup, Store};

const LIMIT: usize = 20;
const WINDOW_MS: u64 = 2_000;
const RPM: u64 = 600;
const WIDE: usize = 32;

async fn run(store: Store, declared: bool, tag: &str) -> Figures {
    let server = ServerProcess::start(
        Path::new(env!("CARGO_BIN_EXE_skein-quota-server")),
        LIMIT,
        WINDOW_MS,
    )
    .unwrap();
    let setup = Setup {
        store,
        declared_rpm: declared.then_some(RPM),
        workers: 3,
        concurrency: 8,
    };
    let fleet = Fleet::start(&server.url, &setup).await.unwrap();
    let f = wide_then_small(&fleet, &server, WIDE, 1, RPM, Duration::from_secs(90), tag)
        .await
        .unwrap();
    fleet.stop().await;
    eprintln!("{tag}: {f:?}");
    assert_eq!(f.wide, Status::Completed, "{f:?}");
    assert_eq!(f.small, Status::Completed, "{f:?}");
    // Every call of both trees was answered once: the root twice and each part once.
    assert_eq!(f.answered, (WIDE as u64 + 2) + 3, "{f:?}");
    assert!(
        f.small_first,
        "the small tree waited behind the wide one: {f:?}"
    );
    // The parts queued for the quota (listed, as `skein tree` and the UI show them).
    assert!(f.most_waiting > 0, "{f:?}");
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_declared_limit_gets_almost_no_429() {
    let f = run(Store::Embedded, true, "embedded declared").await;
    assert!(f.rate_limited <= 2, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_learned_limit_bounds_the_429s() {
    let f = run(Store::Embedded, false, "embedded learned").await;
    // The root's first answer teaches the rate before the parts start; without it the
    // 32 parts would meet the 20-request window at once.
    assert!(f.rate_limited <= 6, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_declared_limit_is_shared_by_three_workers() {
    let nats = skein_testnats::NatsServer::start();
    let f = run(Store::Nats(nats.url()), true, "nats declared").await;
    assert!(f.rate_limited <= 2, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_learned_limit_slows_every_worker() {
    let nats = skein_testnats::NatsServer::start();
    let f = run(Store::Nats(nats.url()), false, "nats learned").await;
    assert!(f.rate_limited <= 6, "{f:?}");
}

/// Two trees of the same size wait for one limited model; the one submitted second, at
/// a higher priority, has its calls granted first and ends first. (Without the priority,
/// the trees take turns and the first submitted ends first: the test can fail.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_tree_is_granted_first() {
    // 120 requests a minute declared, the server allowing far more: nothing but the
    // limiter's order decides.
    let server = ServerProcess::start(
        Path::new(env!("CARGO_BIN_EXE_skein-quota-server")),
        100,
        WINDOW_MS,
    )
    .unwrap();
    let setup = Setup {
        store: Store::Embedded,
        declared_rpm: Some(120),
        workers: 1,
        concurrency: 8,
    };
    let fleet = Fleet::start(&server.url, &setup).await.unwrap();
    let low = fleet.submit_at(4, "low", None).await.unwrap();
    // The low tree's root has been answered: its parts are about to ask.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server.stats().await.unwrap()["ok"].as_u64().unwrap_or(0) < 1
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let high = fleet.submit_at(4, "high", Some(10)).await.unwrap();
    let mut first = None;
    while std::time::Instant::now() < deadline + Duration::from_secs(30) {
        let (l, h) = (
            fleet.status(&low).await.unwrap(),
            fleet.status(&high).await.unwrap(),
        );
        if l.is_terminal() || h.is_terminal() {
            first = Some(if h.is_terminal() && !l.is_terminal() {
                "high"
            } else if l.is_terminal() && !h.is_terminal() {
                "low"
            } else {
                "both"
            });
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    fleet.stop().await;
    let stats = server.stats().await.unwrap();
    assert_eq!(stats["rate_limited"], 0, "{stats}");
    assert_eq!(first, Some("high"), "the tree that ended first; {stats}");
}

/// A burst with nothing declared: eight trees submitted at once to three NATS workers
/// with room for twelve calls, against a server allowing six in its window and taking a
/// second to answer one it admits. The roots' calls go before any answer has taught
/// anything, and those over the window are refused; what the refusals teach (the 429's
/// `Retry-After`, the stated limit, a remaining count of 0) holds every worker back, so
/// the 429s stop there instead of growing with the calls. Counts only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_learned_burst_meets_few_429s() {
    const WORKERS: usize = 3;
    const TREES: usize = 8;
    let nats = skein_testnats::NatsServer::start();
    let server = ServerProcess::start_slow(
        Path::new(env!("CARGO_BIN_EXE_skein-quota-server")),
        6,
        WINDOW_MS,
        1_000,
    )
    .unwrap();
    let setup = Setup {
        store: Store::Nats(nats.url()),
        declared_rpm: None,
        workers: WORKERS,
        concurrency: 4,
    };
    let fleet = Fleet::start(&server.url, &setup).await.unwrap();
    let submits = (0..TREES).map(|i| {
        let fleet = &fleet;
        async move { fleet.submit(1, &format!("burst {i}")).await.unwrap() }
    });
    let trees = futures::future::join_all(submits).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut open = trees.clone();
    while !open.is_empty() && std::time::Instant::now() < deadline {
        let mut still = vec![];
        for t in open {
            if !fleet.status(&t).await.unwrap().is_terminal() {
                still.push(t);
            }
        }
        open = still;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let statuses: Vec<Status> = {
        let mut s = vec![];
        for t in &trees {
            s.push(fleet.status(t).await.unwrap());
        }
        s
    };
    fleet.stop().await;
    let stats = server.stats().await.unwrap();
    eprintln!("learned burst: {stats}");
    assert!(
        statuses.iter().all(|s| *s == Status::Completed),
        "{statuses:?}"
    );
    // Each tree: its root twice and its part once, every call answered once.
    assert_eq!(stats["ok"], (TREES * 3) as u64, "{stats}");
    let limited = stats["rate_limited"].as_u64().unwrap();
    // The burst was real: more calls came at once than the window holds.
    assert!(limited > 0, "no call was refused: {stats}");
    // And bounded: about the first wave's excess, a couple a worker at most.
    assert!(
        limited <= 2 * WORKERS as u64,
        "{limited} 429s for {} calls: {stats}",
        TREES * 3
    );
}
