//! The JetStream backend against real nats-server processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use skein_core::event::{genesis_hash, Cancelled};
use skein_core::{Envelope, Event, Record};
use skein_nats::{NatsConfig, NatsStore};
use skein_ports::quota::{Bucket, Decision, Quota, QuotaAsk, QuotaLimits, PERMIT_LEASE_MS};
use skein_runtime::ports::Durability;
use skein_testnats::{Cluster, NatsServer};

fn cfg(urls: &str, replicas: usize) -> NatsConfig {
    NatsConfig {
        urls: urls.split(',').map(str::to_string).collect(),
        replicas,
        ..NatsConfig::default()
    }
}

/// The ports' conformance suite on a real server, one test per check (each with its own
/// server), with the one-second lease the suite expects.
mod conformance {
    use super::*;

    async fn nats() -> (NatsServer, skein_runtime::ports::Backend) {
        let server = NatsServer::start();
        let store = store_on(&server).await;
        (server, store.backend())
    }

    skein_runtime::conformance_tests!(nats);

    /// The claim that notices outlive a worker: another store opened on the same server,
    /// after the first is gone, reads them whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn notices_outlive_workers() {
        let server = NatsServer::start();
        let first = store_on(&server).await.backend();
        let reopen = async { store_on(&server).await.backend() };
        if let Err(e) = skein_runtime::conformance::notices_outlive_workers(first, reopen).await {
            panic!("notices_outlive_workers: {e}");
        }
    }
}

/// The log's and the notices' checks of the suite again, on a store that gathers its
/// appends and notices into atomic batches (`group_commit`), as it does on servers 2.15.1
/// and later; on earlier ones the store is asked for it and must not use it.
mod conformance_grouped {
    use super::*;

    async fn nats() -> (NatsServer, skein_runtime::ports::Backend) {
        let server = NatsServer::start();
        let store = NatsStore::connect(
            &NatsConfig {
                group_commit: true,
                ..cfg(&server.url(), 1)
            },
            Duration::from_secs(1),
        )
        .await
        .unwrap();
        let version = skein_testnats::nats_server_version();
        // "nats-server: v2.15.1"
        let numbers: Vec<u64> = version
            .split(|c: char| !c.is_ascii_digit())
            .filter(|n| !n.is_empty())
            .take(3)
            .map(|n| n.parse().unwrap())
            .collect();
        let grouped = numbers.as_slice() >= [2, 15, 1].as_slice();
        assert_eq!(store.groups_appends(), grouped, "nats-server {version}");
        assert_eq!(store.groups_notices(), grouped, "nats-server {version}");
        (server, store.backend())
    }

    skein_runtime::conformance_tests!(@each nats; log_appends_and_reads, log_refuses_a_stale_append, log_appends_batches, log_pipelines_appends, log_appends_ahead, log_lists_trees_and_roots, long_reads_are_whole_and_ordered, notices_read_after_a_cursor, a_notice_is_read_by_the_claimer_of_its_wake, notices_among_others_read_whole_from_every_cursor, notices_in_step_with_wakes, jobs_of_ended_sessions_are_acked_and_woken_again);
}

/// A store on `server` (one replica) with the one-second lease the suite expects.
async fn store_on(server: &NatsServer) -> std::sync::Arc<NatsStore> {
    NatsStore::connect(&cfg(&server.url(), 1), Duration::from_secs(1))
        .await
        .unwrap()
}

