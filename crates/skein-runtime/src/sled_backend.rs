//! The embedded backend: every port on one sled database.
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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use skein_core::{Record, SessionId};
use skein_tools::{LocalWorkspace, Workspace};
use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::Transactional;
use tokio::sync::{watch, Notify};

use crate::ports::{
    Backend, Blobs, Cache, CacheEntry, EventLog, Job, JobQueue, Notices, SessionFilter, Workspaces,
};
use crate::{now_ms, Error, Result};

fn backend_err(e: impl std::fmt::Display) -> Error {
    Error::Backend(format!("sled: {e}"))
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
            .map_err(|_| Error::Backend("sled flusher stopped".into()))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct JobRec {
    held_until: Option<u64>,
    not_before: u64,
    attempt: u32,
    token: u64,
    dirty: bool,
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
    /// Makes "take a position, insert the notice" atomic, so a reader that has seen
    /// position p can never later miss a notice below p.
    notice_order: std::sync::Mutex<()>,
    workspace_root: PathBuf,
}

impl SledStore {
    /// Opens (or creates) the store in `dir`. Must be called inside a tokio runtime.
    /// `workspace_root` is where each tree's workspace directory is made.
    pub fn open(dir: &Path, workspace_root: &Path) -> Result<Arc<Self>> {
        std::fs::create_dir_all(dir).map_err(backend_err)?;
        let db = sled::Config::new()
            .path(dir.join("db"))
            .flush_every_ms(None)
            .open()
            .map_err(|e| {
                if e.to_string().contains("could not acquire lock") {
                    Error::Backend(format!(
                        "the data directory {} is in use by another skein process",
                        dir.display()
                    ))
                } else {
                    backend_err(e)
                }
            })?;
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
            notice_order: std::sync::Mutex::new(()),
            workspace_root: workspace_root.to_path_buf(),
        };
        store.release_stale_leases()?;
        Ok(Arc::new(store))
    }

    /// sled allows one process per database, so any lease found at open belongs to a
    /// process that is gone.
    fn release_stale_leases(&self) -> Result<()> {
        for item in self.jobs.iter() {
            let (k, v) = item.map_err(backend_err)?;
            if let Ok(mut rec) = rmp_serde::from_slice::<JobRec>(&v) {
                if rec.held_until.is_some() {
                    rec.held_until = None;
                    rec.not_before = 0;
                    self.jobs.insert(k, encode(&rec)?).map_err(backend_err)?;
                }
            }
        }
        Ok(())
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

    fn job_key(pool: &str, session: &SessionId) -> Vec<u8> {
        let mut k = prefix(pool);
        k.extend_from_slice(session.as_str().as_bytes());
        k
    }

    fn try_claim(
        &self,
        pool: &str,
        lease: Duration,
        want: Option<&SessionFilter>,
    ) -> Result<Option<Job>> {
        let now = now_ms();
        for item in self.jobs.scan_prefix(prefix(pool)) {
            let (k, v) = item.map_err(backend_err)?;
            if want.is_some_and(|w| !job_wanted(&k, pool, w)) {
                continue;
            }
            let Ok(rec) = rmp_serde::from_slice::<JobRec>(&v) else {
                continue;
            };
            let free = match rec.held_until {
                Some(until) => until <= now,
                None => rec.not_before <= now,
            };
            if !free {
                continue;
            }
            let token = self.db.generate_id().map_err(backend_err)?;
            let new = JobRec {
                held_until: Some(now + lease.as_millis() as u64),
                not_before: 0,
                attempt: rec.attempt + 1,
                token,
                dirty: rec.dirty && rec.held_until.is_some(),
            };
            let swapped = self
                .jobs
                .compare_and_swap(&k, Some(&v), Some(encode(&new)?))
                .map_err(backend_err)?;
            if swapped.is_err() {
                continue; // another claimer won this one
            }
            let session = std::str::from_utf8(&k[pool.len() + 1..])
                .map_err(|e| Error::Corrupt(e.to_string()))?;
            return Ok(Some(Job {
                pool: pool.to_string(),
                session: SessionId::parse(session)?,
                attempt: new.attempt,
                handle: token.to_string(),
            }));
        }
        Ok(None)
    }

    async fn claim_where(
        &self,
        pool: &str,
        lease: Duration,
        wait: Duration,
        want: Option<&SessionFilter>,
    ) -> Result<Option<Job>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.job_ready.notified();
            if let Some(j) = self.try_claim(pool, lease, want)? {
                return Ok(Some(j));
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // Wake on a push or an ack, or poll for leases and delays that run out.
            let nap = (deadline - now).min(Duration::from_millis(100));
            let _ = tokio::time::timeout(nap, notified).await;
        }
    }

    /// Updates a job record with `f` if it is still held under `handle`.
    fn update_held(&self, job: &Job, f: impl Fn(JobRec) -> Option<JobRec>) -> Result<()> {
        let key = Self::job_key(&job.pool, &job.session);
        loop {
            let Some(v) = self.jobs.get(&key).map_err(backend_err)? else {
                return Ok(());
            };
            let rec: JobRec = decode(&v)?;
            if rec.token.to_string() != job.handle {
                return Ok(()); // no longer ours: the lease ran out and someone else holds it
            }
            let new = f(rec).map(|r| encode(&r)).transpose()?;
            if self
                .jobs
                .compare_and_swap(&key, Some(&v), new)
                .map_err(backend_err)?
                .is_ok()
            {
                self.job_ready.notify_one();
                return Ok(());
            }
        }
    }
}

