//! Notices on stream `SKEIN_NOTICES` (`skein.notices.<parent>`, `skein.watch.<session>`).
//!
//! A notice's payload names the child. A notice of a child that ended for good (its agent
//! takes no follow-up questions) also carries the record that ended it, in the header
//! [`END_HEADER`] (base64 of the record as the log stores it): the parent settles the
//! child from it rather than reading the child's log, one read fewer per child where a
//! wide turn's children all end at once. Readers of earlier releases ignore the header;
//! a notice without it, or with one that does not read as that child's end, is settled
//! from the log as before.

use async_trait::async_trait;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use bytes::Bytes;
use skein_core::{Record, SessionId};
use skein_ports::ports::{NoticeRead, Notices};
use skein_ports::{Error, Result};

use super::read::{read_subject, read_subject_to_its_last, Got};
use super::{nats_err, trace_headers, NatsStore};
use crate::frame;

/// The header of a notice that carries its child's end.
pub const END_HEADER: &str = "Skein-End";

/// The largest end a notice carries (its base64): a longer answer is read from the log.
const MOST_END_BYTES: usize = 32 * 1024;

impl NatsStore {
    async fn post_notice(
        &self,
        parent: &SessionId,
        child: &SessionId,
        end: Option<&Record>,
    ) -> Result<()> {
        let subject = format!("skein.notices.{}", parent.as_str());
        let mut h = trace_headers();
        if let Some(end) = end {
            let text = STANDARD.encode(frame::encode(std::slice::from_ref(end)));
            if text.len() <= MOST_END_BYTES {
                h.insert(END_HEADER, text.as_str());
            }
        }
        let payload = Bytes::from(child.to_string());
        match &self.notices_group {
            Some(group) => {
                group
                    .publish(subject, h, payload)
                    .await
                    .map_err(|e| nats_err("notice", e))?;
            }
            None => {
                async {
                    self.js
                        .publish_with_headers(subject, h, payload)
                        .await?
                        .await
                }
                .await
                .map_err(|e| nats_err("notice", e))?;
            }
        }
        Ok(())
    }

    async fn read_notices(&self, parent: &SessionId, after: u64) -> Result<Vec<Got>> {
        let subject = format!("skein.notices.{}", parent.as_str());
        read_subject_to_its_last(&self.notices, &subject, after).await
    }
}

/// The child a notice names.
fn child_of(g: &Got) -> Result<SessionId> {
    Ok(SessionId::parse(&String::from_utf8_lossy(&g.payload))?)
}

/// The end a notice of `child` carries: one record of that child that ends it. Anything
/// else (no header, damage, a record of a format this release does not read) is no end,
/// and the parent reads the child's log.
fn end_of(g: &Got, child: &SessionId) -> Option<Record> {
    let text = g.headers.as_ref()?.get(END_HEADER)?.as_str();
    let bytes = STANDARD.decode(text).ok()?;
    let mut records = frame::decode(&bytes).ok()?;
    let r = records.pop().filter(|_| records.is_empty())?;
    (r.env.session == *child && r.env.body.is_terminal()).then_some(r)
}

#[async_trait]
impl Notices for NatsStore {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        self.post_notice(parent, child, None).await
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        self.read_notices(parent, after)
            .await?
            .iter()
            .map(|g| Ok((g.seq, child_of(g)?)))
            .collect()
    }

    async fn post_end(&self, parent: &SessionId, child: &SessionId, end: &Record) -> Result<()> {
        self.post_notice(parent, child, Some(end)).await
    }

    async fn read_ends(&self, parent: &SessionId, after: u64) -> Result<Vec<NoticeRead>> {
        self.read_notices(parent, after)
            .await?
            .iter()
            .map(|g| {
                let child = child_of(g)?;
                let end = end_of(g, &child);
                Ok((g.seq, child, end))
            })
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::NatsConfig;
    use skein_core::event::Cancelled;
    use skein_core::testing::first_record;
    use skein_core::Event;
    use skein_testnats::NatsServer;
    use std::time::Duration;

    fn cancelled(session: &SessionId, reason: &str) -> Record {
        first_record(
            session,
            Event::Cancelled(Cancelled {
                reason: reason.into(),
            }),
        )
    }

    /// Only a notice posted with its own child's end carries it; a bare notice, an end of
    /// another session, a record that is no end, one too long for a header and a header
    /// that does not read are all read as notices without an end (the parent reads the
    /// log), never as an error or as a wrong end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_notice_carries_its_childs_end_and_nothing_else_passes_for_one() {
        let server = NatsServer::start();
        let store = NatsStore::connect(
            &NatsConfig {
                urls: vec![server.url()],
                replicas: 1,
                ..NatsConfig::default()
            },
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        let parent = skein_runtime::new_root_id();
        let c: Vec<SessionId> = (1..=6).map(|i| parent.child("w", i)).collect();
        let end = cancelled(&c[0], "done");
        store.post_end(&parent, &c[0], &end).await.unwrap();
        store.post(&parent, &c[1]).await.unwrap();
        store.post_end(&parent, &c[2], &end).await.unwrap();
        let not_an_end = first_record(&c[3], skein_core::testing::submitted("leaf"));
        assert!(!not_an_end.env.body.is_terminal());
        store.post_end(&parent, &c[3], &not_an_end).await.unwrap();
        let long = cancelled(&c[4], &"x".repeat(MOST_END_BYTES));
        store.post_end(&parent, &c[4], &long).await.unwrap();
        let mut h = async_nats::HeaderMap::new();
        h.insert(END_HEADER, "not base64 at all!");
        store
            .js
            .publish_with_headers(
                format!("skein.notices.{}", parent.as_str()),
                h,
                Bytes::from(c[5].to_string()),
            )
            .await
            .unwrap()
            .await
            .unwrap();

        let read = store.read_ends(&parent, 0).await.unwrap();
        let children: Vec<&SessionId> = read.iter().map(|(_, child, _)| child).collect();
        assert_eq!(children, c.iter().collect::<Vec<_>>());
        // Records compare by their bytes, which their hash covers.
        let ends: Vec<Option<String>> = read
            .iter()
            .map(|(_, _, e)| e.as_ref().map(Record::hash))
            .collect();
        assert_eq!(ends, vec![Some(end.hash()), None, None, None, None, None]);
        // The plain read names the same children at the same positions, and a read after
        // a position starts after it.
        let plain = store.read(&parent, 0).await.unwrap();
        let same: Vec<(u64, SessionId)> = read.iter().map(|(p, c, _)| (*p, c.clone())).collect();
        assert_eq!(plain, same);
        let later = store.read_ends(&parent, read[2].0).await.unwrap();
        assert_eq!(later.len(), 3);
        assert_eq!(later[0].1, c[3]);
    }
}
