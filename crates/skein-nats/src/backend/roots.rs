//! The index of roots on NATS, so that a page of the newest roots and the list of open
//! roots cost what they return, not what the store holds.
//!
//! Two streams, both derived from `SKEIN_EVENTS` and rebuilt from it:
//! - `SKEIN_ROOTS`, subject `skein.roots.<root>`: one message per root, its summary as its
//!   first records make it, published *before* those records are appended (with an
//!   expected last subject sequence of 0, so that it is written once). Stream order is
//!   the order roots were submitted, which is their start order (each root's first
//!   record carries the submitter's clock): a page reads it backwards by sequence, a
//!   small block by direct gets, a large one through a consumer; a time range starts at
//!   its end, found by a binary search over the starts, and stops past its start.
//! - `SKEIN_ROOT_STATE`: `skein.rootstate.<root>`, a root's latest summary, written when
//!   it ends (or is reopened by a question). A page of an ended status reads it
//!   backwards (the order roots ended in); one of an open status reads the open marks.
//! - `SKEIN_ROOT_OPEN`: `skein.rootopen.<root>`, a mark published with the root's start
//!   and purged when it ends, so that the open roots are one subject listing of a stream
//!   that holds only them (a subject filter, and a purge by subject, cost the stream's
//!   subjects); and `skein.rootindex`, the index's format, written when a new store's
//!   streams are made or once a rebuild is done (kept out of the large streams, where
//!   finding an old subject's last message walks back through the stream on some
//!   servers).
//! - `SKEIN_ROOT_BLOCKS`: the first two packed a thousand messages at a time, read by a
//!   filter that matches few roots (an agent, mission text, an ended status) past its
//!   first block; see `root_blocks.rs`.
//!
//! The index may lag the log but never loses a root: the start is written before the
//! root's first record, so a root with records always has one. A summary that is not
//! final is checked against the log's last record when it is listed (one get); one
//! behind the log is made again from the root's log and written. An open mark whose root
//! has ended (a writer that stopped between its append and the index write, or an
//! ending whose index write was cut short while the index's streams had no leader) is
//! put right by the listing of open roots. The streams made for a new store (an empty log)
//! are marked built at once. When `skein.rootindex` is missing (a store from before the
//! index, or streams deleted), the first listing rebuilds the index from the roots of
//! `SKEIN_EVENTS`.

use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE};
use async_nats::jetstream::{consumer, context, stream};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use skein_core::{Event, Record, SessionId, Status};
use skein_ports::ports::EventLog;
use skein_ports::roots::{Cursor, RootFilter, RootSummary, RootsPage, MAX_PAGE};
use skein_ports::{Error, Result};

use super::root_blocks::{range_start, Source};
use super::{nats_err, NatsStore};

/// The index's layout; another value (or none) rebuilds it.
const FORMAT: &[u8] = b"1";
const INDEX_SUBJECT: &str = "skein.rootindex";
/// How many stream sequences past a cursor's own a page reads again: roots submitted
/// at once by several clients may be stored a little out of their start order.
pub(crate) const SKEW: u64 = 16;
/// Roots rebuilt at once.
const REBUILD_WIDTH: usize = 32;
/// The largest block of the index a page reads at once; blocks above
/// [`DIRECT_BLOCK`] sequences come through a consumer.
const MAX_BLOCK: u64 = 65_536;
/// The most sequences one consumer reads: a larger block is read by several at once.
const CONSUMER_PART: u64 = 16_384;
const DIRECT_BLOCK: u64 = 64;
/// A range read through a consumer that cannot have one is read by gets up to this many
/// sequences (a page's first block is 32 or more).
const GETS_INSTEAD: u64 = 256;
/// The statuses of an ended root.
const FINISHED: [&str; 3] = ["completed", "failed", "cancelled"];
/// How far apart the clocks of the processes that end roots may be.
const CLOCK_MARGIN_MS: u64 = 60_000;
/// How long an append that ends a root waits for the index to say so. An update cut
/// short is put right by the next listing (the open mark goes only after the ended
/// state is written, and a mark is checked against its log), so the ending (its job's
/// ack, its announced result) does not wait out an election of the index's streams'
/// leaders, where a read and a write each wait out a request's timeout.
const ENDING_INDEX_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn start_subject(root: &str) -> String {
    format!("skein.roots.{root}")
}
fn state_subject(root: &str) -> String {
    format!("skein.rootstate.{root}")
}
fn open_subject(root: &str) -> String {
    format!("skein.rootopen.{root}")
}

