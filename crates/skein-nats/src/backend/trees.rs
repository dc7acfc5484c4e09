//! The index of each tree's sessions: stream `SKEIN_TREES`, subject `skein.tree.<root>`.
//!
//! Listing a tree's sessions from the subjects of `SKEIN_EVENTS` (a stream info filtered on
//! the root's subject and on `skein.events.<root>.>`) costs, on nats-server 2.9, time in
//! proportion to every subject the stream holds: about 12 ms a request at 100,000 roots,
//! and the listing takes four. So each tree keeps its own list, read by its one literal
//! subject, which costs the same at any size of history:
//! - a root's first record is preceded by a message naming the root: the *mark* that the
//!   tree's list is complete from there on;
//! - every other session's first record is preceded by a message naming it. Sessions of
//!   one tree named at the same moment (a step delegating to many children) go as one
//!   message, a name per line.
//!
//! A session is named before its first record is written, so a list with its mark never
//! misses a session that has records. It may name one that has none (its writer stopped
//! between the two): readers pass over a session whose log is empty.
//!
//! The list is rebuilt from the log when it has no mark (a tree from before the index,
//! its mark aged out, the stream deleted) or when a message after the last mark does not
//! read (damage): the subjects of `SKEIN_EVENTS` are listed as before, and every session
//! found is written in messages whose last names the root, a mark again. Sessions named
//! meanwhile are named before their records, so nothing is lost between the listing and
//! the write. The list ages out with the logs (`events_max_age`): a rebuild's mark is
//! written with or after every name before it, so it ages out no sooner than they do, and
//! a tree whose first mark aged out is listed from the log again and marked anew. (A tree
//! of more than about ten thousand sessions is written again in several messages, the
//! mark in the last; they age out within the moment they were written in.)
//!
//! A worker of a release before these lists creates sessions without naming them. So a
//! list is marked only while every live worker says it names sessions
//! (`WorkerInfo::lists_trees`), and a process that sees one that does not writes
//! [`SINCE_SUBJECT`]: a mark older than that vouches for nothing, and the tree is listed
//! from the log until a listing marks it again (docs/nats.md).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use skein_core::SessionId;
use skein_ports::{Error, Result};
use tokio::sync::oneshot;

use super::read::read_subject_expecting;
use super::{events_subject, nats_err, NatsStore, WorkerInfo};

/// The stream of the index of trees.
pub const TREES: &str = "SKEIN_TREES";

/// The most sessions one message of names made at one moment holds.
const PER_MESSAGE: usize = 256;

/// The most bytes of names one message of a rebuilt list holds (the server's default
/// largest message is 1 MiB).
const REBUILD_BYTES: usize = 512 * 1024;

pub(crate) fn tree_subject(root: &SessionId) -> String {
    format!("skein.tree.{}", root.as_str())
}

type Waiting = Vec<(SessionId, oneshot::Sender<Result<()>>)>;

/// Names waiting to be written, per root, and whether a writer is at work on them: one
/// write per tree is in flight at a time, and what comes meanwhile goes in the next.
#[derive(Default, Clone)]
pub(crate) struct Naming {
    pending: Arc<Mutex<HashMap<SessionId, Waiting>>>,
    /// Whether every live worker names sessions (`WorkerInfo::lists_trees`), and when
    /// that was read: a list is marked only then.
    all_name: Arc<Mutex<Option<(Instant, bool)>>>,
    /// The sequence of the last [`SINCE_SUBJECT`] message, and when it was read: marks
    /// before it vouch for nothing.
    since: Arc<Mutex<Option<(Instant, u64)>>>,
}

/// How long a reading of the live workers decides whether lists are marked, when no
/// worker's round of advertisements (every 5 s) reads them sooner.
const ALL_NAME_FRESH: Duration = Duration::from_secs(20);

/// How long a reading of [`SINCE_SUBJECT`] is used again.
const SINCE_FRESH: Duration = Duration::from_secs(5);

