//! Model quotas shared by every worker: the [`Quota`] port, and the state of one
//! `provider:model` key ([`Bucket`]) that every implementation keeps, in memory
//! ([`LocalQuota`]) or in a store that workers share.
//!
//! A worker asks before each model call ([`Quota::acquire`]) and is told to go, with a
//! [`Permit`], or to come back at a time; it gives the permit back with the call's real
//! usage ([`Quota::release`]), and tells what the provider's answers said of its limits
//! ([`Quota::learn`]), so every worker slows down when one hears a 429.
//!
//! How a [`Bucket`] decides:
//! - **Rate** (requests, input and output tokens a minute): the calls are spaced evenly,
//!   a request every `60 s ÷ rpm`, a call of `n` input tokens taking `n` tokens' worth of
//!   the minute (a generic cell rate: one "next free" time per figure, no burst). So no
//!   window of a minute ever holds more than the rate.
//! - **Concurrency**: at most `concurrent_requests` permits out at once. A permit holds
//!   its place for [`PERMIT_LEASE`], renewed every [`PERMIT_RENEW`] while its call runs
//!   ([`Quota::renew`]); one whose worker died is renewed no more and lapses.
//! - **Learned**: a `Retry-After`, or a provider's remaining count of 0 with its reset,
//!   pauses the key until then; a limit the provider states (`x-ratelimit-limit-requests`)
//!   is used where none is declared.
//! - **Fairness**: whoever is told to wait is listed with its tree's root. The waiters
//!   are served round-robin across roots (roots served least recently first), so a wide
//!   tree cannot starve a small one; a higher priority goes first.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::Result;

/// How long a permit holds a place under `concurrent_requests` without being renewed or
/// given back: how long a worker that died during a call keeps its model's place.
pub const PERMIT_LEASE_MS: u64 = 60 * 1000;
/// See [`PERMIT_LEASE_MS`].
pub const PERMIT_LEASE: std::time::Duration = std::time::Duration::from_millis(PERMIT_LEASE_MS);
/// How often a call under way renews its permit: a third of the lease, so that two
/// renewals in a row may fail (a leader election of the shared store) before it lapses.
pub const PERMIT_RENEW: std::time::Duration = std::time::Duration::from_millis(PERMIT_LEASE_MS / 3);
/// A waiter that has not asked again this long after the time it was given is dropped
/// (its worker died; the job comes back, and asks again).
pub const WAITER_LAPSE_MS: u64 = 30_000;
/// A waiter whose time has come holds back those behind it for this long; one later
/// than that is passed over until it asks again.
pub const WAITER_GRACE_MS: u64 = 200;
/// How soon a call held back by `concurrent_requests` alone asks again.
pub const CONCURRENCY_POLL_MS: u64 = 200;
/// The rate is kept this fraction under the declared one, so that the calls' trips to
/// the provider, which vary a little, never bring two closer than the provider counts.
pub const RATE_MARGIN: f64 = 0.01;

/// Limits of one key, as declared (`[models.providers.NAME.limits]`). None: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaLimits {
    pub requests_per_minute: Option<u64>,
    pub input_tokens_per_minute: Option<u64>,
    pub output_tokens_per_minute: Option<u64>,
    pub concurrent_requests: Option<u64>,
}

/// One call's request for quota.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaAsk {
    /// `provider:model`.
    pub key: String,
    pub session: String,
    /// The root of the session's tree: the unit of fairness.
    pub root: String,
    /// Higher goes first (0 by default).
    pub priority: i32,
    /// The request's size, estimated.
    pub input_tokens: u64,
}

/// Leave to make one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Permit {
    pub key: String,
    pub id: String,
    /// Input tokens charged when it was given.
    pub input_tokens: u64,
    /// How long its session waited for it, in ms (0: it went at once).
    pub waited_ms: u64,
    /// Sessions still waiting for the key when it was given.
    #[serde(default)]
    pub queue: u64,
}

/// What [`Quota::acquire`] answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Go(Permit),
    /// Ask again at `until_ms` (ms since the epoch); `reason` says which limit holds it;
    /// `queue` sessions wait for the key (this one included).
    Wait {
        until_ms: u64,
        reason: String,
        queue: u64,
    },
}