fn encode(s: &RootSummary) -> Result<Bytes> {
    serde_json::to_vec(s)
        .map(Bytes::from)
        .map_err(|e| Error::corrupt("a root summary", e))
}

pub(crate) fn decode(b: &[u8]) -> Option<RootSummary> {
    serde_json::from_slice(b).ok()
}

/// The status a terminal record leaves its session in.
fn ending(r: &Record) -> Option<Status> {
    match r.env.body {
        Event::Completed(_) => Some(Status::Completed),
        Event::Failed(_) => Some(Status::Failed),
        Event::Cancelled(_) => Some(Status::Cancelled),
        _ => None,
    }
}

/// The messages of `st` in `lower..=upper`, through consumers, a part of at most
/// [`CONSUMER_PART`] sequences each, all at once; none when a consumer could not be made.
pub(crate) async fn read_range(
    st: &stream::Stream,
    subject: &str,
    lower: u64,
    upper: u64,
) -> Result<Option<Vec<(u64, Bytes)>>> {
    let parts = (lower..=upper)
        .step_by(CONSUMER_PART as usize)
        .map(|from| async move {
            let to = (from + CONSUMER_PART - 1).min(upper);
            // No consumer in time: a cluster electing, or on a server before 2.10 one
            // placed on a node that is down. A small piece is read by the leader's gets
            // at once; a larger one asks for a consumer once more.
            let small = to - from < GETS_INSTEAD;
            for _ in 0..if small { 1 } else { 2 } {
                let mut msgs = vec![];
                let made = super::read::read_through_consumer_to(
                    st,
                    subject,
                    consumer::DeliverPolicy::ByStartSequence {
                        start_sequence: from,
                    },
                    Some(to),
                    &mut msgs,
                )
                .await?;
                if made {
                    return Ok::<_, Error>(Some(msgs));
                }
            }
            if small {
                return Ok(Some(
                    super::read::read_by_gets(st, subject, from, to).await?,
                ));
            }
            Ok(None)
        });
    let got = futures::future::try_join_all(parts).await?;
    Ok(got
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .map(|parts| parts.concat()))
}

async fn last_of(st: &stream::Stream, subject: &str) -> Result<Option<(u64, Bytes)>> {
    match st.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Ok(Some((m.sequence, m.payload))),
        Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => Ok(None),
        Err(e) => Err(nats_err("read the index of roots", e)),
    }
}

/// Marks the index built when the log is empty (a new store): there is nothing to rebuild
/// it from. Called when the index's streams were just made.
pub(crate) async fn mark_built_if_empty(js: &context::Context) -> Result<()> {
    let mut events = js
        .get_stream(super::EVENTS)
        .await
        .map_err(|e| nats_err(super::EVENTS, e))?;
    let empty = events
        .info()
        .await
        .map_err(|e| nats_err(super::EVENTS, e))?
        .state
        .messages
        == 0;
    if empty {
        js.publish(INDEX_SUBJECT, Bytes::from_static(FORMAT))
            .await
            .map_err(|e| nats_err("mark the index of roots", e))?
            .await
            .map_err(|e| nats_err("mark the index of roots", e))?;
    }
    Ok(())
}

impl NatsStore {
    /// Publishes and waits for the ack; the message's stream sequence.
    async fn publish_acked(&self, subject: String, payload: Bytes) -> Result<u64> {
        Ok(self
            .js
            .publish(subject, payload)
            .await
            .map_err(|e| nats_err("write the index of roots", e))?
            .await
            .map_err(|e| nats_err("write the index of roots", e))?
            .sequence)
    }

