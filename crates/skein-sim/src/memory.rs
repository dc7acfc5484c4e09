//! Every port in memory, on a virtual clock: the simulation's backend. Same contracts as
//! the sled and JetStream backends (the conformance suite runs against it), plus faults
//! a seed chooses: appends whose acknowledgement is lost (the write is made, the writer
//! sees a conflict), pipelined appends refused (the writer hears it at its next append
//! or job ack), a backend that is unreachable, notices lost or posted twice, job pushes,
//! appends and reads that take virtual time (a slow read's answer may be older than what
//! was written while it came back).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{Record, SessionId};
use skein_runtime::ports::{
    Announcer, Backend, Blobs, Cache, CacheEntry, Capabilities, Durability, EventLog, Job,
    JobQueue, NoticeRead, Notices, RootResult, SessionFilter, WaitingForRoom, Workspaces,
};
use skein_runtime::{Error, Result};
use skein_tools::{LocalWorkspace, Workspace};
use tokio::sync::Notify;

use crate::disk::Disk;
use crate::faults::Faults;

#[derive(Debug, Clone)]
struct JobRec {
    /// Virtual ms until which the job is held (a lease), if it is.
    held_until: Option<u64>,
    not_before: u64,
    attempt: u32,
    token: u64,
    dirty: bool,
}

impl JobRec {
    fn due(&self) -> u64 {
        self.held_until.unwrap_or(self.not_before)
    }
}

#[derive(Default)]
struct Inner {
    logs: BTreeMap<SessionId, Vec<Record>>,
    jobs: BTreeMap<String, BTreeMap<SessionId, JobRec>>,
    cache: HashMap<String, CacheEntry>,
    inflight: HashMap<String, SessionId>,
    blobs: HashMap<String, Vec<u8>>,
    /// Each parent's notices: position, child, and the child's end when the notice
    /// carries it (as NATS notices do).
    notices: HashMap<SessionId, Vec<NoticeRead>>,
    watchers: HashMap<SessionId, Vec<(SessionId, String)>>,
    /// Each root's endings as announced, in the order stored (as `SKEIN_RESULTS` keeps
    /// them: an ending already stored, or an earlier one, is dropped).
    results: BTreeMap<SessionId, Vec<RootResult>>,
    /// Sessions whose last pipelined append was refused, and the seq its writer expects
    /// to follow on from: their writer has not heard yet.
    refused: HashMap<SessionId, u64>,
    /// Cache reads that found an entry past its time to live (and so missed).
    expired_reads: u64,
    /// Sessions whose job was acked as ended for good (`ack_final`): as on NATS, where
    /// that job's message stays, every later push for them is dropped.
    finished_jobs: HashSet<SessionId>,
    /// Pushes dropped so.
    dropped_pushes: u64,
    /// How many times each session's job was claimed, over the whole run.
    claims: HashMap<SessionId, u64>,
}

/// The in-memory store. Time is `tokio::time`'s, which a paused runtime advances only
/// when every task waits: leases and delays run out in virtual time.
pub struct MemStore {
    inner: Mutex<Inner>,
    job_ready: Notify,
    lease: Duration,
    t0: tokio::time::Instant,
    next: AtomicU64,
    faults: Arc<Faults>,
    workspaces: PathBuf,
    /// Itself, for the tasks that deliver late notices.
    me: std::sync::Weak<MemStore>,
    /// The disk under the log, when the seed's faults include a disk's (see `disk.rs`).
    disk: Option<Arc<Disk>>,
    /// Claimers woken at once take turns in a shifting order (see
    /// [`MemStore::shuffle_claims`]); 0: in the timer's order.
    shuffle: AtomicU64,
    /// How many times the process restarted on the disk ([`MemStore::reopen`]): a late
    /// notice posted in an earlier life is not delivered.
    life: AtomicU64,
}

impl MemStore {
    pub fn new(lease: Duration, faults: Arc<Faults>, workspaces: PathBuf) -> Arc<Self> {
        Self::on_disk(lease, faults, workspaces, None)
    }

