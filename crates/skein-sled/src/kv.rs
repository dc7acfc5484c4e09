//! The cache (with single-flight claims), the blob store and the notice inboxes.

use async_trait::async_trait;
use skein_core::SessionId;
use skein_ports::ports::{Blobs, Cache, CacheEntry, Notices};
use skein_ports::{Error, Result};

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
        if !self
            .blobs
            .contains_key(hex.as_bytes())
            .map_err(backend_err)?
        {
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
        Ok(self
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
            s.flusher
                .requested
                .load(std::sync::atomic::Ordering::SeqCst),
            0
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
        s.blobs.insert(hash.as_bytes(), &data[..]).expect("insert");
        s.db.flush().expect("flush");
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
}
