//! The EventLog on stream `SKEIN_EVENTS`: appends conditional on the subject's last
//! sequence, with a message id that makes a retried publish a duplicate; records appended
//! together go as one message (see [`crate::frame`]).

use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use skein_core::{Record, SessionId};
use skein_ports::ports::{check_numbering, Durability, EventLog};
use skein_ports::roots::{RootFilter, RootsPage};
use skein_ports::{Error, Result};
use std::future::IntoFuture;
use std::sync::Arc;

use super::group::Acked;
use super::read::{
    first_seq, read_subject, read_subject_expecting, read_subjects_through_consumer,
};
use super::{events_subject, nats_err, NatsStore};
use crate::frame;
use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};

impl NatsStore {
    pub(crate) fn head(&self, s: &SessionId) -> Option<Head> {
        self.heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(s)
            .copied()
    }

    /// Records that the session's log is known to end with record `seq` (whose hash has
    /// the [`tag`] `tag`), stored at stream sequence `sseq`.
    pub(crate) fn set_head(&self, s: &SessionId, seq: u64, sseq: u64, tag: u64) {
        let mut h = self.heads.lock().unwrap_or_else(|p| p.into_inner());
        if h.len() > 100_000 {
            h.clear();
        }
        h.insert(s.clone(), Head { seq, sseq, tag });
    }

