//! The JetStream implementation of every port.
//!
//! | port | NATS |
//! | --- | --- |
//! | EventLog | stream `SKEIN_EVENTS`, subject `skein.events.<session>`; appends carry `Nats-Expected-Last-Subject-Sequence` (one writer per session) and `Nats-Msg-Id = <session>:<seq>` (a retried publish is dropped as a duplicate) |
//! | JobQueue | stream `SKEIN_JOBS` (work queue), subject `skein.jobs.<pool>.<session>`, one durable pull consumer per pool |
//! | Cache | KV `skein_cache`; single-flight claims in KV `skein_inflight` |
//! | Blobs | object store `skein_blobs`, named by blake3 hash |
//! | Notices | stream `SKEIN_NOTICES`: `skein.notices.<parent>` (a child ended or paused), `skein.watch.<session>` (single-flight waiters) |
//! | Announcer | core subject `skein.results.<root>` |
//! | Workspaces | object store `skein_workspace`, objects `<root>/<path>` |
//!
//! Job coalescing: a session has at most one job, pending or held. Each job is published
//! with `Nats-Expected-Last-Subject-Sequence: 0`, which the stream accepts only while the
//! subject holds no message (an acked job is deleted from the work queue). The stream itself
//! has no per-subject limit: replicas of servers before 2.10 cannot catch up on a stream
//! that refuses new messages per subject. A push refused because a job exists writes a wake
//! marker (KV `skein_wake`) and tries once more (the job may have been acked in between); a
//! holder, after its ack, reads the marker and, if set, clears it and pushes again. Either
//! the second publish lands, or the marker was written before the ack and is seen after it:
//! no wake-up is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::header::{HeaderMap, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, consumer, kv, object_store, stream, Context};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use skein_core::{Record, SessionId};
use skein_runtime::ports::{
    Announcer, Blobs, Cache, CacheEntry, EventLog, Job, JobQueue, Notices, RootResult, Workspaces,
};
use skein_runtime::{Backend, Error, Result};
use skein_tools::workspace::DirEntry;
use skein_tools::{ToolError, Usage, Workspace};
use tokio::io::AsyncReadExt;

use crate::config::{duration, NatsConfig};

pub const EVENTS: &str = "SKEIN_EVENTS";
pub const JOBS: &str = "SKEIN_JOBS";
pub const NOTICES: &str = "SKEIN_NOTICES";
pub const MISSIONS: &str = "SKEIN_MISSIONS";

/// How long past its expiry a pull may go unanswered before it is given up.
const PULL_GRACE: Duration = Duration::from_secs(5);

fn nats_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Backend(format!("nats: {what}: {e}"))
}

/// Headers carrying the current trace context (the session being advanced), if any.
fn trace_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Some(tp) = skein_runtime::spans::current() {
        h.insert("traceparent", tp.as_str());
    }
    h
}

fn events_subject(s: &SessionId) -> String {
    format!("skein.events.{}", s.as_str())
}

fn storage(cfg: &NatsConfig) -> stream::StorageType {
    if cfg.storage == "memory" {
        stream::StorageType::Memory
    } else {
        stream::StorageType::File
    }
}

fn age(s: &str) -> Duration {
    duration(s).unwrap_or_default()
}

/// Everything the backend holds on to.
pub struct NatsStore {
    pub client: async_nats::Client,
    pub js: Context,
    events: stream::Stream,
    jobs_stream: stream::Stream,
    notices: stream::Stream,
    cache: kv::Store,
    inflight: kv::Store,
    wake: kv::Store,
    blobs: object_store::ObjectStore,
    /// The stream under `blobs`, for reads that need no consumer.
    blobs_stream: stream::Stream,
    workspace: object_store::ObjectStore,
    cfg: NatsConfig,
    /// Last known (our seq, stream seq) per session: appends need the stream seq.
    heads: Mutex<HashMap<SessionId, (u64, u64)>>,
    consumers: tokio::sync::Mutex<HashMap<String, consumer::PullConsumer>>,
    held: Mutex<HashMap<String, Arc<jetstream::message::Acker>>>,
    /// Lease given to pool consumers (their ack wait).
    lease: Duration,
}

