//! Group commit (`nats.group_commit`): the writes a process makes to one stream while
//! earlier ones are still out go to the server together, as one atomic batch
//! (`Nats-Batch-Id`, `Nats-Batch-Sequence`, `Nats-Batch-Commit`; a stream with
//! `allow_atomic`). Used for appends to `SKEIN_EVENTS`, for notices, and for the first
//! jobs of a wide turn's children.
//!
//! Why: with `sync_interval: always` the server writes and syncs each message of a stream
//! before its ack, one after another, and a wide tree's sessions append at the same
//! moments. nats-server 2.15 commits an atomic batch of a single-replica stream with one
//! sync, so a batch of a hundred appends costs about what one did (docs/perf.md).
//!
//! What an append means does not change. Each message keeps its own headers (the
//! expected last sequence of its subject, and the message id that makes a repeat a
//! duplicate), and the server checks them as it would one by one; a batch is stored whole
//! or not at all. When a batch is not committed as one (one of its appends lost a race,
//! repeats one already stored, the server does not batch, or its ack did not come), each
//! of its appends is published again on its own, in order, and gets the outcome it would
//! have had alone. A message the batch did store (its ack lost) is answered as any repeat
//! is: as a duplicate, which the log's writer checks byte for byte, or, by a server that
//! checks the expected last sequence first (2.15 does), as a lost race, after which the
//! writer reads its log again; both as after a lost ack of a single publish.

use std::future::{Future, IntoFuture};
use std::sync::Arc;

use async_nats::header::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

/// Where an append was stored, and whether it was there already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Acked {
    pub(crate) sequence: u64,
    pub(crate) duplicate: bool,
}

impl From<PublishAck> for Acked {
    fn from(a: PublishAck) -> Self {
        Self {
            sequence: a.sequence,
            duplicate: a.duplicate,
        }
    }
}

/// An append's outcome, which several may wait for.
pub(crate) type Outcome = std::result::Result<Acked, Arc<PublishError>>;

/// Batches of appends, by `outcome`: `committed` (stored as one), `apart` (published
/// again one by one). The worker's metrics list describes it
/// (`skein_runtime::metrics::NATS_BATCHES`).
pub const BATCHES: &str = "skein_nats_append_batches_total";

/// The most appends in one batch: the server's default limit.
const MOST_MESSAGES: usize = 1_000;
/// The most payload bytes in one batch, so that a batch stays a short write.
const MOST_BYTES: usize = 4 << 20;
/// Fewer appends than this, gathered at once, go apart: a batch costs the server more
/// than a message (a single-replica stream stages each batch in files of its own).
const FEWEST_BATCHED: usize = 8;

/// Sends out at once from one group, a process's writes to one stream (a batch, or
/// appends too few to gather). The server allows 50 batches per stream by default, for
/// all its writers together; a batch that finds no room is refused, and its appends go
/// one by one.
const OUT_AT_ONCE: usize = 4;

struct Append {
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
    done: oneshot::Sender<Outcome>,
}

/// The appends of one process to one stream, gathered into batches.
pub(crate) struct Group {
    tx: mpsc::UnboundedSender<Append>,
    #[cfg(test)]
    counts: Arc<Counts>,
}

/// Batches so far: committed as one, and published again apart.
#[derive(Default)]
struct Counts {
    committed: std::sync::atomic::AtomicU64,
    apart: std::sync::atomic::AtomicU64,
}

impl Group {
    /// Starts the task that sends the batches; it ends when the group is dropped.
    pub(crate) fn start(client: async_nats::Client, js: jetstream::Context) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let counts = Arc::new(Counts::default());
        tokio::spawn(send_batches(client, js, rx, counts.clone()));
        Self {
            tx,
            #[cfg(test)]
            counts,
        }
    }

    /// Batches so far: (committed as one, published again apart).
    #[cfg(test)]
    fn batches(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.counts.committed.load(Relaxed),
            self.counts.apart.load(Relaxed),
        )
    }

    /// Queues an append; the future gives its outcome. The append goes out whether or
    /// not the future is awaited.
    pub(crate) fn publish(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> impl Future<Output = Outcome> + Send + 'static {
        let (done, rx) = oneshot::channel();
        let queued = self
            .tx
            .send(Append {
                subject,
                headers,
                payload,
                done,
            })
            .is_ok();
        async move {
            if !queued {
                return Err(gone());
            }
            rx.await.unwrap_or_else(|_| Err(gone()))
        }
    }
}