/// What a provider's answer said of its limits (from its headers).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Learned {
    /// A 429's `Retry-After`, in ms.
    pub retry_after_ms: Option<u64>,
    /// Requests a minute the provider says the key may make.
    pub requests_limit: Option<u64>,
    pub requests_remaining: Option<u64>,
    /// When the request count is full again, in ms from now.
    pub requests_reset_ms: Option<u64>,
    /// Tokens a minute.
    pub tokens_limit: Option<u64>,
    pub tokens_remaining: Option<u64>,
    pub tokens_reset_ms: Option<u64>,
}

impl Learned {
    pub fn is_empty(&self) -> bool {
        *self == Learned::default()
    }
}

/// A session waiting for quota, as listed to people (`skein tree`, the UI).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuotaWaiter {
    pub key: String,
    pub session: String,
    pub root: String,
    /// Since when it waits, ms since the epoch.
    pub since_ms: u64,
    /// When it was told to ask again.
    pub due_ms: u64,
    pub reason: String,
}

/// Model quotas, shared by every worker that shares this port.
#[async_trait]
pub trait Quota: Send + Sync {
    /// Leave for one call under `limits` (the declared ones; learned ones are kept
    /// here), or the time to ask again.
    async fn acquire(&self, ask: &QuotaAsk, limits: &QuotaLimits) -> Result<Decision>;

    /// The call is over: its place under `concurrent_requests` is free, and the tokens
    /// charged are corrected to what it used (`None`: it failed before using any).
    async fn release(
        &self,
        permit: &Permit,
        limits: &QuotaLimits,
        used: Option<(u64, u64)>,
    ) -> Result<()>;

    /// The call of `permit` is still under way: its place is held for another
    /// [`PERMIT_LEASE`] from now (taken again if it had lapsed, since the call runs).
    async fn renew(&self, permit: &Permit, limits: &QuotaLimits) -> Result<()>;

    /// What a provider's answer said of `key`'s limits.
    async fn learn(&self, key: &str, learned: &Learned) -> Result<()>;

    /// Every session waiting for quota now.
    async fn waiting(&self) -> Result<Vec<QuotaWaiter>>;
}

/// One waiter of a [`Bucket`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    pub root: String,
    #[serde(default)]
    pub priority: i32,
    pub since: u64,
    /// When it was told to ask again.
    pub due: u64,
}

/// The state of one key: when each rate is free next, what was learned, the permits out,
/// and who waits. Serialized as it is into a shared store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// When the next request may go (ms; fractional so that spacing does not drift).
    #[serde(default)]
    pub next_request: f64,
    #[serde(default)]
    pub next_input: f64,
    #[serde(default)]
    pub next_output: f64,
    /// Learned: no call before this.
    #[serde(default)]
    pub paused_until: u64,
    #[serde(default)]
    pub learned_rpm: Option<u64>,
    #[serde(default)]
    pub learned_tpm: Option<u64>,
    /// Permits out: id → until when they hold.
    #[serde(default)]
    pub permits: BTreeMap<String, u64>,
    /// Waiting sessions by id.
    #[serde(default)]
    pub waiters: BTreeMap<String, Waiter>,
    /// Roots served: root → the serving count when last served (a round-robin clock).
    #[serde(default)]
    pub served: BTreeMap<String, u64>,
    #[serde(default)]
    pub serial: u64,
    /// Why the last waiter was told to wait (one for all: the entry is read and written
    /// at every call, so it is kept small).
    #[serde(default)]
    pub reason: String,
}

/// Milliseconds a call of `amount` takes out of a rate of `per_minute`.
fn spacing(amount: u64, per_minute: u64) -> f64 {
    amount as f64 * 60_000.0 / (per_minute as f64 * (1.0 - RATE_MARGIN))
}

impl Bucket {
    /// Drops lapsed permits and waiters, and the round-robin marks of roots that wait no
    /// more (the oldest first, once there are many).
    fn tidy(&mut self, now: u64) {
        self.permits.retain(|_, until| *until > now);
        self.waiters
            .retain(|_, w| w.due.saturating_add(WAITER_LAPSE_MS) > now);
        if self.served.len() > 64 {
            let waiting: std::collections::BTreeSet<&String> =
                self.waiters.values().map(|w| &w.root).collect();
            let mut idle: Vec<(u64, String)> = self
                .served
                .iter()
                .filter(|(r, _)| !waiting.contains(r))
                .map(|(r, s)| (*s, r.clone()))
                .collect();
            idle.sort();
            let drop = self.served.len() - 64;
            for (_, r) in idle.into_iter().take(drop) {
                self.served.remove(&r);
            }
        }
    }

