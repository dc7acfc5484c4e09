//! The event log when the disk misbehaves: a failed `fdatasync` stops the log (fail-stop),
//! a failed or short write loses nothing, a full disk fails appends without stopping the
//! store and they go on once there is room, and a byte flipped at rest is found by
//! `verify`, refused by opening and set aside by `repair`. The disk's faults are injected
//! under the log through the `LogFile` seam; each test is given / when / then.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use skein_core::event::{genesis_hash, Cancelled};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_runtime::ports::Durability;
use skein_sled::verify::{self, Finding};
use skein_sled::{LogFile, SledStore, DEFAULT_LEASE};

/// What the disk under the log does next.
#[derive(Default)]
struct Disk {
    /// Every `fdatasync` fails with EIO.
    fail_sync: AtomicBool,
    /// Every write fails with EIO.
    fail_write: AtomicBool,
    /// The file may not grow past this many bytes (ENOSPC); 0 for no limit.
    room: AtomicU64,
    /// Each write writes at most this many bytes; 0 for all.
    short: AtomicUsize,
    /// `fdatasync` calls that reached the disk.
    syncs: AtomicU64,
    /// With `keep_synced`, the file as the last successful `fdatasync` left it: what a
    /// power loss right after it would keep.
    keep_synced: AtomicBool,
    synced: std::sync::Mutex<Vec<u8>>,
    /// With `page_cache`, the disk as Linux's page cache writes it: `on_disk` holds what
    /// reached it, `dirty` the ranges written since; a sync writes the dirty ranges, and a
    /// failed one marks them clean without writing them (as Linux may: they read back
    /// from the cache, and no later sync writes them).
    page_cache: AtomicBool,
    dirty: std::sync::Mutex<Vec<(u64, u64)>>,
    on_disk: std::sync::Mutex<Vec<u8>>,
}

struct Faulty {
    file: File,
    disk: Arc<Disk>,
}

impl LogFile for Faulty {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        LogFile::read_at(&self.file, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        if self.disk.fail_write.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5));
        }
        let mut n = buf.len();
        let room = self.disk.room.load(Ordering::SeqCst);
        if room > 0 && offset + n as u64 > room.max(LogFile::len(&self.file)?) {
            let have = room.max(LogFile::len(&self.file)?);
            if offset >= have {
                return Err(io::Error::from_raw_os_error(28));
            }
            n = (have - offset) as usize;
        }
        let short = self.disk.short.load(Ordering::SeqCst);
        if short > 0 {
            n = n.min(short);
        }
        let n = LogFile::write_at(&self.file, &buf[..n], offset)?;
        if self.disk.page_cache.load(Ordering::SeqCst) {
            let mut dirty = self.disk.dirty.lock().unwrap();
            dirty.push((offset, offset + n as u64));
        }
        Ok(n)
    }

    fn sync_data(&self) -> io::Result<()> {
        let page_cache = self.disk.page_cache.load(Ordering::SeqCst);
        if self.disk.fail_sync.load(Ordering::SeqCst) {
            if page_cache {
                self.disk.dirty.lock().unwrap().clear();
            }
            return Err(io::Error::from_raw_os_error(5));
        }
        self.disk.syncs.fetch_add(1, Ordering::SeqCst);
        LogFile::sync_data(&self.file)?;
        if page_cache {
            let len = LogFile::len(&self.file)?;
            let mut on_disk = self.disk.on_disk.lock().unwrap();
            on_disk.resize(len as usize, 0);
            for (from, to) in self.disk.dirty.lock().unwrap().drain(..) {
                let to = to.min(len);
                if from < to {
                    let range = &mut on_disk[from as usize..to as usize];
                    std::os::unix::fs::FileExt::read_exact_at(&self.file, range, from)?;
                }
            }
        }
        if self.disk.keep_synced.load(Ordering::SeqCst) {
            let len = LogFile::len(&self.file)? as usize;
            let mut now = vec![0u8; len];
            std::os::unix::fs::FileExt::read_exact_at(&self.file, &mut now, 0)?;
            *self.disk.synced.lock().unwrap() = now;
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        LogFile::len(&self.file)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        LogFile::set_len(&self.file, len)
    }
}

