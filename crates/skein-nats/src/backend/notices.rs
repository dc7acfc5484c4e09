//! Notices on stream `SKEIN_NOTICES` (`skein.notices.<parent>`, `skein.watch.<session>`).

use async_trait::async_trait;
use bytes::Bytes;
use skein_core::SessionId;
use skein_ports::ports::Notices;
use skein_ports::{Error, Result};

use super::read::{read_subject, read_subject_expecting};
use super::{nats_err, trace_headers, NatsStore};

#[async_trait]
impl Notices for NatsStore {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        let subject = format!("skein.notices.{}", parent.as_str());
        async {
            self.js
                .publish_with_headers(subject, trace_headers(), Bytes::from(child.to_string()))
                .await?
                .await
        }
        .await
        .map_err(|e| nats_err("notice", e))?;
        Ok(())
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        let subject = format!("skein.notices.{}", parent.as_str());
        read_subject_expecting(&self.notices, &subject, after)
            .await?
            .into_iter()
            .map(|(s, p)| Ok((s, SessionId::parse(&String::from_utf8_lossy(&p))?)))
            .collect()
    }

    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()> {
        let subject = format!("skein.watch.{}", target.as_str());
        let body = serde_json::json!({"watcher": watcher.to_string(), "pool": pool}).to_string();
        async { self.js.publish(subject, Bytes::from(body)).await?.await }
            .await
            .map_err(|e| nats_err("watch", e))?;
        Ok(())
    }

    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>> {
        let subject = format!("skein.watch.{}", target.as_str());
        let mut out = vec![];
        for (_, p) in read_subject(&self.notices, &subject, 0).await? {
            let v: serde_json::Value =
                serde_json::from_slice(&p).map_err(|e| Error::corrupt("notice", e))?;
            let w = SessionId::parse(v["watcher"].as_str().unwrap_or_default())?;
            let pool = v["pool"].as_str().unwrap_or("default").to_string();
            if !out.iter().any(|(x, _)| *x == w) {
                out.push((w, pool));
            }
        }
        Ok(out)
    }
}
