//! Packed blocks of the index of roots, so that a filter that matches few roots (an agent,
//! mission text, an ended status) reads a message per block of roots, not one per root.
//!
//! The sequences of `SKEIN_ROOTS` and of `SKEIN_ROOT_STATE` are cut into aligned ranges
//! of [`BLOCK_ROOTS`] (`1..=1000`, `1001..=2000`, …). Once a range is full (the stream's
//! last sequence is at or past its end), its messages never change, they can only be
//! removed or, in `SKEIN_ROOT_STATE`, replaced by a newer message of the same root at a
//! later sequence. So a range is packed, once, into one message of stream
//! `SKEIN_ROOT_BLOCKS`, subject `skein.rootblock.starts.<k>` or `skein.rootblock.states.<k>`
//! (`k` the range's number from 0): each message's sequence and summary, with its agent
//! and mission cut to [`KEPT_BYTES`] (and marked so). Agent names and missions never go
//! into a subject: the subjects carry only the range's number.
//!
//! A block is a hint, never the truth: a row that may pass a filter is a candidate, read
//! again from its own stream (a state, to see that it was not replaced since; a start
//! whose fields were cut, for the whole text) unless the row decides it alone. A row
//! that cannot pass is passed over. The range still filling is read from its stream.
//!
//! Who writes a block: the writer whose message ends a range (in a task of its own, after
//! its ack), and any reader that finds a full range without one, or with one that does
//! not decode or covers other sequences (a damaged block, or a store written before
//! blocks existed). So the blocks are rebuilt from the index, itself rebuilt from the log.

use async_nats::jetstream::{context, stream};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use skein_ports::roots::{Cursor, RootFilter, RootSummary};
use skein_ports::Result;

use super::roots::{decode, last_of, read_range};
use super::NatsStore;

/// Roots a block packs (stream sequences per range).
pub(crate) const BLOCK_ROOTS: u64 = 1_000;
/// The longest agent and mission a row keeps whole, in bytes; a longer one is cut at a
/// character boundary and its row marked, so that a filter on it reads the whole start.
pub(crate) const KEPT_BYTES: usize = 320;
/// The largest block written, in bytes (under the server's default largest message).
const BLOCK_BYTES: usize = 512 * 1024;
/// The block layout; a block of another is made again.
const LAYOUT: u32 = 1;
/// Blocks read (or made) at once.
const WIDTH: usize = 16;
/// Past this many candidates in a block that need a get each, the range is read whole
/// through a consumer instead.
const MAX_GETS: usize = 64;

/// Which stream of the index a block packs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// `SKEIN_ROOTS`: each root's start.
    Starts,
    /// `SKEIN_ROOT_STATE`: each ended (or reopened) root's latest summary.
    States,
}

impl Source {
    pub(crate) fn filter(self) -> &'static str {
        match self {
            Self::Starts => "skein.roots.*",
            Self::States => "skein.rootstate.*",
        }
    }
    fn subject(self, k: u64) -> String {
        let kind = match self {
            Self::Starts => "starts",
            Self::States => "states",
        };
        format!("skein.rootblock.{kind}.{k}")
    }
}

/// One full range of a stream of the index, packed.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Packed {
    layout: u32,
    first: u64,
    last: u64,
    pub(crate) rows: Vec<Row>,
}

/// A message of the range: its sequence and summary (none when it does not decode),
/// agent and mission cut to what the block keeps. Written as a JSON array, without the
/// names of the fields, a block being read whole.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(from = "Wire", into = "Wire")]
pub(crate) struct Row {
    pub(crate) seq: u64,
    pub(crate) s: Option<RootSummary>,
    cut_agent: bool,
    cut_mission: bool,
}

/// [`Row`] as stored: sequence, then root, agent, status, started at, updated at,
/// mission and last seq (none for a message that does not decode), then what was cut
/// (1 the agent, 2 the mission).
#[derive(Serialize, Deserialize)]
struct Wire(
    u64,
    Option<(String, String, String, u64, u64, String, u64)>,
    u8,
);

impl From<Row> for Wire {
    fn from(r: Row) -> Self {
        let s = r.s.map(|s| {
            (
                s.root,
                s.agent,
                s.status,
                s.started_at,
                s.updated_at,
                s.mission,
                s.last_seq,
            )
        });
        Self(
            r.seq,
            s,
            u8::from(r.cut_agent) | (u8::from(r.cut_mission) << 1),
        )
    }
}