    /// Publishes `root`'s start unless it has one.
    async fn put_start(&self, s: &RootSummary) -> Result<()> {
        let mut h = HeaderMap::new();
        h.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
        let sent = self
            .js
            .publish_with_headers(start_subject(&s.root), h, encode(s)?)
            .await;
        let acked = match sent {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match acked {
            Ok(ack) => {
                self.pack_if_full(Source::Starts, ack.sequence);
                Ok(())
            }
            Err(e) if matches!(e.kind(), context::PublishErrorKind::WrongLastSequence) => Ok(()),
            Err(e) => Err(nats_err("write the start of a root", e)),
        }
    }

    /// Writes `s` as its root's latest summary, and marks the root open or not.
    async fn put_state(&self, s: &RootSummary) -> Result<()> {
        self.put_state_marked(s, true).await
    }

    /// [`Self::put_state`]; `marked`: whether the root may have an open mark to take off
    /// (not a root whose first records ended it).
    async fn put_state_marked(&self, s: &RootSummary, marked: bool) -> Result<()> {
        let state = async {
            let seq = self
                .publish_acked(state_subject(&s.root), encode(s)?)
                .await?;
            self.pack_if_full(Source::States, seq);
            Ok(())
        };
        if s.is_finished() {
            // The ended state first, then the mark: a root whose state write failed (or
            // was cut short) keeps its mark, which the listing of open roots puts right;
            // without either, a listing of ended roots would miss it.
            state.await?;
            if !marked {
                return Ok(());
            }
            return self
                .root_open
                .purge()
                .filter(open_subject(&s.root))
                .await
                .map(|_| ())
                .map_err(|e| nats_err("unmark an open root", e));
        }
        let open = async {
            self.publish_acked(open_subject(&s.root), Bytes::new())
                .await
                .map(|_| ())
        };
        let (a, b) = futures::join!(state, open);
        a.and(b)
    }

    /// Indexes a root before its first records are appended: its start, and its open
    /// mark unless those records end it. Failing here fails the append: a root is never
    /// in the log without being in the index.
    pub(crate) async fn index_start(&self, root: &SessionId, records: &[Record]) -> Result<()> {
        let Some(s) = RootSummary::of(root, records) else {
            return Ok(());
        };
        let open = async {
            if s.is_finished() {
                Ok(())
            } else {
                self.publish_acked(open_subject(&s.root), Bytes::new())
                    .await
                    .map(|_| ())
            }
        };
        let (a, b) = futures::join!(self.put_start(&s), open);
        a.and(b)
    }

    /// Updates the index after records of a root were appended and acknowledged, if they
    /// change whether it is open: an ending (waited for at most [`ENDING_INDEX_WAIT`]), or
    /// a question that reopens it. A failure is only logged (the append stands; a listing
    /// puts the index right).
    pub(crate) async fn index_after(
        &self,
        root: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) {
        let update = self.index_after_inner(root, expected_last, records);
        let updated = if records.last().is_some_and(|r| r.env.body.is_terminal()) {
            tokio::time::timeout(ENDING_INDEX_WAIT, update)
                .await
                .unwrap_or_else(|_| {
                    Err(Error::unavailable_because(format!(
                        "the index's streams did not answer within {ENDING_INDEX_WAIT:?}"
                    )))
                })
        } else {
            update.await
        };
        if let Err(e) = updated {
            tracing::warn!(%root, error = %e.report(), "the index of roots lags the log; a listing will put it right");
        }
    }

    /// Whether records appended to a root change what its index entry says.
    pub(crate) fn changes_index(expected_last: u64, records: &[Record]) -> bool {
        records.last().is_some_and(|r| r.env.body.is_terminal())
            || (expected_last > 0
                && records
                    .iter()
                    .any(|r| matches!(r.env.body, Event::ClarificationRequested(_))))
    }

    async fn index_after_inner(
        &self,
        root: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<()> {
        let Some(last) = records.last() else {
            return Ok(());
        };
        if !Self::changes_index(expected_last, records) {
            return Ok(());
        }
        let summary = if expected_last == 0 {
            RootSummary::of(root, records)
        } else {
            match (ending(last), self.root_start(root.as_str()).await?) {
                (Some(status), Some(mut s)) => {
                    s.status = status.as_str().to_string();
                    s.updated_at = last.env.at;
                    s.last_seq = last.env.seq;
                    Some(s)
                }
                _ => self.summary_from_log(root).await?,
            }
        };
        match summary {
            // A root whose first records ended it was never marked open.
            Some(s) => self.put_state_marked(&s, expected_last > 0).await,
            None => Ok(()),
        }
    }

    async fn root_start(&self, root: &str) -> Result<Option<RootSummary>> {
        Ok(last_of(&self.roots_starts, &start_subject(root))
            .await?
            .and_then(|(_, b)| decode(&b)))
    }

    async fn summary_from_log(&self, root: &SessionId) -> Result<Option<RootSummary>> {
        Ok(RootSummary::of(root, &self.read(root, 1).await?))
    }

    /// Makes sure the index exists: when its format mark is missing, rebuilds it from
    /// the log (once per process).
    pub(crate) async fn roots_ready(&self) -> Result<()> {
        self.roots_checked
            .get_or_try_init(|| async {
                match last_of(&self.root_open, INDEX_SUBJECT).await? {
                    Some((_, f)) if f.as_ref() == FORMAT => Ok(()),
                    _ => self.rebuild_roots_index().await.map(|_| ()),
                }
            })
            .await
            .map(|_| ())
    }

    /// Indexes every root of `SKEIN_EVENTS` that the index lacks, oldest first, then
    /// writes the format mark. Returns how many roots it read.
    pub async fn rebuild_roots_index(&self) -> Result<usize> {
        let roots = self.roots().await?;
        let n = roots.len();
        tracing::info!(roots = n, "building the index of roots from SKEIN_EVENTS");
        let mut summaries: Vec<RootSummary> = futures::stream::iter(roots)
            .map(|r| async move { self.summary_from_log(&r).await })
            .buffer_unordered(REBUILD_WIDTH)
            .try_filter_map(|s| async move { Ok(s) })
            .try_collect()
            .await?;
        summaries.sort_by_key(|s| s.position());
        // Starts go in start order, one after the other (so that stream order is start
        // order); states and marks in any order.
        for s in &summaries {
            self.put_start(s).await?;
        }
        futures::stream::iter(summaries.clone())
            .map(|s| async move { self.put_state(&s).await })
            .buffer_unordered(REBUILD_WIDTH)
            .try_collect::<Vec<()>>()
            .await?;
        self.publish_acked(INDEX_SUBJECT.to_string(), Bytes::from_static(FORMAT))
            .await?;
        Ok(summaries.len())
    }

    /// The start at stream sequence `seq` of `SKEIN_ROOTS`, as the root and its summary
    /// (none if it does not decode); none where no message is.
    pub(crate) async fn start_at(&self, seq: u64) -> Result<Option<(String, Option<RootSummary>)>> {
        match self.roots_starts.get_raw_message(seq).await {
            Ok(m) => {
                let root = m
                    .subject
                    .strip_prefix("skein.roots.")
                    .unwrap_or_default()
                    .to_string();
                Ok(Some((root, decode(&m.payload))))
            }
            Err(e) if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound) => Ok(None),
            Err(e) => Err(nats_err("read the index of roots", e)),
        }
    }

    /// A root's summary as the index should have it: its latest state, else its start;
    /// one that is not final is checked against the log's last record, and made again
    /// from the log (and written) when it is behind. None for a root without records.
    pub(crate) async fn current(
        &self,
        root: &str,
        start: Option<RootSummary>,
    ) -> Result<Option<RootSummary>> {
        let id = SessionId::parse(root)?;
        let state = last_of(&self.root_state, &state_subject(root))
            .await?
            .and_then(|(_, b)| decode(&b));
        if let Some(s) = &state {
            if s.is_finished() {
                return Ok(state);
            }
        }
        let known = state.or(start);
        match (self.last_with_seq(&id).await?, known) {
            (None, _) => Ok(None),
            (Some((r, _)), Some(s)) if r.env.seq == s.last_seq => Ok(Some(s)),
            _ => {
                let s = self.summary_from_log(&id).await?;
                if let Some(s) = &s {
                    self.put_state(s).await?;
                }
                Ok(s)
            }
        }
    }

    /// A page of roots from the index. A filter on an open status reads the open marks
    /// (what is open); one on a finished status reads `SKEIN_ROOT_STATE` backwards (where
    /// finished roots are, in the order they ended); any other reads `SKEIN_ROOTS`
    /// backwards from the newest, from the cursor's root or from the end of the time
    /// range, to its start. Large blocks come through a consumer, not a get apiece.
    pub(crate) async fn indexed_roots_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage> {
        let cursor = cursor.map(Cursor::parse).transpose()?;
        self.roots_ready().await?;
        let filter = filter.normalized();
        let limit = limit.clamp(1, MAX_PAGE);
        let mut found = match filter.status.as_deref() {
            Some(status) if FINISHED.contains(&status) => {
                self.finished_page(&filter, limit, cursor.as_ref()).await?
            }
            Some(_) => self.open_page(&filter, cursor.as_ref()).await?,
            None => self.starts_page(&filter, limit, cursor.as_ref()).await?,
        };
        found.sort_by_key(|s| std::cmp::Reverse(s.position()));
        found.dedup_by(|a, b| a.root == b.root);
        let next = if found.len() > limit {
            found.truncate(limit);
            found.last().map(|s| s.position().to_string())
        } else {
            None
        };
        Ok(RootsPage { roots: found, next })
    }

    /// Reads `SKEIN_ROOTS` backwards, a block at a time, until more than `limit` roots
    /// pass (or the time range's start is passed, or the stream read). The start's
    /// agent, mission and start time never change, so those conditions (and the cursor)
    /// are tried on it first; only a root that passes them costs a get of its state.
    async fn starts_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&Cursor>,
    ) -> Result<Vec<RootSummary>> {
        let info = self
            .roots_starts
            .get_info()
            .await
            .map_err(|e| nats_err("read the index of roots", e))?;
        let (first, last) = (info.state.first_sequence.max(1), info.state.last_sequence);
        let mut upper = match cursor {
            Some(c) => match last_of(&self.roots_starts, &start_subject(&c.root)).await? {
                Some((seq, _)) => (seq + SKEW).min(last),
                // The cursor's root is gone (removed since): read from the newest.
                None => last,
            },
            None => last,
        };
        if let Some(until) = filter.until {
            upper = upper.min(self.first_start_at_or_after(until, first, last).await? - 1 + SKEW);
        }
        let fixed = RootFilter {
            status: None,
            ..filter.clone()
        };
        // The lowest sequence still to read: set once a start before the range is seen.
        let mut floor = first;
        let mut found: Vec<RootSummary> = vec![];
        let mut block = (limit as u64 + SKEW).max(32);
        // An agent or mission text may match few roots: whole ranges are read through
        // their packed blocks (`root_blocks.rs`), so blocks start at range boundaries.
        let packed = fixed.agent.is_some() || fixed.text.is_some();
        let per = self.block_roots();
        let top = upper;
        while upper >= floor && upper > 0 && found.len() <= limit {
            // The first block as it is (a page that fills from the newest reads no more).
            let mut lower = upper.saturating_sub(block - 1);
            if packed && upper < top {
                lower = range_start(lower, per);
            }
            let lower = lower.max(floor);
            let (starts, before_since) = if packed {
                self.starts_packed(lower, upper, &fixed, cursor).await?
            } else {
                let starts = self.starts_between(lower, upper).await?;
                let before = filter.since.and_then(|since| {
                    starts
                        .iter()
                        .filter(|(_, _, s)| s.as_ref().is_some_and(|s| s.started_at < since))
                        .map(|(seq, _, _)| *seq)
                        .max()
                });
                (starts, before)
            };
            if let Some(seq) = before_since {
                floor = floor.max(seq.saturating_sub(SKEW));
            }
            let wanted = starts.into_iter().filter(|(_, _, start)| match start {
                Some(s) => fixed.matches(s) && cursor.is_none_or(|c| s.position() < *c),
                None => true,
            });
            let got = futures::stream::iter(wanted)
                .map(|(_, root, start)| async move { self.current(&root, start).await })
                .buffer_unordered(REBUILD_WIDTH)
                .try_collect::<Vec<_>>()
                .await?;
            for s in got.into_iter().flatten() {
                if cursor.is_some_and(|c| s.position() >= *c) || !filter.matches(&s) {
                    continue;
                }
                found.push(s);
            }
            if lower <= floor {
                break;
            }
            upper = lower - 1;
            block = (block * 2).min(MAX_BLOCK);
        }
        Ok(found)
    }

