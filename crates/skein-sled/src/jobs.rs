//! The job queue: one record per (pool, session) — ready, or held under a lease with a
//! token that only its holder's ack, heartbeat or retry may change; a push while held
//! marks it dirty, and the ack then makes it ready again instead of removing it.
//!
//! The records are the truth; an index in memory orders every job of a pool by when it
//! may next be claimed (now for a ready job, the end of its delay or of its lease
//! otherwise), so a claim takes the first due job in O(log n) instead of reading the whole
//! queue, and a pool's depth is a count. One process holds the database (its lock), and
//! every change of a job record is made under the index's lock, so the two always agree.

use std::collections::{BTreeSet, HashMap};
use std::sync::MutexGuard;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use skein_core::SessionId;
use skein_ports::ports::{Job, JobQueue, SessionFilter, WaitingForRoom};
use skein_ports::{now_ms, Error, Result};

use crate::{backend_err, decode, encode, prefix, SledStore};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct JobRec {
    held_until: Option<u64>,
    not_before: u64,
    attempt: u32,
    token: u64,
    dirty: bool,
}

impl JobRec {
    fn ready() -> Self {
        JobRec {
            held_until: None,
            not_before: 0,
            attempt: 0,
            token: 0,
            dirty: false,
        }
    }

    /// When the job may next be claimed (ms since the epoch).
    fn due(&self) -> u64 {
        self.held_until.unwrap_or(self.not_before)
    }
}

/// Every job of every pool, by when it is due.
#[derive(Default)]
pub(crate) struct JobIndex {
    pools: HashMap<String, PoolJobs>,
}

#[derive(Default)]
struct PoolJobs {
    due: HashMap<SessionId, u64>,
    order: BTreeSet<(u64, SessionId)>,
}

impl PoolJobs {
    fn set(&mut self, session: &SessionId, due: Option<u64>) {
        if let Some(old) = self.due.remove(session) {
            self.order.remove(&(old, session.clone()));
        }
        if let Some(d) = due {
            self.due.insert(session.clone(), d);
            self.order.insert((d, session.clone()));
        }
    }
}

impl JobIndex {
    fn set(&mut self, pool: &str, session: &SessionId, rec: Option<&JobRec>) {
        match (self.pools.get_mut(pool), rec) {
            (Some(p), _) => p.set(session, rec.map(JobRec::due)),
            (None, Some(r)) => self
                .pools
                .entry(pool.to_string())
                .or_default()
                .set(session, Some(r.due())),
            (None, None) => {}
        }
    }
}

impl SledStore {
    fn job_index(&self) -> MutexGuard<'_, JobIndex> {
        self.job_index
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every session with a job in any pool.
    pub(crate) fn queued_sessions(&self) -> Vec<SessionId> {
        self.job_index()
            .pools
            .values()
            .flat_map(|p| p.due.keys().cloned())
            .collect()
    }

    /// Builds the index from the records. sled allows one process per database, so any
    /// lease found at open belongs to a process that is gone: it is released.
    pub(crate) fn index_jobs(&self) -> Result<()> {
        let mut idx = self.job_index();
        for item in self.jobs.iter() {
            let (k, v) = item.map_err(backend_err)?;
            let Some((pool, session)) = split_key(&k) else {
                continue;
            };
            let Ok(mut rec) = rmp_serde::from_slice::<JobRec>(&v) else {
                continue;
            };
            if rec.held_until.is_some() {
                rec.held_until = None;
                rec.not_before = 0;
                self.jobs.insert(&k, encode(&rec)?).map_err(backend_err)?;
            }
            idx.set(pool, &session, Some(&rec));
        }
        Ok(())
    }

    fn job_key(pool: &str, session: &SessionId) -> Vec<u8> {
        let mut k = prefix(pool);
        k.extend_from_slice(session.as_str().as_bytes());
        k
    }

    /// Writes (or removes) a job record and its place in the index, under the index lock.
    fn put_job(
        &self,
        idx: &mut JobIndex,
        pool: &str,
        session: &SessionId,
        rec: Option<&JobRec>,
    ) -> Result<()> {
        let key = Self::job_key(pool, session);
        match rec {
            Some(r) => self.jobs.insert(key, encode(r)?).map(drop),
            None => self.jobs.remove(key).map(drop),
        }
        .map_err(backend_err)?;
        idx.set(pool, session, rec);
        Ok(())
    }

    fn read_job(&self, pool: &str, session: &SessionId) -> Result<Option<JobRec>> {
        self.jobs
            .get(Self::job_key(pool, session))
            .map_err(backend_err)?
            .map(|v| decode(&v))
            .transpose()
    }