fn open_on(data: &Path, disk: &Arc<Disk>) -> Arc<SledStore> {
    let disk = disk.clone();
    SledStore::open_with_log_file(data, &data.join("ws"), DEFAULT_LEASE, &move |file| {
        Box::new(Faulty {
            file,
            disk: disk.clone(),
        })
    })
    .unwrap()
}

fn records(session: &SessionId, from: u64, n: u64) -> Vec<Record> {
    let mut prev = genesis_hash(session);
    (1..from + n)
        .map(|seq| {
            let env = Envelope::new(
                session.clone(),
                seq,
                1_700_000_000_000 + seq,
                prev.clone(),
                Event::Cancelled(Cancelled {
                    reason: format!("r{seq} of {session} {}", "x".repeat(200)),
                }),
            );
            let r = Record::decode(env.encode().unwrap()).unwrap();
            prev = r.hash();
            r
        })
        .skip(from as usize - 1)
        .collect()
}

fn sid(s: &str) -> SessionId {
    SessionId::parse(s).unwrap()
}

#[tokio::test]
async fn a_failed_fdatasync_fails_every_waiting_and_later_append_and_is_never_retried() {
    // Given a store with acknowledged records, on a disk whose next fdatasync fails.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    let (a, b) = (sid("t-eio-a"), sid("t-eio-b"));
    let (ra, rb) = (records(&a, 1, 3), records(&b, 1, 2));
    let store = open_on(&data, &disk);
    let log = store.backend().log;
    log.append(&a, 0, std::slice::from_ref(&ra[0]), Durability::Now)
        .await
        .unwrap();
    disk.fail_sync.store(true, Ordering::SeqCst);

    // When two appends wait for a sync that fails.
    let (x, y) = tokio::join!(
        log.append(&a, 1, std::slice::from_ref(&ra[1]), Durability::Now),
        log.append(&b, 0, std::slice::from_ref(&rb[0]), Durability::Now)
    );

    // Then both fail with an error naming the disk's, and neither is acknowledged.
    for r in [x, y] {
        let e = r.expect_err("acknowledged without a sync");
        let text = e.report().to_string();
        assert!(text.contains("Input/output error"), "{text}");
        assert!(text.contains("fdatasync"), "{text}");
    }
    let failed = tokio::time::timeout(Duration::from_secs(5), store.failed())
        .await
        .expect("the store says it has failed");
    assert!(failed.report().to_string().contains("Input/output error"));

    // And when the disk is sound again, the log still takes nothing and does not sync
    // again: a second fdatasync could succeed without the pages the first one dropped.
    disk.fail_sync.store(false, Ordering::SeqCst);
    let syncs = disk.syncs.load(Ordering::SeqCst);
    let e = log
        .append(&a, 2, std::slice::from_ref(&ra[2]), Durability::Now)
        .await
        .expect_err("a later append");
    assert!(e.report().to_string().contains("Input/output error"), "{e}");
    let e = log
        .append(&b, 0, std::slice::from_ref(&rb[0]), Durability::Now)
        .await
        .expect_err("a later append");
    assert!(e.is_retryable(), "{e}");
    assert_eq!(disk.syncs.load(Ordering::SeqCst), syncs, "synced again");
    drop(log);
    drop(store);

    // And opening again reads the file anew: the acknowledged record is there, and the
    // log goes on.
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    let log = store.backend().log;
    let read = log.read(&a, 1).await.unwrap();
    assert_eq!(read[0].env.seq, 1);
    let last = read.len() as u64;
    let more = records(&a, last + 1, 1);
    log.append(&a, last, std::slice::from_ref(&more[0]), Durability::Now)
        .await
        .unwrap();
}