    /// The requests-a-minute rate in force: declared, else learned.
    pub fn rpm(&self, limits: &QuotaLimits) -> Option<u64> {
        limits.requests_per_minute.or(self.learned_rpm)
    }

    fn input_tpm(&self, limits: &QuotaLimits) -> Option<u64> {
        limits.input_tokens_per_minute.or(self.learned_tpm)
    }

    /// Whether nothing limits the key: no figure declared or learned, no pause, nobody
    /// waiting. Such a call goes without changing the state.
    pub fn is_free(&self, limits: &QuotaLimits, now: u64) -> bool {
        *limits == QuotaLimits::default()
            && self.learned_rpm.is_none()
            && self.learned_tpm.is_none()
            && self.paused_until <= now
            && self.waiters.is_empty()
    }

    /// The waiters in the order they are served: by priority, then round-robin across
    /// roots (the root served least recently first, then the one waiting longest), each
    /// root's own waiters by how long they wait.
    pub fn order(&self) -> Vec<String> {
        let mut roots: BTreeMap<&str, Vec<(&String, &Waiter)>> = BTreeMap::new();
        for (s, w) in &self.waiters {
            roots.entry(w.root.as_str()).or_default().push((s, w));
        }
        let mut queues: Vec<(i32, u64, u64, Vec<&String>)> = roots
            .into_iter()
            .map(|(root, mut ws)| {
                ws.sort_by(|a, b| {
                    b.1.priority
                        .cmp(&a.1.priority)
                        .then(a.1.since.cmp(&b.1.since))
                        .then(a.0.cmp(b.0))
                });
                let top = ws.iter().map(|(_, w)| w.priority).max().unwrap_or(0);
                let oldest = ws.iter().map(|(_, w)| w.since).min().unwrap_or(0);
                let served = self.served.get(root).copied().unwrap_or(0);
                (
                    top,
                    served,
                    oldest,
                    ws.into_iter().map(|(s, _)| s).collect(),
                )
            })
            .collect();
        queues.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut out = Vec::with_capacity(self.waiters.len());
        let longest = queues.iter().map(|q| q.3.len()).max().unwrap_or(0);
        // Priorities first: a queue of a higher top priority is emptied before the next
        // tier's round-robin.
        let mut tiers: Vec<Vec<&Vec<&String>>> = vec![];
        let mut last = None;
        for q in &queues {
            if last != Some(q.0) {
                tiers.push(vec![]);
                last = Some(q.0);
            }
            if let Some(t) = tiers.last_mut() {
                t.push(&q.3);
            }
        }
        for tier in tiers {
            for k in 0..longest {
                for q in &tier {
                    if let Some(s) = q.get(k) {
                        out.push((*s).clone());
                    }
                }
            }
        }
        out
    }

