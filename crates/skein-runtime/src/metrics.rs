//! What a worker counts, through the `metrics` facade: nothing is recorded unless the
//! process installs a recorder (`skein worker --http` installs the Prometheus one), so the
//! embedded commands pay only for a few no-op calls.
//!
//! Every name is listed in [`NAMES`] with its help text; docs/operations.md explains them.

use std::time::{Duration, Instant};

use skein_core::Usage;

pub const JOBS_CLAIMED: &str = "skein_jobs_claimed_total";
pub const JOBS_ACKED: &str = "skein_jobs_acked_total";
pub const JOBS_REDELIVERED: &str = "skein_jobs_redelivered_total";
pub const JOBS_HANDED_BACK: &str = "skein_jobs_handed_back_total";
pub const JOBS_LACKING: &str = "skein_jobs_lacking_total";
pub const JOBS_DEAD_LETTERED: &str = "skein_jobs_dead_lettered_total";
pub const STEP_DURATION: &str = "skein_step_duration_seconds";
pub const MODEL_CALL_DURATION: &str = "skein_model_call_duration_seconds";
pub const MODEL_CALL_ERRORS: &str = "skein_model_call_errors_total";
pub const MODEL_TOKENS: &str = "skein_model_tokens_total";
pub const MODEL_COST: &str = "skein_model_cost_usd";
pub const SESSIONS_IN_FLIGHT: &str = "skein_sessions_in_flight";
pub const QUEUE_DEPTH: &str = "skein_queue_depth";
pub const INTAKE_ACCEPTED: &str = "skein_intake_accepted_total";
pub const INTAKE_REJECTED: &str = "skein_intake_rejected_total";
pub const NATS_RECONNECTS: &str = "skein_nats_reconnects_total";
/// Written by the NATS backend's group commit (`skein_nats` names it the same).
pub const NATS_BATCHES: &str = "skein_nats_append_batches_total";
pub const READY: &str = "skein_ready";
pub const WAITING_FOR_ROOM: &str = "skein_sessions_waiting_for_room";
pub const QUOTA_QUEUE: &str = "skein_quota_queue_length";
pub const QUOTA_WAIT: &str = "skein_quota_wait_seconds";
pub const QUOTA_THROTTLED: &str = "skein_quota_throttled_total";
pub const MODEL_RATE_LIMITED: &str = "skein_model_rate_limited_total";
pub const GC_REMOVED_TREES: &str = "skein_gc_removed_trees_total";
pub const GC_REMOVED_SESSIONS: &str = "skein_gc_removed_sessions_total";
pub const GC_REMOVED_BYTES: &str = "skein_gc_removed_bytes_total";

/// Every metric with its help text.
pub const NAMES: &[(&str, &str)] = &[
    (
        QUOTA_QUEUE,
        "Sessions waiting for a model's quota, by provider:model, as last seen by this \
         worker (the cluster's whole queue when the quota is shared).",
    ),
    (
        QUOTA_WAIT,
        "Time a model call waited for its quota before it was made, by provider:model.",
    ),
    (
        QUOTA_THROTTLED,
        "Times a model call was told to wait for quota (its job goes back until then), by \
         provider:model.",
    ),
    (
        MODEL_RATE_LIMITED,
        "429 answers (rate limited) heard from providers, by provider:model.",
    ),
    (
        WAITING_FOR_ROOM,
        "Sessions whose step waits for room in the store (a full disk, a JetStream store \
         at its limits); they run on once there is room.",
    ),
    (JOBS_CLAIMED, "Jobs claimed, by pool."),
    (JOBS_ACKED, "Jobs acknowledged as done, by pool."),
    (
        JOBS_REDELIVERED,
        "Jobs claimed again after an earlier delivery did not finish, by pool.",
    ),
    (
        JOBS_HANDED_BACK,
        "Jobs handed back to the queue (nak), by pool and reason.",
    ),
    (
        JOBS_LACKING,
        "Jobs and submissions this worker handed back because it lacks what they need \
         (an agent, a model provider), by what it lacks.",
    ),
    (
        JOBS_DEAD_LETTERED,
        "Sessions failed or jobs dropped after max_deliver deliveries, by pool.",
    ),
    (STEP_DURATION, "Time a step took, by step kind."),
    (
        MODEL_CALL_DURATION,
        "Time a model call took, by provider:model and outcome.",
    ),
    (
        MODEL_CALL_ERRORS,
        "Model calls that failed, by provider:model.",
    ),
    (
        MODEL_TOKENS,
        "Tokens of model calls, by provider:model and direction (input, output).",
    ),
    (
        MODEL_COST,
        "Cost of model calls in US dollars since the process started, by provider:model.",
    ),
    (
        SESSIONS_IN_FLIGHT,
        "Sessions this worker is advancing now, by pool.",
    ),
    (
        QUEUE_DEPTH,
        "Jobs waiting or held in a pool, read when metrics are scraped.",
    ),
    (INTAKE_ACCEPTED, "Submissions accepted by intake."),
    (
        INTAKE_REJECTED,
        "Submissions rejected by intake, by reason.",
    ),
    (
        NATS_RECONNECTS,
        "Times the NATS connection was made again after it was lost.",
    ),
    (
        NATS_BATCHES,
        "Atomic batches of writes sent by group commit (nats.group_commit), by outcome: committed whole, or published again apart.",
    ),
    (READY, "1 while the worker is ready (see /readyz), else 0."),
    (
        GC_REMOVED_TREES,
        "Finished trees removed by retention (`nats.retain_finished`, `skein gc`).",
    ),
    (
        GC_REMOVED_SESSIONS,
        "Sessions of the trees removed by retention.",
    ),
    (
        GC_REMOVED_BYTES,
        "Bytes of records of the trees removed by retention.",
    ),
];

