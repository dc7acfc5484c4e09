//! Blobs in the object store `skein_blobs`, named by their blake3 hash.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::{object_store, stream};
use async_trait::async_trait;
use skein_ports::ports::Blobs;
use skein_ports::{Error, Result};
use tokio::io::AsyncReadExt;

use super::{nats_err, NatsStore};

impl NatsStore {
    /// Publishes a job unless its session has one, pending or held: `Ok(false)` then.
    /// The publish carries `Nats-Expected-Last-Subject-Sequence: 0`, which the stream
    /// leader accepts only while the subject holds no message (an acked job is deleted
    /// from the work queue). A publish whose ack was lost may have landed: it is sent
    /// again, and the retry is refused as "a job exists" if the first one landed, so
    /// retrying never makes two jobs.
    /// Reads a blob of at most one chunk (every definition and most outputs) with two
    /// requests to the leader of its stream: its metadata, then its chunk. No consumer is
    /// made, so the read works while a recovering cluster places consumers slowly.
    /// `Ok(None)`: the blob has several chunks (read it by consumer); `Ok(Some(None))`: no
    /// such blob. What is read must hash to the blob's name.
    pub(crate) async fn blob_by_gets(&self, hash: &str) -> Result<Option<Option<Vec<u8>>>> {
        use base64::Engine;
        let bucket = "skein_blobs";
        let name = base64::engine::general_purpose::URL_SAFE.encode(hash);
        let meta = match self
            .blobs_stream
            .get_last_raw_message_by_subject(&format!("$O.{bucket}.M.{name}"))
            .await
        {
            Ok(m) => m,
            Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => {
                return Ok(Some(None))
            }
            Err(e) => return Err(nats_err("blob metadata", e)),
        };
        let info: object_store::ObjectInfo = serde_json::from_slice(&meta.payload)
            .map_err(|e| Error::corrupt(format!("blob {hash}: metadata"), e))?;
        if info.deleted {
            return Ok(Some(None));
        }
        if info.chunks > 1 {
            return Ok(None);
        }
        let data = if info.chunks == 0 {
            vec![]
        } else {
            self.blobs_stream
                .get_last_raw_message_by_subject(&format!("$O.{bucket}.C.{}", info.nuid))
                .await
                .map_err(|e| nats_err("blob chunk", e))?
                .payload
                .to_vec()
        };
        if blake3::hash(&data).to_hex().as_str() != hash {
            return Err(Error::corrupt_because(format!(
                "blob {hash}: its content hashes to another name"
            )));
        }
        Ok(Some(Some(data)))
    }
}

/// The names of blobs this process has seen stored: a put of one of them asks the server
/// nothing. A blob's name is the hash of its content and the bucket keeps every object (no
/// age limit, and skein deletes none), so a blob once stored stays what it was. Every turn
/// that delegates stores its children's definitions; without this, each such turn waited
/// one round trip to learn that the definition was there already. (A blob deleted from
/// outside skein stays known to a process that saw it stored; any other stores it again.)
/// Bounded: when full, it starts again empty.
#[derive(Default)]
pub(crate) struct Known(Mutex<HashSet<String>>);

impl Known {
    const MAX: usize = 4096;

    fn contains(&self, hash: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(hash)
    }

    /// Called only once the server has said the blob is stored.
    fn insert(&self, hash: &str) {
        let mut known = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= Self::MAX {
            known.clear();
        }
        known.insert(hash.to_string());
    }
}

#[async_trait]
impl Blobs for NatsStore {
    async fn put(&self, data: &[u8]) -> Result<String> {
        let hash = blake3::hash(data).to_hex().to_string();
        if self.blobs_known.contains(&hash) {
            return Ok(hash);
        }
        // A description marked deleted (a blob removed from outside skein) is no blob.
        if self.blobs.info(&hash).await.is_ok_and(|info| !info.deleted) {
            self.blobs_known.insert(&hash);
            return Ok(hash);
        }
        // As for reads: a cluster that lost a node answers "no responders" for a moment.
        let mut tries = 0;
        loop {
            let mut r = data;
            match self.blobs.put(hash.as_str(), &mut r).await {
                Ok(_) => {
                    self.blobs_known.insert(&hash);
                    return Ok(hash);
                }
                Err(e) if tries < 10 => {
                    tries += 1;
                    tracing::debug!(hash, error = %e, "blob put failed; retrying");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => return Err(nats_err("blob put", e)),
            }
        }
    }

    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>> {
        match self.blob_by_gets(hash).await {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(hash, error = %e, "blob read by gets failed; reading by consumer")
            }
        }
        // Reading an object runs a consumer over its chunks; while a cluster recovers
        // from a lost node that can time out, so try a few times.
        let mut tries = 0;
        loop {
            let attempt = async {
                let mut obj = match self.blobs.get(hash).await {
                    Ok(o) => o,
                    Err(e) if matches!(e.kind(), object_store::GetErrorKind::NotFound) => {
                        return Ok(None)
                    }
                    Err(e) => return Err(nats_err("blob get", e)),
                };
                let mut out = vec![];
                obj.read_to_end(&mut out)
                    .await
                    .map_err(|e| nats_err("blob read", e))?;
                Ok(Some(out))
            };
            let res = match tokio::time::timeout(Duration::from_secs(10), attempt).await {
                Ok(r) => r,
                Err(_) => Err(Error::unavailable_because(
                    "nats: blob read: no progress for 10 s",
                )),
            };
            match res {
                Err(e) if tries < 5 => {
                    tries += 1;
                    tracing::debug!(hash, error = %e, "blob read failed; retrying");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                other => return other,
            }
        }
    }
}
