//! The worker: claims jobs, rebuilds a session from its log, asks the core for the next
//! step, performs its IO and appends the outcome — until the session waits or ends.
//!
//! Write-ahead: every event is durable before the effect it enables. `ModelCalled` before
//! any tool of its turn; `ToolCalled` before its tool runs; the children's `Submitted` and
//! the parent's `Delegated` before any child job is published. Only the holder of a
//! session's job writes its log; a finished child posts a notice to its parent and wakes
//! it, and the parent's worker records `ChildSettled` itself. Records whose only effect is
//! the next model call (settlements that let a turn go on, a turn of calls that may run
//! again with their results) are pipelined ahead of it: that call's append makes sure of
//! them first.
//!
//! [`Runtime::process`] loads a session and [`Runtime::drive`]s it: each step the core
//! decides is performed by the file of its kind —
//!
//! | step | file |
//! | --- | --- |
//! | `CallModel`, `Summarize` (its request is made here) | `model.rs` |
//! | `Delegate`, `Clarify` | `delegate.rs` |
//! | `RunTools` | `tools.rs` |
//! | `ProposePatch` (and result patches) | `plan.rs` |
//! | `Broadcast` (and a team's end) | `team.rs` |
//! | `Wait` (children settle) | `settle.rs` |
//! | the end of a session | `terminal.rs` |
//! | `AskUser`, `RequestApproval`, `EditPlan`, `Orchestrate`, `Refuse`, `Complete`, `Fail` | here: one append each |
//! | `Idle` | nothing: the drive returns |
//!
//! Submission is `submit.rs`; running a whole tree in one process is `trees.rs`.

mod delegate;
mod model;
mod plan;
mod settle;
mod submit;
mod team;
mod terminal;
mod tools;
mod trees;

use std::collections::BTreeSet;
use std::time::Duration;

use skein_core::decide::Refusal;
use skein_core::{Event, Status, Step};

pub use crate::runtime::{
    default_worker_id, Progress, Runtime, RuntimeConfig, TextDelta, DEFAULT_POOL,
    MAX_MISSION_BYTES, TOOL_PROGRESS,
};
pub use crate::session::Folded;
pub use crate::work_loop::retry_delay;
pub use submit::{resubmission_differs, Named, Submission};
pub(crate) use trees::Scope;

use crate::ports::Job;
use crate::Result;

impl Runtime {
    /// Advances one session as far as it can go. The caller acks the job on `Ok`.
    pub async fn process(&self, job: &Job) -> Result<()> {
        self.process_again(job, false).await
    }