    /// The first sequence of `SKEIN_ROOTS` whose start is at or after `at` (one past
    /// `last` if none is), by a binary search: the stream is in start order (within
    /// [`SKEW`]). A start that does not decode counts as before `at`.
    async fn first_start_at_or_after(&self, at: u64, first: u64, last: u64) -> Result<u64> {
        // The newest start before `at` means every start is, in start order; a stream
        // that says otherwise (starts far in the future of later ones) is read whole.
        match self.start_from(last).await? {
            Some((_, Some(s))) if s.started_at >= at => {}
            _ => return Ok(last + 1),
        }
        let (mut lo, mut hi) = (first, last + 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.start_from(mid).await? {
                Some((seq, Some(s))) if s.started_at < at => lo = seq + 1,
                Some((seq, None)) => lo = seq + 1,
                _ => hi = mid,
            }
        }
        Ok(lo)
    }

    /// The first start at or after sequence `seq`, as its sequence and summary. Read from
    /// the stream's leader: a direct get may be answered by a replica that is behind, and a
    /// start it has not yet would end a time range's search too early (a page missing the
    /// roots just submitted, seen with a node of three down on nats-server 2.9.10).
    async fn start_from(&self, seq: u64) -> Result<Option<(u64, Option<RootSummary>)>> {
        let m = super::read::next_of(&self.roots_starts, "skein.roots.*", seq).await?;
        Ok(m.map(|m| (m.sequence, decode(&m.payload))))
    }