/// Written (one message, rolled up) whenever a process sees a live worker that does not
/// name sessions: a mark written before it no longer vouches for its list, since that
/// worker may have created sessions in the tree without naming them.
pub(crate) const SINCE_SUBJECT: &str = "skein.treesince";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a tree's list said.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Listed {
    /// Complete: every session of the tree that has records is among these.
    Complete(Vec<SessionId>),
    /// No mark vouches for it (none written, or damage after the last).
    Unmarked,
}

/// Reads the messages of a tree's list (stream sequence and payload), in stream order: a
/// mark vouches only when written after sequence `since`.
pub(crate) fn listed(root: &SessionId, messages: &[(u64, Bytes)], since: u64) -> Listed {
    let mut all = BTreeSet::new();
    let mut vouched = false;
    for (seq, payload) in messages {
        let names = std::str::from_utf8(payload).ok().and_then(|text| {
            text.lines()
                .map(|l| SessionId::parse(l).ok().filter(|s| s.root_id() == *root))
                .collect::<Option<Vec<_>>>()
        });
        match names {
            Some(names) if !names.is_empty() => {
                if names.contains(root) && *seq > since {
                    vouched = true;
                }
                all.extend(names);
            }
            _ => vouched = false,
        }
    }
    if vouched {
        Listed::Complete(all.into_iter().collect())
    } else {
        Listed::Unmarked
    }
}

impl NatsStore {
    /// Notes whether every live worker names sessions in their trees' lists; when one
    /// does not, writes [`SINCE_SUBJECT`] again, so that no mark written before now
    /// vouches for its list (that worker may have created sessions without naming them).
    pub(crate) async fn note_live_workers(&self, live: &[WorkerInfo]) {
        let all = live.iter().all(|w| w.lists_trees);
        *lock(&self.naming.all_name) = Some((Instant::now(), all));
        if all {
            return;
        }
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Rollup", "sub");
        let written = async {
            self.js
                .publish_with_headers(SINCE_SUBJECT, h, Bytes::new())
                .await?
                .await
        }
        .await;
        match written {
            Ok(ack) => *lock(&self.naming.since) = Some((Instant::now(), ack.sequence)),
            Err(e) => {
                tracing::warn!(error = %e, "a worker of an earlier release runs, and the trees' lists could not be told; listings may miss what it creates")
            }
        }
    }

    /// The sequence before which marks vouch for nothing (0: none).
    async fn since(&self) -> Result<u64> {
        let known = *lock(&self.naming.since);
        if let Some((at, seq)) = known {
            if at.elapsed() < SINCE_FRESH {
                return Ok(seq);
            }
        }
        let seq = match self
            .trees
            .get_last_raw_message_by_subject(SINCE_SUBJECT)
            .await
        {
            Ok(m) => m.sequence,
            Err(e)
                if matches!(
                    e.kind(),
                    async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
                ) =>
            {
                0
            }
            Err(e) => return Err(nats_err("read the trees' lists", e)),
        };
        *lock(&self.naming.since) = Some((Instant::now(), seq));
        Ok(seq)
    }

    /// Whether a tree's list may be marked complete: only while every live worker names
    /// the sessions it creates (none of an earlier release runs), as last read.
    async fn may_mark(&self) -> bool {
        let known = *lock(&self.naming.all_name);
        match known {
            Some((at, all)) if at.elapsed() < ALL_NAME_FRESH => all,
            _ => match self.live_workers().await {
                Ok(live) => live.iter().all(|w| w.lists_trees),
                Err(e) => {
                    tracing::debug!(error = %e.report(), "live workers not read; a tree's list is not marked");
                    false
                }
            },
        }
    }