#[tokio::test]
async fn what_a_failed_fdatasync_left_unwritten_is_made_durable_by_the_next_open() {
    // Given a log on a disk whose page cache drops what a failed fdatasync was to write
    // (marks it clean, unwritten), with one record acknowledged, and a record of a second
    // session written when the sync failed.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    disk.page_cache.store(true, Ordering::SeqCst);
    let (a, b, c) = (sid("t-dirty-a"), sid("t-dirty-b"), sid("t-dirty-c"));
    let (ra, rb, rc) = (records(&a, 1, 1), records(&b, 1, 1), records(&c, 1, 1));
    let store = open_on(&data, &disk);
    let log = store.backend().log;
    log.append(&a, 0, &ra, Durability::Now).await.unwrap();
    disk.fail_sync.store(true, Ordering::SeqCst);
    log.append(&b, 0, &rb, Durability::Now)
        .await
        .expect_err("acknowledged without a sync");
    drop(log);
    drop(store);
    disk.fail_sync.store(false, Ordering::SeqCst);

    // When the store is opened again: it reads the unacknowledged record from the cache,
    // as a resubmission finding its own submission does, and acknowledges a new one.
    let store = open_on(&data, &disk);
    let log = store.backend().log;
    assert_eq!(
        log.read(&b, 1).await.unwrap().len(),
        1,
        "the cache holds it"
    );
    log.append(&c, 0, &rc, Durability::Now).await.unwrap();
    drop(log);
    drop(store);

    // Then what reached the disk holds every record the open found and the one
    // acknowledged after it: the open wrote them again before the log read them.
    let lost = dir.path().join("after-power-loss");
    std::fs::create_dir_all(&lost).unwrap();
    std::fs::write(lost.join("events.log"), &*disk.on_disk.lock().unwrap()).unwrap();
    let store = SledStore::open(&lost, &dir.path().join("ws")).unwrap();
    let log = store.backend().log;
    for (id, want) in [(&a, &ra), (&b, &rb), (&c, &rc)] {
        let read = log.read(id, 1).await.unwrap();
        assert_eq!(read.len(), 1, "{id} is not on the disk");
        assert_eq!(read[0].bytes, want[0].bytes, "{id}");
    }
}

#[tokio::test]
async fn a_failed_write_fails_its_append_only_and_the_next_one_goes_on() {
    // Given a store on a disk whose writes fail.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    let a = sid("t-wfail");
    let ra = records(&a, 1, 3);
    let store = open_on(&data, &disk);
    let log = store.backend().log;
    log.append(&a, 0, std::slice::from_ref(&ra[0]), Durability::Now)
        .await
        .unwrap();
    disk.fail_write.store(true, Ordering::SeqCst);

    // When an append is made, then it fails, retryably, and nothing of it is indexed.
    let e = log
        .append(&a, 1, std::slice::from_ref(&ra[1]), Durability::Now)
        .await
        .expect_err("written");
    assert!(e.is_retryable(), "{e}");
    assert_eq!(log.last(&a).await.unwrap().unwrap().env.seq, 1);

    // And once writes succeed again, the same append goes on and everything reads back,
    // also after reopening.
    disk.fail_write.store(false, Ordering::SeqCst);
    log.append(&a, 1, std::slice::from_ref(&ra[1]), Durability::Now)
        .await
        .unwrap();
    log.append(&a, 2, std::slice::from_ref(&ra[2]), Durability::Now)
        .await
        .unwrap();
    drop(log);
    drop(store);
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    assert_eq!(store.backend().log.read(&a, 1).await.unwrap().len(), 3);
}

#[tokio::test]
async fn short_writes_are_written_on_until_whole() {
    // Given a disk that writes at most 7 bytes per call.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    disk.short.store(7, Ordering::SeqCst);
    let a = sid("t-short");
    let ra = records(&a, 1, 4);

    // When records and a blob are written.
    let store = open_on(&data, &disk);
    let be = store.backend();
    be.log
        .append(&a, 0, &ra[..2], Durability::Now)
        .await
        .unwrap();
    let h = be.blobs.put(b"a blob written in pieces").await.unwrap();
    be.log
        .append(&a, 2, &ra[2..], Durability::Now)
        .await
        .unwrap();
    drop(be);
    drop(store);

    // Then they read back whole after reopening.
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    let be = store.backend();
    assert_eq!(be.log.read(&a, 1).await.unwrap().len(), 4);
    assert_eq!(
        be.blobs.get(&h).await.unwrap().as_deref(),
        Some(&b"a blob written in pieces"[..])
    );
}

