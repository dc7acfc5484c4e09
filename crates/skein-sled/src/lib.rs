//! skein-sled: the embedded backend of skein's ports — every port on one sled database,
//! for one process (`skein run`, `skein resume`). The JetStream backend (`skein-nats`)
//! implements the same ports for a cluster; both pass the same conformance suite.
//!
//! | port | file | sled |
//! | --- | --- | --- |
//! | EventLog | `log.rs` | trees `events`, `sessions` |
//! | JobQueue | `jobs.rs` | tree `jobs` |
//! | Cache, Blobs, Notices | `kv.rs` | trees `cache`, `inflight`, `blobs`, `notices`, `watchers` |
//! | Workspaces | here | a directory per tree |
//!
//! Layout (one sled tree each):
//! - `events`: `session \0 seq(u64 BE)` → record bytes; `sessions`: `session` → last seq.
//!   An append checks and bumps `sessions` and inserts the record in one transaction.
//! - `jobs`: `pool \0 session` → job state (ready / held with lease, attempt, dirty).
//! - `cache`: mission hash → entry; `blobs`: blake3 hex → bytes;
//!   `notices`: `parent \0 position(u64 BE)` → child id.
//!
//! Durability: an append returns only after a flush that covers it has completed. Appends
//! of many sessions share one flush (group commit): each append takes a ticket after its
//! write, and a single flusher task flushes and then releases every ticket it covered.
//! Jobs and notices are not flushed per write: after a crash, `resume` derives every job
//! from the logs, and a parent reconciles with its children's logs when it is first loaded.

mod jobs;
mod kv;
mod log;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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

fn backend_err(e: impl Into<skein_runtime::error::BoxError>) -> Error {
    Error::unavailable("sled", e)
}

fn event_key(session: &SessionId, seq: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(session.as_str().len() + 9);
    k.extend_from_slice(session.as_str().as_bytes());
    k.push(0);
    k.extend_from_slice(&seq.to_be_bytes());
    k
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

/// Group commit: appends wait for a flush that started after their write.
struct Flusher {
    requested: AtomicU64,
    kick: Notify,
    stop: std::sync::atomic::AtomicBool,
    flushed: watch::Receiver<u64>,
}

impl Flusher {
    fn start(db: sled::Db) -> Arc<Self> {
        let (tx, rx) = watch::channel(0u64);
        let f = Arc::new(Self {
            requested: AtomicU64::new(0),
            kick: Notify::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
            flushed: rx,
        });
        let me = f.clone();
        tokio::spawn(async move {
            while !me.stop.load(Ordering::SeqCst) {
                let target = me.requested.load(Ordering::SeqCst);
                if target <= *tx.borrow() {
                    let kicked = me.kick.notified();
                    let _ = tokio::time::timeout(Duration::from_millis(200), kicked).await;
                    continue;
                }
                let db2 = db.clone();
                match tokio::task::spawn_blocking(move || db2.flush()).await {
                    Ok(Ok(_)) => {
                        let _ = tx.send(target);
                    }
                    Ok(Err(e)) => {
                        tracing::error!(error = %e, "sled flush failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "sled flush task failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        f
    }

    async fn durable(&self) -> Result<()> {
        let ticket = self.requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.kick.notify_one();
        let mut rx = self.flushed.clone();
        rx.wait_for(|done| *done >= ticket)
            .await
            .map(|_| ())
            .map_err(|_| Error::unavailable_because("sled flusher stopped"))
    }
}

/// The embedded store.
pub struct SledStore {
    db: sled::Db,
    events: sled::Tree,
    sessions: sled::Tree,
    jobs: sled::Tree,
    cache: sled::Tree,
    blobs: sled::Tree,
    notices: sled::Tree,
    inflight: sled::Tree,
    watchers: sled::Tree,
    flusher: Arc<Flusher>,
    job_ready: Notify,
    /// Every job by when it is due; see `jobs.rs`.
    job_index: std::sync::Mutex<jobs::JobIndex>,
    /// Makes "take a position, insert the notice" atomic, so a reader that has seen
    /// position p can never later miss a notice below p.
    notice_order: std::sync::Mutex<()>,
    workspace_root: PathBuf,
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

    /// As [`SledStore::open`], holding each claimed job for `lease` without a heartbeat.
    pub fn open_with_lease(
        dir: &Path,
        workspace_root: &Path,
        lease: Duration,
    ) -> Result<Arc<Self>> {
        std::fs::create_dir_all(dir).map_err(backend_err)?;
        let lock = lock_dir(dir)?;
        let db = sled::Config::new()
            .path(dir.join("db"))
            .flush_every_ms(None)
            .open()
            .map_err(backend_err)?;
        let tree = |n: &str| db.open_tree(n).map_err(backend_err);
        let store = Self {
            events: tree("events")?,
            sessions: tree("sessions")?,
            jobs: tree("jobs")?,
            cache: tree("cache")?,
            blobs: tree("blobs")?,
            notices: tree("notices")?,
            inflight: tree("inflight")?,
            watchers: tree("watchers")?,
            flusher: Flusher::start(db.clone()),
            db,
            job_ready: Notify::new(),
            job_index: Default::default(),
            notice_order: std::sync::Mutex::new(()),
            workspace_root: workspace_root.to_path_buf(),
            lease,
            _lock: lock,
        };
        store.index_jobs()?;
        Ok(Arc::new(store))
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

    /// Flushes everything (used at shutdown).
    pub async fn flush(&self) -> Result<()> {
        self.db.flush_async().await.map(|_| ()).map_err(backend_err)
    }
}

impl Drop for SledStore {
    fn drop(&mut self) {
        self.flusher.stop.store(true, Ordering::SeqCst);
        self.flusher.kick.notify_one();
        let _ = self.db.flush();
    }
}

impl Workspaces for SledStore {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace> {
        Arc::new(LocalWorkspace::new(self.workspace_root.join(root.as_str())))
    }
}

/// Takes the data directory's lock file, or says which directory another process holds.
fn lock_dir(dir: &Path) -> Result<std::fs::File> {
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