fn rec(s: &skein_core::SessionId, seq: u64, prev: String) -> Record {
    let env = Envelope::new(
        s.clone(),
        seq,
        seq,
        prev,
        Event::Cancelled(Cancelled {
            reason: format!("r{seq}"),
        }),
    );
    Record::decode(env.encode().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_survive_a_server_restart() {
    let mut server = NatsServer::start();
    let store = store_on(&server).await;
    let b = store.backend();
    let s = skein_runtime::new_root_id();
    let r1 = rec(&s, 1, genesis_hash(&s));
    b.log
        .append(&s, 0, std::slice::from_ref(&r1), Durability::Now)
        .await
        .unwrap();
    server.restart();
    // The client reconnects by itself; the record is still there, and the chain goes on.
    let mut got = vec![];
    for _ in 0..100 {
        if let Ok(g) = b.log.read(&s, 1).await {
            got = g;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got.len(), 1);
    let r2 = rec(&s, 2, r1.hash());
    b.log
        .append(&s, 1, std::slice::from_ref(&r2), Durability::Now)
        .await
        .unwrap();
    assert_eq!(b.log.read(&s, 1).await.unwrap().len(), 2);
}

/// Tries `f` every 200 ms for up to a minute after `since` (a node's kill) until it
/// succeeds; panics naming `what` and every failed try, when and with what error.
async fn until_ok<T, E: std::fmt::Debug, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    since: std::time::Instant,
    mut f: impl FnMut() -> F,
) -> T {
    let mut tries = vec![];
    while since.elapsed() < Duration::from_secs(60) {
        match f().await {
            Ok(t) => return t,
            Err(e) => tries.push(format!("{:?} after the kill: {e:?}", since.elapsed())),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{what} with one node of three down: every try failed: {tries:#?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_keeps_working_with_a_node_down() {
    let mut cluster = Cluster::start();
    let store = NatsStore::connect(&cfg(&cluster.urls(), 3), Duration::from_secs(2))
        .await
        .unwrap();
    let b = store.backend();
    let s = skein_runtime::new_root_id();
    let r1 = rec(&s, 1, genesis_hash(&s));
    b.log
        .append(&s, 0, std::slice::from_ref(&r1), Durability::Now)
        .await
        .unwrap();
    cluster.kill9(0);
    let down = std::time::Instant::now();
    // Each stream and bucket whose leader was the node killed answers "no stream found"
    // until the others elect one: seconds, and on a loaded machine (nats-server 2.9.10
    // with other clusters beside it) more than 20. The runtime retries such errors, and
    // so does this test, each step for up to a minute after the kill.
    let r2 = rec(&s, 2, r1.hash());
    until_ok("an append", down, || {
        b.log
            .append(&s, 1, std::slice::from_ref(&r2), Durability::Now)
    })
    .await;
    until_ok("a push", down, || b.jobs.push("default", &s)).await;
    // Opening the pool's consumer may meet the same election: the work loop tries again
    // and says so, and so does this test.
    let j = until_ok("a claim", down, || {
        b.jobs.claim("default", Duration::from_secs(5))
    })
    .await;
    assert_eq!(j.map(|j| j.session), Some(s.clone()));
    // Every check must pass with the node down; a check that met an election in progress
    // (each stream and bucket elects its own leader, some seconds after the kill) may be
    // run again (each run uses fresh sessions).
    let mut last = None;
    for _ in 0..10 {
        match skein_runtime::conformance::run_all(&b).await {
            Ok(()) => {
                last = None;
                break;
            }
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
    assert!(last.is_none(), "conformance with a node down: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_store_workspace_round_trips_and_refuses_escapes() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let root = skein_runtime::new_root_id();
    let ws = store.backend().workspaces.for_tree(&root);
    ws.write("notes/a.txt", b"hello").await.unwrap();
    ws.write("b.txt", b"x").await.unwrap();
    assert_eq!(ws.read("notes/a.txt").await.unwrap(), b"hello");
    assert_eq!(ws.read("./notes//a.txt").await.unwrap(), b"hello");
    let top: Vec<String> = ws
        .list(".")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(top, vec!["b.txt", "notes"]);
    // A file of many chunks (the store cuts at 128 KiB) reads back whole.
    let big: Vec<u8> = (0..1_300_000u32).map(|i| (i % 251) as u8).collect();
    ws.write("notes/big.bin", &big).await.unwrap();
    assert!(ws.read("notes/big.bin").await.unwrap() == big);
    // Reads and listings leave nothing behind on the server: the consumer of a long read
    // or of a listing is deleted once it ends (the read does not wait for the delete, so
    // it may take a moment).
    let mut meta = store.js.get_stream("OBJ_skein_workspace").await.unwrap();
    let mut left = u64::MAX;
    for _ in 0..100 {
        left = meta.info().await.unwrap().state.consumer_count as u64;
        if left == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0, "consumers of finished reads still on the server");
    // Refused for the path itself, not merely missing: `../other/x` names no object, so
    // any error would do for a read; only a refusal shows the path was judged.
    use skein_tools::ToolError;
    for bad in [
        "../other/x",
        "/etc/passwd",
        "a/../../b",
        "c:\\x",
        "nul\0.txt",
        "line\nbreak.txt",
        "esc\u{1b}[2J.txt",
        "del\u{7f}",
        "c1\u{85}",
    ] {
        let read = ws.read(bad).await;
        assert!(
            matches!(&read, Err(ToolError::Refused(m)) if m.contains("refused")),
            "{bad}: read gave {read:?}"
        );
        let write = ws.write(bad, b"y").await;
        assert!(
            matches!(&write, Err(ToolError::Refused(m)) if m.contains("refused")),
            "{bad}: write gave {write:?}"
        );
    }
    // Another tree does not see these files, and its files are not listed here.
    let other = store
        .backend()
        .workspaces
        .for_tree(&skein_runtime::new_root_id());
    assert!(other.read("b.txt").await.is_err());
    assert!(other.list(".").await.unwrap().is_empty());
    other.write("c.txt", b"z").await.unwrap();
    let names = |ws: std::sync::Arc<dyn skein_tools::Workspace>| async move {
        ws.list(".")
            .await
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.size))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(other.clone()).await, vec![("c.txt".to_string(), 1)]);
    assert_eq!(
        names(ws.clone()).await,
        vec![("b.txt".to_string(), 1), ("notes".to_string(), 0)]
    );
    // An object deleted through the store (as `nats object rm` does) is no longer listed.
    let objects = store.js.get_object_store("skein_workspace").await.unwrap();
    objects.delete(format!("{root}/b.txt")).await.unwrap();
    assert_eq!(names(ws.clone()).await, vec![("notes".to_string(), 0)]);
    assert_eq!(ws.usage("notes/a.txt").await.unwrap().total, 5 + 1_300_000);
}

/// The requests of workspace listings heard on `requests` (a subscription to the
/// stream API) until none comes for 300 ms: the questions whether a description was
/// written since the last listing, and the listings of names (each page of names a
/// request of its own: a few names make one).
async fn listing_requests(requests: &mut async_nats::Subscriber) -> (usize, usize) {
    use futures::StreamExt;
    let (mut asked, mut listed) = (0, 0);
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(300), requests.next()).await
    {
        // A listing names the subjects it wants; the object store's own requests do not.
        if m.subject.as_str() == "$JS.API.STREAM.INFO.OBJ_skein_workspace"
            && String::from_utf8_lossy(&m.payload).contains("subjects_filter")
        {
            listed += 1;
        } else if m.subject.as_str() == "$JS.API.STREAM.MSG.GET.OBJ_skein_workspace"
            && String::from_utf8_lossy(&m.payload).contains("skein_workspace.M.>")
        {
            asked += 1;
        }
    }
    (asked, listed)
}

/// Listings that run at once share their requests to the server, and each still sees every
/// write acknowledged before it began: in four trees, writers on one worker's store list
/// through another's right after each write, while that one lists all the time, and find
/// every file they wrote; then 64 listings at once cost a few requests, not 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_at_once_share_requests_and_see_every_write_before_them() {
    let server = NatsServer::start();
    let one = store_on(&server).await;
    let two = store_on(&server).await;
    let roots: Vec<_> = (0..4).map(|_| skein_runtime::new_root_id()).collect();
    // Listings through `one` all the time, so that a request is nearly always under way
    // when a writer's listing begins.
    let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spin = {
        let (ws, busy) = (one.backend().workspaces.for_tree(&roots[0]), busy.clone());
        tokio::spawn(async move {
            while busy.load(std::sync::atomic::Ordering::Relaxed) {
                ws.list(".").await.unwrap();
            }
        })
    };
    let mut tasks = vec![];
    for root in &roots {
        let (w, r) = (
            two.backend().workspaces.for_tree(root),
            one.backend().workspaces.for_tree(root),
        );
        tasks.push(tokio::spawn(async move {
            for i in 0..16 {
                let name = format!("f{i}.txt");
                w.write(&name, b"x").await.unwrap();
                let listed = r.list(".").await.unwrap();
                assert!(
                    listed.iter().any(|e| e.name == name),
                    "{name}, written before the listing began, is not in it: {listed:?}"
                );
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    busy.store(false, std::sync::atomic::Ordering::Relaxed);
    spin.await.unwrap();
    // The requests a listing makes: the question whether any description was written
    // since the last listing (the last description message), and the listing of names.
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut requests = client.subscribe("$JS.API.STREAM.>").await.unwrap();
    client.flush().await.unwrap();
    let ws = one.backend().workspaces.for_tree(&roots[0]);
    let listings = (0..64).map(|_| {
        let ws = ws.clone();
        async move { ws.list(".").await }
    });
    for listed in futures::future::join_all(listings).await {
        assert_eq!(listed.unwrap().len(), 16, "each tree has its 16 files");
    }
    let (asked, listed) = listing_requests(&mut requests).await;
    assert!(
        (1..=4).contains(&asked),
        "64 listings at once asked {asked} times"
    );
    // Nothing was written since the last listing: the names are not listed again.
    assert_eq!(
        listed, 0,
        "64 listings after no write listed the names {listed} times"
    );

    // A write and a delete through the other store: the next listing lists the names
    // again, and shows both.
    two.backend()
        .workspaces
        .for_tree(&roots[0])
        .write("new.txt", b"y")
        .await
        .unwrap();
    let names = ws.list(".").await.unwrap();
    assert!(names.iter().any(|e| e.name == "new.txt"), "{names:?}");
    let objects = two.js.get_object_store("skein_workspace").await.unwrap();
    objects
        .delete(format!("{}/f0.txt", roots[0]).as_str())
        .await
        .unwrap();
    let names = ws.list(".").await.unwrap();
    assert!(!names.iter().any(|e| e.name == "f0.txt"), "{names:?}");
    assert_eq!(names.len(), 16, "{names:?}");
    // `one` listed its names again after each of the two writes; the writing store's own
    // check of the workspace's cap before its write lists too.
    let (_, listed) = listing_requests(&mut requests).await;
    assert!(
        listed >= 2,
        "listings after writes listed the names {listed} times"
    );

    // Listings that come and go, so that the task sending the requests keeps stopping and
    // starting again: none of them is lost between the two.
    let mut tasks = vec![];
    for _ in 0..8 {
        let ws = one.backend().workspaces.for_tree(&roots[1]);
        tasks.push(tokio::spawn(async move {
            for _ in 0..100 {
                assert_eq!(ws.list(".").await.unwrap().len(), 16);
                tokio::task::yield_now().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// A workspace bucket deleted and made again (its stream sequences start over) under a
/// worker that listed it: the worker's next listing lists the names afresh, rather than
/// answer with the names of the old bucket, whose last description had a higher sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_bucket_made_again_is_listed_afresh() {
    let server = NatsServer::start();
    let one = store_on(&server).await;
    let root = skein_runtime::new_root_id();
    let ws = one.backend().workspaces.for_tree(&root);
    for i in 0..4 {
        ws.write(&format!("old{i}.txt"), b"x").await.unwrap();
    }
    assert_eq!(ws.list(".").await.unwrap().len(), 4);
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let config = js
        .get_stream("OBJ_skein_workspace")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    js.delete_stream("OBJ_skein_workspace").await.unwrap();
    js.create_stream(config).await.unwrap();
    ws.write("new.txt", b"y").await.unwrap();
    let names: Vec<String> = ws
        .list(".")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, vec!["new.txt".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_store_workspace_is_capped_as_a_whole() {
    use skein_tools::{FilesConfig, ToolBox, ToolContext, ToolError, ToolsConfig};
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let root = skein_runtime::new_root_id();
    let ctx = ToolContext {
        session: root.clone(),
        workspace: store.backend().workspaces.for_tree(&root),
        blobs: None,
        progress: None,
    };
    // Another tree's files do not count against this one.
    let other = store
        .backend()
        .workspaces
        .for_tree(&skein_runtime::new_root_id());
    other.write("big.txt", &[b'o'; 500]).await.unwrap();
    let tb = ToolBox::builtin(&ToolsConfig {
        files: FilesConfig {
            max_workspace_bytes: 100,
            ..FilesConfig::default()
        },
        ..ToolsConfig::default()
    });
    let write = |path: &str, n: usize| serde_json::json!({"path": path, "content": "x".repeat(n)});
    tb.try_run(&ctx, "write_file", &write("a/one.txt", 60))
        .await
        .unwrap();
    let e = tb
        .try_run(&ctx, "write_file", &write("two.txt", 41))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, ToolError::Refused(m) if m.contains("101 bytes") && m.contains("at most 100")),
        "{e:?}"
    );
    assert!(ctx.workspace.read("two.txt").await.is_err());
    tb.try_run(&ctx, "write_file", &write("a/one.txt", 99))
        .await
        .unwrap();
    let u = ctx.workspace.usage("a/one.txt").await.unwrap();
    assert_eq!((u.total, u.of_path), (99, 99));
}

/// A pool consumer made by a worker with one lease takes the lease of a worker started
/// later with another, so heartbeats paced by the new lease are never too late for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_consumer_takes_the_lease_of_the_worker_that_opens_it() {
    let server = NatsServer::start();
    let ack_wait = |store: std::sync::Arc<NatsStore>| async move {
        let mut stream = store.js.get_stream("SKEIN_JOBS").await.unwrap();
        let _ = stream.info().await.unwrap();
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer("pool-leased").await.unwrap();
        c.info().await.unwrap().config.ack_wait
    };
    for lease in [Duration::from_secs(2), Duration::from_secs(7)] {
        let store = NatsStore::connect(&cfg(&server.url(), 1), lease)
            .await
            .unwrap();
        let b = store.backend();
        // A claim opens the pool's consumer.
        let none = b
            .jobs
            .claim("leased", Duration::from_millis(100))
            .await
            .unwrap();
        assert!(none.is_none());
        assert_eq!(ack_wait(store.clone()).await, lease);
    }
}

/// Opening a store on a server that has skein's streams asks for each stream's info once
/// (the object stores' twice: the client's handle of one reads its stream again), not once
/// to see that it exists and again for its handle; a command's start waits for these.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_store_asks_each_streams_info_once() {
    use futures::StreamExt;
    let server = NatsServer::start();
    let made = store_on(&server).await;
    let monitor = async_nats::connect(server.url()).await.unwrap();
    let mut infos = monitor.subscribe("$JS.API.STREAM.INFO.>").await.unwrap();
    monitor.flush().await.unwrap();
    let opened = store_on(&server).await;
    // A request of the monitor's own marks the end of the store's: the server delivers
    // a connection's messages in the order it read them.
    monitor
        .publish("$JS.API.STREAM.INFO.END", "".into())
        .await
        .unwrap();
    monitor.flush().await.unwrap();
    let mut asked = std::collections::BTreeMap::<String, usize>::new();
    while let Some(m) = tokio::time::timeout(Duration::from_secs(10), infos.next())
        .await
        .expect("the end mark")
    {
        let stream = m
            .subject
            .trim_start_matches("$JS.API.STREAM.INFO.")
            .to_string();
        if stream == "END" {
            break;
        }
        *asked.entry(stream).or_default() += 1;
    }
    let mut want: std::collections::BTreeMap<String, usize> = [
        "SKEIN_EVENTS",
        "SKEIN_ROOTS",
        "SKEIN_ROOT_STATE",
        "SKEIN_ROOT_OPEN",
        "SKEIN_ROOT_BLOCKS",
        "SKEIN_TREES",
        "SKEIN_JOBS",
        "SKEIN_NOTICES",
        "SKEIN_MISSIONS",
        "SKEIN_RESULTS",
        "KV_skein_cache",
        "KV_skein_inflight",
        "KV_skein_wake",
        "KV_skein_defs",
        "KV_skein_workers",
    ]
    .into_iter()
    .map(|s| (s.to_string(), 1))
    .collect();
    want.insert("OBJ_skein_blobs".into(), 2);
    want.insert("OBJ_skein_workspace".into(), 2);
    assert_eq!(asked, want);
    // The handles made without a second request work: a stream's and a KV bucket's.
    let (made, opened) = (made.backend(), opened.backend());
    let id = skein_core::SessionId::root("opened").unwrap();
    opened
        .log
        .append(&id, 0, &[rec(&id, 1, genesis_hash(&id))], Durability::Now)
        .await
        .unwrap();
    assert_eq!(made.log.read(&id, 1).await.unwrap().len(), 1);
    assert_eq!(opened.cache.claim_inflight("h", &id).await.unwrap(), None);
    let other = skein_core::SessionId::root("other").unwrap();
    assert_eq!(
        made.cache.claim_inflight("h", &other).await.unwrap(),
        Some(id)
    );
}

/// A job stream made the way earlier versions made it (a per-subject limit that refuses
/// new messages, which replicas of servers before 2.10 cannot catch up on) is brought to
/// the new settings when a store connects, and a session still has one job at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_job_stream_is_upgraded_and_jobs_still_coalesce() {
    use async_nats::jetstream::stream;
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(stream::Config {
        name: "SKEIN_JOBS".into(),
        subjects: vec!["skein.jobs.>".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        max_messages_per_subject: 1,
        discard: stream::DiscardPolicy::New,
        discard_new_per_subject: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let store = NatsStore::connect(&cfg(&server.url(), 1), Duration::from_secs(5))
        .await
        .unwrap();
    let mut s = js.get_stream("SKEIN_JOBS").await.unwrap();
    let config = s.info().await.unwrap().config.clone();
    assert!(!config.discard_new_per_subject, "{config:?}");
    assert!(config.max_messages_per_subject <= 0, "{config:?}");
    // Three pushes of one session while its job waits: one job.
    let b = store.backend();
    let id = skein_core::SessionId::root("coalesce").unwrap();
    for _ in 0..3 {
        b.jobs.push("default", &id).await.unwrap();
    }
    assert_eq!(s.info().await.unwrap().state.messages, 1);
    let job = b
        .jobs
        .claim("default", Duration::from_secs(2))
        .await
        .unwrap()
        .expect("the job");
    // A push while it is held leaves no second job, but wakes it again after the ack.
    b.jobs.push("default", &id).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 1);
    b.jobs.ack(&job).await.unwrap();
    let again = b
        .jobs
        .claim("default", Duration::from_secs(2))
        .await
        .unwrap()
        .expect("woken again after the ack");
    assert_eq!(again.session, id);
}

/// Records appended together (a turn's model answer, read-only tool calls and results; a
/// wide turn's delegations) go as one message of several records, and read back one by
/// one, from any seq, after a log written one record per message. A run larger than a
/// message carries goes as several. A message after another writer's record is refused
/// whole, and a publish retried after a lost ack (the same bytes) is taken as done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_appended_together_go_as_one_message_and_are_stored_whole_or_not_at_all() {
    let server = NatsServer::start();
    let store = NatsStore::connect(&cfg(&server.url(), 1), Duration::from_secs(5))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let events = js.get_stream("SKEIN_EVENTS").await.unwrap();
    let b = store.backend();
    let s = skein_runtime::new_root_id();
    let subject = format!("skein.events.{}", s.as_str());
    let mut prev = genesis_hash(&s);
    let mut records = vec![];
    for seq in 1..=41 {
        let r = rec(&s, seq, prev);
        prev = r.hash();
        records.push(r);
    }
    b.log
        .append(&s, 0, std::slice::from_ref(&records[0]), Durability::Now)
        .await
        .unwrap();
    b.log
        .append(&s, 1, &records[1..4], Durability::Now)
        .await
        .unwrap();
    b.log
        .append(&s, 4, &records[4..], Durability::Now)
        .await
        .unwrap();
    assert_eq!(
        messages_on(&js, &subject).await,
        3,
        "one message per append"
    );
    for from in [1, 2, 3, 4, 5, 30, 41] {
        let read = b.log.read(&s, from).await.unwrap();
        assert_eq!(read.len() as u64, 42 - from, "read from {from}");
        for (w, r) in records[from as usize - 1..].iter().zip(&read) {
            assert_eq!(w.bytes, r.bytes, "read from {from}");
        }
    }
    // Another store knows no head: it finds the last record inside the last message.
    let other = NatsStore::connect(&cfg(&server.url(), 1), Duration::from_secs(5))
        .await
        .unwrap();
    let ob = other.backend();
    assert_eq!(
        ob.log.last(&s).await.unwrap().unwrap().bytes,
        records[40].bytes
    );
    let last = events
        .get_last_raw_message_by_subject(&subject)
        .await
        .unwrap();
    assert_eq!(
        last.headers
            .get("Nats-Msg-Id")
            .map(|v| v.as_str().to_string()),
        Some(format!("{}:5", s.as_str())),
        "a message's id names its first record"
    );
    // The same message published again, as a retry after a lost ack would, is a
    // duplicate the server drops, and the append counts as done.
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", format!("{}:5", s.as_str()).as_str());
    let ack = js
        .publish_with_headers(subject.clone(), h, last.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ack.duplicate);
    assert_eq!(messages_on(&js, &subject).await, 3);

    // The other store (a worker that took over the session) appends: this store's head
    // is stale, so the refusal comes from the server's check of the message's condition.
    let theirs = rec(&s, 42, prev.clone());
    ob.log
        .append(&s, 41, std::slice::from_ref(&theirs), Durability::Now)
        .await
        .unwrap();
    let mut ours = vec![];
    let mut before = prev;
    for seq in 42..50 {
        let env = Envelope::new(
            s.clone(),
            seq,
            seq,
            before,
            Event::Cancelled(Cancelled {
                reason: format!("ours {seq}"),
            }),
        );
        let r = Record::decode(env.encode().unwrap()).unwrap();
        before = r.hash();
        ours.push(r);
    }
    match b.log.append(&s, 41, &ours, Durability::Now).await {
        Err(skein_runtime::Error::Conflict { actual, .. }) => assert_eq!(actual, 42),
        other => panic!("a message after another writer: {other:?}"),
    }
    let read = b.log.read(&s, 1).await.unwrap();
    assert_eq!(read.len(), 42, "nothing of the refused message is stored");
    assert_eq!(read[41].bytes, theirs.bytes);

    // Records too large to share one message go as several, all read back.
    let t = skein_runtime::new_root_id();
    let mut before = genesis_hash(&t);
    let mut big = vec![];
    for seq in 1..=3 {
        let env = Envelope::new(
            t.clone(),
            seq,
            seq,
            before,
            Event::Cancelled(Cancelled {
                reason: "x".repeat(100_000),
            }),
        );
        let r = Record::decode(env.encode().unwrap()).unwrap();
        before = r.hash();
        big.push(r);
    }
    b.log.append(&t, 0, &big, Durability::Now).await.unwrap();
    let read = b.log.read(&t, 1).await.unwrap();
    assert_eq!(read.len(), 3);
    let n = messages_on(&js, &format!("skein.events.{}", t.as_str())).await;
    assert_eq!(
        n, 2,
        "two records of 100 kB in one message, the third in another"
    );
}

/// How many messages the event stream holds on `subject`.
async fn messages_on(js: &async_nats::jetstream::Context, subject: &str) -> u64 {
    let stream = js.get_stream("SKEIN_EVENTS").await.unwrap();
    let subjects = stream.info_with_subjects(subject).await.unwrap();
    futures::StreamExt::collect::<Vec<_>>(subjects)
        .await
        .into_iter()
        .map(|x| x.unwrap())
        .filter(|(s, _)| s == subject)
        .map(|(_, n)| n as u64)
        .sum()
}

/// A blob is stored once; a process that has seen it stored puts it again without a
/// request, and one that has not asks the server before writing (and writes no copy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_seen_stored_is_put_again_without_a_request() {
    use std::sync::atomic::Ordering;
    let server = NatsServer::start();
    let a = store_on(&server).await;
    let b = store_on(&server).await;
    let sent = |s: &NatsStore| s.client.statistics().out_messages.load(Ordering::SeqCst);
    let data = b"a definition, stored by its hash".as_slice();

    let before = sent(&a);
    let hash = a.backend().blobs.put(data).await.unwrap();
    assert!(sent(&a) > before, "the first put writes to the server");
    let before = sent(&a);
    assert_eq!(a.backend().blobs.put(data).await.unwrap(), hash);
    assert_eq!(
        sent(&a),
        before,
        "a blob this process stored is not asked about again"
    );

    // Another process learns from the server that the blob is there, and stores no copy.
    let before = sent(&b);
    assert_eq!(b.backend().blobs.put(data).await.unwrap(), hash);
    assert!(
        sent(&b) > before,
        "a process that never saw the blob asks the server"
    );
    let before = sent(&b);
    assert_eq!(b.backend().blobs.put(data).await.unwrap(), hash);
    assert_eq!(sent(&b), before);
    let js = async_nats::jetstream::new(a.client.clone());
    let stream = js.get_stream("OBJ_skein_blobs").await.unwrap();
    assert_eq!(
        stream.cached_info().state.messages,
        2,
        "one chunk and one description: the blob was written once"
    );
    assert_eq!(
        b.backend().blobs.get(&hash).await.unwrap().as_deref(),
        Some(data)
    );

    // A blob deleted from outside is stored again by a process that has not seen it.
    js.get_object_store("skein_blobs")
        .await
        .unwrap()
        .delete(&hash)
        .await
        .unwrap();
    assert_eq!(b.backend().blobs.get(&hash).await.unwrap(), None);
    let c = store_on(&server).await;
    assert_eq!(c.backend().blobs.put(data).await.unwrap(), hash);
    assert_eq!(
        c.backend().blobs.get(&hash).await.unwrap().as_deref(),
        Some(data)
    );
}

/// A record of another writer: not the bytes of [`rec`] at the same seq.
fn their_record(s: &skein_core::SessionId, seq: u64, prev: String) -> Record {
    let body = Event::Cancelled(Cancelled {
        reason: "theirs".into(),
    });
    Record::decode(
        Envelope::new(s.clone(), seq, 99, prev, body)
            .encode()
            .unwrap(),
    )
    .unwrap()
}

/// A pipelined append the server refuses (another store wrote the session's next record
/// meanwhile) returns before its ack, and its writer hears the refusal: the ack of the
/// session's job fails and leaves the job held, and so does the next append; a read meanwhile
/// takes nothing from the writer, and an append that follows on from the refused record is
/// refused though the log ends at its seq. The log holds the other store's records alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_pipelined_append_fails_its_writers_next_append_and_job_ack() {
    let server = NatsServer::start();
    let (ours, theirs) = (store_on(&server).await, store_on(&server).await);
    let (a, b) = (ours.backend(), theirs.backend());
    let s = skein_runtime::new_root_id();
    let r1 = rec(&s, 1, genesis_hash(&s));
    a.log
        .append(&s, 0, std::slice::from_ref(&r1), Durability::Now)
        .await
        .unwrap();
    // Theirs: record 2, which our store's head does not know of.
    let their2 = their_record(&s, 2, r1.hash());
    b.log
        .append(&s, 1, std::slice::from_ref(&their2), Durability::Now)
        .await
        .unwrap();

    let our2 = rec(&s, 2, r1.hash());
    a.log
        .append(&s, 1, std::slice::from_ref(&our2), Durability::Pipelined)
        .await
        .expect("a pipelined append returns before the server has answered");
    // A read waits for the answer without taking it.
    let read = a.log.read(&s, 1).await.unwrap();
    assert_eq!(read.len(), 2);
    assert_eq!(read[1].bytes, their2.bytes, "the server kept their record");

    a.jobs.push("default", &s).await.unwrap();
    let job = a
        .jobs
        .claim("default", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the pushed job");
    match a.jobs.ack(&job).await {
        Err(skein_runtime::Error::Conflict {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (1, 2)),
        other => panic!("the job's ack: expected the refusal, got {other:?}"),
    }
    // The ack heard the refusal, not the writer: an append that follows on from our
    // record 2 is refused all the same, though the log does end at seq 2.
    let after_ours = rec(&s, 3, our2.hash());
    match a
        .log
        .append(&s, 2, std::slice::from_ref(&after_ours), Durability::Now)
        .await
    {
        Err(skein_runtime::Error::Conflict { .. }) => {}
        other => panic!("an append after a record the log lacks: got {other:?}"),
    }
    // Not acked: the job is still held, and comes back once its lease runs out.
    let again = a
        .jobs
        .claim("default", Duration::from_secs(4))
        .await
        .unwrap()
        .expect("the job delivered again after its lease");
    assert_eq!(again.session, s);
    assert!(again.attempt > 1, "delivered again, not anew");

    // Our store reads the log (its head is their record 2), and they write record 3: a
    // pipelined record 3 of ours is sent after their record 2, and refused; the writer's
    // next append hears it.
    assert_eq!(a.log.read(&s, 1).await.unwrap().len(), 2);
    let our3 = rec(&s, 3, their2.hash());
    let their3 = their_record(&s, 3, their2.hash());
    b.log
        .append(&s, 2, std::slice::from_ref(&their3), Durability::Now)
        .await
        .unwrap();
    a.log
        .append(&s, 2, std::slice::from_ref(&our3), Durability::Pipelined)
        .await
        .unwrap();
    let our4 = rec(&s, 4, our3.hash());
    match a
        .log
        .append(&s, 3, std::slice::from_ref(&our4), Durability::Now)
        .await
    {
        Err(skein_runtime::Error::Conflict { expected, .. }) => assert_eq!(expected, 2),
        other => panic!("the next append: expected the refusal, got {other:?}"),
    }
    let read = b.log.read(&s, 1).await.unwrap();
    assert_eq!(
        read.iter().map(|r| r.bytes.clone()).collect::<Vec<_>>(),
        vec![r1.bytes.clone(), their2.bytes.clone(), their3.bytes.clone()],
        "nothing of ours after record 1"
    );
    skein_core::event::verify_chain(&s, &read).unwrap();
}

/// Each ending of a tree reaches a core subscriber of `skein.results.>` once: announced
/// again by the same worker, by another worker, and again once the duplicate window is
/// over (here one second), it is neither stored nor heard twice. A root whose log went on
/// past its end and ended again at a later seq has that ending heard once too; an
/// announcement of the earlier ending made after it changes nothing. A late reader finds
/// the last ending in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_ending_of_a_tree_is_announced_once_whoever_announces_it_and_when() {
    use futures::StreamExt;
    use skein_runtime::ports::{Announcer, RootResult};
    let server = NatsServer::start();
    let short = NatsConfig {
        duplicate_window: "1s".into(),
        ..cfg(&server.url(), 1)
    };
    let a = NatsStore::connect(&short, Duration::from_secs(1))
        .await
        .unwrap();
    let b = NatsStore::connect(&short, Duration::from_secs(1))
        .await
        .unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut heard = client.subscribe("skein.results.>").await.unwrap();
    client.flush().await.unwrap();
    let root = skein_runtime::new_root_id();
    let ending = |seq: u64, answer: &str| RootResult {
        session: root.to_string(),
        seq,
        status: skein_core::Status::Completed,
        answer: Some(answer.into()),
        error: None,
        usage: Default::default(),
    };
    assert!(a.last_result(&root).await.unwrap().is_none());
    a.root_finished(&ending(7, "first")).await.unwrap();
    a.root_finished(&ending(7, "first")).await.unwrap();
    b.root_finished(&ending(7, "first")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    b.root_finished(&ending(7, "first")).await.unwrap();
    // Ended again at a later seq; then a late announcement of the first ending.
    b.root_finished(&ending(12, "second")).await.unwrap();
    a.root_finished(&ending(12, "second")).await.unwrap();
    a.root_finished(&ending(7, "first")).await.unwrap();
    let mut got = vec![];
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(800), heard.next()).await {
        assert_eq!(m.subject.as_str(), format!("skein.results.{root}"));
        let r: RootResult = serde_json::from_slice(&m.payload).unwrap();
        got.push((r.seq, r.answer.unwrap_or_default()));
    }
    assert_eq!(
        got,
        vec![(7, "first".to_string()), (12, "second".to_string())],
        "every ending once, in order"
    );
    let last = b.last_result(&root).await.unwrap().expect("stored");
    assert_eq!((last.result.seq, last.stream_seq), (12, 2));
}

/// The backend counts reconnects through the `metrics` facade under its own constant; the
/// worker describes and exports the counter under the runtime's. They must be one name.
#[test]
fn the_reconnect_counter_is_the_one_the_worker_describes() {
    assert_eq!(
        skein_nats::health::RECONNECTS,
        skein_runtime::metrics::NATS_RECONNECTS
    );
}

/// Claims of one process share a pool's pulls: a burst of claims at once takes a burst of
/// jobs, each exactly once, and a claim given up before its job came does not keep that job
/// from the next claim until its lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_at_once_share_pulls_and_a_given_up_claim_hands_its_job_on() {
    let server = NatsServer::start();
    // A lease far longer than the test: a job kept by a given-up claim would not come back.
    let store = NatsStore::connect(&cfg(&server.url(), 1), Duration::from_secs(600))
        .await
        .unwrap();
    let b = store.backend();

    // Twenty claims wait at once; twenty jobs are pushed; each job goes to one claim.
    let claims: Vec<_> = (0..20)
        .map(|_| {
            let b = b.clone();
            tokio::spawn(async move { b.jobs.claim("p", Duration::from_secs(20)).await })
        })
        .collect();
    let mut pushed = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let s = skein_runtime::new_root_id();
        b.jobs.push("p", &s).await.unwrap();
        pushed.insert(s);
    }
    let mut claimed = std::collections::BTreeSet::new();
    for c in claims {
        let job = c
            .await
            .unwrap()
            .unwrap()
            .expect("a job for every waiting claim");
        assert_eq!(job.attempt, 1, "first delivery of {}", job.session);
        assert!(
            claimed.insert(job.session.clone()),
            "{} claimed twice",
            job.session
        );
        b.jobs.ack(&job).await.unwrap();
    }
    assert_eq!(claimed, pushed);

    // A claim that is given up while its pull is open at the server.
    let given_up = tokio::time::timeout(
        Duration::from_millis(300),
        b.jobs.claim("p", Duration::from_secs(20)),
    )
    .await;
    assert!(given_up.is_err(), "nothing to claim yet");
    let s = skein_runtime::new_root_id();
    b.jobs.push("p", &s).await.unwrap();
    // The job is handed on to the next claim well within its ten-minute lease.
    let job = b
        .jobs
        .claim("p", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the job of the given-up claim is handed on");
    assert_eq!(job.session, s);
    b.jobs.ack(&job).await.unwrap();
    assert_eq!(b.jobs.depth("p").await.unwrap(), 0);
}

/// Claims that come one after another while a pull is open are gathered into a few pulls,
/// not one each (a pull is a request and a subscription made and dropped, on both sides),
/// and each of them still takes exactly one job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_that_come_while_a_pull_is_open_are_gathered_into_few_pulls() {
    use futures::StreamExt;
    let server = NatsServer::start();
    let store = NatsStore::connect(&cfg(&server.url(), 1), Duration::from_secs(60))
        .await
        .unwrap();
    let b = store.backend();
    let watcher = async_nats::connect(server.url()).await.unwrap();
    let mut pulls = watcher
        .subscribe("$JS.API.CONSUMER.MSG.NEXT.SKEIN_JOBS.pool-q")
        .await
        .unwrap();
    watcher.flush().await.unwrap();
    let claim = |b: skein_runtime::ports::Backend| {
        tokio::spawn(async move { b.jobs.claim("q", Duration::from_secs(30)).await })
    };
    // The first claim's pull is open before the others come.
    let mut claims = vec![claim(b.clone())];
    tokio::time::timeout(Duration::from_secs(10), pulls.next())
        .await
        .expect("the first claim pulls")
        .unwrap();
    const MORE: usize = 200;
    for _ in 0..MORE {
        claims.push(claim(b.clone()));
        tokio::task::yield_now().await;
    }
    let mut pushed = std::collections::BTreeSet::new();
    for _ in 0..=MORE {
        let s = skein_runtime::new_root_id();
        b.jobs.push("q", &s).await.unwrap();
        pushed.insert(s);
    }
    let mut claimed = std::collections::BTreeSet::new();
    for c in claims {
        let job = c.await.unwrap().unwrap().expect("a job for every claim");
        assert!(
            claimed.insert(job.session.clone()),
            "{} claimed twice",
            job.session
        );
        b.jobs.ack(&job).await.unwrap();
    }
    assert_eq!(claimed, pushed);
    // Every pull made so far has been heard once the watcher's connection has had a round
    // trip after the last claim got its job.
    watcher.flush().await.unwrap();
    let mut n = 1;
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(200), pulls.next()).await {
        n += 1;
    }
    assert!(
        n <= MORE / 8,
        "{n} pulls for {} claims: the claims were not gathered",
        MORE + 1
    );
}

/// A heartbeat after the lease ran out is refused: the server may have given the job to
/// another worker already, and ignores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_after_the_lease_ran_out_is_refused() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let b = store.backend();
    let s = skein_runtime::new_root_id();
    b.jobs.push("p", &s).await.unwrap();
    let job = b
        .jobs
        .claim("p", Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    b.jobs.heartbeat(&job).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let err = b.jobs.heartbeat(&job).await.unwrap_err();
    assert!(err.to_string().contains("lease ran out"), "{err}");
    // The server delivers it again, to whoever claims next.
    let again = b
        .jobs
        .claim("p", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("redelivered");
    assert_eq!(again.session, s);
    assert_eq!(again.attempt, 2);
}

// A permit under a concurrency limit, shared by two processes: it holds the place until
// given back, a renewal moves its lease on in the shared bucket, and the place goes to
// the next asker once it is given back.

fn quota_ask(session: &str) -> QuotaAsk {
    QuotaAsk {
        key: "p:m".into(),
        session: session.into(),
        root: session.into(),
        priority: 0,
        input_tokens: 10,
    }
}

/// The shared bucket of `p:m`, as stored.
async fn quota_bucket(store: &NatsStore) -> Bucket {
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
    let Decision::Go(permit) = a.acquire(&quota_ask("a"), &limits).await.unwrap() else {
        panic!("the first ask waits")
    };
    let until = |bk: &Bucket| {
        *bk.permits
            .get(&permit.id)
            .expect("the permit holds a place")
    };
    let first = until(&quota_bucket(&a).await);
    let now = skein_ports::now_ms();
    assert!(
        first > now && first <= now + PERMIT_LEASE_MS,
        "a lease of {} ms from {now}",
        first.saturating_sub(now)
    );
    // The other process is told to wait for the place.
    match b.acquire(&quota_ask("b"), &limits).await.unwrap() {
        Decision::Wait { reason, .. } => assert!(reason.contains("concurrent"), "{reason}"),
        Decision::Go(_) => panic!("two permits under a limit of one"),
    }
    // A renewal (from the holder's process) moves the lease on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    a.renew(&permit, &limits).await.unwrap();
    let renewed = until(&quota_bucket(&b).await);
    assert!(renewed > first, "renewed to {renewed}, was {first}");
    match b.acquire(&quota_ask("b"), &limits).await.unwrap() {
        Decision::Wait { .. } => {}
        Decision::Go(_) => panic!("a renewed permit's place was given away"),
    }
    // Given back: the place is the waiter's.
    a.release(&permit, &limits, Some((10, 5))).await.unwrap();
    assert!(!quota_bucket(&b).await.permits.contains_key(&permit.id));
    assert!(matches!(
        b.acquire(&quota_ask("b"), &limits).await.unwrap(),
        Decision::Go(_)
    ));
    // Without a concurrency limit a permit holds no place, and renewing it writes nothing.
    let free = QuotaLimits::default();
    let Decision::Go(other) = a.acquire(&quota_ask("c"), &free).await.unwrap() else {
        panic!("an unlimited ask waits")
    };
    let before = quota_bucket(&a).await;
    a.renew(&other, &free).await.unwrap();
    assert_eq!(quota_bucket(&a).await, before);
}

/// A publish to a stream that does not answer yet (as one electing a leader answers "no
/// responders") is sent again until the stream takes it, once; and given up, with the
/// client's reason, when the stream never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patient_publish_waits_for_a_stream_that_answers_late() {
    use async_nats::jetstream::{self, context::PublishErrorKind, stream};
    use skein_nats::backend::publish_patiently;
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);

    let never = publish_patiently(
        &js,
        "nowhere.x",
        Default::default(),
        "lost".into(),
        Duration::from_millis(800),
    )
    .await
    .unwrap_err();
    assert_eq!(never.kind(), PublishErrorKind::StreamNotFound, "{never}");

    let sending = tokio::spawn({
        let js = js.clone();
        async move {
            publish_patiently(
                &js,
                "late.x",
                Default::default(),
                "kept".into(),
                Duration::from_secs(30),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!sending.is_finished(), "taken before any stream was there");
    let mut late = js
        .create_stream(stream::Config {
            name: "LATE".into(),
            subjects: vec!["late.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let ack = sending.await.unwrap().unwrap();
    assert_eq!((ack.stream.as_str(), ack.sequence), ("LATE", 1));
    assert_eq!(late.info().await.unwrap().state.messages, 1);
    let stored = late.get_raw_message(1).await.unwrap();
    assert_eq!(stored.payload.as_ref(), b"kept");
}