fn gone() -> Arc<PublishError> {
    Arc::new(PublishError::new(PublishErrorKind::BrokenPipe))
}

/// Takes what is queued when a batch may go out (everything queued, within the limits),
/// and sends it. Sending happens here, in order, so that batches and single appends reach
/// the connection in the order they were queued; their acks are awaited apart.
async fn send_batches(
    client: async_nats::Client,
    js: jetstream::Context,
    mut rx: mpsc::UnboundedReceiver<Append>,
    counts: Arc<Counts>,
) {
    let room = Arc::new(Semaphore::new(OUT_AT_ONCE));
    // Batch ids are told apart from other writers' by a prefix drawn from this process and
    // this moment. Two writers that drew the same one would only see their batches
    // refused as incomplete, and their appends go one by one.
    let prefix = {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let seed = format!("{}:{nanos}:{:p}", std::process::id(), &room);
        blake3::hash(seed.as_bytes()).to_hex()[..16].to_string()
    };
    let mut batches = 0u64;
    while let Some(first) = rx.recv().await {
        // Waiting for room is what gathers: appends queue while the batches out are
        // written.
        let Ok(permit) = room.clone().acquire_owned().await else {
            return;
        };
        let mut bytes = first.payload.len();
        let mut appends = vec![first];
        while appends.len() < MOST_MESSAGES && bytes < MOST_BYTES {
            match rx.try_recv() {
                Ok(a) => {
                    bytes += a.payload.len();
                    appends.push(a);
                }
                Err(_) => break,
            }
        }
        batches += 1;
        let out = send(&client, &js, &format!("{prefix}-{batches}"), appends).await;
        tokio::spawn(settle(js.clone(), out, permit, counts.clone()));
    }
}

/// Appends sent, waiting for their ack.
enum Out {
    /// Too few to gather: each published on its own.
    Apart(Vec<(Append, std::result::Result<PublishAckFuture, PublishError>)>),
    /// Several, as the batch `id`, whose commit is the last.
    Batch {
        id: String,
        appends: Vec<Append>,
        commit: std::result::Result<PublishAckFuture, PublishError>,
    },
}

async fn send(
    client: &async_nats::Client,
    js: &jetstream::Context,
    id: &str,
    appends: Vec<Append>,
) -> Out {
    if appends.len() < FEWEST_BATCHED {
        let mut out = Vec::with_capacity(appends.len());
        for a in appends {
            let sent = js
                .publish_with_headers(a.subject.clone(), a.headers.clone(), a.payload.clone())
                .await;
            out.push((a, sent));
        }
        return Out::Apart(out);
    }
    let n = appends.len();
    let with_batch = |a: &Append, i: usize| {
        let mut h = a.headers.clone();
        h.insert("Nats-Batch-Id", id);
        h.insert("Nats-Batch-Sequence", (i + 1).to_string().as_str());
        if i + 1 == n {
            h.insert("Nats-Batch-Commit", "1");
        }
        h
    };
    for (i, a) in appends[..n - 1].iter().enumerate() {
        // Without a reply: the commit answers for the batch. A failure here leaves the
        // batch incomplete, so the commit is refused and every append goes again alone.
        let _ = client
            .publish_with_headers(a.subject.clone(), with_batch(a, i), a.payload.clone())
            .await;
    }
    let last = &appends[n - 1];
    let commit = js
        .publish_with_headers(
            last.subject.clone(),
            with_batch(last, n - 1),
            last.payload.clone(),
        )
        .await;
    Out::Batch {
        id: id.to_string(),
        appends,
        commit,
    }
}

