//! Reading one subject of a stream: a few gets from the stream leader, then (for a long
//! subject) a short-lived consumer.

use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{consumer, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use skein_ports::{Error, Result};

use super::nats_err;

/// Reads every message of one subject of a stream after stream seq `after`. The first
/// few come by direct get, one round trip each, which is all most reads need (the tail
/// of a log a worker has folded); a longer subject — a cold load of a parent with
/// hundreds of children, say — is streamed through a short-lived consumer instead, so
/// the cost is a few round trips rather than one per message. Where no consumer can
/// be made (a cluster electing leaders), direct gets read the rest.
pub(crate) async fn read_subject(
    st: &stream::Stream,
    subject: &str,
    after: u64,
) -> Result<Vec<(u64, Bytes)>> {
    Ok(plain(read_all(st, subject, after).await?))
}

/// A message read: its stream sequence, payload and headers.
pub(crate) struct Got {
    pub(crate) subject: async_nats::Subject,
    pub(crate) seq: u64,
    pub(crate) payload: Bytes,
    pub(crate) headers: Option<HeaderMap>,
}

/// The messages without their headers.
fn plain(got: Vec<Got>) -> Vec<(u64, Bytes)> {
    got.into_iter().map(|g| (g.seq, g.payload)).collect()
}

/// [`read_subject`], with each message's headers.
async fn read_all(st: &stream::Stream, subject: &str, after: u64) -> Result<Vec<Got>> {
    const DIRECT_READS: usize = 8;
    let mut out = vec![];
    if read_direct(st, subject, after + 1, Some(DIRECT_READS), &mut out).await? {
        return Ok(out);
    }
    let next = out.last().map_or(after, |g| g.seq) + 1;
    read_rest(st, subject, next, None, &mut out).await?;
    Ok(out)
}

/// Reads what [`read_subject`] reads, for a subject where something new is likely (a
/// parent woken to read the notices of its children, a log read from its start): the first
/// message after `after` and the subject's last message are asked for at once. When they are the same message,
/// as for the one notice that woke the reader, that is the whole read, in one round trip
/// rather than two (the second would only find nothing more). When they are not (children
/// that ended together, each with its notice) and at most [`PROBES`] stream sequences lie
/// between them, one get starts at each of those sequences, all at once: each message of
/// the subject in between is the first one at or after its own sequence, so this one round
/// finds them all, where reading one after the other took a round trip each (eight
/// children that ended together held their parent's settlement for about 3 ms).
pub(crate) async fn read_subject_expecting(
    st: &stream::Stream,
    subject: &str,
    after: u64,
) -> Result<Vec<(u64, Bytes)>> {
    Ok(plain(read_expecting(st, subject, after, false).await?))
}

/// [`read_subject_expecting`], reading no further than the subject's last message when
/// the read began, for a subject others keep appending to while it is read: a parent's
/// notices while its children end. Read to its end as it grew, a wake that came with the
/// first of a thousand children's ends read all thousand notices as they came, in round
/// trips slowed by those very children, and settled none before the last had ended. What
/// comes after the bound is the next read's: each notice is followed by a wake-up of its
/// reader, which comes after this one.
pub(crate) async fn read_subject_to_its_last(
    st: &stream::Stream,
    subject: &str,
    after: u64,
) -> Result<Vec<Got>> {
    read_expecting(st, subject, after, true).await
}

async fn read_expecting(
    st: &stream::Stream,
    subject: &str,
    after: u64,
    bounded: bool,
) -> Result<Vec<Got>> {
    let mut first = vec![];
    let (read, last) = futures::join!(
        read_direct(st, subject, after + 1, Some(1), &mut first),
        st.get_last_raw_message_by_subject(subject)
    );
    let ended = read?;
    let last = match last {
        Ok(m) => Some(Got {
            subject: m.subject,
            seq: m.sequence,
            payload: m.payload,
            headers: Some(m.headers),
        }),
        Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => None,
        Err(e) => return Err(nats_err("read last", e)),
    };
    let from = match (first.last().map(|g| g.seq), last) {
        (None, _) if ended => return Ok(first),
        (Some(seq), Some(last)) if seq >= last.seq => return Ok(first),
        (Some(seq), Some(last)) if last.seq - seq - 1 <= PROBES => {
            let probes = futures::future::join_all((seq + 1..last.seq).map(|s| async move {
                let mut got = vec![];
                read_direct(st, subject, s, Some(1), &mut got).await?;
                Ok::<_, Error>(got)
            }))
            .await;
            let mut between = vec![];
            for got in probes {
                between.extend(got?.into_iter().filter(|g| g.seq < last.seq));
            }
            between.sort_by_key(|g| g.seq);
            between.dedup_by_key(|g| g.seq);
            first.extend(between);
            first.push(last);
            return Ok(first);
        }
        (Some(seq), Some(last)) if bounded => {
            read_rest(st, subject, seq + 1, Some(last.seq), &mut first).await?;
            return Ok(first);
        }
        (seen, _) => seen.unwrap_or(after),
    };
    first.extend(read_all(st, subject, from).await?);
    Ok(first)
}

/// Appends the messages of `subject` from stream seq `from` on to `out`, through `last`
/// when one is given (the subject's last message when the caller looked): through a
/// short-lived consumer, or, where none can be made or it fails on the way (a leader lost
/// while it delivered, say), by direct gets of what it did not read (which may read past
/// `last`: what they find is the subject's all the same).
async fn read_rest(
    st: &stream::Stream,
    subject: &str,
    from: u64,
    last: Option<u64>,
    out: &mut Vec<Got>,
) -> Result<()> {
    let streamed = read_consumer(
        st,
        subject,
        consumer::DeliverPolicy::ByStartSequence {
            start_sequence: from,
        },
        last,
        out,
    )
    .await;
    if let Ok(true) = streamed {
        return Ok(());
    }
    if let Err(e) = &streamed {
        tracing::debug!(subject, error = %e, "streamed read failed; reading the rest by direct gets");
    }
    let next = out.last().map_or(from, |g| g.seq + 1).max(from);
    read_direct(st, subject, next, None, out).await?;
    Ok(())
}

/// The stream sequence of the first message of `subject`, if it has one: one get.
pub(crate) async fn first_seq(st: &stream::Stream, subject: &str) -> Result<Option<u64>> {
    let mut got = vec![];
    read_direct(st, subject, 1, Some(1), &mut got).await?;
    Ok(got.first().map(|g| g.seq))
}

/// How many stream sequences may lie between the first new message and the last one of a
/// subject for [`read_subject_expecting`] to read them with one get each, all at once.
/// Beyond that the gets would mostly find messages of other subjects, and the subject is
/// read in order as [`read_subject`] reads it.
const PROBES: u64 = 16;

/// Direct gets of `subject` from stream seq `from` on, at most `limit` of them; true
/// when the subject was read to its end.
async fn read_direct(
    st: &stream::Stream,
    subject: &str,
    from: u64,
    limit: Option<usize>,
    out: &mut Vec<Got>,
) -> Result<bool> {
    let mut next = from;
    let mut n = 0;
    while limit.is_none_or(|l| n < l) {
        let Some(m) = next_of(st, subject, next).await? else {
            return Ok(true);
        };
        next = m.sequence + 1;
        out.push(Got {
            subject: m.subject,
            seq: m.sequence,
            payload: m.payload,
            headers: Some(m.headers),
        });
        n += 1;
    }
    Ok(false)
}

/// The first message of `subject` (wildcards allowed) at stream seq `seq` or after, from
/// the stream's leader (`STREAM.MSG.GET`, never a direct get, which any replica may
/// answer from behind); none when there is none.
pub(crate) async fn next_of(
    st: &stream::Stream,
    subject: &str,
    seq: u64,
) -> Result<Option<StreamMessage>> {
    match st
        .raw_message_builder()
        .sequence(seq)
        .next_by_subject(subject)
        .send()
        .await
    {
        Ok(m) => Ok(Some(m)),
        Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => Ok(None),
        Err(e) => Err(nats_err("read", e)),
    }
}

/// Appends to `out` the messages of `subject` (wildcards allowed) that `deliver` picks, as
/// they stand when the read starts, through an ephemeral consumer that needs no acks and
/// is deleted when the read ends (the server would keep it for its inactivity threshold),
/// stopping after stream seq `last` when one is given (a block of a stream read at once).
/// False (and nothing read) when no consumer could be made in time.
pub(crate) async fn read_through_consumer_to(
    st: &stream::Stream,
    subject: &str,
    deliver: consumer::DeliverPolicy,
    last: Option<u64>,
    out: &mut Vec<(u64, Bytes)>,
) -> Result<bool> {
    let mut got = vec![];
    let res = read_consumer(st, subject, deliver, last, &mut got).await;
    out.extend(plain(got));
    res
}

/// The messages of `subject` (wildcards allowed) from stream seq `from` to `to`, by the
/// stream leader's gets, one round trip each: for a block too small to be worth a
/// consumer, or when no consumer could be made.
pub(crate) async fn read_by_gets(
    st: &stream::Stream,
    subject: &str,
    from: u64,
    to: u64,
) -> Result<Vec<(u64, Bytes)>> {
    let mut out = vec![];
    let mut next = from;
    while next <= to {
        match next_of(st, subject, next).await? {
            Some(m) if m.sequence <= to => {
                next = m.sequence + 1;
                out.push((m.sequence, m.payload));
            }
            _ => break,
        }
    }
    Ok(out)
}

/// Appends to `out` every message of `subject` (wildcards allowed) from stream seq `from`
/// on, as they stand when the read starts, through one short-lived consumer: each with its
/// subject. One pass over that part of the stream, where a read of each subject it covers
/// by gets walks, for every message after a subject's first, the messages of other
/// subjects stored between (a wide tree's children, whose turns interleave). False (and
/// nothing read) when no consumer could be made in time.
pub(crate) async fn read_subjects_through_consumer(
    st: &stream::Stream,
    subject: &str,
    from: u64,
    out: &mut Vec<Got>,
) -> Result<bool> {
    read_consumer(
        st,
        subject,
        consumer::DeliverPolicy::ByStartSequence {
            start_sequence: from,
        },
        None,
        out,
    )
    .await
}

/// How long a read waits for its consumer: 2 s, or [`PATIENCE_WHEN_STALLING`] for
/// [`STALLING_FOR`] after a creation that did not answer in time. With one node of a
/// 3-node nats-server 2.9.10 cluster down, about half of the read consumers' creations
/// never answered (placed on the lost node, it seems), and each such read waited the whole
/// 2 s before reading by direct gets: the conformance suite on that cluster took 60–78 s,
/// where it takes 15 s on 2.15.1. A creation that answers takes a few milliseconds.
fn create_patience() -> Duration {
    match *STALLED_AT.lock().unwrap_or_else(|p| p.into_inner()) {
        Some(at) if at.elapsed() < STALLING_FOR => PATIENCE_WHEN_STALLING,
        _ => Duration::from_secs(2),
    }
}

/// Notes that a read consumer's creation did not answer in time (see [`create_patience`]).
fn creation_timed_out() {
    *STALLED_AT.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
}

/// How long a creation may wait soon after one did not answer.
const PATIENCE_WHEN_STALLING: Duration = Duration::from_millis(250);
/// How long after a creation that did not answer the shorter wait holds.
const STALLING_FOR: Duration = Duration::from_secs(30);
/// When a creation last did not answer. One for the process: a worker has one store, and
/// where a process has several, the shorter wait only sends a slow read to direct gets
/// sooner.
static STALLED_AT: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);

