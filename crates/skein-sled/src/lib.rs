//! skein-sled: the embedded backend of skein's ports — every port on one sled database,
//! for one process (`skein run`, `skein resume`). The JetStream backend (`skein-nats`)
//! implements the same ports for a cluster; both pass the same conformance suite.
//!
//! | port | file | sled |
//! | --- | --- | --- |
//! | EventLog | `log.rs`, `wal.rs` | none: its own file, `events.log` |
//! | Blobs | `kv.rs`, `wal.rs` | none: frames of `events.log` (tree `blobs` read for older ones) |
//! | JobQueue | `jobs.rs` | tree `jobs` |
//! | Cache, Notices | `kv.rs` | trees `cache`, `inflight`, `notices`, `watchers` |
//! | Workspaces | here | a directory per tree |
//!
//! The event log is an append-only file of its own (`wal.rs`): one frame per append, one
//! `fdatasync` per group of appends. Blobs are frames of the same file. Earlier versions
//! kept the log in the sled trees `events` and `sessions`; opening such a directory moves
//! those records into the file once. Blobs they kept in the tree `blobs` are read there.
//!
//! Layout of the rest (one sled tree each):
//! - `jobs`: `pool \0 session` → job state (ready / held with lease, attempt, dirty).
//! - `cache`: mission hash → entry; `notices`: `parent \0 position(u64 BE)` → child id;
//!   `blobs` (written by earlier versions only): blake3 hex → bytes.
//!
//! Durability: an append returns only after an `fdatasync` of the log that covers it.
//! Appends of many sessions share one (group commit): each append takes a ticket after its
//! write, and a single flusher task syncs and then releases every ticket it covered. Before
//! each sync it lets the tasks that are ready run first: the writers the last sync released
//! (a wide turn's children, stepping together) then share the next one rather than the
//! first of them getting a sync of its own (docs/perf.md has the figures). A blob is
//! written ahead of the record that names it,
//! whose sync covers it (see `kv.rs`). Cache
//! entries and watchers wait the same way for a flush of the sled database. A sync or flush
//! that fails stops its flusher for good (fail-stop): the writers waiting for it and every
//! later one get its error, and [`SledStore::failed`] resolves with it; a full disk fails
//! the one write with [`skein_runtime::Error::Full`] and stops nothing (see `wal.rs`). Jobs and
//! notices are not flushed per write: after a crash, `resume` derives every job from the
//! logs, and a parent reconciles with its children's logs when it is first loaded.

pub mod file;
mod jobs;
mod kv;
mod log;
pub mod verify;
mod wal;

pub use file::LogFile;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skein_core::SessionId;
use skein_runtime::ports::{Backend, Workspaces};
use skein_runtime::{Error, Result};
use skein_tools::{LocalWorkspace, Workspace};
use tokio::sync::{watch, Notify};

/// How long a claimed job is held without a heartbeat, unless the store is opened with
/// another lease ([`SledStore::open_with_lease`]).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// A failure of the sled database: no room when the disk is full, else unavailable.
fn backend_err(e: impl Into<skein_runtime::error::BoxError>) -> Error {
    let e = e.into();
    let full = match e.downcast_ref::<sled::Error>() {
        Some(sled::Error::Io(io)) => file::is_disk_full(io),
        _ => e
            .downcast_ref::<std::io::Error>()
            .is_some_and(file::is_disk_full),
    };
    if full {
        return Error::full("sled: the disk holding the database is full", e);
    }
    Error::unavailable("sled", e)
}

fn prefix(s: &str) -> Vec<u8> {
    let mut k = s.as_bytes().to_vec();
    k.push(0);
    k
}

fn u64_of(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = bytes.len().min(8);
    b[8 - n..].copy_from_slice(&bytes[bytes.len() - n..]);
    u64::from_be_bytes(b)
}

/// Group commit: writers wait for a flush that started after their write.
///
/// Fail-stop: the first flush that fails stops the flusher for good. The writers waiting
/// for it, and every later one, get that error; none is told its write is durable unless
/// a flush that succeeded covered it.
struct Flusher {
    /// What it flushes, for its errors.
    what: &'static str,
    requested: AtomicU64,
    kick: Notify,
    stop: std::sync::atomic::AtomicBool,
    flushed: watch::Receiver<Flushed>,
    failed: Arc<OnceLock<Arc<std::io::Error>>>,
}