async fn settle(
    js: jetstream::Context,
    out: Out,
    permit: OwnedSemaphorePermit,
    counts: Arc<Counts>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    match out {
        Out::Apart(sent) => {
            let mut outcomes = Vec::with_capacity(sent.len());
            for (a, s) in sent {
                outcomes.push((a.done, acked(s).await));
            }
            drop(permit);
            for (done, outcome) in outcomes {
                let _ = done.send(outcome);
            }
        }
        Out::Batch {
            id,
            appends,
            commit,
        } => {
            let n = appends.len() as u64;
            let committed = match commit {
                Ok(ack) => ack.into_future().await.ok().filter(|a| {
                    a.batch_id.as_deref() == Some(id.as_str())
                        && a.batch_size == Some(n)
                        && a.sequence >= n
                }),
                Err(_) => None,
            };
            drop(permit);
            match committed {
                // Stored together, one after another, the commit last.
                Some(ack) => {
                    counts.committed.fetch_add(1, Relaxed);
                    metrics::counter!(BATCHES, "outcome" => "committed").increment(1);
                    tracing::debug!(batch = %id, appends = n, "appends committed as one batch");
                    let first = ack.sequence + 1 - n;
                    for (i, a) in appends.into_iter().enumerate() {
                        let _ = a.done.send(Ok(Acked {
                            sequence: first + i as u64,
                            duplicate: false,
                        }));
                    }
                }
                None => {
                    counts.apart.fetch_add(1, Relaxed);
                    metrics::counter!(BATCHES, "outcome" => "apart").increment(1);
                    tracing::debug!(batch = %id, appends = n, "batch not committed; its appends go apart");
                    one_by_one(&js, appends).await
                }
            }
        }
    }
}

/// Publishes each append again on its own, in order, and gives each its own outcome.
async fn one_by_one(js: &jetstream::Context, appends: Vec<Append>) {
    let mut sent = Vec::with_capacity(appends.len());
    for a in appends {
        let s = js
            .publish_with_headers(a.subject.clone(), a.headers.clone(), a.payload.clone())
            .await;
        sent.push((a.done, s));
    }
    for (done, s) in sent {
        let _ = done.send(acked(s).await);
    }
}

async fn acked(sent: std::result::Result<PublishAckFuture, PublishError>) -> Outcome {
    match sent {
        Ok(ack) => ack.into_future().await.map(Acked::from).map_err(Arc::new),
        Err(e) => Err(Arc::new(e)),
    }
}

#[cfg(test)]
mod tests {
    use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
    use async_nats::jetstream::{self, context::PublishErrorKind, stream};
    use bytes::Bytes;
    use skein_testnats::NatsServer;

    use super::{Acked, Group, Outcome};

