//! The index of roots: pages read from it match the logs, newest first, with filters and a
//! cursor; it follows appends, survives a reopen, and is rebuilt from the log when it is
//! deleted or damaged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;

use skein_core::event::{genesis_hash, Completed, Submitted};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_ports::roots::{RootFilter, RootSummary, RootsPage};
use skein_runtime::ports::{Durability, EventLog};
use skein_sled::SledStore;

fn open(dir: &Path) -> Arc<SledStore> {
    SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap()
}

/// The index's sled database, opened directly once the store's last handle has let it go.
fn sled_db(dir: &Path) -> sled::Db {
    let started = std::time::Instant::now();
    loop {
        match sled::open(dir.join("data/roots")) {
            Ok(db) => return db,
            Err(e) if started.elapsed().as_secs() < 5 => {
                let _ = e;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

fn record(id: &SessionId, seq: u64, at: u64, prev: String, body: Event) -> Record {
    let env = Envelope::new(id.clone(), seq, at, prev, body);
    let bytes = env.encode().unwrap();
    Record { env, bytes }
}

/// Root `i`: agent `a<i % 2>`, started at `1000 + i`, completed unless `open`.
async fn write_root(store: &SledStore, i: u64, open: bool) -> SessionId {
    let id = SessionId::root(&format!("root{i:03}")).unwrap();
    let sub = record(
        &id,
        1,
        1000 + i,
        genesis_hash(&id),
        Event::Submitted(Submitted {
            mission: format!("Mission number {i}"),
            ..Submitted::for_test(&format!("a{}", i % 2))
        }),
    );
    let mut records = vec![sub];
    if !open {
        let prev = records[0].hash();
        records.push(complete(&id, 2, prev));
    }
    store
        .append(&id, 0, &records, Durability::Now)
        .await
        .unwrap();
    id
}

fn complete(id: &SessionId, seq: u64, prev: String) -> Record {
    record(
        id,
        seq,
        5000,
        prev,
        Event::Completed(Completed {
            answer: "done".into(),
            usage_total: Default::default(),
            steps: 1,
            partial: false,
        }),
    )
}

fn ids(p: &RootsPage) -> Vec<String> {
    p.roots.iter().map(|s| s.root.clone()).collect()
}

/// Every summary, newest first, as folded from the logs.
async fn truth(store: &SledStore) -> Vec<RootSummary> {
    let mut all = vec![];
    for id in store.roots().await.unwrap() {
        all.extend(RootSummary::of(&id, &store.read(&id, 1).await.unwrap()));
    }
    all.sort_by_key(|s| std::cmp::Reverse(s.position()));
    all
}

async fn everything(store: &SledStore) -> Vec<RootSummary> {
    store
        .roots_page(&RootFilter::default(), 1000, None)
        .await
        .unwrap()
        .roots
}

#[tokio::test]
async fn pages_come_from_the_index_and_match_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    for i in 0..12 {
        write_root(&store, i, i == 7).await;
    }
    assert_eq!(everything(&store).await, truth(&store).await);

    // Pages follow on through the cursor.
    let f = RootFilter::default();
    let one = store.roots_page(&f, 5, None).await.unwrap();
    assert_eq!(ids(&one)[0], "root011");
    let two = store.roots_page(&f, 5, one.next.as_deref()).await.unwrap();
    let three = store.roots_page(&f, 5, two.next.as_deref()).await.unwrap();
    assert_eq!((ids(&two)[0].as_str(), ids(&three).len()), ("root006", 2));
    assert_eq!(three.next, None);

    // Filters: status, agent, time range, mission text.
    let running = RootFilter {
        status: Some("running".into()),
        ..Default::default()
    };
    assert_eq!(
        ids(&store.roots_page(&running, 10, None).await.unwrap()),
        ["root007"]
    );
    assert_eq!(
        store.open_roots().await.unwrap(),
        [SessionId::root("root007").unwrap()]
    );
    let f = RootFilter {
        agent: Some("a0".into()),
        since: Some(1002),
        until: Some(1008),
        text: Some("NUMBER".into()),
        ..Default::default()
    };
    assert_eq!(
        ids(&store.roots_page(&f, 10, None).await.unwrap()),
        ["root006", "root004", "root002"]
    );
    let e = store
        .roots_page(&f, 10, Some("not a cursor"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("cursor"), "{e}");

    // A root's status changes: the next page shows it.
    let id = SessionId::root("root007").unwrap();
    let prev = store.last(&id).await.unwrap().unwrap().hash();
    store
        .append(&id, 1, &[complete(&id, 2, prev)], Durability::Now)
        .await
        .unwrap();
    assert!(store
        .roots_page(&running, 10, None)
        .await
        .unwrap()
        .roots
        .is_empty());
    assert!(store.open_roots().await.unwrap().is_empty());
    assert_eq!(everything(&store).await, truth(&store).await);
}

#[tokio::test]
async fn roots_written_and_never_listed_are_found_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    for i in 0..4 {
        write_root(&store, i, false).await;
    }
    assert_eq!(everything(&store).await.len(), 4);
    // Written, not listed, then the store is closed (as a `skein run` ends).
    write_root(&store, 4, true).await;
    drop(store);

    let store = open(dir.path());
    assert_eq!(
        store.roots_pending(),
        (1, false),
        "only the new root is to be summarized"
    );
    assert_eq!(everything(&store).await, truth(&store).await);
    assert_eq!(everything(&store).await.len(), 5);
}

#[tokio::test]
async fn a_deleted_or_damaged_index_is_rebuilt_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    for i in 0..6 {
        write_root(&store, i, i == 2).await;
    }
    let want = truth(&store).await;
    assert_eq!(everything(&store).await, want);
    drop(store);

    // Deleted: every tree of the index.
    {
        let db = sled_db(dir.path());
        for t in ["roots", "root_starts", "open_roots", "roots_meta"] {
            db.drop_tree(t).unwrap();
        }
        db.flush().unwrap();
    }
    let store = open(dir.path());
    assert_eq!(
        store.roots_pending(),
        (0, true),
        "a missing index is rebuilt whole"
    );
    assert_eq!(everything(&store).await, want);
    assert_eq!(
        store.open_roots().await.unwrap(),
        [SessionId::root("root002").unwrap()]
    );
    drop(store);

    // Damaged: a summary that does not decode.
    {
        let db = sled_db(dir.path());
        let t = db.open_tree("roots").unwrap();
        let (k, _) = t.iter().next().unwrap().unwrap();
        t.insert(k, &b"\xc1 not a summary"[..]).unwrap();
        db.flush().unwrap();
    }
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
}

#[tokio::test]
async fn only_a_listing_opens_the_index_and_one_kept_where_older_versions_did_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    for i in 0..3 {
        write_root(&store, i, false).await;
    }
    assert_eq!(everything(&store).await.len(), 3);
    assert!(store.roots_index_opened());
    drop(store);

    // A process that writes a root and reads logs, as `skein run` and `skein tree` do,
    // does not open the index; the next listing finds the root.
    let store = open(dir.path());
    let id = write_root(&store, 3, false).await;
    assert_eq!(store.read(&id, 1).await.unwrap().len(), 2);
    assert_eq!(store.tree(&id).await.unwrap(), vec![id.clone()]);
    assert!(!store.roots_index_opened(), "the index was opened");
    drop(store);
    let store = open(dir.path());
    let want = truth(&store).await;
    assert_eq!(everything(&store).await, want);
    drop(store);

    // The index as an earlier version kept it, in the store's own database: its trees are
    // dropped there, and the index is built anew in its own.
    std::fs::remove_dir_all(dir.path().join("data/roots")).unwrap();
    {
        let db = sled::open(dir.path().join("data/db")).unwrap();
        let meta = db.open_tree("roots_meta").unwrap();
        meta.insert("format", &1u64.to_be_bytes()).unwrap();
        meta.insert("covered", &0u64.to_be_bytes()).unwrap();
        db.open_tree("roots").unwrap().insert("k", "v").unwrap();
        db.flush().unwrap();
    }
    let store = open(dir.path());
    assert_eq!(store.roots_pending(), (0, true), "rebuilt whole");
    assert_eq!(everything(&store).await, want);
    drop(store);
    let names = sled_db_at(&dir.path().join("data/db")).tree_names();
    assert!(
        !names
            .iter()
            .any(|n| n.as_ref() == b"roots_meta" || n.as_ref() == b"roots"),
        "the old trees are still there"
    );
}

fn sled_db_at(path: &Path) -> sled::Db {
    let started = std::time::Instant::now();
    loop {
        match sled::open(path) {
            Ok(db) => return db,
            Err(e) if started.elapsed().as_secs() < 5 => {
                let _ = e;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test]
async fn roots_written_past_the_index_and_into_a_checkpoint_are_found_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    for i in 0..3 {
        write_root(&store, i, false).await;
    }
    assert_eq!(everything(&store).await.len(), 3);
    // Then more than the checkpoint's step of frames, never listed: the close writes a
    // checkpoint that ends past what the index covers.
    for i in 3..6 {
        let id = write_root(&store, i, true).await;
        let prev = store.last(&id).await.unwrap().unwrap().hash();
        let big = record(
            &id,
            2,
            2000,
            prev,
            Event::Completed(Completed {
                answer: "x".repeat(400 << 10),
                usage_total: Default::default(),
                steps: 1,
                partial: false,
            }),
        );
        store.append(&id, 1, &[big], Durability::Now).await.unwrap();
    }
    drop(store);
    assert!(dir.path().join("data/events.idx").exists());

    let store = open(dir.path());
    assert_eq!(
        store.roots_pending(),
        (3, false),
        "only the roots written since"
    );
    assert_eq!(everything(&store).await, truth(&store).await);
    assert_eq!(everything(&store).await.len(), 6);
}
