//! Versions of definitions pushed to the cluster, and which one is current: KV
//! `skein_defs`. A version's content (a `skein_core::Definitions`, often larger than a
//! KV value should be) is a blob of `skein_blobs`, named by its blake3 digest and so
//! immutable; this bucket holds only what is small and changes: a description of each
//! version pushed (`version.<digest>`) and the pointer to the current one (`current`),
//! which workers watch. Every change of the pointer is a compare-and-set on its revision,
//! so two pushes at once cannot lose one another's history.

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use skein_ports::{Error, Result};

use super::{nats_err, NatsStore};

pub const DEFS_BUCKET: &str = "skein_defs";
const CURRENT: &str = "current";
/// How many earlier current versions the pointer remembers (what `rollback` returns to).
const HISTORY: usize = 50;

/// What the bucket says about one pushed version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionInfo {
    pub digest: String,
    /// When it was first pushed (ms since the epoch).
    pub at: u64,
    pub agents: Vec<String>,
    #[serde(default)]
    pub scripts: Vec<String>,
    /// Who pushed it, as they named themselves (`--note`), if they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The current version, and the versions current before it, most recent last.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Current {
    pub digest: String,
    pub at: u64,
    #[serde(default)]
    pub history: Vec<String>,
}

/// How the current pointer is to change.
#[derive(Debug, Clone)]
pub enum Move {
    /// To this version, remembering the one it replaces.
    To(String),
    /// Back to the version current before this one.
    Back,
}

fn valid_digest(d: &str) -> Result<()> {
    if d.len() == 64
        && d.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "`{d}` is not a definitions version (64 lowercase hex digits)"
        )))
    }
}