    /// Claims the first due job of `pool` that `want` accepts, or tells when the next one
    /// is due.
    fn try_claim(
        &self,
        pool: &str,
        want: Option<&SessionFilter>,
    ) -> Result<Result<Job, Option<u64>>> {
        let now = now_ms();
        let mut idx = self.job_index();
        let Some(jobs) = idx.pools.get(pool) else {
            return Ok(Err(None));
        };
        let mut first_due = None;
        let mut pick = None;
        for (due, session) in &jobs.order {
            if *due > now {
                first_due = Some(first_due.map_or(*due, |f: u64| f.min(*due)));
                break;
            }
            if want.is_none_or(|w| w(session)) {
                pick = Some(session.clone());
                break;
            }
        }
        let Some(session) = pick else {
            return Ok(Err(first_due));
        };
        let Some(rec) = self.read_job(pool, &session)? else {
            return Err(Error::corrupt_because(format!(
                "job of {session} in pool {pool} is indexed but has no record"
            )));
        };
        let token = self.db.generate_id().map_err(backend_err)?;
        let new = JobRec {
            held_until: Some(now + self.lease.as_millis() as u64),
            not_before: 0,
            attempt: rec.attempt + 1,
            token,
            dirty: rec.dirty && rec.held_until.is_some(),
        };
        self.put_job(&mut idx, pool, &session, Some(&new))?;
        Ok(Ok(Job {
            pool: pool.to_string(),
            session,
            attempt: new.attempt,
            handle: token.to_string(),
            lease: None,
        }))
    }

    async fn claim_where(
        &self,
        pool: &str,
        wait: Duration,
        want: Option<&SessionFilter>,
    ) -> Result<Option<Job>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.job_ready.notified();
            let next_due = match self.try_claim(pool, want)? {
                Ok(j) => return Ok(Some(j)),
                Err(next) => next,
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // Wake on a push or an ack, when the next delay or lease runs out, or at the
            // latest after a while.
            let mut nap = (deadline - now).min(Duration::from_millis(100));
            if let Some(due) = next_due {
                nap = nap.min(Duration::from_millis(due.saturating_sub(now_ms()).max(1)));
            }
            let _ = tokio::time::timeout(nap, notified).await;
        }
    }

    /// Updates a job record with `f` if it is still held under `handle`; else fails with
    /// [`not_held`].
    fn update_held(&self, job: &Job, f: impl Fn(JobRec) -> Option<JobRec>) -> Result<()> {
        let mut idx = self.job_index();
        let Some(rec) = self.read_job(&job.pool, &job.session)? else {
            return Err(not_held(job));
        };
        if rec.token.to_string() != job.handle {
            // No longer ours: the lease ran out and someone else holds it.
            return Err(not_held(job));
        }
        let new = f(rec);
        self.put_job(&mut idx, &job.pool, &job.session, new.as_ref())?;
        drop(idx);
        self.job_ready.notify_one();
        Ok(())
    }
}

/// A heartbeat, ack or retry of a job this queue does not hold under that claim.
fn not_held(job: &Job) -> Error {
    Error::NotFound(format!(
        "job of {} in pool {} (attempt {}) is not held: never claimed, or its lease ran out \
         and it was claimed again",
        job.session, job.pool, job.attempt
    ))
}

/// The pool and session of a job key (`pool \0 session`).
fn split_key(k: &[u8]) -> Option<(&str, SessionId)> {
    let at = k.iter().position(|b| *b == 0)?;
    let pool = std::str::from_utf8(&k[..at]).ok()?;
    let session = std::str::from_utf8(&k[at + 1..]).ok()?;
    Some((pool, SessionId::parse(session).ok()?))
}

#[async_trait]
impl JobQueue for SledStore {
    async fn push(&self, pool: &str, session: &SessionId) -> Result<()> {
        {
            let mut idx = self.job_index();
            let rec = match self.read_job(pool, session)? {
                None => JobRec::ready(),
                Some(mut r) => {
                    if r.held_until.is_some() {
                        r.dirty = true;
                    }
                    r
                }
            };
            self.put_job(&mut idx, pool, session, Some(&rec))?;
        }
        self.job_ready.notify_one();
        Ok(())
    }

    async fn claim(&self, pool: &str, wait: Duration) -> Result<Option<Job>> {
        self.claim_where(pool, wait, None).await
    }

    async fn claim_matching(
        &self,
        pool: &str,
        wait: Duration,
        want: &SessionFilter,
    ) -> Result<Option<Job>> {
        self.claim_where(pool, wait, Some(want)).await
    }

    /// One process holds the store: no other reader to show a wait to.
    async fn set_waiting_for_room(&self, _: &WaitingForRoom) -> Result<()> {
        Ok(())
    }

    async fn clear_waiting_for_room(&self, _: &SessionId) -> Result<()> {
        Ok(())
    }

    async fn waiting_for_room(&self) -> Result<Vec<WaitingForRoom>> {
        Ok(vec![])
    }

    async fn depth_matching(&self, pool: &str, want: &SessionFilter) -> Result<u64> {
        let idx = self.job_index();
        Ok(idx
            .pools
            .get(pool)
            .map_or(0, |p| p.due.keys().filter(|s| want(s)).count()) as u64)
    }

    async fn heartbeat(&self, job: &Job) -> Result<()> {
        // A heartbeat holds the job for a whole lease again, from now.
        let lease = self.lease.as_millis() as u64;
        self.update_held(job, |mut r| {
            r.held_until = Some(now_ms() + lease);
            Some(r)
        })
    }

    async fn ack(&self, job: &Job) -> Result<()> {
        self.update_held(job, |r| r.dirty.then(JobRec::ready))
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
        let idx = self.job_index();
        Ok(idx.pools.get(pool).map_or(0, |p| p.due.len()) as u64)
    }
}
