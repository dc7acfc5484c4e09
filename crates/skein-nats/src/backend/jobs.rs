//! The JobQueue on stream `SKEIN_JOBS`, one durable pull consumer per pool.
//!
//! Job coalescing: a session has at most one job, pending or held. Each job is published
//! with `Nats-Expected-Last-Subject-Sequence: 0`, which the stream accepts only while the
//! subject holds no message (an acked job is deleted from the work queue). The stream itself
//! has no per-subject limit: replicas of servers before 2.10 cannot catch up on a stream
//! that refuses new messages per subject. A push refused because a job exists reads the
//! wake marker (KV `skein_wake`); if it is not set, it writes it and tries once more (the job
//! may have been acked in between). A holder, after its ack, reads the marker and, if set,
//! clears it and pushes again, by the same steps. Either the second publish lands, or the
//! marker was set after the refusal and is seen by a holder whose ack came after it; a
//! holder that clears it pushes after clearing it. So every refused push is followed by a
//! claim that comes after it: no wake-up is lost. (A holder that cleared the marker and
//! found a newer job held by another worker sets it again for that worker: a bare publish
//! there would leave the newer holder, whose run may have begun before the push it was
//! refused for, to ack without waking the session.)
//!
//! The job of a session ended for good (`ack_final`) is acked and left: its message keeps
//! refusing the session's pushes, which for such a session wake nothing that could act.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use async_trait::async_trait;
use bytes::Bytes;
use skein_core::SessionId;
use skein_ports::ports::{
    claim_matching_unsupported, Job, JobQueue, SessionFilter, WaitingForRoom,
};
use skein_ports::{Error, Result};

use super::feed::Feed;
use super::holds::Hold;
use super::{nats_err, NatsStore};
use super::{trace_headers, JOBS};
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::response::Response;
use async_nats::jetstream::ErrorCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// A heartbeat, ack or retry of a job this process does not hold.
fn not_held(job: &Job) -> Error {
    Error::NotFound(format!(
        "job of {} in pool {} (attempt {}) is not held by this worker",
        job.session, job.pool, job.attempt
    ))
}

/// A delivery held by this worker, carried in its [`Job`]'s lease: its stream sequence
/// (the message an ack deletes) and its acker.
pub(crate) struct Held {
    pub(crate) sseq: u64,
    pub(crate) session: SessionId,
    pub(crate) acker: jetstream::message::Acker,
    /// Acked or handed back: the hold is spent.
    pub(crate) done: AtomicBool,
    /// The consumer's ack wait: a delivery not heard of for this long is the server's to
    /// give to another worker.
    pub(crate) lease: Duration,
    /// When the delivery came, or its last heartbeat was sent.
    pub(crate) since: std::sync::Arc<std::sync::Mutex<std::time::Instant>>,
    /// Its entry among the process's holds, which pushes for the session may mark.
    pub(crate) hold: Hold,
}

impl Held {
    /// The job's hold, while it lasts.
    fn of(job: &Job) -> Result<&Held> {
        job.lease
            .as_ref()
            .and_then(|l| l.get::<Held>())
            .filter(|h| h.session == job.session && !h.done.load(Ordering::SeqCst))
            .ok_or_else(|| not_held(job))
    }

    /// The job's hold, spent by the caller (an ack or a retry): a second one is refused.
    fn take(job: &Job) -> Result<&Held> {
        let held = Self::of(job)?;
        if held.done.swap(true, Ordering::SeqCst) {
            return Err(not_held(job));
        }
        Ok(held)
    }
}