    fn headers(expected: u64, id: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected.to_string().as_str(),
        );
        h.insert(NATS_MESSAGE_ID, id);
        h
    }

    /// Appends made together through a group get the outcome each would have had alone:
    /// stored where the ack says, a lost race refused, a repeat a duplicate of what is
    /// stored. On a stream that takes atomic batches (servers 2.12 and later) the first
    /// round goes as batches committed whole, and the second, which holds a lost race and
    /// a repeat, is refused whole and published again apart. On a stream that does not,
    /// every batch goes apart.
    ///
    /// On one thread, so that each round is queued whole before the group's writer takes
    /// any of it: on two, the writer could take the first appends of round two as a group
    /// of their own and leave the lost race in a group too small to batch.
    #[tokio::test(flavor = "current_thread")]
    async fn appends_made_together_get_the_outcome_each_would_have_had_alone() {
        let server = NatsServer::start();
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client.clone());
        for (name, atomic) in [("GROUPED", true), ("PLAIN", false)] {
            let lower = name.to_lowercase();
            let made = js
                .create_stream(stream::Config {
                    name: name.into(),
                    subjects: vec![format!("{lower}.>")],
                    allow_atomic_publish: atomic,
                    ..Default::default()
                })
                .await
                .unwrap();
            // A server before 2.12 leaves the flag out: it takes no batches.
            let batches = made.cached_info().config.allow_atomic_publish;
            assert!(!batches || atomic);
            let group = Group::start(client.clone(), js.clone());
            let subject = |i: usize| format!("{lower}.s{i}");
            let body = |i: usize, round: u32| Bytes::from(format!("{name} {i} {round}"));
            // Round one: 300 first appends at once.
            let sent: Vec<_> = (0..300)
                .map(|i| group.publish(subject(i), headers(0, &format!("{i}:1")), body(i, 1)))
                .collect();
            let first: Vec<Outcome> = futures::future::join_all(sent).await;
            let mut seqs = vec![];
            for (i, o) in first.iter().enumerate() {
                let Acked {
                    sequence,
                    duplicate,
                } = o.as_ref().unwrap_or_else(|e| panic!("{name} {i}: {e}"));
                // Where no batch was taken, a server that stored the batch's messages
                // one by one anyway shows them to the second publish as duplicates.
                if batches {
                    assert!(!duplicate, "{name} {i}");
                }
                let stored = made.get_raw_message(*sequence).await.unwrap();
                assert_eq!(stored.subject.as_str(), subject(i));
                assert_eq!(stored.payload, body(i, 1));
                seqs.push(*sequence);
            }
            let mut distinct = seqs.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), 300);
            let (committed, apart) = group.batches();
            if batches {
                assert!(committed > 0 && apart == 0, "{committed} {apart}");
            } else {
                assert_eq!(committed, 0);
            }
            let (_, apart_before) = group.batches();
            // Round two: 100 next appends, one that lost a race (a wrong expected last
            // sequence) and one repeat of a first append, at once.
            let mut sent: Vec<_> = (0..100)
                .map(|i| group.publish(subject(i), headers(seqs[i], &format!("{i}:2")), body(i, 2)))
                .collect();
            sent.push(group.publish(
                subject(100),
                headers(seqs[100] + 100_000, "100:2"),
                body(100, 2),
            ));
            sent.push(group.publish(subject(101), headers(0, "101:1"), body(101, 1)));
            let second: Vec<Outcome> = futures::future::join_all(sent).await;
            for (i, o) in second[..100].iter().enumerate() {
                let a = o.as_ref().unwrap_or_else(|e| panic!("{name} {i}: {e}"));
                if batches {
                    assert!(!a.duplicate, "{name} {i}");
                }
                let stored = made.get_raw_message(a.sequence).await.unwrap();
                assert_eq!(stored.subject.as_str(), subject(i));
                assert_eq!(stored.payload, body(i, 2));
            }
            let lost = second[100].as_ref().expect_err("a lost race");
            assert_eq!(lost.kind(), PublishErrorKind::WrongLastSequence);
            // A repeat: what the server says to it alone, it says through the group. (A
            // duplicate where the server looks for repeats first; where it checks the
            // expected last sequence first, as 2.15 does, a lost race.)
            let alone: Outcome = match js
                .publish_with_headers(subject(101), headers(0, "101:1"), body(101, 1))
                .await
            {
                Ok(ack) => ack.await.map(Acked::from).map_err(std::sync::Arc::new),
                Err(e) => Err(std::sync::Arc::new(e)),
            };
            match (&second[101], &alone) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(a, b);
                    assert!(a.duplicate);
                    assert_eq!(a.sequence, seqs[101]);
                }
                (Err(a), Err(b)) => assert_eq!(a.kind(), b.kind()),
                (a, b) => panic!("{name}: through the group {a:?}, alone {b:?}"),
            }
            let last = made
                .get_last_raw_message_by_subject(&subject(100))
                .await
                .unwrap();
            assert_eq!(last.sequence, seqs[100], "the lost race stored nothing");
            let (_, apart) = group.batches();
            assert_eq!(
                apart - apart_before,
                1,
                "{name}: the second round went as one batch, and apart"
            );
        }
    }
}