/// The flusher's progress: every ticket up to `upto` is durable; once `failed`, no more.
#[derive(Clone, Copy, Default)]
struct Flushed {
    upto: u64,
    failed: bool,
}

/// The error that stopped a flusher, under the error a writer is given.
#[derive(Debug)]
struct FlushFailed(Arc<std::io::Error>);

impl std::fmt::Display for FlushFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for FlushFailed {}

impl Flusher {
    /// Starts the task that runs `flush` whenever a writer waits.
    fn start(
        what: &'static str,
        flush: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Arc<Self> {
        let flush = Arc::new(flush);
        let (tx, rx) = watch::channel(Flushed::default());
        let tx = Arc::new(tx);
        let f = Arc::new(Self {
            what,
            requested: AtomicU64::new(0),
            kick: Notify::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
            flushed: rx,
            failed: Arc::new(OnceLock::new()),
        });
        let me = f.clone();
        tokio::spawn(async move {
            while !me.stop.load(Ordering::SeqCst) {
                if me.requested.load(Ordering::SeqCst) <= tx.borrow().upto {
                    let kicked = me.kick.notified();
                    let _ = tokio::time::timeout(Duration::from_millis(200), kicked).await;
                    continue;
                }
                // The writers the last flush released are often about to write again
                // (the children of a wide turn step together): the tasks ready to run go
                // first, so that one flush covers them all rather than the first of them
                // and then the rest.
                tokio::task::yield_now().await;
                let target = me.requested.load(Ordering::SeqCst);
                let f = flush.clone();
                // The writers are released from the flush's own thread, as soon as it is
                // done: not after this task has been woken and polled in turn.
                let done = tx.clone();
                let failed = me.failed.clone();
                let flushed = tokio::task::spawn_blocking(move || match f() {
                    Ok(()) => {
                        done.send_modify(|d| d.upto = target);
                    }
                    Err(e) => {
                        failed.get_or_init(|| Arc::new(e));
                        done.send_modify(|d| d.failed = true);
                    }
                });
                if let Err(e) = flushed.await {
                    me.failed
                        .get_or_init(|| Arc::new(std::io::Error::other(e.to_string())));
                    tx.send_modify(|d| d.failed = true);
                }
                if let Some(e) = me.failed.get() {
                    tracing::error!(
                        store = me.what,
                        error = %e,
                        "a flush failed: the store takes no more writes until it is opened again"
                    );
                    break;
                }
            }
        });
        f
    }

    /// The error every writer gets once a flush has failed.
    fn failure(&self) -> Option<Error> {
        self.failed.get().map(|e| {
            Error::unavailable(
                format!(
                    "{}: a flush to disk failed, so nothing written since is durable; the \
                     store acknowledges no more writes until it is opened again",
                    self.what
                ),
                FlushFailed(e.clone()),
            )
        })
    }

    async fn durable(&self) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let ticket = self.requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.kick.notify_one();
        let mut rx = self.flushed.clone();
        let state = rx
            .wait_for(|d| d.upto >= ticket || d.failed)
            .await
            .map(|d| *d)
            .map_err(|_| Error::unavailable_because("the store's flusher stopped"))?;
        if state.upto >= ticket {
            return Ok(());
        }
        Err(self
            .failure()
            .unwrap_or_else(|| Error::unavailable_because("the store's flusher stopped")))
    }

    /// Waits until a flush has failed; for ever if none does.
    async fn failed(&self) -> Error {
        let mut rx = self.flushed.clone();
        let _ = rx.wait_for(|d| d.failed).await;
        match self.failure() {
            Some(e) => e,
            None => std::future::pending().await,
        }
    }
}

