//! The streams and buckets, created when missing; existing ones are left alone, but for
//! one upgrade: a job stream of an earlier version is brought to the current settings.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{kv, stream, Context};
use skein_ports::{Error, Result};

use super::results::RESULTS;
use super::{age, nats_err, storage};
use crate::config::NatsConfig;

pub const EVENTS: &str = "SKEIN_EVENTS";
pub const JOBS: &str = "SKEIN_JOBS";
pub const NOTICES: &str = "SKEIN_NOTICES";
pub const MISSIONS: &str = "SKEIN_MISSIONS";
/// The start of every root, in the order they were submitted (`roots.rs`).
pub const ROOTS: &str = "SKEIN_ROOTS";
/// The latest summary of each root (`roots.rs`).
pub const ROOT_STATE: &str = "SKEIN_ROOT_STATE";
/// A mark for each open root, and the index's format (`roots.rs`).
pub const ROOT_OPEN: &str = "SKEIN_ROOT_OPEN";
/// Packed blocks of `SKEIN_ROOTS` and `SKEIN_ROOT_STATE` (`root_blocks.rs`).
pub const ROOT_BLOCKS: &str = "SKEIN_ROOT_BLOCKS";

/// The configuration of every stream and bucket skein uses, in the order they are made.
fn wanted(cfg: &NatsConfig) -> Vec<stream::Config> {
    let st = storage(cfg);
    let r = cfg.replicas.max(1);
    let mut streams = Vec::new();
    streams.push(stream::Config {
        name: EVENTS.into(),
        subjects: vec!["skein.events.>".into()],
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        allow_direct: true,
        duplicate_window: age(&cfg.duplicate_window),
        max_age: age(&cfg.events_max_age),
        // Appends may come in atomic batches (`group.rs`). A server before 2.12 does not
        // know the flag and leaves it out of the stream's configuration, which is how a
        // writer tells it takes no batches.
        allow_atomic_publish: true,
        ..Default::default()
    });
    // The index of roots (see `roots.rs`): one start message per root, in the order
    // roots were submitted, and the latest summary and open mark of each. Derived from
    // `SKEIN_EVENTS`, aging out with it.
    for (name, subjects) in [
        (ROOTS, vec!["skein.roots.*".to_string()]),
        (ROOT_STATE, vec!["skein.rootstate.*".to_string()]),
        // A small stream: listing its subjects costs the open roots, and the format mark
        // is found without a walk back through every summary.
        (
            ROOT_OPEN,
            vec![
                "skein.rootopen.*".to_string(),
                "skein.rootindex".to_string(),
            ],
        ),
        // Made again from the two above when missing (an older store's included).
        (ROOT_BLOCKS, vec!["skein.rootblock.>".to_string()]),
    ] {
        streams.push(stream::Config {
            name: name.into(),
            subjects,
            retention: stream::RetentionPolicy::Limits,
            max_messages_per_subject: 1,
            storage: st,
            num_replicas: r,
            allow_direct: true,
            max_age: age(&cfg.events_max_age),
            ..Default::default()
        });
    }
    // Each tree's list of sessions (`trees.rs`): read by its one subject, so a tree is
    // listed at the same cost whatever the history. Derived from `SKEIN_EVENTS`.
    streams.push(stream::Config {
        name: super::TREES.into(),
        subjects: vec!["skein.tree.*".into(), super::trees::SINCE_SUBJECT.into()],
        allow_rollup: true,
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        allow_direct: true,
        max_age: age(&cfg.events_max_age),
        ..Default::default()
    });
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
        // The first jobs of a wide turn's children may come in atomic batches (`group.rs`).
        allow_atomic_publish: true,
        ..Default::default()
    };
    streams.push(jobs);
    streams.push(stream::Config {
        name: NOTICES.into(),
        subjects: vec!["skein.notices.>".into(), "skein.watch.>".into()],
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        allow_direct: true,
        // Wake-ups matter only while their logs exist: they age out with them.
        max_age: age(&cfg.events_max_age),
        // Notices may come in atomic batches too (`group.rs`).
        allow_atomic_publish: true,
        ..Default::default()
    });
    streams.push(stream::Config {
        name: MISSIONS.into(),
        subjects: vec!["skein.missions.submit".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: st,
        num_replicas: r,
        duplicate_window: age(&cfg.duplicate_window),
        ..Default::default()
    });
    // Each ending of a tree, stored once and republished by the stream's leader on
    // `skein.results.<root>` (see `results.rs`); kept as long as the logs. The duplicate
    // window drops a retried announcement; past it, the announcement's expected last
    // subject sequence does.
    streams.push(stream::Config {
        name: RESULTS.into(),
        subjects: vec!["skein.ended.*".into()],
        retention: stream::RetentionPolicy::Limits,
        storage: st,
        num_replicas: r,
        allow_direct: true,
        duplicate_window: age(&cfg.duplicate_window),
        max_age: age(&cfg.events_max_age),
        republish: Some(stream::Republish {
            source: "skein.ended.*".into(),
            destination: "skein.results.{{wildcard(1)}}".into(),
            headers_only: false,
        }),
        ..Default::default()
    });
    for (bucket, max_age) in [
        ("skein_cache", age(&cfg.cache_max_age)),
        ("skein_inflight", age(&cfg.inflight_max_age)),
        ("skein_wake", Duration::ZERO),
        // Pushed definitions versions and the current one: kept for ever.
        ("skein_defs", Duration::ZERO),
        // Live workers: an entry not written again ages out.
        (
            "skein_workers",
            Duration::from_secs(super::workers::WORKER_TTL_SECS),
        ),
    ] {
        // The KV layout made by hand: the client's bucket creation asks for account
        // details that servers before 2.10 answer in a form it cannot read.
        let dup = if max_age > Duration::ZERO {
            max_age.min(Duration::from_secs(120))
        } else {
            Duration::from_secs(120)
        };
        streams.push(stream::Config {
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
        });
    }
    // Object stores as the client would make them, but without direct reads: reads go to
    // the stream leader, so a lagging replica can never answer "absent".
    for bucket in ["skein_blobs", "skein_workspace"] {
        streams.push(stream::Config {
            name: format!("OBJ_{bucket}"),
            subjects: vec![format!("$O.{bucket}.C.>"), format!("$O.{bucket}.M.>")],
            storage: st,
            num_replicas: r,
            discard: stream::DiscardPolicy::New,
            allow_rollup: true,
            allow_direct: false,
            ..Default::default()
        });
    }
    streams
}

