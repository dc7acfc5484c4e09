//! The ports: what the worker loop needs from a backend. The embedded backend (crate
//! `skein-sled`) and the JetStream backend (crate `skein-nats`) implement them; nothing
//! above these traits knows which one it has.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use skein_core::{Record, SessionId, Usage};

use crate::roots::{Cursor, RootFilter, RootSummary, RootsPage};
use crate::workspace::Workspace;
use crate::{Error, Result};

/// How durable an append's records are when [`EventLog::append`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Durable. A backend may make a batch atomic and durable with one flush, or append
    /// its records one by one (after a crash, a prefix may then be in the log).
    Now,
    /// For records that an append made after this one returns will make durable with its
    /// own: what a crash leaves is then either neither, these alone, or both. A backend
    /// whose log is one file written in order (whatever survives a crash is a prefix of
    /// what was written) returns once they are written; any other waits for them, as
    /// [`Durability::Now`] does. A read sees them at once either way.
    Ahead,
    /// For records of the session that the session's next append covers: the caller goes
    /// on (calls a model) while they become durable, and acts on them only through that
    /// append. A backend may return before they are durable, if the session's next
    /// append, read, or the ack of its job first makes sure of them and fails if they
    /// failed, and if at most one such batch of a session is unsure at a time (so a crash
    /// loses at most these and the work since). Otherwise it waits, as
    /// [`Durability::Now`] does.
    Pipelined,
}

/// The durable log of every session.
#[async_trait]
pub trait EventLog: Send + Sync {
    /// Appends consecutive records of one session whose seqs follow `expected_last`, if
    /// and only if the session's last seq is `expected_last` (0: the session has no
    /// records). Otherwise fails with [`Error::Conflict`] and changes nothing. Returns
    /// when the records are as durable as `durability` asks. No records: nothing to do.
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()>;

    /// Records with seq ≥ `from_seq`, in order.
    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>>;

    /// The last record, if any.
    async fn last(&self, session: &SessionId) -> Result<Option<Record>>;

    /// Every session of the tree rooted at `root` that has records (the root included),
    /// sorted. It may also name a session that has none: a backend that writes a tree's
    /// list of sessions ahead of their first records (NATS) keeps a name whose record
    /// was never written (its writer stopped between the two). Callers pass over a
    /// session whose log is empty.
    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>>;

    /// The whole logs of `ids` (sessions of the tree of `root`, as [`EventLog::tree`]
    /// names them), in that order, each as [`EventLog::read`] from seq 1 would give it, read
    /// together where that costs less than a read of each (on NATS, one pass over the
    /// tree's part of the stream). `None`: this backend has no such read for these
    /// sessions, and the caller reads each log.
    async fn read_tree(
        &self,
        root: &SessionId,
        ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>>;

    /// Every root session, sorted.
    async fn roots(&self) -> Result<Vec<SessionId>>;

    /// One page of root summaries that pass `filter`, newest first, at most `limit`, from
    /// after `cursor` (the `next` of the page before). This default reads and folds every
    /// root's log, so its cost grows with history; a backend with an index of roots
    /// overrides it.
    async fn roots_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage> {
        let cursor = cursor.map(Cursor::parse).transpose()?;
        let mut all = vec![];
        for id in self.roots().await? {
            let records = self.read(&id, 1).await?;
            all.extend(RootSummary::of(&id, &records));
        }
        all.sort_by_key(|s| std::cmp::Reverse(s.position()));
        crate::roots::page(all.into_iter().map(Ok), filter, limit, cursor.as_ref())
    }

    /// Every root whose last record is not terminal (its tree is in flight or waits for a
    /// person), sorted. This default reads the last record of every root; a backend with
    /// an index of roots overrides it, so that the cost follows the open trees.
    async fn open_roots(&self) -> Result<Vec<SessionId>> {
        let mut open = vec![];
        for root in self.roots().await? {
            if self
                .last(&root)
                .await?
                .is_some_and(|r| !r.env.body.is_terminal())
            {
                open.push(root);
            }
        }
        Ok(open)
    }
}

/// Refuses records that are not the session's next ones after `expected_last`, in order
/// (a caller's bug, which no backend should write).
pub fn check_numbering(session: &SessionId, expected_last: u64, records: &[Record]) -> Result<()> {
    for (i, r) in records.iter().enumerate() {
        let seq = expected_last + 1 + i as u64;
        if r.env.seq != seq || &r.env.session != session {
            return Err(Error::corrupt_because(format!(
                "record {}#{} appended as {session}#{seq}",
                r.env.session, r.env.seq
            )));
        }
    }
    Ok(())
}

/// A claimed job: "advance this session". Carries no state of the session.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub pool: String,
    pub session: SessionId,
    /// 1 on the first delivery.
    pub attempt: u32,
    /// Names this delivery (unique among the jobs a process holds); not parsed back.
    pub handle: String,
    /// The queue's own hold on this delivery, for its heartbeat, ack and retry (a
    /// JetStream acker); none where the queue finds its holds by the job itself.
    pub lease: Option<Lease>,
}