    /// Before a root's first record: marks its tree's list, unless a live worker of an
    /// earlier release could create sessions in it without naming them (the tree is then
    /// listed from the log, and marked by a listing once none runs).
    pub(crate) async fn mark_tree(&self, root: &SessionId) -> Result<()> {
        if self.may_mark().await {
            self.name_in_tree(root).await
        } else {
            Ok(())
        }
    }

    /// Names `session` in its tree's list; returns once the server has it. Called before
    /// the session's first record is written.
    pub(crate) async fn name_in_tree(&self, session: &SessionId) -> Result<()> {
        let root = session.root_id();
        let (tx, rx) = oneshot::channel();
        let first = {
            let mut pending = lock(&self.naming.pending);
            let list = pending.entry(root.clone());
            let first = matches!(list, std::collections::hash_map::Entry::Vacant(_));
            list.or_default().push((session.clone(), tx));
            first
        };
        if first {
            // A writer of its own, so that a caller that goes away strands nobody. While
            // its write is in flight, names that come wait in the root's entry; it takes
            // them next, and leaves when it finds none (the entry then goes with it).
            let naming = self.naming.clone();
            let js = self.js.clone();
            tokio::spawn(async move {
                loop {
                    let waiting = {
                        let mut pending = lock(&naming.pending);
                        let Some(list) = pending.get_mut(&root) else {
                            break;
                        };
                        if list.is_empty() {
                            pending.remove(&root);
                            break;
                        }
                        std::mem::take(list)
                    };
                    let writes = chunks(waiting).into_iter().map(|part| {
                        let js = js.clone();
                        let root = root.clone();
                        async move {
                            let names: Vec<&str> = part.iter().map(|(s, _)| s.as_str()).collect();
                            let written = publish(&js, &root, names.join("\n"))
                                .await
                                .map_err(|e| e.report().to_string());
                            for (_, tx) in part {
                                let _ =
                                    tx.send(written.clone().map_err(Error::unavailable_because));
                            }
                        }
                    });
                    futures::future::join_all(writes).await;
                }
            });
        }
        rx.await.map_err(|_| {
            Error::unavailable_because(format!("naming {session} in its tree's list: dropped"))
        })?
    }

    /// Every session of the tree of `root`: from its list, or, when the list is not
    /// vouched for, from the subjects of `SKEIN_EVENTS`, then written as the list.
    pub(crate) async fn tree_sessions(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let subject = tree_subject(root);
        let (messages, since) = futures::join!(
            read_subject_expecting(&self.trees, &subject, 0),
            self.since()
        );
        match messages.and_then(|m| Ok((m, since?))) {
            Ok((messages, since)) => {
                if let Listed::Complete(ids) = listed(root, &messages, since) {
                    return Ok(ids);
                }
            }
            // The list is a hint and the log the truth: a list that cannot be read (its
            // stream electing a leader after a node loss, or deleted) is no reason to fail
            // a listing the log can answer. Nothing is written back: the stream that could
            // not be read would not take it either.
            Err(e) => {
                tracing::debug!(%root, error = %e.report(), "a tree's list not read; listed from the log");
                return self.tree_from_subjects(root).await;
            }
        }
        let ids = self.tree_from_subjects(root).await?;
        if !ids.is_empty() && self.may_mark().await {
            if let Err(e) = self.rebuild_tree_list(root, &ids).await {
                tracing::warn!(%root, error = %e.report(), "the tree's list was not written again; the next listing tries again");
            }
        }
        Ok(ids)
    }

    /// Writes `ids` (all of the tree of `root`) as its list: one message, or, for a tree
    /// whose names pass [`REBUILD_BYTES`], several written one after the other with the
    /// root (the mark) in the last.
    async fn rebuild_tree_list(&self, root: &SessionId, ids: &[SessionId]) -> Result<()> {
        let mut parts: Vec<String> = vec![];
        for s in ids.iter().filter(|s| *s != root).chain([root]) {
            match parts.last_mut() {
                Some(part) if part.len() + s.as_str().len() < REBUILD_BYTES => {
                    part.push('\n');
                    part.push_str(s.as_str());
                }
                _ => parts.push(s.as_str().to_string()),
            }
        }
        for part in parts {
            publish(&self.js, root, part).await?;
        }
        tracing::debug!(%root, sessions = ids.len(), "a tree's list written again from its log");
        Ok(())
    }

