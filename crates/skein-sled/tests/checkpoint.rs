//! The checkpoint of the event log's index (`events.idx`): written at close once enough of
//! the log lies past it, used at open (which then scans only what follows it), and
//! ignored when missing, damaged or not matching the log, so that every read is the same.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;

use skein_core::event::{genesis_hash, Completed};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_runtime::ports::{Durability, EventLog};
use skein_sled::SledStore;

fn open(dir: &Path) -> Arc<SledStore> {
    SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap()
}

/// `n` roots of one record each, the record `pad` bytes long or so.
async fn write(store: &SledStore, from: usize, n: usize, pad: usize) {
    for i in from..from + n {
        let id = SessionId::root(&format!("r{i:05}")).unwrap();
        let env = Envelope::new(
            id.clone(),
            1,
            1_700_000_000_000 + i as u64,
            genesis_hash(&id),
            Event::Completed(Completed {
                answer: "x".repeat(pad),
                usage_total: Default::default(),
                steps: 1,
                partial: false,
            }),
        );
        let bytes = env.encode().unwrap();
        store
            .append(&id, 0, &[Record { env, bytes }], Durability::Ahead)
            .await
            .unwrap();
    }
    store.flush().await.unwrap();
}

/// Every root's records, as bytes.
async fn everything(store: &SledStore) -> Vec<(SessionId, Vec<Vec<u8>>)> {
    let mut out = vec![];
    for id in store.roots().await.unwrap() {
        let recs = store.read(&id, 1).await.unwrap();
        out.push((id, recs.into_iter().map(|r| r.bytes).collect()));
    }
    out
}

#[tokio::test]
async fn reads_are_the_same_with_the_checkpoint_without_it_and_with_a_damaged_one() {
    let dir = tempfile::tempdir().unwrap();
    let idx = dir.path().join("data/events.idx");
    let store = open(dir.path());
    // Past the size that makes a close write a checkpoint.
    write(&store, 0, 600, 2048).await;
    let want = everything(&store).await;
    drop(store);
    assert!(idx.exists(), "no checkpoint written at close");

    // Opened from the checkpoint; more written after it, then reopened again.
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
    write(&store, 600, 5, 100).await;
    let want = everything(&store).await;
    drop(store);
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
    drop(store);

    // Deleted: the whole log is read.
    std::fs::remove_file(&idx).unwrap();
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
    drop(store);

    // Damaged, or of another log: ignored.
    write_checkpoint_anew(dir.path(), &want).await;
    let mut bytes = std::fs::read(&idx).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&idx, &bytes).unwrap();
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
    drop(store);
    let other = tempfile::tempdir().unwrap();
    let s = open(other.path());
    write(&s, 0, 700, 2048).await;
    drop(s);
    std::fs::copy(other.path().join("data/events.idx"), &idx).unwrap();
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
}

/// Makes sure `events.idx` exists (a close writes one once enough is past the last).
async fn write_checkpoint_anew(dir: &Path, want: &[(SessionId, Vec<Vec<u8>>)]) {
    let idx = dir.join("data/events.idx");
    if !idx.exists() {
        let store = open(dir);
        assert_eq!(everything(&store).await, want);
        drop(store);
    }
    assert!(idx.exists());
}

/// `id`'s record `seq`, after `prev`.
fn next(id: &SessionId, seq: u64, prev: String) -> Record {
    let env = Envelope::new(
        id.clone(),
        seq,
        1_800_000_000_000 + seq,
        prev,
        Event::Completed(Completed {
            answer: format!("more {seq}"),
            usage_total: Default::default(),
            steps: 1,
            partial: false,
        }),
    );
    let bytes = env.encode().unwrap();
    Record { env, bytes }
}

/// Appends one more record to `id` after what it holds.
async fn append_one(store: &SledStore, id: &SessionId) {
    let last = store.last(id).await.unwrap().unwrap();
    let rec = next(id, last.env.seq + 1, last.hash());
    store
        .append(id, last.env.seq, &[rec], Durability::Now)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_block_of_the_checkpoint_found_damaged_while_open_is_dropped_for_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let idx = dir.path().join("data/events.idx");
    let store = open(dir.path());
    write(&store, 0, 600, 2048).await;
    drop(store);
    assert!(idx.exists(), "no checkpoint written at close");

    // Sessions with records both in the checkpoint and past it read whole.
    let (first, last) = (
        SessionId::root("r00000").unwrap(),
        SessionId::root("r00599").unwrap(),
    );
    let store = open(dir.path());
    append_one(&store, &last).await;
    append_one(&store, &first).await;
    let want = everything(&store).await;
    assert_eq!(want.iter().find(|(s, _)| *s == first).unwrap().1.len(), 2);
    drop(store);

    // A byte of the table's first block (right after the header) damaged: the header
    // and fences are whole, so the open takes the checkpoint and finds the damage only
    // when it reads that block, after a session of another block was appended to.
    let mut bytes = std::fs::read(&idx).unwrap();
    bytes[60] ^= 0xff;
    std::fs::write(&idx, &bytes).unwrap();
    let store = open(dir.path());
    append_one(&store, &last).await;
    assert_eq!(store.read(&first, 1).await.unwrap().len(), 2);
    assert_eq!(store.read(&last, 1).await.unwrap().len(), 3);
    append_one(&store, &first).await;
    let want = everything(&store).await;
    drop(store);
    let store = open(dir.path());
    assert_eq!(everything(&store).await, want);
    assert_eq!(store.read(&first, 1).await.unwrap().len(), 3);
}
