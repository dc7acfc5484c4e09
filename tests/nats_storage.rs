//! A JetStream store that fills during a fan-out: the worker's steps wait in place for
//! room, say so (in its log and in `skein tree`), and run on once the server has room again (restarted with a larger
//! `max_file_store`): the tree completes, no session of it fails, and it replays.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{bin, fan_out, run_ok, Sandbox};
use skein_core::{Event, SessionId};
use skein_testnats::NatsServer;

const SECRET: &str = "test-secret-not-for-production";

fn skein_nats(sb: &Sandbox, url: &str) -> std::process::Command {
    let mut c = std::process::Command::new(bin());
    c.arg("--config")
        .arg(sb.config())
        .args(["--nats", url])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__NATS__REPLICAS", "1")
        .env("SKEIN_LOG", "warn")
        .stdin(Stdio::null());
    c
}

/// A worker whose stderr lines after "ready" are kept.
fn worker(sb: &Sandbox, url: &str) -> (Child, Arc<Mutex<Vec<String>>>) {
    let mut c = skein_nats(sb, url);
    c.args(["worker", "--concurrency", "16"])
        .env("SKEIN__RUNTIME__LEASE", "3s")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the worker exited");
        if line.contains("ready") {
            break;
        }
    }
    let log = Arc::new(Mutex::new(vec![]));
    let kept = log.clone();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            kept.lock().unwrap().push(l);
        }
    });
    (child, log)
}

/// Fills JetStream's file store with a stream of its own until it refuses, then deletes
/// `room` bytes of it again.
async fn fill(url: &str, room: usize) {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "FILLER".into(),
            subjects: vec!["filler.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let chunk = vec![7u8; 32 << 10];
    let mut stored = vec![];
    for _ in 0..10_000 {
        match js.publish("filler.x", chunk.clone().into()).await {
            Ok(ack) => match ack.await {
                Ok(a) => stored.push(a.sequence),
                Err(_) => break,
            },
            Err(_) => break,
        }
    }
    assert!(
        stored.len() < 10_000,
        "the store never filled: is max_file_store set?"
    );
    for seq in stored.iter().rev().take(room / chunk.len()) {
        stream.delete_message(*seq).await.unwrap();
    }
    let _ = stream.info().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_jetstream_store_pauses_a_fan_out_until_there_is_room_and_it_completes() {
    // Given a server with a small file store, a worker, and the store all but full.
    let mut server = NatsServer::start_with_jetstream("  max_file_store: 8MB");
    let url = server.url();
    let sb = fan_out(5);
    let (mut w, log) = worker(&sb, &url);
    fill(&url, 256 << 10).await;

    // When a fan-out of 100 is submitted and fills the store.
    let root = format!("full-{}", &skein_runtime::new_root_id().as_str()[16..]);
    let mut c = skein_nats(&sb, &url);
    c.args(["submit", "--agent", "fanout", "--no-cache", "--id", &root])
        .args(["--inputs", "{\"n\": 100}", "fan out"]);
    run_ok(c);

    // Then its steps say they wait for room, naming JetStream's refusal.
    let deadline = Instant::now() + Duration::from_secs(60);
    let said = loop {
        let found = log
            .lock()
            .unwrap()
            .iter()
            .find(|l| l.contains("no room in the store"))
            .cloned();
        if let Some(l) = found {
            break l;
        }
        assert!(
            Instant::now() < deadline,
            "no step waited for room; the worker said:\n{}",
            log.lock().unwrap().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(said.contains("JetStream has no room"), "{said}");

    // And `skein tree`, in another process, shows which sessions wait and why.
    let tree = |json: bool| {
        let mut c = skein_nats(&sb, &url);
        c.args(["tree", &root]);
        if json {
            c.arg("--json");
        }
        String::from_utf8(run_ok(c).stdout).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let shown = tree(false);
        if shown.contains("waiting for room in the store") {
            assert!(shown.contains("JetStream has no room"), "{shown}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not shown as waiting:\n{shown}\nthe worker said:\n{}",
            log.lock().unwrap().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // And when the server has room again (restarted with a larger limit), the tree
    // completes without a restart of the worker, and no session of it failed.
    server.restart_with_jetstream("  max_file_store: 256MB");
    let id = SessionId::parse(&root).unwrap();
    let st = common::cluster::store(&url, 1).await;
    let b = st.backend();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(Some(r)) = b.log.last(&id).await {
            if r.env.body.is_terminal() {
                match &r.env.body {
                    Event::Completed(c) => assert_eq!(c.answer, "100 parts done"),
                    e => panic!("the tree ended otherwise: {e:?}"),
                }
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the tree did not end; the worker said:\n{}",
            log.lock().unwrap().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut c = skein_nats(&sb, &url);
    c.args(["replay", &root, "--tree", "--verify"]);
    run_ok(c);
    let done: serde_json::Value = serde_json::from_str(&tree(true)).unwrap();
    assert_eq!(
        done["waiting_for_room"].as_array().map(Vec::len),
        Some(0),
        "marks left after the tree ended: {}",
        done["waiting_for_room"]
    );
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("the store has room again")),
        "no session said it runs on"
    );
    common::cluster::kill9(&mut w);
}
