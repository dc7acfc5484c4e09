//! The index of roots: a summary of every root ([`RootSummary`]) kept in a sled database
//! of its own (`roots/` in the data directory, apart from the store's `db/`), so that a
//! page of the newest roots, filtered or not, is read from the index rather than by
//! folding every root's log. That database is opened by the first listing of a process,
//! never by a process that lists nothing (a `skein run`, `skein tree`, `skein events`):
//! their cost does not grow with the index.
//!
//! The log stays the one truth; the index is derived from it and can always be rebuilt:
//! - tree `roots`: `started_at u64 BE | root` → summary (msgpack), iterated backwards for
//!   newest first; tree `root_starts`: `root` → its key in `roots`;
//! - tree `open_roots`: `root` → nothing, for each root not finished (in flight, or
//!   waiting for a person): what a sweep wakes, at the cost of the open trees;
//! - tree `roots_meta`: `format` and `covered`, the end of the log (as an offset of
//!   `events.log`) below which every root's records are summarized.
//!
//! An append to a root marks the root dirty (in memory) before its frame is written. A
//! listing first summarizes the dirty roots again, writes them, moves `covered` to the end
//! of the log as it was before, and flushes the database: so the cost of a listing is that
//! of the roots written since the last one, not of history. Nothing else writes the index:
//! a `skein run` that lists nothing does not touch the database. At open, the roots whose
//! last record lies at or past `covered` are the dirty ones (what a process wrote and never
//! listed, or a crash lost); when `covered` or the format is missing, lies past the end of
//! the log, or a summary does not decode, the whole index is rebuilt from the log. That
//! reading of `covered` waits for the first listing too (with the roots this process
//! wrote until then kept as dirty).
//!
//! Before the index had a database of its own it was kept in the store's `db/`: such
//! trees there are dropped when that database is next opened, and the index is built anew
//! in `roots/` by the first listing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use skein_core::SessionId;
use skein_ports::roots::{page, Cursor, RootFilter, RootSummary, RootsPage};
use skein_ports::{Error, Result};

use crate::{backend_err, decode, encode, open_db, wal::Wal, Sled};

/// The index's layout; another value rebuilds it.
const FORMAT: u64 = 1;

/// The directory of the index's database, in the data directory.
pub(crate) const DIR: &str = "roots";

/// The trees the index kept in the store's database before it had one of its own.
const OLD_TREES: [&str; 4] = ["roots", "root_starts", "open_roots", "roots_meta"];

pub(crate) struct RootsIndex {
    /// Where the index's own database is; opened by the first listing.
    path: PathBuf,
    db: OnceLock<sled::Db>,
    opening: Mutex<()>,
    trees: OnceLock<Trees>,
    /// Roots whose summary may be out of date, and whether the whole index is to be
    /// rebuilt.
    dirty: Mutex<Dirty>,
    /// One refresh at a time.
    refreshing: Mutex<()>,
}

struct Trees {
    by_time: sled::Tree,
    starts: sled::Tree,
    /// The roots not finished: `root` → nothing.
    open: sled::Tree,
    meta: sled::Tree,
}

impl Trees {
    /// Writes `root`'s summary (none: removes it).
    fn put(&self, root: &str, summary: Option<&RootSummary>) -> Result<()> {
        if let Some(old) = self.starts.get(root).map_err(backend_err)? {
            self.by_time.remove(old).map_err(backend_err)?;
        }
        match summary {
            Some(s) => {
                let k = key(s.started_at, root);
                self.by_time.insert(&k, encode(s)?).map_err(backend_err)?;
                self.starts.insert(root, k).map_err(backend_err)?;
                if s.is_finished() {
                    self.open.remove(root).map_err(backend_err)?;
                } else {
                    self.open.insert(root, &[]).map_err(backend_err)?;
                }
            }
            None => {
                self.starts.remove(root).map_err(backend_err)?;
                self.open.remove(root).map_err(backend_err)?;
            }
        }
        Ok(())
    }
}

#[derive(Default)]
struct Dirty {
    roots: BTreeSet<String>,
    rebuild: bool,
    /// Whether the index's `covered` has been read (by the first listing): until then
    /// `roots` holds only the roots this process wrote.
    loaded: bool,
}

fn key(started_at: u64, root: &str) -> Vec<u8> {
    let mut k = started_at.to_be_bytes().to_vec();
    k.extend_from_slice(root.as_bytes());
    k
}

