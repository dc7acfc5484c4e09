//! The runtime: one worker process's configuration, its backend, agents, models and
//! tools, and the channels that report what it does. What it does with them is in
//! [`crate::worker`] (one file per step kind), [`crate::session`] (the fold cache and
//! appends) and [`crate::work_loop`] (claiming jobs).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use skein_core::{AgentSet, Limits, SessionId, Status};
use skein_llm::Registry;
use skein_tools::ToolBox;
use tokio::sync::broadcast;

use crate::ports::Backend;
use crate::session::FoldCache;

/// The pool of agents that name none.
pub const DEFAULT_POOL: &str = skein_core::event::DEFAULT_POOL;
/// Longest mission text accepted.
pub use skein_core::limits::MAX_MISSION_BYTES;

#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Recorded in `ModelCalled` and `ToolCalled`.
    pub worker_id: String,
    pub limits: Limits,
    /// How long a claimed job is held without a heartbeat.
    pub lease: Duration,
    /// Deliveries of one job before its session is failed as dead-lettered.
    pub max_deliver: u32,
    /// Tool outputs longer than this go to the blob store; the event keeps a preview.
    pub blob_threshold: usize,
    /// Cache entries live this long unless an agent says otherwise; none: forever.
    pub cache_ttl: Option<Duration>,
    /// Folded states kept in memory.
    pub state_cache: usize,
    /// The first batch of a wide turn's delegations, each next batch twice as large, up
    /// to 128: the children of a batch start while the next one is made. 0: a turn's
    /// delegations are recorded in one batch, as a team's always are (its participants
    /// must all exist before any of them starts).
    pub delegation_batch: usize,
    /// Signs resume tokens.
    pub token_secret: crate::secret::Secret,
    /// The wall clock and the draws of chance (a simulation's are virtual and seeded).
    pub clock: std::sync::Arc<dyn crate::clock::Clock>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            worker_id: default_worker_id(),
            limits: Limits::default(),
            lease: Duration::from_secs(30),
            max_deliver: 5,
            blob_threshold: 64 * 1024,
            cache_ttl: Some(Duration::from_secs(24 * 3600)),
            state_cache: 10_000,
            delegation_batch: 0,
            token_secret: crate::secret::Secret(crate::secret::new_token_id().into_bytes()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
        }
    }
}

pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into());
    format!("{host}-{}", std::process::id())
}

/// One line of live progress.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub session: SessionId,
    pub seq: u64,
    pub kind: String,
    pub status: Status,
    pub steps: u32,
    /// What a line of kind [`TOOL_PROGRESS`] says: the tool and how far its call has got
    /// (`fs__copy 3/10 copying`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The kind of a [`Progress`] line that tells how far a running tool call has got (an
/// MCP server's progress notifications). Such lines are never recorded: the model does
/// not read them, so a replay is the same without them.
pub const TOOL_PROGRESS: &str = "tool_progress";

/// A piece of a model answer's text as it arrives from the provider. Deltas are
/// ephemeral and best-effort: never recorded, dropped when nobody listens or a listener
/// lags. The answer itself is recorded whole, as one `ModelCalled`, when it is complete.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct TextDelta {
    pub session: SessionId,
    /// The seq the answer will be recorded at, if it completes.
    pub seq: u64,
    /// Which try of this model turn (a failed try's text is void; the next try starts
    /// again from nothing).
    pub attempt: u32,
    pub text: String,
}