/// A queue's hold on a delivery, carried by the [`Job`] it was claimed as. Opaque to
/// everyone but the queue, which reads it back with [`Lease::get`].
#[derive(Clone)]
pub struct Lease(Arc<dyn std::any::Any + Send + Sync>);

impl Lease {
    pub fn new<T: std::any::Any + Send + Sync>(hold: T) -> Self {
        Lease(Arc::new(hold))
    }

    /// The hold, if it is a `T`.
    pub fn get<T: std::any::Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lease")
    }
}

/// The same hold, not merely an equal one.
impl PartialEq for Lease {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Work queues by pool. At most one pending job per session: pushing a session that
/// already waits is a no-op, and pushing one whose job is held makes it run again after
/// the holder acks (wake-ups coalesce, none is lost).
#[async_trait]
pub trait JobQueue: Send + Sync {
    async fn push(&self, pool: &str, session: &SessionId) -> Result<()>;
    /// Pushes the first job of a session that never had one (a child just created), as
    /// [`JobQueue::push`] does. A backend may send such pushes together, since none of
    /// them can find a job there already.
    async fn push_new(&self, pool: &str, session: &SessionId) -> Result<()> {
        self.push(pool, session).await
    }
    /// Wakes a session that has ended, so that a job of it tells its parent and watchers
    /// of its end again (a sweep after trouble, which cannot know whether they heard): as
    /// [`JobQueue::push`], but not dropped where the session's last job was acked as
    /// ended for good ([`JobQueue::ack_final`]).
    async fn push_ended(&self, pool: &str, session: &SessionId) -> Result<()> {
        self.push(pool, session).await
    }
    /// Waits up to `wait` for a job. The job is held for the queue's lease (a parameter of
    /// the backend, set when it is opened) unless heartbeated; after it, the job is
    /// delivered again as the next attempt.
    async fn claim(&self, pool: &str, wait: Duration) -> Result<Option<Job>>;
    /// Holds a job for a whole lease again, from now (long model calls).
    async fn heartbeat(&self, job: &Job) -> Result<()>;
    async fn ack(&self, job: &Job) -> Result<()>;
    /// [`JobQueue::ack`] for the job of a session that has ended. Nothing waits for such
    /// a job to go (a push for it meanwhile, such as a follow-up question to a finished
    /// chat agent, runs it again after the ack, as for any held job), so a backend may let
    /// the ack wait its turn behind the work still going on.
    async fn ack_ended(&self, job: &Job) -> Result<()> {
        self.ack(job).await
    }
    /// [`JobQueue::ack_ended`] for the job of a session that has ended for good: its end
    /// is durable in its log and nothing can follow it (it failed or was cancelled, or it
    /// completed and its agent takes no follow-up questions), so no later run of it could
    /// do anything its ending job has not done. A backend may leave such a job's trace in
    /// place rather than remove it: a push for the session afterwards may then be dropped,
    /// which for such a session loses nothing.
    async fn ack_final(&self, job: &Job) -> Result<()> {
        self.ack_ended(job).await
    }
    /// Gives the job back, to be delivered again after `delay`.
    async fn retry(&self, job: &Job, delay: Duration) -> Result<()>;
    /// Jobs waiting or held in a pool: a gauge, which may count a push or an ack a
    /// moment after it returned (on NATS the consumer's pending count follows the
    /// stream as the server signals it).
    async fn depth(&self, pool: &str) -> Result<u64>;