#[tokio::test]
async fn a_full_disk_fails_appends_clearly_and_they_go_on_once_there_is_room() {
    // Given a store whose disk fills: the file may not grow past its current reserve.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    let a = sid("t-full");
    let ra = records(&a, 1, 400);
    let store = open_on(&data, &disk);
    let log = store.backend().log;
    log.append(&a, 0, std::slice::from_ref(&ra[0]), Durability::Now)
        .await
        .unwrap();
    disk.room.store(1, Ordering::SeqCst);

    // When appends fill the reserve and go on.
    let mut acked = 1u64;
    let err = loop {
        match log
            .append(
                &a,
                acked,
                std::slice::from_ref(&ra[acked as usize]),
                Durability::Now,
            )
            .await
        {
            Ok(()) => acked += 1,
            Err(e) => break e,
        }
    };

    // Then the append that found no room fails, retryably, saying the disk is full, and
    // the store has not stopped.
    let text = err.report().to_string();
    assert!(matches!(err, skein_runtime::Error::Full { .. }), "{err:?}");
    assert!(text.contains("is full"), "{text}");
    assert!(text.contains("No space left on device"), "{text}");
    assert!(err.is_retryable());
    assert!(acked > 10, "the reserve took {acked} appends");
    assert_eq!(log.last(&a).await.unwrap().unwrap().env.seq, acked);
    let e = log
        .append(
            &a,
            acked,
            std::slice::from_ref(&ra[acked as usize]),
            Durability::Now,
        )
        .await
        .expect_err("room");
    assert!(e.report().to_string().contains("is full"));

    // And once there is room, the same appends go on, and every acknowledged record is
    // read back after reopening, with nothing set aside.
    disk.room.store(0, Ordering::SeqCst);
    for seq in acked..acked + 5 {
        log.append(
            &a,
            seq,
            std::slice::from_ref(&ra[seq as usize]),
            Durability::Now,
        )
        .await
        .unwrap();
    }
    drop(log);
    drop(store);
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    let read = store.backend().log.read(&a, 1).await.unwrap();
    assert_eq!(read.len() as u64, acked + 5);
    assert!(read.iter().zip(1..).all(|(r, seq)| r.env.seq == seq));
    let set_aside: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("events.log."))
        .collect();
    assert!(set_aside.is_empty(), "{set_aside:?}");
}

/// A closed log of three trees, 20 frames each, and where each frame of tree `b` starts.
async fn three_trees(data: &Path) -> (Vec<SessionId>, Vec<u64>) {
    let ids = vec![sid("t-rot-a"), sid("t-rot-b"), sid("t-rot-c")];
    let rs: Vec<_> = ids.iter().map(|id| records(id, 1, 20)).collect();
    let store = SledStore::open(data, &data.join("ws")).unwrap();
    let log = store.backend().log;
    let mut b_frames = vec![];
    for seq in 0..20 {
        for (i, id) in ids.iter().enumerate() {
            if i == 1 {
                b_frames.push(store.log_len());
            }
            log.append(
                id,
                seq,
                std::slice::from_ref(&rs[i][seq as usize]),
                Durability::Now,
            )
            .await
            .unwrap();
        }
    }
    (ids, b_frames)
}

