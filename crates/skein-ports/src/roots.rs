//! Root summaries and their pages: what [`crate::ports::EventLog::roots_page`] lists, a
//! filter on them, and the cursor of the next page.
//!
//! A summary is derived from the root's own log alone (its `Submitted` event, its status
//! as folded, its first and latest times), so an index of summaries can always be rebuilt
//! from the logs. Pages are ordered newest first: by start time, then by id, both
//! descending. A cursor names the last summary of a page (`<started_at>:<root>`); the next
//! page starts strictly after it, so roots started meanwhile never shift a page.

use serde::{Deserialize, Serialize};
use skein_core::{Record, SessionId, SessionState};

use crate::{Error, Result};

/// The most summaries one page holds, whatever the caller asks.
pub const MAX_PAGE: usize = 1000;

/// What one root is, as a list of trees shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootSummary {
    /// The root session's id.
    pub root: String,
    pub agent: String,
    /// As [`skein_core::state::Status::as_str`]: `running`, `awaiting_input`,
    /// `completed`, …
    pub status: String,
    /// Time of the root's first and of its latest event (ms since the epoch).
    pub started_at: u64,
    pub updated_at: u64,
    pub mission: String,
    /// The seq of the last record the summary was made from.
    pub last_seq: u64,
}

impl RootSummary {
    /// The summary of `root` from its records (all of them, in order); none for a root
    /// without records.
    pub fn of(root: &SessionId, records: &[Record]) -> Option<Self> {
        if records.is_empty() {
            return None;
        }
        let state = SessionState::fold(records.iter().map(|r| &r.env));
        let sub = state.submitted.as_ref();
        Some(Self {
            root: root.to_string(),
            agent: sub.map(|s| s.agent.clone()).unwrap_or_default(),
            status: state.status.as_str().to_string(),
            started_at: state.started_at,
            updated_at: state.updated_at,
            mission: sub.map(|s| s.mission.clone()).unwrap_or_default(),
            last_seq: state.last_seq,
        })
    }

    /// Whether the root has ended (completed, failed or cancelled).
    pub fn is_finished(&self) -> bool {
        matches!(self.status.as_str(), "completed" | "failed" | "cancelled")
    }

    /// Where the summary sorts: pages list these in descending order.
    pub fn position(&self) -> Cursor {
        Cursor {
            started_at: self.started_at,
            root: self.root.clone(),
        }
    }
}

/// Which roots a page lists: every condition given must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootFilter {
    /// Only roots in this status.
    pub status: Option<String>,
    /// Only roots of this agent.
    pub agent: Option<String>,
    /// Only roots started at or after this time (ms since the epoch).
    pub since: Option<u64>,
    /// Only roots started before this time (ms since the epoch).
    pub until: Option<u64>,
    /// Only roots whose mission contains this text, in any case.
    pub text: Option<String>,
}

impl RootFilter {
    /// The filter with empty conditions dropped and the text lowered once.
    pub fn normalized(&self) -> Self {
        let keep = |s: &Option<String>| s.clone().filter(|s| !s.trim().is_empty());
        Self {
            status: keep(&self.status),
            agent: keep(&self.agent),
            since: self.since,
            until: self.until,
            text: keep(&self.text).map(|t| t.to_lowercase()),
        }
    }

    /// Whether `s` passes. Call on a [`RootFilter::normalized`] filter.
    pub fn matches(&self, s: &RootSummary) -> bool {
        self.status.as_deref().is_none_or(|v| s.status == v)
            && self.agent.as_deref().is_none_or(|v| s.agent == v)
            && self.since.is_none_or(|t| s.started_at >= t)
            && self.until.is_none_or(|t| s.started_at < t)
            && self
                .text
                .as_deref()
                .is_none_or(|t| s.mission.to_lowercase().contains(t))
    }
}

/// A place in the newest-first order of roots.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor {
    pub started_at: u64,
    pub root: String,
}

