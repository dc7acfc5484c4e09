//! Retention on the embedded store: only finished trees older than the cut-off are found
//! for removal (never one in flight, nor one waiting for a person's answer), and removing
//! them leaves every other tree's records, the index of roots and the store whole.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;

use skein_core::event::{genesis_hash, Completed, InputRequested, Submitted};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_ports::roots::RootFilter;
use skein_runtime::ports::{Durability, EventLog};
use skein_sled::gc::{remove_trees, RemovedTotals};
use skein_sled::SledStore;

fn open(dir: &Path) -> Arc<SledStore> {
    SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap()
}

/// Writes `bodies` as the log of `id`, the first at `at` and each a ms later.
async fn write(store: &SledStore, id: &SessionId, at: u64, bodies: Vec<Event>) {
    let mut prev = genesis_hash(id);
    let mut records = vec![];
    for (i, body) in bodies.into_iter().enumerate() {
        let env = Envelope::new(id.clone(), i as u64 + 1, at + i as u64, prev, body);
        let bytes = env.encode().unwrap();
        let r = Record { env, bytes };
        prev = r.hash();
        records.push(r);
    }
    store
        .append(id, 0, &records, Durability::Now)
        .await
        .unwrap();
}

fn submitted(mission: &str) -> Event {
    Event::Submitted(Submitted {
        mission: mission.into(),
        ..Submitted::for_test("a")
    })
}

fn completed() -> Event {
    Event::Completed(Completed {
        answer: "done".into(),
        usage_total: Default::default(),
        steps: 1,
        partial: false,
    })
}

fn asked() -> Event {
    Event::InputRequested(InputRequested {
        call: None,
        questions: serde_json::json!([{"id": "q", "text": "which?"}]),
        context: None,
        defaults: serde_json::Value::Null,
        token_id: "t1".into(),
    })
}

#[tokio::test]
async fn only_old_finished_trees_are_removed_and_the_rest_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = |s: &str| SessionId::root(s).unwrap();
    // Old and finished: removed.
    write(
        &store,
        &id("old1"),
        1_000,
        vec![submitted("one"), completed()],
    )
    .await;
    let old2 = id("old2");
    write(&store, &old2, 2_000, vec![submitted("two"), completed()]).await;
    write(
        &store,
        &old2.child("helper", 1),
        2_100,
        vec![submitted("h"), completed()],
    )
    .await;
    // Old, but waiting for a person's answer: kept.
    write(
        &store,
        &id("asking"),
        3_000,
        vec![submitted("ask"), asked()],
    )
    .await;
    // Old, but in flight: kept.
    write(&store, &id("running"), 4_000, vec![submitted("run")]).await;
    // Old and its root ended, but a child still runs: kept.
    let parent = id("parent");
    write(&store, &parent, 5_000, vec![submitted("p"), completed()]).await;
    write(
        &store,
        &parent.child("late", 1),
        5_100,
        vec![submitted("l")],
    )
    .await;
    // Finished, but newer than the cut-off: kept.
    write(
        &store,
        &id("recent"),
        50_000,
        vec![submitted("new"), completed()],
    )
    .await;

    let found = store.removable_trees(10_000).await.unwrap();
    let names: Vec<_> = found.iter().map(|s| s.root.as_str()).collect();
    assert_eq!(names, ["old1", "old2"]);
    let keep = ["asking", "running", "parent", "recent"];
    let mut before = vec![];
    for k in keep {
        for s in store.tree(&id(k)).await.unwrap() {
            before.push((s.clone(), store.read(&s, 1).await.unwrap()));
        }
    }
    let roots: Vec<SessionId> = found.iter().map(|s| id(&s.root)).collect();
    drop(store);

    let removed = remove_trees(&dir.path().join("data"), &roots).unwrap();
    assert_eq!(
        (removed.trees, removed.sessions, removed.records),
        (2, 3, 6)
    );
    assert!(
        removed.log_bytes_after < removed.log_bytes_before,
        "{removed:?}"
    );

    let store = open(dir.path());
    for (s, records) in &before {
        let now = store.read(s, 1).await.unwrap();
        assert_eq!(
            now.iter().map(|r| &r.bytes).collect::<Vec<_>>(),
            records.iter().map(|r| &r.bytes).collect::<Vec<_>>(),
            "{s}"
        );
    }
    for gone in ["old1", "old2"] {
        assert!(store.tree(&id(gone)).await.unwrap().is_empty(), "{gone}");
    }
    assert_eq!(
        store.roots_pending(),
        (0, false),
        "the index covers the new log"
    );
    let listed: Vec<_> = store
        .roots_page(&RootFilter::default(), 100, None)
        .await
        .unwrap()
        .roots
        .into_iter()
        .map(|s| s.root)
        .collect();
    assert_eq!(listed, ["recent", "parent", "running", "asking"]);
    assert!(store.removable_trees(10_000).await.unwrap().is_empty());
    // The store takes appends after the rewrite, and they are read back after a reopen.
    write(&store, &id("after"), 60_000, vec![submitted("after")]).await;
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.read(&id("after"), 1).await.unwrap().len(), 1);
}

/// Each removal adds what it removed to the store's totals, which outlive the process
/// and start at zero.
#[tokio::test]
async fn the_totals_of_what_was_removed_add_up_over_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let id = |s: &str| SessionId::root(s).unwrap();
    assert_eq!(store.removed_totals().unwrap(), RemovedTotals::default());
    write(&store, &id("a"), 1_000, vec![submitted("a"), completed()]).await;
    let b = id("b");
    write(&store, &b, 2_000, vec![submitted("b"), completed()]).await;
    write(
        &store,
        &b.child("helper", 1),
        2_100,
        vec![submitted("h"), completed()],
    )
    .await;
    write(&store, &id("kept"), 3_000, vec![submitted("k")]).await;
    drop(store);
    let data = dir.path().join("data");
    let first = remove_trees(&data, &[id("a")]).unwrap();
    let second = remove_trees(&data, &[b]).unwrap();
    let shrank = |r: &skein_sled::gc::Removed| r.log_bytes_before - r.log_bytes_after;
    assert!(shrank(&first) > 0 && shrank(&second) > 0);
    let store = open(dir.path());
    assert_eq!(
        store.removed_totals().unwrap(),
        RemovedTotals {
            trees: 2,
            sessions: 3,
            bytes: shrank(&first) + shrank(&second),
        }
    );
}