    /// Decides one ask at `now` (ms since the epoch); `permit_id` names the permit if one
    /// is given.
    pub fn acquire(
        &mut self,
        ask: &QuotaAsk,
        limits: &QuotaLimits,
        now: u64,
        permit_id: &str,
    ) -> Decision {
        if self.is_free(limits, now) {
            return Decision::Go(Permit {
                key: ask.key.clone(),
                id: permit_id.to_string(),
                input_tokens: ask.input_tokens,
                waited_ms: 0,
                queue: 0,
            });
        }
        self.tidy(now);
        let rpm = self.rpm(limits);
        let in_tpm = self.input_tpm(limits);
        let out_tpm = limits.output_tokens_per_minute;
        let nowf = now as f64;
        // When the rates and a learned pause let a call go.
        let mut ready = nowf.max(self.paused_until as f64);
        let mut why = if self.paused_until > now {
            "the provider said to wait (learned)"
        } else {
            ""
        };
        for (next, on, what) in [
            (self.next_request, rpm.is_some(), "requests per minute"),
            (self.next_input, in_tpm.is_some(), "input tokens per minute"),
            (
                self.next_output,
                out_tpm.is_some(),
                "output tokens per minute",
            ),
        ] {
            if on && next > ready {
                ready = next;
                why = what;
            }
        }
        let full = limits
            .concurrent_requests
            .is_some_and(|c| self.permits.len() as u64 >= c);
        let interval = rpm.map_or(0.0, |r| spacing(1, r));
        // Where this ask stands among those waiting.
        let since = self.waiters.get(&ask.session).map_or(now, |w| w.since);
        self.waiters.insert(
            ask.session.clone(),
            Waiter {
                root: ask.root.clone(),
                priority: ask.priority,
                since,
                due: now,
            },
        );
        let order = self.order();
        let rank = order.iter().position(|s| s == &ask.session).unwrap_or(0);
        // Those ahead hold this one back only while they are due now and not late: a
        // waiter told to come later, or one that did not come, does not idle the quota.
        let held_by = order[..rank]
            .iter()
            .filter_map(|s| self.waiters.get(s))
            .any(|w| w.due <= now && w.due.saturating_add(WAITER_GRACE_MS) >= now);
        if ready <= nowf && !full && !held_by {
            self.waiters.remove(&ask.session);
            self.serial += 1;
            self.served.insert(ask.root.clone(), self.serial);
            if let Some(r) = rpm {
                self.next_request = self.next_request.max(nowf) + spacing(1, r);
            }
            if let Some(t) = in_tpm {
                self.next_input = self.next_input.max(nowf) + spacing(ask.input_tokens, t);
            }
            if limits.concurrent_requests.is_some() {
                self.permits
                    .insert(permit_id.to_string(), now.saturating_add(PERMIT_LEASE_MS));
            }
            return Decision::Go(Permit {
                key: ask.key.clone(),
                id: permit_id.to_string(),
                input_tokens: ask.input_tokens,
                waited_ms: now.saturating_sub(since),
                queue: self.waiters.len() as u64,
            });
        }
        let (reason, until) = if ready > nowf {
            (why, ready + rank as f64 * interval)
        } else if full {
            (
                "concurrent requests",
                nowf + CONCURRENCY_POLL_MS as f64 + rank as f64 * interval,
            )
        } else {
            (
                "sessions of other trees go first",
                nowf + (rank as f64 * interval).max(1.0),
            )
        };
        let until = until.ceil() as u64;
        let reason = format!("waiting for quota of {}: {reason}", ask.key);
        if let Some(w) = self.waiters.get_mut(&ask.session) {
            w.due = until;
        }
        self.reason.clone_from(&reason);
        Decision::Wait {
            until_ms: until,
            reason,
            queue: self.waiters.len() as u64,
        }
    }

    /// Gives a permit back at `now`, correcting the tokens it charged by `used`.
    pub fn release(
        &mut self,
        permit: &Permit,
        limits: &QuotaLimits,
        used: Option<(u64, u64)>,
        now: u64,
    ) {
        self.permits.remove(&permit.id);
        let Some((input, output)) = used else {
            return;
        };
        if let Some(t) = self.input_tpm(limits) {
            let more = input as f64 - permit.input_tokens as f64;
            self.next_input += more * spacing(1, t);
        }
        if let Some(t) = limits.output_tokens_per_minute {
            self.next_output = self.next_output.max(now as f64) + spacing(output, t);
        }
    }

    /// Holds the place of permit `id` for another [`PERMIT_LEASE_MS`] from `now`, under a
    /// concurrency limit (without one no permit holds a place).
    pub fn renew(&mut self, id: &str, limits: &QuotaLimits, now: u64) {
        if limits.concurrent_requests.is_some() {
            self.permits
                .insert(id.to_string(), now.saturating_add(PERMIT_LEASE_MS));
        }
    }

    /// Takes in what a provider said at `now`; whether anything changed.
    pub fn learn(&mut self, l: &Learned, now: u64) -> bool {
        let before = self.clone();
        let mut pause = |ms: u64| {
            self.paused_until = self.paused_until.max(now.saturating_add(ms));
        };
        if let Some(ms) = l.retry_after_ms {
            pause(ms);
        }
        if l.requests_remaining == Some(0) {
            pause(l.requests_reset_ms.unwrap_or(1000));
        }
        if l.tokens_remaining == Some(0) {
            pause(l.tokens_reset_ms.unwrap_or(1000));
        }
        if let Some(n) = l.requests_limit.filter(|n| *n > 0) {
            self.learned_rpm = Some(n);
        }
        if let Some(n) = l.tokens_limit.filter(|n| *n > 0) {
            self.learned_tpm = Some(n);
        }
        *self != before
    }

