//! History on a real server: the index of roots rebuilt from the log when its streams are
//! gone and put right when an ending reached the log but not the index; retention's
//! choice of trees and their removal.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE};
use skein_core::event::{genesis_hash, Cancelled};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_nats::{NatsConfig, NatsStore, ROOTS, ROOT_OPEN, ROOT_STATE};
use skein_runtime::new_root_id;
use skein_runtime::ports::roots::RootFilter;
use skein_runtime::ports::{Cache, CacheEntry, Durability, EventLog, JobQueue};
use skein_testnats::NatsServer;

async fn store_on(server: &NatsServer) -> std::sync::Arc<NatsStore> {
    let cfg = NatsConfig {
        urls: vec![server.url()],
        ..NatsConfig::default()
    };
    NatsStore::connect(&cfg, Duration::from_secs(1))
        .await
        .unwrap()
}

/// A record at `seq` and time `at`: a cancellation when `ends`, else a tool result.
fn rec(s: &SessionId, seq: u64, at: u64, prev: String, ends: bool) -> Record {
    let body = if ends {
        Event::Cancelled(Cancelled {
            reason: "done".into(),
        })
    } else {
        Event::tool_result("call", "output", false)
    };
    Record::decode(
        Envelope::new(s.clone(), seq, at, prev, body)
            .encode()
            .unwrap(),
    )
    .unwrap()
}

/// Appends one record as the first of a fresh root.
async fn start(store: &NatsStore, at: u64, ends: bool) -> (SessionId, Record) {
    let r = new_root_id();
    let first = rec(&r, 1, at, genesis_hash(&r), ends);
    store
        .append(&r, 0, std::slice::from_ref(&first), Durability::Now)
        .await
        .unwrap();
    (r, first)
}

