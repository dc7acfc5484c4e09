//! The event log file: a torn tail is cut (and kept aside) without losing an acknowledged
//! record or blob, a log kept in sled by an earlier version is moved into the file, and a
//! wrong expected seq is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use skein_core::event::{genesis_hash, Cancelled};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_runtime::ports::Durability;
use skein_runtime::Error;
use skein_sled::SledStore;

fn records(session: &SessionId, from: u64, n: u64, prev: &mut String) -> Vec<Record> {
    (from..from + n)
        .map(|seq| {
            let env = Envelope::new(
                session.clone(),
                seq,
                1_700_000_000_000 + seq,
                prev.clone(),
                Event::Cancelled(Cancelled {
                    reason: format!("r{seq} of {session}"),
                }),
            );
            let r = Record::decode(env.encode().unwrap()).unwrap();
            *prev = r.hash();
            r
        })
        .collect()
}

fn reasons(rs: &[Record]) -> Vec<String> {
    rs.iter()
        .map(|r| match &r.env.body {
            Event::Cancelled(c) => c.reason.clone(),
            e => panic!("unexpected event {e:?}"),
        })
        .collect()
}

/// The files the log set aside in `data` (`events.log.<why>-<offset>`).
fn set_aside(data: &Path) -> Vec<String> {
    std::fs::read_dir(data)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("events.log."))
        .collect()
}

/// Two sessions, `a` with 5 records (one batch of 3, then 2 single appends), `b` with 2.
/// The last is where the frames end in `events.log`.
///
/// With `crash`, the file is left as a crash just after the last append would have left it
/// (see [`crash_image`]); else as the store left it when it closed.
async fn write_some(
    data: &Path,
    ws: &Path,
    crash: bool,
) -> (SessionId, SessionId, Vec<Record>, Vec<Record>, usize) {
    let a = SessionId::parse("t-log-a").unwrap();
    let b = SessionId::parse("t-log-a.leaf-1").unwrap();
    let (mut pa, mut pb) = (genesis_hash(&a), genesis_hash(&b));
    let ra = records(&a, 1, 5, &mut pa);
    let rb = records(&b, 1, 2, &mut pb);
    let store = SledStore::open(data, ws).unwrap();
    let be = store.backend();
    be.log
        .append(&a, 0, &ra[..3], Durability::Now)
        .await
        .unwrap();
    be.log.append(&b, 0, &rb, Durability::Now).await.unwrap();
    be.log
        .append(&a, 3, std::slice::from_ref(&ra[3]), Durability::Now)
        .await
        .unwrap();
    be.log
        .append(&a, 4, std::slice::from_ref(&ra[4]), Durability::Now)
        .await
        .unwrap();
    let end = store.log_len() as usize;
    let image = crash_image(data);
    drop(be);
    drop(store);
    if crash {
        std::fs::write(data.join("events.log"), image).unwrap();
    }
    (a, b, ra, rb, end)
}

/// `events.log` as it is while the store is open: as a crash at this point would leave it
/// (the page cache survives a process's crash), with the mark of the sync before the last
/// (closing the store moves the mark over everything synced).
fn crash_image(data: &Path) -> Vec<u8> {
    std::fs::read(data.join("events.log")).unwrap()
}

#[tokio::test]
async fn a_torn_tail_is_cut_and_kept_aside_and_every_acknowledged_record_stays() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let (a, b, ra, rb, end) = write_some(&data, &ws, false).await;
    let log = data.join("events.log");
    let whole = std::fs::read(&log).unwrap()[..end].to_vec();
    // A frame cut short: the first 40 bytes of a copy of the log's first frame, where the
    // file ends (as a version without the zero reserve left it).
    let mut torn = whole.clone();
    torn.extend_from_slice(&whole[..40]);
    std::fs::write(&log, &torn).unwrap();

    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(
        reasons(&be.log.read(&a, 1).await.unwrap()),
        reasons(&ra),
        "every acknowledged record of a is read back"
    );
    assert_eq!(reasons(&be.log.read(&b, 1).await.unwrap()), reasons(&rb));
    assert_eq!(
        std::fs::metadata(&log).unwrap().len(),
        whole.len() as u64,
        "the log is cut where the last whole frame ends"
    );
    let aside = data.join(format!("events.log.torn-{}", whole.len()));
    assert_eq!(std::fs::read(&aside).unwrap(), &whole[..40]);
    // The log goes on from there.
    let mut prev = ra[4].hash();
    let more = records(&a, 6, 1, &mut prev);
    be.log
        .append(&a, 5, std::slice::from_ref(&more[0]), Durability::Now)
        .await
        .unwrap();
    drop(be);
    drop(store);
    let store = SledStore::open(&data, &ws).unwrap();
    let read = store.backend().log.read(&a, 1).await.unwrap();
    assert_eq!(read.len(), 6);
    assert_eq!(read[5].env.seq, 6);
}

