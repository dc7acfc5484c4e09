//! Read-only views over logs: what `sessions`, `tree`, `events` and `run`'s summary show.
//! Works on any backend.

use serde::Serialize;
use skein_core::{Envelope, Event, Record, SessionId, SessionState, Usage};

use crate::ports::Backend;
use crate::worker::Folded;
use crate::Result;

/// One session of a tree, summarised.
#[derive(Debug, Clone, Serialize)]
pub struct SessionRow {
    pub session: String,
    pub depth: u32,
    pub agent: String,
    pub status: String,
    pub steps: u32,
    pub tool_calls: u32,
    pub children: u32,
    pub cache_hits: u32,
    /// This session's own model usage.
    pub usage: Usage,
    /// Its own plus everything it started.
    pub usage_total: Usage,
    /// What cache hits saved.
    pub saved: Usage,
    pub started_at: u64,
    /// Time of the terminal event, if any.
    pub ended_at: Option<u64>,
    pub wall_ms: u64,
    /// Workers that made model or tool calls for this session.
    pub workers: Vec<String>,
    pub mission: String,
    pub answer: Option<String>,
    pub error: Option<String>,
    /// The pattern that started this session (`handoff`, `route`, `advisor`), if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// This session's delegations answered from the cache, each with what its key
    /// covered: why it hit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hits: Vec<HitRow>,
    /// The definitions version the session runs on (its tree's, pinned at submission);
    /// none: the worker's own files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defs: Option<String>,
    /// It completed with a partial answer: made without some child's answer (a child
    /// under it failed or was cancelled), so not cached.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partial: bool,
}

/// A delegation (or a root) answered from the cache.
#[derive(Debug, Clone, Serialize)]
pub struct HitRow {
    /// The call it answered (empty for a root answered whole).
    pub call: String,
    /// The session whose answer it is.
    pub source: String,
    pub mission_hash: String,
    /// What the key covered (absent for hits recorded before keys were shown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<skein_core::hash::KeyParts>,
}

/// Folds a whole log (checking its chain).
pub fn fold_records(id: &SessionId, records: &[Record]) -> Result<Folded> {
    let mut f = Folded::new(id.clone());
    f.absorb(records)?;
    Ok(f)
}

/// What a session's row takes from its records beyond its folded state: the workers that
/// made its calls, its tool calls, when it ended, and its cache hits.
#[derive(Debug, Clone, Default)]
pub(crate) struct Seen {
    workers: Vec<String>,
    tool_calls: u32,
    ended_at: Option<u64>,
    hits: Vec<HitRow>,
}

impl Seen {
    /// Takes in the next record of the session.
    pub(crate) fn record(&mut self, env: &Envelope) {
        let w = match &env.body {
            Event::CacheHit(h) => {
                self.hits.push(HitRow {
                    call: h.call.clone(),
                    source: h.source.display(),
                    mission_hash: h.mission_hash.clone(),
                    key: h.key.as_deref().cloned(),
                });
                None
            }
            Event::ModelCalled(m) => Some(&m.worker),
            Event::ToolCalled(t) => {
                self.tool_calls += 1;
                Some(&t.worker)
            }
            e if e.is_terminal() => {
                self.ended_at = Some(env.at);
                None
            }
            _ => None,
        };
        if let Some(w) = w.filter(|w| !w.is_empty()) {
            if !self.workers.contains(w) {
                self.workers.push(w.clone());
            }
        }
    }
}

pub fn row(id: &SessionId, records: &[Record], state: &SessionState) -> SessionRow {
    let mut seen = Seen::default();
    for r in records {
        seen.record(&r.env);
    }
    row_seen(id, &seen, state)
}

/// The row of a fold: what its records showed as they were folded in.
pub fn row_of(f: &Folded) -> SessionRow {
    row_seen(&f.id, &f.seen, &f.state)
}

fn row_seen(id: &SessionId, seen: &Seen, state: &SessionState) -> SessionRow {
    let Seen {
        workers,
        tool_calls,
        ended_at,
        hits,
    } = seen.clone();
    let sub = state.submitted.as_ref();
    let end = ended_at.unwrap_or(state.updated_at);
    SessionRow {
        session: id.display(),
        depth: id.depth(),
        agent: sub.map(|s| s.agent.clone()).unwrap_or_default(),
        status: state.status.as_str().into(),
        steps: state.steps,
        tool_calls,
        children: state.children.values().filter(|c| !c.cached).count() as u32,
        cache_hits: state.accounting.cache_hits,
        usage: state.accounting.usage_own,
        usage_total: state.usage_total(),
        saved: state.accounting.saved,
        started_at: state.started_at,
        ended_at,
        wall_ms: end.saturating_sub(state.started_at),
        workers,
        mission: sub.map(|s| s.mission.clone()).unwrap_or_default(),
        answer: state.ending.answer.clone(),
        error: state.ending.error.clone(),
        via: sub
            .and_then(|s| s.parent.as_ref())
            .filter(|p| skein_core::state::PatternKind::of_call(&p.call).is_some())
            .and_then(|p| skein_core::state::split_call(&p.call))
            .map(|(name, _)| name.to_string()),
        hits,
        defs: sub.and_then(|s| s.defs.clone()),
        partial: state.status == skein_core::Status::Completed && state.accounting.partial,
    }
}

/// Every session of a tree, parents before children, siblings in id order.
pub async fn tree_rows(b: &Backend, root: &SessionId) -> Result<Vec<SessionRow>> {
    let read = tree_folds(b, root).await?;
    Ok(rows_of(&read))
}

