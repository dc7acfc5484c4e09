//! The work loops: claim a job, process it, ack it or hand it back.
//!
//! Two rules keep a worker honest while its backend is in trouble (a node lost, a leader
//! being elected):
//! - A step that fails for a transient reason (the backend unreachable, an append that met
//!   another writer) is tried again in place, with backoff and heartbeats, for up to
//!   [`TRANSIENT_PATIENCE`]. It is not handed back, so an outage does not use up the
//!   deliveries that dead-letter a session.
//! - A worker never goes quiet while it cannot claim: the first failure of a pool is a
//!   warning, and while claims keep failing an error names the pool and the last cause
//!   every [`STALL_REPORT`] (the backend's errors name the stream and consumer).
//!
//! - A step that fails for want of room in the store (a full disk, a JetStream store at
//!   its limits) waits in place, however long, with heartbeats: nothing of it was
//!   written, and it runs on once there is room, without a restart and without using up
//!   a delivery. Its session is listed as waiting for room
//!   ([`Runtime::waiting_for_room`], the gauge `skein_sessions_waiting_for_room`, and an
//!   error line every [`STALL_REPORT`] with how many wait and the store's error) for as
//!   long as it waits.
//!
//! A panic while processing one job is caught, logged at error level and the job handed
//! back; the loop goes on.
//!
//! Draining ([`Runtime::start_draining`]): the loops stop claiming, a model call in flight
//! is abandoned (nothing of it has been written) and its job handed back at once, so
//! another worker takes it without waiting for the lease; other steps finish. Jobs still
//! held when the drain's time is up are handed back by [`Runtime::hand_back_held`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use futures::FutureExt;
use tokio::sync::watch;

use crate::ports::{Job, WaitingForRoom};
use crate::worker::{Runtime, Scope};
use crate::Error;

/// How long a step that keeps failing for transient reasons is retried in place before its
/// job is handed back to the queue.
pub const TRANSIENT_PATIENCE: Duration = Duration::from_secs(120);
/// The longest wait between two in-place retries.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(5);
/// How often a worker that cannot claim says so, at error level.
pub const STALL_REPORT: Duration = Duration::from_secs(10);
/// After backend trouble, when the open trees are swept (see
/// [`Runtime::sweep_open_trees`]): soon, and once more later, for a replica that is reset
/// when it rejoins.
/// How long a job handed back for want of an agent or provider waits before it is
/// delivered again (to any worker of its pool).
const LACKING_DELAY: Duration = Duration::from_millis(500);
const SWEEP_SOON: Duration = Duration::from_secs(5);
const SWEEP_LATER: Duration = Duration::from_secs(45);

/// How long a failed step's job waits before it is delivered again. A write conflict
/// clears as soon as the fold is reread; an unreachable backend (a node down, a leader
/// election) backs off exponentially, so the deliveries that count towards `max_deliver`
/// span an outage of tens of seconds instead of burning out in one second.
pub fn retry_delay(e: &Error, attempt: u32) -> Duration {
    match e {
        Error::Conflict { .. } => Duration::from_millis(50 * u64::from(attempt.min(20))),
        Error::Unavailable { .. } | Error::Full { .. } => {
            Duration::from_millis(500u64.saturating_mul(1 << attempt.saturating_sub(1).min(6)))
        }
        _ => Duration::from_secs(2),
    }
}

/// Claim failures per pool, shared by every work loop of a runtime, and whether the
/// backend was in trouble since the last sweep (see [`Runtime::sweep_open_trees`]).
#[derive(Default)]
pub struct ClaimHealth {
    pools: Mutex<HashMap<String, PoolHealth>>,
    /// When sweeps are due: one soon after trouble, one later for what settles late.
    sweeps: Mutex<Vec<Instant>>,
}

struct PoolHealth {
    failing_since: Instant,
    reported: Instant,
}

impl ClaimHealth {
    /// A claim from `pool` answered (with a job or none).
    pub fn ok(&self, pool: &str) {
        let mut p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = p.remove(pool) {
            tracing::warn!(pool, after = ?h.failing_since.elapsed(), "claims answer again");
        }
    }