    /// The last record and its stream sequence.
    pub(crate) async fn last_with_seq(&self, s: &SessionId) -> Result<Option<(Record, u64)>> {
        match self
            .events
            .get_last_raw_message_by_subject(&events_subject(s))
            .await
        {
            Ok(m) => {
                let what = || format!("last record of {}", events_subject(s));
                let r = frame::decode(&m.payload)
                    .map_err(|e| undecodable(what(), e))?
                    .pop()
                    .ok_or_else(|| Error::corrupt_because(what()))?;
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
    /// read. A log that does not end at `expected_last`, or ends with another record than
    /// the one whose hash is `prev` (a writer that took a refused pipelined append of its
    /// own for written), is a conflict.
    async fn expected_sseq(
        &self,
        session: &SessionId,
        expected_last: u64,
        prev: &str,
    ) -> Result<u64> {
        if expected_last == 0 {
            return Ok(0);
        }
        match self.head(session) {
            Some(h) if h.seq == expected_last && h.tag == tag(prev) => Ok(h.sseq),
            _ => match self.last_with_seq(session).await? {
                Some((r, sseq)) if r.env.seq == expected_last && r.hash() == prev => Ok(sseq),
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

    /// Appends `records` (one, or several consecutive ones) as one message, conditional on
    /// the subject's last sequence being that of record `expected_last`: stored whole or
    /// not at all. Its message id names the first record, so a publish retried after a
    /// lost ack is dropped as a duplicate, and is ours only if the stored bytes are the same.
    async fn append_message(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        let sent = self.send_message(session, expected_last, records).await?;
        self.settle(session, sent).await
    }

    /// Publishes what [`Self::append_message`] appends, without waiting for its ack.
    async fn send_message(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<Sent> {
        let first = expected_last + 1;
        let last = expected_last + records.len() as u64;
        let payload = frame::encode(records);
        let prev = records.first().map_or("", |r| r.env.prev.as_str());
        let expected_sseq = self.expected_sseq(session, expected_last, prev).await?;
        let mut h = HeaderMap::new();
        h.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected_sseq.to_string().as_str(),
        );
        h.insert(NATS_MESSAGE_ID, format!("{session}:{first}").as_str());
        let ack = match &self.events_group {
            Some(group) => group
                .publish(events_subject(session), h, Bytes::from(payload.clone()))
                .boxed(),
            None => match self
                .js
                .publish_with_headers(events_subject(session), h, Bytes::from(payload.clone()))
                .await
            {
                Ok(ack) => ack
                    .into_future()
                    .map(|r| r.map(Acked::from).map_err(Arc::new))
                    .boxed(),
                Err(e) => return Err(self.refused(session, expected_last, &e).await),
            },
        };
        Ok(Sent {
            ack: ack.shared(),
            expected_last,
            last,
            last_tag: records.last().map_or(0, |r| tag(&r.hash())),
            payload,
        })
    }

    /// Waits for the ack of a message [`Self::send_message`] published: a duplicate is
    /// ours only if the stored bytes are the same, and the session's head moves on.
    async fn settle(&self, session: &SessionId, sent: Sent) -> Result<()> {
        let Sent {
            ack,
            expected_last,
            last,
            last_tag,
            payload,
        } = sent;
        let ack = match ack.await {
            Ok(ack) => ack,
            Err(e) => return Err(self.refused(session, expected_last, &e).await),
        };
        if ack.duplicate {
            // Someone already wrote this seq: ours only if the bytes are the same.
            let stored = self
                .events
                .get_raw_message(ack.sequence)
                .await
                .map_err(|e| nats_err("read dup", e))?;
            if stored.payload.as_ref() != payload.as_slice() {
                self.heads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(session);
                return Err(Error::Conflict {
                    session: session.to_string(),
                    expected: expected_last,
                    actual: expected_last + 1,
                });
            }
        }
        self.set_head(session, last, ack.sequence, last_tag);
        Ok(())
    }

    /// The error of a publish to the log the server refused or that failed.
    async fn refused(
        &self,
        session: &SessionId,
        expected_last: u64,
        e: &jetstream::context::PublishError,
    ) -> Error {
        if matches!(
            e.kind(),
            jetstream::context::PublishErrorKind::WrongLastSequence
        ) {
            self.moved_on(session, expected_last).await
        } else if super::is_full(e) {
            Error::full(
                format!("nats: append to {session}: JetStream has no room"),
                e.to_string(),
            )
        } else {
            nats_err("append", e.to_string())
        }
    }

    /// Waits for the ack of the session's pipelined append, if one is out, without taking
    /// its outcome, which is the writer's ([`Self::make_sure`]): a read waits so that it
    /// sees the records.
    async fn stored(&self, session: &SessionId) {
        let ack = self
            .pipelined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(session)
            .map(|sent| sent.ack.clone());
        if let Some(ack) = ack {
            let _ = ack.await;
        }
    }

    /// Waits for the ack of the session's pipelined append, if one is out
    /// ([`Durability::Pipelined`](skein_ports::ports::Durability::Pipelined)); its error, if it failed. For the session's
    /// writer alone: the next append, and the ack of its job.
    pub(crate) async fn make_sure(&self, session: &SessionId) -> Result<()> {
        let sent = self
            .pipelined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session);
        let pending = self
            .index_pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session);
        match sent {
            Some(sent) => {
                self.settle(session, sent).await?;
                if let Some((expected_last, records)) = pending {
                    self.index_after(session, expected_last, &records).await;
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Appends consecutive runs of records, one message each, in order.
    async fn append_runs(
        &self,
        session: &SessionId,
        expected_last: u64,
        runs: &[&[Record]],
    ) -> Result<()> {
        let mut last = expected_last;
        for run in runs {
            self.append_message(session, last, run).await?;
            last += run.len() as u64;
        }
        Ok(())
    }

    /// The most bytes of records one message carries: a quarter of what the server takes
    /// in a message, at most [`FRAME_BYTES`]. A record larger than that goes alone.
    fn frame_bytes(&self) -> usize {
        (self.client.server_info().max_payload / 4).clamp(1, FRAME_BYTES)
    }
}

/// The ack of a publish, which several may wait for.
type SharedAck = Shared<BoxFuture<'static, super::group::Outcome>>;

/// Where a session's log is known to end: its last record's seq, the stream sequence of
/// its message, and a tag of its hash.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Head {
    seq: u64,
    sseq: u64,
    tag: u64,
}

/// A record hash's first 16 hex digits, enough to tell two records at one seq apart.
fn tag(hash: &str) -> u64 {
    hash.get(..16)
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or(0)
}

/// A message of records published and not yet acknowledged.
pub(crate) struct Sent {
    ack: SharedAck,
    expected_last: u64,
    last: u64,
    /// The [`tag`] of the last record's hash.
    last_tag: u64,
    payload: Vec<u8>,
}

/// The most bytes of records one message of several carries.
const FRAME_BYTES: usize = 256 * 1024;

/// `records` cut into runs that each go as one message: as many as fit in `max_bytes`
/// (counting what framing adds), at least one.
fn runs(records: &[Record], max_bytes: usize) -> Vec<&[Record]> {
    let mut out = vec![];
    let mut start = 0;
    let mut size = 0;
    for (i, r) in records.iter().enumerate() {
        let add = r.bytes.len() + FRAMING_PER_RECORD;
        if i > start && size + add > max_bytes {
            out.push(&records[start..i]);
            start = i;
            size = 0;
        }
        size += add;
    }
    if start < records.len() {
        out.push(&records[start..]);
    }
    out
}

/// What a record adds to a message of several beyond its bytes, at most (the binary's
/// header), and the array's own header.
const FRAMING_PER_RECORD: usize = 5;

impl NatsStore {
    /// Consecutive records go as few messages as they fit in (see [`crate::frame`]): a
    /// turn's records are one publish and one ack, each message stored whole or not at
    /// all.
    async fn append_now(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        check_numbering(session, expected_last, records)?;
        self.make_sure(session).await?;
        self.append_runs(session, expected_last, &runs(records, self.frame_bytes()))
            .await
    }

    /// Published, and its ack left to the session's next append, read or job ack (which
    /// fail if it failed; the next append's condition on the subject's last sequence
    /// would refuse it anyway). Records too many for one message wait as `append_now`.
    async fn append_pipelined(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        check_numbering(session, expected_last, records)?;
        self.make_sure(session).await?;
        let sent = match runs(records, self.frame_bytes()).as_slice() {
            [] => return Ok(()),
            [one] => self.send_message(session, expected_last, one).await?,
            more => return self.append_runs(session, expected_last, more).await,
        };
        let mut out = self.pipelined.lock().unwrap_or_else(|p| p.into_inner());
        if out.len() > 100_000 {
            // Left by sessions whose holder went away (their acks unread): the next
            // append of each reads its head from the server.
            out.clear();
        }
        out.insert(session.clone(), sent);
        Ok(())
    }
}

#[async_trait]
impl EventLog for NatsStore {
    /// [`Durability::Ahead`] waits for the ack, as [`Durability::Now`] does: a stream is
    /// not one file written in order.
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()> {
        let indexed = session.is_root() && !records.is_empty();
        if indexed && expected_last == 0 {
            let (started, named) =
                futures::join!(self.index_start(session, records), self.mark_tree(session));
            started.and(named)?;
        } else if expected_last == 0 && !records.is_empty() {
            // Named in its tree's list before its first record (`trees.rs`).
            self.name_in_tree(session).await?;
        }
        match durability {
            Durability::Now | Durability::Ahead => {
                self.append_now(session, expected_last, records).await?;
                if indexed {
                    self.index_after(session, expected_last, records).await;
                }
            }
            Durability::Pipelined => {
                self.append_pipelined(session, expected_last, records)
                    .await?;
                // The index never says more than the log: an ending pipelined is indexed
                // once its ack is read (`make_sure`).
                if indexed && Self::changes_index(expected_last, records) {
                    let mut pending = self.index_pending.lock().unwrap_or_else(|p| p.into_inner());
                    if pending.len() > 10_000 {
                        // Left by writers that went away: a listing puts their roots right.
                        pending.clear();
                    }
                    pending.insert(session.clone(), (expected_last, records.to_vec()));
                }
            }
        }
        Ok(())
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        // A pipelined append of this process is read once it is stored (its outcome is
        // its writer's).
        self.stored(session).await;
        // Start after the stream seq of the record before `from_seq` when we know it.
        let after = match self.head(session) {
            Some(h) if h.seq + 1 == from_seq => h.sseq,
            _ => 0,
        };
        // Without a known position (a session this process has not read or written: a
        // root's first claim, a child created by another worker, any cold load), its
        // first and last messages are asked for at once: a log of one message (a session
        // just submitted) is read in one round trip, not two.
        let subject = events_subject(session);
        let messages = if after == 0 {
            read_subject_expecting(&self.events, &subject, 0).await?
        } else {
            read_subject(&self.events, &subject, after).await?
        };
        let mut out = vec![];
        let mut last = None;
        let n = messages.len();
        for (i, (sseq, payload)) in messages.into_iter().enumerate() {
            let records = frame::decode(&payload)
                .map_err(|e| undecodable(format!("record of {session}"), e))?;
            if i + 1 == n {
                last = records.last().map(|r| (r.env.seq, sseq, tag(&r.hash())));
            }
            out.extend(records.into_iter().filter(|r| r.env.seq >= from_seq));
        }
        if let Some((s, sseq, tag)) = last {
            self.set_head(session, s, sseq, tag);
        }
        Ok(out)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        self.stored(session).await;
        Ok(self.last_with_seq(session).await?.map(|(r, _)| r))
    }

    /// From the tree's list (`trees.rs`).
    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        self.tree_sessions(root).await
    }

    /// One pass over the tree's part of the stream (see [`NatsStore::read_tree_logs`]).
    async fn read_tree(
        &self,
        root: &SessionId,
        ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>> {
        self.read_tree_logs(root, ids).await
    }

    /// From the index of roots (`roots.rs`).
    async fn roots_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage> {
        self.indexed_roots_page(filter, limit, cursor).await
    }

    /// From the open marks of the index of roots, each checked against its log.
    async fn open_roots(&self) -> Result<Vec<SessionId>> {
        self.indexed_open_roots().await
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        self.sessions_with_subjects("skein.events.*".into(), "roots", &mut out)
            .await?;
        out.sort();
        Ok(out)
    }
}

/// The fewest sessions a tree has for [`NatsStore::read_tree_logs`] to read it in one pass:
/// a smaller tree is read log by log, in fewer requests than a consumer's making, reading
/// and deleting take.
const ONE_PASS_LEAST: usize = 16;

/// The same on a server before 2.10, where a consumer filtered by a wildcard costs more
/// as the stream's subjects grow (18 ms to make and delete at 100,000 roots on 2.9.10,
/// docs/nats.md): only a tree whose logs, read one by one, cost more than that.
const ONE_PASS_LEAST_BEFORE_2_10: usize = 256;

impl NatsStore {
    /// The whole logs of `ids`, sessions of the tree of `root`, in that order: the root's
    /// read as [`EventLog::read`] reads it, and every message of its sessions' subjects
    /// (`skein.events.<root>.>`) from the root's first on (each session of a tree is made
    /// after its root) through one short-lived consumer, as they stand when the read
    /// starts. Where `ids` are one session and sessions under it (a subtree), that session
    /// stands for the root, so the read covers the subtree only.
    ///
    /// A log read by gets takes one per message, and each get of a message after the
    /// subject's first walks the server's block from there to it, past every message of
    /// other sessions between: a child of a wide tree, whose turns interleave with its
    /// siblings', walked about a thousand messages per message, and `skein tree` of a tree
    /// of 1,024 children took a second of the server's CPU. (One consumer with both the
    /// root's subject and the wildcard as filters costs the server ten times what the
    /// wildcard alone does, on 2.15.1.)
    ///
    /// A log that does not begin at its first record in that pass, or is empty, is read by
    /// itself. `None` (read each log) for a small tree (see [`ONE_PASS_LEAST`]), for a top
    /// with no message, or when no consumer can be made or its delivery fails.
    pub(crate) async fn read_tree_logs(
        &self,
        root: &SessionId,
        ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>> {
        let least = if super::version_at_least(&self.client.server_info().version, (2, 10, 0)) {
            ONE_PASS_LEAST
        } else {
            ONE_PASS_LEAST_BEFORE_2_10
        };
        if ids.len() < least {
            return Ok(None);
        }
        // Appends of this process still out are read once stored, as `read` does.
        for id in ids {
            self.stored(id).await;
        }
        // The part of the tree asked for: a subtree (a cancel of one session and what is
        // under it) is read from its own top, not from the tree's root.
        let top = ids
            .iter()
            .min_by_key(|s| s.depth())
            .filter(|t| root.contains(t) && ids.iter().all(|s| t.contains(s)))
            .unwrap_or(root);
        let top_subject = events_subject(top);
        let Some(from) = first_seq(&self.events, &top_subject).await? else {
            return Ok(None);
        };
        let children = format!("{top_subject}.>");
        let mut got = vec![];
        let (read, top_log) = futures::join!(
            read_subjects_through_consumer(&self.events, &children, from, &mut got),
            async {
                match ids.contains(top) {
                    true => self.read(top, 1).await,
                    false => Ok(vec![]),
                }
            }
        );
        match read {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => {
                tracing::debug!(%root, error = %e, "one-pass read of a tree failed; reading each log");
                return Ok(None);
            }
        }
        let top_log = top_log?;
        let at: std::collections::HashMap<&str, usize> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect();
        let mut logs: Vec<Vec<Record>> = vec![vec![]; ids.len()];
        let mut ends: Vec<Option<u64>> = vec![None; ids.len()];
        for g in got {
            let Some(i) = g
                .subject
                .strip_prefix("skein.events.")
                .and_then(|s| at.get(s).copied())
            else {
                continue;
            };
            let records = frame::decode(&g.payload)
                .map_err(|e| undecodable(format!("record of {}", ids[i]), e))?;
            logs[i].extend(records);
            ends[i] = Some(g.seq);
        }
        // The top's log as read by itself; a log that does not begin at its first record
        // here (written before its top's first, as no runtime writes a tree but an import
        // might) or that is empty (named but never written, as a rule), read by itself.
        for (i, id) in ids.iter().enumerate() {
            if id == top {
                logs[i] = top_log.clone();
                ends[i] = None;
            } else if logs[i].first().is_none_or(|r| r.env.seq != 1) {
                logs[i] = self.read(id, 1).await?;
                ends[i] = None;
            }
        }
        for ((id, log), end) in ids.iter().zip(&logs).zip(ends) {
            if let (Some(r), Some(sseq)) = (log.last(), end) {
                self.set_head(id, r.env.seq, sseq, tag(&r.hash()));
            }
        }
        Ok(Some(logs))
    }

    /// Adds to `out` the session of each subject of `SKEIN_EVENTS` that `filter` picks (a
    /// stream info listing its subjects; `what` names it in an error).
    pub(crate) async fn sessions_with_subjects(
        &self,
        filter: String,
        what: &str,
        out: &mut Vec<SessionId>,
    ) -> Result<()> {
        let mut info = self
            .events
            .info_with_subjects(filter)
            .await
            .map_err(|e| nats_err(what, e))?;
        while let Some(item) = info.next().await {
            let (subject, _) = item.map_err(|e| nats_err(what, e))?;
            if let Some(id) = subject.strip_prefix("skein.events.") {
                out.push(SessionId::parse(id)?);
            }
        }
        Ok(())
    }
}

/// A message that does not read as records: damage, unless its records are of a format
/// newer than this process reads (a worker of a later release wrote them).
fn undecodable(what: String, e: frame::FrameError) -> Error {
    match e.into_newer() {
        Ok(newer) => Error::Core(newer),
        Err(e) => Error::corrupt(what, e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{runs, FRAMING_PER_RECORD};
    use crate::frame::tests::chain;
    use skein_core::{Record, SessionId};

    /// Records of one session whose bytes grow from about 60 to about 3,000.
    fn records() -> Vec<Record> {
        let s = SessionId::parse("01jd0000000000000000000000").unwrap();
        chain(&s, 1..=40, |seq| (seq * seq * 2) as usize)
    }

    #[test]
    fn runs_are_in_order_fit_the_limit_and_take_all_that_fits() {
        let rs = records();
        let cost = |run: &[Record]| -> usize {
            run.iter().map(|r| r.bytes.len() + FRAMING_PER_RECORD).sum()
        };
        for max in [1, 100, 500, 1_000, 4_000, 10_000, 1 << 20] {
            let cut = runs(&rs, max);
            let again: Vec<&[u8]> = cut
                .iter()
                .flat_map(|r| r.iter())
                .map(|r| &r.bytes[..])
                .collect();
            let all: Vec<&[u8]> = rs.iter().map(|r| &r.bytes[..]).collect();
            assert_eq!(again, all, "max {max}: every record once, in order");
            for (i, run) in cut.iter().enumerate() {
                assert!(!run.is_empty(), "max {max}: an empty run");
                assert!(
                    run.len() == 1 || cost(run) <= max,
                    "max {max}: run {i} of {} bytes",
                    cost(run)
                );
                if let Some(next) = cut.get(i + 1) {
                    assert!(
                        cost(run) + cost(&next[..1]) > max,
                        "max {max}: run {i} could have taken the next record"
                    );
                }
            }
        }
        assert_eq!(runs(&rs, 1 << 20).len(), 1);
        assert_eq!(runs(&rs, 1).len(), rs.len());
        assert!(runs(&[], 100).is_empty());
    }
}