    /// The waiters, for people.
    pub fn listed(&self, key: &str) -> Vec<QuotaWaiter> {
        self.waiters
            .iter()
            .map(|(s, w)| QuotaWaiter {
                key: key.to_string(),
                session: s.clone(),
                root: w.root.clone(),
                since_ms: w.since,
                due_ms: w.due,
                reason: self.reason.clone(),
            })
            .collect()
    }
}

/// A clock in ms since the epoch, for a [`LocalQuota`] that does not run on the system's.
pub type ClockFn = std::sync::Arc<dyn Fn() -> u64 + Send + Sync>;

/// The quotas of one process (the embedded backend): a [`Bucket`] per key in memory.
#[derive(Default)]
pub struct LocalQuota {
    buckets: Mutex<BTreeMap<String, Bucket>>,
    serial: std::sync::atomic::AtomicU64,
    /// None: the system's clock.
    clock: Option<ClockFn>,
}

impl LocalQuota {
    pub fn new() -> Self {
        Self::default()
    }

    /// Quotas that tell the time by `clock` (a simulation's virtual one).
    pub fn with_clock(clock: ClockFn) -> Self {
        Self {
            clock: Some(clock),
            ..Self::default()
        }
    }

    fn now(&self) -> u64 {
        self.clock.as_ref().map_or_else(crate::now_ms, |c| c())
    }

    fn with<T>(&self, key: &str, f: impl FnOnce(&mut Bucket) -> T) -> T {
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        f(b.entry(key.to_string()).or_default())
    }
}

#[async_trait]
impl Quota for LocalQuota {
    async fn acquire(&self, ask: &QuotaAsk, limits: &QuotaLimits) -> Result<Decision> {
        let id = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_string();
        let now = self.now();
        Ok(self.with(&ask.key, |b| b.acquire(ask, limits, now, &id)))
    }

    async fn release(
        &self,
        permit: &Permit,
        limits: &QuotaLimits,
        used: Option<(u64, u64)>,
    ) -> Result<()> {
        let now = self.now();
        self.with(&permit.key, |b| b.release(permit, limits, used, now));
        Ok(())
    }

    async fn renew(&self, permit: &Permit, limits: &QuotaLimits) -> Result<()> {
        let now = self.now();
        self.with(&permit.key, |b| b.renew(&permit.id, limits, now));
        Ok(())
    }

    async fn learn(&self, key: &str, learned: &Learned) -> Result<()> {
        let now = self.now();
        self.with(key, |b| b.learn(learned, now));
        Ok(())
    }