/// The rows of sessions read by [`tree_folds`], parents before children, siblings in id
/// order.
pub fn rows_of(read: &[(Vec<Record>, Folded)]) -> Vec<SessionRow> {
    let mut out: Vec<SessionRow> = read
        .iter()
        .map(|(records, f)| row(&f.id, records, &f.state))
        .collect();
    // Sort by path so that children follow their parent, numbering naturally.
    out.sort_by_key(|r| natural_key(&r.session));
    out
}

/// The rows of folds, parents before children, siblings in id order.
pub fn rows_of_folds<F: std::borrow::Borrow<Folded>>(folds: &[F]) -> Vec<SessionRow> {
    let mut out: Vec<SessionRow> = folds.iter().map(|f| row_of(f.borrow())).collect();
    out.sort_by_key(|r| natural_key(&r.session));
    out
}

/// How many logs [`tree_folds`] reads at once.
const READERS: usize = 8;

/// Every session of a tree: its whole log, and that log folded (its chain checked). Logs
/// are read and folded on up to [`READERS`] tasks at once, so that a wide tree's report
/// (decoding and hashing every record) uses every core; the order is that of
/// [`EventLog::tree`](crate::ports::EventLog::tree).
pub async fn tree_folds(b: &Backend, root: &SessionId) -> Result<Vec<(Vec<Record>, Folded)>> {
    let ids = b.log.tree(root).await?;
    let mut read = read_and_fold(b, root, ids).await?;
    // A session named in the tree whose first record was never written (see
    // `EventLog::tree`) is passed over.
    read.retain(|(records, _)| !records.is_empty());
    Ok(read)
}

/// The whole logs of `ids` (sessions of the tree of `root`), in that order: read together
/// where the backend can ([`EventLog::read_tree`](crate::ports::EventLog::read_tree): one
/// pass over a wide tree on NATS), otherwise one after another.
pub async fn tree_logs(
    b: &Backend,
    root: &SessionId,
    ids: &[SessionId],
) -> Result<Vec<Vec<Record>>> {
    if let Some(logs) = read_together(b, root, ids).await? {
        return Ok(logs);
    }
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        out.push(b.log.read(id, 1).await?);
    }
    Ok(out)
}

/// [`EventLog::read_tree`](crate::ports::EventLog::read_tree), checked to give a log for
/// each session asked.
pub(crate) async fn read_together(
    b: &Backend,
    root: &SessionId,
    ids: &[SessionId],
) -> Result<Option<Vec<Vec<Record>>>> {
    match b.log.read_tree(root, ids).await? {
        Some(logs) if logs.len() != ids.len() => Err(crate::Error::Unavailable {
            what: format!(
                "reading the tree of {root}: {} logs for {} sessions",
                logs.len(),
                ids.len()
            ),
            source: None,
        }),
        read => Ok(read),
    }
}

/// The logs of `ids` (sessions of the tree of `root`), each read whole and folded, in
/// that order, on up to [`READERS`] tasks at once.
pub(crate) async fn read_and_fold(
    b: &Backend,
    root: &SessionId,
    ids: Vec<SessionId>,
) -> Result<Vec<(Vec<Record>, Folded)>> {
    use futures::StreamExt;
    let mut out = Vec::with_capacity(ids.len());
    let unavailable = |e: tokio::task::JoinError| crate::Error::Unavailable {
        what: format!("reading a log of the tree of {root}: {e}"),
        source: None,
    };
    // Read together where the backend can (one pass over a wide tree on NATS), then folded.
    if let Some(logs) = read_together(b, root, &ids).await? {
        let mut folds = futures::stream::iter(ids.into_iter().zip(logs).map(|(id, records)| {
            tokio::spawn(async move {
                let f = fold_records(&id, &records)?;
                Ok::<_, crate::Error>((records, f))
            })
        }))
        .buffered(READERS);
        while let Some(fold) = folds.next().await {
            out.push(fold.map_err(unavailable)??);
        }
        return Ok(out);
    }
    let mut reads = futures::stream::iter(ids.into_iter().map(|id| {
        let log = b.log.clone();
        tokio::spawn(async move {
            let records = log.read(&id, 1).await?;
            let f = fold_records(&id, &records)?;
            Ok::<_, crate::Error>((records, f))
        })
    }))
    .buffered(READERS);
    while let Some(read) = reads.next().await {
        out.push(read.map_err(unavailable)??);
    }
    Ok(out)
}

fn natural_key(s: &str) -> Vec<(String, u64)> {
    s.split('/')
        .map(|t| match t.rsplit_once('-') {
            Some((a, n)) if n.parse::<u64>().is_ok() => (a.to_string(), n.parse().unwrap_or(0)),
            _ => (t.to_string(), 0),
        })
        .collect()
}

/// Summary of a whole tree.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TreeSummary {
    pub sessions: usize,
    pub steps: u32,
    pub tool_calls: u32,
    pub cache_hits: u32,
    pub usage: Usage,
    pub saved: Usage,
    pub wall_ms: u64,
    /// The definitions version the tree is pinned to (its root's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub defs: Option<String>,
}

pub fn summarize(rows: &[SessionRow]) -> TreeSummary {
    let mut s = TreeSummary {
        sessions: rows.len(),
        ..Default::default()
    };
    for r in rows {
        s.steps += r.steps;
        s.tool_calls += r.tool_calls;
        s.cache_hits += r.cache_hits;
        s.usage.add(&r.usage);
        s.saved.add(&r.saved);
    }
    if let Some(root) = rows.first() {
        s.wall_ms = root.wall_ms;
        s.defs = root.defs.clone();
    }
    s
}
