//! Retention: finding the finished trees older than a given age, and removing them from a
//! closed store.
//!
//! A tree may be removed when its root has ended (completed, failed or cancelled) and so
//! has every session of the tree: never a tree still in flight, nor one that waits for a
//! person's answer or approval, nor one with a run that a session of another tree still
//! shares (it watches the run and has not ended). Removing writes `events.log` anew
//! without the trees' records (see [`crate::wal`]'s `compact`), and first takes out of the
//! sled database what names them: the trees' entries in the index of roots, cache entries
//! whose answer came from them, watchers and jobs of their sessions. Blobs stay (another
//! tree may name the same one). Last it adds what it removed to the store's totals
//! ([`RemovedTotals`], tree `retention`), which `skein ui` serves at `/metrics`.

use std::collections::HashSet;
use std::path::Path;

use skein_core::SessionId;
use skein_ports::ports::{open_watcher_outside, CacheEntry};
use skein_ports::roots::RootSummary;
use skein_ports::{Error, Result};

use crate::{backend_err, decode, lock_dir, open_db, roots, wal, Sled, SledStore};

/// What [`remove_trees`] removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Removed {
    pub trees: u64,
    pub sessions: u64,
    pub records: u64,
    pub cache_entries: u64,
    /// The length of the log's frames before and after.
    pub log_bytes_before: u64,
    pub log_bytes_after: u64,
}

/// What retention removed from a store over its whole life: the sum of every
/// [`remove_trees`] on it, kept in its sled database (tree `retention`), so a process that
/// serves `/metrics` on the store can show it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RemovedTotals {
    pub trees: u64,
    pub sessions: u64,
    /// By how much the event log shrank.
    pub bytes: u64,
}

/// The sled tree of the totals, and its keys.
const TOTALS: &str = "retention";
const TOTAL_KEYS: [&str; 3] = ["trees", "sessions", "bytes"];

fn totals_in(db: &sled::Db) -> Result<RemovedTotals> {
    let tree = db.open_tree(TOTALS).map_err(backend_err)?;
    let mut n = [0u64; 3];
    for (slot, key) in n.iter_mut().zip(TOTAL_KEYS) {
        if let Some(v) = tree.get(key).map_err(backend_err)? {
            let bytes: [u8; 8] = v.as_ref().try_into().map_err(|_| {
                Error::corrupt_because(format!(
                    "the retention total `{key}` is {} bytes, not 8",
                    v.len()
                ))
            })?;
            *slot = u64::from_be_bytes(bytes);
        }
    }
    Ok(RemovedTotals {
        trees: n[0],
        sessions: n[1],
        bytes: n[2],
    })
}

fn add_to_totals(db: &sled::Db, r: &Removed) -> Result<()> {
    let was = totals_in(db)?;
    let now = [
        was.trees.saturating_add(r.trees),
        was.sessions.saturating_add(r.sessions),
        was.bytes
            .saturating_add(r.log_bytes_before.saturating_sub(r.log_bytes_after)),
    ];
    let tree = db.open_tree(TOTALS).map_err(backend_err)?;
    for (key, n) in TOTAL_KEYS.into_iter().zip(now) {
        tree.insert(key, &n.to_be_bytes()).map_err(backend_err)?;
    }
    Ok(())
}

impl SledStore {
    /// What [`remove_trees`] removed from this store so far, summed over every run (all
    /// zero for a store never collected). Opens the sled database if it is not yet.
    pub fn removed_totals(&self) -> Result<RemovedTotals> {
        totals_in(&self.sled.open()?.db)
    }

    /// The trees that may be removed as older than `before` (ms since the epoch): the
    /// root's last event is before it, the root and every session of its tree have ended,
    /// and no session of another tree that has not ended watches one of its sessions (a
    /// shared run not yet settled, [`open_watcher_outside`]). Oldest first.
    pub async fn removable_trees(&self, before: u64) -> Result<Vec<RootSummary>> {
        // The watchers are in the sled database, which a process opens on first use.
        self.sled.open()?;
        let mut out = vec![];
        for s in self.roots.finished_before(&self.wal, before)? {
            let root = SessionId::parse(&s.root)?;
            let mut ended = true;
            for session in self.wal.sessions_from(root.as_str())? {
                let id = SessionId::parse(&session)?;
                if !root.contains(&id) {
                    continue;
                }
                if !self
                    .wal
                    .last(&id)?
                    .is_some_and(|r| r.env.body.is_terminal())
                    || open_watcher_outside(self, self, &root, &id)
                        .await?
                        .is_some()
                {
                    ended = false;
                    break;
                }
            }
            if ended {
                out.push(s);
            }
        }
        Ok(out)
    }
}

/// Removes the trees of `roots` from the store in `dir`, which no process may have open
/// (this takes its lock). Call with roots [`SledStore::removable_trees`] named.
pub fn remove_trees(dir: &Path, roots: &[SessionId]) -> Result<Removed> {
    let _lock = lock_dir(dir)?;
    if roots.iter().any(|r| !r.is_root()) {
        return Err(Error::invalid(
            "only whole trees are removed: name their roots",
        ));
    }
    let set: HashSet<&str> = roots.iter().map(SessionId::as_str).collect();
    let of_removed = |session: &str| set.contains(session.split('.').next().unwrap_or(session));
    let mut removed = Removed {
        trees: roots.len() as u64,
        ..Removed::default()
    };
    let db = open_db(&dir.join("db"))?;
    let cache = db.open_tree("cache").map_err(backend_err)?;
    for item in cache.iter() {
        let (k, v) = item.map_err(backend_err)?;
        // An entry that does not decode is left alone: a reader of the cache reports it.
        if decode::<CacheEntry>(&v).is_ok_and(|e| of_removed(e.source.as_str())) {
            cache.remove(k).map_err(backend_err)?;
            removed.cache_entries += 1;
        }
    }
    for name in ["watchers", "jobs"] {
        let tree = db.open_tree(name).map_err(backend_err)?;
        for item in tree.iter() {
            let (k, _) = item.map_err(backend_err)?;
            let names_removed = k
                .split(|b| *b == 0)
                .any(|part| std::str::from_utf8(part).is_ok_and(of_removed));
            if names_removed {
                tree.remove(k).map_err(backend_err)?;
            }
        }
    }
    roots::drop_old_trees(&db)?;
    db.flush().map_err(backend_err)?;
    let roots_path = dir.join(roots::DIR);
    let roots_db = if Sled::empty_on_disk(&roots_path) {
        None
    } else {
        Some(open_db(&roots_path)?)
    };
    let mut covered = None;
    if let Some(rdb) = &roots_db {
        covered = roots::forget(rdb, roots)?;
        rdb.flush().map_err(backend_err)?;
    }
    let c = wal::compact(&dir.join("events.log"), &of_removed)?;
    // The index covered the whole log (the trees were found through it): it covers the
    // new one too. Otherwise the next listing rebuilds it.
    if let Some(rdb) = roots_db
        .as_ref()
        .filter(|_| covered == Some(c.bytes_before))
    {
        roots::set_covered(rdb, c.bytes_after)?;
        rdb.flush().map_err(backend_err)?;
    }
    removed.sessions = c.sessions;
    removed.records = c.records;
    removed.log_bytes_before = c.bytes_before;
    removed.log_bytes_after = c.bytes_after;
    // Counted once the log is written anew, while this process still holds the lock.
    add_to_totals(&db, &removed)?;
    db.flush().map_err(backend_err)?;
    tracing::info!(
        trees = removed.trees,
        sessions = removed.sessions,
        records = removed.records,
        "removed finished trees from the store"
    );
    Ok(removed)
}
