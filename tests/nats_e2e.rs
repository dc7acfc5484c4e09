//! End to end on NATS JetStream with real processes: nats-server(s), several `skein worker`
//! processes, and submissions made with the NATS text protocol over a plain TCP socket
//! (not skein's client code). Faults: a worker killed with SIGKILL, the server restarted.
//! Afterwards every log is audited. The tests take a lock so that their worker processes
//! do not compete for the same two cores.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use skein_core::{AgentSet, Event, Limits, SessionId};
use skein_nats::{NatsConfig, NatsStore};
use skein_testnats::{Cluster, NatsServer};

const SECRET: &str = "test-secret-not-for-production";

fn worker(urls: &str, name: &str, replicas: usize) -> Child {
    let mut c = std::process::Command::new(bin());
    c.args(["--config"])
        .arg(demo_config())
        .args(["--nats", urls, "worker", "--concurrency", "32"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__RUNTIME__LEASE", "3s")
        .env("SKEIN__RUNTIME__WORKER_ID", name)
        .env("SKEIN__NATS__REPLICAS", replicas.to_string())
        .env(
            "SKEIN_LOG",
            std::env::var("SKEIN_E2E_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("worker starts");
    // Wait for its "ready" line.
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("worker {name} exited before it was ready");
        }
        if line.contains("ready") {
            break;
        }
    }
    let tag = name.to_string();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if std::env::var("SKEIN_E2E_VERBOSE").is_ok() {
                eprintln!("[{tag}] {l}");
            }
        }
    });
    child
}

fn kill9(c: &mut Child) {
    std::process::Command::new("kill")
        .args(["-9", &c.id().to_string()])
        .status()
        .unwrap();
    let _ = c.wait();
}

/// Publishes with the NATS text protocol over TCP: `PUB subject n\r\npayload\r\n`.
fn raw_publish(url: &str, subject: &str, payloads: &[Vec<u8>]) {
    let addr = url.trim_start_matches("nats://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut info = String::new();
    r.read_line(&mut info).unwrap();
    assert!(info.starts_with("INFO "), "{info}");
    s.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"name\":\"raw-e2e\"}\r\n")
        .unwrap();
    for p in payloads {
        s.write_all(format!("PUB {subject} {}\r\n", p.len()).as_bytes())
            .unwrap();
        s.write_all(p).unwrap();
        s.write_all(b"\r\n").unwrap();
    }
    s.write_all(b"PING\r\n").unwrap();
    let mut line = String::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line.starts_with("PONG") {
            break;
        }
        assert!(!line.starts_with("-ERR"), "{line}");
    }
    let _ = r.read(&mut [0u8; 0]);
}

fn missions(tag: &str, n: usize) -> (Vec<SessionId>, Vec<Vec<u8>>) {
    let ids: Vec<SessionId> = (0..n)
        .map(|i| SessionId::root(&format!("{tag}-{i}")).unwrap())
        .collect();
    let payloads = ids
        .iter()
        .map(|id| {
            serde_json::json!({"agent": "orchestrator", "mission": format!("Brief on {id}"), "id": id.to_string(), "no_cache": true})
                .to_string()
                .into_bytes()
        })
        .collect();
    (ids, payloads)
}

fn tag() -> String {
    skein_runtime::new_root_id().as_str()[16..].to_string()
}

async fn store(urls: &str, replicas: usize) -> std::sync::Arc<NatsStore> {
    let cfg = NatsConfig {
        urls: urls.split(',').map(str::to_string).collect(),
        replicas,
        ..NatsConfig::default()
    };
    NatsStore::connect(&cfg, Duration::from_secs(3))
        .await
        .unwrap()
}