#[tokio::test]
async fn a_byte_flipped_at_rest_is_found_refused_and_set_aside_only_by_repair() {
    for (place, frame) in [("start", 0usize), ("middle", 10), ("end", 19)] {
        // Given a closed log with one byte flipped inside one of b's frames.
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let (ids, b_frames) = three_trees(&data).await;
        let log = data.join("events.log");
        let mut bytes = std::fs::read(&log).unwrap();
        let at = b_frames[frame];
        bytes[at as usize + 40] ^= 0x20;
        std::fs::write(&log, &bytes).unwrap();

        // When it is verified, then the damage is found where it is, and nothing changes.
        let report = verify::verify(&data).unwrap();
        assert_eq!(
            report.finding.offset(),
            Some(at),
            "{place}: {:?}",
            report.finding
        );
        assert!(report.finding.refuses(), "{place}: {:?}", report.finding);
        assert_eq!(
            std::fs::read(&log).unwrap(),
            bytes,
            "{place}: verify changed the log"
        );
        let lost_b = report
            .beyond
            .iter()
            .find(|l| l.session == ids[1].as_str())
            .unwrap();
        assert_eq!(
            (lost_b.first_seq, lost_b.last_seq, lost_b.damaged),
            (frame as u64 + 1, 20, true),
            "{place}"
        );

        // And opening refuses, naming the offset, and cuts nothing.
        let e = SledStore::open(&data, &dir.path().join("ws"))
            .err()
            .expect("opened a damaged log");
        assert!(
            e.to_string().contains(&format!("offset {at}")),
            "{place}: {e}"
        );
        assert!(e.to_string().contains("skein store repair"), "{place}: {e}");
        assert_eq!(
            std::fs::read(&log).unwrap(),
            bytes,
            "{place}: open changed the log"
        );

        // And repair sets the damaged part aside, says what each tree lost, and the store
        // opens with every frame before the damage.
        let repaired = verify::repair(&data).unwrap();
        let aside = repaired.aside.clone().unwrap();
        assert_eq!(std::fs::read(&aside).unwrap(), &bytes[at as usize..]);
        let trees: Vec<_> = repaired
            .report
            .beyond
            .iter()
            .map(|l| l.tree.clone())
            .collect();
        assert!(trees.contains(&ids[1].to_string()), "{place}: {trees:?}");
        let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
        let be = store.backend();
        assert_eq!(be.log.read(&ids[1], 1).await.unwrap().len(), frame);
        assert_eq!(be.log.read(&ids[0], 1).await.unwrap().len(), frame + 1);
        assert!(matches!(
            verify::verify(&data).unwrap().finding,
            Finding::Whole
        ));
    }
}

#[tokio::test]
async fn an_unknown_frame_kind_followed_by_frames_is_an_error_not_a_tear() {
    // Given a log with a whole frame of a kind this version does not know, between frames.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (_, b_frames) = three_trees(&data).await;
    let log = data.join("events.log");
    let mut bytes = std::fs::read(&log).unwrap();
    let at = b_frames[5] as usize;
    bytes[at..at + 4].copy_from_slice(b"SKZ9");

    // (Its crc still matches: the body is unchanged.)
    std::fs::write(&log, &bytes).unwrap();

    // When it is opened, then it is refused, naming the kind; nothing is cut.
    let e = SledStore::open(&data, &dir.path().join("ws"))
        .err()
        .expect("opened");
    assert!(e.to_string().contains("SKZ9"), "{e}");
    assert!(e.to_string().contains(&format!("offset {at}")), "{e}");
    assert_eq!(std::fs::read(&log).unwrap(), bytes);
    assert!(matches!(
        verify::verify(&data).unwrap().finding,
        Finding::Damaged { .. }
    ));
}

#[tokio::test]
async fn a_log_of_a_newer_format_is_refused_with_a_message() {
    // Given a log whose header says format 3.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    three_trees(&data).await;
    let log = data.join("events.log");
    let mut bytes = std::fs::read(&log).unwrap();
    let body_len = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
    let slen = u16::from_le_bytes(bytes[12..14].try_into().unwrap()) as usize;
    let seq_at = 12 + 2 + slen;
    bytes[seq_at..seq_at + 8].copy_from_slice(&3u64.to_le_bytes());
    let crc = crc32fast::hash(&bytes[12..12 + body_len]);
    bytes[8..12].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&log, &bytes).unwrap();

    // When it is opened, then it is refused, saying why, and nothing changes.
    let e = SledStore::open(&data, &dir.path().join("ws"))
        .err()
        .expect("opened");
    assert!(e.to_string().contains("format 3"), "{e}");
    assert!(e.to_string().contains("newer skein"), "{e}");
    assert_eq!(std::fs::read(&log).unwrap(), bytes);
}

