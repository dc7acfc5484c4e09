//! The Cache on KV `skein_cache`; single-flight claims on KV `skein_inflight`.

use async_nats::jetstream::kv;
use async_trait::async_trait;
use bytes::Bytes;
use skein_core::SessionId;
use skein_ports::ports::{Cache, CacheEntry};
use skein_ports::{Error, Result};

use super::{nats_err, NatsStore};

#[async_trait]
impl Cache for NatsStore {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        let Some(v) = self
            .cache
            .get(hash)
            .await
            .map_err(|e| nats_err("cache get", e))?
        else {
            return Ok(None);
        };
        let e: CacheEntry =
            serde_json::from_slice(&v).map_err(|e| Error::corrupt("cache entry", e))?;
        Ok(if e.expires.is_some_and(|x| x <= now) {
            None
        } else {
            Some(e)
        })
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        let v = serde_json::to_vec(entry).map_err(|e| Error::corrupt("cache entry", e))?;
        self.cache
            .put(hash, v.into())
            .await
            .map_err(|e| nats_err("cache put", e))?;
        Ok(())
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        for _ in 0..3 {
            match self
                .inflight
                .create(hash, Bytes::from(session.to_string()))
                .await
            {
                Ok(_) => return Ok(None),
                Err(e) if matches!(e.kind(), kv::CreateErrorKind::AlreadyExists) => {
                    match self
                        .inflight
                        .get(hash)
                        .await
                        .map_err(|e| nats_err("inflight", e))?
                    {
                        Some(v) => {
                            let holder = SessionId::parse(&String::from_utf8_lossy(&v))?;
                            return Ok((&holder != session).then_some(holder));
                        }
                        // Released in between (or a lagging replica): try again.
                        None => continue,
                    }
                }
                Err(e) => return Err(nats_err("inflight", e)),
            }
        }
        // Could not tell who holds it: run our own (a duplicate run, never a stuck one).
        Ok(None)
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        if let Some(e) = self
            .inflight
            .entry(hash)
            .await
            .map_err(|e| nats_err("inflight", e))?
        {
            if e.operation == kv::Operation::Put && e.value.as_ref() == session.as_str().as_bytes()
            {
                let _ = self
                    .inflight
                    .delete_expect_revision(hash, Some(e.revision))
                    .await;
            }
        }
        Ok(())
    }
}
