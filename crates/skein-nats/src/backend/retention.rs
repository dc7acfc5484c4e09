//! Retention on NATS: finding the finished trees older than an age, from the index of
//! roots read from its oldest end, and removing one tree: the cache entries whose answer
//! came from it, its subjects of `SKEIN_EVENTS`, its notices, watchers, jobs and ending,
//! its workspace, and last its entries in the index of roots. Archiving (the audit export
//! of a tree) is the caller's, before the removal; an archive may be kept in the object
//! store `skein_archive`.
//!
//! A tree is removable when its root and every session of its tree have ended (never a
//! tree in flight, nor one waiting for a person), no session of another tree that has not
//! ended watches one of its sessions (a run shared and not yet settled), and its root's
//! last event is older than the cut-off. A removal stopped half-way leaves a root whose
//! index entry outlives its log: the next run finds it again (ended, old) and finishes it.

use async_nats::jetstream::{kv, object_store, stream};
use serde::Serialize;
use skein_core::SessionId;
use skein_ports::ports::{open_watcher_outside, CacheEntry, EventLog};
use skein_ports::roots::RootSummary;
use skein_ports::Result;

use super::roots::SKEW;
use super::{nats_err, NatsStore};

/// The object store of archived trees.
pub const ARCHIVE: &str = "skein_archive";

/// What removing one tree removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RemovedTree {
    /// Sessions of the tree (the root included).
    pub sessions: u64,
    /// Records of those sessions, and their bytes.
    pub records: u64,
    pub bytes: u64,
    /// Objects of its workspace.
    pub workspace_objects: u64,
    /// Entries of the cache whose answer came from one of its sessions.
    pub cache_entries: u64,
}

/// How many starts of `SKEIN_ROOTS` one round of the scan reads at once.
const SCAN_BLOCK: u64 = 256;

impl NatsStore {
    /// The trees that may be removed as older than `before` (ms since the epoch), oldest
    /// first: `SKEIN_ROOTS` is read from its oldest start until the starts are past the
    /// cut-off (a root's start is no later than its last event), so the cost follows the
    /// trees older than the cut-off, not history.
    pub async fn removable_trees(&self, before: u64) -> Result<Vec<RootSummary>> {
        self.roots_ready().await?;
        let info = self
            .roots_starts
            .get_info()
            .await
            .map_err(|e| nats_err("read the index of roots", e))?;
        let (mut seq, last) = (info.state.first_sequence.max(1), info.state.last_sequence);
        let mut out = vec![];
        let mut past = 0;
        while seq <= last && past < SKEW {
            let hi = (seq + SCAN_BLOCK - 1).min(last);
            let got = futures::future::try_join_all((seq..=hi).map(|s| async move {
                match self.start_at(s).await? {
                    Some((root, start)) if !root.is_empty() => self.current(&root, start).await,
                    _ => Ok(None),
                }
            }))
            .await?;
            for s in got.into_iter().flatten() {
                if s.started_at >= before {
                    past += 1;
                } else if s.is_finished()
                    && s.updated_at < before
                    && self.tree_ended(&SessionId::parse(&s.root)?).await?
                {
                    out.push(s);
                }
            }
            seq = hi + 1;
        }
        out.sort_by_key(|s| s.position());
        Ok(out)
    }

