//! Blobs in the object store `skein_blobs`, named by their blake3 hash.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::{object_store, stream};
use async_trait::async_trait;
use skein_ports::ports::Blobs;
use skein_ports::{Error, Result};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::read::read_subject;
use super::{nats_err, NatsStore};

impl NatsStore {
    /// Reads a blob without the object store's reader: its description by a direct get
    /// from the leader of its stream, then its chunks as any subject is read (one direct
    /// get for the one chunk of every definition and most outputs; a consumer deleted
    /// after the read for a long blob). No consumer is left behind, and the read works
    /// while a recovering cluster places consumers slowly. `Ok(None)`: no such blob. What
    /// is read must hash to the blob's name.
    async fn read_blob(&self, hash: &str) -> Result<Option<Vec<u8>>> {
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
                return Ok(None)
            }
            Err(e) => return Err(nats_err("blob metadata", e)),
        };
        let info: object_store::ObjectInfo = serde_json::from_slice(&meta.payload)
            .map_err(|e| Error::corrupt(format!("blob {hash}: metadata"), e))?;
        if info.deleted {
            return Ok(None);
        }
        let chunks = format!("$O.{bucket}.C.{}", info.nuid);
        let data = match info.chunks {
            0 => vec![],
            1 => self
                .blobs_stream
                .get_last_raw_message_by_subject(&chunks)
                .await
                .map_err(|e| nats_err("blob chunk", e))?
                .payload
                .to_vec(),
            _ => {
                let mut out = Vec::with_capacity(info.size);
                for (_, chunk) in read_subject(&self.blobs_stream, &chunks, 0).await? {
                    out.extend_from_slice(&chunk);
                }
                out
            }
        };
        if blake3::hash(&data).to_hex().as_str() != hash {
            return Err(Error::corrupt_because(format!(
                "blob {hash}: its content ({} bytes of {} in {} chunks) hashes to another name",
                data.len(),
                info.size,
                info.chunks
            )));
        }
        Ok(Some(data))
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
        // While a cluster recovers from a lost node a read can find no leader or time out:
        // try a few times.
        let mut tries = 0;
        loop {
            let res =
                match tokio::time::timeout(Duration::from_secs(10), self.read_blob(hash)).await {
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

/// Reads `r` (an object of the archive store) to its end; what was read before an error
/// goes with it, and the caller reads the object again from its start.
///
/// Not `read_to_end`: that wants a read which fails to have put nothing in the buffer, and
/// tokio checks so in debug builds with a panic. The object store's reader breaks it: the
/// read that takes in an object's last chunk puts the chunk in the buffer and then, in the
/// same call, can fail (the whole object's digest wrong, or the message's info unreadable).
/// A blob read that way on a cluster with a node down once panicked there; blobs are now
/// read by [`NatsStore::read_blob`], without that reader.
pub(crate) async fn read_whole<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 128 * 1024];
    loop {
        match r.read(&mut chunk).await? {
            0 => return Ok(out),
            n => out.extend_from_slice(&chunk[..n]),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::ReadBuf;

    use super::read_whole;

    /// Gives its bytes a few at a time, then, if told to, fails in the very read that
    /// gives the last of them, as the object store's reader does on a wrong digest.
    struct Pieces {
        left: Vec<u8>,
        fail_at_the_end: bool,
    }

    impl tokio::io::AsyncRead for Pieces {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let n = self.left.len().min(3).min(buf.remaining());
            let piece: Vec<u8> = self.left.drain(..n).collect();
            buf.put_slice(&piece);
            if self.left.is_empty() && self.fail_at_the_end && n > 0 {
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "wrong digest",
                )));
            }
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_whole_read_gathers_every_piece() {
        let mut r = Pieces {
            left: b"eleven byte".to_vec(),
            fail_at_the_end: false,
        };
        assert_eq!(read_whole(&mut r).await.unwrap(), b"eleven byte");
    }

    #[tokio::test]
    async fn a_read_that_fails_after_filling_the_buffer_is_an_error_not_a_panic() {
        let mut r = Pieces {
            left: b"eleven byte".to_vec(),
            fail_at_the_end: true,
        };
        let err = read_whole(&mut r).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert_eq!(err.to_string(), "wrong digest");
    }
}