async fn listed(store: &NatsStore, status: Option<&str>) -> Vec<(String, String)> {
    let f = RootFilter {
        status: status.map(str::to_string),
        ..Default::default()
    };
    let page = store.roots_page(&f, 100, None).await.unwrap();
    page.roots.into_iter().map(|s| (s.root, s.status)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_index_is_rebuilt_from_the_log() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    assert!(marked(&store).await, "a new store's index is built (empty)");
    let (ended, _) = start(&store, 1_000, true).await;
    let (open, _) = start(&store, 2_000, false).await;
    let (later, first) = start(&store, 3_000, false).await;
    let end = rec(&later, 2, 4_000, first.hash(), true);
    store
        .append(&later, 1, std::slice::from_ref(&end), Durability::Now)
        .await
        .unwrap();
    let want = vec![
        (later.to_string(), "cancelled".to_string()),
        (open.to_string(), "new".to_string()),
        (ended.to_string(), "cancelled".to_string()),
    ];
    assert_eq!(listed(&store, None).await, want);

    for name in [ROOTS, ROOT_STATE, ROOT_OPEN] {
        store.js.delete_stream(name).await.unwrap();
    }
    // A process that opens the store makes the streams again, empty; its first listing
    // finds the index unbuilt and builds it from the log.
    let again = store_on(&server).await;
    assert!(
        !marked(&again).await,
        "made again over a log that is not empty: unbuilt"
    );
    assert_eq!(listed(&again, None).await, want);
    assert!(marked(&again).await);
    assert_eq!(again.open_roots().await.unwrap(), vec![open.clone()]);
    assert_eq!(
        listed(&again, Some("cancelled")).await,
        vec![want[0].clone(), want[2].clone()]
    );
    // A root submitted after the rebuild lists first.
    let (newest, _) = start(&again, 5_000, false).await;
    assert_eq!(listed(&again, None).await[0].0, newest.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_the_index_missed_is_put_right_when_listed() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let (a, a1) = start(&store, 1_000, false).await;
    let (b, b1) = start(&store, 2_000, false).await;
    let mut open = vec![a.clone(), b.clone()];
    open.sort();
    assert_eq!(store.open_roots().await.unwrap(), open);
    // Each ends in the log, written past the index (as by a writer that stopped between
    // its append and the index's update). The list of open roots passes `a` and clears
    // its mark; a page shows `b` ended.
    end_past_the_index(&store, &a, &a1).await;
    assert_eq!(store.open_roots().await.unwrap(), vec![b.clone()]);
    assert_eq!(open_marks(&store).await, 1);
    end_past_the_index(&store, &b, &b1).await;
    assert_eq!(
        listed(&store, None).await,
        vec![
            (b.to_string(), "cancelled".to_string()),
            (a.to_string(), "cancelled".to_string())
        ]
    );
    assert_eq!(
        open_marks(&store).await,
        0,
        "the open marks of ended roots are gone"
    );
    assert!(store.open_roots().await.unwrap().is_empty());
}

async fn end_past_the_index(store: &NatsStore, root: &SessionId, first: &Record) {
    let end = rec(root, 2, 9_000, first.hash(), true);
    let last = store
        .js
        .get_stream("SKEIN_EVENTS")
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&format!("skein.events.{root}"))
        .await
        .unwrap()
        .sequence;
    let mut h = HeaderMap::new();
    h.insert(
        NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
        last.to_string().as_str(),
    );
    store
        .js
        .publish_with_headers(
            format!("skein.events.{root}"),
            h,
            skein_nats::frame::encode(std::slice::from_ref(&end)).into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

async fn open_marks(store: &NatsStore) -> usize {
    use futures::StreamExt;
    store
        .js
        .get_stream(ROOT_OPEN)
        .await
        .unwrap()
        .info_with_subjects("skein.rootopen.*")
        .await
        .unwrap()
        .count()
        .await
}

/// Appends `records` to a fresh log of `s`.
async fn append(store: &NatsStore, s: &SessionId, at: u64, ends: &[bool]) -> Vec<Record> {
    let mut prev = genesis_hash(s);
    let mut out = vec![];
    for (i, e) in ends.iter().enumerate() {
        let r = rec(s, i as u64 + 1, at + i as u64, prev, *e);
        store
            .append(s, i as u64, std::slice::from_ref(&r), Durability::Now)
            .await
            .unwrap();
        prev = r.hash();
        out.push(r);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_takes_only_old_finished_trees_and_removes_them_whole() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let now = skein_runtime::now_ms();
    // Old and ended, with an ended child: removable.
    let old = new_root_id();
    append(&store, &old, 1_000, &[true]).await;
    let child = old.child("helper", 1);
    append(&store, &child, 1_100, &[false, true]).await;
    // Old, ended, but a child still runs: kept.
    let busy = new_root_id();
    append(&store, &busy, 2_000, &[true]).await;
    append(&store, &busy.child("helper", 1), 2_100, &[false]).await;
    // Old and open: kept.
    let open = new_root_id();
    append(&store, &open, 3_000, &[false]).await;
    // Ended, but recent: kept.
    let recent = new_root_id();
    append(&store, &recent, now, &[true]).await;

    let before = now - 60_000;
    let found = store.removable_trees(before).await.unwrap();
    let ids: Vec<&str> = found.iter().map(|s| s.root.as_str()).collect();
    assert_eq!(ids, vec![old.as_str()]);

    // The child's job, acked as ended for good, stays in its stream, and a push it
    // refused left a wake marker: the removal takes both.
    store.push("default", &child).await.unwrap();
    let job = store
        .claim("default", Duration::from_secs(3))
        .await
        .unwrap()
        .expect("the child's job");
    assert_eq!(job.session, child);
    store.ack_final(&job).await.unwrap();
    store.push("default", &child).await.unwrap();
    let jobs = store.js.get_stream("SKEIN_JOBS").await.unwrap();
    let wake = store.js.get_key_value("skein_wake").await.unwrap();
    let job_subject = format!("skein.jobs.default.{}", child.as_str());
    assert!(jobs
        .get_last_raw_message_by_subject(&job_subject)
        .await
        .is_ok());
    assert!(wake.get(child.as_str()).await.unwrap().is_some());

    let removed = store.remove_tree(&old).await.unwrap().expect("removed");
    assert_eq!((removed.sessions, removed.records), (2, 3));
    assert!(
        jobs.get_last_raw_message_by_subject(&job_subject)
            .await
            .is_err(),
        "the job left by the child's last ack outlived its tree"
    );
    assert!(
        wake.get(child.as_str()).await.unwrap().is_none(),
        "a wake marker outlived its tree"
    );
    assert!(removed.bytes > 0);
    assert!(store.read(&old, 1).await.unwrap().is_empty());
    assert!(store.read(&child, 1).await.unwrap().is_empty());
    let left: Vec<String> = listed(&store, None)
        .await
        .into_iter()
        .map(|l| l.0)
        .collect();
    assert!(!left.contains(&old.to_string()), "{left:?}");
    assert_eq!(left.len(), 3, "{left:?}");
    // Removed once: a second removal (another worker's) finds nothing and counts nothing.
    assert_eq!(store.remove_tree(&old).await.unwrap(), None);
    assert!(store.removable_trees(before).await.unwrap().is_empty());

    // Archives round-trip through the object store.
    store
        .archive_put("x.jsonl", b"line\n".to_vec())
        .await
        .unwrap();
    assert_eq!(
        store.archive_get("x.jsonl").await.unwrap().as_deref(),
        Some(&b"line\n"[..])
    );
    assert_eq!(store.archive_get("y.jsonl").await.unwrap(), None);
}

/// Whether the index of roots says it is built.
async fn marked(store: &NatsStore) -> bool {
    store
        .js
        .get_stream(ROOT_OPEN)
        .await
        .unwrap()
        .get_last_raw_message_by_subject("skein.rootindex")
        .await
        .is_ok()
}

/// A root's ending appended pipelined is indexed once its writer reads the ack (here the
/// ack of the session's job), never before: the index says no more than the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_ending_is_indexed_once_its_ack_is_read() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let b = store.backend();
    let (root, first) = start(&store, 1_000, false).await;
    let end = rec(&root, 2, 2_000, first.hash(), true);
    b.log
        .append(&root, 1, std::slice::from_ref(&end), Durability::Pipelined)
        .await
        .unwrap();
    assert_eq!(
        open_marks(&store).await,
        1,
        "not indexed before its ack is read"
    );
    b.jobs.push("default", &root).await.unwrap();
    let job = b
        .jobs
        .claim("default", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the pushed job");
    b.jobs.ack(&job).await.unwrap();
    assert_eq!(
        open_marks(&store).await,
        0,
        "indexed once the job's ack read it"
    );
    let state = store
        .js
        .get_stream(ROOT_STATE)
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&format!("skein.rootstate.{root}"))
        .await
        .expect("the root's final summary");
    let s: skein_runtime::ports::roots::RootSummary =
        serde_json::from_slice(&state.payload).unwrap();
    assert_eq!((s.status.as_str(), s.last_seq), ("cancelled", 2));
}

/// Appends to a fresh log of `s` a `Submitted` with `mission_hash`, then its end.
async fn submitted_and_ended(store: &NatsStore, s: &SessionId, at: u64, mission_hash: &str) {
    let first = Record::decode(
        Envelope::new(
            s.clone(),
            1,
            at,
            genesis_hash(s),
            Event::Submitted(skein_core::event::Submitted {
                mission_hash: mission_hash.into(),
                ..skein_core::event::Submitted::for_test("helper")
            }),
        )
        .encode()
        .unwrap(),
    )
    .unwrap();
    let end = rec(s, 2, at + 1, first.hash(), true);
    store
        .append(s, 0, &[first, end], Durability::Now)
        .await
        .unwrap();
}

fn entry(source: &SessionId) -> CacheEntry {
    CacheEntry {
        answer: "the answer".into(),
        usage: Default::default(),
        source: source.clone(),
        steps: 1,
        created: 1_000,
        expires: None,
    }
}

/// A removed tree takes with it the cache entries whose answer came from its sessions,
/// found by their missions' hashes, and only those: an entry under the same hash that a
/// run of another tree has put since, and the entries of trees kept, stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_tree_removes_the_cache_entries_it_answered_and_no_other() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let old = new_root_id();
    submitted_and_ended(&store, &old, 1_000, "h-root").await;
    let (a, b) = (old.child("helper", 1), old.child("helper", 2));
    submitted_and_ended(&store, &a, 1_100, "h-a").await;
    submitted_and_ended(&store, &b, 1_200, "h-b").await;
    let kept = new_root_id();
    submitted_and_ended(&store, &kept, 2_000, "h-kept").await;
    store.put("h-root", &entry(&old)).await.unwrap();
    store.put("h-a", &entry(&a)).await.unwrap();
    // The same mission run again in the kept tree, whose answer replaced b's.
    store.put("h-b", &entry(&kept)).await.unwrap();
    store.put("h-kept", &entry(&kept)).await.unwrap();

    let removed = store.remove_tree(&old).await.unwrap().expect("removed");
    assert_eq!((removed.sessions, removed.cache_entries), (3, 2));
    let now = skein_runtime::now_ms();
    assert_eq!(store.get("h-root", now).await.unwrap(), None);
    assert_eq!(store.get("h-a", now).await.unwrap(), None);
    for kept_hash in ["h-b", "h-kept"] {
        let e = store.get(kept_hash, now).await.unwrap().expect(kept_hash);
        assert_eq!(e.source, kept, "{kept_hash}");
    }
    // Removed once: another worker's removal finds nothing more.
    assert_eq!(store.remove_tree(&old).await.unwrap(), None);
}

/// A tree with a run that a call of another tree shares is kept while that other session
/// has not ended: removed, the sharer would find no log where the run was and fail its
/// call. A watcher inside the tree, or one that has ended, keeps nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_whose_run_an_open_session_of_another_tree_shares_is_kept() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let now = skein_runtime::now_ms();
    let old = new_root_id();
    append(&store, &old, 1_000, &[true]).await;
    let run = old.child("helper", 1);
    append(&store, &run, 1_100, &[false, true]).await;
    // A sibling of the run shared it (inside the tree), and so does another tree's
    // session, which has not ended.
    let sibling = old.child("helper", 2);
    append(&store, &sibling, 1_200, &[true]).await;
    skein_runtime::ports::Notices::watch(&*store, &run, &sibling, "default")
        .await
        .unwrap();
    let sharer = new_root_id();
    let sharer_log = append(&store, &sharer, 2_000, &[false]).await;
    skein_runtime::ports::Notices::watch(&*store, &run, &sharer, "default")
        .await
        .unwrap();
    let before = now - 60_000;
    assert!(
        store.removable_trees(before).await.unwrap().is_empty(),
        "a tree whose run an open session of another tree shares is removable"
    );
    // The sharer ends: the tree may go.
    let end = rec(&sharer, 2, 2_001, sharer_log[0].hash(), true);
    store
        .append(&sharer, 1, std::slice::from_ref(&end), Durability::Now)
        .await
        .unwrap();
    let found = store.removable_trees(before).await.unwrap();
    let ids: Vec<&str> = found.iter().map(|s| s.root.as_str()).collect();
    assert_eq!(ids, vec![old.as_str(), sharer.as_str()]);
}