/// Waits until every root has ended (reading the logs), or fails after `limit`.
async fn wait_all(urls: &str, replicas: usize, roots: &[SessionId], limit: Duration) {
    let st = store(urls, replicas).await;
    let b = st.backend();
    let deadline = Instant::now() + limit;
    loop {
        let mut open = 0;
        for r in roots {
            match b.log.last(r).await {
                Ok(Some(rec)) if rec.env.body.is_terminal() => {}
                _ => open += 1,
            }
        }
        if open == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{open} of {} trees still open after {limit:?}",
            roots.len()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The checks of one log that need nothing but the log: the hash chain, no tool call
/// recorded twice, one terminal event and it is `Completed`. Adds the workers that made
/// its model calls to `workers`.
fn check_log(s: &SessionId, recs: &[skein_core::Record], workers: &mut BTreeSet<String>) {
    skein_core::event::verify_chain(s, recs).unwrap_or_else(|e| panic!("{s}: {e:?}"));
    let mut calls = BTreeSet::new();
    let mut terminal = 0;
    for r in recs {
        match &r.env.body {
            Event::ToolCalled(t) => assert!(calls.insert(t.call.clone()), "{s}: {} twice", t.call),
            Event::ModelCalled(m) => {
                workers.insert(m.worker.clone());
            }
            e if e.is_terminal() => terminal += 1,
            _ => {}
        }
    }
    assert_eq!(terminal, 1, "{s}");
    assert!(
        matches!(recs.last().unwrap().env.body, Event::Completed(_)),
        "{s}: ends with {}",
        recs.last().unwrap().env.body.kind()
    );
}

/// Every tree completed; every log verifies (chain, decisions, one terminal event, no
/// duplicated step). Returns the workers that made model calls.
async fn audit(urls: &str, replicas: usize, roots: &[SessionId]) -> BTreeSet<String> {
    let st = store(urls, replicas).await;
    let b = st.backend();
    let files = read_agents();
    let agents = AgentSet::load(&files, &[]).unwrap();
    let mut workers = BTreeSet::new();
    for root in roots {
        let verdicts = skein_runtime::replay::verify_tree(&b, root, &agents, &Limits::default())
            .await
            .unwrap();
        assert_eq!(verdicts.len(), 5, "{root}");
        for v in verdicts {
            assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
        }
        for s in b.log.tree(root).await.unwrap() {
            check_log(&s, &b.log.read(&s, 1).await.unwrap(), &mut workers);
        }
    }
    workers
}

/// The checks of [`check_log`] on every log of every tree (no decision replay, which
/// would read every definition blob right after a node loss).
async fn chains(urls: &str, roots: &[SessionId]) {
    let st = store(urls, 3).await;
    let b = st.backend();
    let mut workers = BTreeSet::new();
    for root in roots {
        for s in b.log.tree(root).await.unwrap() {
            check_log(&s, &b.log.read(&s, 1).await.unwrap(), &mut workers);
        }
    }
}

fn read_agents() -> Vec<(String, String)> {
    std::fs::read_dir(repo().join("config/agents"))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.display().to_string(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect()
}

/// Serialises the tests of this file: each runs several processes.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn three_workers_run_fifty_raw_submissions_and_one_is_killed_midway() {
    let _serial = serial();
    let server = NatsServer::start();
    let url = server.url();
    let mut workers = Workers((1..=3).map(|i| worker(&url, &format!("w{i}"), 1)).collect());
    let (ids, payloads) = missions(&format!("k{}", tag()), 50);
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
    raw_publish(&url, "skein.missions.submit", &payloads);
    std::thread::sleep(Duration::from_millis(700));
    server.restart();
    let rt = rt();
    rt.block_on(wait_all(&url, 1, &ids, Duration::from_secs(180)));
    rt.block_on(audit(&url, 1, &ids));
}

#[test]
fn a_cluster_node_killed_mid_run_loses_nothing() {
    let _serial = serial();
    let mut cluster = Cluster::start();
    let urls = cluster.urls();
    let _workers = Workers(
        (1..=2)
            .map(|i| worker(&urls, &format!("c{i}"), 3))
            .collect(),
    );
    let (ids, payloads) = missions(&format!("c{}", tag()), 20);
    raw_publish(&cluster.url(1), "skein.missions.submit", &payloads);
    std::thread::sleep(Duration::from_millis(700));
    cluster.kill9(0);
    let rt = rt();
    // Every mission completes while the node is down, and every log of every tree has
    // an unbroken hash chain, no duplicated tool call and one terminal event.
    rt.block_on(wait_all(&urls, 3, &ids, Duration::from_secs(240)));
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
