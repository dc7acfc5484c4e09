//! The EventLog on stream `SKEIN_EVENTS`: appends conditional on the subject's last
//! sequence, with a message id that makes a retried publish a duplicate; a long run of
//! records as one atomic batch where the server takes them.

use std::sync::atomic::Ordering;

use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use skein_core::{Record, SessionId};
use skein_runtime::ports::{append_each, check_numbering, EventLog};
use skein_runtime::{Error, Result};

use super::read::read_subject;
use super::{events_subject, nats_err, NatsStore};
use async_nats::header::{
    HeaderMap, NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE,
    NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID,
};

impl NatsStore {
    pub(crate) fn head(&self, s: &SessionId) -> Option<(u64, u64)> {
        self.heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(s)
            .copied()
    }

    pub(crate) fn set_head(&self, s: &SessionId, seq: u64, sseq: u64) {
        let mut h = self.heads.lock().unwrap_or_else(|p| p.into_inner());
        if h.len() > 100_000 {
            h.clear();
        }
        h.insert(s.clone(), (seq, sseq));
    }

    /// The last record and its stream sequence.
    pub(crate) async fn last_with_seq(&self, s: &SessionId) -> Result<Option<(Record, u64)>> {
        match self
            .events
            .get_last_raw_message_by_subject(&events_subject(s))
            .await
        {
            Ok(m) => {
                let r = Record::decode(m.payload.to_vec()).map_err(|e| {
                    Error::corrupt(format!("last record of {}", events_subject(s)), e)
                })?;
                Ok(Some((r, m.sequence)))
            }
            Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => {
                Ok(None)
            }
            Err(e) => Err(nats_err("read last", e)),
        }
    }

    /// The stream sequence of the session's record `expected_last` (0 for none), which an
    /// append after it names as the subject's last: from the head when it is known, else
    /// read. A log that does not end at `expected_last` is a conflict.
    async fn expected_sseq(&self, session: &SessionId, expected_last: u64) -> Result<u64> {
        if expected_last == 0 {
            return Ok(0);
        }
        match self.head(session) {
            Some((s, sseq)) if s == expected_last => Ok(sseq),
            _ => match self.last_with_seq(session).await? {
                Some((r, sseq)) if r.env.seq == expected_last => Ok(sseq),
                other => Err(Error::Conflict {
                    session: session.to_string(),
                    expected: expected_last,
                    actual: other.map(|(r, _)| r.env.seq).unwrap_or(0),
                }),
            },
        }
    }

    /// The conflict of an append refused because the subject moved on: the head is
    /// forgotten and the log's actual last seq reported.
    async fn moved_on(&self, session: &SessionId, expected_last: u64) -> Error {
        self.heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session);
        match self.last_with_seq(session).await {
            Ok(last) => Error::Conflict {
                session: session.to_string(),
                expected: expected_last,
                actual: last.map(|(r, _)| r.env.seq).unwrap_or(0),
            },
            Err(e) => e,
        }
    }

    /// Appends [`BATCH_MIN`] to [`BATCH_MAX`] records as one atomic batch: the first
    /// carries the expected last subject sequence, every one but the last goes out without
    /// waiting, and the last commits; the server stores all of them or none. A batch has no
    /// message ids (the server refuses them there), so a commit whose answer is lost is
    /// not retried here: as for any append whose outcome is unknown, the job fails and
    /// the next load reads what the log holds. Returns `Ok(false)` when the server
    /// refused the batch as a batch (atomic publish turned off, too many batches in
    /// flight, a message lost on the way): nothing was stored, and the caller appends
    /// the records one by one.
    async fn append_atomic(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<bool> {
        let expected_sseq = self.expected_sseq(session, expected_last).await?;
        let subject = events_subject(session);
        // The batch id names one attempt only: a unique token from the client.
        let inbox = self.client.new_inbox();
        let id = inbox.rsplit('.').next().unwrap_or(inbox.as_str());
        let n = records.len();
        let headers = |i: usize| {
            let mut h = HeaderMap::new();
            h.insert(NATS_BATCH_ID, id);
            h.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
            if i == 0 {
                h.insert(
                    NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                    expected_sseq.to_string().as_str(),
                );
            }
            h
        };
        let (last, rest) = records.split_last().ok_or_else(|| {
            Error::corrupt_because(format!("an empty batch appended to {subject}"))
        })?;
        for (i, r) in rest.iter().enumerate() {
            self.client
                .publish_with_headers(subject.clone(), headers(i), Bytes::from(r.bytes.clone()))
                .await
                .map_err(|e| nats_err("append batch", e))?;
        }
        let mut h = headers(n - 1);
        h.insert(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL);
        let answer = self
            .client
            .request_with_headers(subject.clone(), h, Bytes::from(last.bytes.clone()))
            .await
            .map_err(|e| nats_err("commit batch", e))?;
        let ack: BatchAck = serde_json::from_slice(&answer.payload)
            .map_err(|e| Error::corrupt(format!("answer to a batch commit on {subject}"), e))?;
        match ack.error {
            None if ack.count == n as u64 => {
                self.set_head(session, expected_last + n as u64, ack.seq);
                Ok(true)
            }
            None => Err(Error::corrupt_because(format!(
                "a batch of {n} records to {subject} was acked as {} records",
                ack.count
            ))),
            Some(e) if e.err_code == WRONG_LAST_SEQUENCE => {
                Err(self.moved_on(session, expected_last).await)
            }
            Some(e) => {
                if e.err_code == ATOMIC_PUBLISH_DISABLED {
                    self.atomic_batches.store(false, Ordering::Relaxed);
                }
                tracing::debug!(
                    code = e.err_code,
                    error = %e.description,
                    records = n,
                    "batch refused; appending its records one by one"
                );
                Ok(false)
            }
        }
    }
}