#[tokio::test]
async fn the_zeros_past_the_last_frame_are_kept_and_a_frame_found_behind_them_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let (a, b, ra, rb, end) = write_some(&data, &ws, false).await;
    let log = data.join("events.log");
    let bytes = std::fs::read(&log).unwrap();
    assert!(
        bytes.len() >= end + (64 << 10),
        "the file is {} bytes, its frames {end}: no reserve",
        bytes.len()
    );
    assert!(bytes[end..].iter().all(|&x| x == 0), "the reserve is zeros");

    // Opened again, the reserve is no torn tail: nothing is set aside or cut.
    let store = SledStore::open(&data, &ws).unwrap();
    assert_eq!(store.log_len() as usize, end);
    assert_eq!(std::fs::metadata(&log).unwrap().len() as usize, bytes.len());
    let leftovers = set_aside(&data);
    assert!(leftovers.is_empty(), "set aside: {leftovers:?}");
    // The next frame goes where the last one ended, into the reserve.
    let mut prev = ra[4].hash();
    let sixth = records(&a, 6, 1, &mut prev);
    let be = store.backend();
    be.log
        .append(&a, 5, std::slice::from_ref(&sixth[0]), Durability::Now)
        .await
        .unwrap();
    let end6 = store.log_len() as usize;
    drop(be);
    drop(store);
    let with_sixth = std::fs::read(&log).unwrap();
    assert_eq!(
        with_sixth.len(),
        bytes.len(),
        "an append inside the reserve grew the file"
    );
    let store = SledStore::open(&data, &ws).unwrap();
    assert_eq!(store.backend().log.read(&a, 1).await.unwrap().len(), 6);
    drop(store);

    // The sixth record's frame found a page further on, behind zeros, where it would be
    // if its first page had not reached the disk before a crash: opening must not read
    // it, and must not leave it where a later frame could end just before it.
    let frame = &with_sixth[end..end6];
    let mut crashed = bytes.clone();
    crashed[end + 4096..end + 4096 + frame.len()].copy_from_slice(frame);
    std::fs::write(&log, &crashed).unwrap();
    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(reasons(&be.log.read(&a, 1).await.unwrap()), reasons(&ra));
    assert_eq!(reasons(&be.log.read(&b, 1).await.unwrap()), reasons(&rb));
    assert_eq!(std::fs::metadata(&log).unwrap().len() as usize, end);
    assert_eq!(
        std::fs::read(data.join(format!("events.log.torn-{end}"))).unwrap(),
        &crashed[end..]
    );
    // The log goes on from there and grows a reserve again.
    be.log
        .append(&a, 5, std::slice::from_ref(&sixth[0]), Durability::Now)
        .await
        .unwrap();
    assert!(std::fs::metadata(&log).unwrap().len() as usize >= end6 + (64 << 10));
}

#[tokio::test]
async fn a_new_log_is_made_with_its_reserve_so_its_first_appends_keep_its_length() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let log = data.join("events.log");
    let a = SessionId::parse("t-new").unwrap();
    let ra = records(&a, 1, 3, &mut genesis_hash(&a));

    // A new store's log holds its header and, behind it, the reserve, already synced.
    let store = SledStore::open(&data, &ws).unwrap();
    let header = store.log_len() as usize;
    let made = std::fs::read(&log).unwrap();
    assert!(
        made.len() >= header + (64 << 10),
        "the new log is {} bytes, its header {header}: no reserve",
        made.len()
    );
    assert!(
        made[header..].iter().all(|&x| x == 0),
        "the reserve is zeros"
    );

    // Its first appends are written into it: the file keeps its length.
    let be = store.backend();
    for (seq, r) in ra.iter().enumerate() {
        be.log
            .append(&a, seq as u64, std::slice::from_ref(r), Durability::Now)
            .await
            .unwrap();
    }
    assert!(store.log_len() as usize > header);
    assert_eq!(std::fs::metadata(&log).unwrap().len() as usize, made.len());
    drop(be);
    drop(store);

    // And opened again, they are read back, nothing set aside.
    let store = SledStore::open(&data, &ws).unwrap();
    assert_eq!(
        reasons(&store.backend().log.read(&a, 1).await.unwrap()),
        reasons(&ra)
    );
    let aside = set_aside(&data);
    assert!(aside.is_empty(), "set aside: {aside:?}");
}

