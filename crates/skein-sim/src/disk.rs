//! A disk under the simulated event log, with the faults a disk has: a model of the
//! embedded store's log (`crates/skein-sled/src/wal.rs` and the group commit of its
//! `lib.rs`), not that code itself, which needs a data directory, sled and blocking
//! threads per seed.
//!
//! What it models, as the embedded store does it:
//! - an append writes its records as one frame at the end of the file and returns once an
//!   `fdatasync` that started after the write covers it (one flusher, group commit); the
//!   records can be read at once; an append ahead (`EventLog::append_batch_ahead`) returns
//!   once written, a later frame's sync covering it;
//! - a failed `fdatasync` (EIO) stops the log for good (fail-stop): the appends waiting
//!   for it and every later one fail with that error, nothing more is acknowledged, and
//!   only reopening the store goes on. The simulation then restarts the process: every
//!   worker is killed, the disk keeps a prefix of the frames that holds every synced one
//!   (the page cache may or may not have written the rest), the store reopens, and the
//!   open trees are woken, as `skein resume` does. The open makes every frame it kept
//!   durable (it writes again and syncs what lies past the mark) before the log reads one;
//! - a write that fails (EIO after a short write) fails its append only: nothing of it
//!   counts, and the next frame is written over what it left;
//! - a full disk (ENOSPC) fails appends with [`Error::Full`] until room returns, a
//!   virtual delay later; the runtime's steps wait for room in place;
//! - each sync also makes durable a mark of how far the sync before it reached; at open
//!   a frame that does not check out before the mark is damage a crash cannot explain,
//!   and opening refuses (the simulated operator then restores the byte and opens
//!   again). A byte at rest is flipped only before the mark: past it, in the last group
//!   commit, the real log cannot tell a flipped byte from a torn write and cuts it, with
//!   the bytes kept aside (see docs/architecture.md, "Storage faults").
//!
//! Checked on every seed: no append is acknowledged that a sync of its life of the store
//! did not cover; no acknowledged record is missing after a reopen or at the end; damage
//! at rest is refused at open, never read as records.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use skein_core::{Record, SessionId};
use skein_runtime::{Error, Result};
use tokio::sync::Notify;

use crate::faults::{Faults, Rng};

/// How often each disk fault strikes, per opportunity.
#[derive(Debug, Clone, Copy)]
pub struct DiskRates {
    /// An `fdatasync` fails (EIO), per sync: the store stops until it is reopened.
    pub sync_fails: f64,
    /// A write fails partway (EIO after a short write), per append.
    pub write_fails: f64,
    /// The disk fills, per append: appends fail with `Full` for up to 5 virtual s.
    pub full: f64,
    /// A byte of the log flips at rest, per reopen.
    pub damage: f64,
}

impl DiskRates {
    pub const NONE: DiskRates = DiskRates {
        sync_fails: 0.0,
        write_fails: 0.0,
        full: 0.0,
        damage: 0.0,
    };

    /// The rates of a plain run: about one seed in six has its store stopped and reopened.
    pub const DEFAULT: DiskRates = DiskRates {
        sync_fails: 0.002,
        write_fails: 0.003,
        full: 0.002,
        damage: 0.5,
    };

    /// Swarm testing: each seed draws its own, some off and some far more frequent.
    pub fn swarm(rng: &mut Rng) -> DiskRates {
        let mut pick = |max: f64| {
            if rng.chance(0.3) {
                0.0
            } else {
                max * (rng.below(1000) as f64 / 1000.0)
            }
        };
        DiskRates {
            sync_fails: pick(0.01),
            write_fails: pick(0.05),
            full: pick(0.02),
            damage: pick(1.0),
        }
    }
}

/// Where an append's frame lies: the life of the store it was written in (each reopen
/// starts one) and its place among the frames.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    life: u64,
    frame: usize,
}

/// One frame of the file: whose records, and a checksum of their bytes as written.
struct Frame {
    session: SessionId,
    first_seq: u64,
    count: usize,
    sum: blake3::Hash,
}