    /// As [`JobQueue::claim`], but only a job whose session `want` accepts; every other
    /// job stays as it was (not claimed, its delivery count untouched). What lets one
    /// process run one tree while others wait in the same queue. A backend that cannot
    /// choose does not claim [`Capabilities::claim_matching`] and refuses this as
    /// [`crate::RefusalKind::Unsupported`] ([`claim_matching_unsupported`]).
    async fn claim_matching(
        &self,
        pool: &str,
        wait: Duration,
        want: &SessionFilter,
    ) -> Result<Option<Job>>;

    /// Jobs waiting or held in a pool whose session `want` accepts; refused as
    /// `claim_matching` is by a backend that cannot choose.
    async fn depth_matching(&self, pool: &str, want: &SessionFilter) -> Result<u64>;

    /// Shows every process that `w.session`'s step waits for room in the store (while it
    /// waits, this is said again now and then, and a mark not said again lapses). Best
    /// effort. A store one process holds has no other reader, and may keep nothing.
    async fn set_waiting_for_room(&self, w: &WaitingForRoom) -> Result<()>;

    /// `session` waits for room no more.
    async fn clear_waiting_for_room(&self, session: &SessionId) -> Result<()>;

    /// Every session shown as waiting for room, by any process (none, where nothing is
    /// kept).
    async fn waiting_for_room(&self) -> Result<Vec<WaitingForRoom>>;
}

/// The refusal of [`JobQueue::claim_matching`] and [`JobQueue::depth_matching`] by a
/// backend that cannot choose jobs by session.
pub fn claim_matching_unsupported() -> Error {
    Error::refused(
        crate::RefusalKind::Unsupported,
        "this job queue cannot claim or count the jobs of chosen sessions",
    )
}

/// A session whose step waits for room in the store (see [`JobQueue::set_waiting_for_room`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WaitingForRoom {
    pub session: String,
    /// Since when, in ms since the epoch.
    pub since_ms: u64,
    /// The store's error, as its report.
    pub reason: String,
}

/// Chooses sessions (see [`JobQueue::claim_matching`]).
pub type SessionFilter = dyn Fn(&SessionId) -> bool + Send + Sync;

/// A cached sub-agent answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub answer: String,
    pub usage: Usage,
    pub source: SessionId,
    pub steps: u32,
    /// ms since the epoch.
    pub created: u64,
    /// ms since the epoch; none for no expiry.
    #[serde(default)]
    pub expires: Option<u64>,
}

/// Mission hash → answer.
#[async_trait]
pub trait Cache: Send + Sync {
    /// The entry, unless missing or expired at `now` (ms).
    async fn get(&self, hash: &str, now: u64) -> Result<Option<CacheEntry>>;
    async fn put(&self, hash: &str, entry: &CacheEntry) -> Result<()>;

    /// Single-flight: records `session` as the run of `hash` unless another session
    /// already is; returns that other session, or none when `session` now holds it.
    async fn claim_inflight(&self, hash: &str, session: &SessionId) -> Result<Option<SessionId>>;

    /// Ends `session`'s hold on `hash` (a no-op if someone else holds it).
    async fn release_inflight(&self, hash: &str, session: &SessionId) -> Result<()>;
}

