//! The cache (with single-flight claims), the blob store and the notice inboxes.
//!
//! Cache entries and watchers must outlive the process: they are sled trees, flushed
//! before a write returns. Single-flight claims and notices are soft state, kept in
//! memory: a claim whose holder is gone is replaced, and a parent loaded afresh (as every
//! parent is in a new process) reconciles with its children's logs rather than its notices.

use std::collections::{BTreeMap, HashMap};
use std::sync::MutexGuard;

use async_trait::async_trait;
use skein_core::SessionId;
use skein_ports::ports::{Blobs, Cache, CacheEntry, Notices};
use skein_ports::{Error, Result};

use crate::{backend_err, decode, encode, prefix, SledStore};

/// The single-flight claims and notice inboxes of this process.
#[derive(Default)]
pub(crate) struct Soft {
    /// Mission hash → the session computing it.
    inflight: HashMap<String, SessionId>,
    /// Parent → its notices by position.
    notices: HashMap<SessionId, BTreeMap<u64, SessionId>>,
    /// The last notice position given out (positions rise across all parents).
    position: u64,
    /// Cache entries written into the database whose flush has not come back yet, with
    /// how many puts of each wait: taken out again should the store stop first
    /// ([`SledStore::forget_unflushed_cache`]).
    unflushed: HashMap<String, u32>,
}

impl SledStore {
    fn soft(&self) -> MutexGuard<'_, Soft> {
        self.soft.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Once a sync of the log has failed, takes out the cache entries no flush covered.
    /// An entry is made from its source's last record, which a reader may see before its
    /// sync; that sync failed or never came, so the record may be gone when the store is
    /// opened again, and an entry made from it would answer from a run the log does not
    /// show. sled flushes what it holds when it is dropped, so they are removed first.
    pub(crate) fn forget_unflushed_cache(&self) {
        let keys: Vec<String> = self.soft().unflushed.drain().map(|(k, _)| k).collect();
        if let (Some(db), false) = (self.sled.get(), keys.is_empty()) {
            for k in keys {
                let _ = db.cache.remove(k.as_bytes());
            }
        }
    }
}

#[async_trait]
impl Cache for SledStore {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        let Some(sled) = self.sled.get() else {
            return Ok(None);
        };
        let Some(v) = sled.cache.get(hash.as_bytes()).map_err(backend_err)? else {
            return Ok(None);
        };
        let e: CacheEntry = decode(&v)?;
        if e.expires.is_some_and(|x| x <= now) {
            return Ok(None);
        }
        Ok(Some(e))
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        let bytes = encode(entry)?;
        let db = self.sled.open()?;
        *self.soft().unflushed.entry(hash.to_string()).or_default() += 1;
        db.cache
            .insert(hash.as_bytes(), bytes)
            .map_err(backend_err)?;
        // Flushed after the log is synced, in the same group commit: an entry is durable
        // only with the records it was made from. On a failure it stays unflushed.
        self.wal_flusher.durable_db().await?;
        let mut soft = self.soft();
        if let Some(n) = soft.unflushed.get_mut(hash) {
            *n -= 1;
            if *n == 0 {
                soft.unflushed.remove(hash);
            }
        }
        Ok(())
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        let mut soft = self.soft();
        match soft.inflight.get(hash) {
            Some(owner) if owner != session => Ok(Some(owner.clone())),
            Some(_) => Ok(None),
            None => {
                soft.inflight.insert(hash.to_string(), session.clone());
                Ok(None)
            }
        }
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        let mut soft = self.soft();
        if soft.inflight.get(hash) == Some(session) {
            soft.inflight.remove(hash);
        }
        Ok(())
    }
}

#[async_trait]
impl Blobs for SledStore {
    /// Writes the blob into the event log file and returns without a sync of its own: a
    /// caller names the blob only in a record it appends next, that record's frame comes
    /// after the blob's in the file, and the `fdatasync` its append waits for covers both.
    /// A crash before that sync can lose the blob, but then the record too: opening cuts
    /// the file at its first damaged frame, so what survives is always a prefix of what was
    /// written. A blob in the sled tree `blobs` was stored by an earlier version, which
    /// flushed it before returning.
    async fn put(&self, data: &[u8]) -> Result<String> {
        let hash = blake3::hash(data);
        let hex = hash.to_hex().to_string();
        let in_sled = match self.sled.get() {
            Some(sled) => sled
                .blobs
                .contains_key(hex.as_bytes())
                .map_err(backend_err)?,
            None => false,
        };
        if !in_sled {
            self.wal.put_blob(hash.as_bytes(), data)?;
        }
        Ok(hex)
    }

    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>> {
        if let Some(raw) = raw_hash(hash) {
            if let Some(data) = self.wal.blob(&raw)? {
                return Ok(Some(data));
            }
        }
        let Some(sled) = self.sled.get() else {
            return Ok(None);
        };
        Ok(sled
            .blobs
            .get(hash.as_bytes())
            .map_err(backend_err)?
            .map(|v| v.to_vec()))
    }
}

/// The 32 bytes a blob's name spells in hex, if it is one.
fn raw_hash(hex: &str) -> Option<[u8; 32]> {
    blake3::Hash::from_hex(hex).ok().map(|h| *h.as_bytes())
}