/// Whether a summary, as encoded in the index, may pass the (normalized) filter `f`: a
/// look at its bytes that a filtered page makes before it decodes one, and that never
/// turns away a summary that passes. MessagePack keeps a string as its UTF-8 bytes, so
/// an agent or status that matches is among them, and so is a mission's text, ASCII
/// case aside; a summary with other than ASCII bytes is decoded, since lowering some
/// letters beyond ASCII gives ASCII ones.
fn may_match(f: &RootFilter, encoded: &[u8]) -> bool {
    let holds = |needle: &[u8], eq: fn(&[u8], &[u8]) -> bool| {
        needle.is_empty() || encoded.windows(needle.len()).any(|w| eq(w, needle))
    };
    let exact = |a: &[u8], b: &[u8]| a == b;
    f.agent
        .as_deref()
        .is_none_or(|a| holds(a.as_bytes(), exact))
        && f.status
            .as_deref()
            .is_none_or(|a| holds(a.as_bytes(), exact))
        && f.text.as_deref().is_none_or(|t| {
            !encoded.is_ascii() || holds(t.as_bytes(), |a, b| a.eq_ignore_ascii_case(b))
        })
}

fn u64_of(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
}

impl RootsIndex {
    /// The index kept in `dir`'s `roots/`. Reads nothing: the first listing does.
    pub(crate) fn open(dir: &Path) -> Self {
        Self {
            path: dir.join(DIR),
            db: OnceLock::new(),
            opening: Mutex::new(()),
            trees: OnceLock::new(),
            dirty: Mutex::new(Dirty::default()),
            refreshing: Mutex::new(()),
        }
    }

    /// Finds, once, which roots the index does not cover: those whose last record lies at
    /// or past its `covered`, beside those this process wrote; everything when the index
    /// is missing or of another format. A database with nothing on disk is not opened.
    fn load(&self, wal: &Wal) -> Result<()> {
        if self.dirty().loaded {
            return Ok(());
        }
        let covered = if Sled::empty_on_disk(&self.path) {
            None
        } else {
            let meta = &self.trees()?.meta;
            let format = meta.get("format").map_err(backend_err)?;
            let covered = meta.get("covered").map_err(backend_err)?;
            match (format.as_deref().and_then(u64_of), covered) {
                (Some(FORMAT), Some(c)) => u64_of(&c).filter(|c| *c <= wal.end()),
                _ => None,
            }
        };
        let since = covered.map(|c| wal.roots_written_since(c)).transpose()?;
        let mut d = self.dirty();
        match since {
            Some(roots) if !d.rebuild => d.roots.extend(roots),
            _ => {
                d.rebuild = true;
                d.roots.clear();
            }
        }
        d.loaded = true;
        Ok(())
    }

    /// Whether this process has opened the index's database.
    pub(crate) fn opened(&self) -> bool {
        self.db.get().is_some()
    }

    /// The index's database, opened now if it was not.
    fn db(&self) -> Result<&sled::Db> {
        if let Some(db) = self.db.get() {
            return Ok(db);
        }
        let _one = self.opening.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(db) = self.db.get() {
            return Ok(db);
        }
        let db = open_db(&self.path)?;
        Ok(self.db.get_or_init(|| db))
    }

    /// The index's trees, opening the database if it was not.
    fn trees(&self) -> Result<&Trees> {
        if let Some(t) = self.trees.get() {
            return Ok(t);
        }
        let db = self.db()?;
        let tree = |n: &str| db.open_tree(n).map_err(backend_err);
        let trees = Trees {
            by_time: tree("roots")?,
            starts: tree("root_starts")?,
            open: tree("open_roots")?,
            meta: tree("roots_meta")?,
        };
        Ok(self.trees.get_or_init(|| trees))
    }

    fn dirty(&self) -> std::sync::MutexGuard<'_, Dirty> {
        self.dirty.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `session` dirty if it is a root: called before its records are written.
    pub(crate) fn touch(&self, session: &SessionId) {
        if session.is_root() {
            let mut d = self.dirty();
            if !d.rebuild && !d.roots.contains(session.as_str()) {
                d.roots.insert(session.as_str().to_string());
            }
        }
    }

    /// Marks the whole index for rebuilding (it was found damaged).
    fn damaged(&self) {
        let mut d = self.dirty();
        d.rebuild = true;
        d.roots.clear();
    }

    /// How many roots the index does not cover yet, and whether it is to be rebuilt
    /// whole (an index that cannot be read is).
    pub(crate) fn pending(&self, wal: &Wal) -> (usize, bool) {
        let _one = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = self.load(wal) {
            tracing::warn!(error = %e.report(), "the index of roots cannot be read");
            return (0, true);
        }
        let d = self.dirty();
        (d.roots.len(), d.rebuild)
    }