    /// The starts of `SKEIN_ROOTS` in `lower..=upper`: as sequence, root and summary.
    /// A small block by direct gets; a large one through a consumer (by gets when none
    /// can be made).
    pub(crate) async fn starts_between(
        &self,
        lower: u64,
        upper: u64,
    ) -> Result<Vec<(u64, String, Option<RootSummary>)>> {
        if upper - lower + 1 > DIRECT_BLOCK {
            let streamed = read_range(&self.roots_starts, "skein.roots.*", lower, upper).await;
            if let Ok(Some(msgs)) = streamed {
                let mut out = Vec::with_capacity(msgs.len());
                for (seq, payload) in msgs {
                    match decode(&payload) {
                        Some(s) => out.push((seq, s.root.clone(), Some(s))),
                        // The root is in the subject only: one get for it.
                        None => match self.start_at(seq).await? {
                            Some((root, start)) if !root.is_empty() => out.push((seq, root, start)),
                            _ => {}
                        },
                    }
                }
                return Ok(out);
            }
        }
        let got = futures::future::try_join_all(
            (lower..=upper)
                .map(|seq| async move { Ok::<_, Error>((seq, self.start_at(seq).await?)) }),
        )
        .await?;
        Ok(got
            .into_iter()
            .filter_map(|(seq, m)| match m {
                Some((root, start)) if !root.is_empty() => Some((seq, root, start)),
                _ => None,
            })
            .collect())
    }