    /// A store whose log lies on `disk` (none: appends are durable once made).
    pub fn on_disk(
        lease: Duration,
        faults: Arc<Faults>,
        workspaces: PathBuf,
        disk: Option<Arc<Disk>>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            inner: Mutex::new(Inner::default()),
            job_ready: Notify::new(),
            lease,
            t0: tokio::time::Instant::now(),
            next: AtomicU64::new(1),
            faults,
            workspaces,
            me: me.clone(),
            disk,
            shuffle: AtomicU64::new(0),
            life: AtomicU64::new(0),
        })
    }

    /// Claimers woken at the same instant no longer claim in the order of their timers,
    /// which would let one worker win a job it hands back every time (a JetStream
    /// consumer serves waiting pulls in the order they came): each yields a varying
    /// number of turns first.
    pub fn shuffle_claims(&self) {
        self.shuffle.store(1, Ordering::Relaxed);
    }

    pub fn backend(self: &Arc<Self>) -> Backend {
        Backend {
            name: "memory",
            log: self.clone(),
            jobs: self.clone(),
            cache: self.clone(),
            blobs: self.clone(),
            notices: self.clone(),
            workspaces: self.clone(),
            announcer: Some(self.clone()),
            quota: None,
            capabilities: Capabilities {
                notices_in_step_with_wakes: false,
                notices_outlive_workers: false,
                claim_matching: true,
            },
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Virtual ms since the store was made.
    fn now(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    fn id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Fails the call when the seed says the backend is unreachable now.
    fn reach(&self, what: &str) -> Result<()> {
        if self.faults.unreachable() {
            return Err(Error::unavailable_because(format!(
                "memory: {what}: the backend is unreachable (simulated)"
            )));
        }
        Ok(())
    }

    /// A read served by `serve`, late when the seed makes it slow: it waits before it is
    /// served and again before its answer arrives, so that what it returns may be older
    /// than what others have written meanwhile, as a reply on its way back from a server
    /// is.
    async fn served<T>(&self, serve: impl FnOnce(&mut Inner) -> T) -> T {
        let slow = self.faults.read_delay();
        if let Some((before, _)) = slow {
            tokio::time::sleep(before).await;
        }
        let answer = serve(&mut self.lock());
        if let Some((_, after)) = slow {
            tokio::time::sleep(after).await;
        }
        answer
    }

    /// The disk under the log, if it has one.
    pub fn disk(&self) -> Option<&Arc<Disk>> {
        self.disk.as_ref()
    }

    /// The process restarts on the disk: what it kept of the log, opened again (see
    /// [`Disk::reopen`]). The notices are lost with the process, as the embedded store's
    /// are (they live in its memory), and so are those still on their way: a notice may
    /// carry an end the disk did not keep (a cancel's record written, its sync failed),
    /// which no parent may settle from. Jobs, claims and watchers stay: they carry no
    /// record, and a parent heals from its children's logs when it is loaded cold. The
    /// announced endings are kept with the log, as if on the same disk: one whose record
    /// the disk did not keep goes with it (a worker read that record before its sync
    /// failed; the embedded store has no announcer, and on NATS the log and the results
    /// live on the same servers). So are cache entries made from a record the disk did
    /// not keep (a worker read its source's end before that sync failed): the embedded
    /// store takes out the entries no flush covered once a sync of its log fails.
    pub fn reopen(&self) {
        if let Some(disk) = &self.disk {
            let mut g = self.lock();
            disk.reopen(&mut g.logs);
            let Inner { logs, cache, .. } = &mut *g;
            cache.retain(|_, e| {
                logs.get(&e.source).is_some_and(|l| {
                    l.iter().any(|r| {
                        matches!(&r.env.body, skein_core::Event::Completed(c) if c.answer == e.answer)
                    })
                })
            });
            g.refused.clear();
            g.notices.clear();
            // A session whose end the disk did not keep is open again, and takes pushes:
            // its job's message left in place stood for that end. (The embedded store,
            // whose disk this is, leaves none; on NATS an end acked with every write
            // fsynced is kept, and one lost with the page cache is the loss of acked
            // writes the server's default sync accepts, docs/nats.md.)
            let Inner {
                logs,
                finished_jobs,
                ..
            } = &mut *g;
            finished_jobs.retain(|s| {
                logs.get(s)
                    .and_then(|l| l.last())
                    .is_some_and(|r| r.env.body.is_terminal())
            });
            let Inner { logs, results, .. } = &mut *g;
            for (root, stored) in results.iter_mut() {
                let log = logs.get(root);
                stored.retain(|r| {
                    log.and_then(|l| l.get((r.seq as usize).saturating_sub(1)))
                        .is_some_and(|rec| rec.env.seq == r.seq && rec.env.body.is_terminal())
                });
            }
            self.life.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many cache reads found an entry past its time to live.
    pub fn expired_reads(&self) -> u64 {
        self.lock().expired_reads
    }

    /// How many pushes were dropped for sessions whose job was acked as ended for good.
    pub fn dropped_pushes(&self) -> u64 {
        self.lock().dropped_pushes
    }

    /// The session whose job was claimed most often, and how often.
    pub fn most_claimed(&self) -> Option<(SessionId, u64)> {
        let g = self.lock();
        g.claims
            .iter()
            .max_by(|(s, n), (t, m)| n.cmp(m).then_with(|| t.cmp(s)))
            .map(|(s, n)| (s.clone(), *n))
    }

    /// Whether the session's log ends with a terminal event.
    pub fn ended(&self, session: &SessionId) -> bool {
        self.lock()
            .logs
            .get(session)
            .and_then(|l| l.last())
            .is_some_and(|r| r.env.body.is_terminal())
    }

    /// The job queue as it stands, one line a job (for a seed's report).
    pub fn jobs_report(&self) -> Vec<String> {
        let now = self.now();
        let g = self.lock();
        let mut out = vec![];
        for (pool, jobs) in &g.jobs {
            for (s, r) in jobs {
                out.push(format!(
                    "{pool}/{s}: held_until {:?} not_before {} attempt {} dirty {} (now {now})",
                    r.held_until, r.not_before, r.attempt, r.dirty
                ));
            }
        }
        out
    }

    /// Every log, for the invariants: session → records.
    pub fn logs(&self) -> BTreeMap<SessionId, Vec<Record>> {
        self.lock().logs.clone()
    }

    /// Every root's endings as announced, in the order stored.
    pub fn results(&self) -> BTreeMap<SessionId, Vec<RootResult>> {
        self.lock().results.clone()
    }

    /// Whether the ending `root`'s log ends with has been announced.
    pub fn announced(&self, root: &SessionId) -> bool {
        let g = self.lock();
        let Some(end) = g.logs.get(root).and_then(|l| l.last()) else {
            return false;
        };
        end.env.body.is_terminal()
            && g.results
                .get(root)
                .and_then(|r| r.last())
                .is_some_and(|r| r.seq == end.env.seq)
    }

    /// Appends `records` if the log ends at `expected_last`; on a disk, waits for a sync
    /// to cover them when `wait`.
    async fn append_written(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        wait: bool,
    ) -> Result<()> {
        self.reach("append")?;
        // Drawn (and counted) only for an append that writes something.
        let slow = (!records.is_empty())
            .then(|| self.faults.append_delay())
            .flatten();
        if let Some((before, _)) = slow {
            tokio::time::sleep(before).await;
        }
        let disk = self.disk.as_ref().filter(|_| !records.is_empty());
        if let Some(d) = disk {
            d.before_write()?;
        }
        // The lock is not held across the wait for the disk.
        let written = {
            let mut g = self.lock();
            g.refused.remove(session);
            let log = g.logs.entry(session.clone()).or_default();
            let actual = log.len() as u64;
            // As on NATS, whose condition names the stream sequence of the writer's own last
            // message: the log must end with the record the batch follows, not merely at its
            // seq (a writer whose pipelined append was refused, and whose refusal another
            // holder's ack heard, expects a record that is not there).
            let follows = match (log.last(), records.first()) {
                (Some(last), Some(first)) => first.env.prev == last.hash(),
                _ => true,
            };
            if actual != expected_last || !follows {
                if log.is_empty() {
                    g.logs.remove(session);
                }
                return Err(Error::Conflict {
                    session: session.to_string(),
                    expected: expected_last,
                    actual,
                });
            }
            log.extend(records.iter().cloned());
            let written = disk.map(|d| d.written(session, expected_last + 1, records));
            // A seeded fault: the write is made but its acknowledgement is lost, and the
            // writer's retry meets its own records as a conflict (what a JetStream publish
            // whose ack timed out sees when it is sent again). On a disk, the write is
            // synced before its answer is lost, as JetStream stores a message before it
            // acks it: a writer that reads its records back may take them as durable.
            let ack_lost = self.faults.conflict().then(|| Error::Conflict {
                session: session.to_string(),
                expected: expected_last,
                actual: log.len() as u64,
            });
            (written, ack_lost)
        };
        if let (Some(d), (Some(t), lost)) = (disk, &written) {
            if wait || lost.is_some() {
                d.durable(*t).await?;
            }
            if let (true, None, Some(last)) = (wait, lost, records.last()) {
                d.acked(*t, session, last);
            }
        }
        if let Some((_, after)) = slow {
            tokio::time::sleep(after).await;
        }
        match written.1 {
            Some(lost) => Err(lost),
            None => Ok(()),
        }
    }

    fn try_claim(
        &self,
        pool: &str,
        want: Option<&SessionFilter>,
    ) -> std::result::Result<Job, Option<u64>> {
        let now = self.now();
        let token = self.id();
        let lease = self.lease.as_millis() as u64;
        let mut g = self.lock();
        let Some(jobs) = g.jobs.get_mut(pool) else {
            return Err(None);
        };
        let mut first_due: Option<u64> = None;
        let mut pick: Option<(u64, SessionId)> = None;
        for (s, r) in jobs.iter() {
            let due = r.due();
            if due > now {
                first_due = Some(first_due.map_or(due, |f| f.min(due)));
                continue;
            }
            if want.is_none_or(|w| w(s)) && pick.as_ref().is_none_or(|(d, _)| due < *d) {
                pick = Some((due, s.clone()));
            }
        }
        let Some((_, session)) = pick else {
            return Err(first_due);
        };
        let Some(rec) = jobs.get_mut(&session) else {
            return Err(first_due);
        };
        rec.dirty = rec.dirty && rec.held_until.is_some();
        rec.held_until = Some(now + lease);
        rec.not_before = 0;
        rec.attempt += 1;
        rec.token = token;
        let attempt = rec.attempt;
        *g.claims.entry(session.clone()).or_default() += 1;
        Ok(Job {
            pool: pool.to_string(),
            session,
            attempt,
            handle: token.to_string(),
            lease: None,
        })
    }

    async fn claim_where(
        &self,
        pool: &str,
        wait: Duration,
        want: Option<&SessionFilter>,
    ) -> Result<Option<Job>> {
        self.reach("claim")?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.job_ready.notified();
            let next_due = match self.try_claim(pool, want) {
                Ok(j) => return Ok(Some(j)),
                Err(next) => next,
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let mut nap = deadline - now;
            if let Some(due) = next_due {
                nap = nap.min(Duration::from_millis(due.saturating_sub(self.now()).max(1)));
            }
            let _ = tokio::time::timeout(nap, notified).await;
            let turn = self.shuffle.load(Ordering::Relaxed);
            if turn > 0 {
                let n = self.shuffle.fetch_add(1, Ordering::Relaxed);
                for _ in 0..n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62 {
                    tokio::task::yield_now().await;
                }
            }
        }
    }

    /// A job whose pipelined append was refused is not acked: its lease runs out.
    fn refused_append(&self, job: &Job) -> Result<()> {
        let refused = self.lock().refused.remove(&job.session);
        if let Some(expected) = refused {
            let actual = self
                .lock()
                .logs
                .get(&job.session)
                .map_or(0, |l| l.len() as u64);
            return Err(Error::Conflict {
                session: job.session.to_string(),
                expected,
                actual,
            });
        }
        Ok(())
    }

    fn update_held(&self, job: &Job, f: impl Fn(&mut JobRec) -> bool) -> Result<()> {
        let not_held = || {
            Error::NotFound(format!(
                "job of {} in pool {} (attempt {}) is not held",
                job.session, job.pool, job.attempt
            ))
        };
        let mut g = self.lock();
        let Some(jobs) = g.jobs.get_mut(&job.pool) else {
            return Err(not_held());
        };
        let Some(rec) = jobs.get_mut(&job.session) else {
            return Err(not_held());
        };
        if rec.token.to_string() != job.handle {
            return Err(not_held()); // the lease ran out and someone else holds it
        }
        if !f(rec) {
            jobs.remove(&job.session);
        }
        drop(g);
        self.job_ready.notify_waiters();
        Ok(())
    }
}

#[async_trait]
impl EventLog for MemStore {
    /// [`Durability::Pipelined`] as on NATS: written at once, or (a seeded fault, drawn
    /// as a conflict: the publish was refused or lost) not at all, which the writer hears
    /// at the session's next append (whose expected seq the log does not end at) or at
    /// its job's ack. The other two are durable at once.
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()> {
        if durability == Durability::Pipelined
            && !records.is_empty()
            && self.faults.pipelined_refused()
        {
            let mut g = self.lock();
            g.refused
                .insert(session.clone(), expected_last + records.len() as u64);
            return Ok(());
        }
        // On the disk, records written ahead are not waited for, as on the embedded store
        // whose log is one file written in order: the sync of any later frame covers them.
        self.append_written(
            session,
            expected_last,
            records,
            durability != Durability::Ahead,
        )
        .await
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        self.reach("read")?;
        Ok(self
            .served(|g| {
                g.logs
                    .get(session)
                    .map(|l| {
                        l.iter()
                            .skip(from_seq.max(1) as usize - 1)
                            .cloned()
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .await)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        self.reach("last")?;
        Ok(self
            .served(|g| g.logs.get(session).and_then(|l| l.last().cloned()))
            .await)
    }

    /// The logs of two sessions or more read together, as the NATS store reads a wide
    /// tree, so that the simulation's worlds take the callers' one-pass paths (a cancel's
    /// and a sweep's kept folds, the readers of a whole tree) under its faults; one
    /// session is read log by log (`None`), so both paths are taken. Like NATS, the logs
    /// are not one snapshot: each is read as it stands at its turn, and other tasks may
    /// append between two of them. A fault fails the whole read.
    async fn read_tree(
        &self,
        _root: &SessionId,
        ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>> {
        self.reach("read_tree")?;
        if ids.len() < 2 {
            return Ok(None);
        }
        let mut logs = Vec::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                tokio::task::yield_now().await;
            }
            logs.push(
                self.served(|g| g.logs.get(id).cloned().unwrap_or_default())
                    .await,
            );
        }
        Ok(Some(logs))
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        self.reach("tree")?;
        Ok(self
            .served(|g| {
                g.logs
                    .keys()
                    .filter(|s| root.contains(s))
                    .cloned()
                    .collect()
            })
            .await)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        self.reach("roots")?;
        Ok(self
            .lock()
            .logs
            .keys()
            .filter(|s| !s.as_str().contains('.'))
            .cloned()
            .collect())
    }
}

#[async_trait]
impl JobQueue for MemStore {
    async fn push(&self, pool: &str, session: &SessionId) -> Result<()> {
        self.reach("push")?;
        if let Some(d) = self.faults.push_delay() {
            tokio::time::sleep(d).await;
        }
        {
            let mut g = self.lock();
            if g.finished_jobs.contains(session) {
                g.dropped_pushes += 1;
                return Ok(());
            }
            let jobs = g.jobs.entry(pool.to_string()).or_default();
            match jobs.get_mut(session) {
                Some(r) if r.held_until.is_some() => r.dirty = true,
                Some(_) => {}
                None => {
                    jobs.insert(
                        session.clone(),
                        JobRec {
                            held_until: None,
                            not_before: 0,
                            attempt: 0,
                            token: 0,
                            dirty: false,
                        },
                    );
                }
            }
        }
        self.job_ready.notify_waiters();
        Ok(())
    }

    async fn push_ended(&self, pool: &str, session: &SessionId) -> Result<()> {
        self.reach("push")?;
        self.lock().finished_jobs.remove(session);
        self.push(pool, session).await
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

    async fn heartbeat(&self, job: &Job) -> Result<()> {
        self.reach("heartbeat")?;
        if self.faults.heartbeat_lost() {
            return Ok(());
        }
        let until = self.now() + self.lease.as_millis() as u64;
        self.update_held(job, |r| {
            r.held_until = Some(until);
            true
        })
    }

    async fn ack(&self, job: &Job) -> Result<()> {
        self.reach("ack")?;
        self.refused_append(job)?;
        self.update_held(job, |r| {
            if !r.dirty {
                return false;
            }
            *r = JobRec {
                held_until: None,
                not_before: 0,
                attempt: 0,
                token: 0,
                dirty: false,
            };
            true
        })
    }

    /// As on NATS: the job goes, a push that came while it was held is dropped with it,
    /// and so is every later push for the session (see [`MemStore::reopen`] for a disk
    /// that loses the end).
    async fn ack_final(&self, job: &Job) -> Result<()> {
        self.reach("ack")?;
        self.refused_append(job)?;
        self.update_held(job, |_| false)?;
        self.lock().finished_jobs.insert(job.session.clone());
        Ok(())
    }

    async fn retry(&self, job: &Job, delay: Duration) -> Result<()> {
        self.reach("retry")?;
        self.lock().refused.remove(&job.session);
        let at = self.now() + delay.as_millis() as u64;
        self.update_held(job, |r| {
            r.held_until = None;
            r.not_before = at;
            r.dirty = false;
            true
        })
    }

    async fn depth(&self, pool: &str) -> Result<u64> {
        Ok(self.lock().jobs.get(pool).map_or(0, BTreeMap::len) as u64)
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
        Ok(self
            .lock()
            .jobs
            .get(pool)
            .map_or(0, |j| j.keys().filter(|s| want(s)).count()) as u64)
    }
}

#[async_trait]
impl Cache for MemStore {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        self.reach("cache get")?;
        Ok(self
            .served(|g| {
                let found = g.cache.get(hash).cloned();
                let live = found.filter(|e| e.expires.is_none_or(|x| x > now));
                if live.is_none() && g.cache.contains_key(hash) {
                    g.expired_reads += 1;
                }
                live
            })
            .await)
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        self.reach("cache put")?;
        self.lock().cache.insert(hash.to_string(), entry.clone());
        Ok(())
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        self.reach("inflight")?;
        let mut g = self.lock();
        match g.inflight.get(hash) {
            Some(other) if other != session => Ok(Some(other.clone())),
            _ => {
                g.inflight.insert(hash.to_string(), session.clone());
                Ok(None)
            }
        }
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        self.reach("inflight")?;
        let mut g = self.lock();
        if g.inflight.get(hash) == Some(session) {
            g.inflight.remove(hash);
        }
        Ok(())
    }
}

#[async_trait]
impl Blobs for MemStore {
    async fn put(&self, data: &[u8]) -> Result<String> {
        self.reach("blob put")?;
        let hash = blake3::hash(data).to_hex().to_string();
        self.lock().blobs.insert(hash.clone(), data.to_vec());
        Ok(hash)
    }

    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>> {
        self.reach("blob get")?;
        Ok(self.lock().blobs.get(hash).cloned())
    }
}

impl MemStore {
    async fn post_notice(
        &self,
        parent: &SessionId,
        child: &SessionId,
        end: Option<Record>,
    ) -> Result<()> {
        self.reach("notice")?;
        // A notice may be lost (the parent heals from its children's logs when it is
        // next loaded cold) or posted twice.
        let copies = self.faults.notice_copies();
        for _ in 0..copies {
            if let Some(late) = self.faults.notice_delay() {
                let (me, parent, child, end) =
                    (self.me.clone(), parent.clone(), child.clone(), end.clone());
                let life = self.life.load(Ordering::Relaxed);
                tokio::spawn(async move {
                    tokio::time::sleep(late).await;
                    let Some(me) = me.upgrade() else { return };
                    if me.life.load(Ordering::Relaxed) != life {
                        return;
                    }
                    let pos = me.id();
                    me.lock()
                        .notices
                        .entry(parent)
                        .or_default()
                        .push((pos, child, end));
                });
                continue;
            }
            let pos = self.id();
            self.lock()
                .notices
                .entry(parent.clone())
                .or_default()
                .push((pos, child.clone(), end.clone()));
        }
        Ok(())
    }
}

#[async_trait]
impl Notices for MemStore {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        self.post_notice(parent, child, None).await
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        Ok(self
            .read_ends(parent, after)
            .await?
            .into_iter()
            .map(|(pos, child, _)| (pos, child))
            .collect())
    }

    /// Carried as NATS carries it, so that the simulation's faults (notices lost, posted
    /// twice, late) meet the parents that settle children from their notices.
    async fn post_end(&self, parent: &SessionId, child: &SessionId, end: &Record) -> Result<()> {
        self.post_notice(parent, child, Some(end.clone())).await
    }

    async fn read_ends(&self, parent: &SessionId, after: u64) -> Result<Vec<NoticeRead>> {
        self.reach("notices")?;
        Ok(self
            .served(|g| {
                g.notices
                    .get(parent)
                    .map(|v| v.iter().filter(|(p, _, _)| *p > after).cloned().collect())
                    .unwrap_or_default()
            })
            .await)
    }

    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()> {
        self.reach("watch")?;
        let mut g = self.lock();
        let w = g.watchers.entry(target.clone()).or_default();
        if !w.iter().any(|(s, _)| s == watcher) {
            w.push((watcher.clone(), pool.to_string()));
        }
        Ok(())
    }

    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>> {
        self.reach("watchers")?;
        Ok(self
            .served(|g| g.watchers.get(target).cloned().unwrap_or_default())
            .await)
    }
}

impl Workspaces for MemStore {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace> {
        Arc::new(LocalWorkspace::new(self.workspaces.join(root.as_str())).inline())
    }
}

/// The announcer of `SKEIN_RESULTS` as the NATS store keeps it: each ending of a root
/// (named by the root and the seq of the record that ended it) stored once, an ending
/// announced again or an earlier one dropped. It lies outside the disk: a restart keeps
/// what was announced.
#[async_trait]
impl Announcer for MemStore {
    async fn root_finished(&self, notice: &RootResult) -> Result<()> {
        self.reach("announce")?;
        let root = SessionId::parse(&notice.session)?;
        let mut g = self.lock();
        let stored = g.results.entry(root).or_default();
        if stored.last().is_none_or(|last| last.seq < notice.seq) {
            stored.push(notice.clone());
        }
        Ok(())
    }

    async fn last_announced(&self, root: &SessionId) -> Result<Option<RootResult>> {
        self.reach("last announced")?;
        Ok(self
            .served(|g| g.results.get(root).and_then(|r| r.last().cloned()))
            .await)
    }
}