/// Looks up (or makes) the durable pull consumer of `pool`, with `lease` as its ack wait.
pub(crate) async fn open_consumer(
    jobs: &jetstream::stream::Stream,
    pool: &str,
    lease: Duration,
) -> Result<consumer::PullConsumer> {
    let name = format!("pool-{pool}");
    let config = consumer::pull::Config {
        durable_name: Some(name.clone()),
        filter_subject: format!("skein.jobs.{pool}.>"),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: lease,
        max_deliver: -1,
        max_ack_pending: -1,
        // Each worker keeps a few pulls open per pool (one per batch of claims that came
        // while the others were open). A pull past this limit is refused by the server,
        // and the client reports that only as an opaque error: it is a failed claim like
        // any other, so the limit sits far above what a cluster keeps open.
        max_waiting: 16_384,
        ..Default::default()
    };
    // One attempt: while a cluster elects leaders this fails, and the caller's loop tries
    // again and says so (a silent retry here once hid a lost consumer).
    let cons = jobs
        .get_or_create_consumer(&name, config.clone())
        .await
        .map_err(|e| nats_err(&format!("open consumer {name} of stream {JOBS}"), e))?;
    // The consumer outlives workers: one made with another lease keeps that ack wait, and
    // heartbeats paced by ours would come too late for it. Bring it to ours.
    if cons.cached_info().config.ack_wait != lease {
        tracing::info!(pool, from = ?cons.cached_info().config.ack_wait, to = ?lease,
            "pool consumer's ack wait set to this worker's lease");
        return jobs
            .create_consumer(config)
            .await
            .map_err(|e| nats_err("pool consumer update", e));
    }
    Ok(cons)
}

impl NatsStore {
    /// Whether a refused job publish is the per-subject limit of a job stream made by an
    /// earlier version (one the upgrade could not change): the server reports a failed
    /// store, and the stream refuses a second message per subject.
    fn refused_per_subject(&self, e: &jetstream::context::PublishError) -> bool {
        let cfg = &self.jobs_stream.cached_info().config;
        cfg.discard_new_per_subject
            && cfg.max_messages_per_subject == 1
            && std::error::Error::source(e)
                .and_then(|s| s.downcast_ref::<jetstream::Error>())
                .is_some_and(|j| j.error_code() == ErrorCode::STREAM_STORE_FAILED)
    }

    /// The pool's consumer, for its depth.
    pub(crate) async fn consumer(&self, pool: &str) -> Result<consumer::PullConsumer> {
        let mut c = self.consumers.lock().await;
        if let Some(x) = c.get(pool) {
            return Ok(x.clone());
        }
        let cons = open_consumer(&self.jobs_stream, pool, self.lease).await?;
        c.insert(pool.to_string(), cons.clone());
        Ok(cons)
    }

    /// Drops the cached handle of a pool's consumer: the next claim looks it up again and
    /// makes it anew if the cluster lost it.
    pub(crate) async fn forget_consumer(&self, pool: &str) {
        self.consumers.lock().await.remove(pool);
    }

    pub(crate) async fn publish_job(&self, pool: &str, session: &SessionId) -> Result<bool> {
        let subject = format!("skein.jobs.{pool}.{}", session.as_str());
        let mut delay = Duration::from_millis(100);
        let mut tries = 0;
        loop {
            let mut h = trace_headers();
            h.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
            let res = async {
                self.js
                    .publish_with_headers(subject.clone(), h, Bytes::new())
                    .await?
                    .await
            }
            .await;
            tracing::trace!(%session, published = res.is_ok(), "job push");
            match res {
                Ok(_) => return Ok(true),
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::context::PublishErrorKind::WrongLastSequence
                    ) =>
                {
                    return Ok(false)
                }
                // A stream made before the limit moved to the publish says it this way.
                Err(e) if self.refused_per_subject(&e) => return Ok(false),
                Err(e) if tries < 4 => {
                    tries += 1;
                    tracing::debug!(%session, error = %e, "job push not acknowledged; sending again");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(e) => return Err(nats_err("push job", e)),
            }
        }
    }

