//! Model quotas in the worker: a model call asks the runtime's [`Quota`] first; told to
//! wait, the session's job goes back to the queue until then (no worker slot is held
//! meanwhile) and the session is listed as waiting for quota; given leave, the call is
//! made and its permit given back with the real usage. What the provider's answers say of
//! their limits is shared through the same port, so one worker's 429 slows them all.
//!
//! No event records a wait: when a call is made does not change what the model is sent,
//! and the log records the call (`ModelCalled`) as before, so replay reads the same
//! thing. A crash while waiting loses nothing either: the job is in the queue, with a
//! delay, and the waiter's place lapses from the quota's list after
//! [`skein_ports::quota::WAITER_LAPSE_MS`].

use std::sync::Arc;
use std::time::Duration;

use skein_core::{ModelRequest, SessionId};
use skein_ports::quota::{Decision, Learned, Permit, Quota, QuotaAsk, QuotaLimits, QuotaWaiter};

use crate::runtime::{lock, Runtime};
use crate::Result;

/// A wait this short is waited in place, with the job held.
const SHORT_WAIT_MS: u64 = 50;
/// A session's job comes back this much before its turn, so that claiming it again and
/// reading its log do not make the call late (it waits the rest in place).
const COME_BACK_EARLY_MS: u64 = 25;

/// A permit held for one call, with what its release needs.
pub(crate) struct Held {
    pub(crate) quota: Arc<dyn Quota>,
    pub(crate) permit: Option<Permit>,
    pub(crate) key: String,
    pub(crate) limits: QuotaLimits,
}

impl Drop for Held {
    /// A step abandoned while its call was under way (a session's `limits.timeout` ran
    /// out) gives its permit back too; else its place under `concurrent_requests` would
    /// be held until the permit lapses, stopping every call of the model meanwhile.
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (quota, limits) = (self.quota.clone(), self.limits);
        rt.spawn(async move {
            if let Err(e) = quota.release(&permit, &limits, None).await {
                tracing::warn!(key = %permit.key, error = %e.report(), "cannot give a quota permit back; it lapses");
            }
        });
    }
}

impl Held {
    /// What keeps this permit's place while its call runs: the quota, the permit and the
    /// limits, owned, so that the renewals need no borrow of the permit's holder. None
    /// when the permit holds no place (no concurrency limit).
    pub(crate) fn renewal(&self) -> Option<(Arc<dyn Quota>, Permit, QuotaLimits)> {
        let permit = self.permit.clone()?;
        self.limits
            .concurrent_requests
            .is_some()
            .then(|| (self.quota.clone(), permit, self.limits))
    }
}

/// The declared limits of a model, as the port takes them.
fn port_limits(l: skein_llm::Limits) -> QuotaLimits {
    QuotaLimits {
        requests_per_minute: l.requests_per_minute,
        input_tokens_per_minute: l.input_tokens_per_minute,
        output_tokens_per_minute: l.output_tokens_per_minute,
        concurrent_requests: l.concurrent_requests,
    }
}

/// What a provider's answer said, as the port takes it.
pub(crate) fn learned(i: &skein_llm::ratelimit::RateLimitInfo) -> Learned {
    let ms = |d: Option<Duration>| d.map(|d| d.as_millis() as u64);
    Learned {
        retry_after_ms: ms(i.retry_after).or((i.status == 429).then_some(1_000)),
        requests_limit: i.requests_limit,
        requests_remaining: i.requests_remaining,
        requests_reset_ms: ms(i.requests_reset),
        tokens_limit: i.tokens_limit,
        tokens_remaining: i.tokens_remaining,
        tokens_reset_ms: ms(i.tokens_reset),
    }
}

/// What asking for quota came to.
pub(crate) enum Asked {
    /// No quota applies (none is set, or the model is `scripted`).
    Free,
    Go(Held),
    /// The session waits; its job goes back until then.
    Wait,
}

impl Runtime {
    /// The model quotas this runtime asks: its backend's shared ones, else its own.
    pub fn quota(&self) -> Option<&Arc<dyn Quota>> {
        self.quota.get()
    }

    /// Every session this process told to wait for quota, whose job is back in the queue.
    pub fn waiting_for_quota(&self) -> Vec<QuotaWaiter> {
        lock(&self.quota_waits).values().cloned().collect()
    }