/// Content-addressed payloads (agent definitions by digest, large tool outputs).
#[async_trait]
pub trait Blobs: Send + Sync {
    /// Stores `data` under its hex blake3 hash, which is returned. Once it returns, a
    /// record appended to any log may name the blob: the blob is durable by the time that
    /// record is (JetStream acks the object first; the embedded store writes the blob to
    /// its log file ahead of the record, and one sync covers both).
    async fn put(&self, data: &[u8]) -> Result<String>;
    async fn get(&self, hash: &str) -> Result<Option<Vec<u8>>>;
}

/// A notice read back: its position, the child it names, and the child's end when the
/// notice carries it ([`Notices::post_end`]).
pub type NoticeRead = (u64, SessionId, Option<Record>);

/// "Child C of session P has ended": a durable inbox per parent, so a parent reads only
/// the notices it has not seen instead of polling every child.
#[async_trait]
pub trait Notices: Send + Sync {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> Result<()>;
    /// Notices with position > `after`, in order, as (position, child).
    async fn read(&self, parent: &SessionId, after: u64) -> Result<Vec<(u64, SessionId)>>;

    /// [`Notices::post`] for a child that has ended, with the record that ended it: durable
    /// in the child's log, and the last record that log will ever hold (its agent takes no
    /// follow-up questions). A backend may carry the record in the notice, so that the
    /// parent settles the child without reading its log; one that does not posts the bare
    /// notice, and the parent reads the log as it would anyway.
    async fn post_end(&self, parent: &SessionId, child: &SessionId, end: &Record) -> Result<()> {
        let _ = end;
        self.post(parent, child).await
    }

    /// [`Notices::read`], with the end each notice carries ([`Notices::post_end`]), where
    /// it carries one.
    async fn read_ends(&self, parent: &SessionId, after: u64) -> Result<Vec<NoticeRead>> {
        Ok(self
            .read(parent, after)
            .await?
            .into_iter()
            .map(|(pos, child)| (pos, child, None))
            .collect())
    }

    /// Asks that `watcher` (run by `pool`) gets a notice and a wake-up when `target` ends,
    /// as its parent does: how single-flight waiters hear of a shared run.
    async fn watch(&self, target: &SessionId, watcher: &SessionId, pool: &str) -> Result<()>;

    /// Everyone watching `target`, as (watcher, pool).
    async fn watchers(&self, target: &SessionId) -> Result<Vec<(SessionId, String)>>;
}

/// A session outside the tree of `root` that watches `session` and has not ended, if one
/// does: a call of another tree that shares `session`'s run (single flight) and has not
/// yet settled it from `session`'s log. Retention keeps a tree while one of its sessions
/// has such a watcher, however old the tree: removed, the sharer would find no log where
/// the run was and fail its call, though the run completed. A watcher inside the tree
/// ended with it; one with no log waits for nothing.
pub async fn open_watcher_outside(
    log: &dyn EventLog,
    notices: &dyn Notices,
    root: &SessionId,
    session: &SessionId,
) -> Result<Option<SessionId>> {
    for (watcher, _) in notices.watchers(session).await? {
        if root.contains(&watcher) {
            continue;
        }
        if log
            .last(&watcher)
            .await?
            .is_some_and(|r| !r.env.body.is_terminal())
        {
            return Ok(Some(watcher));
        }
    }
    Ok(None)
}

/// Where a finished root is announced (`skein.results.ROOT` on NATS). The worker calls
/// it every time it finds a root ended (a job run again calls it again), so an
/// implementation announces each ending, named by the root and [`RootResult::seq`], once.
#[async_trait]
pub trait Announcer: Send + Sync {
    async fn root_finished(&self, notice: &RootResult) -> Result<()>;

    /// The last ending announced for `root`; none if it never ended (or its result aged
    /// out).
    async fn last_announced(&self, root: &SessionId) -> Result<Option<RootResult>>;
}

