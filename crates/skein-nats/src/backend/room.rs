//! Sessions waiting for room in the store, shown to every process: KV `skein_waiting`,
//! kept in memory, so that it takes marks while JetStream's file store is full. A worker
//! whose step waits puts `session → {since, reason}` at every try; an entry not put again
//! for [`LAPSE`] lapses (its worker is gone), and the worker deletes it when the session
//! runs on. `skein tree` and the UI read it.

use std::time::Duration;

use async_nats::jetstream::{kv, stream};

use futures::StreamExt;
use skein_core::SessionId;
use skein_ports::ports::WaitingForRoom;
use skein_ports::{Error, Result};

use super::{nats_err, NatsStore};

pub(crate) const WAITING: &str = "skein_waiting";
/// How long a mark lasts without being put again.
const LAPSE: Duration = Duration::from_secs(60);

impl NatsStore {
    /// The bucket, made on first use.
    async fn waiting(&self) -> Result<&kv::Store> {
        self.waiting
            .get_or_try_init(|| async { self.memory_bucket(WAITING, Some(LAPSE)).await })
            .await
    }

    pub(crate) async fn put_waiting(&self, w: &WaitingForRoom) -> Result<()> {
        let value = serde_json::to_vec(w).map_err(|e| Error::corrupt("a waiting mark", e))?;
        self.waiting()
            .await?
            .put(&w.session, value.into())
            .await
            .map_err(|e| nats_err(WAITING, e))?;
        Ok(())
    }

    pub(crate) async fn delete_waiting(&self, session: &SessionId) -> Result<()> {
        self.waiting()
            .await?
            .purge(session.as_str())
            .await
            .map_err(|e| nats_err(WAITING, e))
    }

    pub(crate) async fn list_waiting(&self) -> Result<Vec<WaitingForRoom>> {
        let kv = self.waiting().await?;
        let mut keys = kv.keys().await.map_err(|e| nats_err(WAITING, e))?;
        let mut out = vec![];
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| nats_err(WAITING, e))?;
            if let Some(v) = kv.get(&k).await.map_err(|e| nats_err(WAITING, e))? {
                // A mark that does not decode is no one's: it is left to lapse.
                if let Ok(w) = serde_json::from_slice::<WaitingForRoom>(&v) {
                    out.push(w);
                }
            }
        }
        out.sort_by(|a, b| a.session.cmp(&b.session));
        Ok(out)
    }
}

impl NatsStore {
    /// A KV bucket `name` kept in the servers' memory, each value living `lapse` at most,
    /// made if missing. Its stream is made by hand, as the topology makes its buckets (the
    /// client's bucket creation asks for account details some servers answer in a form it
    /// cannot read).
    pub(crate) async fn memory_bucket(
        &self,
        name: &str,
        lapse: Option<Duration>,
    ) -> Result<kv::Store> {
        if let Ok(kv) = self.js.get_key_value(name).await {
            return Ok(kv);
        }
        self.js
            .get_or_create_stream(stream::Config {
                name: format!("KV_{name}"),
                subjects: vec![format!("$KV.{name}.>")],
                max_messages_per_subject: 1,
                max_age: lapse.unwrap_or_default(),
                storage: stream::StorageType::Memory,
                num_replicas: self.cfg.replicas,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                duplicate_window: lapse.unwrap_or_default(),
                ..Default::default()
            })
            .await
            .map_err(|e| nats_err(name, e))?;
        self.js
            .get_key_value(name)
            .await
            .map_err(|e| nats_err(name, e))
    }
}