    /// Asks for quota for `request` of session `id`, at `priority` (higher goes first).
    pub(crate) async fn ask_quota(
        &self,
        id: &SessionId,
        request: &ModelRequest,
        priority: i32,
    ) -> Result<Asked> {
        let Some(quota) = self.quota.get() else {
            return Ok(Asked::Free);
        };
        let Some((key, limits)) = self.models.limits(&request.model) else {
            return Ok(Asked::Free);
        };
        let limits = port_limits(limits);
        let ask = QuotaAsk {
            key: key.clone(),
            session: id.as_str().to_string(),
            root: id.root_id().as_str().to_string(),
            priority,
            input_tokens: skein_llm::estimate_usage(request, &Default::default()).input_tokens,
        };
        // A turn that comes within moments is waited for here: handing the job back
        // and claiming it again takes about as long, and a late call loses its slot.
        let mut decision = quota.acquire(&ask, &limits).await?;
        for _ in 0..4 {
            let Decision::Wait { until_ms, .. } = &decision else {
                break;
            };
            let left = until_ms.saturating_sub(self.cfg.clock.now_ms());
            if left > SHORT_WAIT_MS {
                break;
            }
            tokio::time::sleep(Duration::from_millis(left)).await;
            decision = quota.acquire(&ask, &limits).await?;
        }
        match decision {
            Decision::Go(permit) => {
                crate::metrics::quota_granted(&key, permit.waited_ms, permit.queue);
                if lock(&self.quota_waits).remove(id.as_str()).is_some() {
                    self.progress_note(id, "QuotaGranted");
                }
                Ok(Asked::Go(Held {
                    quota: quota.clone(),
                    permit: Some(permit),
                    key,
                    limits,
                }))
            }
            Decision::Wait {
                until_ms,
                reason,
                queue,
            } => {
                crate::metrics::quota_throttled(&key, queue);
                let now = self.cfg.clock.now_ms();
                let mut waits = lock(&self.quota_waits);
                let new = !waits.contains_key(id.as_str());
                let since = waits.get(id.as_str()).map_or(now, |w| w.since_ms);
                waits.insert(
                    id.as_str().to_string(),
                    QuotaWaiter {
                        key,
                        session: id.as_str().to_string(),
                        root: ask.root,
                        since_ms: since,
                        due_ms: until_ms,
                        reason: reason.clone(),
                    },
                );
                drop(waits);
                lock(&self.quota_pending).insert(id.as_str().to_string());
                if new {
                    tracing::debug!(session = %id, %reason, "waiting for quota");
                    self.progress_note(id, "WaitingForQuota");
                }
                Ok(Asked::Wait)
            }
        }
    }

    /// The call is over: what its answers said of their limits is shared, and its
    /// permit given back with the usage (none when it failed).
    pub(crate) async fn after_call(
        &self,
        held: Option<&mut Held>,
        key_of: &str,
        heard: &[skein_llm::ratelimit::RateLimitInfo],
        used: Option<(u64, u64)>,
    ) {
        let Some(quota) = held
            .as_ref()
            .map(|h| h.quota.clone())
            .or_else(|| self.quota.get().cloned())
        else {
            return;
        };
        let key = held
            .as_ref()
            .map(|h| h.key.clone())
            .or_else(|| self.models.limits(key_of).map(|(k, _)| k));
        let Some(key) = key else { return };
        for info in heard {
            if info.status == 429 {
                crate::metrics::rate_limited(&key);
            }
            if let Err(e) = quota.learn(&key, &learned(info)).await {
                tracing::warn!(key, error = %e.report(), "cannot share what the provider said of its limits");
            }
        }
        if let Some(h) = held {
            if let Some(p) = h.permit.take() {
                if let Err(e) = h.quota.release(&p, &h.limits, used).await {
                    tracing::warn!(key, error = %e.report(), "cannot give a quota permit back; it lapses");
                }
            }
        }
    }

    /// When the session's job should come back, if its step in this job was told to
    /// wait for quota. A job that ended without waiting ends the session's listing.
    pub(crate) fn take_quota_wait(&self, session: &SessionId) -> Option<Duration> {
        if !lock(&self.quota_pending).remove(session.as_str()) {
            lock(&self.quota_waits).remove(session.as_str());
            return None;
        }
        let waits = lock(&self.quota_waits);
        let w = waits.get(session.as_str())?;
        let now = self.cfg.clock.now_ms();
        Some(Duration::from_millis(
            w.due_ms
                .saturating_sub(now)
                .saturating_sub(COME_BACK_EARLY_MS),
        ))
    }

    /// Whether this job's step was told to wait for quota (the drive stops there).
    pub(crate) fn quota_pending(&self, session: &SessionId) -> bool {
        lock(&self.quota_pending).contains(session.as_str())
    }

    /// Whether `session` waits for quota, here or, by the shared list, anywhere.
    pub(crate) async fn waits_for_quota(&self, session: &SessionId) -> bool {
        if lock(&self.quota_waits).contains_key(session.as_str()) {
            return true;
        }
        let Some(q) = self.quota.get() else {
            return false;
        };
        q.waiting()
            .await
            .map(|ws| ws.iter().any(|w| w.session == session.as_str()))
            .unwrap_or(false)
    }
}