impl From<Wire> for Row {
    fn from(Wire(seq, s, cut): Wire) -> Self {
        let s = s.map(
            |(root, agent, status, started_at, updated_at, mission, last_seq)| RootSummary {
                root,
                agent,
                status,
                started_at,
                updated_at,
                mission,
                last_seq,
            },
        );
        // A row without its summary decides nothing.
        let whole = s.is_some();
        Self {
            seq,
            s,
            cut_agent: cut & 1 != 0 || !whole,
            cut_mission: cut & 2 != 0 || !whole,
        }
    }
}

/// Cuts `s` to at most `kept` bytes at a character boundary; whether it was cut.
fn keep(s: &mut String, kept: usize) -> bool {
    if s.len() <= kept {
        return false;
    }
    let mut at = kept;
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    s.truncate(at);
    true
}

impl Row {
    fn of(seq: u64, payload: &[u8], kept: usize) -> Self {
        match decode(payload) {
            Some(mut s) => {
                let cut_agent = keep(&mut s.agent, kept);
                let cut_mission = keep(&mut s.mission, kept);
                Self {
                    seq,
                    s: Some(s),
                    cut_agent,
                    cut_mission,
                }
            }
            None => Self {
                seq,
                s: None,
                cut_agent: true,
                cut_mission: true,
            },
        }
    }

    /// The row's summary when nothing of it was cut.
    pub(crate) fn whole(&self) -> Option<&RootSummary> {
        self.s
            .as_ref()
            .filter(|_| !self.cut_agent && !self.cut_mission)
    }

    /// Whether the row's root may pass `filter` (normalized) and `cursor`. `status`:
    /// whether the row's status counts (a state's, which is final for its message; a
    /// start's status changes later).
    pub(crate) fn may_pass(
        &self,
        filter: &RootFilter,
        cursor: Option<&Cursor>,
        status: bool,
    ) -> bool {
        let Some(s) = &self.s else {
            return true;
        };
        let agent = |want: &str| {
            if self.cut_agent {
                want.starts_with(s.agent.as_str())
            } else {
                s.agent == want
            }
        };
        let text = |t: &str| self.cut_mission || s.mission.to_lowercase().contains(t);
        (!status || filter.status.as_deref().is_none_or(|v| s.status == v))
            && filter.agent.as_deref().is_none_or(agent)
            && filter.since.is_none_or(|t| s.started_at >= t)
            && filter.until.is_none_or(|t| s.started_at < t)
            && filter.text.as_deref().is_none_or(text)
            && cursor.is_none_or(|c| s.position() < *c)
    }
}

/// The first sequence of the range that holds `seq`.
pub(crate) fn range_start(seq: u64, per: u64) -> u64 {
    (seq.max(1) - 1) / per * per + 1
}

/// `lower..=upper` cut at range boundaries: each piece, and whether it is a whole range.
pub(crate) fn pieces(lower: u64, upper: u64, per: u64) -> Vec<(u64, u64, bool)> {
    let mut out = vec![];
    let mut from = lower;
    while from <= upper {
        let start = range_start(from, per);
        let end = start + per - 1;
        out.push((from, end.min(upper), from == start && end <= upper));
        from = end + 1;
    }
    out
}

/// Packs `first..=last` of `src` and writes the block (a failed write is only logged: the
/// next reader packs it again). None when no consumer could read the range.
async fn pack(
    js: &context::Context,
    st: &stream::Stream,
    src: Source,
    first: u64,
    last: u64,
    per: u64,
) -> Result<Option<Packed>> {
    let Some(msgs) = read_range(st, src.filter(), first, last).await? else {
        return Ok(None);
    };
    // Agents and missions are kept shorter until the block fits in a message.
    let mut kept = KEPT_BYTES;
    let (packed, payload) = loop {
        let packed = Packed {
            layout: LAYOUT,
            first,
            last,
            rows: msgs.iter().map(|(seq, b)| Row::of(*seq, b, kept)).collect(),
        };
        let payload = serde_json::to_vec(&packed);
        match payload {
            Ok(p) if p.len() > BLOCK_BYTES && kept > 0 => kept /= 4,
            _ => break (packed, payload),
        }
    };
    let subject = src.subject((first - 1) / per);
    let written = async {
        let payload = Bytes::from(payload.map_err(|e| e.to_string())?);
        js.publish(subject.clone(), payload)
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())
    };
    if let Err(error) = written.await {
        tracing::debug!(
            subject,
            error,
            "a block of the index of roots was not written"
        );
    }
    Ok(Some(packed))
}