    /// As [`Runtime::process`]; `retry` says a step of this job failed before (and was
    /// not handed back), so the drive reconciles with the logs as a redelivery does.
    pub(crate) async fn process_again(&self, job: &Job, retry: bool) -> Result<()> {
        let (mut f, cold) = self.load_for_job(&job.session).await?;
        crate::spans::set_current(&f.id, &f.state);
        // A redelivered or retried job means a step may have stopped half way (its job
        // pushes lost, say): reconcile from the logs as on a cold load. Whether the fold
        // was cached says nothing of that: a parent reading its children keeps their folds.
        // Nor, where notices outlive workers, does a fold missing from the cache say that
        // anything was lost: the last job ran on another worker, and reconciling there
        // would read every outstanding child's log and push its job again.
        let cold = (cold && !self.backend.capabilities().notices_outlive_workers)
            || retry
            || job.attempt > 1;
        let deadline = match self.deadline(&f.state).await {
            Ok(d) => d,
            // A definition that still cannot be read after max_deliver deliveries: the
            // drive fails the session as dead-lettered once its log stood still long
            // enough, so the loss is written in its log rather than its job dropped.
            Err(e) if job.attempt > self.cfg.max_deliver => {
                tracing::warn!(session = %f.id, error = %e.report(), "no deadline: the definition cannot be read");
                None
            }
            Err(e) => return Err(e),
        };
        let Some(deadline) = deadline else {
            let res = self.drive(&mut f, cold, job).await;
            if res.is_ok() {
                self.keep_state(f);
            }
            // On an error the fold is dropped, so the retry reloads and reconciles.
            return res;
        };
        // A session with a `limits.timeout` is driven only until its deadline; a step
        // still under way then is abandoned (as a crash would leave it) and the session
        // times out.
        let left = Duration::from_millis(deadline.at.saturating_sub(self.cfg.clock.now_ms()));
        // Past it, the session is not driven at all. A drive that has nothing to wait for
        // (a session waiting for a person, or for children) finishes at its first poll,
        // before the timer is looked at: it would leave the session waiting, woken again
        // at its deadline, that is at once, for as long as it waits.
        if left.is_zero() {
            drop(f);
            return Box::pin(self.time_out(job, &deadline.reason)).await;
        }
        match tokio::time::timeout(left, self.drive(&mut f, cold, job)).await {
            Ok(Ok(())) => {
                if !f.state.status.is_terminal() {
                    self.wake_at(&f, deadline.at);
                }
                self.keep_state(f);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => {
                drop(f);
                Box::pin(self.time_out(job, &deadline.reason)).await
            }
        }
    }

    /// When the session's `limits.timeout` runs out, and what its caller is told then.
    async fn deadline(&self, state: &skein_core::SessionState) -> Result<Option<Deadline>> {
        if state.status.is_terminal() || state.submitted.is_none() {
            return Ok(None);
        }
        let def = self.def_for(state).await?;
        let Some(t) = def.front.limits.timeout() else {
            return Ok(None);
        };
        Ok(Some(Deadline {
            at: state.started_at.saturating_add(t.as_millis() as u64),
            reason: format!(
                "timed out: `{}` ran past its limits.timeout of {}",
                def.name(),
                def.front.limits.timeout.as_deref().unwrap_or("?")
            ),
        }))
    }

    /// The session ran past its deadline: it and every unfinished session under it are
    /// cancelled with the reason, and its end is told to its caller.
    async fn time_out(&self, job: &Job, reason: &str) -> Result<()> {
        crate::control::cancel(self, &job.session, reason).await?;
        let (mut f, _) = self.load(&job.session).await?;
        self.drive(&mut f, true, job).await?;
        self.keep_state(f);
        Ok(())
    }

    /// Wakes a waiting session at its deadline. The timer lives in this process: were it
    /// lost with the process, the deadline holds from the session's next wake.
    fn wake_at(&self, f: &Folded, at: u64) {
        let jobs = self.backend.jobs.clone();
        let id = f.id.clone();
        let pool = f.state.pool();
        let left = at.saturating_sub(self.cfg.clock.now_ms()) + 5;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(left)).await;
            if let Err(e) = wake(&*jobs, &pool, &id).await {
                tracing::warn!(session = %id, error = %e.report(), "timeout wake-up failed");
            }
        });
    }
}

/// Pushes the job that wakes `session`, trying again while the backend cannot be reached
/// (some 30 s in all). A wake-up after a record written from outside (an answer, an
/// approval, a cancel, a deadline) is all that moves a waiting session: the record is
/// already written, so a wake-up lost to a passing outage would leave the session
/// waiting on nothing until a sweep.
pub(crate) async fn wake(
    jobs: &dyn crate::ports::JobQueue,
    pool: &str,
    session: &skein_core::SessionId,
) -> Result<()> {
    let mut tries = 1;
    loop {
        match jobs.push(pool, session).await {
            Err(e) if e.is_retryable() && tries < WAKE_TRIES => {
                tokio::time::sleep(Duration::from_millis(250 * u64::from(tries))).await;
                tries += 1;
            }
            done => return done,
        }
    }
}

/// Tries of a wake-up while the backend cannot be reached (some 30 s in all).
const WAKE_TRIES: u32 = 15;

/// A session's deadline (ms since the epoch) and the reason it ends with then.
struct Deadline {
    at: u64,
    reason: String,
}

