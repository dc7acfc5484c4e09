//! skein-sled: the embedded backend of skein's ports — an event log file of its own, a
//! sled database for what must outlast the process, and memory for the rest, for one
//! process (`skein run`, `skein resume`). The JetStream backend (`skein-nats`)
//! implements the same ports for a cluster; both pass the same conformance suite.
//!
//! | port | file | sled |
//! | --- | --- | --- |
//! | EventLog | `log.rs`, `wal.rs` | none: its own file, `events.log` |
//! | Blobs | `kv.rs`, `wal.rs` | none: frames of `events.log` (tree `blobs` read for older ones) |
//! | JobQueue | `jobs.rs` | none while open: in memory; tree `jobs` holds what was handed on to the next process |
//! | Cache, Notices | `kv.rs` | trees `cache`, `watchers`; single-flight claims and notices are in memory |
//! | EventLog's index of roots | `roots.rs` | a database of its own, `roots/`, opened by a listing |
//! | Workspaces | here | a directory per tree |
//!
//! The event log is an append-only file of its own (`wal.rs`): one frame per append, one
//! `fdatasync` per group of appends. Blobs are frames of the same file. Earlier versions
//! kept the log in the sled trees `events` and `sessions`; opening such a directory moves
//! those records into the file once. Blobs they kept in the tree `blobs` are read there.
//!
//! Layout of the rest (one sled tree each):
//! - `jobs`: `pool \0 session` → job state (ready / held with lease, attempt, dirty), as
//!   last handed on ([`SledStore::leave`], or a drop).
//! - `cache`: mission hash → entry; `watchers`: `target \0 watcher` → pool;
//!   `blobs` (written by earlier versions only): blake3 hex → bytes. Earlier versions also
//!   kept `notices` and `inflight` trees, which are no longer read.
//!
//! Durability: an append returns only after an `fdatasync` of the log that covers it.
//! Appends of many sessions share one (group commit): each append takes a ticket after its
//! write, and a single flusher task syncs and then releases every ticket it covered. Before
//! each sync it lets the tasks that are ready run first: the writers the last sync released
//! (a wide turn's children, stepping together) then share the next one rather than the
//! first of them getting a sync of its own (docs/perf.md has the figures). A blob is
//! written ahead of the record that names it, whose sync covers it (see `kv.rs`). Cache
//! entries and watchers take their tickets from the same flusher, marked so that the flush
//! covering them also flushes the sled database (appends alone never flush it): one task
//! and one queue for both. A sync or flush that fails stops the flusher for good
//! (fail-stop), for the log and the database alike: the writers waiting for it and every
//! later one get its error, naming the part that failed, and [`SledStore::failed`]
//! resolves with it; a full disk fails the one write with [`skein_ports::Error::Full`] and
//! stops nothing (see `wal.rs`). Jobs, notices and single-flight claims are soft state, in
//! memory: after a crash, `resume` derives every job from the logs, a parent reconciles
//! with its children's logs when it is first loaded, and a claim whose holder is gone is
//! replaced.

mod checkpoint;
pub mod file;
pub mod gc;
mod jobs;
mod kv;
mod log;
mod roots;
pub mod verify;
mod wal;

pub use file::LogFile;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use skein_core::SessionId;
use skein_ports::ports::{Backend, Capabilities, Workspaces};
use skein_ports::{Error, Result};
use skein_tools::{LocalWorkspace, Workspace};
use tokio::sync::{watch, Notify};