/// Whether the job under key `k` (`pool \0 session`) is of a session `want` accepts.
fn job_wanted(k: &[u8], pool: &str, want: &SessionFilter) -> bool {
    k.get(pool.len() + 1..)
        .and_then(|s| std::str::from_utf8(s).ok())
        .and_then(|s| SessionId::parse(s).ok())
        .is_some_and(|s| want(&s))
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(v).map_err(|e| Error::Corrupt(e.to_string()))
}

fn decode<'a, T: Deserialize<'a>>(b: &'a [u8]) -> Result<T> {
    rmp_serde::from_slice(b).map_err(|e| Error::Corrupt(e.to_string()))
}

#[async_trait]
impl EventLog for SledStore {
    async fn append(&self, session: &SessionId, expected_last: u64, record: &Record) -> Result<()> {
        self.append_batch(session, expected_last, std::slice::from_ref(record))
            .await
    }

    async fn append_batch(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        for (i, r) in records.iter().enumerate() {
            let seq = expected_last + 1 + i as u64;
            if r.env.seq != seq || &r.env.session != session {
                return Err(Error::Corrupt(format!(
                    "record {}#{} appended as {session}#{seq}",
                    r.env.session, r.env.seq
                )));
            }
        }
        if records.is_empty() {
            return Ok(());
        }
        let skey = session.as_str().as_bytes();
        let last_seq = expected_last + records.len() as u64;
        let res = (&self.sessions, &self.events).transaction(|(sessions, events)| {
            let last = sessions.get(skey)?.map(|v| u64_of(&v)).unwrap_or(0);
            if last != expected_last {
                return Err(ConflictableTransactionError::Abort(last));
            }
            sessions.insert(skey, &last_seq.to_be_bytes())?;
            for r in records {
                events.insert(event_key(session, r.env.seq), r.bytes.as_slice())?;
            }
            Ok(())
        });
        match res {
            Ok(()) => self.flusher.durable().await,
            Err(TransactionError::Abort(actual)) => Err(Error::Conflict {
                session: session.to_string(),
                expected: expected_last,
                actual,
            }),
            Err(TransactionError::Storage(e)) => Err(backend_err(e)),
        }
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        let start = event_key(session, from_seq.max(1));
        let end = event_key(session, u64::MAX);
        let mut out = vec![];
        for item in self.events.range(start..=end) {
            let (_, v) = item.map_err(backend_err)?;
            out.push(Record::decode(v.to_vec()).map_err(|e| Error::Corrupt(e.to_string()))?);
        }
        Ok(out)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        let start = event_key(session, 1);
        let end = event_key(session, u64::MAX);
        match self.events.range(start..=end).next_back() {
            None => Ok(None),
            Some(item) => {
                let (_, v) = item.map_err(backend_err)?;
                Ok(Some(
                    Record::decode(v.to_vec()).map_err(|e| Error::Corrupt(e.to_string()))?,
                ))
            }
        }
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for item in self.sessions.scan_prefix(root.as_str().as_bytes()) {
            let (k, _) = item.map_err(backend_err)?;
            let id = std::str::from_utf8(&k).map_err(|e| Error::Corrupt(e.to_string()))?;
            let id = SessionId::parse(id)?;
            if root.contains(&id) {
                out.push(id);
            }
        }
        Ok(out)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for item in self.sessions.iter() {
            let (k, _) = item.map_err(backend_err)?;
            if !k.contains(&b'.') {
                let id = std::str::from_utf8(&k).map_err(|e| Error::Corrupt(e.to_string()))?;
                out.push(SessionId::parse(id)?);
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl JobQueue for SledStore {
    async fn push(&self, pool: &str, session: &SessionId) -> Result<()> {
        let key = Self::job_key(pool, session);
        self.jobs
            .fetch_and_update(&key, |old| {
                let rec = match old.and_then(|v| rmp_serde::from_slice::<JobRec>(v).ok()) {
                    None => JobRec {
                        held_until: None,
                        not_before: 0,
                        attempt: 0,
                        token: 0,
                        dirty: false,
                    },
                    Some(mut r) => {
                        if r.held_until.is_some() {
                            r.dirty = true;
                        }
                        r
                    }
                };
                rmp_serde::to_vec_named(&rec).ok()
            })
            .map_err(backend_err)?;
        self.job_ready.notify_one();
        Ok(())
    }

    async fn claim(&self, pool: &str, lease: Duration, wait: Duration) -> Result<Option<Job>> {
        self.claim_where(pool, lease, wait, None).await
    }

    async fn claim_matching(
        &self,
        pool: &str,
        lease: Duration,
        wait: Duration,
        want: &SessionFilter,
    ) -> Result<Option<Job>> {
        self.claim_where(pool, lease, wait, Some(want)).await
    }

    async fn depth_matching(&self, pool: &str, want: &SessionFilter) -> Result<u64> {
        let mut n = 0;
        for item in self.jobs.scan_prefix(prefix(pool)) {
            let (k, _) = item.map_err(backend_err)?;
            n += u64::from(job_wanted(&k, pool, want));
        }
        Ok(n)
    }

    async fn heartbeat(&self, job: &Job) -> Result<()> {
        // Extend by the same lease the claim used: leases are held by the caller's cadence.
        self.update_held(job, |mut r| {
            let len = r
                .held_until
                .map(|u| u.saturating_sub(now_ms()))
                .unwrap_or(0)
                .max(30_000);
            r.held_until = Some(now_ms() + len);
            Some(r)
        })
    }

    async fn ack(&self, job: &Job) -> Result<()> {
        self.update_held(job, |r| {
            r.dirty.then_some(JobRec {
                held_until: None,
                not_before: 0,
                attempt: 0,
                token: 0,
                dirty: false,
            })
        })
    }

    async fn retry(&self, job: &Job, delay: Duration) -> Result<()> {
        self.update_held(job, |mut r| {
            r.held_until = None;
            r.not_before = now_ms() + delay.as_millis() as u64;
            r.dirty = false;
            Some(r)
        })
    }

    async fn depth(&self, pool: &str) -> Result<u64> {
        Ok(self.jobs.scan_prefix(prefix(pool)).count() as u64)
    }
}

#[async_trait]
impl Cache for SledStore {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        let Some(v) = self.cache.get(hash.as_bytes()).map_err(backend_err)? else {
            return Ok(None);
        };
        let e: CacheEntry = decode(&v)?;
        if e.expires.is_some_and(|x| x <= now) {
            return Ok(None);
        }
        Ok(Some(e))
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        self.cache
            .insert(hash.as_bytes(), encode(entry)?)
            .map_err(backend_err)?;
        self.flusher.durable().await
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        let me = session.as_str().as_bytes();
        match self
            .inflight
            .compare_and_swap(hash.as_bytes(), None as Option<&[u8]>, Some(me))
            .map_err(backend_err)?
        {
            Ok(()) => Ok(None),
            Err(cur) => match cur.current {
                Some(v) if v.as_ref() != me => {
                    let id = std::str::from_utf8(&v).map_err(|e| Error::Corrupt(e.to_string()))?;
                    Ok(Some(SessionId::parse(id)?))
                }
                _ => Ok(None),
            },
        }
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        let me = session.as_str().as_bytes();
        let _ = self
            .inflight
            .compare_and_swap(hash.as_bytes(), Some(me), None as Option<&[u8]>)
            .map_err(backend_err)?;
        Ok(())
    }
}

#[async_trait]
impl Blobs for SledStore {
    async fn put(&self, data: &[u8]) -> Result<String> {
        let hash = blake3::hash(data).to_hex().to_string();
        if !self
            .blobs
            .contains_key(hash.as_bytes())
            .map_err(backend_err)?
        {
            self.blobs
                .insert(hash.as_bytes(), data)
                .map_err(backend_err)?;
            self.flusher.durable().await?;
        }
        Ok(hash)
    }

    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>> {
        Ok(self
            .blobs
            .get(hash.as_bytes())
            .map_err(backend_err)?
            .map(|v| v.to_vec()))
    }
}

#[async_trait]
impl Notices for SledStore {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        let _order = self.notice_order.lock().unwrap_or_else(|p| p.into_inner());
        let pos = self.db.generate_id().map_err(backend_err)? + 1;
        let mut k = prefix(parent.as_str());
        k.extend_from_slice(&pos.to_be_bytes());
        self.notices
            .insert(k, child.as_str().as_bytes())
            .map_err(backend_err)?;
        Ok(())
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        let mut start = prefix(parent.as_str());
        start.extend_from_slice(&(after.saturating_add(1)).to_be_bytes());
        let mut end = prefix(parent.as_str());
        end.extend_from_slice(&u64::MAX.to_be_bytes());
        let mut out = vec![];
        for item in self.notices.range(start..=end) {
            let (k, v) = item.map_err(backend_err)?;
            let pos = u64_of(&k[k.len() - 8..]);
            let child = std::str::from_utf8(&v).map_err(|e| Error::Corrupt(e.to_string()))?;
            out.push((pos, SessionId::parse(child)?));
        }
        Ok(out)
    }

    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()> {
        let mut k = prefix(target.as_str());
        k.extend_from_slice(watcher.as_str().as_bytes());
        self.watchers
            .insert(k, pool.as_bytes())
            .map_err(backend_err)?;
        self.flusher.durable().await
    }

    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>> {
        let p = prefix(target.as_str());
        let mut out = vec![];
        for item in self.watchers.scan_prefix(&p) {
            let (k, v) = item.map_err(backend_err)?;
            let w =
                std::str::from_utf8(&k[p.len()..]).map_err(|e| Error::Corrupt(e.to_string()))?;
            let pool = String::from_utf8(v.to_vec()).map_err(|e| Error::Corrupt(e.to_string()))?;
            out.push((SessionId::parse(w)?, pool));
        }
        Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn conformance() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path(), &dir.path().join("ws")).unwrap();
        crate::conformance::run_all(&store.backend()).await.unwrap();
    }

    #[tokio::test]
    async fn a_second_opener_is_refused_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let _a = SledStore::open(dir.path(), dir.path()).unwrap();
        let e = SledStore::open(dir.path(), dir.path())
            .err()
            .expect("second open refused");
        assert!(
            e.to_string().contains("is in use by another skein process"),
            "{e}"
        );
        assert!(
            e.to_string().contains(&dir.path().display().to_string()),
            "{e}"
        );
    }
}