/// The embedded store.
pub struct SledStore {
    db: sled::Db,
    wal: Arc<wal::Wal>,
    /// Group commit of the event log.
    wal_flusher: Arc<Flusher>,
    jobs: sled::Tree,
    cache: sled::Tree,
    blobs: sled::Tree,
    notices: sled::Tree,
    inflight: sled::Tree,
    watchers: sled::Tree,
    /// Group commit of the sled database.
    flusher: Arc<Flusher>,
    /// The database as the flusher's task holds it: emptied when the store is dropped, so
    /// that the database (and its lock) closes then, not when that task next wakes.
    flushed_db: Arc<std::sync::Mutex<Option<sled::Db>>>,
    job_ready: Notify,
    /// Every job by when it is due; see `jobs.rs`.
    job_index: std::sync::Mutex<jobs::JobIndex>,
    /// Makes "take a position, insert the notice" atomic, so a reader that has seen
    /// position p can never later miss a notice below p.
    notice_order: std::sync::Mutex<()>,
    workspace_root: PathBuf,
    /// Whether `workspace_root` lies on a local disk: small file operations of the tools
    /// then run on the calling task ([`LocalWorkspace::quick`]).
    workspace_local: bool,
    /// How long a claimed job is held without a heartbeat; a heartbeat extends it by as
    /// much again.
    lease: Duration,
    /// Held for the store's life: one process per data directory.
    _lock: std::fs::File,
}

impl SledStore {
    /// Opens (or creates) the store in `dir`, with the [`DEFAULT_LEASE`]. Must be called
    /// inside a tokio runtime. `workspace_root` is where each tree's workspace directory
    /// is made.
    pub fn open(dir: &Path, workspace_root: &Path) -> Result<Arc<Self>> {
        Self::open_with_lease(dir, workspace_root, DEFAULT_LEASE)
    }

    /// As [`SledStore::open_with_lease`], with the event log's file wrapped by `wrap`
    /// before it is read: how tests put a disk that fails, fills or writes short under the
    /// log.
    pub fn open_with_log_file(
        dir: &Path,
        workspace_root: &Path,
        lease: Duration,
        wrap: &dyn Fn(std::fs::File) -> Box<dyn LogFile>,
    ) -> Result<Arc<Self>> {
        Self::open_inner(dir, workspace_root, lease, Some(wrap))
    }

    /// As [`SledStore::open`], holding each claimed job for `lease` without a heartbeat.
    pub fn open_with_lease(
        dir: &Path,
        workspace_root: &Path,
        lease: Duration,
    ) -> Result<Arc<Self>> {
        Self::open_inner(dir, workspace_root, lease, None)
    }

    fn open_inner(
        dir: &Path,
        workspace_root: &Path,
        lease: Duration,
        wrap: Option<&dyn Fn(std::fs::File) -> Box<dyn LogFile>>,
    ) -> Result<Arc<Self>> {
        std::fs::create_dir_all(dir).map_err(backend_err)?;
        let lock = lock_dir(dir)?;
        let db = open_db(&dir.join("db"))?;
        let tree = |n: &str| db.open_tree(n).map_err(backend_err);
        let wal = Arc::new(wal::Wal::open(&dir.join("events.log"), wrap)?);
        migrate_sled_log(&db, &wal)?;
        let w = wal.clone();
        let flushed_db = Arc::new(std::sync::Mutex::new(Some(db.clone())));
        let store = Self {
            wal_flusher: Flusher::start("event log", move || w.sync()),
            wal,
            jobs: tree("jobs")?,
            cache: tree("cache")?,
            blobs: tree("blobs")?,
            notices: tree("notices")?,
            inflight: tree("inflight")?,
            watchers: tree("watchers")?,
            flusher: {
                let slot = flushed_db.clone();
                Flusher::start("sled database", move || {
                    match &*slot.lock().unwrap_or_else(|p| p.into_inner()) {
                        Some(db) => db.flush().map(|_| ()).map_err(std::io::Error::other),
                        None => Ok(()),
                    }
                })
            },
            flushed_db,
            db,
            job_ready: Notify::new(),
            job_index: Default::default(),
            notice_order: std::sync::Mutex::new(()),
            workspace_root: workspace_root.to_path_buf(),
            workspace_local: skein_tools::workspace::on_local_disk(workspace_root),
            lease,
            _lock: lock,
        };
        store.index_jobs()?;
        Ok(Arc::new(store))
    }

    /// Bytes of `events.log` that hold frames: the file goes on past them with the zeros
    /// of its reserve.
    pub fn log_len(&self) -> u64 {
        self.wal.end()
    }