    /// A claim from `pool` failed with `error`.
    pub fn failed(&self, pool: &str, error: &crate::Error) {
        self.trouble();
        let mut p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match p.get_mut(pool) {
            None => {
                tracing::warn!(pool, error = %error.report(), "claim failed");
                p.insert(
                    pool.to_string(),
                    PoolHealth {
                        failing_since: now,
                        reported: now,
                    },
                );
            }
            Some(h) if now.duration_since(h.reported) >= STALL_REPORT => {
                h.reported = now;
                tracing::error!(pool, failing_for = ?h.failing_since.elapsed(), error = %error.report(),
                    "cannot make progress: no job can be claimed from this pool");
            }
            Some(_) => {}
        }
    }

    /// The backend failed in a way that may have lost wake-ups (a stream without a
    /// leader, a replica reset): schedule sweeps of the open trees.
    pub fn trouble(&self) {
        let now = Instant::now();
        let mut s = self.sweeps.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() < 2 {
            s.clear();
            s.push(now + SWEEP_SOON);
            s.push(now + SWEEP_LATER);
        } else {
            // Still in trouble: push the later sweep out past it.
            s[1] = now + SWEEP_LATER;
        }
    }

    /// Whether a sweep is due now (and then it is taken).
    fn sweep_due(&self) -> bool {
        let now = Instant::now();
        let mut s = self.sweeps.lock().unwrap_or_else(|p| p.into_inner());
        match s.first() {
            Some(t) if *t <= now => {
                s.remove(0);
                true
            }
            _ => false,
        }
    }

    /// How long claims from `pool` have been failing, if they are.
    pub fn failing_for(&self, pool: &str) -> Option<Duration> {
        let p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        p.get(pool).map(|h| h.failing_since.elapsed())
    }

    /// Every pool whose claims are failing now, with how long they have been, sorted.
    pub fn failing(&self) -> Vec<(String, Duration)> {
        let p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = p
            .iter()
            .map(|(k, h)| (k.clone(), h.failing_since.elapsed()))
            .collect();
        v.sort();
        v
    }
}

/// What the work loops of one runtime share: the claim health of its pools, the drain
/// switch, the jobs held now, and the sessions waiting for room in the store.
pub struct Loops {
    pub health: Arc<ClaimHealth>,
    draining: watch::Sender<bool>,
    held: Mutex<HashMap<String, Job>>,
    waiting_for_room: Mutex<std::collections::BTreeMap<String, WaitingForRoom>>,
    /// When the sessions waiting for room were last reported at error level.
    room_reported: Mutex<Option<Instant>>,
    /// Pools this worker stands aside from, and until when: it handed a job of the pool
    /// back for want of something, and every one of its slots leaves that job to the
    /// workers that have it when it is due again.
    aside: Mutex<HashMap<String, Instant>>,
}

impl Default for Loops {
    fn default() -> Self {
        Self {
            health: Arc::default(),
            draining: watch::Sender::new(false),
            held: Mutex::new(HashMap::new()),
            waiting_for_room: Mutex::default(),
            aside: Mutex::default(),
            room_reported: Mutex::default(),
        }
    }
}

impl Loops {
    /// Lists `session` as waiting for room; whether it was not listed yet. One error line
    /// for all of them says so when the first starts to wait, and again every
    /// [`STALL_REPORT`] while any waits, with how many.
    fn wait_for_room(&self, session: &str, error: &Error, now_ms: u64) -> (bool, WaitingForRoom) {
        let mut w = self
            .waiting_for_room
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let new = !w.contains_key(session);
        let entry = w
            .entry(session.to_string())
            .or_insert_with(|| WaitingForRoom {
                session: session.to_string(),
                since_ms: now_ms,
                reason: String::new(),
            });
        entry.reason = error.report().to_string();
        let entry = entry.clone();
        crate::metrics::waiting_for_room(w.len());
        let mut reported = self.room_reported.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if reported.is_none_or(|at| now.duration_since(at) >= STALL_REPORT) {
            *reported = Some(now);
            tracing::error!(sessions = w.len(), error = %error.report(),
                "no room in the store: sessions wait, and run on once there is room (free \
                 space, or raise the store's limits; see \"Storage faults\" in \
                 docs/architecture.md)");
        }
        (new, entry)
    }

