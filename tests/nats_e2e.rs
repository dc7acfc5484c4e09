//! End to end on NATS JetStream with real processes: nats-server(s), several `skein worker`
//! processes, and submissions made with the NATS text protocol over a plain TCP socket
//! (not skein's client code). Faults: a worker killed with SIGKILL, the server restarted.
//! Afterwards every log is audited, and an independent subscriber of `skein.results.>`
//! (the text protocol again) has heard no tree's result twice. The tests take a lock so
//! that their worker processes do not compete for the same two cores.

mod common;

use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;
use skein_core::{Event, SessionId};
use skein_testnats::{Cluster, NatsServer};

#[test]
fn three_workers_run_fifty_raw_submissions_and_one_is_killed_midway() {
    let _serial = serial();
    let server = NatsServer::start();
    let url = server.url();
    let mut workers = Workers((1..=3).map(|i| worker(&url, &format!("w{i}"), 1)).collect());
    let (ids, payloads) = missions(&format!("k{}", tag()), 50);
    let tally = ResultTally::subscribe(std::slice::from_ref(&url));
    raw_publish(&url, "skein.missions.submit", &payloads);
    let rt = rt();
    // Kill a worker once the run is well under way.
    rt.block_on(async {
        let st = store(&url, 1).await;
        let b = st.backend();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut started = 0;
            for r in &ids[..10] {
                if b.log.tree(r).await.map(|t| t.len() > 1).unwrap_or(false) {
                    started += 1;
                }
            }
            if started >= 5 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the run never got under way: {started} of the first 10 trees started"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    kill9(&mut workers.0[0]);
    rt.block_on(wait_all(&url, 1, &ids, Duration::from_secs(180)));
    tally.assert_each_exactly_once(&ids, Duration::from_secs(30));
    let used = rt.block_on(audit(&url, 1, &ids));
    assert!(used.len() >= 2, "work spread over the workers: {used:?}");
}

#[test]
fn a_server_restart_mid_run_loses_nothing() {
    let _serial = serial();
    let mut server = NatsServer::start();
    let url = server.url();
    let _workers = Workers((1..=2).map(|i| worker(&url, &format!("r{i}"), 1)).collect());
    let (ids, payloads) = missions(&format!("r{}", tag()), 20);
    // It hears nothing while the server is down: no result twice is all it can tell.
    let tally = ResultTally::subscribe(std::slice::from_ref(&url));
    raw_publish(&url, "skein.missions.submit", &payloads);
    std::thread::sleep(Duration::from_millis(700));
    server.restart();
    let rt = rt();
    rt.block_on(wait_all(&url, 1, &ids, Duration::from_secs(180)));
    rt.block_on(audit(&url, 1, &ids));
    tally.assert_at_most_once();
}

async fn leader_of(urls: &str, stream: &str) -> Option<String> {
    let st = store(urls, 3).await;
    let mut s = st.js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    info.cluster.as_ref().and_then(|c| c.leader.clone())
}

/// `skein submit` right after the node leading `SKEIN_MISSIONS` is killed with SIGKILL.
/// Until new leaders are elected (about ten seconds here) the remaining servers answer
/// but their JetStream does not: the command waits for it rather than failing at its
/// connect limit, prints the id, and the tree completes once. (A plain `nats pub` in
/// that window is dropped by the server: docs/nats.md.)
#[test]
fn a_submit_while_the_missions_stream_elects_a_leader_is_taken_once() {
    let _serial = serial();
    let mut cluster = Cluster::start();
    let urls = cluster.urls();
    let _workers = Workers(vec![worker(&urls, "m1", 3)]);
    let rt = rt();
    let victim = rt
        .block_on(leader_of(&urls, "SKEIN_MISSIONS"))
        .and_then(|l| cluster.index_of(&l))
        .expect("SKEIN_MISSIONS has a leader");
    let id = format!("m{}", tag());
    let tally = ResultTally::subscribe(&[cluster.url((victim + 1) % 3)]);
    cluster.kill9(victim);
    let data = tempfile::tempdir().expect("a data directory");
    let out = skein(&demo_config(), data.path())
        .args([
            "--nats",
            &urls,
            "submit",
            "--agent",
            "orchestrator",
            "--id",
            &id,
        ])
        .arg("Brief on leader elections")
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .output()
        .expect("skein submit runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), id);
    let root = SessionId::root(&id).expect("a root id");
    rt.block_on(wait_all(
        &urls,
        3,
        std::slice::from_ref(&root),
        Duration::from_secs(120),
    ));
    tally.assert_each_exactly_once(std::slice::from_ref(&root), Duration::from_secs(60));
}

/// The acceptance of "a tree's result is announced once": a 3-node cluster, a worker
/// killed with SIGKILL, then the node leading `SKEIN_RESULTS` (or another one, should
/// that be the subscriber's), then a second worker, each worker replaced as it dies.
/// Every tree completes, and the subscriber, on a node that stays up, hears each tree's
/// result exactly once.
#[test]
fn a_node_and_workers_killed_mid_run_lose_nothing_and_each_result_is_heard_once() {
    let _serial = serial();
    let mut cluster = Cluster::start();
    let urls = cluster.urls();
    let mut workers = Workers(
        (1..=3)
            .map(|i| worker(&urls, &format!("c{i}"), 3))
            .collect(),
    );
    let (ids, payloads) = missions(&format!("c{}", tag()), 30);
    let tally = ResultTally::subscribe(&[cluster.url(1)]);
    raw_publish(&cluster.url(1), "skein.missions.submit", &payloads);
    std::thread::sleep(Duration::from_millis(700));
    kill9(&mut workers.0[0]);
    workers.0[0] = worker(&urls, "c4", 3);
    let rt = rt();
    let led = rt
        .block_on(leader_of(&urls, "SKEIN_RESULTS"))
        .and_then(|l| cluster.index_of(&l))
        .filter(|i| *i != 1);
    let victim = led.unwrap_or(0);
    eprintln!(
        "killing {} (the leader of SKEIN_RESULTS: {})",
        cluster.name(victim),
        led.is_some()
    );
    cluster.kill9(victim);
    std::thread::sleep(Duration::from_millis(1000));
    kill9(&mut workers.0[1]);
    workers.0[1] = worker(&urls, "c5", 3);
    // Every mission completes while the node is down, and every log of every tree has
    // an unbroken hash chain, no duplicated tool call and one terminal event.
    rt.block_on(wait_all(&urls, 3, &ids, Duration::from_secs(240)));
    tally.assert_each_exactly_once(&ids, Duration::from_secs(60));
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(180), chains(&urls, &ids))
            .await
            .expect("the chain audit finished")
    });
}