#[tokio::test]
async fn a_damaged_header_is_refused_and_written_anew_by_repair_losing_nothing() {
    // Given a closed log whose header frame has a flipped byte.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (ids, _) = three_trees(&data).await;
    let log = data.join("events.log");
    let mut bytes = std::fs::read(&log).unwrap();
    bytes[30] ^= 0x01;
    std::fs::write(&log, &bytes).unwrap();

    // When it is verified and opened, then the header's damage is named, and refused.
    let report = verify::verify(&data).unwrap();
    assert_eq!(report.finding.offset(), Some(0), "{:?}", report.finding);
    let Finding::Damaged { what, .. } = &report.finding else {
        panic!("{:?}", report.finding);
    };
    assert!(what.contains("header"), "{what}");
    assert!(SledStore::open(&data, &dir.path().join("ws")).is_err());

    // And repair writes it anew: nothing is set aside, every record is there.
    let repaired = verify::repair(&data).unwrap();
    assert!(repaired.header_rewritten);
    assert_eq!(repaired.aside, None);
    assert!(matches!(repaired.report.finding, Finding::Whole));
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    for id in &ids {
        assert_eq!(store.backend().log.read(id, 1).await.unwrap().len(), 20);
    }
}

/// A small generator of pseudo-random numbers (xorshift), so that a failing seed can be
/// run again.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What a power loss leaves of the file: what the last sync covered, and of the 4 KiB
/// pages written since, each with an even chance (the kernel writes pages back in any
/// order).
fn power_loss_image(synced: &[u8], now: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut image = synced.to_vec();
    let len = if rng.below(2) == 0 {
        synced.len()
    } else {
        now.len().max(synced.len())
    };
    image.resize(len, 0);
    for (i, page) in now.chunks(4096).enumerate() {
        let at = i * 4096;
        if at >= len || rng.below(2) == 0 {
            continue;
        }
        let end = (at + page.len()).min(len);
        if synced.get(at..end) != Some(&page[..end - at]) {
            image[at..end].copy_from_slice(&page[..end - at]);
        }
    }
    image
}