/// Trees removed by retention, with their sessions and the bytes of their records.
pub fn gc_removed(trees: u64, sessions: u64, bytes: u64) {
    metrics::counter!(GC_REMOVED_TREES).increment(trees);
    metrics::counter!(GC_REMOVED_SESSIONS).increment(sessions);
    metrics::counter!(GC_REMOVED_BYTES).increment(bytes);
}

/// Upper bounds of the duration histograms, in seconds.
pub const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A job claimed from `pool`; `attempt` > 1 is a redelivery.
pub fn job_claimed(pool: &str, attempt: u32) {
    metrics::counter!(JOBS_CLAIMED, "pool" => pool.to_string()).increment(1);
    if attempt > 1 {
        metrics::counter!(JOBS_REDELIVERED, "pool" => pool.to_string()).increment(1);
    }
}

pub fn job_acked(pool: &str) {
    metrics::counter!(JOBS_ACKED, "pool" => pool.to_string()).increment(1);
}

/// A job handed back: `reason` is `failed` (a step failed) or `draining` (the worker
/// stops and abandoned its model call).
pub fn job_handed_back(pool: &str, reason: &'static str) {
    metrics::counter!(JOBS_HANDED_BACK, "pool" => pool.to_string(), "reason" => reason)
        .increment(1);
}

/// A job or submission handed back because this worker lacks `need`.
pub fn job_lacking(need: &str) {
    metrics::counter!(JOBS_LACKING, "need" => need.to_string()).increment(1);
}

pub fn job_dead_lettered(pool: &str) {
    metrics::counter!(JOBS_DEAD_LETTERED, "pool" => pool.to_string()).increment(1);
}

/// A finished model call of `model` (`provider:model`).
pub fn model_call(model: &str, took: Duration, usage: Option<&Usage>) {
    let outcome = if usage.is_some() { "ok" } else { "error" };
    metrics::histogram!(MODEL_CALL_DURATION, "model" => model.to_string(), "outcome" => outcome)
        .record(took.as_secs_f64());
    match usage {
        Some(u) => {
            metrics::counter!(MODEL_TOKENS, "model" => model.to_string(), "direction" => "input")
                .increment(u.input_tokens);
            metrics::counter!(MODEL_TOKENS, "model" => model.to_string(), "direction" => "output")
                .increment(u.output_tokens);
            if u.cost > 0.0 {
                metrics::gauge!(MODEL_COST, "model" => model.to_string()).increment(u.cost);
            }
        }
        None => metrics::counter!(MODEL_CALL_ERRORS, "model" => model.to_string()).increment(1),
    }
}

/// Times one step: recorded under its kind when dropped, whether it succeeded or not.
pub struct StepTimer {
    kind: &'static str,
    started: Instant,
}

impl StepTimer {
    pub fn start(kind: &'static str) -> Self {
        Self {
            kind,
            started: Instant::now(),
        }
    }
}

impl Drop for StepTimer {
    fn drop(&mut self) {
        metrics::histogram!(STEP_DURATION, "kind" => self.kind)
            .record(self.started.elapsed().as_secs_f64());
    }
}

/// Counts a session as in flight in `pool` while it lives.
pub struct InFlight(String);

impl InFlight {
    pub fn enter(pool: &str) -> Self {
        metrics::gauge!(SESSIONS_IN_FLIGHT, "pool" => pool.to_string()).increment(1.0);
        Self(pool.to_string())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!(SESSIONS_IN_FLIGHT, "pool" => self.0.clone()).decrement(1.0);
    }
}

/// Records `depth` jobs in `pool`.
pub fn queue_depth(pool: &str, depth: u64) {
    metrics::gauge!(QUEUE_DEPTH, "pool" => pool.to_string()).set(depth as f64);
}

pub fn intake_accepted() {
    metrics::counter!(INTAKE_ACCEPTED).increment(1);
}

/// `reason`: `malformed` (not a submission), `unknown_agent`, or `invalid` (refused by a
/// limit or a check).
pub fn intake_rejected(reason: &'static str) {
    metrics::counter!(INTAKE_REJECTED, "reason" => reason).increment(1);
}

pub fn nats_reconnected() {
    metrics::counter!(NATS_RECONNECTS).increment(1);
}

/// A call of `model` got its quota after `waited_ms`, with `queue` still waiting.
pub fn quota_granted(model: &str, waited_ms: u64, queue: u64) {
    metrics::histogram!(QUOTA_WAIT, "model" => model.to_string()).record(waited_ms as f64 / 1000.0);
    metrics::gauge!(QUOTA_QUEUE, "model" => model.to_string()).set(queue as f64);
}

/// A call of `model` was told to wait, with `queue` waiting.
pub fn quota_throttled(model: &str, queue: u64) {
    metrics::counter!(QUOTA_THROTTLED, "model" => model.to_string()).increment(1);
    metrics::gauge!(QUOTA_QUEUE, "model" => model.to_string()).set(queue as f64);
}

/// A provider answered 429 to a call of `model`.
pub fn rate_limited(model: &str) {
    metrics::counter!(MODEL_RATE_LIMITED, "model" => model.to_string()).increment(1);
}

/// How many sessions wait for room in the store now.
pub fn waiting_for_room(n: usize) {
    metrics::gauge!(WAITING_FOR_ROOM).set(n as f64);
}

pub fn ready(ready: bool) {
    metrics::gauge!(READY).set(if ready { 1.0 } else { 0.0 });
}
