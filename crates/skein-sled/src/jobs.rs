//! The job queue: one record per (pool, session) — ready, or held under a lease with a
//! token that only its holder's ack, heartbeat or retry may change; a push while held
//! marks it dirty, and the ack then makes it ready again instead of removing it.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use skein_core::SessionId;
use skein_runtime::ports::{Job, JobQueue, SessionFilter};
use skein_runtime::{now_ms, Error, Result};

use crate::{backend_err, decode, encode, prefix, SledStore};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct JobRec {
    held_until: Option<u64>,
    not_before: u64,
    attempt: u32,
    token: u64,
    dirty: bool,
}

impl SledStore {
    /// sled allows one process per database, so any lease found at open belongs to a
    /// process that is gone.
    pub(crate) fn release_stale_leases(&self) -> Result<()> {
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

    fn job_key(pool: &str, session: &SessionId) -> Vec<u8> {
        let mut k = prefix(pool);
        k.extend_from_slice(session.as_str().as_bytes());
        k
    }

    fn try_claim(&self, pool: &str, want: Option<&SessionFilter>) -> Result<Option<Job>> {
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
                held_until: Some(now + self.lease.as_millis() as u64),
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
                .map_err(|e| Error::corrupt("job key", e))?;
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
        wait: Duration,
        want: Option<&SessionFilter>,
    ) -> Result<Option<Job>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.job_ready.notified();
            if let Some(j) = self.try_claim(pool, want)? {
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

    async fn depth_matching(&self, pool: &str, want: &SessionFilter) -> Result<u64> {
        let mut n = 0;
        for item in self.jobs.scan_prefix(prefix(pool)) {
            let (k, _) = item.map_err(backend_err)?;
            n += u64::from(job_wanted(&k, pool, want));
        }
        Ok(n)
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