#[tokio::test]
async fn under_random_faults_no_acknowledged_record_is_lost_and_a_power_loss_image_opens() {
    // Given seeds of random schedules: appends of three sessions, with failing writes,
    // short writes, a full disk and, now and then, a failing sync.
    for seed in 1..=24u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let disk = Arc::new(Disk::default());
        disk.keep_synced.store(true, Ordering::SeqCst);
        let ids = [sid("t-sim-a"), sid("t-sim-b"), sid("t-sim-a.leaf-1")];
        let all: Vec<_> = ids.iter().map(|id| records(id, 1, 200)).collect();
        let mut acked = [0u64; 3];
        let mut written = [0u64; 3];
        let store = open_on(&data, &disk);
        let log = store.backend().log;
        for _ in 0..80 {
            disk.fail_write.store(rng.below(12) == 0, Ordering::SeqCst);
            disk.short.store(
                if rng.below(6) == 0 {
                    1 + rng.below(40) as usize
                } else {
                    0
                },
                Ordering::SeqCst,
            );
            disk.room
                .store(if rng.below(10) == 0 { 1 } else { 0 }, Ordering::SeqCst);
            if rng.below(40) == 0 {
                disk.fail_sync.store(true, Ordering::SeqCst);
            }
            let s = rng.below(3) as usize;
            let n = 1 + rng.below(3);
            let from = written[s];
            let batch = &all[s][from as usize..(from + n) as usize];
            // When an append is made.
            match log.append(&ids[s], from, batch, Durability::Now).await {
                Ok(()) => {
                    // Then it is acknowledged only while no sync has failed.
                    assert!(
                        !disk.fail_sync.load(Ordering::SeqCst),
                        "seed {seed}: acknowledged after a failed sync"
                    );
                    written[s] = from + n;
                    acked[s] = from + n;
                }
                Err(skein_runtime::Error::Conflict { actual, .. }) => written[s] = actual,
                Err(_) => {
                    // Written or not, the log says which; a later append learns it.
                    let last = log.last(&ids[s]).await.unwrap().map_or(0, |r| r.env.seq);
                    written[s] = last;
                }
            }
        }
        disk.fail_write.store(false, Ordering::SeqCst);
        disk.short.store(0, Ordering::SeqCst);
        disk.room.store(0, Ordering::SeqCst);
        let synced = disk.synced.lock().unwrap().clone();
        let now = std::fs::read(data.join("events.log")).unwrap();
        drop(log);
        drop(store);

        // And after a power loss, the store opens, and every acknowledged record is there.
        let image = power_loss_image(&synced, &now, &mut rng);
        let lost = dir.path().join("after-power-loss");
        std::fs::create_dir_all(&lost).unwrap();
        std::fs::write(lost.join("events.log"), &image).unwrap();
        let store = SledStore::open(&lost, &dir.path().join("ws"))
            .unwrap_or_else(|e| panic!("seed {seed}: the power loss image does not open: {e}"));
        let log = store.backend().log;
        for (i, id) in ids.iter().enumerate() {
            let read = log.read(id, 1).await.unwrap();
            assert!(
                read.len() as u64 >= acked[i],
                "seed {seed}: {id} has {} records, {} were acknowledged",
                read.len(),
                acked[i]
            );
            for (r, want) in read.iter().zip(&all[i]) {
                assert_eq!(r.bytes, want.bytes, "seed {seed}: {id} seq {}", r.env.seq);
            }
        }
    }
}

#[tokio::test]
async fn both_slots_of_the_mark_damaged_refuse_to_open_rather_than_cut() {
    // Given a closed log whose two mark slots both have a flipped byte (the header frame
    // is whole).
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    three_trees(&data).await;
    let log = data.join("events.log");
    let mut bytes = std::fs::read(&log).unwrap();
    let header = 12 + u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
    let mark = 12 + 2 + 5 + 8 + 4 + 4 + 16;
    bytes[header + mark - 2] ^= 0x01;
    bytes[header + 2 * mark - 2] ^= 0x01;
    std::fs::write(&log, &bytes).unwrap();

    // When it is opened, then it is refused, naming the mark; nothing is cut.
    let e = SledStore::open(&data, &dir.path().join("ws"))
        .err()
        .expect("opened");
    assert!(e.to_string().contains("mark"), "{e}");
    assert_eq!(std::fs::read(&log).unwrap(), bytes);
}