#[tokio::test]
async fn a_last_frame_whose_crc_does_not_match_is_cut_with_nothing_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let (a, b, ra, rb, end) = write_some(&data, &ws, true).await;
    let log = data.join("events.log");
    let mut bytes = std::fs::read(&log).unwrap();
    // Flip a byte inside the last frame (a's fifth record): its pages reached the disk
    // only in part.
    bytes[end - 3] ^= 0xff;
    std::fs::write(&log, &bytes).unwrap();

    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(
        reasons(&be.log.read(&a, 1).await.unwrap()),
        reasons(&ra[..4]),
        "the damaged frame is gone and only it"
    );
    assert_eq!(reasons(&be.log.read(&b, 1).await.unwrap()), reasons(&rb));
    assert_eq!(be.log.last(&a).await.unwrap().unwrap().env.seq, 4);
    // Appending seq 5 again is what a worker redoing the lost step does.
    be.log
        .append(&a, 4, std::slice::from_ref(&ra[4]), Durability::Now)
        .await
        .unwrap();
    assert_eq!(be.log.read(&a, 5).await.unwrap().len(), 1);
}

#[tokio::test]
async fn blobs_among_the_records_are_read_back_and_a_torn_one_at_the_end_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let a = SessionId::parse("t-blob-a").unwrap();
    let mut prev = genesis_hash(&a);
    let ra = records(&a, 1, 3, &mut prev);
    let big = vec![7u8; 100_000];
    let (h1, h2, h3, end, image) = {
        let store = SledStore::open(&data, &ws).unwrap();
        let be = store.backend();
        let h1 = be.blobs.put(b"a definition").await.unwrap();
        be.log
            .append(&a, 0, std::slice::from_ref(&ra[0]), Durability::Now)
            .await
            .unwrap();
        let h2 = be.blobs.put(&big).await.unwrap();
        be.log
            .append(&a, 1, &ra[1..], Durability::Now)
            .await
            .unwrap();
        let h3 = be.blobs.put(b"the last one").await.unwrap();
        (h1, h2, h3, store.log_len() as usize, crash_image(&data))
    };
    let log = data.join("events.log");
    let whole = image[..end].to_vec();
    // The last blob's frame reached the disk only in part.
    let cut = whole.len() - 5;
    std::fs::write(&log, &whole[..cut]).unwrap();

    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(reasons(&be.log.read(&a, 1).await.unwrap()), reasons(&ra));
    assert_eq!(
        be.blobs.get(&h1).await.unwrap().as_deref(),
        Some(&b"a definition"[..])
    );
    assert_eq!(be.blobs.get(&h2).await.unwrap(), Some(big));
    assert_eq!(
        be.blobs.get(&h3).await.unwrap(),
        None,
        "a blob whose frame is torn is not read"
    );
    let frame_start = whole.len() - (12 + 32 + b"the last one".len());
    assert_eq!(std::fs::metadata(&log).unwrap().len(), frame_start as u64);
    // Stored again, it is whole after the next open.
    assert_eq!(be.blobs.put(b"the last one").await.unwrap(), h3);
    drop(be);
    drop(store);
    let store = SledStore::open(&data, &ws).unwrap();
    assert_eq!(
        store.backend().blobs.get(&h3).await.unwrap().as_deref(),
        Some(&b"the last one"[..])
    );
}