#[async_trait]
impl Notices for SledStore {
    /// Taking a position and inserting the notice happen under one lock, so a reader that
    /// has seen position p can never later miss a notice below p.
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        let mut soft = self.soft();
        soft.position += 1;
        let pos = soft.position;
        soft.notices
            .entry(parent.clone())
            .or_default()
            .insert(pos, child.clone());
        Ok(())
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        let soft = self.soft();
        let Some(inbox) = soft.notices.get(parent) else {
            return Ok(vec![]);
        };
        let Some(from) = after.checked_add(1) else {
            return Ok(vec![]);
        };
        Ok(inbox
            .range(from..)
            .map(|(pos, child)| (*pos, child.clone()))
            .collect())
    }

    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()> {
        let mut k = prefix(target.as_str());
        k.extend_from_slice(watcher.as_str().as_bytes());
        self.sled
            .open()?
            .watchers
            .insert(k, pool.as_bytes())
            .map_err(backend_err)?;
        self.wal_flusher.durable_db().await
    }

    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>> {
        let p = prefix(target.as_str());
        let mut out = vec![];
        let Some(sled) = self.sled.get() else {
            return Ok(out);
        };
        for item in sled.watchers.scan_prefix(&p) {
            let (k, v) = item.map_err(backend_err)?;
            let w =
                std::str::from_utf8(&k[p.len()..]).map_err(|e| Error::corrupt("watcher key", e))?;
            let pool =
                String::from_utf8(v.to_vec()).map_err(|e| Error::corrupt("watcher pool", e))?;
            out.push((SessionId::parse(w)?, pool));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use skein_ports::ports::Blobs;

    use crate::SledStore;

    fn open(dir: &std::path::Path) -> std::sync::Arc<SledStore> {
        SledStore::open(&dir.join("data"), &dir.join("ws")).expect("the store opens")
    }

    #[tokio::test]
    async fn a_blob_is_written_once_into_the_log_and_read_after_a_reopen() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = open(dir.path());
        let size = || s.log_len();
        let data = b"an agent definition";
        let hash = s.put(data).await.expect("put");
        assert_eq!(hash, blake3::hash(data).to_hex().as_str());
        let after_one = size();
        assert!(after_one > data.len() as u64);
        // Stored again: neither written again nor synced, and no sled flush for either.
        assert_eq!(s.put(data).await.expect("put"), hash);
        let other = s.put(b"another").await.expect("put");
        assert_eq!(
            size(),
            after_one + (12 + 32 + b"another".len()) as u64,
            "a stored blob was written again"
        );
        assert_eq!(s.log_syncs(), 0, "a put synced on its own");
        assert_eq!(
            s.wal_flusher
                .requested
                .load(std::sync::atomic::Ordering::SeqCst),
            0,
            "a put waited for a flush"
        );
        drop(s);

        let s = open(dir.path());
        assert_eq!(s.get(&hash).await.expect("get").as_deref(), Some(&data[..]));
        assert_eq!(
            s.get(&other).await.expect("get").as_deref(),
            Some(&b"another"[..])
        );
        assert_eq!(s.get(&"0".repeat(64)).await.expect("get"), None);
        assert_eq!(s.get("not a hash").await.expect("get"), None);
    }

    #[tokio::test]
    async fn a_blob_an_earlier_version_kept_in_sled_is_read_and_not_stored_again() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = open(dir.path());
        let data = b"stored by an earlier version";
        let hash = blake3::hash(data).to_hex().to_string();
        let sled = s.sled.open().expect("sled");
        sled.blobs
            .insert(hash.as_bytes(), &data[..])
            .expect("insert");
        sled.db.flush().expect("flush");
        drop(s);

        let s = open(dir.path());
        let frames_end = s.log_len();
        assert_eq!(s.get(&hash).await.expect("get").as_deref(), Some(&data[..]));
        assert_eq!(s.put(data).await.expect("put"), hash);
        assert_eq!(
            s.log_len(),
            frames_end,
            "the blob was written to the log again"
        );
    }

    /// sled is opened by the first write into it, not before: a store that only reads
    /// finds it empty without opening it, and what the first write put there outlives the
    /// store, dropped as any other after `leave`.
    #[tokio::test]
    async fn sled_is_opened_by_the_first_write_and_what_it_holds_outlives_the_store() {
        use skein_ports::ports::{Cache, CacheEntry, Notices};
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = open(dir.path());
        let (root, watcher) = (
            skein_core::SessionId::parse("s-root").expect("id"),
            skein_core::SessionId::parse("s-watcher").expect("id"),
        );
        assert_eq!(
            Cache::get(&*s, "no such mission", 0).await.expect("get"),
            None
        );
        assert!(s.watchers(&root).await.expect("watchers").is_empty());
        assert!(!s.sled_opened(), "a read opened sled");
        s.leave().await.expect("leave");
        assert!(!dir.path().join("data/db").exists(), "sled was made");

        let s = open(dir.path());
        let entry = CacheEntry {
            answer: "forty-two".into(),
            usage: Default::default(),
            source: root.clone(),
            steps: 1,
            created: 1,
            expires: None,
        };
        Cache::put(&*s, "mission", &entry).await.expect("put");
        s.watch(&root, &watcher, "default").await.expect("watch");
        assert!(s.sled_opened());
        s.leave().await.expect("leave");

        let s = open(dir.path());
        assert!(
            s.sled_opened(),
            "sled holds something: it is opened at once"
        );
        let got = Cache::get(&*s, "mission", 2).await.expect("get");
        assert_eq!(got.map(|e| e.answer).as_deref(), Some("forty-two"));
        let w = s.watchers(&root).await.expect("watchers");
        assert_eq!(w, vec![(watcher, "default".to_string())]);
    }
}