/// How long a claimed job is held without a heartbeat, unless the store is opened with
/// another lease ([`SledStore::open_with_lease`]).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// A failure of the sled database: no room when the disk is full, else unavailable.
fn backend_err(e: impl Into<skein_ports::error::BoxError>) -> Error {
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

/// Group commit, for the event log and the sled database both: writers wait for a flush
/// that started after their write. Each flush syncs the log; it also flushes the sled
/// database when a writer of the database asked for that ([`Flusher::durable_db`]) since
/// the last one, so appends alone never pay for a database flush. One task, one queue of
/// tickets: a cache entry written beside a turn's appends shares their flush.
///
/// Fail-stop: the first flush that fails stops the flusher for good. The writers waiting
/// for it, and every later one, get that error; none is told its write is durable unless
/// a flush that succeeded covered it.
struct Flusher {
    requested: AtomicU64,
    /// Set by a writer of the sled database before it takes its ticket, taken by the next
    /// flush: a flush that sees the ticket also sees the mark, or an earlier flush took the
    /// mark after the write and covered it.
    db_dirty: AtomicBool,
    kick: Notify,
    stop: AtomicBool,
    flushed: watch::Receiver<Flushed>,
    failed: Arc<OnceLock<FlushFailed>>,
}

/// The flusher's progress: every ticket up to `upto` is durable; once `failed`, no more.
#[derive(Clone, Copy, Default)]
struct Flushed {
    upto: u64,
    failed: bool,
}

/// What a flush failed on (`event log` or `sled database`) and the disk's error, under the
/// error a writer is given.
#[derive(Debug, Clone)]
struct FlushFailed {
    what: &'static str,
    error: Arc<std::io::Error>,
}

impl std::fmt::Display for FlushFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for FlushFailed {}

/// The two halves of one flush, as [`Flusher::start`] takes them: a sync of the event log,
/// and a flush of the sled database.
type FlushFn = dyn Fn() -> std::io::Result<()> + Send + Sync;

impl Flusher {
    /// Starts the task that syncs the log (`sync_log`), and flushes the database
    /// (`flush_db`) when asked, whenever a writer waits.
    fn start(
        sync_log: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
        flush_db: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Arc<Self> {
        let parts: Arc<(Box<FlushFn>, Box<FlushFn>)> =
            Arc::new((Box::new(sync_log), Box::new(flush_db)));
        let (tx, rx) = watch::channel(Flushed::default());
        let tx = Arc::new(tx);
        let f = Arc::new(Self {
            requested: AtomicU64::new(0),
            db_dirty: AtomicBool::new(false),
            kick: Notify::new(),
            stop: AtomicBool::new(false),
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
                let with_db = me.db_dirty.swap(false, Ordering::SeqCst);
                let parts = parts.clone();
                // The writers are released from the flush's own thread, as soon as it is
                // done: not after this task has been woken and polled in turn.
                let done = tx.clone();
                let failed = me.failed.clone();
                let flushed = tokio::task::spawn_blocking(move || {
                    let result = (parts.0)().map_err(|e| ("event log", e)).and_then(|()| {
                        if with_db {
                            (parts.1)().map_err(|e| ("sled database", e))
                        } else {
                            Ok(())
                        }
                    });
                    match result {
                        Ok(()) => done.send_modify(|d| d.upto = target),
                        Err((what, e)) => {
                            failed.get_or_init(|| FlushFailed {
                                what,
                                error: Arc::new(e),
                            });
                            done.send_modify(|d| d.failed = true);
                        }
                    }
                });
                if let Err(e) = flushed.await {
                    me.failed.get_or_init(|| FlushFailed {
                        what: "event log",
                        error: Arc::new(std::io::Error::other(e.to_string())),
                    });
                    tx.send_modify(|d| d.failed = true);
                }
                if let Some(e) = me.failed.get() {
                    tracing::error!(
                        store = e.what,
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
                    e.what
                ),
                e.clone(),
            )
        })
    }

    /// Whether a flush of the sled database (not of the log) is what failed.
    fn db_failed(&self) -> bool {
        self.failed.get().is_some_and(|e| e.what == "sled database")
    }

    /// Waits until the event log is synced past every write made before the call.
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

    /// As [`Flusher::durable`], for a write of the sled database: the flush that covers it
    /// flushes the database too.
    async fn durable_db(&self) -> Result<()> {
        self.db_dirty.store(true, Ordering::SeqCst);
        self.durable().await
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
    /// The sled database, opened when first needed (see [`Sled`]).
    sled: Arc<Sled>,
    wal: Arc<wal::Wal>,
    /// The store's one group commit: of the event log, and of the sled database for the
    /// writes that ask for it ([`Flusher::durable_db`]).
    wal_flusher: Arc<Flusher>,
    /// Single-flight claims and notices: soft state, in memory (see `kv.rs`).
    soft: std::sync::Mutex<kv::Soft>,
    /// Set by [`SledStore::leave`]: the store then hands on and flushes nothing more when
    /// dropped (leave did what was needed).
    left: AtomicBool,
    job_ready: Notify,
    /// Every job, by when it is due; see `jobs.rs`.
    job_index: std::sync::Mutex<jobs::JobIndex>,
    workspace_root: PathBuf,
    /// Whether `workspace_root` lies on a local disk: small file operations of the tools
    /// then run on the calling task ([`LocalWorkspace::quick`]).
    workspace_local: bool,
    /// How long a claimed job is held without a heartbeat; a heartbeat extends it by as
    /// much again.
    lease: Duration,
    /// The index of roots (see `roots.rs`).
    roots: roots::RootsIndex,
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
        let wal = Arc::new(wal::Wal::open(&dir.join("events.log"), wrap)?);
        let sled = Arc::new(Sled::new(&dir.join("db")));
        if !Sled::empty_on_disk(&dir.join("db")) {
            migrate_sled_log(&sled.open()?.db, &wal)?;
        }
        let roots = roots::RootsIndex::open(dir);
        let w = wal.clone();
        let slot = sled.flushed.clone();
        let store = Self {
            wal_flusher: Flusher::start(
                move || w.sync(),
                // Only a write into the database asks for its flush, and that write opened
                // it; a database dropped with the store has nothing more to flush.
                move || match &*slot.lock().unwrap_or_else(|p| p.into_inner()) {
                    Some(db) => db.flush().map(|_| ()).map_err(std::io::Error::other),
                    None => Ok(()),
                },
            ),
            wal,
            soft: Default::default(),
            left: AtomicBool::new(false),
            sled,
            job_ready: Notify::new(),
            job_index: Default::default(),
            workspace_root: workspace_root.to_path_buf(),
            workspace_local: skein_tools::workspace::on_local_disk(workspace_root),
            lease,
            roots,
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

    /// Brings the index of roots up to date with the log (a listing of roots does so
    /// first); returns how many roots it summarized again.
    pub fn refresh_roots(&self) -> Result<usize> {
        self.roots.refresh(&self.wal)
    }

    /// How many roots the index of roots does not cover yet, and whether it is to be
    /// rebuilt whole.
    pub fn roots_pending(&self) -> (usize, bool) {
        self.roots.pending(&self.wal)
    }

    /// Whether this process has opened the database of the index of roots (a listing
    /// does; nothing else).
    pub fn roots_index_opened(&self) -> bool {
        self.roots.opened()
    }

    /// The bytes of keys and values the index of roots holds, and how many roots.
    pub fn roots_index_bytes(&self) -> Result<(u64, u64)> {
        self.roots.bytes()
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
            quota: None,
            // One process holds the database: a notice is written to its tree (at once
            // visible to every reader in the process) before the wake-up is pushed, so the
            // claimer of that wake-up reads it. A crash may lose both (neither is flushed
            // per write), and then every fold is gone with the process: the next load of
            // the parent is cold and reads every outstanding child.
            capabilities: Capabilities {
                notices_in_step_with_wakes: true,
                notices_outlive_workers: false,
                claim_matching: true,
            },
        }
    }

    /// Ends this process's use of the store just before the process exits: syncs the log
    /// and, when a job is left for a session that has not ended (a run interrupted, a
    /// paused session's deadline), hands every job on to the next process (`skein ui`,
    /// `resume`) and flushes the database. Otherwise nothing is handed on: jobs, notices
    /// and single-flight marks are soft state (see `jobs.rs` and `kv.rs`), and what sled
    /// holds that must last (cache entries, watchers) was flushed when it was written.
    ///
    /// The store is then dropped as any other. A process that never wrote into sled never
    /// opened it (see [`Sled`]), so there is no database to close; one that did flushed it
    /// then, and closing it finds nothing left to write.
    pub async fn leave(self: Arc<Self>) -> Result<()> {
        self.close_log()?;
        self.left.store(true, Ordering::SeqCst);
        for session in self.queued_sessions() {
            // A log that cannot be read counts as not ended: its job is kept.
            let ended = self
                .wal
                .last(&session)
                .is_ok_and(|last| last.is_none_or(|r| r.env.body.is_terminal()));
            if !ended {
                self.hand_on_jobs()?;
                return self.flush().await;
            }
        }
        Ok(())
    }

    /// Whether this process has opened the sled database (it does so on its first write
    /// there, or at open when the database holds something).
    pub fn sled_opened(&self) -> bool {
        self.sled.get().is_some()
    }

    /// Flushes everything (used at shutdown).
    pub async fn flush(&self) -> Result<()> {
        self.close_log()?;
        if let Some(e) = self.wal_flusher.failure() {
            return Err(e);
        }
        match self.sled.get() {
            Some(o) => o.db.flush_async().await.map(|_| ()).map_err(backend_err),
            None => Ok(()),
        }
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
        self.wal_flusher.failed().await
    }
}

impl Drop for SledStore {
    fn drop(&mut self) {
        if self.wal_flusher.failure().is_some() {
            self.forget_unflushed_cache();
        }
        self.wal_flusher.stop.store(true, Ordering::SeqCst);
        self.wal_flusher.kick.notify_one();
        let _ = self.wal.close();
        if !self.left.load(Ordering::SeqCst) && !self.wal_flusher.db_failed() {
            if let Err(e) = self.hand_on_jobs() {
                tracing::warn!(error = %e, "the job queue could not be handed on; `skein resume` derives it");
            }
            if let Some(o) = self.sled.get() {
                let _ = o.db.flush();
            }
        }
        self.sled
            .flushed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}

/// The sled database of a store, opened when first needed: when the store is opened if
/// the database holds anything on disk, otherwise at the first write into it (a cache
/// entry, a watcher, jobs handed on). Until then every read finds it empty, which it is.
/// A `skein run` that writes nothing there (`--no-cache`) so never opens sled, and never
/// pays for its open, its I/O threads or the flush with which it closes. The index of
/// roots is a sled database of its own (`roots.rs`), opened by a listing only.
pub(crate) struct Sled {
    path: PathBuf,
    opened: OnceLock<Opened>,
    opening: std::sync::Mutex<()>,
    /// The database as the flusher's task holds it: emptied when the store is dropped, so
    /// that the database (and its lock) closes then, not when that task next wakes.
    flushed: Arc<std::sync::Mutex<Option<sled::Db>>>,
}

/// The open database and the trees of the store's ports.
pub(crate) struct Opened {
    pub(crate) db: sled::Db,
    pub(crate) jobs: sled::Tree,
    pub(crate) cache: sled::Tree,
    pub(crate) blobs: sled::Tree,
    pub(crate) watchers: sled::Tree,
}

impl Sled {
    fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            opened: OnceLock::new(),
            opening: std::sync::Mutex::new(()),
            flushed: Arc::new(std::sync::Mutex::new(None)),
        }
    }

    /// Whether the database at `path` holds nothing: it was never made, or never flushed
    /// (sled writes its file only when it flushes, and its snapshots after that).
    pub(crate) fn empty_on_disk(path: &Path) -> bool {
        let Ok(entries) = std::fs::read_dir(path) else {
            return true;
        };
        let file_empty = std::fs::metadata(path.join("db")).map_or(true, |m| m.len() == 0);
        let snapshot = entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("snap."));
        file_empty && !snapshot
    }

    /// The database, if this process has opened it.
    pub(crate) fn get(&self) -> Option<&Opened> {
        self.opened.get()
    }

    /// The database, opened now if it was not.
    pub(crate) fn open(&self) -> Result<&Opened> {
        if let Some(o) = self.opened.get() {
            return Ok(o);
        }
        let _one = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = self.opened.get() {
            return Ok(o);
        }
        let db = open_db(&self.path)?;
        roots::drop_old_trees(&db)?;
        let tree = |n: &str| db.open_tree(n).map_err(backend_err);
        let opened = Opened {
            jobs: tree("jobs")?,
            cache: tree("cache")?,
            blobs: tree("blobs")?,
            watchers: tree("watchers")?,
            db: db.clone(),
        };
        *self.flushed.lock().unwrap_or_else(|p| p.into_inner()) = Some(db);
        Ok(self.opened.get_or_init(|| opened))
    }
}

/// How long [`open_db`] waits for a handle of this process that is closing.
const DB_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Opens the sled database. The data directory's own lock is held by then, so no other
/// process has the database open; a sled lock still taken is this process's previous
/// handle, whose last background write (sled runs it on a thread of its own) can outlive
/// the handle's drop by a moment. That is waited for, up to [`DB_LOCK_WAIT`], rather than
/// failing an open that follows a close.
///
/// sled 0.34 offers no other way to tell a taken lock: its `Config::open` turns the lock
/// call's error into a new `io::Error` of kind `Other` whose text quotes it, keeping
/// neither the OS error code nor a source, and `sled::Error` has no variant for it. So
/// that text is what is matched here, and only within [`DB_LOCK_WAIT`] of the first try:
/// if a sled release words it otherwise, an open that follows a close fails at once with
/// sled's own message, and never waits on some other error. `tests/open.rs` checks that
/// the wording is still sled's.
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
        if !wal.sessions_from(id)?.iter().any(|s| s == id) {
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

/// How long [`lock_dir`] waits for a lock it finds taken.
const DIR_LOCK_WAIT: Duration = Duration::from_millis(500);

/// Takes the data directory's lock file, or says which directory another process holds.
///
/// A lock found taken is tried again for up to [`DIR_LOCK_WAIT`] before that is said: a
/// store this process has just dropped can still hold it for a moment, when another
/// thread forked a child in between (the child's copy of the descriptor keeps the lock
/// until its exec closes it). A process that holds the directory holds it far longer.
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
        let started = std::time::Instant::now();
        let mut taken = flock(&file, FlockOperation::NonBlockingLockExclusive);
        while taken == Err(rustix::io::Errno::WOULDBLOCK) && started.elapsed() < DIR_LOCK_WAIT {
            std::thread::sleep(Duration::from_millis(5));
            taken = flock(&file, FlockOperation::NonBlockingLockExclusive);
        }
        match taken {
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

    /// A flush half that counts its calls and fails while `bad` is set.
    fn part(
        calls: &Arc<AtomicU64>,
        bad: &Arc<AtomicBool>,
    ) -> impl Fn() -> std::io::Result<()> + Send + Sync + 'static {
        let (c, b) = (calls.clone(), bad.clone());
        move || {
            c.fetch_add(1, Ordering::SeqCst);
            if b.load(Ordering::SeqCst) {
                Err(std::io::Error::from_raw_os_error(5))
            } else {
                Ok(())
            }
        }
    }

    #[tokio::test]
    async fn a_flush_that_fails_fails_its_writers_and_every_later_one_and_is_not_retried() {
        // Given a flusher whose database flush fails once the disk turns bad.
        let (log_calls, db_calls) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (good, bad) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let f = Flusher::start(part(&log_calls, &good), part(&db_calls, &bad));
        f.durable_db().await.unwrap();

        // When writers wait for a flush that fails.
        bad.store(true, Ordering::SeqCst);
        let (x, y) = tokio::join!(f.durable_db(), f.durable());

        // Then each is told so, with the disk's error and the part that failed; and once
        // the disk is good again, later writers are refused without another flush.
        for r in [x, y] {
            let e = r.unwrap_err();
            assert!(e.report().to_string().contains("Input/output error"), "{e}");
            assert!(e.to_string().contains("sled database"), "{e}");
        }
        bad.store(false, Ordering::SeqCst);
        let made = (
            log_calls.load(Ordering::SeqCst),
            db_calls.load(Ordering::SeqCst),
        );
        assert!(f.durable().await.is_err());
        assert!(f.durable_db().await.is_err());
        assert_eq!(
            (
                log_calls.load(Ordering::SeqCst),
                db_calls.load(Ordering::SeqCst)
            ),
            made,
            "flushed again"
        );
        assert!(f.failed().await.to_string().contains("sled database"));
        assert!(f.db_failed());
    }

    #[tokio::test]
    async fn a_failed_log_sync_names_the_event_log() {
        let (calls, bad) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(true)));
        let f = Flusher::start(part(&calls, &bad), part(&calls, &Arc::default()));
        let e = f.durable().await.unwrap_err();
        assert!(e.to_string().contains("event log"), "{e}");
        assert!(!f.db_failed());
    }

    #[tokio::test]
    async fn the_database_is_flushed_only_for_writes_that_ask_and_the_log_always() {
        // Given one flusher for the log and the database.
        let (log_calls, db_calls) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let ok = Arc::new(AtomicBool::new(false));
        let f = Flusher::start(part(&log_calls, &ok), part(&db_calls, &ok));

        // When only appends wait, then a write of the database.
        f.durable().await.unwrap();
        f.durable().await.unwrap();
        assert_eq!(
            db_calls.load(Ordering::SeqCst),
            0,
            "appends flushed the database"
        );
        let log_before = log_calls.load(Ordering::SeqCst);
        f.durable_db().await.unwrap();

        // Then that write's flush synced the log and flushed the database, and the next
        // append does not flush the database again.
        assert_eq!(db_calls.load(Ordering::SeqCst), 1);
        assert!(log_calls.load(Ordering::SeqCst) > log_before);
        f.durable().await.unwrap();
        assert_eq!(db_calls.load(Ordering::SeqCst), 1);
    }
}