    /// Deletes a job's message, without the secure erase the server does by default (which
    /// overwrites the message in its block and writes the block out again: about a tenth
    /// of the server's CPU in a zero-latency run). A job holds no secret, and a message
    /// deleted either way is gone for every reader. Deleted already: done.
    async fn delete_job_message(&self, sseq: u64) -> Result<()> {
        let what = || format!("delete job from stream {JOBS}");
        let answer: Response<serde::de::IgnoredAny> = self
            .js
            .request(
                format!("STREAM.MSG.DELETE.{JOBS}"),
                &serde_json::json!({ "seq": sseq, "no_erase": true }),
            )
            .await
            .map_err(|e| nats_err(&what(), e))?;
        match answer {
            Response::Ok(_) => Ok(()),
            Response::Err { error } if error.error_code() == ErrorCode::NO_MESSAGE_FOUND => Ok(()),
            Response::Err { error } => Err(nats_err(&what(), error)),
        }
    }

    /// A job's ack without its wake-up: its message deleted (unless `left`, for a session
    /// ended for good), then its delivery acked. The outer error comes before the ack is
    /// sent (the job stays held or was not held here); the inner one is the ack's own
    /// outcome.
    async fn ack_only(&self, job: &Job, left: bool) -> Result<Result<()>> {
        // What the job appended is stored before the job is done; if it was not, the
        // job is not acked and its delivery comes back.
        self.make_sure(&job.session).await?;
        // Not held (never claimed here, or acked already): its message, which may be
        // another holder's, is left alone.
        let held = Held::take(job)?;
        // The job's message is deleted through the stream (every replica applies the
        // delete in the same order as the publishes it gates), then acked. A holder that
        // dies in between leaves an acked delivery of a deleted message: nothing to redo.
        let deleted = if left {
            Ok(())
        } else {
            self.delete_job_message(held.sseq).await
        };
        let acked = match deleted {
            Err(e) => {
                // Held again: the delivery runs out and comes back.
                held.done.store(false, Ordering::SeqCst);
                return Err(e);
            }
            Ok(()) => {
                // A push from here from now on goes to the server, where the job's
                // message is gone; one that came before marked the hold.
                held.hold.release();
                held.acker.ack().await.map_err(|e| nats_err("ack", e))
            }
        };
        tracing::trace!(session = %job.session, ok = acked.is_ok(), left, "job acked");
        Ok(acked)
    }

    /// After a job's ack: a push that found the job held left a marker, so the session
    /// runs once more. The marker is cleared and the push made whole (a job held by
    /// another worker by now gets the marker back). When the marker cannot be read, or the
    /// ack's outcome is unknown, push anyway: an extra wake-up costs one idle step, a lost
    /// one strands a session.
    async fn wake_after_ack(&self, job: &Job, acked: bool) -> Result<()> {
        // A push made here while the job was held marked its hold instead of the marker.
        let woken_here = job
            .lease
            .as_ref()
            .and_then(|l| l.get::<Held>())
            .is_some_and(|h| h.hold.was_woken());
        match self.wake.get(job.session.as_str()).await {
            Ok(None) if acked && !woken_here => Ok(()),
            Ok(Some(_)) => {
                let _ = self.wake.delete(job.session.as_str()).await;
                self.push(&job.pool, &job.session).await
            }
            _ => self.push(&job.pool, &job.session).await,
        }
    }
}

#[async_trait]
impl JobQueue for NatsStore {
    /// A worker's pull takes the next job of its pool, whatever its session.
    async fn claim_matching(&self, _: &str, _: Duration, _: &SessionFilter) -> Result<Option<Job>> {
        Err(claim_matching_unsupported())
    }

    async fn depth_matching(&self, _: &str, _: &SessionFilter) -> Result<u64> {
        Err(claim_matching_unsupported())
    }

    async fn set_waiting_for_room(&self, w: &WaitingForRoom) -> Result<()> {
        self.put_waiting(w).await
    }

    async fn clear_waiting_for_room(&self, session: &SessionId) -> Result<()> {
        self.delete_waiting(session).await
    }

    async fn waiting_for_room(&self) -> Result<Vec<WaitingForRoom>> {
        self.list_waiting().await
    }

