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

use super::roots::{decode, read_range};
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
    /// The subjects of this stream's blocks, less the range's number.
    fn prefix(self) -> &'static str {
        match self {
            Self::Starts => "skein.rootblock.starts.",
            Self::States => "skein.rootblock.states.",
        }
    }
    fn subject(self, k: u64) -> String {
        format!("{}{k}", self.prefix())
    }
}

/// One full range of a stream of the index, packed: for each message, what a filter
/// looks at, not the whole summary (a candidate is read again whole). Agents and statuses
/// are kept once per block, rows name them by their place.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Packed {
    layout: u32,
    first: u64,
    last: u64,
    agents: Vec<String>,
    statuses: Vec<String>,
    rows: Vec<Row>,
}

/// A message of the range, as a JSON array: its sequence less the range's first, its
/// agent's and status's places in the block's lists, its start time, its latest time
/// less its start time, its mission in lower case, and what was cut ([`CUT_AGENT`],
/// [`CUT_MISSION`]; [`UNREAD`] for a message that does not decode).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Row(u64, u32, u32, u64, u64, String, u8);

const CUT_AGENT: u8 = 1;
const CUT_MISSION: u8 = 2;
const UNREAD: u8 = 4;

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

impl Packed {
    /// Packs `msgs` (of `first..=last`), agents and missions cut to `kept` bytes.
    fn of(first: u64, last: u64, msgs: &[(u64, Bytes)], kept: usize) -> Self {
        let mut p = Self {
            layout: LAYOUT,
            first,
            last,
            agents: vec![],
            statuses: vec![],
            rows: Vec::with_capacity(msgs.len()),
        };
        let place = |list: &mut Vec<String>, v: String| {
            let at = list.iter().position(|x| *x == v).unwrap_or_else(|| {
                list.push(v);
                list.len() - 1
            });
            u32::try_from(at).unwrap_or(u32::MAX)
        };
        for (seq, payload) in msgs {
            let off = seq - first;
            let Some(mut s) = decode(payload) else {
                p.rows.push(Row(off, 0, 0, 0, 0, String::new(), UNREAD));
                continue;
            };
            let mut cut = 0;
            if keep(&mut s.agent, kept) {
                cut |= CUT_AGENT;
            }
            let mut mission = s.mission.to_lowercase();
            if keep(&mut mission, kept) {
                cut |= CUT_MISSION;
            }
            let agent = place(&mut p.agents, s.agent);
            let status = place(&mut p.statuses, s.status);
            let since = s.updated_at.saturating_sub(s.started_at);
            p.rows
                .push(Row(off, agent, status, s.started_at, since, mission, cut));
        }
        p
    }

    fn fits(&self, first: u64, last: u64) -> bool {
        self.layout == LAYOUT
            && self.first == first
            && self.last == last
            && self.rows.iter().all(|r| {
                r.6 & UNREAD != 0
                    || (r.0 <= last - first
                        && (r.1 as usize) < self.agents.len()
                        && (r.2 as usize) < self.statuses.len())
            })
    }

    /// The sequences of the messages that may pass `filter` (normalized) and `cursor`.
    /// `status`: whether a row's status counts (a state's is final for its message; a
    /// start's changes later).
    pub(crate) fn candidates(
        &self,
        filter: &RootFilter,
        cursor: Option<&Cursor>,
        status: bool,
    ) -> Vec<u64> {
        let agent_ok = |r: &Row, want: &str| {
            let a = self.agents[r.1 as usize].as_str();
            if r.6 & CUT_AGENT != 0 {
                want.starts_with(a)
            } else {
                a == want
            }
        };
        self.rows
            .iter()
            .filter(|r| {
                r.6 & UNREAD != 0
                    || ((!status
                        || filter
                            .status
                            .as_deref()
                            .is_none_or(|v| self.statuses[r.2 as usize] == v))
                        && filter.agent.as_deref().is_none_or(|a| agent_ok(r, a))
                        && filter.since.is_none_or(|t| r.3 >= t)
                        && filter.until.is_none_or(|t| r.3 < t)
                        && filter
                            .text
                            .as_deref()
                            .is_none_or(|t| r.6 & CUT_MISSION != 0 || r.5.contains(t))
                        && cursor.is_none_or(|c| r.3 <= c.started_at))
            })
            .map(|r| self.first + r.0)
            .collect()
    }

