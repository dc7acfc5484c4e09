//! The JetStream implementation of every port, one file per port:
//!
//! | file | what |
//! | --- | --- |
//! | `topology.rs` | streams and buckets, created once (`ensure_topology`), and their handles with the info read at open (`Topology`) |
//! | `connection.rs` | connect options: credentials, TLS, reconnects |
//! | `read.rs` | reading one subject of a stream (leader gets, streamed through a consumer when long) |
//! | `log.rs` | EventLog |
//! | `roots.rs` | the index of roots: pages of roots and the open roots |
//! | `retention.rs` | finding and removing finished trees older than an age; archives in object store `skein_archive` |
//! | `jobs.rs` | JobQueue (and the wake markers of job coalescing) |
//! | `cache.rs` | Cache and single-flight claims |
//! | `blobs.rs` | Blobs |
//! | `defs.rs` | pushed versions of the definitions, and the current one (KV `skein_defs`) |
//! | `workers.rs` | live workers and what they have and read (KV `skein_workers`) |
//! | `notices.rs` | Notices |
//! | `results.rs` | Announcer, and reading a tree's last result |
//! | `workspace.rs` | Workspaces: `ObjectWorkspace` |
//!
//! | port | NATS |
//! | --- | --- |
//! | EventLog | stream `SKEIN_EVENTS`, subject `skein.events.<session>`; appends carry `Nats-Expected-Last-Subject-Sequence` (one writer per session) and `Nats-Msg-Id = <session>:<seq>`, the seq of the message's first record (a retried publish is dropped as a duplicate); records appended together go as one message (`frame.rs`) |
//! | JobQueue | stream `SKEIN_JOBS` (work queue), subject `skein.jobs.<pool>.<session>`, one durable pull consumer per pool |
//! | Cache | KV `skein_cache`; single-flight claims in KV `skein_inflight` |
//! | Blobs | object store `skein_blobs`, named by blake3 hash |
//! | Notices | stream `SKEIN_NOTICES`: `skein.notices.<parent>` (a child ended or paused), `skein.watch.<session>` (single-flight waiters) |
//! | (index of roots) | streams `SKEIN_ROOTS` (`skein.roots.<root>`: each root's start, in submit order), `SKEIN_ROOT_STATE` (`skein.rootstate.<root>`) and `SKEIN_ROOT_OPEN` (`skein.rootopen.<root>`): see `roots.rs`; `SKEIN_ROOT_BLOCKS` (`skein.rootblock.{starts,states}.<k>`: the two large ones packed a thousand at a time): see `root_blocks.rs` |
//! | (index of trees) | stream `SKEIN_TREES`, subject `skein.tree.<root>`: each session of the tree, named before its first record; see `trees.rs` |
//! | Announcer | stream `SKEIN_RESULTS`, subject `skein.ended.<root>`, republished by the stream on `skein.results.<root>`: each ending once |
//! | Workspaces | object store `skein_workspace`, objects `<root>/<path>` |
//! | (definitions) | versions as blobs of `skein_blobs`; KV `skein_defs`: `version.<digest>`, `current` |
//! | (live workers) | KV `skein_workers`, one entry per worker, aging out |
//!
//! Job coalescing (at most one job per session, no wake-up lost) is told in `jobs.rs`.

mod blobs;
mod cache;
mod connection;
mod defs;
mod feed;
mod group;
mod holds;
mod jobs;
mod log;
mod notices;
mod quota;
mod read;
mod results;
mod retention;
mod room;
mod root_blocks;
mod roots;
mod topology;
mod trees;
mod workers;
mod workspace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, consumer, kv, object_store, stream, Context};
use skein_core::SessionId;
use skein_ports::ports::Capabilities;
use skein_ports::{Backend, Error, Result};

pub use connection::{connect_client, connect_options};
pub use defs::{Current, Move, VersionInfo, DEFS_BUCKET};
pub use results::{ended_subject, results_subject, StoredResult, ENDED_SEQ, RESULTS};
pub use retention::{RemovedTree, ARCHIVE};
pub use topology::{
    ensure_topology, Topology, EVENTS, JOBS, MISSIONS, NOTICES, ROOTS, ROOT_BLOCKS, ROOT_OPEN,
    ROOT_STATE,
};
pub use trees::TREES;
pub use workers::{WorkerInfo, WORKERS_BUCKET, WORKER_TTL_SECS};
pub use workspace::{clean_path, ObjectWorkspace};