/// Creates every missing stream and bucket; existing ones are left alone. Idempotent.
pub async fn ensure_topology(js: &Context, cfg: &NatsConfig) -> Result<()> {
    let st = storage(cfg);
    let r = cfg.replicas.max(1);
    let put = |c: stream::Config| async move {
        match js.get_stream(&c.name).await {
            // Existing streams are left as they are: an operator may have tuned them, and
            // a read-only command must never rescale a cluster's streams.
            Ok(_) => Ok(()),
            Err(_) => js
                .create_stream(c.clone())
                .await
                .map(|_| ())
                .map_err(|e| nats_err(&c.name, e)),
        }
    };
    put(stream::Config {
        name: EVENTS.into(),
        subjects: vec!["skein.events.>".into()],
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        allow_direct: true,
        duplicate_window: age(&cfg.duplicate_window),
        max_age: age(&cfg.events_max_age),
        ..Default::default()
    })
    .await?;
    // Limits retention, not a work queue: on a work queue each replica deletes an acked
    // job through the consumer, in its own order, so replicas judge the conditional
    // publish of the next job differently (servers before 2.11 then reset the stream for
    // minutes). The holder deletes its job through the stream instead.
    let jobs = stream::Config {
        name: JOBS.into(),
        subjects: vec!["skein.jobs.>".into()],
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        // A job left behind (its session's logs aged out) goes with them.
        max_age: age(&cfg.events_max_age),
        ..Default::default()
    };
    put(jobs.clone()).await?;
    upgrade_jobs_stream(js, jobs).await;
    put(stream::Config {
        name: NOTICES.into(),
        subjects: vec!["skein.notices.>".into(), "skein.watch.>".into()],
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        allow_direct: true,
        // Wake-ups matter only while their logs exist: they age out with them.
        max_age: age(&cfg.events_max_age),
        ..Default::default()
    })
    .await?;
    put(stream::Config {
        name: MISSIONS.into(),
        subjects: vec!["skein.missions.submit".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: st,
        num_replicas: r,
        duplicate_window: age(&cfg.duplicate_window),
        ..Default::default()
    })
    .await?;
    for (bucket, max_age) in [
        ("skein_cache", age(&cfg.cache_max_age)),
        ("skein_inflight", age(&cfg.inflight_max_age)),
        ("skein_wake", Duration::ZERO),
    ] {
        // The KV layout made by hand: the client's bucket creation asks for account
        // details that servers before 2.10 answer in a form it cannot read.
        let dup = if max_age > Duration::ZERO {
            max_age.min(Duration::from_secs(120))
        } else {
            Duration::from_secs(120)
        };
        put(stream::Config {
            name: format!("KV_{bucket}"),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_age,
            storage: st,
            num_replicas: r,
            allow_rollup: true,
            deny_delete: true,
            // KV reads may come from any replica: a lagging cache or single-flight read
            // costs at most a duplicate run (see claim_inflight), and stays available
            // while a cluster re-elects leaders.
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            duplicate_window: dup,
            ..Default::default()
        })
        .await?;
    }
    // Object stores as the client would make them, but without direct reads: reads go to
    // the stream leader, so a lagging replica can never answer "absent".
    for bucket in ["skein_blobs", "skein_workspace"] {
        put(stream::Config {
            name: format!("OBJ_{bucket}"),
            subjects: vec![format!("$O.{bucket}.C.>"), format!("$O.{bucket}.M.>")],
            storage: st,
            num_replicas: r,
            discard: stream::DiscardPolicy::New,
            allow_rollup: true,
            allow_direct: false,
            ..Default::default()
        })
        .await?;
    }
    Ok(())
}

/// Earlier versions made `SKEIN_JOBS` refuse a second message per subject in the stream
/// itself (`max_messages_per_subject: 1` with `discard_new_per_subject`). A replica that
/// restarts on servers before 2.10 cannot catch up on such a stream ("maximum messages per
/// subject exceeded", retried for ever), and the stream stops answering. The limit now
/// travels on each job's publish instead (see [`NatsStore::publish_job`]); a stream made
/// the old way is brought to the new settings here, once.
async fn upgrade_jobs_stream(js: &Context, want: stream::Config) {
    let Ok(mut s) = js.get_stream(JOBS).await else {
        return;
    };
    let Ok(info) = s.info().await else {
        return;
    };
    let have = &info.config;
    if !have.discard_new_per_subject && have.max_messages_per_subject <= 0 {
        return;
    }
    let cfg = stream::Config {
        max_messages_per_subject: -1,
        discard_new_per_subject: false,
        discard: stream::DiscardPolicy::Old,
        // A work queue stays one (retention cannot change); its jobs are deleted through
        // the stream before they are acked all the same, so its replicas stay consistent.
        retention: have.retention,
        max_age: have.max_age,
        num_replicas: have.num_replicas,
        storage: have.storage,
        ..want
    };
    match js.update_stream(cfg).await {
        Ok(_) => tracing::info!(
            stream = JOBS,
            "job stream updated: one job per session is now enforced on publish, not by a \
             per-subject limit (which replicas of servers before 2.11 cannot catch up on)"
        ),
        Err(e) => tracing::warn!(stream = JOBS, error = %e,
            "job stream keeps its per-subject limit; a replica of a server before 2.11 may \
             fail to catch up on it after a restart"),
    }
}

/// Connection options with the configured credentials and TLS (never logged), the server
/// addresses, and whether any credentials were given. Callers add their retry policy.
pub async fn connect_options(
    cfg: &NatsConfig,
) -> Result<(
    async_nats::ConnectOptions,
    Vec<async_nats::ServerAddr>,
    bool,
)> {
    let mut opts = async_nats::ConnectOptions::new()
        .name("skein")
        .connection_timeout(Duration::from_secs(5));
    let env = |v: &Option<String>| v.as_ref().and_then(|n| std::env::var(n).ok());
    let mut given = false;
    let password = env(&cfg.password_env).or(cfg.password.clone());
    if let (Some(u), Some(p)) = (&cfg.user, password) {
        opts = opts.user_and_password(u.clone(), p);
        given = true;
    }
    if let Some(t) = env(&cfg.token_env).or(cfg.token.clone()) {
        opts = opts.token(t);
        given = true;
    }
    if let Some(c) = &cfg.credentials_file {
        opts = opts
            .credentials_file(c)
            .await
            .map_err(|e| Error::Backend(format!("nats: credentials file {}: {e}", c.display())))?;
        given = true;
    }
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone());
    }
    if let (Some(c), Some(k)) = (&cfg.tls_cert, &cfg.tls_key) {
        opts = opts.add_client_certificate(c.clone(), k.clone());
    }
    if cfg.tls_required {
        opts = opts.require_tls(true);
    }
    let urls: Vec<async_nats::ServerAddr> = cfg
        .urls
        .iter()
        .map(|u| {
            u.parse().map_err(|e| {
                Error::Rejected(format!("nats url `{}`: {e}", crate::config::redact_url(u)))
            })
        })
        .collect::<Result<_>>()?;
    Ok((opts, urls, given))
}