impl Cursor {
    /// Reads a cursor as [`Cursor`]'s `Display` writes it; a clear error otherwise.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(format!(
                "cursor {s:?} is not one a page of roots gave (<started_at>:<root>)"
            ))
        };
        let (at, root) = s.split_once(':').ok_or_else(bad)?;
        let started_at = at.parse().map_err(|_| bad())?;
        let id = SessionId::parse(root).map_err(|_| bad())?;
        if !id.is_root() {
            return Err(bad());
        }
        Ok(Self {
            started_at,
            root: root.to_string(),
        })
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.started_at, self.root)
    }
}

/// One page of roots, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootsPage {
    pub roots: Vec<RootSummary>,
    /// The cursor of the next page; none when this page ends the list.
    pub next: Option<String>,
}

/// Takes a page from `newest_first` (summaries in descending [`RootSummary::position`]):
/// those after `cursor` that pass `filter`, at most `limit` (at most [`MAX_PAGE`]).
pub fn page(
    newest_first: impl Iterator<Item = Result<RootSummary>>,
    filter: &RootFilter,
    limit: usize,
    cursor: Option<&Cursor>,
) -> Result<RootsPage> {
    let filter = filter.normalized();
    let limit = limit.clamp(1, MAX_PAGE);
    let mut roots = Vec::new();
    for s in newest_first {
        let s = s?;
        if cursor.is_some_and(|c| s.position() >= *c) {
            continue;
        }
        if !filter.matches(&s) {
            continue;
        }
        if roots.len() == limit {
            let next = roots.last().map(|l: &RootSummary| l.position().to_string());
            return Ok(RootsPage { roots, next });
        }
        roots.push(s);
    }
    Ok(RootsPage { roots, next: None })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn summary(root: &str, at: u64, status: &str, mission: &str) -> RootSummary {
        RootSummary {
            root: root.into(),
            agent: "a".into(),
            status: status.into(),
            started_at: at,
            updated_at: at,
            mission: mission.into(),
            last_seq: 1,
        }
    }

    #[test]
    fn pages_follow_on_and_filters_hold() {
        let all: Vec<_> = (0..7u64)
            .rev()
            .map(|i| {
                let status = if i % 2 == 0 { "completed" } else { "running" };
                summary(&format!("r{i}"), 100 + i, status, &format!("Mission {i}"))
            })
            .collect();
        let f = RootFilter::default();
        let one = page(all.clone().into_iter().map(Ok), &f, 3, None).unwrap();
        let ids = |p: &RootsPage| p.roots.iter().map(|s| s.root.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&one), ["r6", "r5", "r4"]);
        let c = Cursor::parse(one.next.as_deref().unwrap()).unwrap();
        let two = page(all.clone().into_iter().map(Ok), &f, 3, Some(&c)).unwrap();
        assert_eq!(ids(&two), ["r3", "r2", "r1"]);
        let c = Cursor::parse(two.next.as_deref().unwrap()).unwrap();
        let three = page(all.clone().into_iter().map(Ok), &f, 3, Some(&c)).unwrap();
        assert_eq!((ids(&three), three.next), (vec!["r0".to_string()], None));

        let f = RootFilter {
            status: Some("completed".into()),
            text: Some("MISSION".into()),
            since: Some(101),
            until: Some(106),
            ..Default::default()
        };
        let p = page(all.into_iter().map(Ok), &f, 10, None).unwrap();
        assert_eq!(ids(&p), ["r4", "r2"]);
    }

    #[test]
    fn a_cursor_no_page_gave_is_refused_clearly() {
        for bad in ["", "12", "x:abc", "12:a.b", "12:Not An Id"] {
            let e = Cursor::parse(bad).unwrap_err();
            assert!(e.to_string().contains("cursor"), "{bad}: {e}");
        }
        assert_eq!(Cursor::parse("12:abc").unwrap().to_string(), "12:abc");
    }
}
