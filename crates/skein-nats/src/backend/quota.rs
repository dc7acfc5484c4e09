//! Model quotas shared by every worker: KV `skein_quota`, one entry per `provider:model`
//! holding its [`Bucket`] (the next free time of each rate, what was learned, the permits
//! out, who waits). A worker reads the entry, decides on it, and writes it back only if
//! the entry is still at the revision it read (compare-and-swap); one that lost the race
//! reads again. The bucket is kept in memory: a restarted server forgets the spacing of
//! calls made before (at worst a burst), nothing else.
//!
//! Cost per model call, under declared or learned limits: one read and one conditional
//! write to ask, one of each to give the permit back (only under a concurrency or token
//! limit, or to share a provider's answer that changed what is known), and under a
//! concurrency limit one of each every `PERMIT_RENEW` (20 s) that the call lasts. A model with no
//! limit declared or learned costs one read. Within a process the asks of one key take
//! turns, so only the processes of a cluster race for an entry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::kv;
use async_trait::async_trait;
use futures::StreamExt;
use skein_ports::quota::{
    Bucket, Decision, Learned, Permit, Quota, QuotaAsk, QuotaLimits, QuotaWaiter, WAITER_LAPSE_MS,
};
use skein_ports::{Error, Result};

use super::{nats_err, NatsStore};

pub(crate) const QUOTA: &str = "skein_quota";
/// Tries of one compare-and-swap before the operation gives up as unavailable.
const CAS_TRIES: usize = 64;

static PERMITS: AtomicU64 = AtomicU64::new(0);

/// A KV key for `provider:model` (whose characters KV keys may not hold): `q_` and the
/// name's bytes in hex.
fn key_of(name: &str) -> String {
    let mut k = String::with_capacity(2 + name.len() * 2);
    k.push_str("q_");
    for b in name.bytes() {
        k.push_str(&format!("{b:02x}"));
    }
    k
}

fn decode(v: &[u8]) -> Result<Bucket> {
    serde_json::from_slice(v).map_err(|e| Error::corrupt("a quota bucket", e))
}

impl NatsStore {
    /// The bucket, made on first use.
    async fn quota_kv(&self) -> Result<&kv::Store> {
        self.quota
            .get_or_try_init(|| async { self.memory_bucket(QUOTA, None).await })
            .await
    }

    /// Reads the bucket of `name`, lets `f` change it, and writes it back if it changed
    /// and nobody wrote it meanwhile; otherwise reads again. Returns what `f` returned.
    async fn with_bucket<T>(
        &self,
        name: &str,
        mut f: impl FnMut(&mut Bucket, u64) -> T,
    ) -> Result<T> {
        let kv = self.quota_kv().await?;
        let key = key_of(name);
        // One change of a key at a time from this process: its work loops would only
        // make each other read again; the processes of a cluster still race, and the
        // compare-and-swap settles that.
        let turn = {
            let mut locks = self.quota_turns.lock().unwrap_or_else(|p| p.into_inner());
            locks.entry(key.clone()).or_default().clone()
        };
        let _turn = turn.lock().await;
        for tries in 0..CAS_TRIES {
            let entry = kv.entry(&key).await.map_err(|e| nats_err(QUOTA, e))?;
            let (mut bucket, revision) = match entry {
                Some(e) if e.operation == kv::Operation::Put => {
                    (decode(&e.value)?, Some(e.revision))
                }
                Some(e) => (Bucket::default(), Some(e.revision)),
                None => (Bucket::default(), None),
            };
            let before = bucket.clone();
            let out = f(&mut bucket, skein_ports::now_ms());
            if bucket == before {
                return Ok(out);
            }
            let value: bytes::Bytes = serde_json::to_vec(&bucket)
                .map_err(|e| Error::corrupt("a quota bucket", e))?
                .into();
            let written = match revision {
                Some(r) => match kv.update(&key, value, r).await {
                    Ok(_) => true,
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => false,
                    Err(e) => return Err(nats_err(QUOTA, e)),
                },
                None => match kv.create(&key, value).await {
                    Ok(_) => true,
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => false,
                    Err(e) => return Err(nats_err(QUOTA, e)),
                },
            };
            if written {
                return Ok(out);
            }
            // Another worker wrote first: read again, after a moment once it repeats.
            if tries >= 4 {
                tokio::time::sleep(Duration::from_millis(1 + tries as u64 % 5)).await;
            }
        }
        Err(Error::unavailable_because(format!(
            "nats: {QUOTA}: the bucket of {name} kept changing under {CAS_TRIES} tries"
        )))
    }
}

#[async_trait]
impl Quota for NatsStore {
    async fn acquire(&self, ask: &QuotaAsk, limits: &QuotaLimits) -> Result<Decision> {
        let id = format!(
            "{}-{}-{}",
            std::process::id(),
            skein_ports::now_ms(),
            PERMITS.fetch_add(1, Ordering::Relaxed)
        );
        self.with_bucket(&ask.key, |b, now| b.acquire(ask, limits, now, &id))
            .await
    }

    async fn release(
        &self,
        permit: &Permit,
        limits: &QuotaLimits,
        used: Option<(u64, u64)>,
    ) -> Result<()> {
        // Nothing to give back when neither concurrency nor tokens are limited.
        let tokens =
            limits.input_tokens_per_minute.is_some() || limits.output_tokens_per_minute.is_some();
        if limits.concurrent_requests.is_none() && !(tokens && used.is_some()) {
            return Ok(());
        }
        self.with_bucket(&permit.key, |b, now| b.release(permit, limits, used, now))
            .await
    }

    async fn renew(&self, permit: &Permit, limits: &QuotaLimits) -> Result<()> {
        // Only a concurrency limit gives a permit a place to hold.
        if limits.concurrent_requests.is_none() {
            return Ok(());
        }
        self.with_bucket(&permit.key, |b, now| b.renew(&permit.id, limits, now))
            .await
    }

    async fn learn(&self, key: &str, learned: &Learned) -> Result<()> {
        if learned.is_empty() {
            return Ok(());
        }
        self.with_bucket(key, |b, now| {
            b.learn(learned, now);
        })
        .await
    }

    async fn waiting(&self) -> Result<Vec<QuotaWaiter>> {
        let kv = self.quota_kv().await?;
        let mut keys = kv.keys().await.map_err(|e| nats_err(QUOTA, e))?;
        let now = skein_ports::now_ms();
        let mut out = vec![];
        let mut seen = std::collections::BTreeSet::new();
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| nats_err(QUOTA, e))?;
            // Every key comes once, then the entries written since: a key seen again
            // means the list is whole (the entries change at every model call).
            if !seen.insert(k.clone()) {
                break;
            }
            let Some(v) = kv.get(&k).await.map_err(|e| nats_err(QUOTA, e))? else {
                continue;
            };
            let name = k
                .strip_prefix("q_")
                .and_then(|h| {
                    (0..h.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
                        .collect::<Option<Vec<u8>>>()
                })
                .and_then(|b| String::from_utf8(b).ok())
                .unwrap_or(k.clone());
            if let Ok(b) = decode(&v) {
                out.extend(
                    b.listed(&name)
                        .into_iter()
                        .filter(|w| w.due_ms.saturating_add(WAITER_LAPSE_MS) > now),
                );
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_hold_only_what_kv_allows() {
        let k = super::key_of("local:qwen2.5:7b/x");
        assert!(k.starts_with("q_"));
        assert!(k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    }
}