    async fn waiting(&self) -> Result<Vec<QuotaWaiter>> {
        let b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.now();
        Ok(b.iter()
            .flat_map(|(k, b)| {
                b.listed(k)
                    .into_iter()
                    .filter(move |w| w.due_ms.saturating_add(WAITER_LAPSE_MS) > now)
            })
            .collect())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ask(session: &str, root: &str) -> QuotaAsk {
        QuotaAsk {
            key: "p:m".into(),
            session: session.into(),
            root: root.into(),
            priority: 0,
            input_tokens: 10,
        }
    }

    /// Every session asks again exactly when told; returns the order of grants and
    /// their times.
    fn run(b: &mut Bucket, limits: &QuotaLimits, asks: &[(u64, QuotaAsk)]) -> Vec<(u64, String)> {
        let mut due: Vec<(u64, QuotaAsk)> = asks.to_vec();
        let mut out = vec![];
        let mut n = 0;
        while !due.is_empty() {
            due.sort_by_key(|(t, a)| (*t, a.session.clone()));
            let (t, a) = due.remove(0);
            n += 1;
            match b.acquire(&a, limits, t, &n.to_string()) {
                Decision::Go(_) => out.push((t, a.session.clone())),
                Decision::Wait { until_ms, .. } => {
                    assert!(until_ms >= t, "told to come back in the past");
                    due.push((until_ms, a))
                }
            }
            assert!(n < 100_000, "no end");
        }
        out
    }

    #[test]
    fn the_rate_is_never_exceeded_in_any_minute() {
        let limits = QuotaLimits {
            requests_per_minute: Some(600),
            ..Default::default()
        };
        let mut b = Bucket::default();
        let asks: Vec<_> = (0..700)
            .map(|i| (1_000 + i as u64 % 7, ask(&format!("s{i:04}"), "r")))
            .collect();
        let grants = run(&mut b, &limits, &asks);
        assert_eq!(grants.len(), 700);
        let times: Vec<u64> = grants.iter().map(|g| g.0).collect();
        for (i, t) in times.iter().enumerate() {
            let in_window = times[i..].iter().take_while(|u| **u < t + 60_000).count();
            assert!(
                in_window <= 600,
                "{in_window} requests in the minute from {t}"
            );
        }
        // And the quota is used: the last grant comes close to the floor of 700 ÷ 600/min.
        let span = times.last().unwrap() - times[0];
        assert!(span <= 70_000 * 102 / 100, "{span} ms for 700 requests");
    }

    #[test]
    fn a_small_tree_asking_later_is_served_before_a_wide_one_ends() {
        let limits = QuotaLimits {
            requests_per_minute: Some(60),
            ..Default::default()
        };
        let mut b = Bucket::default();
        let mut asks: Vec<_> = (0..50)
            .map(|i| (0, ask(&format!("wide{i:02}"), "wide")))
            .collect();
        asks.push((5_000, ask("small", "small")));
        let grants = run(&mut b, &limits, &asks);
        let at = grants.iter().position(|g| g.1 == "small").unwrap();
        assert!(at <= 8, "the small tree went {at}th: {grants:?}");
    }

    #[test]
    fn tokens_are_charged_by_estimate_then_by_use() {
        let limits = QuotaLimits {
            input_tokens_per_minute: Some(1000),
            output_tokens_per_minute: Some(600),
            ..Default::default()
        };
        let mut b = Bucket::default();
        let mut a = ask("a", "r");
        a.input_tokens = 500;
        let Decision::Go(p) = b.acquire(&a, &limits, 0, "1") else {
            panic!("the first call waits")
        };
        // Half a minute's input is charged; the next call waits for it.
        let Decision::Wait {
            until_ms, reason, ..
        } = b.acquire(&ask("b", "r"), &limits, 10, "2")
        else {
            panic!("no wait")
        };
        assert!((30_000..=31_000).contains(&until_ms), "{until_ms}");
        assert!(reason.contains("input tokens"), "{reason}");
        // It used 100 input and 300 output tokens: the input is mostly given back, the
        // output charged.
        b.release(&p, &limits, Some((100, 300)), 20);
        let Decision::Wait {
            until_ms, reason, ..
        } = b.acquire(&ask("b", "r"), &limits, 30, "3")
        else {
            panic!("no wait")
        };
        assert!(reason.contains("output tokens"), "{reason}");
        assert!((30_000..=31_000).contains(&until_ms), "{until_ms}");
    }

    #[test]
    fn concurrency_holds_and_lapses() {
        let limits = QuotaLimits {
            concurrent_requests: Some(1),
            ..Default::default()
        };
        let mut b = Bucket::default();
        let Decision::Go(p) = b.acquire(&ask("a", "r"), &limits, 0, "1") else {
            panic!()
        };
        assert!(matches!(
            b.acquire(&ask("b", "r"), &limits, 1, "2"),
            Decision::Wait { .. }
        ));
        b.release(&p, &limits, None, 2);
        assert!(matches!(
            b.acquire(&ask("b", "r"), &limits, 3, "3"),
            Decision::Go(_)
        ));
        // Never given back: it lapses.
        assert!(matches!(
            b.acquire(&ask("c", "r"), &limits, 4, "4"),
            Decision::Wait { .. }
        ));
        assert!(matches!(
            b.acquire(&ask("c", "r"), &limits, 4 + PERMIT_LEASE_MS, "5"),
            Decision::Go(_)
        ));
    }

    #[test]
    fn learned_pauses_and_rates_hold_every_caller() {
        let none = QuotaLimits::default();
        let mut b = Bucket::default();
        assert!(b.is_free(&none, 0));
        assert!(b.learn(
            &Learned {
                retry_after_ms: Some(2_000),
                requests_limit: Some(120),
                ..Default::default()
            },
            100
        ));
        assert!(!b.is_free(&none, 100));
        let Decision::Wait {
            until_ms, reason, ..
        } = b.acquire(&ask("a", "r"), &none, 200, "1")
        else {
            panic!()
        };
        assert_eq!(until_ms, 2_100);
        assert!(reason.contains("learned"), "{reason}");
        assert!(matches!(
            b.acquire(&ask("a", "r"), &none, 2_100, "2"),
            Decision::Go(_)
        ));
        // The learned rate spaces the next.
        assert!(matches!(
            b.acquire(&ask("b", "r"), &none, 2_101, "3"),
            Decision::Wait { .. }
        ));
        assert!(!b.learn(&Learned::default(), 3_000), "nothing new");
        // A remaining count of zero pauses until its reset.
        b.learn(
            &Learned {
                requests_remaining: Some(0),
                requests_reset_ms: Some(5_000),
                ..Default::default()
            },
            10_000,
        );
        assert_eq!(b.paused_until, 15_000);
    }

    #[test]
    fn a_waiter_that_never_comes_back_holds_no_one_for_long() {
        let limits = QuotaLimits {
            requests_per_minute: Some(600),
            ..Default::default()
        };
        let mut b = Bucket::default();
        assert!(matches!(
            b.acquire(&ask("a", "r"), &limits, 0, "1"),
            Decision::Go(_)
        ));
        let Decision::Wait { until_ms, .. } = b.acquire(&ask("gone", "r"), &limits, 1, "2") else {
            panic!()
        };
        // `gone` never asks again: `late` is held back at most the grace after its time.
        let grants = run(&mut b, &limits, &[(until_ms, ask("late", "r"))]);
        assert!(
            grants[0].0 <= until_ms + WAITER_GRACE_MS + 200,
            "{grants:?}"
        );
        // And it is dropped once it has lapsed.
        b.tidy(until_ms + WAITER_LAPSE_MS + 1);
        assert!(b.waiters.is_empty());
    }

    /// Many trees asking at random times, each waiter coming back late by a random
    /// amount or never (a crash, asking again only much later): under every seed no
    /// window of the rate's minute holds more than the rate, and every ask is served.
    #[test]
    fn random_trees_never_exceed_the_rate_and_all_are_served() {
        let limits = QuotaLimits {
            requests_per_minute: Some(120),
            ..Default::default()
        };
        for seed in 1..=20u64 {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut draw = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let mut b = Bucket::default();
            // (when it asks, ask)
            let mut due: Vec<(u64, QuotaAsk)> = (0..150)
                .map(|i| {
                    let root = format!("r{}", draw(6));
                    (draw(30_000), ask(&format!("s{i:03}"), &root))
                })
                .collect();
            let mut grants: Vec<u64> = vec![];
            let mut steps = 0;
            while !due.is_empty() {
                due.sort_by_key(|(t, a)| (*t, a.session.clone()));
                let (t, a) = due.remove(0);
                steps += 1;
                assert!(steps < 50_000, "seed {seed}: no end");
                match b.acquire(&a, &limits, t, &steps.to_string()) {
                    Decision::Go(_) => grants.push(t),
                    Decision::Wait { until_ms, .. } => {
                        assert!(until_ms >= t, "seed {seed}: told to come back in the past");
                        let back = match draw(20) {
                            0 => until_ms + 40_000, // gone, asks again much later
                            1..=4 => until_ms + draw(300),
                            _ => until_ms,
                        };
                        due.push((back, a));
                    }
                }
            }
            assert_eq!(grants.len(), 150, "seed {seed}");
            grants.sort();
            for (i, t) in grants.iter().enumerate() {
                let in_window = grants[i..].iter().take_while(|u| **u < t + 60_000).count();
                assert!(
                    in_window <= 120,
                    "seed {seed}: {in_window} in the minute from {t}"
                );
            }
        }
    }

    #[test]
    fn priority_goes_first() {
        let limits = QuotaLimits {
            requests_per_minute: Some(60),
            ..Default::default()
        };
        let mut b = Bucket::default();
        let mut asks: Vec<_> = (0..5).map(|i| (0, ask(&format!("low{i}"), "a"))).collect();
        let mut hi = ask("high", "b");
        hi.priority = 5;
        asks.push((1, hi));
        let grants = run(&mut b, &limits, &asks);
        assert_eq!(grants[0].1, "low0", "the first went at once");
        assert_eq!(grants[1].1, "high");
    }
}