    async fn push(&self, pool: &str, session: &SessionId) -> Result<()> {
        // Held here: its holder pushes after its ack (see `holds.rs`).
        if self.holds.wake(session) {
            tracing::trace!(%session, "push marked the job held here");
            return Ok(());
        }
        if self.publish_job(pool, session).await? {
            return Ok(());
        }
        // A job exists, pending or held. A marker set already is one a holder will read
        // after its ack (or one it is clearing, to push after): a wide tree's children
        // ending while their parent's job is held find it set, and stop here.
        if let Ok(Some(_)) = self.wake.get(session.as_str()).await {
            return Ok(());
        }
        // Leave a wake marker, then try once more.
        self.wake
            .put(session.as_str(), Bytes::from_static(b"1"))
            .await
            .map_err(|e| nats_err("wake marker", e))?;
        self.publish_job(pool, session).await?;
        Ok(())
    }

    async fn push_new(&self, pool: &str, session: &SessionId) -> Result<()> {
        let Some(group) = &self.jobs_group else {
            return self.push(pool, session).await;
        };
        let mut h = trace_headers();
        h.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
        let subject = format!("skein.jobs.{pool}.{}", session.as_str());
        match group.publish(subject, h, Bytes::new()).await {
            Ok(_) => Ok(()),
            // A job there after all, or a publish that failed: the plain push, with its
            // wake marker and its retries, decides.
            Err(e) => {
                tracing::debug!(%session, error = %e, "first job not stored in a batch; pushed alone");
                self.push(pool, session).await
            }
        }
    }