/// What the flusher has done, for the appends that wait on it.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    life: u64,
    synced: usize,
    stopped: bool,
}

struct State {
    life: u64,
    frames: Vec<Frame>,
    /// Frames an `fdatasync` has covered.
    synced: usize,
    /// The mark: how far the sync before the last one reached.
    mark: usize,
    /// The error of the sync that failed, once one has.
    stopped: Option<String>,
    full_until: Option<tokio::time::Instant>,
    /// Each session's last acknowledged record: its seq and hash.
    acked: HashMap<SessionId, (u64, String)>,
    violations: Vec<String>,
}

/// The simulated disk: its state, its faults and what they did.
pub struct Disk {
    pub rates: DiskRates,
    faults: Arc<Faults>,
    rng: Mutex<Rng>,
    state: Mutex<State>,
    /// What the flusher has done; `synced_or_stopped` wakes the appends waiting on it. (A
    /// `Notify` whose waiters wake in the order they came: tokio's `watch` spreads its
    /// waiters over several at random, which would wake them in another order each run.)
    progress: Mutex<Progress>,
    synced_or_stopped: Notify,
    kick: Notify,
    pub syncs: AtomicU64,
    pub syncs_failed: AtomicU64,
    pub writes_failed: AtomicU64,
    /// Times the disk filled, and appends refused for it.
    pub fulls: AtomicU64,
    pub full_refusals: AtomicU64,
    pub reopens: AtomicU64,
    /// Bytes flipped at rest, and opens refused for damage.
    pub damaged: AtomicU64,
    pub refused_opens: AtomicU64,
    /// Records written, never acknowledged, that a reopen did not find.
    pub dropped: AtomicU64,
}

