//! Model quotas in the simulation. Some generated worlds declare limits for their model
//! (requests a minute, input tokens a minute, concurrent requests): their agents then run
//! `limited:NAME`, the scripted model under a quota, and every worker of the world asks
//! one shared limiter, the in-process one of the embedded backend ([`LocalQuota`]) on
//! the virtual clock. The faults still fall: a worker is killed while its session waits
//! for quota or while it holds a permit, the model fails, the backend is unreachable.
//!
//! Every grant is recorded with its virtual time, and every call the model receives with
//! how many were under way at once; after the run, [`check`] finds a window of a minute
//! that holds more grants than the declared rate, or more calls at once than the declared
//! concurrency. That every tree ends (nobody waits for ever) is the run's own liveness
//! check.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::ModelRequest;
use skein_llm::{Completion, Provider};
use skein_ports::quota::{
    Decision, Learned, LocalQuota, Permit, Quota, QuotaAsk, QuotaLimits, QuotaWaiter, PERMIT_LEASE,
};

use crate::faults::Rng;
use crate::invariants::Verdict;

/// The provider name a limited world's agents run on.
pub const PROVIDER: &str = "limited";

/// The limits of a seed's world, if it has any (about one seed in three): drawn from a
/// stream of their own, so the rest of the world is drawn as without them.
pub fn draw(seed: u64) -> Option<QuotaLimits> {
    let mut rng = Rng::new(seed.rotate_left(29) ^ 0x7175_6f74_6173);
    if !rng.chance(0.35) {
        return None;
    }
    let rates = [20, 60, 120, 600];
    let mut limits = QuotaLimits {
        requests_per_minute: Some(rates[rng.below(rates.len() as u64) as usize]),
        ..QuotaLimits::default()
    };
    if rng.chance(0.3) {
        limits.input_tokens_per_minute = Some(20_000 + 20_000 * rng.below(5));
    }
    if rng.chance(0.3) {
        limits.output_tokens_per_minute = Some(10_000 + 10_000 * rng.below(3));
    }
    if rng.chance(0.4) {
        limits.concurrent_requests = Some(1 + rng.below(4));
    }
    Some(limits)
}

/// The limits as the model registry declares them.
pub fn declared(l: &QuotaLimits) -> skein_llm::Limits {
    skein_llm::Limits {
        requests_per_minute: l.requests_per_minute,
        input_tokens_per_minute: l.input_tokens_per_minute,
        output_tokens_per_minute: l.output_tokens_per_minute,
        concurrent_requests: l.concurrent_requests,
    }
}

/// One grant: when (virtual ms since the run began), to which session.
#[derive(Debug, Clone)]
pub struct Grant {
    pub at_ms: u64,
    pub session: String,
    pub key: String,
}

/// The limiter every worker of a limited world shares, and what it and the model saw.
pub struct SimQuota {
    pub limits: QuotaLimits,
    inner: LocalQuota,
    t0: tokio::time::Instant,
    grants: Mutex<Vec<Grant>>,
    /// Times a call was told to wait.
    pub waits: AtomicU64,
    /// Calls under way at each model (`provider:model`, the quota's key) now, and the
    /// most there ever were.
    running: Mutex<BTreeMap<String, (u64, u64)>>,
    /// Calls the model received.
    pub calls: AtomicU64,
    /// When (virtual ms since the run began, plus one) workers were last killed: the
    /// permits their dropped calls would give back are kept out (a kill -9 gives nothing
    /// back; the place lapses).
    killed_at: AtomicU64,
    /// Permits kept out so.
    pub lost_permits: AtomicU64,
}

impl SimQuota {
    /// A limiter on the virtual clock (`clock`, ms since the epoch).
    pub fn new(limits: QuotaLimits, clock: Arc<crate::faults::SimClock>) -> Arc<Self> {
        let c = clock.clone();
        Arc::new(Self {
            limits,
            inner: LocalQuota::with_clock(Arc::new(move || {
                skein_runtime::clock::Clock::now_ms(&*c)
            })),
            t0: tokio::time::Instant::now(),
            grants: Mutex::new(vec![]),
            waits: AtomicU64::new(0),
            running: Mutex::new(BTreeMap::new()),
            calls: AtomicU64::new(0),
            killed_at: AtomicU64::new(0),
            lost_permits: AtomicU64::new(0),
        })
    }

    fn elapsed_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    /// Workers are being killed now: what they would give back as they are dropped is
    /// lost, as in a real crash.
    pub fn killing(&self) {
        self.killed_at
            .store(self.elapsed_ms() + 1, Ordering::Relaxed);
    }