impl NatsStore {
    /// Records that version `info.digest` exists (its blob must be stored already). A
    /// version pushed again keeps its first description.
    pub async fn defs_record(&self, info: &VersionInfo) -> Result<()> {
        valid_digest(&info.digest)?;
        let key = format!("version.{}", info.digest);
        let v = serde_json::to_vec(info).map_err(|e| Error::corrupt("definitions version", e))?;
        match self.defs.create(&key, Bytes::from(v)).await {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), kv::CreateErrorKind::AlreadyExists) => Ok(()),
            Err(e) => Err(nats_err("definitions version", e)),
        }
    }

    /// Every version pushed, oldest first.
    pub async fn defs_versions(&self) -> Result<Vec<VersionInfo>> {
        let mut keys = self
            .defs
            .keys()
            .await
            .map_err(|e| nats_err("definitions versions", e))?;
        let mut out = vec![];
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| nats_err("definitions versions", e))?;
            if !k.starts_with("version.") {
                continue;
            }
            if let Some(v) = self
                .defs
                .get(&k)
                .await
                .map_err(|e| nats_err("definitions version", e))?
            {
                out.push(
                    serde_json::from_slice::<VersionInfo>(&v)
                        .map_err(|e| Error::corrupt(format!("definitions {k}"), e))?,
                );
            }
        }
        out.sort_by(|a, b| (a.at, &a.digest).cmp(&(b.at, &b.digest)));
        Ok(out)
    }

    /// The description of one version; a digest's unique prefix is enough.
    pub async fn defs_version(&self, digest_or_prefix: &str) -> Result<VersionInfo> {
        let all = self.defs_versions().await?;
        let found: Vec<&VersionInfo> = all
            .iter()
            .filter(|v| v.digest.starts_with(digest_or_prefix))
            .collect();
        match found.as_slice() {
            [one] if !digest_or_prefix.is_empty() => Ok((*one).clone()),
            [] | [_] => Err(Error::NotFound(format!(
                "no definitions version `{digest_or_prefix}` was pushed (see `skein agents list`)"
            ))),
            many => Err(Error::invalid(format!(
                "`{digest_or_prefix}` names {} versions; give more of the digest",
                many.len()
            ))),
        }
    }

    /// The current version, if one was ever made current.
    pub async fn defs_current(&self) -> Result<Option<Current>> {
        Ok(self.defs_current_entry().await?.map(|(c, _)| c))
    }

    async fn defs_current_entry(&self) -> Result<Option<(Current, u64)>> {
        let Some(e) = self
            .defs
            .entry(CURRENT)
            .await
            .map_err(|e| nats_err("current definitions", e))?
        else {
            return Ok(None);
        };
        if e.operation != kv::Operation::Put {
            return Ok(None);
        }
        let c = serde_json::from_slice(&e.value)
            .map_err(|e| Error::corrupt("the current definitions pointer", e))?;
        Ok(Some((c, e.revision)))
    }

    /// Moves the current pointer; returns what it points to now. Moving to the version
    /// already current changes nothing.
    pub async fn defs_move(&self, to: Move, now: u64) -> Result<Current> {
        for _ in 0..10 {
            let found = self.defs_current_entry().await?;
            let (old, revision) = match &found {
                Some((c, r)) => (Some(c.clone()), *r),
                None => (None, 0),
            };
            let new = match (&to, old) {
                (Move::To(d), Some(old)) if &old.digest == d => return Ok(old),
                (Move::To(d), Some(old)) => {
                    let mut history = old.history;
                    history.push(old.digest);
                    let keep = history.len().saturating_sub(HISTORY);
                    history.drain(..keep);
                    Current {
                        digest: d.clone(),
                        at: now,
                        history,
                    }
                }
                (Move::To(d), None) => Current {
                    digest: d.clone(),
                    at: now,
                    history: vec![],
                },
                (Move::Back, Some(mut old)) => match old.history.pop() {
                    Some(prev) => Current {
                        digest: prev,
                        at: now,
                        history: old.history,
                    },
                    None => {
                        return Err(Error::invalid(format!(
                            "nothing to roll back to: {} is the first version made current",
                            &old.digest[..12.min(old.digest.len())]
                        )))
                    }
                },
                (Move::Back, None) => {
                    return Err(Error::invalid(
                        "nothing to roll back to: no definitions were pushed",
                    ))
                }
            };
            if let Move::To(d) = &to {
                valid_digest(d)?;
            }
            let v = serde_json::to_vec(&new)
                .map_err(|e| Error::corrupt("the current definitions pointer", e))?;
            let written = if found.is_some() {
                self.defs
                    .update(CURRENT, Bytes::from(v), revision)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            } else {
                self.defs
                    .create(CURRENT, Bytes::from(v))
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            };
            match written {
                Ok(()) => return Ok(new),
                // Someone moved it meanwhile: read it again.
                Err(e) => tracing::debug!(error = %e, "the current pointer moved; retrying"),
            }
        }
        Err(Error::unavailable_because(
            "the current definitions pointer kept changing under this update",
        ))
    }

    /// The current version's digest now, then each time it changes (None: no version
    /// is current), until the connection's watch ends.
    pub async fn defs_watch(
        &self,
    ) -> Result<impl futures::Stream<Item = Result<Option<String>>> + Send + 'static> {
        let w = self
            .defs
            .watch_with_history(CURRENT)
            .await
            .map_err(|e| nats_err("watch the current definitions", e))?;
        Ok(w.map(|e| {
            let e = e.map_err(|e| nats_err("watch the current definitions", e))?;
            if e.operation != kv::Operation::Put {
                return Ok(None);
            }
            let c: Current = serde_json::from_slice(&e.value)
                .map_err(|e| Error::corrupt("the current definitions pointer", e))?;
            Ok(Some(c.digest))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::valid_digest;

    #[test]
    fn only_a_full_lowercase_hex_digest_names_a_version() {
        assert!(valid_digest(&"a".repeat(64)).is_ok());
        assert!(valid_digest(&"A".repeat(64)).is_err());
        assert!(valid_digest("abc").is_err());
        assert!(valid_digest(&"g".repeat(64)).is_err());
    }
}