fn disk_error(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

impl Disk {
    /// A disk with `rates`, drawing from a stream of its own (`seed`'s), so that the
    /// other faults of a seed fall where they did without it. Its flusher runs on the
    /// current runtime.
    pub fn start(rates: DiskRates, faults: Arc<Faults>, rng: Rng) -> Arc<Disk> {
        let disk = Arc::new(Disk {
            rates,
            faults,
            rng: Mutex::new(rng),
            state: Mutex::new(State {
                life: 0,
                frames: vec![],
                synced: 0,
                mark: 0,
                stopped: None,
                full_until: None,
                acked: HashMap::new(),
                violations: vec![],
            }),
            progress: Mutex::new(Progress::default()),
            synced_or_stopped: Notify::new(),
            kick: Notify::new(),
            syncs: AtomicU64::new(0),
            syncs_failed: AtomicU64::new(0),
            writes_failed: AtomicU64::new(0),
            fulls: AtomicU64::new(0),
            full_refusals: AtomicU64::new(0),
            reopens: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
            refused_opens: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let me = disk.clone();
        tokio::spawn(async move { me.flusher().await });
        disk
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn roll(&self, p: f64) -> bool {
        self.faults.on()
            && p > 0.0
            && self
                .rng
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .chance(p)
    }

    fn draw(&self, n: u64) -> u64 {
        self.rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .below(n)
    }

    /// The group commit: whenever an append waits, the appends ready to run write
    /// first, then one `fdatasync` covers every frame written before it started.
    async fn flusher(&self) {
        loop {
            // Woken, the flusher runs after the tasks already ready (the run queue is first
            // in, first out): the writers among them join this sync.
            self.kick.notified().await;
            let mut st = self.lock();
            let target = st.frames.len();
            if st.stopped.is_some() || target <= st.synced {
                continue;
            }
            if self.roll(self.rates.sync_fails) {
                self.syncs_failed.fetch_add(1, Ordering::Relaxed);
                st.stopped = Some(disk_error(5).to_string());
                let life = st.life;
                drop(st);
                self.advance(|p| {
                    if p.life == life {
                        p.stopped = true;
                    }
                });
                continue;
            }
            self.syncs.fetch_add(1, Ordering::Relaxed);
            st.mark = st.synced;
            st.synced = target;
            let life = st.life;
            drop(st);
            self.advance(|p| {
                if p.life == life {
                    p.synced = target;
                }
            });
        }
    }

    /// Changes the progress and wakes every append that waits on it.
    fn advance(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self
            .progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
        self.synced_or_stopped.notify_waiters();
    }

    fn stopped_error(why: &str) -> Error {
        Error::unavailable(
            "event log (simulated disk): an fdatasync failed, so the log takes no more \
             appends and acknowledges nothing more until the store is opened again",
            why.to_string(),
        )
    }

    /// Whether a sync has failed and the store waits to be reopened.
    pub fn stopped(&self) -> bool {
        self.lock().stopped.is_some()
    }

    /// Before an append writes its frame: the store's state and the faults of a write.
    pub fn before_write(&self) -> Result<()> {
        let now = tokio::time::Instant::now();
        let mut st = self.lock();
        if let Some(why) = &st.stopped {
            return Err(Self::stopped_error(why));
        }
        let full = || {
            Error::full(
                "event log (simulated disk): the disk is full: cannot write; nothing of this \
                 write was recorded, and it succeeds once there is room",
                disk_error(28),
            )
        };
        if st.full_until.is_some_and(|t| t > now) {
            self.full_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(full());
        }
        if self.roll(self.rates.full) {
            self.fulls.fetch_add(1, Ordering::Relaxed);
            self.full_refusals.fetch_add(1, Ordering::Relaxed);
            st.full_until = Some(now + Duration::from_millis(100 + self.draw(4900)));
            return Err(full());
        }
        if self.roll(self.rates.write_fails) {
            self.writes_failed.fetch_add(1, Ordering::Relaxed);
            return Err(Error::unavailable(
                "event log (simulated disk): cannot write; nothing of this write was recorded",
                disk_error(5),
            ));
        }
        Ok(())
    }

    /// The frame of `records` (of `session`, from `first_seq`) is written: where it lies.
    pub fn written(&self, session: &SessionId, first_seq: u64, records: &[Record]) -> Ticket {
        let mut h = blake3::Hasher::new();
        for r in records {
            h.update(&r.bytes);
        }
        let mut st = self.lock();
        st.frames.push(Frame {
            session: session.clone(),
            first_seq,
            count: records.len(),
            sum: h.finalize(),
        });
        Ticket {
            life: st.life,
            frame: st.frames.len() - 1,
        }
    }

    /// Waits for a sync that covers the frame; fails if a sync failed first, or the store
    /// was reopened meanwhile.
    pub async fn durable(&self, t: Ticket) -> Result<()> {
        self.kick.notify_one();
        let p = loop {
            let changed = self.synced_or_stopped.notified();
            let p = *self
                .progress
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if p.life != t.life || p.stopped || p.synced > t.frame {
                break p;
            }
            changed.await;
        };
        if p.life == t.life && p.synced > t.frame {
            return Ok(());
        }
        match &self.lock().stopped {
            Some(why) if p.life == t.life => Err(Self::stopped_error(why)),
            _ => Err(Error::unavailable_because(
                "event log (simulated disk): the store was opened again before this write \
                 was synced",
            )),
        }
    }

    /// The append of `last` (its batch's last record), at `t`, is acknowledged: a sync of
    /// this life must cover it.
    pub fn acked(&self, t: Ticket, session: &SessionId, last: &Record) {
        let mut st = self.lock();
        let covered = t.life == st.life
            && t.frame < st.synced
            && st
                .frames
                .get(t.frame)
                .is_some_and(|f| &f.session == session);
        if !covered {
            let (life, synced) = (st.life, st.synced);
            st.violations.push(format!(
                "{session}: seq {} acknowledged, but no sync covered its frame ({} of life \
                 {}; life {life} has synced {synced} frames)",
                last.env.seq, t.frame, t.life
            ));
        }
        let seq = last.env.seq;
        if st.acked.get(session).is_none_or(|(s, _)| *s < seq) {
            st.acked.insert(session.clone(), (seq, last.hash()));
        }
    }

    /// The process restarts and opens the store again: the disk keeps a prefix of the
    /// frames holding every synced one; a byte may have flipped at rest; opening checks
    /// every frame and refuses damage before the mark; then every acknowledged record
    /// must be there. `logs` are the store's.
    pub fn reopen(&self, logs: &mut BTreeMap<SessionId, Vec<Record>>) {
        self.reopens.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock();
        let written = st.frames.len();
        let mut keep = st.synced + self.draw((written - st.synced) as u64 + 1) as usize;
        // A byte of a frame before the mark flips while the process is down.
        let mut flipped = None;
        if st.mark > 0 && self.roll(self.rates.damage) {
            let f = &st.frames[self.draw(st.mark as u64) as usize];
            let seq = f.first_seq + self.draw(f.count as u64);
            if let Some(r) = logs
                .get_mut(&f.session)
                .and_then(|l| l.get_mut(seq as usize - 1))
            {
                let at = self.draw(r.bytes.len() as u64) as usize;
                let bit = 1u8 << self.draw(8);
                r.bytes[at] ^= bit;
                flipped = Some((f.session.clone(), seq, at, bit));
                self.damaged.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Opening reads every frame: damage before the mark is refused, a frame that does
        // not check out past it is a torn tail and is cut.
        loop {
            let bad = st.frames[..keep].iter().position(|f| !checks_out(f, logs));
            let Some(i) = bad else { break };
            if i >= st.mark {
                keep = i;
                break;
            }
            // Refused, naming the frame; the operator puts the byte back (a copy of the
            // disk) and opens again.
            self.refused_opens.fetch_add(1, Ordering::Relaxed);
            let f = &st.frames[i];
            match flipped.take() {
                Some((s, seq, at, bit))
                    if s == f.session
                        && (f.first_seq..f.first_seq + f.count as u64).contains(&seq) =>
                {
                    if let Some(r) = logs.get_mut(&s).and_then(|l| l.get_mut(seq as usize - 1)) {
                        r.bytes[at] ^= bit;
                    }
                }
                _ => {
                    let what = format!(
                        "{}: opening refused frame {i} (seqs from {}) as damaged, but no byte \
                         of it had flipped",
                        f.session, f.first_seq
                    );
                    st.violations.push(what);
                    break;
                }
            }
        }
        if let Some((s, seq, ..)) = &flipped {
            st.violations.push(format!(
                "{s}: a byte of seq {seq} flipped at rest before the mark, and opening did not \
                 refuse"
            ));
        }
        // What the disk did not keep: the frames past `keep`, the newest first (each
        // session's frames are in its log's order, so each is its log's tail then).
        for f in st.frames.drain(keep..).rev().collect::<Vec<_>>() {
            let Some(log) = logs.get_mut(&f.session) else {
                continue;
            };
            let from = f.first_seq as usize - 1;
            if log.len() != from + f.count {
                st.violations.push(format!(
                    "{}: its log has {} records where a dropped frame ends at seq {}",
                    f.session,
                    log.len(),
                    from + f.count
                ));
            }
            self.dropped
                .fetch_add(log.len().saturating_sub(from) as u64, Ordering::Relaxed);
            log.truncate(from);
            if log.is_empty() {
                logs.remove(&f.session);
            }
        }
        // The open writes again and syncs every frame it kept past the mark before the
        // log reads one (a failed sync may have left their pages clean and unwritten), so
        // each is durable from here on, as if synced.
        st.synced = keep;
        st.mark = st.mark.min(st.synced);
        st.stopped = None;
        st.life += 1;
        let lost = lost_acks(&st.acked, logs);
        st.violations
            .extend(lost.into_iter().map(|l| format!("{l} (after a reopen)")));
        let p = Progress {
            life: st.life,
            synced: st.synced,
            stopped: false,
        };
        drop(st);
        self.advance(|now| *now = p);
    }

    /// The violations the disk saw, and every acknowledged record missing from `logs` (the
    /// run's logs at its end).
    pub fn violations(&self, logs: &BTreeMap<SessionId, Vec<Record>>) -> Vec<String> {
        let st = self.lock();
        let mut v = st.violations.clone();
        v.extend(lost_acks(&st.acked, logs));
        v
    }

    /// One line of what struck.
    pub fn report(&self) -> String {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "disk: {} syncs, {} failed (the store stopped and reopened {} times, {} unsynced \
             records dropped), {} writes failed, full {} times ({} appends refused), {} bytes \
             flipped at rest ({} opens refused)",
            n(&self.syncs),
            n(&self.syncs_failed),
            n(&self.reopens),
            n(&self.dropped),
            n(&self.writes_failed),
            n(&self.fulls),
            n(&self.full_refusals),
            n(&self.damaged),
            n(&self.refused_opens)
        )
    }
}

/// Whether a frame's records are in the log with the bytes they were written with.
fn checks_out(f: &Frame, logs: &BTreeMap<SessionId, Vec<Record>>) -> bool {
    let Some(recs) = logs
        .get(&f.session)
        .and_then(|l| l.get(f.first_seq as usize - 1..f.first_seq as usize - 1 + f.count))
    else {
        return false;
    };
    let mut h = blake3::Hasher::new();
    for r in recs {
        h.update(&r.bytes);
    }
    h.finalize() == f.sum
}

fn lost_acks(
    acked: &HashMap<SessionId, (u64, String)>,
    logs: &BTreeMap<SessionId, Vec<Record>>,
) -> Vec<String> {
    let mut out: Vec<String> = acked
        .iter()
        .filter(|(s, (seq, hash))| {
            logs.get(*s)
                .and_then(|l| l.get(*seq as usize - 1))
                .is_none_or(|r| &r.hash() != hash)
        })
        .map(|(s, (seq, _))| format!("{s}: acknowledged record seq {seq} lost"))
        .collect();
    out.sort();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::faults::Rates;
    use skein_core::{Envelope, Event};

    type Logs = BTreeMap<SessionId, Vec<Record>>;

    fn disk(rates: DiskRates) -> Arc<Disk> {
        let faults = Arc::new(Faults::new(Rates::NONE, Rng::new(1)));
        Disk::start(rates, faults, Rng::new(2))
    }

    fn n(a: &AtomicU64) -> u64 {
        a.load(Ordering::Relaxed)
    }

    /// Writes the session's next record as the store does, and returns where it lies.
    fn write(d: &Disk, logs: &mut Logs, s: &SessionId) -> Result<(Ticket, Record)> {
        d.before_write()?;
        let log = logs.entry(s.clone()).or_default();
        let seq = log.len() as u64 + 1;
        let prev = log
            .last()
            .map_or_else(|| skein_core::event::genesis_hash(s), Record::hash);
        let env = Envelope::new(
            s.clone(),
            seq,
            1_700_000_000_000 + seq,
            prev,
            Event::tool_result(format!("c{seq}"), "ok", false),
        );
        let r = Record {
            bytes: env.encode().unwrap(),
            env,
        };
        log.push(r.clone());
        Ok((d.written(s, seq, std::slice::from_ref(&r)), r))
    }

    /// Writes and waits for the sync, as a durable append does.
    async fn append(d: &Disk, logs: &mut Logs, s: &SessionId) -> Result<()> {
        let (t, r) = write(d, logs, s)?;
        d.durable(t).await?;
        d.acked(t, s, &r);
        Ok(())
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
    }

    #[test]
    fn an_append_is_acknowledged_once_synced_and_survives_a_reopen_that_drops_the_rest() {
        rt().block_on(async {
            // Given a disk without faults and two acknowledged appends.
            let d = disk(DiskRates::NONE);
            let s = SessionId::parse("a").unwrap();
            let mut logs = Logs::new();
            append(&d, &mut logs, &s).await.unwrap();
            append(&d, &mut logs, &s).await.unwrap();
            assert_eq!(n(&d.syncs), 2);
            // When a third is written, not synced, and the process restarts, many times.
            for _ in 0..20 {
                if logs[&s].len() == 2 {
                    write(&d, &mut logs, &s).unwrap();
                }
                d.reopen(&mut logs);
                // Then the two acknowledged records are there; the third may not be.
                assert!(logs[&s].len() >= 2);
            }
            assert!(n(&d.dropped) > 0, "the unsynced record was never dropped");
            assert_eq!(d.violations(&logs), Vec::<String>::new());
        });
    }

    #[test]
    fn a_failed_sync_stops_the_log_until_it_is_reopened() {
        rt().block_on(async {
            // Given a disk whose every sync fails.
            let d = disk(DiskRates {
                sync_fails: 1.0,
                ..DiskRates::NONE
            });
            let s = SessionId::parse("a").unwrap();
            let mut logs = Logs::new();
            // When an append waits for a sync: it fails, naming the disk's error, and so
            // does every later one, before writing.
            let e = append(&d, &mut logs, &s).await.unwrap_err();
            assert!(e.to_string().contains("fdatasync failed"), "{e}");
            assert!(d.stopped());
            let later = append(&d, &mut logs, &s).await.unwrap_err();
            assert!(later.is_retryable(), "{later}");
            assert_eq!(logs[&s].len(), 1, "a write was made on a stopped log");
            // Then a reopen goes on, and nothing was acknowledged.
            d.reopen(&mut logs);
            assert!(!d.stopped());
            assert_eq!(n(&d.syncs), 0);
            assert_eq!(d.violations(&logs), Vec::<String>::new());
        });
    }

    #[test]
    fn a_full_disk_refuses_writes_until_there_is_room() {
        rt().block_on(async {
            let d = disk(DiskRates {
                full: 1.0,
                ..DiskRates::NONE
            });
            let s = SessionId::parse("a").unwrap();
            let mut logs = Logs::new();
            let e = append(&d, &mut logs, &s).await.unwrap_err();
            assert!(matches!(e, Error::Full { .. }), "{e}");
            assert!(logs.get(&s).is_none_or(|l| l.is_empty()));
            // Room returns within 5 virtual s (and the next append fills it again).
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert!(d.before_write().is_err());
            assert_eq!(n(&d.fulls), 2);
        });
    }

    #[test]
    fn damage_before_the_mark_is_refused_at_open_and_never_read() {
        rt().block_on(async {
            // Given three appends synced one by one (the mark then covers two), and a
            // byte that flips at rest at every reopen.
            let d = disk(DiskRates {
                damage: 1.0,
                ..DiskRates::NONE
            });
            let s = SessionId::parse("a").unwrap();
            let mut logs = Logs::new();
            for _ in 0..3 {
                append(&d, &mut logs, &s).await.unwrap();
            }
            let before: Vec<Vec<u8>> = logs[&s].iter().map(|r| r.bytes.clone()).collect();
            // When the store is reopened: opening refuses, the byte is put back.
            d.reopen(&mut logs);
            assert_eq!(n(&d.damaged), 1);
            assert_eq!(n(&d.refused_opens), 1);
            let after: Vec<Vec<u8>> = logs[&s].iter().map(|r| r.bytes.clone()).collect();
            assert_eq!(before, after);
            assert_eq!(d.violations(&logs), Vec::<String>::new());
        });
    }

    #[test]
    fn the_checks_find_an_unsynced_acknowledgement_and_a_lost_record() {
        rt().block_on(async {
            let d = disk(DiskRates::NONE);
            let s = SessionId::parse("a").unwrap();
            let mut logs = Logs::new();
            // An acknowledgement no sync covered is a violation.
            let (t, r) = write(&d, &mut logs, &s).unwrap();
            d.acked(t, &s, &r);
            let v = d.violations(&logs);
            assert!(v[0].contains("no sync covered"), "{v:?}");
            // So is an acknowledged record missing from the logs at the end.
            append(&d, &mut logs, &s).await.unwrap();
            logs.get_mut(&s).unwrap().pop();
            let v = d.violations(&logs);
            assert!(v.iter().any(|x| x.contains("seq 2 lost")), "{v:?}");
        });
    }
}
