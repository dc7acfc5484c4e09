//! The EventLog on stream `SKEIN_EVENTS`: appends conditional on the subject's last
//! sequence, with a message id that makes a retried publish a duplicate.

use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use skein_core::{Record, SessionId};
use skein_runtime::ports::EventLog;
use skein_runtime::{Error, Result};

use super::read::read_subject;
use super::{events_subject, nats_err, NatsStore};
use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};

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
}

#[async_trait]
impl EventLog for NatsStore {
    async fn append(&self, session: &SessionId, expected_last: u64, record: &Record) -> Result<()> {
        let seq = expected_last + 1;
        if record.env.seq != seq || &record.env.session != session {
            return Err(Error::corrupt_because(format!(
                "record {}#{} appended as {session}#{seq}",
                record.env.session, record.env.seq
            )));
        }
        let expected_sseq = if expected_last == 0 {
            0
        } else {
            match self.head(session) {
                Some((s, sseq)) if s == expected_last => sseq,
                _ => match self.last_with_seq(session).await? {
                    Some((r, sseq)) if r.env.seq == expected_last => sseq,
                    other => {
                        let actual = other.map(|(r, _)| r.env.seq).unwrap_or(0);
                        return Err(Error::Conflict {
                            session: session.to_string(),
                            expected: expected_last,
                            actual,
                        });
                    }
                },
            }
        };
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
                self.heads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(session);
                let actual = self
                    .last_with_seq(session)
                    .await?
                    .map(|(r, _)| r.env.seq)
                    .unwrap_or(0);
                Err(Error::Conflict {
                    session: session.to_string(),
                    expected: expected_last,
                    actual,
                })
            }
            Err(e) => Err(nats_err("append", e)),
        }
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