/// The most records the server takes in one atomic batch.
pub(crate) const BATCH_MAX: usize = 1000;
/// The fewest records worth a batch. A commit costs about 4 ms on a single server of
/// 2.15 (as much as 10 to 16 records appended one by one on loopback), so a turn's few
/// records go one by one and only wide delegations are batched: 1,000 records took 21 ms
/// as a batch and 157 ms one by one.
pub(crate) const BATCH_MIN: usize = 32;
/// JetStream's error codes: the subject's last sequence is not the expected one; atomic
/// publish is not allowed on the stream.
const WRONG_LAST_SEQUENCE: u64 = 10071;
const ATOMIC_PUBLISH_DISABLED: u64 = 10174;

/// The server's answer to a batch's commit.
#[derive(serde::Deserialize)]
struct BatchAck {
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    count: u64,
    error: Option<ApiError>,
}

#[derive(serde::Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

#[async_trait]
impl EventLog for NatsStore {
    async fn append(&self, session: &SessionId, expected_last: u64, record: &Record) -> Result<()> {
        let seq = expected_last + 1;
        check_numbering(session, expected_last, std::slice::from_ref(record))?;
        let expected_sseq = self.expected_sseq(session, expected_last).await?;
        let mut h = HeaderMap::new();
        h.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected_sseq.to_string().as_str(),
        );
        h.insert(NATS_MESSAGE_ID, format!("{session}:{seq}").as_str());
        let res = async {
            self.js
                .publish_with_headers(
                    events_subject(session),
                    h,
                    Bytes::from(record.bytes.clone()),
                )
                .await?
                .await
        }
        .await;
        match res {
            Ok(ack) => {
                if ack.duplicate {
                    // Someone already wrote this seq: ours only if the bytes are the same.
                    let stored = self
                        .events
                        .get_raw_message(ack.sequence)
                        .await
                        .map_err(|e| nats_err("read dup", e))?;
                    if stored.payload.as_ref() != record.bytes.as_slice() {
                        self.heads
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(session);
                        return Err(Error::Conflict {
                            session: session.to_string(),
                            expected: expected_last,
                            actual: seq,
                        });
                    }
                }
                self.set_head(session, seq, ack.sequence);
                Ok(())
            }
            Err(e)
                if matches!(
                    e.kind(),
                    jetstream::context::PublishErrorKind::WrongLastSequence
                ) =>
            {
                Err(self.moved_on(session, expected_last).await)
            }
            Err(e) => Err(nats_err("append", e)),
        }
    }

    /// Where the stream allows atomic batches (servers 2.12 and later), long runs of
    /// records (a wide turn's `Delegated` records) go in batches of up to [`BATCH_MAX`]:
    /// one round trip each, not one per record.
    async fn append_batch(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        check_numbering(session, expected_last, records)?;
        let mut last = expected_last;
        for chunk in records.chunks(BATCH_MAX) {
            // The server holds a few dozen open batches per stream; past this process's
            // share of them, records go one by one rather than be refused as a batch.
            let permit = (chunk.len() >= BATCH_MIN && self.atomic_batches.load(Ordering::Relaxed))
                .then(|| self.batch_slots.try_acquire().ok())
                .flatten();
            let batched = permit.is_some() && self.append_atomic(session, last, chunk).await?;
            if !batched {
                append_each(self, session, last, chunk).await?;
            }
            last += chunk.len() as u64;
        }
        Ok(())
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        // Start after the stream seq of the record before `from_seq` when we know it.
        let after = match self.head(session) {
            Some((s, sseq)) if s + 1 == from_seq => sseq,
            _ => 0,
        };
        let mut out = vec![];
        let mut last = None;
        for (sseq, payload) in read_subject(&self.events, &events_subject(session), after).await? {
            let r = Record::decode(payload.to_vec())
                .map_err(|e| Error::corrupt(format!("record of {session}"), e))?;
            last = Some((r.env.seq, sseq));
            if r.env.seq >= from_seq {
                out.push(r);
            }
        }
        if let Some((s, sseq)) = last {
            self.set_head(session, s, sseq);
        }
        Ok(out)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        Ok(self.last_with_seq(session).await?.map(|(r, _)| r))
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for filter in [events_subject(root), format!("{}.>", events_subject(root))] {
            let mut info = self
                .events
                .info_with_subjects(filter)
                .await
                .map_err(|e| nats_err("tree", e))?;
            while let Some(item) = info.next().await {
                let (subject, _) = item.map_err(|e| nats_err("tree", e))?;
                if let Some(id) = subject.strip_prefix("skein.events.") {
                    out.push(SessionId::parse(id)?);
                }
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        let mut info = self
            .events
            .info_with_subjects("skein.events.*")
            .await
            .map_err(|e| nats_err("roots", e))?;
        while let Some(item) = info.next().await {
            let (subject, _) = item.map_err(|e| nats_err("roots", e))?;
            if let Some(id) = subject.strip_prefix("skein.events.") {
                out.push(SessionId::parse(id)?);
            }
        }
        out.sort();
        Ok(out)
    }
}