/// The JSON published when a root ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RootResult {
    pub session: String,
    /// The seq of the root's record that ended it: one ending of a tree, announced once.
    /// A root whose log went on past its end would end again at a later seq. Absent (0)
    /// in the results of earlier versions.
    #[serde(default)]
    pub seq: u64,
    /// How the root ended: `completed`, `failed` or `cancelled` on the wire.
    pub status: skein_core::Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub usage: Usage,
}

/// Gives each tree its workspace.
pub trait Workspaces: Send + Sync {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace>;
}

/// What a backend claims beyond the ports' contracts, each false unless the backend can
/// promise it (the conformance suite checks every claim, and that a backend claiming
/// none of them refuses what it does not do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Whether a notice posted before a wake-up is always there for the session it wakes,
    /// for as long as the process that posted it lives: no notice is lost or late while
    /// the woken session's fold stays cached. Where this holds, a parent woken with no new
    /// notice knows that no child of its own has ended unheard, and does not read every
    /// outstanding child's log to make sure (it still does when it is loaded cold, the
    /// only way a crash that lost notices shows). A backend whose notices and jobs live
    /// in separate stores of a cluster cannot promise it.
    pub notices_in_step_with_wakes: bool,

    /// Whether the notices live apart from every worker process, so that no worker's
    /// crash loses one (a cluster's stream holds them). Where this holds, a fold missing
    /// from a worker's cache (the session's last job ran on another worker, or this one
    /// restarted) says nothing of lost notices or lost job pushes: such a load reads the
    /// notices from the start, as its fold has no cursor, and checks every outstanding
    /// child only when no notice came, as a cached fold does. A crash in the middle of a
    /// job shows as a redelivery, which still checks every child. On one process a crash
    /// loses notices and cached folds together, and a cold load is how that shows, so such
    /// a backend cannot promise it.
    pub notices_outlive_workers: bool,

    /// Whether [`JobQueue::claim_matching`] and [`JobQueue::depth_matching`] work: what
    /// running one tree in a process (the runtime's `run_tree`) needs. Without
    /// it both are refused as [`crate::RefusalKind::Unsupported`].
    pub claim_matching: bool,
}

/// One backend: all the ports together.
#[derive(Clone)]
pub struct Backend {
    pub name: &'static str,
    pub log: Arc<dyn EventLog>,
    pub jobs: Arc<dyn JobQueue>,
    pub cache: Arc<dyn Cache>,
    pub blobs: Arc<dyn Blobs>,
    pub notices: Arc<dyn Notices>,
    pub workspaces: Arc<dyn Workspaces>,
    pub announcer: Option<Arc<dyn Announcer>>,
    pub capabilities: Capabilities,
    /// Model quotas shared by every worker of this backend; none: each runtime keeps its
    /// own in memory (one process holds the store).
    pub quota: Option<Arc<dyn crate::quota::Quota>>,
}

impl Backend {
    /// What this backend claims beyond the ports' contracts.
    pub fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    /// Every session of the subtree under `id` (`id` included), sorted; `NotFound` when
    /// there is no session `id`.
    pub async fn subtree(&self, id: &SessionId) -> Result<Vec<SessionId>> {
        let ids: Vec<SessionId> = self
            .log
            .tree(&id.root_id())
            .await?
            .into_iter()
            .filter(|s| id.contains(s))
            .collect();
        if ids.is_empty() {
            return Err(Error::NotFound(format!("no session {id}")));
        }
        Ok(ids)
    }

    /// Reads a whole log.
    pub async fn read_all(&self, session: &SessionId) -> Result<Vec<Record>> {
        self.log.read(session, 1).await
    }

    pub async fn def_text(&self, digest: &str) -> Result<String> {
        let bytes = self.blobs.get(digest).await?.ok_or_else(|| {
            Error::NotFound(format!(
                "agent definition {digest} is not in the blob store"
            ))
        })?;
        String::from_utf8(bytes).map_err(|e| Error::corrupt(format!("definition {digest}"), e))
    }
}

/// Max time a claim waits before returning `None`, so loops can check for shutdown.
pub const CLAIM_WAIT: Duration = Duration::from_millis(500);