use crate::config::{duration, NatsConfig, StorageType};

/// How long past its expiry a pull may go unanswered before it is given up.
const PULL_GRACE: Duration = Duration::from_secs(5);

/// A NATS operation that failed for a reason other than the ones its caller maps to a
/// kind of its own (a conflict, a missing message): the server is unreachable or failed.
///
/// A refusal for want of room (JetStream's resource limits: the server's `max_file_store`
/// or `max_memory_store`, the account's limits) is [`Error::Full`]: the write succeeds
/// once the operator makes room, and the work waits for it.
fn nats_err(what: &str, e: impl Into<skein_ports::error::BoxError>) -> Error {
    let e = e.into();
    if is_full(&*e) {
        return Error::full(format!("nats: {what}: JetStream has no room"), e);
    }
    Error::unavailable(format!("nats: {what}"), e)
}

/// Whether writes to `stream` (the log, the notices, new sessions' jobs) are gathered into
/// atomic batches: `group_commit` is on, the stream takes atomic batches (its server is
/// 2.12 or later and the flag is set), it has a single replica, and the server (`version`)
/// is 2.15.1 or later. There a batch is synced once; on earlier servers each of its
/// messages is synced as it would be alone, after the batch is staged in files of its own,
/// which costs more than it saves. A replicated stream's writes go through its replicas'
/// log instead, not measured with batches.
fn group_commits(stream: &stream::Stream, version: &str, cfg: &NatsConfig) -> bool {
    let have = &stream.cached_info().config;
    cfg.group_commit
        && have.allow_atomic_publish
        && have.num_replicas <= 1
        && version_at_least(version, (2, 15, 1))
}

/// Whether a server's `version` ("2.15.1", "v2.16.0-RC.1") is `least` or later; a version
/// that cannot be read is not.
fn version_at_least(version: &str, least: (u64, u64, u64)) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u64>());
    match (parts.next(), parts.next(), parts.next()) {
        (Some(Ok(a)), Some(Ok(b)), Some(Ok(c))) => (a, b, c) >= least,
        _ => false,
    }
}

/// Whether `e`, or an error beneath it, is JetStream refusing a write for want of room.
pub(crate) fn is_full(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::ErrorCode;
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            if [
                ErrorCode::INSUFFICIENT_RESOURCES,
                ErrorCode::STORAGE_RESOURCES_EXCEEDED,
                ErrorCode::ACCOUNT_RESOURCES_EXCEEDED,
                ErrorCode::MEMORY_RESOURCES_EXCEEDED,
            ]
            .contains(&js.error_code())
            {
                return true;
            }
        }
        at = e.source();
    }
    false
}