/// Every stream skein uses, by name, as found or made by [`ensure_topology`], each holding
/// the info read then.
pub struct Topology {
    streams: HashMap<String, stream::Stream>,
}

impl Topology {
    /// The stream `name`, holding its info.
    pub fn stream(&self, name: &str) -> Result<stream::Stream> {
        self.streams
            .get(name)
            .cloned()
            .ok_or_else(|| Error::unavailable_because(format!("nats: no stream {name}")))
    }

    /// The KV bucket `bucket`, opened as the client opens one (its stream `KV_<bucket>`,
    /// keys under `$KV.<bucket>.`) without asking for the stream's info again. skein's
    /// buckets are made by [`ensure_topology`], never as mirrors, and its JetStream context
    /// has the default API prefix.
    pub fn kv(&self, bucket: &str) -> Result<kv::Store> {
        let stream_name = format!("KV_{bucket}");
        let stream = self.stream(&stream_name)?;
        if stream.cached_info().config.max_messages_per_subject < 1 {
            return Err(Error::unavailable_because(format!(
                "nats: stream {stream_name} is not a KV bucket (it keeps more than one \
                 message per key)"
            )));
        }
        Ok(kv::Store {
            name: bucket.to_string(),
            prefix: format!("$KV.{bucket}."),
            stream_name,
            stream,
            put_prefix: None,
            use_jetstream_prefix: false,
        })
    }
}

/// Creates every missing stream and bucket; existing ones are left alone. Idempotent.
///
/// Every stream's info is asked for at once, so that a command's start waits about one
/// round trip for them rather than one per stream (there are seventeen).
pub async fn ensure_topology(js: &Context, cfg: &NatsConfig) -> Result<Topology> {
    let wanted = wanted(cfg);
    let jobs = wanted.iter().find(|c| c.name == JOBS).cloned();
    let found =
        futures::future::join_all(wanted.iter().map(|c| js.get_stream(c.name.as_str()))).await;
    let mut fresh_index = false;
    let mut streams = HashMap::with_capacity(wanted.len());
    for (c, found) in wanted.into_iter().zip(found) {
        let s = match found {
            // Existing streams are left as they are: an operator may have tuned them, and
            // a read-only command must never rescale a cluster's streams.
            Ok(s) => s,
            Err(_) => {
                fresh_index |= c.name == ROOT_OPEN;
                js.create_stream(c.clone())
                    .await
                    .map_err(|e| nats_err(&c.name, e))?
            }
        };
        streams.insert(c.name.clone(), s);
    }
    // The index of roots was just made: marked built when there is nothing to build it
    // from (see `roots.rs`).
    if fresh_index {
        super::roots::mark_built_if_empty(js).await?;
    }
    let mut topology = Topology { streams };
    if let Some(jobs) = jobs {
        upgrade_jobs_stream(js, &mut topology, jobs).await;
    }
    Ok(topology)
}

/// Earlier versions made `SKEIN_JOBS` refuse a second message per subject in the stream
/// itself (`max_messages_per_subject: 1` with `discard_new_per_subject`). A replica that
/// restarts on servers before 2.10 cannot catch up on such a stream ("maximum messages per
/// subject exceeded", retried for ever), and the stream stops answering. The limit now
/// travels on each job's publish instead (see [`NatsStore::publish_job`]); a stream made
/// the old way is brought to the new settings here, once.
async fn upgrade_jobs_stream(js: &Context, topology: &mut Topology, want: stream::Config) {
    let Some(s) = topology.streams.get(JOBS) else {
        return;
    };
    let have = &s.cached_info().config;
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
        Ok(_) => {
            tracing::info!(
                stream = JOBS,
                "job stream updated: one job per session is now enforced on publish, not by \
                 a per-subject limit (which replicas of servers before 2.11 cannot catch up on)"
            );
            // The handle's info is read again for its new settings; kept as found if not.
            if let Ok(s) = js.get_stream(JOBS).await {
                topology.streams.insert(JOBS.to_string(), s);
            }
        }
        Err(e) => tracing::warn!(stream = JOBS, error = %e,
            "job stream keeps its per-subject limit; a replica of a server before 2.11 may \
             fail to catch up on it after a restart"),
    }
}