    /// Brings the index up to date with `wal`: summarizes the dirty roots again (every
    /// root when rebuilding), then moves `covered` and flushes. Returns how many roots it
    /// summarized.
    pub(crate) fn refresh(&self, wal: &Wal) -> Result<usize> {
        let _one = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
        self.load(wal)?;
        let end = wal.end();
        let (roots, rebuild) = {
            let mut d = self.dirty();
            let rebuild = std::mem::take(&mut d.rebuild);
            (std::mem::take(&mut d.roots), rebuild)
        };
        if roots.is_empty() && !rebuild {
            return Ok(0);
        }
        let result = self.write(wal, end, roots, rebuild);
        if result.is_err() {
            // What was taken is not covered: rebuild rather than guess which part was.
            self.damaged();
        }
        result
    }

    fn write(&self, wal: &Wal, end: u64, roots: BTreeSet<String>, rebuild: bool) -> Result<usize> {
        let t = self.trees()?;
        let roots: Vec<String> = if rebuild {
            t.meta.remove("covered").map_err(backend_err)?;
            t.by_time.clear().map_err(backend_err)?;
            t.starts.clear().map_err(backend_err)?;
            t.open.clear().map_err(backend_err)?;
            wal.sessions_from("")?
                .into_iter()
                .filter(|s| !s.contains('.') && !s.starts_with('!'))
                .collect()
        } else {
            roots.into_iter().collect()
        };
        for root in &roots {
            let id = SessionId::parse(root)?;
            let summary = RootSummary::of(&id, &wal.read(&id, 1)?);
            t.put(root, summary.as_ref())?;
        }
        t.meta
            .insert("format", &FORMAT.to_be_bytes())
            .map_err(backend_err)?;
        t.meta
            .insert("covered", &end.to_be_bytes())
            .map_err(backend_err)?;
        self.db()?.flush().map_err(backend_err)?;
        Ok(roots.len())
    }

    /// The roots not finished, from an index brought up to date first.
    pub(crate) fn open_roots(&self, wal: &Wal) -> Result<Vec<SessionId>> {
        self.refresh(wal)?;
        let mut out = vec![];
        for item in self.trees()?.open.iter() {
            let (k, _) = item.map_err(backend_err)?;
            let root = std::str::from_utf8(&k)
                .map_err(|e| Error::corrupt("a root in the index of roots", e))?;
            out.push(SessionId::parse(root)?);
        }
        Ok(out)
    }

    /// A page of roots, newest first, from an index brought up to date first.
    pub(crate) fn page(
        &self,
        wal: &Wal,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage> {
        let cursor = cursor.map(Cursor::parse).transpose()?;
        self.refresh(wal)?;
        match self.read_page(filter, limit, cursor.as_ref()) {
            Err(e) if matches!(e, Error::Corrupt { .. }) => {
                tracing::warn!(error = %e.report(), "the index of roots is damaged: rebuilding it from the event log");
                self.damaged();
                self.refresh(wal)?;
                self.read_page(filter, limit, cursor.as_ref())
            }
            r => r,
        }
    }

    fn read_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&Cursor>,
    ) -> Result<RootsPage> {
        let by_time = &self.trees()?.by_time;
        let f = filter.normalized();
        // A time range and the cursor bound the keys read (they begin with the start time).
        let mut hi = cursor.map(|c| key(c.started_at, &c.root));
        if let Some(until) = f.until {
            let k = key(until, "");
            hi = Some(hi.map_or(k.clone(), |h| h.min(k)));
        }
        let lo = f.since.map(|t| key(t, ""));
        let range = match (lo, hi) {
            (Some(l), Some(h)) if l >= h => return Ok(RootsPage::default()),
            (Some(l), Some(h)) => by_time.range(l..h),
            (Some(l), None) => by_time.range(l..),
            (None, Some(h)) => by_time.range(..h),
            (None, None) => by_time.iter(),
        };
        let items = range.rev().filter_map(|item| match item {
            Ok((_, v)) if !may_match(&f, &v) => None,
            Ok((_, v)) => Some(decode::<RootSummary>(&v)),
            Err(e) => Some(Err(backend_err(e))),
        });
        page(items, &f, limit, cursor)
    }