pub struct Runtime {
    pub backend: Backend,
    /// The worker's own agent files (what a tree pinned to no pushed version runs on).
    pub agents: Arc<AgentSet>,
    pub models: Registry,
    pub tools: ToolBox,
    pub cfg: RuntimeConfig,
    /// The versions of definitions in force (see [`crate::defs`]).
    pub(crate) defs: crate::defs::Catalogue,
    /// Other workers, and what this one handed back to them (see [`crate::defs::Peers`]).
    pub(crate) lacks: crate::defs::Lacks,
    /// The record format this worker writes (see [`Runtime::set_write_format`]).
    pub(crate) write_format: std::sync::atomic::AtomicU16,
    /// The secrets (provider keys, the token secret) no recorded event may hold.
    pub(crate) scrubber: crate::scrub::Scrubber,
    /// Shared by the work loops: claim health, the drain switch, held jobs.
    pub loops: crate::work_loop::Loops,
    /// The folds and definitions kept between jobs (see [`crate::session`]).
    pub(crate) sessions: FoldCache,
    pub(crate) progress: Broadcast<Progress>,
    pub(crate) text: Broadcast<TextDelta>,
    /// What [`Runtime::run_tree`] waits on: the session of every terminal record this
    /// runtime appends, and a count of all the records it appends. Waiting on
    /// [`Runtime::subscribe`] instead would wake the waiting thread for every record.
    pub(crate) ends: Broadcast<SessionId>,
    pub(crate) appended: std::sync::atomic::AtomicU64,
    /// What the cache key's shape of a delegation reads again and again, worked out once:
    /// the digest of `[limits]`, and the agents each agent may start.
    pub(crate) shape_memo: ShapeMemo,
    /// Waiting parents this process will look at again (see `Runtime::recheck_later`).
    pub(crate) rechecks: Arc<std::sync::Mutex<std::collections::HashSet<SessionId>>>,
    /// Model quotas shared with the other workers (see `crate::quota`).
    pub(crate) quota: std::sync::OnceLock<Arc<dyn skein_ports::quota::Quota>>,
    /// Sessions this process told to wait for quota, by id.
    pub(crate) quota_waits:
        Mutex<std::collections::BTreeMap<String, skein_ports::quota::QuotaWaiter>>,
    /// Sessions whose step in the job under way was told to wait for quota.
    pub(crate) quota_pending: Mutex<std::collections::HashSet<String>>,
}

/// See [`Runtime::shape_memo`]. A version of the definitions never changes: what each
/// agent may start is kept per version and agent.
#[derive(Default)]
pub(crate) struct ShapeMemo {
    pub(crate) reachable: Mutex<std::collections::HashMap<String, Arc<Reach>>>,
}

/// What an agent of a version may start, directly or through the sessions it starts, and
/// the digest of their definitions ([`skein_core::hash::RunShape::reach`]).
pub(crate) struct Reach {
    pub(crate) agents: std::collections::BTreeSet<String>,
    pub(crate) digest: Option<String>,
}

/// A broadcast channel made when it is first subscribed to. Nothing is sent while nobody
/// has subscribed, as a channel without receivers drops what it is sent. Making the
/// channel up front writes each of its thousands of slots, which a short command would
/// pay for at every start (docs/perf.md), and most runtimes never subscribe to one.
pub(crate) struct Broadcast<T> {
    capacity: usize,
    tx: std::sync::OnceLock<broadcast::Sender<T>>,
}

impl<T: Clone> Broadcast<T> {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            tx: std::sync::OnceLock::new(),
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<T> {
        self.tx
            .get_or_init(|| broadcast::channel(self.capacity).0)
            .subscribe()
    }

    /// A sender, when someone has subscribed.
    pub(crate) fn sender(&self) -> Option<broadcast::Sender<T>> {
        self.tx.get().filter(|tx| tx.receiver_count() > 0).cloned()
    }

    pub(crate) fn receiver_count(&self) -> usize {
        self.tx.get().map_or(0, |tx| tx.receiver_count())
    }