    /// Every grant, in the order given.
    pub fn grants(&self) -> Vec<Grant> {
        self.grants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// What the quota did, for people.
    pub fn report(&self) -> String {
        let grants = self.grants();
        let last = grants.iter().map(|g| g.at_ms).max().unwrap_or(0);
        let tail: Vec<String> = grants
            .iter()
            .rev()
            .take(8)
            .rev()
            .map(|g| format!("{} {} at {}", g.key, g.session, g.at_ms))
            .collect();
        format!(
            "quota {:?}: {} calls granted (the last at {last} virtual ms), told to wait {} \
             times, {} permits lost to kills, the most at once {:?}; the last grants: {}",
            self.limits,
            grants.len(),
            self.waits.load(Ordering::Relaxed),
            self.lost_permits.load(Ordering::Relaxed),
            self.most_at_once(),
            tail.join(", "),
        )
    }

    fn running(&self) -> MutexGuard<'_, BTreeMap<String, (u64, u64)>> {
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The most calls that were under way at once at each model.
    pub fn most_at_once(&self) -> BTreeMap<String, u64> {
        self.running()
            .iter()
            .map(|(k, (_, most))| (k.clone(), *most))
            .collect()
    }

    /// `model` behind this quota: it counts the calls under way at once.
    pub fn provider(self: &Arc<Self>, model: Arc<dyn Provider>) -> Arc<dyn Provider> {
        Arc::new(Counted {
            quota: self.clone(),
            inner: model,
        })
    }
}

#[async_trait]
impl Quota for SimQuota {
    async fn acquire(&self, ask: &QuotaAsk, limits: &QuotaLimits) -> skein_ports::Result<Decision> {
        let d = self.inner.acquire(ask, limits).await?;
        match &d {
            Decision::Go(_) => self
                .grants
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(Grant {
                    at_ms: self.elapsed_ms(),
                    session: ask.session.clone(),
                    key: ask.key.clone(),
                }),
            Decision::Wait { .. } => {
                self.waits.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(d)
    }

    async fn release(
        &self,
        permit: &Permit,
        limits: &QuotaLimits,
        used: Option<(u64, u64)>,
    ) -> skein_ports::Result<()> {
        // A permit given back unused at the moment of a kill is one a dropped call gave
        // back: the crash keeps it.
        if used.is_none() && self.killed_at.load(Ordering::Relaxed) == self.elapsed_ms() + 1 {
            self.lost_permits.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.inner.release(permit, limits, used).await
    }

    async fn renew(&self, permit: &Permit, limits: &QuotaLimits) -> skein_ports::Result<()> {
        self.inner.renew(permit, limits).await
    }

    async fn learn(&self, key: &str, learned: &Learned) -> skein_ports::Result<()> {
        self.inner.learn(key, learned).await
    }

    async fn waiting(&self) -> skein_ports::Result<Vec<QuotaWaiter>> {
        self.inner.waiting().await
    }
}

/// The model of a limited world: counts the calls under way (a call whose worker is
/// killed stops counting when its task is dropped).
struct Counted {
    quota: Arc<SimQuota>,
    inner: Arc<dyn Provider>,
}

struct Running<'a>(&'a SimQuota, String);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if let Some((now, _)) = self.0.running().get_mut(&self.1) {
            *now -= 1;
        }
    }
}

#[async_trait]
impl Provider for Counted {
    async fn complete(&self, model: &str, req: &ModelRequest) -> skein_llm::Result<Completion> {
        let q = &self.quota;
        q.calls.fetch_add(1, Ordering::Relaxed);
        let key = format!("{PROVIDER}:{model}");
        {
            let mut running = q.running();
            let (now, most) = running.entry(key.clone()).or_default();
            *now += 1;
            *most = (*most).max(*now);
        }
        let _running = Running(q, key);
        self.inner.complete(model, req).await
    }
}

/// Whether a session of the tree under `root` waits for quota: it is listed as waiting
/// (`skein tree`, the UI), and moves on once the quota lets it.
pub async fn waits(q: Option<&SimQuota>, root: &skein_core::SessionId) -> bool {
    let Some(q) = q else { return false };
    q.waiting()
        .await
        .is_ok_and(|ws| ws.iter().any(|w| w.root == root.as_str()))
}

/// How long the trees of a world have before its liveness check: a limited world's calls
/// are spaced, and a permit a kill kept holds its place until it lapses, so it has
/// [`PERMIT_LEASE`] more.
pub fn extend(q: Option<&SimQuota>, limit: Duration) -> Duration {
    match q {
        Some(_) => limit + PERMIT_LEASE,
        None => limit,
    }
}

/// How long the trees of a world have to end once every fault stops: under a declared
/// concurrency, a permit whose worker was killed while its call was under way holds its
/// place until it lapses ([`PERMIT_LEASE`]), so the drain lasts that much longer.
pub fn drain_limit(q: Option<&SimQuota>, drain: Duration) -> Duration {
    match q {
        Some(q) if q.limits.concurrent_requests.is_some() => drain + PERMIT_LEASE,
        _ => drain,
    }
}

/// The quota's invariants, for each model (each has the declared limits): no window of a
/// minute holds more grants than the declared rate, and no more calls were under way at
/// once than the declared concurrency.
pub fn check(q: &SimQuota, v: &mut Verdict) {
    let grants = q.grants();
    let mut by_key: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    // Only the limited provider's models have declared limits; a world may run agents
    // on other providers too (the definition versions' `alt`), whose grants the limiter
    // also records.
    let limited = format!("{PROVIDER}:");
    for g in grants.iter().filter(|g| g.key.starts_with(&limited)) {
        by_key.entry(g.key.as_str()).or_default().push(g.at_ms);
    }
    for (key, times) in &by_key {
        let mut times = times.clone();
        let Some(rpm) = q.limits.requests_per_minute else {
            break;
        };
        times.sort_unstable();
        for (i, t) in times.iter().enumerate() {
            let within = times[i..]
                .iter()
                .take_while(|u| **u < t.saturating_add(60_000))
                .count();
            if within as u64 > rpm {
                v.violations.push(format!(
                    "quota: {within} calls of {key} granted in the minute from {t} ms, the \
                     declared rate is {rpm} a minute"
                ));
                break;
            }
        }
    }
    if let Some(c) = q.limits.concurrent_requests {
        for (key, most) in q.most_at_once() {
            if most > c {
                v.violations.push(format!(
                    "quota: {most} calls of {key} under way at once, the declared \
                     concurrency is {c}"
                ));
            }
        }
    }
    // Every call the model received was granted: a call without leave would escape the
    // limit (a retry under an old permit is not one, the permit is asked for each call).
    let calls = q.calls.load(Ordering::Relaxed);
    let granted = by_key.values().map(Vec::len).sum::<usize>() as u64;
    if calls > granted {
        v.violations.push(format!(
            "quota: the model received {calls} calls, {granted} were granted"
        ));
    }
}