    /// Bytes the index keeps on disk per root, keys and values (not sled's own overhead).
    pub(crate) fn bytes(&self) -> Result<(u64, u64)> {
        let mut bytes = 0u64;
        let mut n = 0u64;
        let trees = self.trees()?;
        for t in [&trees.by_time, &trees.starts] {
            for item in t.iter() {
                let (k, v) = item.map_err(backend_err)?;
                bytes += (k.len() + v.len()) as u64;
            }
        }
        for _ in trees.starts.iter() {
            n += 1;
        }
        Ok((bytes, n))
    }
}

/// Drops the trees an earlier version kept the index in from the store's database `db`,
/// if it has them.
pub(crate) fn drop_old_trees(db: &sled::Db) -> Result<()> {
    let names = db.tree_names();
    for t in OLD_TREES {
        if names.iter().any(|n| n.as_ref() == t.as_bytes()) {
            db.drop_tree(t).map_err(backend_err)?;
        }
    }
    Ok(())
}

/// Takes `roots` out of the index in `db` (a closed store's), and `covered` with them: until
/// [`set_covered`] puts it back, the next open rebuilds the index whole. Returns what
/// `covered` was.
pub(crate) fn forget(db: &sled::Db, roots: &[SessionId]) -> Result<Option<u64>> {
    let tree = |n: &str| db.open_tree(n).map_err(backend_err);
    let (by_time, starts, open, meta) = (
        tree("roots")?,
        tree("root_starts")?,
        tree("open_roots")?,
        tree("roots_meta")?,
    );
    let covered = meta
        .remove("covered")
        .map_err(backend_err)?
        .and_then(|c| u64_of(&c));
    for r in roots {
        if let Some(k) = starts.remove(r.as_str()).map_err(backend_err)? {
            by_time.remove(k).map_err(backend_err)?;
        }
        open.remove(r.as_str()).map_err(backend_err)?;
    }
    Ok(covered)
}

/// Says the index in `db` covers the log up to `end` (after [`forget`], once the log holds
/// only what the index does).
pub(crate) fn set_covered(db: &sled::Db, end: u64) -> Result<()> {
    let meta = db.open_tree("roots_meta").map_err(backend_err)?;
    meta.insert("format", &FORMAT.to_be_bytes())
        .map_err(backend_err)?;
    meta.insert("covered", &end.to_be_bytes())
        .map_err(backend_err)?;
    Ok(())
}

impl RootsIndex {
    /// The finished roots whose last event is before `before` (ms), oldest first, from an
    /// index brought up to date first.
    pub(crate) fn finished_before(&self, wal: &Wal, before: u64) -> Result<Vec<RootSummary>> {
        self.refresh(wal)?;
        let mut out = vec![];
        // A root's first event is no later than its last: only keys started before `before`.
        for item in self.trees()?.by_time.range(..key(before, "")) {
            let (_, v) = item.map_err(backend_err)?;
            let s: RootSummary = decode(&v)?;
            if s.is_finished() && s.updated_at < before {
                out.push(s);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_look_at_encoded_bytes_never_turns_away_a_summary_that_passes() {
        let missions = [
            "Plan the Q3 launch",
            "say \"hi\" to the team",
            "ÜBER-Plan für Köln",
            "a 5 \u{212A}m run",   // the Kelvin sign lowers to an ASCII k
            "\u{130}stanbul trip", // a dotted capital I lowers to an i and a mark
            "",
        ];
        let texts = [
            "plan", "\"hi\"", "über", "köln", "km", "k", "i", "istanbul", "zzz",
        ];
        for (n, mission) in missions.iter().enumerate() {
            for status in ["completed", "awaiting_input"] {
                let s = RootSummary {
                    root: format!("r{n}"),
                    agent: "planner".into(),
                    status: status.into(),
                    started_at: 1_700_000_000_000 + n as u64,
                    updated_at: 1_700_000_000_000 + n as u64,
                    mission: (*mission).into(),
                    last_seq: 3,
                };
                let bytes = encode(&s).unwrap();
                let mut filters = vec![RootFilter::default()];
                for t in texts {
                    filters.push(RootFilter {
                        text: Some(t.to_uppercase()),
                        ..Default::default()
                    });
                }
                for a in ["planner", "plan", "other"] {
                    filters.push(RootFilter {
                        agent: Some(a.into()),
                        status: Some("completed".into()),
                        ..Default::default()
                    });
                }
                for f in filters {
                    let f = f.normalized();
                    if f.matches(&s) {
                        assert!(may_match(&f, &bytes), "{f:?} turned away {s:?}");
                    }
                }
                // It does turn away what cannot match, or it would save nothing.
                let other = RootFilter {
                    agent: Some("other".into()),
                    ..Default::default()
                };
                assert!(!may_match(&other.normalized(), &bytes));
            }
        }
    }
}