/// Publishes to a stream and waits for its ack, trying again for up to `patience` while no
/// stream answers (a stream electing a leader answers "no responders", which the client
/// reports as no stream for the subject) or the ack does not come. For a message whose
/// repeat is harmless only: a publish whose ack was lost may be stored twice. A submission
/// is such a message, as its intake takes the same submission again as a no-op.
pub async fn publish_patiently(
    js: &Context,
    subject: &str,
    headers: HeaderMap,
    payload: bytes::Bytes,
    patience: Duration,
) -> std::result::Result<jetstream::publish::PublishAck, jetstream::context::PublishError> {
    use jetstream::context::PublishErrorKind;
    let until = tokio::time::Instant::now() + patience;
    let mut pause = Duration::from_millis(100);
    loop {
        let sent = match js
            .publish_with_headers(subject.to_string(), headers.clone(), payload.clone())
            .await
        {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match sent {
            Err(e)
                if matches!(
                    e.kind(),
                    PublishErrorKind::StreamNotFound | PublishErrorKind::TimedOut
                ) && tokio::time::Instant::now() + pause < until =>
            {
                tracing::debug!(subject, error = %e, "no stream took the message yet; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            sent => return sent,
        }
    }
}

/// Headers carrying the current trace context (the session being advanced), if any.
fn trace_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Some(tp) = skein_ports::trace_context::current() {
        h.insert("traceparent", tp.as_str());
    }
    h
}

fn events_subject(s: &SessionId) -> String {
    format!("skein.events.{}", s.as_str())
}

fn storage(cfg: &NatsConfig) -> stream::StorageType {
    match cfg.storage {
        StorageType::File => stream::StorageType::File,
        StorageType::Memory => stream::StorageType::Memory,
    }
}

fn age(s: &str) -> Duration {
    duration(s).unwrap_or_default()
}

/// Everything the backend holds on to.
/// How many deletes of ended sessions' jobs a process has out at once (see `ack_ended` in
/// `jobs.rs`).
const ENDED_DELETES: usize = 4;

pub struct NatsStore {
    pub client: async_nats::Client,
    pub js: Context,
    events: stream::Stream,
    /// The index of roots (see `roots.rs`): `SKEIN_ROOTS`, `SKEIN_ROOT_STATE`, and whether
    /// this process has found it built.
    roots_starts: stream::Stream,
    root_state: stream::Stream,
    root_open: stream::Stream,
    /// `SKEIN_ROOT_BLOCKS`: packed blocks of the index (`root_blocks.rs`), and the roots
    /// each packs.
    root_blocks: stream::Stream,
    block_roots: std::sync::atomic::AtomicU64,
    /// `SKEIN_TREES`: each tree's list of sessions (`trees.rs`), and the names waiting to
    /// be written to it.
    trees: stream::Stream,
    naming: trees::Naming,
    roots_checked: tokio::sync::OnceCell<()>,
    jobs_stream: stream::Stream,
    /// First jobs of new sessions gathered into atomic batches in the same way.
    jobs_group: Option<group::Group>,
    /// Appends to `SKEIN_EVENTS` gathered into atomic batches (`group.rs`), where the
    /// stream takes them and `group_commit` is on; otherwise each goes alone.
    events_group: Option<group::Group>,
    notices: stream::Stream,
    /// Notices gathered into atomic batches in the same way.
    notices_group: Option<group::Group>,
    /// Every tree's endings (`results.rs`).
    results: stream::Stream,
    cache: kv::Store,
    inflight: kv::Store,
    wake: kv::Store,
    /// KV `skein_defs` (see `defs.rs`).
    defs: kv::Store,
    /// KV `skein_workers` (see `workers.rs`).
    workers: kv::Store,
    /// KV `skein_waiting` (see `room.rs`), made on first use.
    waiting: tokio::sync::OnceCell<kv::Store>,
    /// KV `skein_quota` (see `quota.rs`), made on first use.
    quota: tokio::sync::OnceCell<kv::Store>,
    /// Per quota key, the turn of this process's asks (see `quota.rs`).
    quota_turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    blobs: object_store::ObjectStore,
    /// The stream under `blobs`, for reads that need no consumer.
    blobs_stream: stream::Stream,
    /// Blobs this process has seen stored (see [`Blobs::put`] here).
    blobs_known: blobs::Known,
    workspace: Arc<object_store::ObjectStore>,
    /// The stream under `workspace`, whose object descriptions a listing reads.
    workspace_stream: Arc<stream::Stream>,
    /// The names of the workspace's objects, listed once for every listing waiting.
    workspace_names: Arc<workspace::Names>,
    cfg: NatsConfig,
    /// Last known (our seq, stream seq) per session: appends need the stream seq.
    heads: Mutex<HashMap<SessionId, log::Head>>,
    /// Each session's pipelined append whose ack nobody has read yet.
    pipelined: Mutex<HashMap<SessionId, log::Sent>>,
    /// A root's pipelined records that change its entry in the index of roots, indexed
    /// once their ack is read: `expected_last` and the records.
    index_pending: Mutex<HashMap<SessionId, (u64, Vec<skein_core::Record>)>>,
    consumers: tokio::sync::Mutex<HashMap<String, consumer::PullConsumer>>,
    /// The owner task of each pool's claims (`feed.rs`).
    feeds: Mutex<feed::Feeds>,
    /// The jobs this process holds (see `holds.rs`).
    holds: Arc<holds::Holds>,
    /// The turns of the deletes of ended sessions' jobs, `ENDED_DELETES` at a time (see
    /// `ack_ended` in `jobs.rs`).
    ended_deletes: tokio::sync::Semaphore,
    /// Lease given to pool consumers (their ack wait).
    lease: Duration,
    /// Whether `workspace_dir` lies on a local disk (looked at on the first tool call): its
    /// small file operations then run on the calling task.
    workspace_local: std::sync::OnceLock<bool>,
}

impl NatsStore {
    /// Connects, sets up the topology and returns the store.
    pub async fn connect(cfg: &NatsConfig, lease: Duration) -> Result<Arc<Self>> {
        let client = connect_client(cfg).await?;
        let js = jetstream::new(client.clone());
        // A fresh cluster may still be electing its JetStream leader, and a cluster that
        // lost a node its stream leaders: the whole setup is tried again for a while.
        let mut tries = 0;
        loop {
            match Self::open(client.clone(), js.clone(), cfg, lease).await {
                Ok(store) => return Ok(store),
                Err(e) if tries < 40 => {
                    tries += 1;
                    tracing::debug!(error = %e, "JetStream setup not ready; retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(crate) async fn open(
        client: async_nats::Client,
        js: Context,
        cfg: &NatsConfig,
        lease: Duration,
    ) -> Result<Arc<Self>> {
        let topology = ensure_topology(&js, cfg).await?;
        let s = |n: &str| topology.stream(n);
        let k = |n: &str| topology.kv(n);
        // The object stores' handles ask for their streams' info once more (the client
        // makes them only so), both at once.
        let o = |n: &'static str| {
            let js = js.clone();
            async move { js.get_object_store(n).await.map_err(|e| nats_err(n, e)) }
        };
        let (blobs, workspace) = tokio::try_join!(o("skein_blobs"), o("skein_workspace"))?;
        let events = s(EVENTS)?;
        let version = client.server_info().version;
        let group_for = |stream: &stream::Stream| {
            group_commits(stream, &version, cfg)
                .then(|| group::Group::start(client.clone(), js.clone()))
        };
        let events_group = group_for(&events);
        let jobs_stream = s(JOBS)?;
        let jobs_group = group_for(&jobs_stream);
        let notices = s(NOTICES)?;
        let notices_group = group_for(&notices);
        let workspace_stream = s("OBJ_skein_workspace")?;
        let holds = Arc::new(holds::Holds::new(lease));
        let store = Arc::new(Self {
            events,
            roots_starts: s(ROOTS)?,
            root_state: s(ROOT_STATE)?,
            root_open: s(ROOT_OPEN)?,
            root_blocks: s(ROOT_BLOCKS)?,
            block_roots: std::sync::atomic::AtomicU64::new(root_blocks::BLOCK_ROOTS),
            trees: s(TREES)?,
            naming: trees::Naming::default(),
            roots_checked: tokio::sync::OnceCell::new(),
            feeds: Mutex::new(feed::Feeds::new(jobs_stream.clone(), lease, holds.clone())),
            holds,
            jobs_stream,
            jobs_group,
            events_group,
            notices,
            notices_group,
            results: s(RESULTS)?,
            cache: k("skein_cache")?,
            inflight: k("skein_inflight")?,
            wake: k("skein_wake")?,
            defs: k(defs::DEFS_BUCKET)?,
            workers: k(workers::WORKERS_BUCKET)?,
            waiting: tokio::sync::OnceCell::new(),
            quota: tokio::sync::OnceCell::new(),
            quota_turns: Mutex::default(),
            blobs,
            blobs_stream: s("OBJ_skein_blobs")?,
            blobs_known: blobs::Known::default(),
            workspace: Arc::new(workspace),
            workspace_stream: Arc::new(workspace_stream.clone()),
            workspace_names: workspace::Names::new(workspace_stream),
            client,
            js,
            cfg: cfg.clone(),
            heads: Mutex::new(HashMap::new()),
            pipelined: Mutex::new(HashMap::new()),
            index_pending: Mutex::new(HashMap::new()),
            consumers: tokio::sync::Mutex::new(HashMap::new()),
            lease,
            workspace_local: std::sync::OnceLock::new(),
            ended_deletes: tokio::sync::Semaphore::new(ENDED_DELETES),
        });
        store.holds.set_store(Arc::downgrade(&store));
        Ok(store)
    }

    /// Whether appends to the log go in atomic batches (see `group.rs`).
    pub fn groups_appends(&self) -> bool {
        self.events_group.is_some()
    }

    /// Whether notices go in atomic batches.
    pub fn groups_notices(&self) -> bool {
        self.notices_group.is_some()
    }

    /// The ports, each call bounded by [`crate::deadline::OPERATION_LIMIT`].
    pub fn backend(self: &Arc<Self>) -> Backend {
        let d = crate::deadline::Deadline::new(self.clone(), crate::deadline::OPERATION_LIMIT);
        Backend {
            name: "nats",
            log: d.clone(),
            jobs: d.clone(),
            cache: d.clone(),
            blobs: d.clone(),
            notices: d.clone(),
            workspaces: self.clone(),
            announcer: Some(d),
            quota: Some(self.clone()),
            // Notices are messages of `SKEIN_NOTICES`, acked by the server before the
            // wake-up is pushed: a worker's crash loses none. A worker's claims take the
            // next job of its pool, whatever its session.
            capabilities: Capabilities {
                notices_in_step_with_wakes: false,
                notices_outlive_workers: true,
                claim_matching: false,
            },
        }
    }

    pub fn config(&self) -> &NatsConfig {
        &self.cfg
    }

    /// The handles of `names`, each holding its info, asked for all at once so that the
    /// whole takes `limit` at most however many streams have no leader; an `Err(Elapsed)`
    /// for a stream that did not answer within it.
    pub(crate) async fn streams_within(
        &self,
        names: &[&str],
        limit: Duration,
    ) -> Vec<
        std::result::Result<
            std::result::Result<stream::Stream, jetstream::context::GetStreamError>,
            tokio::time::error::Elapsed,
        >,
    > {
        futures::future::join_all(
            names
                .iter()
                .map(|name| tokio::time::timeout(limit, self.js.get_stream(*name))),
        )
        .await
    }

    /// Replicas of skein's streams that are not current with their leader, as
    /// `(stream, replica, why)`; a stream whose info cannot be had is reported with replica
    /// `-`. Empty on a single server.
    pub async fn lagging_replicas(&self) -> Vec<(String, String, String)> {
        let streams = [EVENTS, JOBS, NOTICES, MISSIONS, RESULTS];
        let infos = self.streams_within(&streams, Duration::from_secs(10)).await;
        let mut out = vec![];
        for (name, info) in streams.into_iter().zip(infos) {
            let info = match info {
                Ok(Ok(st)) => st.cached_info().clone(),
                Ok(Err(e)) => {
                    out.push((name.to_string(), "-".into(), format!("no stream info: {e}")));
                    continue;
                }
                Err(_) => {
                    out.push((
                        name.to_string(),
                        "-".into(),
                        "no stream info within 10s".into(),
                    ));
                    continue;
                }
            };
            let Some(cluster) = info.cluster else {
                continue;
            };
            if cluster.leader.is_none() {
                out.push((name.to_string(), "-".into(), "no leader".into()));
            }
            for r in cluster.replicas {
                if r.offline {
                    out.push((name.to_string(), r.name, "offline".into()));
                } else if !r.current {
                    out.push((
                        name.to_string(),
                        r.name,
                        format!("not current (lag {:?}, seen {:?} ago)", r.lag, r.active),
                    ));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn server_versions_are_compared_by_their_numbers() {
        use super::version_at_least as at_least;
        let least = (2, 15, 1);
        for v in [
            "2.15.1",
            "v2.15.1",
            "2.15.10",
            "2.16.0-RC.1",
            "3.0.0",
            "2.15.1-beta",
        ] {
            assert!(at_least(v, least), "{v}");
        }
        for v in [
            "2.15.0", "2.9.10", "v2.14.99", "2.15", "", "unknown", "2.x.1",
        ] {
            assert!(!at_least(v, least), "{v}");
        }
    }
}
