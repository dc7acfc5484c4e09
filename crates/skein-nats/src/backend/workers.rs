//! Live workers, as each advertises itself: KV `skein_workers`, one entry per worker,
//! written again every few seconds and gone when it is not (the bucket's entries age out).
//! What a worker has (its own agents, its model providers, tools and MCP servers, its
//! pools) lets one that lacks
//! something leave the work for one that has it; the record formats it reads let every
//! worker write only what all of them read.

use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use skein_ports::{Error, Result};

use super::{nats_err, NatsStore};

pub const WORKERS_BUCKET: &str = "skein_workers";
/// How long an entry lives without being written again.
pub const WORKER_TTL_SECS: u64 = 15;

/// What one worker says of itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub worker: String,
    /// When it said so (ms since the epoch).
    pub at: u64,
    /// The agents of its own files.
    #[serde(default)]
    pub agents: Vec<String>,
    /// Its model providers.
    #[serde(default)]
    pub providers: Vec<String>,
    /// Its tools (none: not said, by an earlier release).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// The MCP servers whose tools it has (none: not said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<Vec<String>>,
    #[serde(default)]
    pub pools: Vec<String>,
    /// The definitions version it holds current, if a pushed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defs: Option<String>,
    /// The newest record format it reads (it reads every older one too).
    #[serde(default = "first_format")]
    pub reads: u16,
    /// The skein version it runs.
    #[serde(default)]
    pub build: String,
    /// It said it stops (it drains): not counted as live.
    #[serde(default)]
    pub stopped: bool,
    /// It names each session in its tree's list before the session's first record
    /// (`trees.rs`); an earlier release does not say so.
    #[serde(default)]
    pub lists_trees: bool,
}

fn first_format() -> u16 {
    1
}

/// A worker id as a KV key: characters a key may not hold become `_`.
fn key(worker: &str) -> String {
    worker
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_=".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl NatsStore {
    /// Writes (again) what this worker says of itself.
    pub async fn advertise(&self, info: &WorkerInfo) -> Result<()> {
        let v = serde_json::to_vec(info).map_err(|e| Error::corrupt("worker info", e))?;
        self.workers
            .put(key(&info.worker), Bytes::from(v))
            .await
            .map_err(|e| nats_err("advertise the worker", e))?;
        Ok(())
    }

    /// Every worker that advertised itself within the entries' lifetime.
    pub async fn live_workers(&self) -> Result<Vec<WorkerInfo>> {
        let mut keys = self
            .workers
            .keys()
            .await
            .map_err(|e| nats_err("live workers", e))?;
        let mut out = vec![];
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| nats_err("live workers", e))?;
            if let Some(v) = self
                .workers
                .get(&k)
                .await
                .map_err(|e| nats_err("live worker", e))?
            {
                // An entry this build cannot read is a worker it cannot judge: left out.
                if let Ok(w) = serde_json::from_slice::<WorkerInfo>(&v) {
                    if !w.stopped {
                        out.push(w);
                    }
                }
            }
        }
        self.note_live_workers(&out).await;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_worker_id_becomes_a_valid_key() {
        assert_eq!(super::key("host-1234"), "host-1234");
        assert_eq!(super::key("pod.a/b c"), "pod_a_b_c");
    }
}
