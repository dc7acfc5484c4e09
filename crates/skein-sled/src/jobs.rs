//! The job queue: one record per (pool, session) — ready, or held under a lease with a
//! token that only its holder's ack, heartbeat or retry may change; a push while held
//! marks it dirty, and the ack then makes it ready again instead of removing it.
//!
//! Jobs are soft state: everything about them can be derived from the logs (`resume`
//! re-enqueues every unfinished session), so they live in memory, and the sled tree `jobs`
//! holds only what the store handed on when it was last left or dropped: every job, when a
//! job was left for a session that had not ended (an interrupted run, a paused session's
//! deadline), for the next process to take. Opening reads that tree back. A crash hands on
//! nothing newer, and `resume` derives the jobs as after any crash.
//!
//! An index orders every job of a pool by when it may next be claimed (now for a ready
//! job, the end of its delay or of its lease otherwise), so a claim takes the first due
//! job in O(log n) instead of reading the whole queue, and a pool's depth is a count. One
//! process holds the store (its lock), and every change of a job is made under the
//! index's lock.

use std::collections::{BTreeSet, HashMap};
use std::sync::MutexGuard;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use skein_core::SessionId;
use skein_ports::ports::{Job, JobQueue, SessionFilter, WaitingForRoom};
use skein_ports::{now_ms, Error, Result};

use crate::{backend_err, encode, prefix, SledStore};

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
    /// The last lease token given out.
    token: u64,
}

#[derive(Default)]
struct PoolJobs {
    jobs: HashMap<SessionId, JobRec>,
    order: BTreeSet<(u64, SessionId)>,
}

impl PoolJobs {
    fn set(&mut self, session: &SessionId, rec: Option<&JobRec>) {
        if let Some(old) = self.jobs.remove(session) {
            self.order.remove(&(old.due(), session.clone()));
        }
        if let Some(r) = rec {
            self.jobs.insert(session.clone(), r.clone());
            self.order.insert((r.due(), session.clone()));
        }
    }
}

impl JobIndex {
    fn set(&mut self, pool: &str, session: &SessionId, rec: Option<&JobRec>) {
        match (self.pools.get_mut(pool), rec) {
            (Some(p), _) => p.set(session, rec),
            (None, Some(_)) => self
                .pools
                .entry(pool.to_string())
                .or_default()
                .set(session, rec),
            (None, None) => {}
        }
    }

    fn get(&self, pool: &str, session: &SessionId) -> Option<&JobRec> {
        self.pools.get(pool)?.jobs.get(session)
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
            .flat_map(|p| p.jobs.keys().cloned())
            .collect()
    }

    /// Reads back the jobs the last process handed on. One process holds the store, so
    /// any lease found belongs to a process that is gone: it is released.
    pub(crate) fn index_jobs(&self) -> Result<()> {
        let Some(sled) = self.sled.get() else {
            // Never flushed: nothing was handed on.
            return Ok(());
        };
        let mut idx = self.job_index();
        for item in sled.jobs.iter() {
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
            }
            idx.set(pool, &session, Some(&rec));
        }
        Ok(())
    }

    /// Writes every job into the tree `jobs`, in place of what it held, for the next
    /// process (one batch: the tree holds the old hand-over or the new one). Not flushed
    /// here: the caller flushes the database.
    pub(crate) fn hand_on_jobs(&self) -> Result<()> {
        let idx = self.job_index();
        if idx.pools.values().all(|p| p.jobs.is_empty()) && self.sled.get().is_none() {
            // No job to hand on, and none was handed on before (or sled would be open).
            return Ok(());
        }
        let jobs = &self.sled.open()?.jobs;
        let mut batch = sled::Batch::default();
        for item in jobs.iter() {
            let (k, _) = item.map_err(backend_err)?;
            let kept = split_key(&k).is_some_and(|(pool, s)| idx.get(pool, &s).is_some());
            if !kept {
                batch.remove(k);
            }
        }
        for (pool, p) in &idx.pools {
            for (session, rec) in &p.jobs {
                batch.insert(Self::job_key(pool, session), encode(rec)?);
            }
        }
        jobs.apply_batch(batch).map_err(backend_err)
    }

    fn job_key(pool: &str, session: &SessionId) -> Vec<u8> {
        let mut k = prefix(pool);
        k.extend_from_slice(session.as_str().as_bytes());
        k
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
        let Some(rec) = idx.get(pool, &session).cloned() else {
            return Err(Error::corrupt_because(format!(
                "job of {session} in pool {pool} is indexed but has no record"
            )));
        };
        idx.token += 1;
        let token = idx.token;
        let new = JobRec {
            held_until: Some(now + self.lease.as_millis() as u64),
            not_before: 0,
            attempt: rec.attempt + 1,
            token,
            dirty: rec.dirty && rec.held_until.is_some(),
        };
        idx.set(pool, &session, Some(&new));
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
        let Some(rec) = idx.get(&job.pool, &job.session).cloned() else {
            return Err(not_held(job));
        };
        if rec.token.to_string() != job.handle {
            // No longer ours: the lease ran out and someone else holds it.
            return Err(not_held(job));
        }
        let new = f(rec);
        idx.set(&job.pool, &job.session, new.as_ref());
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
            let rec = match idx.get(pool, session).cloned() {
                None => JobRec::ready(),
                Some(mut r) => {
                    if r.held_until.is_some() {
                        r.dirty = true;
                    }
                    r
                }
            };
            idx.set(pool, session, Some(&rec));
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
            .map_or(0, |p| p.jobs.keys().filter(|s| want(s)).count()) as u64)
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
        Ok(idx.pools.get(pool).map_or(0, |p| p.jobs.len()) as u64)
    }
}

#[cfg(test)]
mod tests {
    use skein_ports::ports::JobQueue;

    use crate::SledStore;

    fn sid(s: &str) -> skein_core::SessionId {
        skein_core::SessionId::root(s).expect("a session id")
    }

    #[tokio::test]
    async fn jobs_live_in_memory_and_only_a_hand_over_writes_them() {
        // Given a store with jobs pushed, claimed and acked.
        let dir = tempfile::tempdir().expect("a temporary directory");
        let open = || SledStore::open(&dir.path().join("data"), &dir.path().join("ws"));
        let s = open().expect("opens");
        for n in ["a", "b", "c"] {
            s.push("default", &sid(&format!("s-{n}")))
                .await
                .expect("push");
        }
        let done = s
            .claim("default", std::time::Duration::ZERO)
            .await
            .expect("claim")
            .expect("a job");
        s.ack(&done).await.expect("ack");

        // Then nothing of them is in sled until the store hands them on, and what it hands
        // on is what the queue holds: every job but the acked one.
        assert!(!s.sled_opened(), "a job change was written to sled");
        assert_eq!(s.depth("default").await.expect("depth"), 2);
        drop(s);
        let s = open().expect("opens again");
        assert_eq!(
            s.sled.get().expect("sled holds the hand-over").jobs.len(),
            2
        );
        assert_eq!(s.depth("default").await.expect("depth"), 2);
        let left = s.queued_sessions();
        assert!(!left.contains(&done.session), "{left:?}");

        // And a hand-over replaces the one before it rather than adding to it.
        let next = s
            .claim("default", std::time::Duration::ZERO)
            .await
            .expect("claim")
            .expect("a job");
        s.ack(&next).await.expect("ack");
        s.hand_on_jobs().expect("hand on");
        assert_eq!(s.sled.get().expect("sled is open").jobs.len(), 1);
    }
}