/// Connects with the configured credentials, retrying for as long as it takes (a worker
/// may start before its server).
pub async fn connect_client(cfg: &NatsConfig) -> Result<async_nats::Client> {
    let (opts, urls, _) = connect_options(cfg).await?;
    opts.retry_on_initial_connect()
        .max_reconnects(None)
        .event_callback(crate::health::event_logger())
        .connect(urls)
        .await
        .map_err(|e| nats_err("connect", e))
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

    async fn open(
        client: async_nats::Client,
        js: Context,
        cfg: &NatsConfig,
        lease: Duration,
    ) -> Result<Arc<Self>> {
        ensure_topology(&js, cfg).await?;
        let s = |n: &'static str| {
            let js = js.clone();
            async move { js.get_stream(n).await.map_err(|e| nats_err(n, e)) }
        };
        let k = |n: &'static str| {
            let js = js.clone();
            async move { js.get_key_value(n).await.map_err(|e| nats_err(n, e)) }
        };
        let o = |n: &'static str| {
            let js = js.clone();
            async move { js.get_object_store(n).await.map_err(|e| nats_err(n, e)) }
        };
        Ok(Arc::new(Self {
            events: s(EVENTS).await?,
            jobs_stream: s(JOBS).await?,
            notices: s(NOTICES).await?,
            cache: k("skein_cache").await?,
            inflight: k("skein_inflight").await?,
            wake: k("skein_wake").await?,
            blobs: o("skein_blobs").await?,
            blobs_stream: s("OBJ_skein_blobs").await?,
            workspace: o("skein_workspace").await?,
            client,
            js,
            cfg: cfg.clone(),
            heads: Mutex::new(HashMap::new()),
            consumers: tokio::sync::Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            lease,
        }))
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
        }
    }

    pub fn config(&self) -> &NatsConfig {
        &self.cfg
    }

    fn head(&self, s: &SessionId) -> Option<(u64, u64)> {
        self.heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(s)
            .copied()
    }

    fn set_head(&self, s: &SessionId, seq: u64, sseq: u64) {
        let mut h = self.heads.lock().unwrap_or_else(|p| p.into_inner());
        if h.len() > 100_000 {
            h.clear();
        }
        h.insert(s.clone(), (seq, sseq));
    }

    /// The last record and its stream sequence.
    async fn last_with_seq(&self, s: &SessionId) -> Result<Option<(Record, u64)>> {
        match self
            .events
            .get_last_raw_message_by_subject(&events_subject(s))
            .await
        {
            Ok(m) => {
                let r = Record::decode(m.payload.to_vec())
                    .map_err(|e| Error::Corrupt(e.to_string()))?;
                Ok(Some((r, m.sequence)))
            }
            Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => {
                Ok(None)
            }
            Err(e) => Err(nats_err("read last", e)),
        }
    }

    async fn consumer(&self, pool: &str) -> Result<consumer::PullConsumer> {
        let mut c = self.consumers.lock().await;
        if let Some(x) = c.get(pool) {
            return Ok(x.clone());
        }
        let name = format!("pool-{pool}");
        let config = consumer::pull::Config {
            durable_name: Some(name.clone()),
            filter_subject: format!("skein.jobs.{pool}.>"),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: self.lease,
            max_deliver: -1,
            max_ack_pending: -1,
            // Every work loop of every worker keeps one pull request open.
            max_waiting: 16_384,
            ..Default::default()
        };
        // One attempt: while a cluster elects leaders this fails, and the caller's loop
        // tries again and says so (a silent retry here once hid a lost consumer).
        let cons = self
            .jobs_stream
            .get_or_create_consumer(&name, config.clone())
            .await
            .map_err(|e| nats_err(&format!("open consumer {name} of stream {JOBS}"), e))?;
        // The consumer outlives workers: one made with another lease keeps that ack wait,
        // and heartbeats paced by ours would come too late for it. Bring it to ours.
        let cons = if cons.cached_info().config.ack_wait != self.lease {
            tracing::info!(pool, from = ?cons.cached_info().config.ack_wait, to = ?self.lease,
                "pool consumer's ack wait set to this worker's lease");
            self.jobs_stream
                .create_consumer(config)
                .await
                .map_err(|e| nats_err("pool consumer update", e))?
        } else {
            cons
        };
        c.insert(pool.to_string(), cons.clone());
        Ok(cons)
    }

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
    async fn blob_by_gets(&self, hash: &str) -> Result<Option<Option<Vec<u8>>>> {
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
            .map_err(|e| Error::Corrupt(format!("blob {hash}: metadata: {e}")))?;
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
            return Err(Error::Corrupt(format!(
                "blob {hash}: its content hashes to another name"
            )));
        }
        Ok(Some(Some(data)))
    }

    /// Replicas of skein's streams that are not current with their leader, as
    /// `(stream, replica, why)`; a stream whose info cannot be had is reported with replica
    /// `-`. Empty on a single server.
    pub async fn lagging_replicas(&self) -> Vec<(String, String, String)> {
        let mut out = vec![];
        for name in [EVENTS, JOBS, NOTICES, MISSIONS] {
            let info = tokio::time::timeout(Duration::from_secs(10), async {
                let mut st = self.js.get_stream(name).await?;
                Ok::<_, async_nats::Error>(st.info().await?.clone())
            })
            .await;
            let info = match info {
                Ok(Ok(i)) => i,
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

    /// Drops the cached handle of a pool's consumer: the next claim looks it up again and
    /// makes it anew if the cluster lost it.
    async fn forget_consumer(&self, pool: &str) {
        self.consumers.lock().await.remove(pool);
    }

    async fn publish_job(&self, pool: &str, session: &SessionId) -> Result<bool> {
        let subject = format!("skein.jobs.{pool}.{}", session.as_str());
        let mut delay = Duration::from_millis(100);
        let mut tries = 0;
        loop {
            let mut h = trace_headers();
            h.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
            let res = async {
                self.js
                    .publish_with_headers(subject.clone(), h, Bytes::new())
                    .await?
                    .await
            }
            .await;
            tracing::trace!(%session, published = res.is_ok(), "job push");
            match res {
                Ok(_) => return Ok(true),
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::context::PublishErrorKind::WrongLastSequence
                    ) =>
                {
                    return Ok(false)
                }
                // A stream made before the limit moved to the publish says it this way.
                Err(e) if e.to_string().contains("maximum messages per subject") => {
                    return Ok(false)
                }
                Err(e) if tries < 4 => {
                    tries += 1;
                    tracing::debug!(%session, error = %e, "job push not acknowledged; sending again");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(e) => return Err(nats_err("push job", e)),
            }
        }
    }

    /// Reads every message of one subject of a stream after stream seq `after`. The first
    /// few come by direct get, one round trip each, which is all most reads need (the tail
    /// of a log a worker has folded); a longer subject — a cold load of a parent with
    /// hundreds of children, say — is streamed through a short-lived consumer instead, so
    /// the cost is a few round trips rather than one per message. Where no consumer can
    /// be made (a cluster electing leaders), direct gets read the rest.
    async fn read_subject(
        &self,
        st: &stream::Stream,
        subject: &str,
        after: u64,
    ) -> Result<Vec<(u64, Bytes)>> {
        const DIRECT_READS: usize = 8;
        let mut out = vec![];
        if self
            .read_direct(st, subject, after + 1, Some(DIRECT_READS), &mut out)
            .await?
        {
            return Ok(out);
        }
        let next = out.last().map_or(after, |(seq, _)| *seq) + 1;
        let streamed = self
            .read_subject_streamed(st, subject, next, &mut out)
            .await;
        match streamed {
            Ok(true) => {}
            // No consumer could be made, or it failed on the way (a leader lost while it
            // delivered, say): direct gets read what it did not.
            Ok(false) | Err(_) => {
                if let Err(e) = &streamed {
                    tracing::debug!(subject, error = %e, "streamed read failed; reading the rest by direct gets");
                }
                let next = out.last().map_or(after, |(seq, _)| *seq) + 1;
                self.read_direct(st, subject, next, None, &mut out).await?;
            }
        }
        Ok(out)
    }

    /// Direct gets of `subject` from stream seq `from` on, at most `limit` of them; true
    /// when the subject was read to its end.
    async fn read_direct(
        &self,
        st: &stream::Stream,
        subject: &str,
        from: u64,
        limit: Option<usize>,
        out: &mut Vec<(u64, Bytes)>,
    ) -> Result<bool> {
        let mut next = from;
        let mut n = 0;
        while limit.is_none_or(|l| n < l) {
            match st
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(subject)
                .send()
                .await
            {
                Ok(m) => {
                    next = m.sequence + 1;
                    out.push((m.sequence, m.payload));
                    n += 1;
                }
                Err(e) if matches!(e.kind(), stream::LastRawMessageErrorKind::NoMessageFound) => {
                    return Ok(true)
                }
                Err(e) => return Err(nats_err("read", e)),
            }
        }
        Ok(false)
    }

    /// Appends to `out` the messages of `subject` from stream seq `from` on, as they stand
    /// when the read starts, through an ephemeral consumer that needs no acks. False (and
    /// nothing read) when no consumer could be made in time.
    async fn read_subject_streamed(
        &self,
        st: &stream::Stream,
        subject: &str,
        from: u64,
        out: &mut Vec<(u64, Bytes)>,
    ) -> Result<bool> {
        let made = tokio::time::timeout(
            Duration::from_secs(2),
            st.create_consumer(consumer::pull::Config {
                filter_subject: subject.to_string(),
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                ack_policy: consumer::AckPolicy::None,
                inactive_threshold: Duration::from_secs(30),
                memory_storage: true,
                ..Default::default()
            }),
        )
        .await;
        let cons: consumer::PullConsumer = match made {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::debug!(subject, error = %e, "no read consumer; reading by direct gets");
                return Ok(false);
            }
            Err(_) => {
                tracing::debug!(subject, "no read consumer in time; reading by direct gets");
                return Ok(false);
            }
        };
        let name = cons.cached_info().name.clone();
        let mut left = cons.cached_info().num_pending;
        let res = async {
            while left > 0 {
                let mut batch = cons
                    .fetch()
                    .max_messages(left.min(2048) as usize)
                    .expires(Duration::from_secs(5))
                    .messages()
                    .await
                    .map_err(|e| nats_err("read", e))?;
                let mut got = 0;
                loop {
                    // A delivery that stops mid-way (its consumer's leader lost) is given
                    // up; the caller reads the rest by direct gets.
                    let next = tokio::time::timeout(Duration::from_secs(10), batch.next())
                        .await
                        .map_err(|_| {
                            Error::Backend(format!("read of {subject}: delivery stalled"))
                        })?;
                    let Some(m) = next else { break };
                    let m = m.map_err(|e| nats_err("read", e))?;
                    let sseq = m.info().map_err(|e| nats_err("read", e))?.stream_sequence;
                    out.push((sseq, m.payload.clone()));
                    got += 1;
                }
                if got == 0 {
                    return Err(Error::Backend(format!(
                        "read of {subject}: {left} messages announced but none delivered"
                    )));
                }
                left = left.saturating_sub(got);
            }
            Ok(true)
        }
        .await;
        // Done with it either way; the server drops it by itself if this is lost.
        let _ = st.delete_consumer(&name).await;
        res
    }
}

#[async_trait]
impl EventLog for NatsStore {
    async fn append(&self, session: &SessionId, expected_last: u64, record: &Record) -> Result<()> {
        let seq = expected_last + 1;
        if record.env.seq != seq || &record.env.session != session {
            return Err(Error::Corrupt(format!(
                "record {}#{} appended as {session}#{seq}",
                record.env.session, record.env.seq
            )));
        }
        let expected_sseq = if expected_last == 0 {
            0
        } else {
            match self.head(session) {
                Some((s, sseq)) if s == expected_last => sseq,
                _ => match self.last_with_seq(session).await? {
                    Some((r, sseq)) if r.env.seq == expected_last => sseq,
                    other => {
                        let actual = other.map(|(r, _)| r.env.seq).unwrap_or(0);
                        return Err(Error::Conflict {
                            session: session.to_string(),
                            expected: expected_last,
                            actual,
                        });
                    }
                },
            }
        };
        let mut h = HeaderMap::new();
        h.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected_sseq.to_string().as_str(),
        );
        h.insert(NATS_MESSAGE_ID, format!("{session}:{seq}").as_str());
        let res = async {
            self.js
                .publish_with_headers(
                    events_subject(session),
                    h,
                    Bytes::from(record.bytes.clone()),
                )
                .await?
                .await
        }
        .await;
        match res {
            Ok(ack) => {
                if ack.duplicate {
                    // Someone already wrote this seq: ours only if the bytes are the same.
                    let stored = self
                        .events
                        .get_raw_message(ack.sequence)
                        .await
                        .map_err(|e| nats_err("read dup", e))?;
                    if stored.payload.as_ref() != record.bytes.as_slice() {
                        self.heads
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(session);
                        return Err(Error::Conflict {
                            session: session.to_string(),
                            expected: expected_last,
                            actual: seq,
                        });
                    }
                }
                self.set_head(session, seq, ack.sequence);
                Ok(())
            }
            Err(e)
                if matches!(
                    e.kind(),
                    jetstream::context::PublishErrorKind::WrongLastSequence
                ) =>
            {
                self.heads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(session);
                let actual = self
                    .last_with_seq(session)
                    .await?
                    .map(|(r, _)| r.env.seq)
                    .unwrap_or(0);
                Err(Error::Conflict {
                    session: session.to_string(),
                    expected: expected_last,
                    actual,
                })
            }
            Err(e) => Err(nats_err("append", e)),
        }
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        // Start after the stream seq of the record before `from_seq` when we know it.
        let after = match self.head(session) {
            Some((s, sseq)) if s + 1 == from_seq => sseq,
            _ => 0,
        };
        let mut out = vec![];
        let mut last = None;
        for (sseq, payload) in self
            .read_subject(&self.events, &events_subject(session), after)
            .await?
        {
            let r = Record::decode(payload.to_vec()).map_err(|e| Error::Corrupt(e.to_string()))?;
            last = Some((r.env.seq, sseq));
            if r.env.seq >= from_seq {
                out.push(r);
            }
        }
        if let Some((s, sseq)) = last {
            self.set_head(session, s, sseq);
        }
        Ok(out)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        Ok(self.last_with_seq(session).await?.map(|(r, _)| r))
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for filter in [events_subject(root), format!("{}.>", events_subject(root))] {
            let mut info = self
                .events
                .info_with_subjects(filter)
                .await
                .map_err(|e| nats_err("tree", e))?;
            while let Some(item) = info.next().await {
                let (subject, _) = item.map_err(|e| nats_err("tree", e))?;
                if let Some(id) = subject.strip_prefix("skein.events.") {
                    out.push(SessionId::parse(id)?);
                }
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        let mut info = self
            .events
            .info_with_subjects("skein.events.*")
            .await
            .map_err(|e| nats_err("roots", e))?;
        while let Some(item) = info.next().await {
            let (subject, _) = item.map_err(|e| nats_err("roots", e))?;
            if let Some(id) = subject.strip_prefix("skein.events.") {
                out.push(SessionId::parse(id)?);
            }
        }
        out.sort();
        Ok(out)
    }
}

#[async_trait]
impl JobQueue for NatsStore {
    async fn push(&self, pool: &str, session: &SessionId) -> Result<()> {
        if self.publish_job(pool, session).await? {
            return Ok(());
        }
        // A job exists, pending or held: leave a wake marker, then try once more.
        self.wake
            .put(session.as_str(), Bytes::from_static(b"1"))
            .await
            .map_err(|e| nats_err("wake marker", e))?;
        self.publish_job(pool, session).await?;
        Ok(())
    }

    async fn claim(&self, pool: &str, wait: Duration) -> Result<Option<Job>> {
        let cons = self.consumer(pool).await?;
        let expires = wait.max(Duration::from_millis(10));
        let what = || format!("claim from consumer pool-{pool} of stream {JOBS}");
        // A pull whose consumer lost its leader may never be answered: it is given up
        // after its expiry and a grace period, and the consumer is looked up (or made)
        // again, so a worker never waits silently on a consumer that is gone.
        let pulled = tokio::time::timeout(expires + PULL_GRACE, async {
            let mut batch = cons
                .fetch()
                .max_messages(1)
                .expires(expires)
                .messages()
                .await?;
            Ok::<_, async_nats::Error>(batch.next().await)
        })
        .await;
        let next = match pulled {
            Err(_) => {
                self.forget_consumer(pool).await;
                return Err(Error::Backend(format!(
                    "nats: {}: no answer within {:?}",
                    what(),
                    expires + PULL_GRACE
                )));
            }
            Ok(Err(e)) => {
                self.forget_consumer(pool).await;
                return Err(nats_err(&what(), e));
            }
            Ok(Ok(next)) => next,
        };
        let msg = match next {
            None => return Ok(None),
            Some(Ok(m)) => m,
            // Too many pull requests open at once: back-pressure, not a fault.
            Some(Err(e)) if e.to_string().contains("Exceeded MaxWaiting") => {
                tokio::time::sleep(wait.min(Duration::from_millis(100))).await;
                return Ok(None);
            }
            Some(Err(e)) => {
                self.forget_consumer(pool).await;
                return Err(nats_err(&what(), e));
            }
        };
        let (attempt, sseq) = {
            let info = msg.info().map_err(|e| nats_err("job info", e))?;
            (info.delivered.max(1) as u32, info.stream_sequence)
        };
        let prefix = format!("skein.jobs.{pool}.");
        let Some(id) = msg
            .subject
            .as_str()
            .strip_prefix(&prefix)
            .map(str::to_string)
        else {
            return Err(Error::Corrupt(format!("job on subject {}", msg.subject)));
        };
        let session = SessionId::parse(&id)?;
        tracing::trace!(%session, attempt, "job claimed");
        let (_, acker) = msg.split();
        let handle = format!("{sseq}:{attempt}");
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle.clone(), Arc::new(acker));
        Ok(Some(Job {
            pool: pool.into(),
            session,
            attempt,
            handle,
        }))
    }

    async fn heartbeat(&self, job: &Job) -> Result<()> {
        let acker = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&job.handle)
            .cloned();
        if let Some(a) = acker {
            a.ack_with(jetstream::AckKind::Progress)
                .await
                .map_err(|e| nats_err("heartbeat", e))?;
        }
        Ok(())
    }

    async fn ack(&self, job: &Job) -> Result<()> {
        let acker = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&job.handle);
        // The job's message is deleted through the stream (every replica applies the
        // delete in the same order as the publishes it gates), then acked. A holder that
        // dies in between leaves an acked delivery of a deleted message: nothing to redo.
        let deleted = match job
            .handle
            .split_once(':')
            .map(|(seq, _)| seq.parse::<u64>())
        {
            Some(Ok(sseq)) => match self.jobs_stream.delete_message(sseq).await {
                Ok(_) => Ok(()),
                Err(e) if e.to_string().contains("no message found") => Ok(()),
                Err(e) => Err(nats_err(&format!("delete job from stream {JOBS}"), e)),
            },
            _ => Err(Error::Corrupt(format!("job handle {}", job.handle))),
        };
        let acked = match (deleted, acker) {
            (Err(e), Some(a)) => {
                // Held again: the delivery runs out and comes back.
                self.held
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(job.handle.clone(), a);
                return Err(e);
            }
            (Err(e), None) => return Err(e),
            (Ok(()), Some(a)) => a.ack().await.map_err(|e| nats_err("ack", e)),
            (Ok(()), None) => Ok(()),
        };
        tracing::trace!(session = %job.session, ok = acked.is_ok(), "job acked");
        // A push that found this job held left a marker: run the session once more. When
        // the marker cannot be read (or the ack's outcome is unknown) push anyway: an extra
        // wake-up costs one idle step, a lost one strands a session.
        match self.wake.get(job.session.as_str()).await {
            Ok(None) if acked.is_ok() => {}
            Ok(Some(_)) => {
                let _ = self.wake.delete(job.session.as_str()).await;
                self.publish_job(&job.pool, &job.session).await?;
            }
            _ => {
                self.publish_job(&job.pool, &job.session).await?;
            }
        }
        acked
    }

    async fn retry(&self, job: &Job, delay: Duration) -> Result<()> {
        let acker = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&job.handle);
        if let Some(a) = acker {
            // No delay: delivered again at once (a draining worker hands its job on).
            let delay = (!delay.is_zero()).then_some(delay);
            a.ack_with(jetstream::AckKind::Nak(delay))
                .await
                .map_err(|e| nats_err("nak", e))?;
        }
        Ok(())
    }

    async fn depth(&self, pool: &str) -> Result<u64> {
        let mut cons = self.consumer(pool).await?;
        let info = cons
            .info()
            .await
            .map_err(|e| nats_err("consumer info", e))?;
        Ok(info.num_pending + info.num_ack_pending as u64)
    }
}