    /// Sends to whoever listens now; with nobody listening, `value` is dropped.
    pub(crate) fn send(&self, value: T) {
        if let Some(tx) = self.tx.get() {
            let _ = tx.send(value);
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Runtime {
    pub fn new(
        backend: Backend,
        agents: Arc<AgentSet>,
        models: Registry,
        tools: ToolBox,
        mut cfg: RuntimeConfig,
    ) -> Arc<Self> {
        // A tool that asks for a person's approval gets it whatever `[limits]` says.
        for name in tools.names() {
            if tools.requires_approval(&name) && !cfg.limits.approval_required.contains(&name) {
                cfg.limits.approval_required.push(name);
            }
        }
        let mut secrets = models.known_secrets();
        if let Ok(t) = std::str::from_utf8(&cfg.token_secret.0) {
            secrets.push(t.to_string());
        }
        // The backend's shared quotas, else this process's own.
        let quota = std::sync::OnceLock::new();
        let _ = quota.set(backend.quota.clone().unwrap_or_else(|| {
            Arc::new(skein_ports::quota::LocalQuota::new()) as Arc<dyn skein_ports::quota::Quota>
        }));
        Arc::new(Self {
            scrubber: crate::scrub::Scrubber::new(secrets),
            backend,
            defs: crate::defs::Catalogue::new(agents.clone(), models.clone(), cfg.limits.clone()),
            lacks: Default::default(),
            write_format: skein_core::event::ENVELOPE_VERSION.into(),
            agents,
            models,
            tools,
            cfg,
            loops: Default::default(),
            sessions: FoldCache::default(),
            progress: Broadcast::new(4096),
            text: Broadcast::new(4096),
            ends: Broadcast::new(1024),
            appended: Default::default(),
            rechecks: Default::default(),
            shape_memo: Default::default(),
            quota,
            quota_waits: Default::default(),
            quota_pending: Default::default(),
        })
    }

    /// Live progress of every session this runtime advances.
    pub fn subscribe(&self) -> broadcast::Receiver<Progress> {
        self.progress.subscribe()
    }

    /// Model answers' text while it arrives, for every session this runtime advances
    /// (see [`TextDelta`]).
    pub fn subscribe_text(&self) -> broadcast::Receiver<TextDelta> {
        self.text.subscribe()
    }

    /// The record format this worker writes: the first one, until it is told that every
    /// live worker reads a newer one.
    pub fn write_format(&self) -> u16 {
        self.write_format.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Writes format `v` from now on (never one this process does not read itself): the
    /// newest format every live worker reads. Returns whether it changed.
    pub fn set_write_format(&self, v: u16) -> bool {
        let v = v.clamp(
            skein_core::event::ENVELOPE_VERSION,
            skein_core::event::read_format(),
        );
        self.write_format
            .swap(v, std::sync::atomic::Ordering::Relaxed)
            != v
    }

    /// Writes the newest record format every live worker reads: `reads`, what each live
    /// worker says it reads (this one's own counted too). A worker of an earlier release
    /// that appears brings the format back to the one it reads. Returns whether it changed.
    pub fn agree_on_format(&self, reads: impl IntoIterator<Item = u16>) -> bool {
        let me = skein_core::event::read_format();
        let all = reads.into_iter().chain([me]).min().unwrap_or(me);
        self.set_write_format(all)
    }

    /// Every pool the catalogue's agents use.
    pub fn pools(&self) -> Vec<String> {
        let mut p: BTreeSet<String> = [DEFAULT_POOL.to_string()].into();
        p.extend(
            self.agents
                .agents
                .values()
                .filter_map(|d| d.front.pool.clone()),
        );
        p.into_iter().collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::Broadcast;

    #[test]
    fn a_broadcast_is_made_by_its_first_subscriber_and_drops_what_nobody_hears() {
        let b = Broadcast::new(4);
        assert_eq!(b.receiver_count(), 0);
        b.send(1);
        assert!(b.tx.get().is_none(), "a send alone made the channel");
        let mut first = b.subscribe();
        let mut second = b.subscribe();
        assert_eq!(b.receiver_count(), 2);
        b.send(2);
        b.send(3);
        for rx in [&mut first, &mut second] {
            assert_eq!(
                rx.try_recv().unwrap(),
                2,
                "the send before any subscriber was dropped"
            );
            assert_eq!(rx.try_recv().unwrap(), 3);
            assert!(rx.try_recv().is_err());
        }
        drop((first, second));
        assert_eq!(b.receiver_count(), 0);
        b.send(4);
        let mut late = b.subscribe();
        assert!(
            late.try_recv().is_err(),
            "a late subscriber hears only what follows"
        );
    }
}