    /// How many `fdatasync` calls the event log has made since the store was opened (one
    /// per group of appends that share it).
    pub fn log_syncs(&self) -> u64 {
        self.wal.syncs()
    }

    pub fn backend(self: &Arc<Self>) -> Backend {
        Backend {
            name: "sled",
            log: self.clone(),
            jobs: self.clone(),
            cache: self.clone(),
            blobs: self.clone(),
            notices: self.clone(),
            workspaces: self.clone(),
            announcer: None,
        }
    }

    /// Ends this process's use of the store just before the process exits: syncs the log
    /// and, when no job is left for a session that has not ended, keeps the sled database
    /// open until the process is gone, so that it is not flushed on the way out. Every
    /// sled write that must last was flushed when it was made (cache entries, watchers);
    /// what is left unflushed — job states of ended sessions, notices, single-flight
    /// marks — is what a crash leaves too, and is rebuilt from the logs as after one (a
    /// parent reads its children's logs when it is first loaded, a single-flight mark
    /// whose holder failed is replaced, `resume` re-enqueues an unfinished tree). A job
    /// still waiting for a session that has not ended (a run interrupted, a paused
    /// session's deadline) is flushed as before, for the next process to take. sled's
    /// first flush in a process starts its pool of I/O threads, which cost a short
    /// `skein run` several milliseconds of CPU on the way out.
    ///
    /// For a process that exits next; one that goes on using the data directory (a test,
    /// a server) drops the store instead, which flushes and closes it.
    pub async fn leave(self: Arc<Self>) -> Result<()> {
        self.close_log()?;
        for session in self.queued_sessions() {
            // A log that cannot be read counts as not ended: its job is kept.
            let ended = self
                .wal
                .last(&session)
                .is_ok_and(|last| last.is_none_or(|r| r.env.body.is_terminal()));
            if !ended {
                return self.flush().await;
            }
        }
        std::mem::forget(self);
        Ok(())
    }

    /// Flushes everything (used at shutdown).
    pub async fn flush(&self) -> Result<()> {
        self.close_log()?;
        if let Some(e) = self.flusher.failure() {
            return Err(e);
        }
        self.db.flush_async().await.map(|_| ()).map_err(backend_err)
    }

    /// Syncs the event log and moves its mark over all of it.
    fn close_log(&self) -> Result<()> {
        if let Some(e) = self.wal.stopped() {
            return Err(e);
        }
        self.wal
            .close()
            .map_err(|e| Error::unavailable("event log: the last sync failed", e))
    }

    /// Resolves when the store has stopped taking writes: a sync of the event log or a
    /// flush of the sled database failed. Every later write fails with the same error;
    /// opening the store again (a new process) reads the files anew.
    pub async fn failed(&self) -> Error {
        tokio::select! {
            e = self.wal_flusher.failed() => e,
            e = self.flusher.failed() => e,
        }
    }
}