    /// The tree's sessions from the subjects of `SKEIN_EVENTS`.
    pub(crate) async fn tree_from_subjects(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for filter in [events_subject(root), format!("{}.>", events_subject(root))] {
            self.sessions_with_subjects(filter, "tree", &mut out)
                .await?;
        }
        out.sort();
        out.dedup();
        Ok(out)
    }
}

fn chunks(mut waiting: Waiting) -> Vec<Waiting> {
    let mut out = vec![];
    while waiting.len() > PER_MESSAGE {
        let rest = waiting.split_off(PER_MESSAGE);
        out.push(waiting);
        waiting = rest;
    }
    out.push(waiting);
    out
}

async fn publish(
    js: &async_nats::jetstream::Context,
    root: &SessionId,
    text: String,
) -> Result<()> {
    js.publish(tree_subject(root), Bytes::from(text))
        .await
        .map_err(|e| nats_err("name a session in its tree's list", e))?
        .await
        .map_err(|e| nats_err("name a session in its tree's list", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{listed, Listed};

    fn listed_at(root: &SessionId, since: u64, messages: &[(u64, Bytes)]) -> Listed {
        listed(root, messages, since)
    }
    use bytes::Bytes;
    use skein_core::SessionId;

    fn id(s: &str) -> SessionId {
        SessionId::parse(s).unwrap()
    }

    fn msgs(texts: &[&str]) -> Vec<(u64, Bytes)> {
        (1..)
            .zip(texts)
            .map(|(i, t)| (i, Bytes::from(t.to_string())))
            .collect()
    }

    #[test]
    fn a_list_is_complete_from_its_mark_and_not_past_damage() {
        let root = id("r1");
        let all = |v: &[&str]| Listed::Complete(v.iter().map(|s| id(s)).collect());
        assert_eq!(listed_at(&root, 0, &msgs(&[])), Listed::Unmarked);
        assert_eq!(listed_at(&root, 0, &msgs(&["r1"])), all(&["r1"]));
        assert_eq!(
            listed_at(&root, 0, &msgs(&["r1", "r1.a-1\nr1.b-2", "r1.a-1.c-1"])),
            all(&["r1", "r1.a-1", "r1.a-1.c-1", "r1.b-2"])
        );
        // Names without the mark: a tree from before the index, or its mark aged out.
        assert_eq!(listed_at(&root, 0, &msgs(&["r1.a-1"])), Listed::Unmarked);
        // Damage after the mark, then a rebuild's mark again.
        assert_eq!(
            listed_at(&root, 0, &msgs(&["r1", "r1.a-1", "\u{0}garbage"])),
            Listed::Unmarked
        );
        assert_eq!(
            listed_at(&root, 0, &msgs(&["r1", "", "r1.a-1"])),
            Listed::Unmarked
        );
        assert_eq!(
            listed_at(&root, 0, &msgs(&["r1", "zzz", "r1.a-1\nr1"])),
            all(&["r1", "r1.a-1"])
        );
        // A mark written before a worker of an earlier release was seen vouches for
        // nothing; one written after it does.
        assert_eq!(
            listed_at(&root, 1, &msgs(&["r1", "r1.a-1"])),
            Listed::Unmarked
        );
        assert_eq!(
            listed_at(&root, 1, &msgs(&["r1", "r1.a-1", "r1.a-1\nr1"])),
            all(&["r1", "r1.a-1"])
        );
        // A name of another tree is damage too.
        assert_eq!(
            listed_at(&root, 0, &msgs(&["r1", "r2.a-1"])),
            Listed::Unmarked
        );
    }
}