    /// Whether every session of the tree has ended (a session named in the tree's list
    /// but never written has nothing to end), and none is watched by a session of another
    /// tree that has not ([`open_watcher_outside`]: a shared run not yet settled).
    async fn tree_ended(&self, root: &SessionId) -> Result<bool> {
        for s in self.tree(root).await? {
            let (last, watcher) =
                futures::join!(self.last(&s), open_watcher_outside(self, self, root, &s));
            if last?.is_some_and(|r| !r.env.body.is_terminal()) || watcher?.is_some() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Removes the tree of `root` (call with a root [`Self::removable_trees`] gave, after
    /// archiving it). None when its log was gone already (another worker removed it):
    /// only the index entries that were left are taken out.
    pub async fn remove_tree(&self, root: &SessionId) -> Result<Option<RemovedTree>> {
        let sessions = self.tree(root).await?;
        let mut removed = RemovedTree {
            sessions: sessions.len() as u64,
            ..Default::default()
        };
        // A session's cache entry is kept under its mission hash, which its `Submitted`
        // holds.
        let mut ran = vec![];
        for s in &sessions {
            for r in self.read(s, 1).await? {
                if let skein_core::Event::Submitted(sub) = &r.env.body {
                    ran.push((sub.mission_hash.clone(), s));
                }
                removed.records += 1;
                removed.bytes += r.bytes.len() as u64;
            }
        }
        // Before the logs: a removal cut short after this finds the logs, and so the
        // mission hashes, again next time.
        removed.cache_entries = self.uncache(&ran).await?;
        let purge = |st: &stream::Stream, subject: String| {
            let st = st.clone();
            async move {
                st.purge()
                    .filter(subject)
                    .await
                    .map(|r| r.purged)
                    .map_err(|e| nats_err("remove a tree", e))
            }
        };
        let mut purged = 0;
        for subject in [
            format!("skein.events.{root}"),
            format!("skein.events.{root}.>"),
        ] {
            purged += purge(&self.events, subject).await?;
        }
        for subject in [
            format!("skein.notices.{root}"),
            format!("skein.notices.{root}.>"),
            format!("skein.watch.{root}"),
            format!("skein.watch.{root}.>"),
        ] {
            purge(&self.notices, subject).await?;
        }
        // The jobs of sessions ended for good stay until here (`ack_final`), and so do
        // the wake markers that pushes refused by them left.
        for subject in [
            format!("skein.jobs.*.{root}"),
            format!("skein.jobs.*.{root}.>"),
        ] {
            purge(&self.jobs_stream, subject).await?;
        }
        for subject in [
            format!("{}{root}", self.wake.prefix),
            format!("{}{root}.>", self.wake.prefix),
        ] {
            purge(&self.wake.stream, subject).await?;
        }
        purge(&self.results, format!("skein.ended.{root}")).await?;
        // After the logs: a list left by a removal cut short names sessions without
        // records, which readers pass over.
        purge(&self.trees, super::trees::tree_subject(root)).await?;
        removed.workspace_objects = self.remove_workspace(root).await?;
        self.unindex(root.as_str()).await?;
        Ok((purged > 0).then_some(removed))
    }

    /// Deletes the cache entries kept under each mission hash whose answer came from the
    /// session beside it; returns how many. An entry another run has replaced since (its
    /// source is another session, or its revision moved on) is left.
    async fn uncache(&self, ran: &[(String, &SessionId)]) -> Result<u64> {
        let mut removed = 0;
        for (hash, session) in ran {
            if hash.is_empty() {
                continue;
            }
            let Some(e) = self
                .cache
                .entry(hash)
                .await
                .map_err(|e| nats_err("read a cache entry", e))?
            else {
                continue;
            };
            if e.operation != kv::Operation::Put {
                continue;
            }
            let from_here =
                serde_json::from_slice::<CacheEntry>(&e.value).is_ok_and(|c| &c.source == *session);
            if from_here
                && self
                    .cache
                    .delete_expect_revision(hash, Some(e.revision))
                    .await
                    .is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Keeps `bytes` as object `name` of the object store [`ARCHIVE`] (made on first use,
    /// with the storage and replicas of the other streams).
    pub async fn archive_put(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        // Made by hand, as the topology makes its object stores.
        if self.js.get_object_store(ARCHIVE).await.is_err() {
            self.js
                .get_or_create_stream(stream::Config {
                    name: format!("OBJ_{ARCHIVE}"),
                    subjects: vec![format!("$O.{ARCHIVE}.C.>"), format!("$O.{ARCHIVE}.M.>")],
                    storage: super::storage(&self.cfg),
                    num_replicas: self.cfg.replicas.max(1),
                    discard: stream::DiscardPolicy::New,
                    allow_rollup: true,
                    ..Default::default()
                })
                .await
                .map_err(|e| nats_err(ARCHIVE, e))?;
        }
        let store = self
            .js
            .get_object_store(ARCHIVE)
            .await
            .map_err(|e| nats_err(ARCHIVE, e))?;
        store
            .put(name, &mut bytes.as_slice())
            .await
            .map_err(|e| nats_err("archive a tree", e))?;
        Ok(())
    }

    /// The bytes of archived object `name`, if there is one.
    pub async fn archive_get(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let Ok(store) = self.js.get_object_store(ARCHIVE).await else {
            return Ok(None);
        };
        let mut obj = match store.get(name).await {
            Ok(o) => o,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(nats_err("read an archive", e)),
        };
        let out = super::blobs::read_whole(&mut obj)
            .await
            .map_err(|e| nats_err("read an archive", e))?;
        Ok(Some(out))
    }
}