    /// The open roots that pass `filter` (an open status), each brought up to date.
    async fn open_page(
        &self,
        filter: &RootFilter,
        cursor: Option<&Cursor>,
    ) -> Result<Vec<RootSummary>> {
        let open = self.indexed_open_roots().await?;
        let got = futures::stream::iter(open)
            .map(|root| async move {
                let start = self.root_start(root.as_str()).await?;
                self.current(root.as_str(), start).await
            })
            .buffer_unordered(REBUILD_WIDTH)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(got
            .into_iter()
            .flatten()
            .filter(|s| filter.matches(s) && cursor.is_none_or(|c| s.position() < *c))
            .collect())
    }

    /// Reads `SKEIN_ROOT_STATE` (one summary per ended root, in the order they ended)
    /// backwards, a block at a time, for roots in a finished status. A root ends after
    /// it starts, so once a block's roots all ended (less a margin for clocks) before the
    /// start of the page's last root, no older block holds one that sorts before it.
    /// An ended root whose state was not written yet is an open mark: the listing of
    /// open roots writes it first.
    async fn finished_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&Cursor>,
    ) -> Result<Vec<RootSummary>> {
        self.indexed_open_roots().await?;
        let info = self
            .root_state
            .get_info()
            .await
            .map_err(|e| nats_err("read the index of roots", e))?;
        let (first, mut upper) = (info.state.first_sequence.max(1), info.state.last_sequence);
        let mut found: Vec<RootSummary> = vec![];
        let mut block = (limit as u64 + SKEW).max(32);
        let per = self.block_roots();
        while upper >= first && upper > 0 {
            // Past the first block (read as it is), whole ranges go through their packed blocks
            // (`root_blocks.rs`): a status (or agent, or text) that few roots ended in
            // costs a message per range, not one per root.
            let mut lower = upper.saturating_sub(block - 1);
            if upper < info.state.last_sequence {
                lower = range_start(lower, per);
            }
            let lower = lower.max(first);
            let Some((got, ended_before)) =
                self.states_packed(lower, upper, filter, cursor).await?
            else {
                return Err(Error::unavailable_because(
                    "no consumer could be made to read the ended roots".to_string(),
                ));
            };
            found.extend(got);
            if found.len() > limit {
                found.sort_by_key(|s| std::cmp::Reverse(s.position()));
                found.truncate(limit + 1);
                let kth = found[limit].started_at;
                if ended_before.saturating_add(CLOCK_MARGIN_MS) < kth {
                    break;
                }
            }
            // Older blocks ended before the range starts, so they started before it too.
            if lower <= first
                || filter
                    .since
                    .is_some_and(|t| ended_before.saturating_add(CLOCK_MARGIN_MS) < t)
            {
                break;
            }
            upper = lower - 1;
            block = (block * 2).min(MAX_BLOCK);
        }
        Ok(found)
    }

    /// The open roots from their marks, each checked against its log's last record: a
    /// mark whose root has ended is put right, one whose root has no records is passed.
    pub(crate) async fn indexed_open_roots(&self) -> Result<Vec<SessionId>> {
        self.roots_ready().await?;
        let mut marked = vec![];
        let mut info = self
            .root_open
            .info_with_subjects("skein.rootopen.*")
            .await
            .map_err(|e| nats_err("open roots", e))?;
        while let Some(item) = info.next().await {
            let (subject, _) = item.map_err(|e| nats_err("open roots", e))?;
            if let Some(id) = subject.strip_prefix("skein.rootopen.") {
                marked.push(SessionId::parse(id)?);
            }
        }
        let checked: Vec<Option<SessionId>> = futures::stream::iter(marked)
            .map(|root| async move {
                match self.last_with_seq(&root).await? {
                    None => Ok::<_, Error>(None),
                    Some((r, _)) if r.env.body.is_terminal() => {
                        if let Some(s) = self.summary_from_log(&root).await? {
                            self.put_state(&s).await?;
                        }
                        Ok(None)
                    }
                    Some(_) => Ok(Some(root)),
                }
            })
            .buffer_unordered(REBUILD_WIDTH)
            .try_collect()
            .await?;
        let mut open: Vec<SessionId> = checked.into_iter().flatten().collect();
        open.sort();
        Ok(open)
    }
}
impl NatsStore {
    /// Takes `root` out of the index (its tree was removed from the log).
    pub(crate) async fn unindex(&self, root: &str) -> Result<()> {
        for (st, subject) in [
            (&self.roots_starts, start_subject(root)),
            (&self.root_state, state_subject(root)),
            (&self.root_open, open_subject(root)),
        ] {
            st.purge()
                .filter(subject)
                .await
                .map_err(|e| nats_err("remove a root from the index", e))?;
        }
        Ok(())
    }
}
