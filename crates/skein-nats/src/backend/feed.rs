//! One owner task per pool and process takes jobs from the pool's consumer and hands them
//! to the work loops that asked for one.
//!
//! A work loop's claim is a *want*: a reply slot sent to the pool's owner through a bounded
//! channel. The owner pulls exactly as many messages as there are wants not yet covered by
//! a pull in flight (credit), so no job is taken from the server before a loop can run it:
//! a job pulled ahead would sit in a queue while its lease and delivery count ran. Pulls
//! run beside the owner, several at once when wants arrive while one is open (those are
//! gathered for up to 2 ms first, so that one pull covers many), and report each message
//! and their end back to it. A message goes to the oldest want still waiting;
//! a message nobody waits for any more (its loop stopped claiming, the worker drains) is
//! handed back at once instead of waiting out its lease. A pull that fails passes its
//! error to the wants it covered, and the consumer is looked up again before the next one.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream, AckKind};
use futures::StreamExt;
use skein_core::SessionId;
use skein_ports::ports::{Job, Lease};
use skein_ports::{Error, Result};
use tokio::sync::{mpsc, oneshot};

use super::holds::Holds;
use super::jobs::{open_consumer, Held};
use super::JOBS;
use super::PULL_GRACE;

/// Wants a pool's owner may have queued before a claim waits to send its own.
const WANTS: usize = 4096;

/// How long wants that come while pulls are in flight are gathered before one pull
/// covers them all, and how many are pulled for at once without waiting longer.
const GATHER: Duration = Duration::from_millis(2);
const GATHER_MAX: usize = 64;

/// Sleeps until `at`; never, without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A work loop's claim, waiting for a job or for its pull to end empty.
struct Want {
    reply: oneshot::Sender<Result<Option<Job>>>,
    wait: Duration,
}

/// What a pull reports to its owner.
enum Pulled {
    Message(Box<jetstream::Message>),
    /// The pull ended with `unused` of its messages never delivered, because it expired
    /// or failed (`error`).
    End {
        unused: usize,
        error: Option<String>,
    },
}