#[async_trait]
impl Cache for NatsStore {
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>> {
        let Some(v) = self
            .cache
            .get(hash)
            .await
            .map_err(|e| nats_err("cache get", e))?
        else {
            return Ok(None);
        };
        let e: CacheEntry =
            serde_json::from_slice(&v).map_err(|e| Error::Corrupt(e.to_string()))?;
        Ok(if e.expires.is_some_and(|x| x <= now) {
            None
        } else {
            Some(e)
        })
    }

    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()> {
        let v = serde_json::to_vec(entry).map_err(|e| Error::Corrupt(e.to_string()))?;
        self.cache
            .put(hash, v.into())
            .await
            .map_err(|e| nats_err("cache put", e))?;
        Ok(())
    }

    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>> {
        for _ in 0..3 {
            match self
                .inflight
                .create(hash, Bytes::from(session.to_string()))
                .await
            {
                Ok(_) => return Ok(None),
                Err(e) if matches!(e.kind(), kv::CreateErrorKind::AlreadyExists) => {
                    match self
                        .inflight
                        .get(hash)
                        .await
                        .map_err(|e| nats_err("inflight", e))?
                    {
                        Some(v) => {
                            let holder = SessionId::parse(&String::from_utf8_lossy(&v))?;
                            return Ok((&holder != session).then_some(holder));
                        }
                        // Released in between (or a lagging replica): try again.
                        None => continue,
                    }
                }
                Err(e) => return Err(nats_err("inflight", e)),
            }
        }
        // Could not tell who holds it: run our own (a duplicate run, never a stuck one).
        Ok(None)
    }

    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()> {
        if let Some(e) = self
            .inflight
            .entry(hash)
            .await
            .map_err(|e| nats_err("inflight", e))?
        {
            if e.operation == kv::Operation::Put && e.value.as_ref() == session.as_str().as_bytes()
            {
                let _ = self
                    .inflight
                    .delete_expect_revision(hash, Some(e.revision))
                    .await;
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Blobs for NatsStore {
    async fn put(&self, data: &[u8]) -> Result<String> {
        let hash = blake3::hash(data).to_hex().to_string();
        if self.blobs.info(&hash).await.is_ok() {
            return Ok(hash);
        }
        // As for reads: a cluster that lost a node answers "no responders" for a moment.
        let mut tries = 0;
        loop {
            let mut r = data;
            match self.blobs.put(hash.as_str(), &mut r).await {
                Ok(_) => return Ok(hash),
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
                Err(_) => Err(Error::Backend(
                    "nats: blob read: no progress for 10 s".into(),
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
        self.read_subject(&self.notices, &subject, after)
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
        for (_, p) in self.read_subject(&self.notices, &subject, 0).await? {
            let v: serde_json::Value =
                serde_json::from_slice(&p).map_err(|e| Error::Corrupt(e.to_string()))?;
            let w = SessionId::parse(v["watcher"].as_str().unwrap_or_default())?;
            let pool = v["pool"].as_str().unwrap_or("default").to_string();
            if !out.iter().any(|(x, _)| *x == w) {
                out.push((w, pool));
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl Announcer for NatsStore {
    async fn root_finished(&self, notice: &RootResult) -> Result<()> {
        let body = serde_json::to_vec(notice).map_err(|e| Error::Corrupt(e.to_string()))?;
        self.client
            .publish_with_headers(
                format!("skein.results.{}", notice.session),
                trace_headers(),
                body.into(),
            )
            .await
            .map_err(|e| nats_err("result", e))?;
        self.client
            .flush()
            .await
            .map_err(|e| nats_err("flush", e))?;
        Ok(())
    }
}

impl Workspaces for NatsStore {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace> {
        if let Some(dir) = &self.cfg.workspace_dir {
            return Arc::new(skein_tools::workspace::LocalWorkspace::new(
                dir.join(root.as_str()),
            ));
        }
        Arc::new(ObjectWorkspace {
            store: self.workspace.clone(),
            root: root.to_string(),
        })
    }
}

/// A tree's workspace in the object store: objects named `<root>/<path>`, so a file one
/// worker writes is there for every other.
pub struct ObjectWorkspace {
    store: object_store::ObjectStore,
    root: String,
}

/// Normalises a workspace path, refusing anything that could name another tree's files.
pub fn clean_path(path: &str) -> std::result::Result<String, ToolError> {
    if path.starts_with('/') || path.contains('\\') {
        return Err(ToolError::Refused(format!(
            "`{path}`: absolute paths are refused"
        )));
    }
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(ToolError::Refused(format!("`{path}`: `..` is refused"))),
            s => parts.push(s),
        }
    }
    Ok(parts.join("/"))
}

#[async_trait]
impl Workspace for ObjectWorkspace {
    async fn read(&self, path: &str) -> std::result::Result<Vec<u8>, ToolError> {
        let p = clean_path(path)?;
        let mut obj = self
            .store
            .get(format!("{}/{p}", self.root))
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        let mut out = vec![];
        obj.read_to_end(&mut out)
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?;
        Ok(out)
    }

    async fn write(&self, path: &str, data: &[u8]) -> std::result::Result<(), ToolError> {
        let p = clean_path(path)?;
        if p.is_empty() {
            return Err(ToolError::Refused("a file needs a name".into()));
        }
        let mut r = data;
        self.store
            .put(format!("{}/{p}", self.root).as_str(), &mut r)
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        Ok(())
    }

    async fn list(&self, path: &str) -> std::result::Result<Vec<DirEntry>, ToolError> {
        let p = clean_path(path)?;
        let prefix = if p.is_empty() {
            format!("{}/", self.root)
        } else {
            format!("{}/{p}/", self.root)
        };
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?;
        let mut out: Vec<DirEntry> = vec![];
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| ToolError::Failed(e.to_string()))?;
            if info.deleted {
                continue;
            }
            let Some(rest) = info.name.strip_prefix(&prefix) else {
                continue;
            };
            let (name, is_dir) = match rest.split_once('/') {
                Some((d, _)) => (d.to_string(), true),
                None => (rest.to_string(), false),
            };
            if !out.iter().any(|e| e.name == name) {
                out.push(DirEntry {
                    name,
                    is_dir,
                    size: if is_dir { 0 } else { info.size as u64 },
                });
            }
        }
        out.sort();
        Ok(out)
    }

    /// One pass over the object list (the default lists directory by directory).
    async fn usage(&self, path: &str) -> std::result::Result<Usage, ToolError> {
        let target = format!("{}/{}", self.root, clean_path(path)?);
        let prefix = format!("{}/", self.root);
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?;
        let mut u = Usage::default();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| ToolError::Failed(e.to_string()))?;
            if info.deleted || !info.name.starts_with(&prefix) {
                continue;
            }
            u.total = u.total.saturating_add(info.size as u64);
            if info.name == target {
                u.of_path = info.size as u64;
            }
        }
        Ok(u)
    }
}