/// [`read_through_consumer_to`], with each message's subject and headers.
async fn read_consumer(
    st: &stream::Stream,
    subject: &str,
    deliver: consumer::DeliverPolicy,
    last: Option<u64>,
    out: &mut Vec<Got>,
) -> Result<bool> {
    let from = match deliver {
        consumer::DeliverPolicy::ByStartSequence { start_sequence } => Some(start_sequence),
        _ => None,
    };
    let patience = create_patience();
    let made = tokio::time::timeout(
        patience,
        st.create_consumer(consumer::pull::Config {
            filter_subject: subject.to_string(),
            deliver_policy: deliver,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            memory_storage: true,
            ..Default::default()
        }),
    )
    .await;
    let cons: consumer::PullConsumer = match made {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            tracing::debug!(subject, error = %e, "no read consumer; reading by direct gets");
            return Ok(false);
        }
        Err(_) => {
            tracing::debug!(
                subject,
                ?patience,
                "no read consumer in time; reading by direct gets"
            );
            creation_timed_out();
            return Ok(false);
        }
    };
    let name = cons.cached_info().name.clone();
    let mut left = cons.cached_info().num_pending;
    if let (Some(from), Some(last)) = (from, last) {
        left = left.min((last + 1).saturating_sub(from));
    }
    let res = async {
        while left > 0 {
            let mut batch = cons
                .fetch()
                .max_messages(left.min(2048) as usize)
                .expires(Duration::from_secs(5))
                .messages()
                .await
                .map_err(|e| nats_err("read", e))?;
            let mut got = 0;
            loop {
                // A delivery that stops mid-way (its consumer's leader lost) is given
                // up; the caller reads the rest by direct gets.
                let next = tokio::time::timeout(Duration::from_secs(10), batch.next())
                    .await
                    .map_err(|_| {
                        Error::unavailable_because(format!("read of {subject}: delivery stalled"))
                    })?;
                let Some(m) = next else { break };
                let m = m.map_err(|e| nats_err("read", e))?;
                let sseq = m.info().map_err(|e| nats_err("read", e))?.stream_sequence;
                if last.is_some_and(|l| sseq > l) {
                    // Past the block (sequences below it were removed): done.
                    left = 0;
                    break;
                }
                let (m, _) = m.split();
                out.push(Got {
                    subject: m.subject,
                    seq: sseq,
                    payload: m.payload,
                    headers: m.headers,
                });
                got += 1;
                if last.is_some_and(|l| sseq == l) {
                    left = 0;
                    break;
                }
            }
            if left == 0 {
                break;
            }
            if got == 0 {
                return Err(Error::unavailable_because(format!(
                    "read of {subject}: {left} messages announced but none delivered"
                )));
            }
            left = left.saturating_sub(got);
        }
        Ok(true)
    }
    .await;
    // Done with it either way; the server drops it by itself if this is lost. The read
    // does not wait for the delete: it would be one more round trip on the way of every
    // long read (a parent's notices while its children end, a cold load of a long log).
    let st = st.clone();
    tokio::spawn(async move {
        let _ = st.delete_consumer(&name).await;
    });
    res
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use async_nats::jetstream;
    use skein_testnats::NatsServer;

    /// The gets that stand in for a consumer read a block's messages of the filter, from
    /// its first sequence to its last, whichever other subjects lie between and after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_block_read_by_gets_is_the_filters_messages_within_it() {
        let server = NatsServer::start();
        let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
        let st = js
            .create_stream(stream::Config {
                name: "BLOCKS".into(),
                subjects: vec!["blk.>".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        // Sequences 1..=30: every third is another subject's.
        for i in 1..=30u64 {
            let subject = if i % 3 == 0 {
                "blk.other.x".to_string()
            } else {
                format!("blk.mine.{i}")
            };
            js.publish(subject, Bytes::from(i.to_string()))
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let mine = |from: u64, to: u64| -> Vec<(u64, Bytes)> {
            (from..=to)
                .filter(|i| i % 3 != 0)
                .map(|i| (i, Bytes::from(i.to_string())))
                .collect()
        };
        assert_eq!(
            read_by_gets(&st, "blk.mine.*", 4, 20).await.unwrap(),
            mine(4, 20)
        );
        // A block that begins and ends on another subject's sequence.
        assert_eq!(
            read_by_gets(&st, "blk.mine.*", 3, 9).await.unwrap(),
            mine(3, 9)
        );
        // Past the stream's end, and a block holding none of the filter's messages.
        assert_eq!(
            read_by_gets(&st, "blk.mine.*", 28, 40).await.unwrap(),
            mine(28, 30)
        );
        assert!(read_by_gets(&st, "blk.mine.*", 31, 40)
            .await
            .unwrap()
            .is_empty());
        assert_eq!(
            read_by_gets(&st, "blk.other.x", 1, 10).await.unwrap(),
            vec![
                (3, Bytes::from("3")),
                (6, Bytes::from("6")),
                (9, Bytes::from("9"))
            ]
        );
    }
}