impl Drop for SledStore {
    fn drop(&mut self) {
        for f in [&self.flusher, &self.wal_flusher] {
            f.stop.store(true, Ordering::SeqCst);
            f.kick.notify_one();
        }
        let _ = self.wal.close();
        if self.flusher.failure().is_none() {
            let _ = self.db.flush();
        }
        self.flushed_db
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}

/// How long [`open_db`] waits for a handle of this process that is closing.
const DB_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Opens the sled database. The data directory's own lock is held by then, so no other
/// process has the database open; a sled lock still taken is this process's previous
/// handle, whose last background write (sled runs it on a thread of its own) can outlive
/// the handle's drop by a moment. That is waited for, up to [`DB_LOCK_WAIT`], rather than
/// failing an open that follows a close. sled reports a taken lock only in the text of an
/// I/O error of kind `Other`, so that text is what is matched here.
fn open_db(path: &Path) -> Result<sled::Db> {
    let started = std::time::Instant::now();
    loop {
        match sled::Config::new().path(path).flush_every_ms(None).open() {
            Err(sled::Error::Io(e))
                if e.kind() == std::io::ErrorKind::Other
                    && e.to_string().contains("could not acquire lock")
                    && started.elapsed() < DB_LOCK_WAIT =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            r => return r.map_err(backend_err),
        }
    }
}

/// Moves the records an earlier version kept in the sled trees `events` and `sessions`
/// into the event log file, once: they are synced there before the trees are emptied, and a
/// crash in between finds them in both places and moves only the sessions the file lacks.
fn migrate_sled_log(db: &sled::Db, wal: &wal::Wal) -> Result<()> {
    let names = db.tree_names();
    if !names.iter().any(|n| n.as_ref() == b"events") {
        return Ok(());
    }
    let events = db.open_tree("events").map_err(backend_err)?;
    if events.is_empty() {
        return Ok(());
    }
    let sessions = db.open_tree("sessions").map_err(backend_err)?;
    let mut moved = 0usize;
    for item in sessions.iter() {
        let (k, _) = item.map_err(backend_err)?;
        let id = std::str::from_utf8(&k).map_err(|e| Error::corrupt("session key", e))?;
        let session = SessionId::parse(id)?;
        if !wal.sessions_from(id).iter().any(|s| s == id) {
            let mut records = vec![];
            for item in events.scan_prefix(prefix(id)) {
                let (_, v) = item.map_err(backend_err)?;
                records.push(
                    skein_core::Record::decode(v.to_vec())
                        .map_err(|e| Error::corrupt(format!("record of {session}"), e))?,
                );
            }
            if wal.append(&session, 0, &records)?.is_err() {
                return Err(Error::corrupt_because(format!(
                    "moving {session}'s records into the event log: it has some already"
                )));
            }
            moved += records.len();
        }
    }
    wal.sync().map_err(backend_err)?;
    events.clear().map_err(backend_err)?;
    sessions.clear().map_err(backend_err)?;
    db.flush().map_err(backend_err)?;
    tracing::info!(
        records = moved,
        "moved the event log out of sled into its own file"
    );
    Ok(())
}

impl Workspaces for SledStore {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace> {
        Arc::new(
            LocalWorkspace::new(self.workspace_root.join(root.as_str()))
                .quick(self.workspace_local),
        )
    }
}

/// Takes the data directory's lock file, or says which directory another process holds.
pub(crate) fn lock_dir(dir: &Path) -> Result<std::fs::File> {
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::unavailable(format!("sled: cannot open {}", path.display()), e))?;
    #[cfg(unix)]
    {
        use rustix::fs::{flock, FlockOperation};
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(Error::unavailable_because(format!(
                    "the data directory {} is in use by another skein process",
                    dir.display()
                )))
            }
            Err(e) => {
                return Err(Error::unavailable(
                    format!("sled: cannot lock {}", path.display()),
                    std::io::Error::from(e),
                ))
            }
        }
    }
    Ok(file)
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(v).map_err(|e| Error::corrupt("encoding a stored value", e))
}

fn decode<'a, T: Deserialize<'a>>(b: &'a [u8]) -> Result<T> {
    rmp_serde::from_slice(b).map_err(|e| Error::corrupt("a stored value", e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    use super::Flusher;

    #[tokio::test]
    async fn a_flush_that_fails_fails_its_writers_and_every_later_one_and_is_not_retried() {
        // Given a flusher whose flush fails once the disk turns bad.
        let bad = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicU64::new(0));
        let (b, c) = (bad.clone(), calls.clone());
        let f = Flusher::start("sled database", move || {
            c.fetch_add(1, Ordering::SeqCst);
            if b.load(Ordering::SeqCst) {
                Err(std::io::Error::from_raw_os_error(5))
            } else {
                Ok(())
            }
        });
        f.durable().await.unwrap();

        // When writers wait for a flush that fails.
        bad.store(true, Ordering::SeqCst);
        let (x, y) = tokio::join!(f.durable(), f.durable());

        // Then each is told so, with the disk's error; and once the disk is good again,
        // later writers are refused without another flush.
        for r in [x, y] {
            let e = r.unwrap_err();
            assert!(e.report().to_string().contains("Input/output error"), "{e}");
            assert!(e.to_string().contains("sled database"), "{e}");
        }
        bad.store(false, Ordering::SeqCst);
        let made = calls.load(Ordering::SeqCst);
        assert!(f.durable().await.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), made, "flushed again");
        assert!(f.failed().await.to_string().contains("sled database"));
    }
}