#[tokio::test]
async fn a_record_written_after_a_blob_that_did_not_reach_the_disk_is_cut_with_it() {
    // A blob's put does not sync: the append of the record naming it does, and covers the
    // blob. Were the blob's pages lost and the record's kept (the kernel writes pages back
    // in any order), opening cuts at the damaged blob, so no record names a lost blob.
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let a = SessionId::parse("t-blob-b").unwrap();
    let mut prev = genesis_hash(&a);
    let ra = records(&a, 1, 2, &mut prev);
    let blob_at;
    let (h, image) = {
        let store = SledStore::open(&data, &ws).unwrap();
        let be = store.backend();
        be.log
            .append(&a, 0, std::slice::from_ref(&ra[0]), Durability::Now)
            .await
            .unwrap();
        blob_at = store.log_len() as usize;
        let h = be.blobs.put(b"named by the next record").await.unwrap();
        be.log
            .append(&a, 1, std::slice::from_ref(&ra[1]), Durability::Now)
            .await
            .unwrap();
        (h, crash_image(&data))
    };
    let log = data.join("events.log");
    let mut bytes = image;
    // A page of the blob's frame never written: zeros where its bytes were.
    for b in &mut bytes[blob_at + 20..blob_at + 30] {
        *b = 0;
    }
    std::fs::write(&log, &bytes).unwrap();

    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(be.blobs.get(&h).await.unwrap(), None);
    assert_eq!(
        reasons(&be.log.read(&a, 1).await.unwrap()),
        reasons(&ra[..1]),
        "the record after the damaged blob is cut with it"
    );
    assert_eq!(std::fs::metadata(&log).unwrap().len(), blob_at as u64);
    assert_eq!(
        std::fs::read(data.join(format!("events.log.torn-{blob_at}"))).unwrap(),
        &bytes[blob_at..]
    );
}

#[tokio::test]
async fn an_append_ahead_is_written_without_a_sync_and_the_next_append_syncs_both() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let child = SessionId::parse("t-ahead.leaf-1").unwrap();
    let parent = SessionId::parse("t-ahead").unwrap();
    let (mut pc, mut pp) = (genesis_hash(&child), genesis_hash(&parent));
    let rc = records(&child, 1, 2, &mut pc);
    let rp = records(&parent, 1, 1, &mut pp);
    {
        let store = SledStore::open(&data, &ws).unwrap();
        let be = store.backend();
        be.log
            .append(&child, 0, &rc, Durability::Ahead)
            .await
            .unwrap();
        assert_eq!(store.log_syncs(), 0, "an append ahead synced");
        assert_eq!(
            reasons(&be.log.read(&child, 1).await.unwrap()),
            reasons(&rc),
            "an append ahead is read at once"
        );
        // Numbered as any append: a wrong expected seq changes nothing.
        match be.log.append(&child, 1, &rc[1..], Durability::Ahead).await {
            Err(Error::Conflict {
                expected, actual, ..
            }) => assert_eq!((expected, actual), (1, 2)),
            other => panic!("expected a conflict, got {other:?}"),
        }
        be.log
            .append(&parent, 0, std::slice::from_ref(&rp[0]), Durability::Now)
            .await
            .unwrap();
        assert_eq!(store.log_syncs(), 1, "the next append waits for one sync");
    }
    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(
        reasons(&be.log.read(&child, 1).await.unwrap()),
        reasons(&rc)
    );
    assert_eq!(
        reasons(&be.log.read(&parent, 1).await.unwrap()),
        reasons(&rp)
    );
}

