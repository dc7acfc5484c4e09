//! The cache (with single-flight claims), the blob store and the notice inboxes.

use async_trait::async_trait;
use skein_core::SessionId;
use skein_runtime::ports::{Blobs, Cache, CacheEntry, Notices};
use skein_runtime::{Error, Result};

use crate::{backend_err, decode, encode, prefix, u64_of, SledStore};

#[async_trait]
impl Cache for SledStore {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        let Some(v) = self.cache.get(hash.as_bytes()).map_err(backend_err)? else {
            return Ok(None);
        };
        let e: CacheEntry = decode(&v)?;
        if e.expires.is_some_and(|x| x <= now) {
            return Ok(None);
        }
        Ok(Some(e))
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        self.cache
            .insert(hash.as_bytes(), encode(entry)?)
            .map_err(backend_err)?;
        self.flusher.durable().await
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        let me = session.as_str().as_bytes();
        match self
            .inflight
            .compare_and_swap(hash.as_bytes(), None as Option<&[u8]>, Some(me))
            .map_err(backend_err)?
        {
            Ok(()) => Ok(None),
            Err(cur) => match cur.current {
                Some(v) if v.as_ref() != me => {
                    let id = std::str::from_utf8(&v)
                        .map_err(|e| Error::corrupt("single-flight owner", e))?;
                    Ok(Some(SessionId::parse(id)?))
                }
                _ => Ok(None),
            },
        }
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        let me = session.as_str().as_bytes();
        let _ = self
            .inflight
            .compare_and_swap(hash.as_bytes(), Some(me), None as Option<&[u8]>)
            .map_err(backend_err)?;
        Ok(())
    }
}

#[async_trait]
impl Blobs for SledStore {
    /// Returns once the blob is durable, also when another writer stored it a moment ago:
    /// a caller records the hash next, and the log's `fdatasync` must not land before the
    /// blob's flush (a crash between would leave a log naming a blob the store lost).
    async fn put(&self, data: &[u8]) -> Result<String> {
        let hash = blake3::hash(data).to_hex().to_string();
        let lock = || {
            self.unflushed_blobs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        };
        {
            // Written and marked under one lock: a writer who finds the blob in the tree
            // finds the mark too, until a flush after the write has ended.
            let mut unflushed = lock();
            let present = self
                .blobs
                .contains_key(hash.as_bytes())
                .map_err(backend_err)?;
            if present && !unflushed.contains_key(&hash) {
                return Ok(hash);
            }
            if !present {
                self.blobs
                    .insert(hash.as_bytes(), data)
                    .map_err(backend_err)?;
            }
            *unflushed.entry(hash.clone()).or_insert(0) += 1;
        }
        // A flush asked for now covers the write, whoever made it.
        let flushed = self.flusher.durable().await;
        let mut unflushed = lock();
        if let Some(waiting) = unflushed.get_mut(&hash) {
            *waiting -= 1;
            if *waiting == 0 && flushed.is_ok() {
                unflushed.remove(&hash);
            }
        }
        flushed.map(|()| hash)
    }

    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>> {
        Ok(self
            .blobs
            .get(hash.as_bytes())
            .map_err(backend_err)?
            .map(|v| v.to_vec()))
    }
}

#[async_trait]
impl Notices for SledStore {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        let _order = self.notice_order.lock().unwrap_or_else(|p| p.into_inner());
        let pos = self.db.generate_id().map_err(backend_err)? + 1;
        let mut k = prefix(parent.as_str());
        k.extend_from_slice(&pos.to_be_bytes());
        self.notices
            .insert(k, child.as_str().as_bytes())
            .map_err(backend_err)?;
        Ok(())
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        let mut start = prefix(parent.as_str());
        start.extend_from_slice(&(after.saturating_add(1)).to_be_bytes());
        let mut end = prefix(parent.as_str());
        end.extend_from_slice(&u64::MAX.to_be_bytes());
        let mut out = vec![];
        for item in self.notices.range(start..=end) {
            let (k, v) = item.map_err(backend_err)?;
            let pos = u64_of(&k[k.len() - 8..]);
            let child = std::str::from_utf8(&v).map_err(|e| Error::corrupt("notice", e))?;
            out.push((pos, SessionId::parse(child)?));
        }
        Ok(out)
    }

    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()> {
        let mut k = prefix(target.as_str());
        k.extend_from_slice(watcher.as_str().as_bytes());
        self.watchers
            .insert(k, pool.as_bytes())
            .map_err(backend_err)?;
        self.flusher.durable().await
    }

    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>> {
        let p = prefix(target.as_str());
        let mut out = vec![];
        for item in self.watchers.scan_prefix(&p) {
            let (k, v) = item.map_err(backend_err)?;
            let w =
                std::str::from_utf8(&k[p.len()..]).map_err(|e| Error::corrupt("watcher key", e))?;
            let pool =
                String::from_utf8(v.to_vec()).map_err(|e| Error::corrupt("watcher pool", e))?;
            out.push((SessionId::parse(w)?, pool));
        }
        Ok(out)
    }

    /// One process holds the database: a notice is written to its tree (at once visible to
    /// every reader in the process) before the wake-up is pushed, so the claimer of that
    /// wake-up reads it. A crash may lose both (neither is flushed per write), and then
    /// every fold is gone with the process: the next load of the parent is cold and reads
    /// every outstanding child.
    fn in_step_with_wakes(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use skein_runtime::ports::Blobs;

    use crate::SledStore;

    fn flushes_asked(s: &SledStore) -> u64 {
        s.flusher.requested.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_blob_another_writer_has_not_seen_flushed_is_waited_for_and_one_flushed_is_not() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let s = SledStore::open(&dir.path().join("data"), &dir.path().join("ws"))
            .expect("the store opens");
        let data = b"an agent definition";
        let hash = blake3::hash(data).to_hex().to_string();

        // A writer that has put the blob in the tree and waits for its flush: the blob is
        // there, and so is its mark.
        s.blobs.insert(hash.as_bytes(), &data[..]).expect("insert");
        s.unflushed_blobs
            .lock()
            .expect("lock")
            .insert(hash.clone(), 1);
        let before = flushes_asked(&s);
        assert_eq!(s.put(data).await.expect("put"), hash);
        assert_eq!(
            flushes_asked(&s),
            before + 1,
            "a second writer returned before a flush covered the first one's write"
        );
        // The first writer's flush ends: the blob is durable, and a later put of it
        // neither writes nor flushes.
        s.unflushed_blobs.lock().expect("lock").clear();
        let before = flushes_asked(&s);
        assert_eq!(s.put(data).await.expect("put"), hash);
        assert_eq!(
            flushes_asked(&s),
            before,
            "a durable blob was flushed again"
        );

        // A new blob is written, flushed, and then known durable.
        let before = flushes_asked(&s);
        let other = s.put(b"another").await.expect("put");
        assert_eq!(flushes_asked(&s), before + 1);
        assert!(s.unflushed_blobs.lock().expect("lock").is_empty());
        assert_eq!(
            s.get(&other).await.expect("get").as_deref(),
            Some(&b"another"[..])
        );
    }
}
