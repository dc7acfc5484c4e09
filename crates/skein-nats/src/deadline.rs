//! Every backend call answers within a deadline.
//!
//! async-nats bounds single requests, but several of the backend's operations are streams
//! of messages (reads through a consumer, object chunks, subject listings) or loops of
//! requests, and a stream whose leader was lost mid-way may simply stop. A worker stuck
//! in one of them goes silent with work pending. [`Deadline`] wraps each port of the
//! store: a call that has not finished within its limit fails as a backend error that
//! names the operation, which the worker treats as transient (it retries, and says so).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{Record, SessionId};
use skein_runtime::ports::{
    Announcer, Blobs, Cache, CacheEntry, Durability, EventLog, Job, JobQueue, Notices, RootResult,
    WaitingForRoom,
};
use skein_runtime::{Error, Result};

use crate::backend::NatsStore;

/// The longest any single backend operation may take. Generous: a cold read of a long
/// log streams thousands of records, and a blob may be megabytes.
pub const OPERATION_LIMIT: Duration = Duration::from_secs(30);

/// The store's ports, each call bounded by a deadline.
pub struct Deadline {
    store: Arc<NatsStore>,
    limit: Duration,
}

impl Deadline {
    pub fn new(store: Arc<NatsStore>, limit: Duration) -> Arc<Self> {
        Arc::new(Self { store, limit })
    }

    async fn run<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.limit, fut).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(operation = what, limit = ?self.limit, "NATS operation did not finish in time");
                Err(Error::unavailable_because(format!(
                    "nats: {what}: did not finish within {:?}",
                    self.limit
                )))
            }
        }
    }
}

#[async_trait]
impl EventLog for Deadline {
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()> {
        self.run(
            "append to SKEIN_EVENTS",
            self.store
                .append(session, expected_last, records, durability),
        )
        .await
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        self.run(
            "read from SKEIN_EVENTS",
            EventLog::read(&*self.store, session, from_seq),
        )
        .await
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        self.run("last of SKEIN_EVENTS", self.store.last(session))
            .await
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        self.run("subjects of SKEIN_EVENTS", self.store.tree(root))
            .await
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        self.run("subjects of SKEIN_EVENTS", self.store.roots())
            .await
    }
}

#[async_trait]
impl JobQueue for Deadline {
    async fn push(&self, pool: &str, session: &SessionId) -> Result<()> {
        self.run("push to SKEIN_JOBS", self.store.push(pool, session))
            .await
    }

    async fn claim(&self, pool: &str, wait: Duration) -> Result<Option<Job>> {
        // The wait is the caller's: the deadline comes on top of it.
        match tokio::time::timeout(wait + self.limit, self.store.claim(pool, wait)).await {
            Ok(r) => r,
            Err(_) => Err(Error::unavailable_because(format!(
                "nats: claim from consumer pool-{pool} of SKEIN_JOBS: did not finish within {:?}",
                wait + self.limit
            ))),
        }
    }

    async fn heartbeat(&self, job: &Job) -> Result<()> {
        self.run("heartbeat on SKEIN_JOBS", self.store.heartbeat(job))
            .await
    }

    async fn ack(&self, job: &Job) -> Result<()> {
        self.run("ack on SKEIN_JOBS", self.store.ack(job)).await
    }

    async fn retry(&self, job: &Job, delay: Duration) -> Result<()> {
        self.run("nak on SKEIN_JOBS", self.store.retry(job, delay))
            .await
    }

    async fn depth(&self, pool: &str) -> Result<u64> {
        self.run("depth of SKEIN_JOBS", self.store.depth(pool))
            .await
    }

    async fn set_waiting_for_room(&self, w: &WaitingForRoom) -> Result<()> {
        self.run("put to KV skein_waiting", self.store.put_waiting(w))
            .await
    }

    async fn clear_waiting_for_room(&self, session: &SessionId) -> Result<()> {
        self.run(
            "purge from KV skein_waiting",
            self.store.delete_waiting(session),
        )
        .await
    }

    async fn waiting_for_room(&self) -> Result<Vec<WaitingForRoom>> {
        self.run("list KV skein_waiting", self.store.list_waiting())
            .await
    }
}

#[async_trait]
impl Cache for Deadline {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        self.run(
            "get from KV skein_cache",
            Cache::get(&*self.store, hash, now),
        )
        .await
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        self.run(
            "put to KV skein_cache",
            Cache::put(&*self.store, hash, entry),
        )
        .await
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        self.run(
            "claim in KV skein_inflight",
            self.store.claim_inflight(hash, session),
        )
        .await
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        self.run(
            "release in KV skein_inflight",
            self.store.release_inflight(hash, session),
        )
        .await
    }
}

#[async_trait]
impl Blobs for Deadline {
    async fn put(&self, data: &[u8]) -> Result<String> {
        self.run(
            "put to object store skein_blobs",
            Blobs::put(&*self.store, data),
        )
        .await
    }

    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>> {
        // A blob read retries by itself for up to about a minute while a cluster recovers.
        match tokio::time::timeout(self.limit * 3, Blobs::get(&*self.store, hash)).await {
            Ok(r) => r,
            Err(_) => Err(Error::unavailable_because(format!(
                "nats: get from object store skein_blobs: did not finish within {:?}",
                self.limit * 3
            ))),
        }
    }
}

#[async_trait]
impl Notices for Deadline {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()> {
        self.run("post to SKEIN_NOTICES", self.store.post(parent, child))
            .await
    }

    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>> {
        self.run(
            "read from SKEIN_NOTICES",
            Notices::read(&*self.store, parent, after),
        )
        .await
    }

    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()> {
        self.run(
            "watch on SKEIN_NOTICES",
            self.store.watch(target, watcher, pool),
        )
        .await
    }

    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>> {
        self.run("watchers on SKEIN_NOTICES", self.store.watchers(target))
            .await
    }
}

#[async_trait]
impl Announcer for Deadline {
    async fn root_finished(&self, notice: &RootResult) -> Result<()> {
        self.run("result notice", self.store.root_finished(notice))
            .await
    }
}