/// The handle of one pool's owner task; dropping it stops the task.
pub(crate) struct Feed {
    wants: mpsc::Sender<Want>,
    task: tokio::task::AbortHandle,
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Feed {
    fn start(jobs: stream::Stream, pool: &str, lease: Duration, holds: Arc<Holds>) -> Self {
        let (tx, rx) = mpsc::channel(WANTS);
        let owner = Owner {
            jobs,
            pool: pool.to_string(),
            lease,
            holds,
            consumer: None,
            waiting: VecDeque::new(),
            covered: 0,
        };
        let task = tokio::spawn(owner.run(rx)).abort_handle();
        Feed { wants: tx, task }
    }

    /// The next job of the pool, or none if none came within `wait`.
    pub(crate) async fn claim(
        feeds: &Mutex<Feeds>,
        pool: &str,
        wait: Duration,
    ) -> Result<Option<Job>> {
        let wants = {
            let mut f = feeds.lock().unwrap_or_else(|p| p.into_inner());
            let fresh = |f: &Feeds| match f.feeds.get(pool) {
                Some(feed) if !feed.wants.is_closed() => Some(feed.wants.clone()),
                _ => None,
            };
            match fresh(&f) {
                Some(w) => w,
                None => {
                    let feed = Feed::start(f.jobs.clone(), pool, f.lease, f.holds.clone());
                    let w = feed.wants.clone();
                    f.feeds.insert(pool.to_string(), feed);
                    w
                }
            }
        };
        let (reply, answer) = oneshot::channel();
        let stopped = || {
            Error::unavailable_because(format!(
                "nats: the claims of pool {pool} stopped being served"
            ))
        };
        wants
            .send(Want { reply, wait })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// Every pool's owner of one process, started on a pool's first claim.
pub(crate) struct Feeds {
    jobs: stream::Stream,
    lease: Duration,
    holds: Arc<Holds>,
    feeds: std::collections::HashMap<String, Feed>,
}

impl Feeds {
    pub(crate) fn new(jobs: stream::Stream, lease: Duration, holds: Arc<Holds>) -> Self {
        Feeds {
            jobs,
            lease,
            holds,
            feeds: Default::default(),
        }
    }
}

struct Owner {
    jobs: stream::Stream,
    pool: String,
    lease: Duration,
    holds: Arc<Holds>,
    /// The pool's consumer, looked up again after a pull failed.
    consumer: Option<consumer::PullConsumer>,
    /// Wants in the order they came.
    waiting: VecDeque<Want>,
    /// Messages the pulls in flight may still deliver.
    covered: usize,
}

impl Owner {
    async fn run(mut self, mut wants: mpsc::Receiver<Want>) {
        let (pulled_tx, mut pulled) = mpsc::unbounded_channel();
        let mut open = true;
        // When the pull for the wants no pull covers is due (see `GATHER`).
        let mut due: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                w = wants.recv(), if open => match w {
                    Some(w) => self.waiting.push_back(w),
                    // Every claimer's handle is gone: end once the pulls in flight have.
                    None => open = false,
                },
                Some(p) = pulled.recv() => self.pulled(p),
                // Due: the check below finds it so and pulls.
                _ = sleep_until(due), if due.is_some() => {}
            }
            while let Ok(w) = wants.try_recv() {
                self.waiting.push_back(w);
            }
            if !open && self.covered == 0 {
                return;
            }
            let uncovered = self.waiting.len().saturating_sub(self.covered);
            if uncovered == 0 {
                due = None;
                continue;
            }
            // With no pull in flight a claim is pulled for at once. With pulls in flight,
            // which deliver to the oldest wants first, the newer ones are gathered a
            // moment so that one pull covers many: a thousand loops asking again one
            // after another had made a pull (a request, and a subscription made and
            // dropped) each.
            let now = tokio::time::Instant::now();
            if self.covered > 0 && uncovered < GATHER_MAX {
                let at = *due.get_or_insert(now + GATHER);
                if at > now {
                    continue;
                }
            }
            due = None;
            // Wants whose claimers stopped waiting are dropped here, where they would be
            // covered, rather than at every message.
            self.waiting.retain(|w| !w.reply.is_closed());
            if self.waiting.len() > self.covered {
                self.pull(&pulled_tx).await;
            }
        }
    }

    /// Starts a pull for every want no pull in flight covers.
    async fn pull(&mut self, report: &mpsc::UnboundedSender<Pulled>) {
        let consumer = match &self.consumer {
            Some(c) => c.clone(),
            None => {
                let opened = tokio::time::timeout(
                    PULL_GRACE * 2,
                    open_consumer(&self.jobs, &self.pool, self.lease),
                )
                .await
                .unwrap_or_else(|_| {
                    Err(Error::unavailable_because(format!(
                        "nats: open consumer pool-{} of stream {JOBS}: no answer within {:?}",
                        self.pool,
                        PULL_GRACE * 2
                    )))
                });
                match opened {
                    Ok(c) => {
                        self.consumer = Some(c.clone());
                        c
                    }
                    Err(e) => {
                        let text = e.report().to_string();
                        let n = self.waiting.len() - self.covered;
                        self.fail_newest(n, &text);
                        return;
                    }
                }
            }
        };
        let n = self.waiting.len() - self.covered;
        let wait = self
            .waiting
            .back()
            .map_or(Duration::from_secs(1), |w| w.wait)
            .max(Duration::from_millis(10));
        self.covered += n;
        tokio::spawn(pull(consumer, self.pool.clone(), n, wait, report.clone()));
    }

    fn pulled(&mut self, p: Pulled) {
        match p {
            Pulled::Message(m) => {
                self.covered = self.covered.saturating_sub(1);
                self.deliver(m);
            }
            Pulled::End { unused, error } => {
                self.covered = self.covered.saturating_sub(unused);
                match error {
                    // The oldest wants, which this pull covered, end empty; a claimer
                    // asks again.
                    None => {
                        for _ in 0..unused.min(self.waiting.len()) {
                            if let Some(w) = self.waiting.pop_front() {
                                let _ = w.reply.send(Ok(None));
                            }
                        }
                    }
                    Some(text) => {
                        self.consumer = None;
                        let n = unused.min(self.waiting.len());
                        for _ in 0..n {
                            if let Some(w) = self.waiting.pop_front() {
                                let _ = w.reply.send(Err(Error::unavailable_because(text.clone())));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Ends the `n` newest wants with an error (they were about to be covered by a pull
    /// that could not start).
    fn fail_newest(&mut self, n: usize, text: &str) {
        for _ in 0..n {
            if let Some(w) = self.waiting.pop_back() {
                let _ = w
                    .reply
                    .send(Err(Error::unavailable_because(text.to_string())));
            }
        }
    }

    /// Gives a pulled message to the oldest want still waiting, or hands it back.
    fn deliver(&mut self, m: Box<jetstream::Message>) {
        let mut job = job_of(&self.pool, *m, self.lease, &self.holds);
        while let Some(w) = self.waiting.pop_front() {
            match w.reply.send(job) {
                Ok(()) => return,
                // That claimer stopped waiting: the next one takes it.
                Err(back) => job = back,
            }
        }
        if let Ok(Some(job)) = job {
            hand_back(job);
        }
    }
}

/// Hands a job nobody waits for back at once, for whichever claim comes next.
fn hand_back(job: Job) {
    tracing::debug!(session = %job.session, "pulled job not wanted any more; handed back");
    tokio::spawn(async move {
        if let Some(held) = job.lease.as_ref().and_then(|l| l.get::<Held>()) {
            let _ = held.acker.ack_with(AckKind::Nak(None)).await;
        }
    });
}

/// One pull of up to `n` messages, each reported as it comes, then its end.
async fn pull(
    consumer: consumer::PullConsumer,
    pool: String,
    n: usize,
    wait: Duration,
    report: mpsc::UnboundedSender<Pulled>,
) {
    let mut got = 0usize;
    let what = || format!("claim from consumer pool-{pool} of stream {JOBS}");
    let send = |p: Pulled| {
        if let Err(mpsc::error::SendError(Pulled::Message(m))) = report.send(p) {
            // The owner is gone (the process is closing its store): back at once.
            tokio::spawn(async move {
                let _ = m.ack_with(AckKind::Nak(None)).await;
            });
        }
    };
    // A pull whose consumer lost its leader may never be answered: it is given up after
    // its expiry and a grace period, and the consumer is looked up again.
    let res = tokio::time::timeout(wait + PULL_GRACE, async {
        // A batch waits for all of its messages (or its expiry); a fetch would end as soon
        // as the stream had none pending, leaving the claims it covered empty-handed.
        let mut batch = consumer
            .batch()
            .max_messages(n)
            .expires(wait)
            .messages()
            .await?;
        while let Some(m) = batch.next().await {
            let m = m?;
            got += 1;
            send(Pulled::Message(Box::new(m)));
        }
        Ok::<_, async_nats::Error>(())
    })
    .await;
    let error = match res {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("nats: {}: {e}", what())),
        Err(_) => Some(format!(
            "nats: {}: no answer within {:?}",
            what(),
            wait + PULL_GRACE
        )),
    };
    send(Pulled::End {
        unused: n.saturating_sub(got),
        error,
    });
}

/// The job a pulled message is, held by this process.
fn job_of(
    pool: &str,
    msg: jetstream::Message,
    lease: Duration,
    holds: &Arc<Holds>,
) -> Result<Option<Job>> {
    let (attempt, sseq) = {
        let info = msg
            .info()
            .map_err(|e| Error::corrupt_because(format!("job info: {e}")))?;
        (info.delivered.max(1) as u32, info.stream_sequence)
    };
    let prefix = format!("skein.jobs.{pool}.");
    let Some(id) = msg
        .subject
        .as_str()
        .strip_prefix(&prefix)
        .map(str::to_string)
    else {
        return Err(Error::corrupt_because(format!(
            "job on subject {}",
            msg.subject
        )));
    };
    let session = SessionId::parse(&id)?;
    tracing::trace!(%session, attempt, "job claimed");
    let (_, acker) = msg.split();
    let since = Arc::new(Mutex::new(Instant::now()));
    let hold = holds.hold(pool, &session, since.clone());
    Ok(Some(Job {
        pool: pool.into(),
        handle: format!("{sseq}:{attempt}"),
        lease: Some(Lease::new(Held {
            sseq,
            session: session.clone(),
            acker,
            done: AtomicBool::new(false),
            lease,
            since,
            hold,
        })),
        session,
        attempt,
    }))
}