#[tokio::test]
async fn a_new_log_is_made_durable_by_its_first_sync_and_a_close_adds_none() {
    // Given a fresh data directory on a disk that keeps what each sync covered.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    disk.keep_synced.store(true, Ordering::SeqCst);
    let a = sid("t-new-a");
    let ra = records(&a, 1, 3);

    // When the store is opened, then nothing is synced yet: the header waits for the
    // first appends, and a power loss now leaves an empty file, or one of zeros, each
    // opened as a new log that takes appends.
    let store = open_on(&data, &disk);
    assert_eq!(disk.syncs.load(Ordering::SeqCst), 0, "synced at open");
    let opened = std::fs::read(data.join("events.log")).unwrap();
    assert!(!opened.is_empty(), "the header was not written");
    for image in [vec![], vec![0u8; opened.len()]] {
        let lost = tempfile::tempdir().unwrap();
        std::fs::write(lost.path().join("events.log"), &image).unwrap();
        let s = SledStore::open(lost.path(), &lost.path().join("ws")).unwrap();
        let log = s.backend().log;
        assert!(log.read(&a, 1).await.unwrap().is_empty());
        log.append(&a, 0, &ra[..1], Durability::Now).await.unwrap();
        assert_eq!(log.read(&a, 1).await.unwrap().len(), 1);
    }

    // When records are appended durably, then one sync covers the header and them: the
    // file as that sync left it opens with every record.
    let log = store.backend().log;
    log.append(&a, 0, &ra[..2], Durability::Now).await.unwrap();
    assert_eq!(disk.syncs.load(Ordering::SeqCst), 1);
    let synced = disk.synced.lock().unwrap().clone();
    let lost = tempfile::tempdir().unwrap();
    std::fs::write(lost.path().join("events.log"), &synced).unwrap();
    let s = SledStore::open(lost.path(), &lost.path().join("ws")).unwrap();
    assert_eq!(s.backend().log.read(&a, 1).await.unwrap().len(), 2);
    drop(s);

    // When the store is closed after one more append, then the close syncs that append
    // and nothing more: its mark is written, not synced.
    log.append(&a, 2, &ra[2..], Durability::Pipelined)
        .await
        .unwrap();
    drop(log);
    drop(store);
    assert_eq!(
        disk.syncs.load(Ordering::SeqCst),
        2,
        "the close synced its mark"
    );

    // And the mark it wrote reaches the next open: a byte flipped in the last frame is
    // damage before the mark, refused, not a tear to cut.
    let file = data.join("events.log");
    let whole = std::fs::read(&file).unwrap();
    let end = whole.len() - whole.iter().rev().take_while(|b| **b == 0).count();
    let mut flipped = whole.clone();
    flipped[end - 8] ^= 0x01;
    std::fs::write(&file, &flipped).unwrap();
    assert!(
        SledStore::open(&data, &dir.path().join("ws")).is_err(),
        "damage under the close's mark was opened"
    );
    std::fs::write(&file, &whole).unwrap();
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    assert_eq!(store.backend().log.read(&a, 1).await.unwrap().len(), 3);
}

/// A cache entry is made from a session's last record, which a reader may see before its
/// sync: should that sync fail, the record is not kept, and neither may the entry be
/// (its answer would come from a run the log does not show). The database is not
/// flushed past a failed sync of the log; sled flushes itself when dropped, so the
/// entries whose flush never came are taken out first.
#[tokio::test]
async fn a_cache_entry_whose_flush_a_failed_log_sync_stopped_is_not_kept() {
    // Given a store whose sound writes are durable: an entry put before the disk fails.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let disk = Arc::new(Disk::default());
    let entry = |answer: &str| skein_runtime::ports::CacheEntry {
        answer: answer.into(),
        usage: Default::default(),
        source: sid("t-cache.helper-1"),
        steps: 1,
        created: 1,
        expires: None,
    };
    let store = open_on(&data, &disk);
    let cache = store.backend().cache;
    cache.put("kept", &entry("durable")).await.unwrap();

    // When a record is written, not synced yet (its session's end, read by the worker
    // that makes the entry), and the sync that would cover it and the entry fails.
    let s = sid("t-cache");
    let log = store.backend().log;
    log.append(&s, 0, &records(&s, 1, 1), Durability::Ahead)
        .await
        .unwrap();
    disk.fail_sync.store(true, Ordering::SeqCst);
    let e = cache
        .put("lost", &entry("made from a record the disk lost"))
        .await
        .expect_err("acknowledged without a sync");
    assert!(e.report().to_string().contains("Input/output error"), "{e}");
    drop((cache, log));
    drop(store);

    // Then a new process finds the durable entry and not the other (whether the record
    // is kept is the disk's to say: this one kept the written page).
    disk.fail_sync.store(false, Ordering::SeqCst);
    let store = SledStore::open(&data, &dir.path().join("ws")).unwrap();
    let cache = store.backend().cache;
    let kept = cache.get("kept", 2).await.unwrap().map(|e| e.answer);
    assert_eq!(kept.as_deref(), Some("durable"));
    let lost = cache.get("lost", 2).await.unwrap().map(|e| e.answer);
    assert_eq!(lost, None, "an entry no flush covered was kept");
}