    /// The earliest latest time of its messages (`u64::MAX` if none).
    pub(crate) fn ended_before(&self) -> u64 {
        self.rows
            .iter()
            .filter(|r| r.6 & UNREAD == 0)
            .map(|r| r.3.saturating_add(r.4))
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The newest sequence of a message started before `since`.
    pub(crate) fn started_before(&self, since: u64) -> Option<u64> {
        self.rows
            .iter()
            .filter(|r| r.6 & UNREAD == 0 && r.3 < since)
            .map(|r| self.first + r.0)
            .max()
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
        let packed = Packed::of(first, last, &msgs, kept);
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

    /// Removes the blocks of ranges that lie wholly before the first message left in
    /// their stream: every root they packed was removed (by retention, or aged out), so
    /// no listing reads them again. Returns how many were removed. A range that still
    /// holds a root keeps its block.
    pub async fn drop_emptied_blocks(&self) -> Result<u64> {
        let per = self.block_roots();
        let mut dropped = 0;
        for src in [Source::Starts, Source::States] {
            let first = self
                .source(src)
                .get_info()
                .await
                .map_err(|e| super::nats_err("the index of roots", e))?
                .state
                .first_sequence;
            let prefix = src.prefix();
            let mut emptied = vec![];
            let mut subjects = self
                .root_blocks
                .info_with_subjects(format!("{prefix}*"))
                .await
                .map_err(|e| super::nats_err("the blocks of the index", e))?;
            while let Some(item) = subjects.next().await {
                let (subject, _) =
                    item.map_err(|e| super::nats_err("the blocks of the index", e))?;
                let k = subject
                    .strip_prefix(prefix)
                    .and_then(|k| k.parse::<u64>().ok());
                if let Some(k) = k.filter(|k| (k + 1) * per < first) {
                    emptied.push(k);
                }
            }
            for k in emptied {
                self.root_blocks
                    .purge()
                    .filter(src.subject(k))
                    .await
                    .map_err(|e| super::nats_err("remove a block of the index", e))?;
                dropped += 1;
            }
        }
        Ok(dropped)
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
        let stored = match self
            .root_blocks
            .direct_get_last_for_subject(src.subject((first - 1) / per))
            .await
        {
            Ok(m) => Ok(Some(m.payload)),
            Err(e) if matches!(e.kind(), stream::DirectGetErrorKind::NotFound) => Ok(None),
            Err(e) => Err(super::nats_err("read a block of the index of roots", e)),
        };
        match stored {
            Ok(Some(b)) => match serde_json::from_slice::<Packed>(&b) {
                Ok(p) if p.fits(first, last) => return Ok(Some(p)),
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
    /// before `since` (if any). Whole ranges through their blocks, each candidate read
    /// again by a get; the rest, and a range whose block has too many candidates or
    /// cannot be read, from the stream.
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
                        let before = filter.since.and_then(|t| p.started_before(t));
                        let cand = p.candidates(filter, cursor, false);
                        if cand.len() <= MAX_GETS {
                            let got = futures::future::try_join_all(cand.into_iter().map(
                                |seq| async move {
                                    Ok::<_, skein_ports::Error>((seq, self.start_at(seq).await?))
                                },
                            ))
                            .await?;
                            let out = got
                                .into_iter()
                                .filter_map(|(seq, m)| match m {
                                    Some((root, start)) if !root.is_empty() => {
                                        Some((seq, root, start))
                                    }
                                    _ => None,
                                })
                                .collect();
                            return Ok::<_, skein_ports::Error>((out, before));
                        }
                    }
                }
                let starts = self.starts_between(from, to).await?;
                let before = filter.since.and_then(|t| {
                    starts
                        .iter()
                        .filter(|(_, _, s)| s.as_ref().is_some_and(|s| s.started_at < t))
                        .map(|(q, _, _)| *q)
                        .max()
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
                            let cand = p.candidates(filter, cursor, true);
                            if cand.len() <= MAX_GETS {
                                let got = futures::future::try_join_all(
                                    cand.into_iter().map(|seq| self.state_at(seq)),
                                )
                                .await?;
                                let found = got
                                    .into_iter()
                                    .flatten()
                                    .filter(|s| {
                                        filter.matches(s)
                                            && cursor.is_none_or(|c| s.position() < *c)
                                    })
                                    .collect();
                                return Ok::<_, skein_ports::Error>(Some((
                                    found,
                                    p.ended_before(),
                                )));
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
    fn a_block_reads_back_and_picks_what_may_pass() {
        let start = |root: &str, agent: &str, status: &str, at: u64, mission: &str| {
            Bytes::from(
                serde_json::to_vec(&RootSummary {
                    root: root.into(),
                    agent: agent.into(),
                    status: status.into(),
                    started_at: at,
                    updated_at: at + 10,
                    mission: mission.into(),
                    last_seq: 2,
                })
                .unwrap(),
            )
        };
        let long = format!("{} Needle", "m".repeat(KEPT_BYTES));
        let msgs = vec![
            (11, start("r-1", "a", "completed", 5, "Find the NEEDLE")),
            (
                12,
                start("r-2", &"b".repeat(KEPT_BYTES + 1), "failed", 6, &long),
            ),
            (14, Bytes::from_static(b"{damaged")),
            (15, start("r-4", "a", "failed", 8, "other")),
        ];
        let p = Packed::of(11, 20, &msgs, KEPT_BYTES);
        let back: Packed = serde_json::from_slice(&serde_json::to_vec(&p).unwrap()).unwrap();
        assert!(back.fits(11, 20) && !back.fits(1, 10));
        let f = |agent: Option<&str>, status: Option<&str>, text: Option<&str>| {
            RootFilter {
                agent: agent.map(str::to_string),
                status: status.map(str::to_string),
                text: text.map(str::to_string),
                ..RootFilter::default()
            }
            .normalized()
        };
        // The damaged message is always a candidate; a cut field may hold anything.
        assert_eq!(
            back.candidates(&f(Some("a"), None, None), None, false),
            vec![11, 14, 15]
        );
        assert_eq!(
            back.candidates(&f(Some("z"), None, None), None, false),
            vec![14]
        );
        let b_long = "b".repeat(KEPT_BYTES + 1);
        assert_eq!(
            back.candidates(&f(Some(&b_long), None, None), None, false),
            vec![12, 14]
        );
        assert_eq!(
            back.candidates(&f(None, None, Some("needle")), None, false),
            vec![11, 12, 14]
        );
        assert_eq!(
            back.candidates(&f(None, Some("failed"), None), None, true),
            vec![12, 14, 15]
        );
        assert_eq!(
            back.candidates(&f(None, Some("failed"), None), None, false)
                .len(),
            4
        );
        assert_eq!(back.ended_before(), 15);
        assert_eq!(back.started_before(7), Some(12));
    }
}