impl NatsStore {
    /// Roots per block: [`BLOCK_ROOTS`], or what a test set.
    pub(crate) fn block_roots(&self) -> u64 {
        self.block_roots.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Packs smaller blocks of the index of roots than [`BLOCK_ROOTS`], so that a test
    /// with a few hundred roots reads whole blocks. Every process on a store must agree:
    /// a block of other bounds is taken as damaged and packed again.
    #[doc(hidden)]
    pub fn set_index_block_roots(&self, roots: u64) {
        self.block_roots
            .store(roots.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    fn source(&self, src: Source) -> &stream::Stream {
        match src {
            Source::Starts => &self.roots_starts,
            Source::States => &self.root_state,
        }
    }

    /// After a message of `src` was stored at `seq`: when it ends a range, packs the
    /// range in a task of its own (the writer does not wait for it).
    pub(crate) fn pack_if_full(&self, src: Source, seq: u64) {
        let per = self.block_roots();
        if seq == 0 || !seq.is_multiple_of(per) {
            return;
        }
        let (js, st) = (self.js.clone(), self.source(src).clone());
        tokio::spawn(async move {
            if let Err(e) = pack(&js, &st, src, seq + 1 - per, seq, per).await {
                tracing::debug!(error = %e.report(), "a block of the index of roots was not packed");
            }
        });
    }

    /// The block of the whole range from `first`: the stored one, else (missing,
    /// damaged, or of other bounds) packed again now. None when it could not be read.
    pub(crate) async fn block(&self, src: Source, first: u64) -> Result<Option<Packed>> {
        let per = self.block_roots();
        let last = first + per - 1;
        let stored = last_of(&self.root_blocks, &src.subject((first - 1) / per)).await;
        match stored {
            Ok(Some((_, b))) => match serde_json::from_slice::<Packed>(&b) {
                Ok(p) if p.layout == LAYOUT && p.first == first && p.last == last => {
                    return Ok(Some(p))
                }
                _ => tracing::debug!(
                    first,
                    "a block of the index of roots is damaged; packing it again"
                ),
            },
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e.report(), "a block of the index of roots was not read")
            }
        }
        pack(&self.js, self.source(src), src, first, last, per).await
    }

    /// The starts of `SKEIN_ROOTS` in `lower..=upper` that may pass `filter` and
    /// `cursor` (as sequence, root and summary), and the newest sequence of a start
    /// before `since` (if any). Whole ranges through their blocks; the rest, and a range
    /// whose block has too many cut candidates or cannot be read, from the stream.
    pub(crate) async fn starts_packed(
        &self,
        lower: u64,
        upper: u64,
        filter: &RootFilter,
        cursor: Option<&Cursor>,
    ) -> Result<(Vec<(u64, String, Option<RootSummary>)>, Option<u64>)> {
        let per = self.block_roots();
        let parts: Vec<_> = futures::stream::iter(pieces(lower, upper, per))
            .map(|(from, to, whole)| async move {
                if whole {
                    if let Some(p) = self.block(Source::Starts, from).await? {
                        let before = filter.since.and_then(|t| {
                            before_since(
                                p.rows
                                    .iter()
                                    .filter_map(|r| r.s.as_ref().map(|s| (r.seq, s))),
                                t,
                            )
                        });
                        let cand: Vec<&Row> = p
                            .rows
                            .iter()
                            .filter(|r| r.may_pass(filter, cursor, false))
                            .collect();
                        if cand.iter().filter(|r| r.whole().is_none()).count() <= MAX_GETS {
                            let mut out = vec![];
                            for r in cand {
                                match r.whole() {
                                    Some(s) => out.push((r.seq, s.root.clone(), Some(s.clone()))),
                                    None => match self.start_at(r.seq).await? {
                                        Some((root, start)) if !root.is_empty() => {
                                            out.push((r.seq, root, start))
                                        }
                                        _ => {}
                                    },
                                }
                            }
                            return Ok::<_, skein_ports::Error>((out, before));
                        }
                    }
                }
                let starts = self.starts_between(from, to).await?;
                let before = filter.since.and_then(|t| {
                    before_since(
                        starts
                            .iter()
                            .filter_map(|(q, _, s)| s.as_ref().map(|s| (*q, s))),
                        t,
                    )
                });
                Ok((starts, before))
            })
            .buffered(WIDTH)
            .try_collect()
            .await?;
        let before = parts.iter().filter_map(|(_, b)| *b).max();
        Ok((parts.into_iter().flat_map(|(s, _)| s).collect(), before))
    }

    /// The ended states of `SKEIN_ROOT_STATE` in `lower..=upper` that pass `filter` and
    /// `cursor`, and the earliest end among all of them (`u64::MAX` if none). Whole
    /// ranges through their blocks: each candidate is read again (it may have been
    /// replaced since); the rest from the stream. None when a range could not be read.
    pub(crate) async fn states_packed(
        &self,
        lower: u64,
        upper: u64,
        filter: &RootFilter,
        cursor: Option<&Cursor>,
    ) -> Result<Option<(Vec<RootSummary>, u64)>> {
        let per = self.block_roots();
        let parts: Vec<Option<(Vec<RootSummary>, u64)>> =
            futures::stream::iter(pieces(lower, upper, per))
                .map(|(from, to, whole)| async move {
                    if whole {
                        if let Some(p) = self.block(Source::States, from).await? {
                            let cand: Vec<u64> = p
                                .rows
                                .iter()
                                .filter(|r| r.may_pass(filter, cursor, true))
                                .map(|r| r.seq)
                                .collect();
                            if cand.len() <= MAX_GETS {
                                let ended_before = p
                                    .rows
                                    .iter()
                                    .filter_map(|r| r.s.as_ref().map(|s| s.updated_at))
                                    .min()
                                    .unwrap_or(u64::MAX);
                                let mut found = vec![];
                                for seq in cand {
                                    if let Some(s) = self.state_at(seq).await? {
                                        if filter.matches(&s)
                                            && cursor.is_none_or(|c| s.position() < *c)
                                        {
                                            found.push(s);
                                        }
                                    }
                                }
                                return Ok::<_, skein_ports::Error>(Some((found, ended_before)));
                            }
                        }
                    }
                    let Some(msgs) =
                        read_range(&self.root_state, Source::States.filter(), from, to).await?
                    else {
                        return Ok(None);
                    };
                    let mut ended_before = u64::MAX;
                    let mut found = vec![];
                    for s in msgs.iter().filter_map(|(_, b)| decode(b)) {
                        ended_before = ended_before.min(s.updated_at);
                        if filter.matches(&s) && cursor.is_none_or(|c| s.position() < *c) {
                            found.push(s);
                        }
                    }
                    Ok(Some((found, ended_before)))
                })
                .buffered(WIDTH)
                .try_collect()
                .await?;
        let Some(parts) = parts.into_iter().collect::<Option<Vec<_>>>() else {
            return Ok(None);
        };
        let ended_before = parts.iter().map(|(_, e)| *e).min().unwrap_or(u64::MAX);
        Ok(Some((
            parts.into_iter().flat_map(|(f, _)| f).collect(),
            ended_before,
        )))
    }

    /// The state at sequence `seq` of `SKEIN_ROOT_STATE`; none when it was replaced or
    /// removed, or does not decode.
    async fn state_at(&self, seq: u64) -> Result<Option<RootSummary>> {
        match self.root_state.get_raw_message(seq).await {
            Ok(m) => Ok(decode(&m.payload)),
            Err(e) if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound) => Ok(None),
            Err(e) => Err(super::nats_err("read the index of roots", e)),
        }
    }
}