#[tokio::test]
async fn a_pipelined_append_waits_for_no_sync_unless_the_one_before_it_still_does() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let s = SessionId::parse("t-piped").unwrap();
    let mut prev = genesis_hash(&s);
    let r = records(&s, 1, 5, &mut prev);
    {
        let store = SledStore::open(&data, &ws).unwrap();
        let be = store.backend();
        be.log
            .append(&s, 0, std::slice::from_ref(&r[0]), Durability::Now)
            .await
            .unwrap();
        assert_eq!(store.log_syncs(), 1);
        // After a durable record: written, not synced, and read at once.
        be.log
            .append(&s, 1, &r[1..3], Durability::Pipelined)
            .await
            .unwrap();
        assert_eq!(
            store.log_syncs(),
            1,
            "a pipelined append after a durable one synced"
        );
        assert_eq!(
            reasons(&be.log.read(&s, 1).await.unwrap()),
            reasons(&r[..3])
        );
        // The batch before it still unsynced: this one waits for a sync covering both.
        be.log
            .append(&s, 3, &r[3..4], Durability::Pipelined)
            .await
            .unwrap();
        assert_eq!(
            store.log_syncs(),
            2,
            "two pipelined appends of a session were left unsynced"
        );
        // Numbered as any append: a wrong expected seq changes nothing.
        match be.log.append(&s, 3, &r[3..4], Durability::Pipelined).await {
            Err(Error::Conflict {
                expected, actual, ..
            }) => assert_eq!((expected, actual), (3, 4)),
            other => panic!("expected a conflict, got {other:?}"),
        }
        be.log
            .append(&s, 4, &r[4..], Durability::Pipelined)
            .await
            .unwrap();
        assert_eq!(store.log_syncs(), 2);
    }
    // Closed with the last batch unsynced: a close syncs it; what an open finds is the
    // whole log.
    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    assert_eq!(reasons(&be.log.read(&s, 1).await.unwrap()), reasons(&r));
    // What an open finds is durable (the close synced it and moved the mark past it; after
    // a crash, the open would write again and sync what lies past the mark): a pipelined
    // append right after an open waits for no sync, and the one after it for one.
    let mut more = r[4].hash();
    let r6 = records(&s, 6, 2, &mut more);
    be.log
        .append(&s, 5, &r6[..1], Durability::Pipelined)
        .await
        .unwrap();
    assert_eq!(store.log_syncs(), 0);
    be.log
        .append(&s, 6, &r6[1..], Durability::Pipelined)
        .await
        .unwrap();
    assert_eq!(store.log_syncs(), 1);
}

#[tokio::test]
async fn an_append_after_the_wrong_seq_is_a_conflict_naming_the_actual_one() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let (a, _, ra, _, _) = write_some(&data, &ws, false).await;
    let store = SledStore::open(&data, &ws).unwrap();
    let be = store.backend();
    let mut prev = ra[2].hash();
    let stale = records(&a, 4, 1, &mut prev);
    match be
        .log
        .append(&a, 3, std::slice::from_ref(&stale[0]), Durability::Now)
        .await
    {
        Err(Error::Conflict {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (3, 5)),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(be.log.read(&a, 1).await.unwrap().len(), 5);
}

#[tokio::test]
async fn a_log_kept_in_sled_by_an_earlier_version_is_moved_into_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ws) = (dir.path().join("data"), dir.path().join("ws"));
    let a = SessionId::parse("t-old-a").unwrap();
    let b = SessionId::parse("t-old-a.leaf-2").unwrap();
    let c = SessionId::parse("t-old-c").unwrap();
    let mut written = vec![];
    {
        // The earlier layout: `events` holds `session \0 seq(u64 BE)` → record bytes and
        // `sessions` each session's last seq.
        std::fs::create_dir_all(&data).unwrap();
        let db = sled::open(data.join("db")).unwrap();
        let events = db.open_tree("events").unwrap();
        let sessions = db.open_tree("sessions").unwrap();
        for (s, n) in [(&a, 3u64), (&b, 2), (&c, 1)] {
            let mut prev = genesis_hash(s);
            let rs = records(s, 1, n, &mut prev);
            for r in &rs {
                let mut k = s.as_str().as_bytes().to_vec();
                k.push(0);
                k.extend_from_slice(&r.env.seq.to_be_bytes());
                events.insert(k, r.bytes.as_slice()).unwrap();
            }
            sessions
                .insert(s.as_str().as_bytes(), &n.to_be_bytes())
                .unwrap();
            written.push((s.clone(), rs));
        }
        db.flush().unwrap();
    }
    for round in 0..2 {
        let store = SledStore::open(&data, &ws).unwrap();
        let be = store.backend();
        for (s, rs) in &written {
            assert_eq!(
                reasons(&be.log.read(s, 1).await.unwrap()),
                reasons(rs),
                "{s} after opening {} time(s)",
                round + 1
            );
        }
        let mut roots = be.log.roots().await.unwrap();
        roots.sort();
        assert_eq!(roots, vec![a.clone(), c.clone()]);
        assert_eq!(be.log.tree(&a).await.unwrap(), vec![a.clone(), b.clone()]);
    }
    let db = sled::open(data.join("db")).unwrap();
    assert!(
        db.open_tree("events").unwrap().is_empty(),
        "the old tree is emptied once its records are in the file"
    );
}