#[test]
fn malformed_submissions_are_rejected_with_reasons_and_block_nothing() {
    let _serial = serial();
    let server = NatsServer::start();
    let url = server.url();
    let _workers = Workers(vec![worker(&url, "m1", 1)]);
    let rt = rt();
    let client = rt.block_on(async_nats::connect(url.clone())).unwrap();
    let mut rejected = rt
        .block_on(client.subscribe("skein.missions.rejected"))
        .unwrap();
    rt.block_on(client.flush()).unwrap();
    let t = tag();
    let good = |i: usize| {
        serde_json::json!({"agent": "orchestrator", "mission": "a good one", "id": format!("good-{t}-{i}")})
            .to_string()
            .into_bytes()
    };
    let corpus: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "invalid JSON submission"),
        (b"".to_vec(), "invalid JSON submission"),
        (
            br#"{"agent": 5, "mission": "x"}"#.to_vec(),
            "invalid type: integer `5`",
        ),
        (
            br#"{"agent": "ghost", "mission": "x"}"#.to_vec(),
            "unknown agent `ghost`",
        ),
        (
            br#"{"agent": "orchestrator", "mission": "   "}"#.to_vec(),
            "mission is empty",
        ),
        (
            br#"{"agent": "orchestrator", "mission": "x", "id": "Not A Token"}"#.to_vec(),
            "id: invalid session id",
        ),
        (
            br#"{"agent": "orchestrator", "mission": "x", "colour": "red"}"#.to_vec(),
            "unknown field `colour`",
        ),
        (br#"{"mission": "x"}"#.to_vec(), "missing field `agent`"),
        (
            br#"{"agent": "orchestrator", "mission": "x", "inputs": [1]}"#.to_vec(),
            "inputs must be a JSON object",
        ),
        (
            serde_json::json!({"agent": "orchestrator", "mission": "x".repeat(70_000)})
                .to_string()
                .into_bytes(),
            "at most 65536 are accepted",
        ),
    ];
    let mut payloads = vec![good(0)];
    for (i, (p, _)) in corpus.iter().enumerate() {
        payloads.push(p.clone());
        payloads.push(good(i + 1));
    }
    raw_publish(&url, "skein.missions.submit", &payloads);
    let reasons: Vec<String> = rt.block_on(async {
        let mut out = vec![];
        while out.len() < corpus.len() {
            let m = tokio::time::timeout(
                Duration::from_secs(30),
                futures::StreamExt::next(&mut rejected),
            )
            .await
            .expect("a rejection for every bad submission")
            .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
            out.push(v["reason"].as_str().unwrap().to_string());
        }
        out
    });
    for (i, (_, want)) in corpus.iter().enumerate() {
        assert!(
            reasons[i].contains(want),
            "bad submission {i}: wanted `{want}`, got `{}`",
            reasons[i]
        );
    }
    let goods: Vec<SessionId> = (0..=corpus.len())
        .map(|i| SessionId::root(&format!("good-{t}-{i}")).unwrap())
        .collect();
    rt.block_on(wait_all(&url, 1, &goods, Duration::from_secs(120)));
    // Resubmitting an id is a no-op: still one root, still one Submitted.
    raw_publish(&url, "skein.missions.submit", &[good(0)]);
    std::thread::sleep(Duration::from_millis(500));
    let st = rt.block_on(store(&url, 1));
    let recs = rt.block_on(st.backend().log.read(&goods[0], 1)).unwrap();
    assert_eq!(
        recs.iter()
            .filter(|r| matches!(r.env.body, Event::Submitted(_)))
            .count(),
        1
    );
}