/// The newest sequence of a start before `since`.
fn before_since<'a>(
    starts: impl Iterator<Item = (u64, &'a RootSummary)>,
    since: u64,
) -> Option<u64> {
    starts
        .filter(|(_, s)| s.started_at < since)
        .map(|(q, _)| q)
        .max()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pieces_follow_range_boundaries() {
        assert_eq!(
            pieces(3, 25, 10),
            vec![(3, 10, false), (11, 20, true), (21, 25, false)]
        );
        assert_eq!(pieces(1, 10, 10), vec![(1, 10, true)]);
        assert_eq!(range_start(10, 10), 1);
        assert_eq!(range_start(11, 10), 11);
    }

    #[test]
    fn a_long_field_is_cut_at_a_character_boundary_and_marked() {
        let mut s = "é".repeat(KEPT_BYTES);
        assert!(keep(&mut s, KEPT_BYTES));
        assert!(s.len() <= KEPT_BYTES && s.chars().all(|c| c == 'é'));
        let mut short = "short".to_string();
        assert!(!keep(&mut short, KEPT_BYTES));
    }

    #[test]
    fn a_row_reads_back_as_written() {
        let mut long = br#"{"root":"r-1","agent":"a","status":"completed","started_at":5,"updated_at":6,"mission":""#.to_vec();
        long.extend("m".repeat(KEPT_BYTES + 10).bytes());
        long.extend(br#"","last_seq":3}"#);
        for row in [
            Row::of(7, &long, KEPT_BYTES),
            Row::of(8, b"{damaged", KEPT_BYTES),
        ] {
            let back: Row = serde_json::from_slice(&serde_json::to_vec(&row).unwrap()).unwrap();
            assert_eq!(back.s, row.s);
            assert_eq!(
                (back.seq, back.cut_agent, back.cut_mission),
                (row.seq, row.cut_agent, row.cut_mission)
            );
        }
        let row = Row::of(7, &long, KEPT_BYTES);
        assert!(row.whole().is_none() && !row.cut_agent && row.cut_mission);
    }
}