    fn room_again(&self, session: &str) -> Option<WaitingForRoom> {
        let mut w = self
            .waiting_for_room
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let was = w.remove(session);
        if was.is_some() {
            crate::metrics::waiting_for_room(w.len());
            if w.is_empty() {
                *self.room_reported.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }
        }
        was
    }
}

/// How long a worker stands aside from a pool after it handed back, for want of
/// something, the delivery numbered `attempt`: past the job's next due time by half a
/// [`LACKING_DELAY`], and by up to three eighths more as the delivery's number goes.
fn aside_after(attempt: u32) -> Duration {
    LACKING_DELAY + LACKING_DELAY / 2 + LACKING_DELAY * (attempt % 4) / 8
}

/// Registers a held job for as long as it lives.
struct Held<'a>(&'a Loops, String);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut h = self.0.held.lock().unwrap_or_else(|p| p.into_inner());
        h.remove(&self.1);
    }
}

impl Runtime {
    /// Starts draining: model calls in flight are abandoned and their jobs handed back,
    /// and none is started any more. The loops stop claiming once their `stop` turns true.
    pub fn start_draining(&self) {
        self.loops.draining.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.loops.draining.borrow()
    }

    /// Returns once the runtime drains (at once if it does already).
    pub async fn draining(&self) {
        let mut rx = self.loops.draining.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Hands back every job still held, to be delivered again at once (the end of a drain
    /// whose time is up). Returns how many were handed back.
    pub async fn hand_back_held(&self) -> usize {
        let held: Vec<Job> = {
            let h = self.loops.held.lock().unwrap_or_else(|p| p.into_inner());
            h.values().cloned().collect()
        };
        let mut n = 0;
        for job in held {
            match self.backend.jobs.retry(&job, Duration::ZERO).await {
                Ok(()) => {
                    crate::metrics::job_handed_back(&job.pool, "draining");
                    n += 1;
                }
                Err(e) => {
                    tracing::warn!(session = %job.session, error = %e.report(), "hand back failed")
                }
            }
        }
        n
    }

    /// Claims and processes jobs of `pools` until `stop` turns true; with a scope, only
    /// jobs of the trees in it are taken.
    pub(crate) async fn work_loop(
        self: Arc<Self>,
        pools: Vec<String>,
        health: Arc<ClaimHealth>,
        mut stop: watch::Receiver<bool>,
        scope: Option<Arc<Scope>>,
    ) {
        let wait = crate::ports::CLAIM_WAIT / pools.len().max(1) as u32;
        while !*stop.borrow() {
            let mut got = false;
            for pool in &pools {
                if let Some(until) = self.aside_until(pool) {
                    tokio::select! {
                        biased;
                        _ = stop.changed() => break,
                        _ = tokio::time::sleep_until(until) => {}
                    }
                }
                let claim = async {
                    match &scope {
                        Some(s) => {
                            let s = s.clone();
                            let want = move |id: &skein_core::SessionId| s.wants(id);
                            self.backend.jobs.claim_matching(pool, wait, &want).await
                        }
                        None => self.backend.jobs.claim(pool, wait).await,
                    }
                };
                let claimed = tokio::select! {
                    biased;
                    c = claim => c,
                    _ = stop.changed() => break,
                };
                match claimed {
                    Ok(Some(job)) => {
                        health.ok(pool);
                        crate::metrics::job_claimed(pool, job.attempt);
                        got = true;
                        let attempt = job.attempt;
                        // Boxed: a job's future is some 30 KB, and a loop that held it
                        // inline would carry that much while it waits for a job.
                        if Box::pin(self.handle(job)).await {
                            // Handed back for want of something: every slot of this
                            // worker stands aside from the pool until the job is due
                            // again and past, so that a worker that has what it needs
                            // takes it rather than another slot of this one. How long
                            // varies with the delivery: with two such jobs handed back
                            // in turn, a fixed time had this worker's slots return at
                            // the very instant the other job fell due, first in line
                            // every time, and the worker that had what both need never
                            // got either.
                            self.stand_aside(pool, aside_after(attempt));
                        }
                    }
                    Ok(None) => health.ok(pool),
                    Err(e) => {
                        health.failed(pool, &e);
                        tokio::select! {
                            biased;
                            _ = stop.changed() => break,
                            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        }
                    }
                }
            }
            if !got {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Every slot of this worker stands aside from `pool` for `how_long` from now (see
    /// [`aside_after`]).
    fn stand_aside(&self, pool: &str, how_long: Duration) {
        let until = Instant::now() + how_long;
        let mut a = self.loops.aside.lock().unwrap_or_else(|p| p.into_inner());
        let at = a.entry(pool.to_string()).or_insert(until);
        *at = (*at).max(until);
    }

    /// Until when this worker stands aside from `pool`, if it does now.
    fn aside_until(&self, pool: &str) -> Option<Instant> {
        let mut a = self.loops.aside.lock().unwrap_or_else(|p| p.into_inner());
        match a.get(pool) {
            Some(until) if *until > Instant::now() => Some(*until),
            Some(_) => {
                a.remove(pool);
                None
            }
            None => None,
        }
    }

    /// Processes one job: transient failures are retried in place, the job is acked on
    /// success, handed back otherwise. What the backend publishes meanwhile carries the
    /// session's trace context.
    /// Returns whether the job was handed back for want of something this worker lacks
    /// (or cannot read).
    pub async fn handle(&self, job: Job) -> bool {
        crate::spans::scoped(self.handle_job(job)).await
    }

    async fn handle_job(&self, job: Job) -> bool {
        let _in_flight = crate::metrics::InFlight::enter(&job.pool);
        let _held = {
            let mut h = self.loops.held.lock().unwrap_or_else(|p| p.into_inner());
            h.insert(job.handle.clone(), job.clone());
            Held(&self.loops, job.handle.clone())
        };
        let started = Instant::now();
        let mut tries = 0u32;
        let res = loop {
            // A retry reconciles with the logs as a redelivery does: the failed step
            // may have left children whose jobs were never published.
            let res = match std::panic::AssertUnwindSafe(self.process_again(&job, tries > 0))
                .catch_unwind()
                .await
            {
                Ok(r) => r,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic".into());
                    tracing::error!(session = %job.session, attempt = job.attempt, panic = %what,
                        "processing the job panicked; it is handed back");
                    Err(crate::Error::unavailable_because(format!(
                        "processing panicked: {what}"
                    )))
                }
            };
            if !matches!(res, Err(crate::Error::Full { .. })) {
                if let Some(w) = self.loops.room_again(job.session.as_str()) {
                    tracing::warn!(session = %job.session, waited_ms = self.cfg.clock.now_ms().saturating_sub(w.since_ms),
                        "the store has room again; the session runs on");
                    self.room_again(&job.session).await;
                }
            }
            match &res {
                // No room in the store: wait in place for as long as it takes.
                Err(e @ crate::Error::Full { .. }) if !self.is_draining() => {
                    tries += 1;
                    let (new, w) =
                        self.loops
                            .wait_for_room(job.session.as_str(), e, self.cfg.clock.now_ms());
                    if new {
                        tracing::warn!(session = %job.session, error = %e.report(),
                            "no room in the store: the session waits");
                        self.announce_room(&job.session, true);
                    }
                    // Said again at every try, so that a mark whose worker is gone lapses.
                    if let Err(e) = self.backend.jobs.set_waiting_for_room(&w).await {
                        tracing::debug!(session = %job.session, error = %e.report(),
                            "cannot show that the session waits for room");
                    }
                    let wait = retry_delay(e, tries)
                        .min(MAX_RETRY_WAIT)
                        .min(self.cfg.lease / 2);
                    let _ = self.backend.jobs.heartbeat(&job).await;
                    tokio::time::sleep(wait).await;
                    let _ = self.backend.jobs.heartbeat(&job).await;
                }
                Err(e)
                    if e.is_retryable()
                        && started.elapsed() < TRANSIENT_PATIENCE
                        && !self.is_draining() =>
                {
                    tries += 1;
                    if !matches!(e, crate::Error::Conflict { .. }) {
                        self.loops.health.trouble();
                    }
                    let wait = retry_delay(e, tries)
                        .min(MAX_RETRY_WAIT)
                        .min(self.cfg.lease / 2);
                    tracing::warn!(session = %job.session, attempt = job.attempt, tries, error = %e.report(),
                        "step failed; trying again in place");
                    // Keep the lease while waiting; a heartbeat that cannot be sent is
                    // part of the same outage.
                    let _ = self.backend.jobs.heartbeat(&job).await;
                    tokio::time::sleep(wait).await;
                    let _ = self.backend.jobs.heartbeat(&job).await;
                }
                _ => break res,
            }
        };
        if self.loops.room_again(job.session.as_str()).is_some() {
            // Handed back while waiting (the worker drains): it waits elsewhere.
            self.room_again(&job.session).await;
        }
        tracing::trace!(session = %job.session, ok = res.is_ok(), "job processed");
        let quota_wait = self.take_quota_wait(&job.session);
        let lacking = matches!(
            res,
            Err(crate::Error::Lacking(_))
                | Err(crate::Error::Core(skein_core::Error::NewerFormat { .. }))
        );
        match res {
            // The step waits for a model's quota: the job goes back until then, and no
            // worker slot is held meanwhile.
            Ok(()) if quota_wait.is_some() => {
                let delay = quota_wait.unwrap_or_default();
                match self.backend.jobs.retry(&job, delay).await {
                    Ok(()) => crate::metrics::job_handed_back(&job.pool, "quota"),
                    Err(e) => {
                        tracing::warn!(session = %job.session, error = %e.report(), "retry failed")
                    }
                }
            }
            Ok(()) => match self.ack_processed(&job).await {
                Ok(()) => crate::metrics::job_acked(&job.pool),
                Err(e) => {
                    // The job comes back; what it appended may not have been stored (a
                    // pipelined append the ack found refused), so its fold is not kept.
                    self.sessions.forget(&job.session);
                    tracing::warn!(session = %job.session, error = %e.report(), "ack failed")
                }
            },
            // The worker drains: the job goes back at once, for another worker to take.
            Err(crate::Error::Interrupted(why)) => {
                tracing::info!(session = %job.session, attempt = job.attempt, why = %why,
                    "job handed back: the worker is draining");
                // The loops stopped claiming when the drain began, but a pull they had
                // open may still stand at the server until it expires; handed back before
                // then, the job could be delivered to it and wait out its lease.
                tokio::time::sleep(crate::ports::CLAIM_WAIT + Duration::from_millis(250)).await;
                match self.backend.jobs.retry(&job, Duration::ZERO).await {
                    Ok(()) => crate::metrics::job_handed_back(&job.pool, "draining"),
                    Err(e) => {
                        tracing::warn!(session = %job.session, error = %e.report(), "retry failed")
                    }
                }
            }
            // A record of a later release's format: a worker that reads it takes the job.
            Err(crate::Error::Core(e @ skein_core::Error::NewerFormat { .. })) => {
                tracing::warn!(session = %job.session, attempt = job.attempt, error = %e,
                    "job handed back: its log holds a record this worker cannot read");
                if let skein_core::Error::NewerFormat { found, .. } = e {
                    crate::metrics::job_lacking(&format!("format:{found}"));
                }
                match self.backend.jobs.retry(&job, LACKING_DELAY).await {
                    Ok(()) => crate::metrics::job_handed_back(&job.pool, "newer_format"),
                    Err(e) => {
                        tracing::warn!(session = %job.session, error = %e.report(), "retry failed")
                    }
                }
            }
            // Another worker has what this one lacks: the job goes to it, soon.
            Err(crate::Error::Lacking(why)) => {
                tracing::info!(session = %job.session, attempt = job.attempt, why = %why,
                    "job handed back");
                match self.backend.jobs.retry(&job, LACKING_DELAY).await {
                    Ok(()) => crate::metrics::job_handed_back(&job.pool, "lacking"),
                    Err(e) => {
                        tracing::warn!(session = %job.session, error = %e.report(), "retry failed")
                    }
                }
            }
            // A log that cannot be read or folded never gets better by retrying, and no
            // failure can be appended to it: past max_deliver the job is dropped, loudly.
            Err(e) if !e.is_retryable() && job.attempt > self.cfg.max_deliver => {
                tracing::error!(session = %job.session, attempt = job.attempt, error = %e.report(),
                    "job dropped: its session cannot be processed; inspect its log with `skein replay --verify`");
                crate::metrics::job_dead_lettered(&job.pool);
                if let Err(e) = self.backend.jobs.ack(&job).await {
                    tracing::warn!(session = %job.session, error = %e.report(), "ack failed");
                }
            }
            Err(e) => {
                let delay = retry_delay(&e, job.attempt);
                tracing::warn!(session = %job.session, attempt = job.attempt, error = %e.report(),
                    "step failed; job will be delivered again");
                match self.backend.jobs.retry(&job, delay).await {
                    Ok(()) => crate::metrics::job_handed_back(&job.pool, "failed"),
                    Err(e) => {
                        tracing::warn!(session = %job.session, error = %e.report(), "retry failed")
                    }
                }
            }
        }
        lacking
    }

    /// Every session whose step waits for room in the store now, in id order.
    pub fn waiting_for_room(&self) -> Vec<WaitingForRoom> {
        self.loops
            .waiting_for_room
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Tells the progress listeners that `session` waits for room (`kind`
    /// `WaitingForRoom`), or runs on (`RoomAgain`).
    fn announce_room(&self, session: &skein_core::SessionId, waiting: bool) {
        self.progress_note(
            session,
            if waiting {
                "WaitingForRoom"
            } else {
                "RoomAgain"
            },
        );
    }

    /// `session` runs on: says so, and clears its mark.
    async fn room_again(&self, session: &skein_core::SessionId) {
        self.announce_room(session, false);
        if let Err(e) = self.backend.jobs.clear_waiting_for_room(session).await {
            tracing::debug!(session = %session, error = %e.report(),
                "cannot clear the mark that the session waits for room");
        }
    }

    /// Starts `concurrency` work loops over every pool; returns the stop switch and the
    /// loops' handles.
    pub fn spawn_workers(
        self: &Arc<Self>,
        pools: Vec<String>,
        concurrency: usize,
    ) -> (watch::Sender<bool>, Vec<tokio::task::JoinHandle<()>>) {
        self.spawn_in(pools, concurrency, None)
    }

    /// As [`Runtime::spawn_workers`]; with a scope, the loops take only jobs of its trees.
    pub(crate) fn spawn_in(
        self: &Arc<Self>,
        pools: Vec<String>,
        concurrency: usize,
        scope: Option<Arc<Scope>>,
    ) -> (watch::Sender<bool>, Vec<tokio::task::JoinHandle<()>>) {
        let (tx, rx) = watch::channel(false);
        let health = self.loops.health.clone();
        let mut handles: Vec<_> = (0..concurrency.max(1))
            .map(|_| {
                let fut = self.clone().work_loop(
                    pools.clone(),
                    health.clone(),
                    rx.clone(),
                    scope.clone(),
                );
                tokio::spawn(fut)
            })
            .collect();
        handles.push(tokio::spawn(self.clone().sweeper(rx)));
        (tx, handles)
    }

    /// Runs the sweeps that backend trouble schedules, until `stop`.
    async fn sweeper(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        while !*stop.borrow() {
            tokio::select! {
                biased;
                _ = stop.changed() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            if self.loops.health.sweep_due() {
                if let Err(e) = self.sweep_open_trees().await {
                    tracing::warn!(error = %e.report(), "sweep of the open trees failed; it runs again");
                    self.loops.health.trouble();
                }
            }
        }
    }

    /// Acks a job processed to its end. Nothing waits for the job of a session that ended
    /// to go, so its ack may wait its turn (`JobQueue::ack_ended`).
    /// A session ended for good is acked as such (`JobQueue::ack_final`): nothing can
    /// follow its end, so no later run of it has anything to do.
    async fn ack_processed(&self, job: &Job) -> crate::Result<()> {
        match self.sessions.ending(&job.session) {
            Some(crate::session::Ending::ForGood) => self.backend.jobs.ack_final(job).await,
            Some(crate::session::Ending::MayRunAgain) => self.backend.jobs.ack_ended(job).await,
            None => self.backend.jobs.ack(job).await,
        }
    }

    /// Wakes every session of every tree that has not ended. Jobs are wake-ups: a cluster
    /// that loses a stream's state (a replica reset while it was leader, on older servers)
    /// can lose some, and nothing else would wake their sessions. A wake-up for a session
    /// that has a job is coalesced with it, so a sweep costs reads, not duplicate work.
    pub async fn sweep_open_trees(&self) -> crate::Result<usize> {
        let started = Instant::now();
        let mut trees = 0;
        let mut woken = 0;
        for root in self.backend.log.open_roots().await? {
            trees += 1;
            woken += self.requeue_tree(&root).await?;
        }
        tracing::info!(trees, woken, took = ?started.elapsed(), "swept the open trees after backend trouble");
        Ok(woken)
    }
}

/// The size in bytes of the future of one job ([`Runtime::handle`]) and of the parts of a
/// drive that make it up, as this build lays them out: each job in flight is such a
/// future, boxed.
#[doc(hidden)]
pub fn job_future_sizes() -> Vec<(&'static str, usize)> {
    fn s2<A, B, F>(_: fn(A, B) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn s3<A, B, C, F>(_: fn(A, B, C) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn s4<A, B, C, D, F>(_: fn(A, B, C, D) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn s5<A, B, C, D, E, F>(_: fn(A, B, C, D, E) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn s6<A, B, C, D, E, G, F>(_: fn(A, B, C, D, E, G) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn s7<A, B, C, D, E, G, H, F>(_: fn(A, B, C, D, E, G, H) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    vec![
        ("handle", s2(Runtime::handle)),
        ("handle_job", s2(Runtime::handle_job)),
        ("process_again", s3(Runtime::process_again)),
        ("drive", s4(Runtime::drive)),
        ("call_model", s6(Runtime::call_model)),
        ("run_tools", s5(Runtime::run_tools)),
        ("delegate", s4(Runtime::delegate)),
        ("collect_settlements", s7(Runtime::collect_settlements)),
        ("on_terminal", s2(Runtime::on_terminal)),
        ("end_team", s2(Runtime::end_team)),
        ("broadcast", s3(Runtime::broadcast)),
        ("propose", s3(Runtime::propose)),
        ("clarify", s3(Runtime::clarify)),
        ("append", s3(Runtime::append)),
        ("append_all", s3(Runtime::append_all)),
        ("load_for_job", s2(Runtime::load_for_job)),
        ("refuse", s3(Runtime::refuse)),
        ("member_exit", s2(Runtime::member_exit)),
        ("cancel", s3(crate::control::cancel)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_future_stays_small() {
        // Every job in flight is one such future, boxed; the steps a job seldom takes are
        // boxed apart so as not to make it larger (it was some 36 KB in a debug build).
        let sizes = job_future_sizes();
        let handle = sizes.iter().find(|(n, _)| *n == "handle").map(|(_, s)| *s);
        assert!(handle.is_some_and(|s| s < 12 * 1024), "{sizes:?}");
    }

    #[test]
    fn outages_back_off_long_enough_to_outlast_a_leader_election() {
        let down = Error::unavailable_because("request timed out");
        let waits: Vec<Duration> = (1..=5).map(|a| retry_delay(&down, a)).collect();
        assert!(waits.windows(2).all(|w| w[1] == w[0] * 2), "{waits:?}");
        // The five deliveries before a dead letter span well over ten seconds.
        assert!(waits.iter().sum::<Duration>() >= Duration::from_secs(15));
        let conflict = Error::Conflict {
            session: "s".into(),
            expected: 1,
            actual: 2,
        };
        assert!(retry_delay(&conflict, 1) <= Duration::from_millis(100));
        assert!(retry_delay(&down, 60) <= Duration::from_secs(40));
    }
}
