//! A permit under a concurrency limit, shared by two processes through a real nats-server:
//! it holds the place until given back, a renewal moves its lease on in the shared bucket,
//! and the place goes to the next asker once it is given back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use skein_nats::{NatsConfig, NatsStore};
use skein_ports::quota::{Bucket, Decision, Quota, QuotaAsk, QuotaLimits, PERMIT_LEASE_MS};
use skein_testnats::NatsServer;

async fn store_on(server: &NatsServer) -> Arc<NatsStore> {
    let cfg = NatsConfig {
        urls: vec![server.url()],
        replicas: 1,
        ..NatsConfig::default()
    };
    NatsStore::connect(&cfg, Duration::from_secs(1))
        .await
        .unwrap()
}

fn ask(session: &str) -> QuotaAsk {
    QuotaAsk {
        key: "p:m".into(),
        session: session.into(),
        root: session.into(),
        priority: 0,
        input_tokens: 10,
    }
}

/// The shared bucket of `p:m`, as stored.
async fn bucket(store: &NatsStore) -> Bucket {
    let kv = store.js.get_key_value("skein_quota").await.unwrap();
    // The key: `q_` and the name's bytes in hex.
    let key: String = "q_".to_string()
        + &"p:m"
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
    let v = kv.get(&key).await.unwrap().expect("the bucket is stored");
    serde_json::from_slice(&v).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_permit_keeps_its_place_and_a_released_one_frees_it() {
    let server = NatsServer::start();
    let (a, b) = (store_on(&server).await, store_on(&server).await);
    let limits = QuotaLimits {
        concurrent_requests: Some(1),
        ..Default::default()
    };
    let Decision::Go(permit) = a.acquire(&ask("a"), &limits).await.unwrap() else {
        panic!("the first ask waits")
    };
    let until = |bk: &Bucket| {
        *bk.permits
            .get(&permit.id)
            .expect("the permit holds a place")
    };
    let first = until(&bucket(&a).await);
    let now = skein_ports::now_ms();
    assert!(
        first > now && first <= now + PERMIT_LEASE_MS,
        "a lease of {} ms from {now}",
        first.saturating_sub(now)
    );
    // The other process is told to wait for the place.
    match b.acquire(&ask("b"), &limits).await.unwrap() {
        Decision::Wait { reason, .. } => assert!(reason.contains("concurrent"), "{reason}"),
        Decision::Go(_) => panic!("two permits under a limit of one"),
    }
    // A renewal (from the holder's process) moves the lease on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    a.renew(&permit, &limits).await.unwrap();
    let renewed = until(&bucket(&b).await);
    assert!(renewed > first, "renewed to {renewed}, was {first}");
    match b.acquire(&ask("b"), &limits).await.unwrap() {
        Decision::Wait { .. } => {}
        Decision::Go(_) => panic!("a renewed permit's place was given away"),
    }
    // Given back: the place is the waiter's.
    a.release(&permit, &limits, Some((10, 5))).await.unwrap();
    assert!(!bucket(&b).await.permits.contains_key(&permit.id));
    assert!(matches!(
        b.acquire(&ask("b"), &limits).await.unwrap(),
        Decision::Go(_)
    ));
    // Without a concurrency limit a permit holds no place, and renewing it writes nothing.
    let free = QuotaLimits::default();
    let Decision::Go(other) = a.acquire(&ask("c"), &free).await.unwrap() else {
        panic!("an unlimited ask waits")
    };
    let before = bucket(&a).await;
    a.renew(&other, &free).await.unwrap();
    assert_eq!(bucket(&a).await, before);
}