    /// The session's job message is deleted first: a job acked as ended for good left it
    /// there, which would refuse the push. A job of it still held loses its message too;
    /// its holder's delete then finds nothing, and its ack and this job's run both only
    /// tell of the end, which is idempotent. The message is read and deleted by its
    /// sequence, as every ack deletes one: a purge by subject of the replicated jobs
    /// stream, tried first, left the trees of a three-node cluster of nats-server 2.9.10
    /// that lost a node waiting for ever in two runs of four
    /// (`a_node_and_workers_killed_mid_run_lose_nothing_and_each_result_is_heard_once`).
    /// The wake marker that pushes refused by the message left behind is cleared with it:
    /// for an ended session it stands for nothing but one more such run.
    async fn push_ended(&self, pool: &str, session: &SessionId) -> Result<()> {
        let subject = format!("skein.jobs.{pool}.{}", session.as_str());
        match self
            .jobs_stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => self.delete_job_message(m.sequence).await?,
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {}
            Err(e) => return Err(nats_err("read a finished job", e)),
        }
        self.wake
            .delete(session.as_str())
            .await
            .map_err(|e| nats_err("wake marker", e))?;
        self.push(pool, session).await
    }

    async fn claim(&self, pool: &str, wait: Duration) -> Result<Option<Job>> {
        Feed::claim(&self.feeds, pool, wait).await
    }

    async fn heartbeat(&self, job: &Job) -> Result<()> {
        let held = Held::of(job)?;
        {
            // Past its ack wait the delivery may be another worker's already: the server
            // ignores a late heartbeat, so it is refused here rather than answered `Ok`.
            let mut since = held.since.lock().unwrap_or_else(|p| p.into_inner());
            if since.elapsed() >= held.lease {
                return Err(Error::NotFound(format!(
                    "job of {} in pool {} (attempt {}): its lease ran out {:?} ago",
                    job.session,
                    job.pool,
                    job.attempt,
                    since.elapsed() - held.lease
                )));
            }
            *since = std::time::Instant::now();
        }
        held.acker
            .ack_with(jetstream::AckKind::Progress)
            .await
            .map_err(|e| nats_err("heartbeat", e))
    }

    async fn ack(&self, job: &Job) -> Result<()> {
        let acked = self.ack_only(job, false).await?;
        self.wake_after_ack(job, acked.is_ok()).await?;
        acked
    }

    /// As `ack`, with the job's delete waiting its turn behind the deletes of the other
    /// ended sessions' jobs of this process, a few at a time. With every write fsynced,
    /// each delete costs the jobs stream a write of its own, and the children of a wide
    /// turn end together: deleted all at once, a thousand deletes stood in the stream's
    /// queue ahead of the pushes that wake their parent. Nothing waits for an ended
    /// session's job to go (a push meanwhile leaves the wake marker, read after the ack),
    /// so its delete can wait; the order of delete, hold, ack and wake marker stays that
    /// of an ack.
    async fn ack_ended(&self, job: &Job) -> Result<()> {
        let acked = {
            // The semaphore is never closed.
            let _turn = self.ended_deletes.acquire().await.ok();
            self.ack_only(job, false).await?
        };
        self.wake_after_ack(job, acked.is_ok()).await?;
        acked
    }

    /// The job of a session ended for good is acked and its message left in the stream:
    /// no delete (a JetStream API request, and with every write fsynced a write of its
    /// own) and no read of the wake marker. The message is acked, so it is never
    /// delivered again; while it stands, a push for the session is refused and leaves the
    /// marker, which nobody reads: nothing runs, which for such a session is all a run
    /// would do. It goes when its tree is removed (retention purges the tree's jobs) or
    /// ages out with the logs (`events_max_age`).
    async fn ack_final(&self, job: &Job) -> Result<()> {
        self.ack_only(job, true).await?
    }

    async fn retry(&self, job: &Job, delay: Duration) -> Result<()> {
        // Whatever the job appended, stored or not, is the next holder's to find.
        if let Err(e) = self.make_sure(&job.session).await {
            tracing::debug!(session = %job.session, error = %e, "a pipelined append failed");
        }
        let held = Held::take(job)?;
        // No delay: delivered again at once (a draining worker hands its job on).
        let delay = (!delay.is_zero()).then_some(delay);
        held.acker
            .ack_with(jetstream::AckKind::Nak(delay))
            .await
            .map_err(|e| nats_err("nak", e))?;
        // The job stays, and its next run reads what a push marking the hold was for.
        held.hold.release();
        Ok(())
    }

    async fn depth(&self, pool: &str) -> Result<u64> {
        let mut cons = self.consumer(pool).await?;
        let info = match cons.info().await {
            Ok(info) => info,
            Err(e) => {
                self.forget_consumer(pool).await;
                return Err(nats_err("consumer info", e));
            }
        };
        Ok(info.num_pending + info.num_ack_pending as u64)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::NatsConfig;
    use skein_testnats::NatsServer;

    /// A new session's job, pushed and claimed through `a`.
    async fn held_job(a: &NatsStore, pool: &str) -> (SessionId, Job) {
        let s = skein_runtime::new_root_id();
        a.push(pool, &s).await.unwrap();
        let held = a
            .claim(pool, Duration::from_secs(3))
            .await
            .unwrap()
            .expect("the job");
        assert_eq!(held.session, s);
        (s, held)
    }

    /// Claims through `a` the job of `s`, which must come: `why` says why it should.
    async fn runs_again(a: &NatsStore, pool: &str, s: &SessionId, why: &str) -> Job {
        let job = a.claim(pool, Duration::from_secs(5)).await.unwrap();
        assert_eq!(job.as_ref().map(|j| &j.session), Some(s), "{why}");
        job.unwrap()
    }

    async fn store(server: &NatsServer) -> std::sync::Arc<NatsStore> {
        store_leasing(server, Duration::from_secs(30)).await
    }

    /// Acks of ended sessions' jobs, made all at once, take their turns at the deletes
    /// and keep an ack's promises: each job's message is gone, and a session pushed from
    /// another process while its job was held runs once more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acks_of_ended_sessions_delete_in_turn_and_wake_what_was_pushed() {
        let server = NatsServer::start();
        let (a, b) = (store(&server).await, store(&server).await);
        let pool = "ended";
        let mut held = vec![];
        for _ in 0..40 {
            held.push(held_job(&a, pool).await);
        }
        // Every other session is pushed again while held: the push leaves its marker.
        for (s, _) in held.iter().step_by(2) {
            b.push(pool, s).await.unwrap();
        }
        let acks = held.iter().map(|(_, j)| a.ack_ended(j));
        for r in futures::future::join_all(acks).await {
            r.unwrap();
        }
        let mut again = std::collections::BTreeSet::new();
        while let Some(j) = a.claim(pool, Duration::from_millis(500)).await.unwrap() {
            assert!(again.insert(j.session.clone()), "{} ran twice", j.session);
            a.ack_ended(&j).await.unwrap();
        }
        let pushed: std::collections::BTreeSet<_> =
            held.iter().step_by(2).map(|(s, _)| s.clone()).collect();
        assert_eq!(
            again, pushed,
            "the sessions pushed while held run once more, only they"
        );
        for (s, _) in &held {
            assert_eq!(job_message(&a, pool, s).await, None, "the job of {s} stays");
        }
    }

    /// A holder slow to read the wake marker after its ack, while the session's next job
    /// is already held by another worker whose run began before the push that left the
    /// marker: clearing the marker must hand it on to that worker, or its ack ends the
    /// session's wake-ups and the pushed-for step never runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_marker_cleared_by_a_slow_former_holder_still_wakes_the_session() {
        let server = NatsServer::start();
        let (a, b) = (store(&server).await, store(&server).await);
        let pool = "slowholder";
        let s = skein_runtime::new_root_id();
        let wait = Duration::from_secs(3);

        a.push(pool, &s).await.unwrap();
        let first = a.claim(pool, wait).await.unwrap().expect("the first job");
        // The first holder acks; its look at the marker comes later.
        a.ack_only(&first, false).await.unwrap().unwrap();
        // A second job lands and another worker starts running it.
        b.push(pool, &s).await.unwrap();
        let second = b.claim(pool, wait).await.unwrap().expect("the second job");
        assert_eq!(second.session, s);
        // A push for something the running job may not have read: refused, so it leaves
        // the marker.
        a.push(pool, &s).await.unwrap();
        assert!(
            a.wake.get(s.as_str()).await.unwrap().is_some(),
            "the marker is set"
        );
        // Now the first holder reads the marker, clears it and pushes; the second holder
        // acks.
        a.wake_after_ack(&first, true).await.unwrap();
        b.ack(&second).await.unwrap();
        runs_again(
            &a,
            pool,
            &s,
            "the session runs once more after the push the running job may have missed",
        )
        .await;
    }

    /// A push refused while the marker is set already leaves it as it is and publishes
    /// nothing more; the holder's ack still wakes the session once, not twice. (The
    /// pushes come from another process: one from the holder's own is a mark on its hold,
    /// below.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pushes_while_held_wake_the_session_once_after_the_ack() {
        let server = NatsServer::start();
        let (a, b) = (store(&server).await, store(&server).await);
        let pool = "manypushes";
        let wait = Duration::from_secs(3);
        let (s, held) = held_job(&a, pool).await;
        for _ in 0..5 {
            b.push(pool, &s).await.unwrap();
        }
        assert!(
            b.wake.get(s.as_str()).await.unwrap().is_some(),
            "a push from another process leaves the marker"
        );
        a.ack(&held).await.unwrap();
        let again = a
            .claim(pool, wait)
            .await
            .unwrap()
            .expect("woken after the ack");
        assert_eq!(again.session, s);
        assert!(
            a.wake.get(s.as_str()).await.unwrap().is_none(),
            "the marker was cleared by the ack that used it"
        );
        a.ack(&again).await.unwrap();
        assert!(
            a.claim(pool, Duration::from_millis(500))
                .await
                .unwrap()
                .is_none(),
            "one wake-up for the five pushes"
        );
    }

    /// A job acked as ended for good keeps its message, acked: it is not delivered again,
    /// and a push for its session (from this process or another) runs nothing. The push
    /// of an ended session that a sweep makes clears the message and runs it once more;
    /// a plain ack's job goes, as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_acked_for_good_stays_and_only_a_push_of_an_ended_session_runs_it_again() {
        let server = NatsServer::start();
        let (a, b) = (store(&server).await, store(&server).await);
        let pool = "final";
        let (s, held) = held_job(&a, pool).await;
        let sseq = job_message(&a, pool, &s).await.expect("the job's message");
        // A push while held, from another process: with `ack` it would run the session
        // once more; this ack drops it.
        b.push(pool, &s).await.unwrap();
        a.ack_final(&held).await.unwrap();
        assert_eq!(
            job_message(&a, pool, &s).await,
            Some(sseq),
            "the job's message stays"
        );
        a.push(pool, &s).await.unwrap();
        b.push(pool, &s).await.unwrap();
        assert!(
            a.claim(pool, Duration::from_millis(800))
                .await
                .unwrap()
                .is_none(),
            "a session acked for good ran again"
        );
        assert_eq!(a.depth(pool).await.unwrap(), 0);
        b.push_ended(pool, &s).await.unwrap();
        let again = runs_again(&a, pool, &s, "a sweep's push of the ended session").await;
        assert_ne!(job_message(&a, pool, &s).await, Some(sseq));
        a.ack(&again).await.unwrap();
        assert_eq!(job_message(&a, pool, &s).await, None, "a plain ack deletes");
        // And a session whose job was acked plainly takes pushes as ever.
        a.push(pool, &s).await.unwrap();
        runs_again(&a, pool, &s, "a push after a plain ack").await;
    }

    async fn store_leasing(server: &NatsServer, lease: Duration) -> std::sync::Arc<NatsStore> {
        let cfg = NatsConfig {
            urls: vec![server.url()],
            replicas: 1,
            ..NatsConfig::default()
        };
        NatsStore::connect(&cfg, lease).await.unwrap()
    }

    /// The stream sequence of the session's job message, if one is stored.
    async fn job_message(a: &NatsStore, pool: &str, s: &SessionId) -> Option<u64> {
        a.jobs_stream
            .get_last_raw_message_by_subject(&format!("skein.jobs.{pool}.{}", s.as_str()))
            .await
            .ok()
            .map(|m| m.sequence)
    }

    /// Pushes for a session whose job this process holds go to no server: they mark the
    /// hold, and the holder's ack wakes the session once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_push_for_a_job_held_here_marks_its_hold_and_the_ack_wakes_the_session() {
        let server = NatsServer::start();
        let a = store(&server).await;
        let pool = "heldhere";
        let wait = Duration::from_secs(3);
        let (s, held) = held_job(&a, pool).await;
        let job_seq = job_message(&a, pool, &s).await;
        assert!(job_seq.is_some());
        for _ in 0..5 {
            a.push(pool, &s).await.unwrap();
        }
        assert!(
            a.wake.get(s.as_str()).await.unwrap().is_none(),
            "no marker was written"
        );
        assert_eq!(
            job_message(&a, pool, &s).await,
            job_seq,
            "nothing was published"
        );
        a.ack(&held).await.unwrap();
        assert_eq!(a.holds.len(), 0, "the ack released the hold");
        let again = a
            .claim(pool, wait)
            .await
            .unwrap()
            .expect("woken after the ack");
        assert_eq!(again.session, s);
        a.ack(&again).await.unwrap();
        assert!(
            a.claim(pool, Duration::from_millis(500))
                .await
                .unwrap()
                .is_none(),
            "one wake-up for the five pushes"
        );
    }

    /// A marked hold whose job is dropped without its ack or a retry (its run gave up, say,
    /// its lease lost) still pushes; the push finds the delivery still pending and leaves
    /// the marker, so the session runs once more after the delivery that comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_woken_hold_dropped_without_its_ack_still_wakes_the_session() {
        let server = NatsServer::start();
        let a = store_leasing(&server, Duration::from_secs(2)).await;
        let pool = "droppedhold";
        let wait = Duration::from_secs(5);
        let (s, held) = held_job(&a, pool).await;
        a.push(pool, &s).await.unwrap();
        assert!(a.wake.get(s.as_str()).await.unwrap().is_none());
        drop(held);
        let mut marked = false;
        for _ in 0..40 {
            if a.wake.get(s.as_str()).await.unwrap().is_some() {
                marked = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(marked, "the dropped hold's push left the marker");
        let back = a
            .claim(pool, wait)
            .await
            .unwrap()
            .expect("the delivery comes back");
        assert_eq!(back.session, s);
        a.ack(&back).await.unwrap();
        runs_again(
            &a,
            pool,
            &s,
            "the marker woke the session after the run that came back",
        )
        .await;
    }

    /// A marked hold dropped after its delivery was acked by another process (its lease ran
    /// out, and the delivery that came back was run there) publishes the job anew, and the
    /// job carries the trace context of the task that dropped the hold, as an ack's push
    /// carries the acking job's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_woken_hold_dropped_after_its_lease_pushes_in_its_jobs_trace() {
        let server = NatsServer::start();
        let lease = Duration::from_secs(2);
        let (a, b) = (
            store_leasing(&server, lease).await,
            store_leasing(&server, lease).await,
        );
        let pool = "tracedhold";
        let (s, held) = held_job(&a, pool).await;
        a.push(pool, &s).await.unwrap();
        assert!(
            a.wake.get(s.as_str()).await.unwrap().is_none(),
            "the push marked the hold"
        );
        let back = runs_again(
            &b,
            pool,
            &s,
            "the delivery comes back to the other process after the lease",
        )
        .await;
        b.ack(&back).await.unwrap();
        assert_eq!(
            job_message(&a, pool, &s).await,
            None,
            "the ack deleted the job"
        );
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        skein_ports::trace_context::scoped(async {
            skein_ports::trace_context::set(Some(traceparent.to_string()));
            drop(held);
        })
        .await;
        let mut pushed = None;
        for _ in 0..40 {
            let subject = format!("skein.jobs.{pool}.{}", s.as_str());
            if let Ok(m) = a
                .jobs_stream
                .get_last_raw_message_by_subject(&subject)
                .await
            {
                pushed = Some(m);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pushed = pushed.expect("the dropped hold published the job again");
        assert_eq!(
            pushed.headers.get("traceparent").map(|v| v.as_str()),
            Some(traceparent),
            "the job is of the dropping task's trace"
        );
        let again = runs_again(&b, pool, &s, "the pushed job runs").await;
        b.ack(&again).await.unwrap();
    }

    /// A hold past half its lease is not marked: another worker may soon hold its
    /// delivery, so the push goes to the server and leaves the marker there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hold_past_half_its_lease_leaves_the_push_to_the_server() {
        let server = NatsServer::start();
        let a = store_leasing(&server, Duration::from_secs(2)).await;
        let pool = "latehold";
        let (s, held) = held_job(&a, pool).await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        a.push(pool, &s).await.unwrap();
        assert!(
            a.wake.get(s.as_str()).await.unwrap().is_some(),
            "the push went to the server"
        );
        drop(held);
    }

    /// A retried job keeps its message and runs again, reading what a push marking its
    /// hold was for: the retry drops the mark rather than pushing a second run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retry_drops_the_mark_and_the_job_runs_again() {
        let server = NatsServer::start();
        let a = store(&server).await;
        let pool = "retriedhold";
        let wait = Duration::from_secs(3);
        let (s, held) = held_job(&a, pool).await;
        a.push(pool, &s).await.unwrap();
        a.retry(&held, Duration::ZERO).await.unwrap();
        drop(held);
        let again = a.claim(pool, wait).await.unwrap().expect("the job again");
        assert_eq!((again.session.clone(), again.attempt), (s.clone(), 2));
        a.ack(&again).await.unwrap();
        assert!(a.wake.get(s.as_str()).await.unwrap().is_none());
        assert!(
            a.claim(pool, Duration::from_millis(500))
                .await
                .unwrap()
                .is_none(),
            "the retried run was the wake-up"
        );
    }
}