impl Runtime {
    pub(crate) async fn drive(&self, f: &mut Folded, mut cold: bool, job: &Job) -> Result<()> {
        if f.state.submitted.is_none() {
            tracing::warn!(session = %f.id, "job for a session without a log; dropped");
            return Ok(());
        }
        // A worker that lacks what the session needs leaves it to one that has it; when
        // no live worker has it, the session fails with the reason (after a few
        // deliveries, for a worker that is starting).
        if !f.state.status.is_terminal() && self.has_peers() {
            if let Some(need) = self.lacks(&f.state).await? {
                let defs = f.state.submitted.as_ref().and_then(|s| s.defs.clone());
                let elsewhere = self.served_elsewhere(&need, defs.as_deref()).await;
                if elsewhere || job.attempt < crate::defs::UNSERVED_DELIVERIES {
                    self.handed_back_for(&need);
                    return Err(crate::Error::Lacking(format!(
                        "this worker lacks {need}{}",
                        if elsewhere {
                            "; another live worker has it"
                        } else {
                            "; no live worker has it yet"
                        }
                    )));
                }
                let error = format!(
                    "no worker can serve this session: it needs {need}, which none of the \
                     live workers has (delivered {} times)",
                    job.attempt
                );
                let body = Event::dead_lettered(&error, f.state.usage_total(), f.state.steps);
                self.append(f, body).await?;
                crate::metrics::job_dead_lettered(&job.pool);
            }
        }
        // Dead-lettered only when the deliveries were many and the log stood still for as
        // long as they could have taken: deliveries that ran out during a leader election
        // (heartbeats that found no consumer leader) come quickly while the session still
        // moves, and do not fail it.
        let still_for = self.cfg.clock.now_ms().saturating_sub(f.state.updated_at);
        let stalled =
            u128::from(still_for) >= self.cfg.lease.as_millis() * u128::from(self.cfg.max_deliver);
        // A session waiting for quota is delivered again at every turn of its wait, and
        // its log stands still meanwhile: that is no stall.
        if !f.state.status.is_terminal()
            && job.attempt > self.cfg.max_deliver
            && stalled
            && !self.waits_for_quota(&f.id).await
        {
            // What the deliveries kept failing at, from the log: the step due next, and the
            // last model error when model calls failed.
            let next = match (
                self.def_for(&f.state).await,
                self.version_of(&f.state).await,
            ) {
                (Ok(def), Ok(v)) => Ok(f.state.next(&def, &v.limits, &*v.agents)),
                (_, Err(e)) => Err(format!(
                    "none: its definitions version cannot be read ({e})"
                )),
                (Err(e), _) => Err(format!("none: its definition cannot be read ({e})")),
            };
            // A session that waits (on its children, a person, a deadline) has no step to
            // get past: its deliveries were handed back by workers that lacked something
            // or drained, and its log stands still because it waits. This drive acks it.
            if matches!(next, Ok(Step::Wait)) {
                tracing::debug!(session = %f.id, attempt = job.attempt,
                    "a waiting session delivered often: not dead-lettered");
            } else {
                let due = match &next {
                    Ok(step) => step.describe(),
                    Err(why) => why.clone(),
                };
                let mut error = format!(
                    "the job of this session was delivered {} times without \
                 finishing (max_deliver {}); the step it could not get past: {due}",
                    job.attempt - 1,
                    self.cfg.max_deliver
                );
                if let Some(m) = &f.state.failures.last_model_error {
                    error.push_str(&format!("; the last model error: {m}"));
                }
                // The step it could not get past may have created children (their logs are
                // written ahead of the parent's record of them) and never recorded them: no
                // one would settle, count or cancel those. They end here, and what they spent
                // counts in this session's total.
                let mut usage_total = f.state.usage_total();
                for orphan in self.unrecorded_children(f).await? {
                    let reason = format!(
                        "its parent {} was dead-lettered before it recorded this child",
                        f.id.display()
                    );
                    Box::pin(crate::control::cancel(self, &orphan, &reason)).await?;
                    let (spent, _) = self.spent_under(&orphan).await?;
                    usage_total.add(&spent);
                }
                let body = Event::dead_lettered(&error, usage_total, f.state.steps);
                self.append(f, body).await?;
                crate::metrics::job_dead_lettered(&job.pool);
            }
        }
        // Children whose jobs this drive published itself.
        let mut pushed = BTreeSet::new();
        // Whether this drive looked for settled children already.
        let mut looked = false;
        loop {
            if f.state.status.is_terminal() {
                return self.on_terminal(f).await;
            }
            let def = self.def_for(&f.state).await?;
            let version = self.version_of(&f.state).await?;
            let step = f.state.next(&def, &version.limits, &*version.agents);
            tracing::debug!(session = %f.id, step = step.name(), "step");
            let _timer = crate::metrics::StepTimer::start(step.name());
            match step {
                Step::Idle => return Ok(()),
                Step::Wait => {
                    if f.state.status == Status::AwaitingInput {
                        // A child's question goes to its parent: wake it to read it.
                        if let Some(p) = f.state.submitted.as_ref().and_then(|s| s.parent.clone()) {
                            self.backend.notices.post(&p.session, &f.id).await?;
                            let pool = p.pool();
                            self.backend.jobs.push(&pool, &p.session).await?;
                        }
                    }
                    // A team whose supervisor answered ends: its members still at work
                    // are cancelled and read back at once (their own workers may be deep
                    // in a model call, and tell this session only when it returns).
                    let ending = !f.state.team_leftovers().is_empty();
                    if ending {
                        Box::pin(self.end_team(f)).await?;
                    }
                    let look = self
                        .collect_settlements(f, &def, cold, ending, &pushed, !looked)
                        .await?;
                    cold = false;
                    looked = true;
                    if look.settled == 0 {
                        let out = f.state.turn.iter().any(|slot| {
                            matches!(slot.state, skein_core::state::SlotState::Delegated { .. })
                        });
                        if look.partial && out {
                            self.recheck_later(f);
                        }
                        return Ok(());
                    }
                }
                Step::CallModel { tool_names, .. } => {
                    let request = f.state.model_request(&def);
                    self.call_model(f, &def, request, &tool_names, job).await?;
                    if self.quota_pending(&f.id) {
                        return Ok(());
                    }
                }
                Step::Refuse(rs) => self.refuse(f, rs).await?,
                Step::Clarify(v) => Box::pin(self.clarify(f, v)).await?,
                Step::Summarize { model, max_chars } => {
                    let request = f.state.summary_request(model, max_chars);
                    let full = request.meta.context.as_deref().unwrap_or_default();
                    self.backend.blobs.put(full.as_bytes()).await?;
                    self.call_model(f, &def, request, &[], job).await?;
                    if self.quota_pending(&f.id) {
                        return Ok(());
                    }
                }
                Step::AskUser(asks) => {
                    let events = asks
                        .into_iter()
                        .map(|a| a.into_event(crate::clock::token_id(&*self.cfg.clock)))
                        .collect();
                    self.append_all(f, events).await?
                }
                Step::RequestApproval(v) => {
                    let events = v
                        .into_iter()
                        .map(|a| a.into_event(crate::clock::token_id(&*self.cfg.clock)))
                        .collect();
                    self.append_all(f, events).await?
                }
                Step::Delegate(ds) => {
                    // Their jobs are pushed by `delegate`: a cold reconciliation in this
                    // drive need not push them again.
                    pushed.extend(ds.iter().map(|d| d.child.clone()));
                    Box::pin(self.delegate(f, &def, ds)).await?
                }
                Step::RunTools(runs) => self.run_tools(f, &def, runs, job).await?,
                Step::EditPlan(e) => self.append(f, e.into_event()).await?,
                Step::Orchestrate(e) => self.append(f, *e).await?,
                Step::Broadcast(bs) => Box::pin(self.broadcast(f, bs)).await?,
                Step::ProposePatch(ps) => Box::pin(self.propose(f, ps)).await?,
                Step::Complete { answer } => {
                    let body = f.state.completion(answer);
                    self.append(f, body).await?
                }
                Step::Fail { error } => {
                    let body = Event::failed(error, f.state.usage_total(), f.state.steps);
                    self.append(f, body).await?
                }
            }
        }
    }

    pub(crate) async fn refuse(&self, f: &mut Folded, rs: Vec<Refusal>) -> Result<()> {
        let events = rs
            .into_iter()
            .map(|r| Event::refusal(r.call, r.error, r.kind))
            .collect();
        self.append_all(f, events).await
    }
}
