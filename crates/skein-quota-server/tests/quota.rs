//! Shared model quotas against a server that enforces one (its own process): a tree of
//! 32 parts with a small tree submitted after it, at 600 requests a minute (20 per 2 s
//! window), on the embedded store and on NATS with 3 workers; with the limit declared
//! and with only what the server's answers say. Order and counts only, no timings.
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
