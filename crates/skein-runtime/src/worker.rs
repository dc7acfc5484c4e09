//! The worker: claims jobs, rebuilds a session from its log, asks the core for the next
//! step, performs its IO and appends the outcome — until the session waits or ends.
//!
//! Write-ahead: every event is durable before the effect it enables. `ModelCalled` before
//! any tool of its turn; `ToolCalled` before its tool runs; the children's `Submitted` and
//! the parent's `Delegated` before any child job is published. Only the holder of a
//! session's job writes its log; a finished child posts a notice to its parent and wakes
//! it, and the parent's worker records `ChildSettled` itself.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::StreamExt;
use rand::Rng;
use serde::Serialize;
use serde_json::Value;
use skein_core::decide::{Delegation, Refusal, ToolRun};
use skein_core::event::{
    genesis_hash, ApprovalRequested, BlobRef, CacheHit, ChildSettled, Completed, Delegated, Failed,
    InputProvided, InputRequested, ModelCalled, ModelFailed, Outcome, ParentRef, Submitted,
    ToolCalled, ToolReturned,
};
use skein_core::hash::{mission_hash, MissionKey};
use skein_core::{
    AgentDef, AgentSet, Budget, Envelope, Event, Limits, ModelRequest, Record, SessionId,
    SessionState, Status, Step,
};
use skein_llm::Registry;
use skein_tools::{ToolBox, ToolContext};
use tokio::sync::broadcast;

use crate::ports::{Backend, CacheEntry, Job, RootResult};
use crate::{new_root_id, now_ms, runtime_tools, Error, Result};

/// The pool of agents that name none.
pub const DEFAULT_POOL: &str = "default";
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
    /// Signs resume tokens.
    pub token_secret: crate::hitl::Secret,
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
            token_secret: crate::hitl::Secret(crate::hitl::new_token_id().into_bytes()),
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

/// A submission from a person or a program.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submission {
    pub agent: String,
    pub mission: String,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub inputs: Value,
    #[serde(default)]
    pub budget: Option<Budget>,
    #[serde(default)]
    pub no_cache: bool,
    /// The caller's W3C traceparent: the tree continues its trace (else a new one starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// What differs between the submission that holds a root id and another one made under
/// the same id: none when they ask for the same thing (agent, mission, context, inputs and,
/// when the new one names it, the budget).
pub fn resubmission_differs(
    existing: &Submitted,
    asked: &Submitted,
    budget_named: bool,
) -> Option<String> {
    let empty = |v: &Value| v.is_null() || v.as_object().is_some_and(|o| o.is_empty());
    let mut diffs = vec![];
    if existing.agent != asked.agent {
        diffs.push(format!("agent `{}`, not `{}`", existing.agent, asked.agent));
    }
    if existing.mission != asked.mission {
        diffs.push("another mission".to_string());
    }
    if existing.context != asked.context {
        diffs.push("another context".to_string());
    }
    if existing.inputs != asked.inputs && !(empty(&existing.inputs) && empty(&asked.inputs)) {
        diffs.push("other inputs".to_string());
    }
    if budget_named && existing.budget != asked.budget {
        diffs.push(format!(
            "budget {:?} tokens, not {:?}",
            existing.budget.tokens, asked.budget.tokens
        ));
    }
    (!diffs.is_empty()).then(|| format!("it has {}", diffs.join(", ")))
}

/// One line of live progress.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub session: SessionId,
    pub seq: u64,
    pub kind: String,
    pub status: Status,
    pub steps: u32,
}

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

/// A session's folded state and what the worker needs to append to it.
#[derive(Debug, Clone)]
pub struct Folded {
    pub id: SessionId,
    pub state: SessionState,
    pub last_hash: String,
    /// Position in the notice inbox already read.
    pub cursor: u64,
}

impl Folded {
    pub fn new(id: SessionId) -> Self {
        let last_hash = genesis_hash(&id);
        Self {
            id,
            state: SessionState::default(),
            last_hash,
            cursor: 0,
        }
    }

    /// Folds records that follow the current state, checking the chain as it goes.
    pub fn absorb(&mut self, records: &[Record]) -> Result<()> {
        for r in records {
            if r.env.seq != self.state.last_seq + 1 || r.env.prev != self.last_hash {
                return Err(Error::Corrupt(format!(
                    "log of {} breaks at seq {}: expected seq {} chained to the previous record",
                    self.id,
                    r.env.seq,
                    self.state.last_seq + 1
                )));
            }
            self.state.apply(&r.env);
            self.last_hash = r.hash();
        }
        Ok(())
    }
}

pub struct Runtime {
    pub backend: Backend,
    pub agents: Arc<AgentSet>,
    pub models: Registry,
    pub tools: ToolBox,
    pub cfg: RuntimeConfig,
    /// Shared by the work loops: claim health, the drain switch, held jobs.
    pub loops: crate::work_loop::Loops,
    defs: Mutex<HashMap<String, Arc<AgentDef>>>,
    states: Mutex<HashMap<SessionId, Folded>>,
    progress: broadcast::Sender<Progress>,
    text: broadcast::Sender<TextDelta>,
}

/// The trees a [`Runtime::run_tree`] works on, by root.
pub(crate) struct Scope {
    roots: Mutex<BTreeSet<SessionId>>,
}

impl Scope {
    fn new(root: &SessionId) -> Self {
        Self {
            roots: Mutex::new([root.root_id()].into()),
        }
    }

    pub(crate) fn wants(&self, session: &SessionId) -> bool {
        lock(&self.roots).contains(&session.root_id())
    }

    fn roots(&self) -> Vec<SessionId> {
        lock(&self.roots).iter().cloned().collect()
    }

    fn extend(&self, roots: Vec<SessionId>) {
        lock(&self.roots).extend(roots);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn outcome_of(terminal: &Event) -> Option<Outcome> {
    match terminal {
        Event::Completed(c) => Some(Outcome::Completed {
            answer: c.answer.clone(),
            patch: None,
            usage: c.usage_total,
            steps: c.steps,
        }),
        Event::Failed(f) => Some(Outcome::Failed {
            error: f.error.clone(),
            usage: f.usage_total,
            steps: f.steps,
        }),
        Event::Cancelled(c) => Some(Outcome::Failed {
            error: format!("cancelled: {}", c.reason),
            usage: Default::default(),
            steps: 0,
        }),
        _ => None,
    }
}

/// Every string in `v` (keys aside) through `f`.
fn map_strings(v: &mut Value, f: &dyn Fn(&str) -> String) {
    match v {
        Value::String(s) => *s = f(s),
        Value::Array(a) => a.iter_mut().for_each(|x| map_strings(x, f)),
        Value::Object(o) => o.values_mut().for_each(|x| map_strings(x, f)),
        _ => {}
    }
}

/// Replaces, in a model's reply, every resume token it was shown by its reference, so
/// the log records the reference.
fn hide_tokens(shown: &[(String, String)], resp: &mut skein_core::ModelResponse) {
    if shown.is_empty() {
        return;
    }
    let hide = |text: &str| {
        shown.iter().fold(text.to_string(), |t, (token, r)| {
            t.replace(token.as_str(), r)
        })
    };
    if let Some(c) = &mut resp.content {
        *c = hide(c);
    }
    for call in &mut resp.tool_calls {
        map_strings(&mut call.args, &hide);
    }
}

/// How long a failed step's job waits before it is delivered again. A write conflict
/// clears as soon as the fold is reread; an unreachable backend (a node down, a leader
/// election) backs off exponentially, so the deliveries that count towards `max_deliver`
/// span an outage of tens of seconds instead of burning out in one second.
pub fn retry_delay(e: &Error, attempt: u32) -> Duration {
    match e {
        Error::Conflict { .. } => Duration::from_millis(50 * u64::from(attempt.min(20))),
        Error::Backend(_) => {
            Duration::from_millis(500u64.saturating_mul(1 << attempt.saturating_sub(1).min(6)))
        }
        _ => Duration::from_secs(2),
    }
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
        let (progress, _) = broadcast::channel(4096);
        let (text, _) = broadcast::channel(4096);
        Arc::new(Self {
            backend,
            agents,
            models,
            tools,
            cfg,
            loops: Default::default(),
            defs: Mutex::new(HashMap::new()),
            states: Mutex::new(HashMap::new()),
            progress,
            text,
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

    // ---- submission -------------------------------------------------------------------

    /// Validates a submission, creates the root session and enqueues it. Submitting the
    /// same `id` again is a no-op that returns the id.
    pub async fn submit(&self, sub: Submission) -> Result<SessionId> {
        let def = self.agents.get(&sub.agent).ok_or_else(|| {
            Error::Rejected(format!(
                "unknown agent `{}`; known agents: {}",
                sub.agent,
                self.agents
                    .agents
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        skein_core::limits::check_mission(&sub.mission, sub.context.as_deref(), &sub.inputs)
            .map_err(Error::Rejected)?;
        if !(sub.inputs.is_null() || sub.inputs.is_object()) {
            return Err(Error::Rejected("inputs must be a JSON object".into()));
        }
        let id = match &sub.id {
            Some(t) => SessionId::root(t).map_err(|e| Error::Rejected(format!("id: {e}")))?,
            None => new_root_id(),
        };
        let def_digest = self.backend.blobs.put(def.text.as_bytes()).await?;
        let hash = mission_hash(&MissionKey {
            def_digest: &def_digest,
            model: &def.front.model,
            mission: &sub.mission,
            context: sub.context.as_deref(),
            inputs: &sub.inputs,
            strategy: def.front.strategy.as_deref(),
        });
        let asked_budget = sub.budget;
        let budget = sub.budget.unwrap_or(Budget {
            tokens: def.front.limits.max_tokens.or(self.cfg.limits.max_tokens),
        });
        let submitted = Submitted {
            agent: def.name().to_string(),
            def_digest,
            mission: sub.mission,
            context: sub.context,
            inputs: sub.inputs,
            mission_hash: hash,
            parent: None,
            depth: 0,
            budget,
            trace: Some(crate::trace::for_root(&id, sub.traceparent.as_deref())),
            ancestry: vec![],
            no_cache: sub.no_cache,
            forked_from: None,
            pool: def.front.pool.clone(),
            plan: None,
        };
        let pool = submitted
            .pool
            .clone()
            .unwrap_or_else(|| DEFAULT_POOL.into());
        let hash = submitted.mission_hash.clone();
        let cacheable = !submitted.no_cache && self.agents.caching(def).cached;
        let asked = submitted.clone();
        let Some(mut f) = self.create(&id, submitted).await? else {
            // The id is taken: the same submission again is a no-op; another is refused.
            let first = self.backend.log.read(&id, 1).await?;
            let existing = match first.first().map(|r| &r.env.body) {
                Some(Event::Submitted(s)) => s,
                _ => {
                    return Err(Error::Corrupt(format!(
                        "{id}: log does not start with Submitted"
                    )))
                }
            };
            if let Some(differs) = resubmission_differs(existing, &asked, asked_budget.is_some()) {
                return Err(Error::IdTaken {
                    id: id.to_string(),
                    differs,
                });
            }
            self.backend.jobs.push(&pool, &id).await?;
            return Ok(id);
        };
        // A root mission answered before: record the hit; the worker completes it.
        if cacheable {
            if let Some(hit) = self.backend.cache.get(&hash, now_ms()).await? {
                let ev = CacheHit {
                    call: String::new(),
                    mission_hash: hash,
                    source: hit.source,
                    answer: hit.answer,
                    saved: hit.usage,
                    steps: hit.steps,
                };
                self.append(&mut f, Event::CacheHit(ev)).await?;
            }
        }
        crate::spans::set_current(&f.id, &f.state);
        self.backend.jobs.push(&pool, &id).await?;
        Ok(id)
    }

    /// Appends `Submitted` as the first record of `id`; none if the session existed.
    async fn create(&self, id: &SessionId, submitted: Submitted) -> Result<Option<Folded>> {
        let mut f = Folded::new(id.clone());
        match self.append(&mut f, Event::Submitted(submitted)).await {
            Ok(()) => Ok(Some(f)),
            Err(Error::Conflict { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    // ---- log access -------------------------------------------------------------------

    fn seal(&self, f: &Folded, seq: u64, prev: String, body: Event) -> Result<Record> {
        let env = Envelope::new(f.id.clone(), seq, now_ms(), prev, body);
        let bytes = env.encode()?;
        Ok(Record { env, bytes })
    }

    /// Appends one event to a session this worker holds, and folds it.
    pub async fn append(&self, f: &mut Folded, body: Event) -> Result<()> {
        self.append_all(f, vec![body]).await
    }

    /// Appends events in order (one durable batch where the backend can), and folds them.
    pub async fn append_all(&self, f: &mut Folded, bodies: Vec<Event>) -> Result<()> {
        if bodies.is_empty() {
            return Ok(());
        }
        let first = f.state.last_seq;
        let mut prev = f.last_hash.clone();
        let mut records = Vec::with_capacity(bodies.len());
        for (i, body) in bodies.into_iter().enumerate() {
            let r = self.seal(f, first + 1 + i as u64, prev, body)?;
            prev = r.hash();
            records.push(r);
        }
        match self.backend.log.append_batch(&f.id, first, &records).await {
            Ok(()) => {}
            Err(e) => {
                if matches!(e, Error::Conflict { .. }) {
                    // Someone else wrote: forget the cached fold so the next load rereads.
                    lock(&self.states).remove(&f.id);
                }
                return Err(e);
            }
        }
        for r in &records {
            f.state.apply(&r.env);
            if r.env.body.is_terminal() {
                crate::spans::session_ended(&f.id, &f.state, r.env.at);
            }
            let _ = self.progress.send(Progress {
                session: f.id.clone(),
                seq: r.env.seq,
                kind: r.env.body.kind().to_string(),
                status: f.state.status,
                steps: f.state.steps,
            });
        }
        f.last_hash = prev;
        Ok(())
    }

    /// The folded state of a session: the cached fold plus whatever is new in the log.
    /// Returns whether it was loaded cold (not cached).
    pub async fn load(&self, id: &SessionId) -> Result<(Folded, bool)> {
        let cached = lock(&self.states).remove(id);
        let cold = cached.is_none();
        let mut f = cached.unwrap_or_else(|| Folded::new(id.clone()));
        let new = self.backend.log.read(id, f.state.last_seq + 1).await?;
        f.absorb(&new)?;
        Ok((f, cold))
    }

    /// Gives a fold back to the cache (after `load`).
    pub fn keep_state(&self, f: Folded) {
        self.keep(f)
    }

    fn keep(&self, f: Folded) {
        let mut states = lock(&self.states);
        if states.len() >= self.cfg.state_cache {
            // Drop finished sessions first; then anything.
            let victim = states
                .iter()
                .find(|(_, v)| v.state.status.is_terminal())
                .or_else(|| states.iter().next())
                .map(|(k, _)| k.clone());
            if let Some(v) = victim {
                states.remove(&v);
            }
        }
        states.insert(f.id.clone(), f);
    }

    /// The definition a session was submitted with.
    pub async fn def_for(&self, state: &SessionState) -> Result<Arc<AgentDef>> {
        let Some(sub) = &state.submitted else {
            return Err(Error::NotFound("session has no Submitted event".into()));
        };
        if let Some(d) = lock(&self.defs).get(&sub.def_digest) {
            return Ok(d.clone());
        }
        let text = self.backend.def_text(&sub.def_digest).await?;
        let def = Arc::new(AgentDef::parse(
            &format!("stored definition {}", sub.def_digest),
            &text,
        )?);
        lock(&self.defs).insert(sub.def_digest.clone(), def.clone());
        Ok(def)
    }

    // ---- the loop ---------------------------------------------------------------------

    /// Advances one session as far as it can go. The caller acks the job on `Ok`.
    pub async fn process(&self, job: &Job) -> Result<()> {
        let (mut f, cold) = self.load(&job.session).await?;
        crate::spans::set_current(&f.id, &f.state);
        // A redelivered job means a step may have stopped half way (its job pushes lost,
        // say): reconcile from the logs as on a cold load.
        let cold = cold || job.attempt > 1;
        let res = self.drive(&mut f, cold, job).await;
        if res.is_ok() {
            self.keep(f);
        }
        // On an error the fold is dropped, so the retry reloads and reconciles.
        res
    }

    async fn drive(&self, f: &mut Folded, mut cold: bool, job: &Job) -> Result<()> {
        if f.state.submitted.is_none() {
            tracing::warn!(session = %f.id, "job for a session without a log; dropped");
            return Ok(());
        }
        // Dead-lettered only when the deliveries were many and the log stood still for as
        // long as they could have taken: deliveries that ran out during a leader election
        // (heartbeats that found no consumer leader) come quickly while the session still
        // moves, and do not fail it.
        let still_for = now_ms().saturating_sub(f.state.updated_at);
        let stalled =
            u128::from(still_for) >= self.cfg.lease.as_millis() * u128::from(self.cfg.max_deliver);
        if !f.state.status.is_terminal() && job.attempt > self.cfg.max_deliver && stalled {
            // What the deliveries kept failing at, from the log: the step due next, and the
            // last model error when model calls failed.
            let due = match self.def_for(&f.state).await {
                Ok(def) => f
                    .state
                    .next(&def, &self.cfg.limits, &*self.agents)
                    .describe(),
                Err(e) => format!("none: its definition cannot be read ({e})"),
            };
            let mut error = format!(
                "dead-lettered: the job of this session was delivered {} times without \
                 finishing (max_deliver {}); the step it could not get past: {due}",
                job.attempt - 1,
                self.cfg.max_deliver
            );
            if let Some(m) = &f.state.last_model_error {
                error.push_str(&format!("; the last model error: {m}"));
            }
            let usage_total = f.state.usage_total();
            let steps = f.state.steps;
            self.append(
                f,
                Event::Failed(Failed {
                    error,
                    usage_total,
                    steps,
                }),
            )
            .await?;
            crate::metrics::job_dead_lettered(&job.pool);
        }
        // Children whose jobs this drive published itself.
        let mut pushed = BTreeSet::new();
        loop {
            if f.state.status.is_terminal() {
                return self.on_terminal(f).await;
            }
            let def = self.def_for(&f.state).await?;
            let step = f.state.next(&def, &self.cfg.limits, &*self.agents);
            tracing::debug!(session = %f.id, step = step.name(), "step");
            let _timer = crate::metrics::StepTimer::start(step.name());
            match step {
                Step::Idle => return Ok(()),
                Step::Wait => {
                    if f.state.status == Status::AwaitingInput {
                        // A child's question goes to its parent: wake it to read it.
                        if let Some(p) = f.state.submitted.as_ref().and_then(|s| s.parent.clone()) {
                            self.backend.notices.post(&p.session, &f.id).await?;
                            let pool = p.pool.clone().unwrap_or_else(|| DEFAULT_POOL.into());
                            self.backend.jobs.push(&pool, &p.session).await?;
                        }
                    }
                    let settled = self.collect_settlements(f, cold, &pushed).await?;
                    cold = false;
                    if settled == 0 {
                        return Ok(());
                    }
                }
                Step::CallModel { tool_names, .. } => {
                    let request = f.state.model_request(&def);
                    self.call_model(f, &def, request, &tool_names, job).await?
                }
                Step::Refuse(rs) => self.refuse(f, rs).await?,
                Step::Clarify(v) => self.clarify(f, v).await?,
                Step::Summarize { model, max_chars } => {
                    let full = f.state.pending_answer.clone().unwrap_or_default();
                    self.backend.blobs.put(full.as_bytes()).await?;
                    let sub = f.state.submitted.clone();
                    let request = ModelRequest {
                        model,
                        messages: vec![
                            skein_core::Message::System {
                                content: format!(
                                    "Summarise the answer below in at most {max_chars} \
                                     characters. Keep every fact, figure and name the \
                                     requester needs; add nothing."
                                ),
                            },
                            skein_core::Message::User {
                                content: full.clone(),
                            },
                        ],
                        tools: vec![],
                        temperature: None,
                        max_tokens: None,
                        prompt_cache: false,
                        meta: skein_core::message::RequestMeta {
                            session: f.id.to_string(),
                            agent: sub.as_ref().map(|s| s.agent.clone()).unwrap_or_default(),
                            mission: "summarize".into(),
                            context: Some(full),
                            inputs: serde_json::Value::Null,
                            plan: serde_json::Value::Null,
                        },
                    };
                    self.call_model(f, &def, request, &[], job).await?
                }
                Step::AskUser(asks) => {
                    let events = asks
                        .into_iter()
                        .map(|a| {
                            Event::InputRequested(InputRequested {
                                call: Some(a.call),
                                questions: a.questions,
                                context: a.context,
                                defaults: a.defaults,
                                token_id: crate::hitl::new_token_id(),
                            })
                        })
                        .collect();
                    self.append_all(f, events).await?
                }
                Step::RequestApproval(v) => {
                    let events = v
                        .into_iter()
                        .map(|a| {
                            Event::ApprovalRequested(ApprovalRequested {
                                call: a.call,
                                tool: a.tool,
                                preview: a.preview,
                                token_id: crate::hitl::new_token_id(),
                            })
                        })
                        .collect();
                    self.append_all(f, events).await?
                }
                Step::Delegate(ds) => {
                    // Their jobs are pushed by `delegate`: a cold reconciliation in this
                    // drive need not push them again.
                    pushed.extend(ds.iter().map(|d| d.child.clone()));
                    self.delegate(f, &def, ds).await?
                }
                Step::RunTools(runs) => self.run_tools(f, &def, runs, job).await?,
                Step::EditPlan(e) => self.append(f, e.into_event()).await?,
                Step::ProposePatch(ps) => self.propose(f, ps).await?,
                Step::Complete { answer } => {
                    let usage_total = f.state.usage_total();
                    let steps = f.state.steps;
                    self.append(
                        f,
                        Event::Completed(Completed {
                            answer,
                            usage_total,
                            steps,
                        }),
                    )
                    .await?
                }
                Step::Fail { error } => {
                    let usage_total = f.state.usage_total();
                    let steps = f.state.steps;
                    self.append(
                        f,
                        Event::Failed(Failed {
                            error,
                            usage_total,
                            steps,
                        }),
                    )
                    .await?
                }
            }
        }
    }

    async fn refuse(&self, f: &mut Folded, rs: Vec<Refusal>) -> Result<()> {
        let events = rs
            .into_iter()
            .map(|r| {
                Event::ToolReturned(ToolReturned {
                    call: r.call,
                    output: r.error,
                    error: true,
                    ms: 0,
                    blob: None,
                })
            })
            .collect();
        self.append_all(f, events).await
    }

    /// Keeps a job's lease alive while `fut` runs.
    async fn with_heartbeat<T>(&self, job: &Job, fut: impl std::future::Future<Output = T>) -> T {
        let every = (self.cfg.lease / 3).max(Duration::from_millis(200));
        tokio::pin!(fut);
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tokio::select! {
                out = &mut fut => return out,
                _ = tick.tick() => {
                    if let Err(e) = self.backend.jobs.heartbeat(job).await {
                        tracing::warn!(session = %job.session, error = %e, "heartbeat failed");
                    }
                }
            }
        }
    }

    async fn call_model(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        mut request: ModelRequest,
        tool_names: &[String],
        job: &Job,
    ) -> Result<()> {
        request.tools = tool_names
            .iter()
            .filter_map(|n| match n.as_str() {
                "call_agent" => Some(runtime_tools::call_agent_spec(def)),
                "ask_clarification" => Some(runtime_tools::ask_clarification_spec()),
                "ask_user" => Some(runtime_tools::ask_user_spec()),
                "update_plan" => Some(runtime_tools::update_plan_spec()),
                "propose_patch" => Some(runtime_tools::propose_patch_spec()),
                other => self.tools.spec(other),
            })
            .collect();
        // The model is shown the resume tokens its log holds references to; a token it
        // sends back is recorded as its reference again.
        let shown = self.reveal_tokens(&f.state, &mut request);
        let started = Instant::now();
        // The answer's text goes out while it arrives, to whoever listens; the log gets it
        // whole below. A session that was shown resume tokens does not stream: a token
        // the model repeats could be cut across two pieces, where hiding it again fails.
        let (session, seq, attempt) = (
            f.id.clone(),
            f.state.last_seq + 1,
            f.state.model_failures + 1,
        );
        let on_text = |piece: &str| {
            if !shown.is_empty() || self.text.receiver_count() == 0 {
                return;
            }
            let _ = self.text.send(TextDelta {
                session: session.clone(),
                seq,
                attempt,
                text: piece.to_string(),
            });
        };
        // A worker that drains abandons the call: nothing of it is recorded yet, and the
        // job goes back for another worker to make it.
        let result = tokio::select! {
            biased;
            _ = self.draining() => return Err(Error::Interrupted(format!(
                "the call to {} was abandoned", request.model))),
            r = self.with_heartbeat(job, self.models.complete_streaming(&request, &on_text)) => r,
        };
        let latency_ms = started.elapsed().as_millis() as u64;
        crate::metrics::model_call(
            &request.model,
            started.elapsed(),
            result.as_ref().ok().map(|c| &c.usage),
        );
        let outcome = match &result {
            Ok(c) => crate::spans::ModelOutcome::Answered {
                usage: &c.usage,
                finish_reason: c.response.finish_reason.as_deref(),
            },
            Err(e) => crate::spans::ModelOutcome::Failed(e.to_string()),
        };
        let began = std::time::SystemTime::now() - started.elapsed();
        crate::spans::model_call(&f.id, &f.state, &request.model, began, outcome);
        match result {
            Ok(mut c) => {
                hide_tokens(&shown, &mut c.response);
                self.fix_call_ids(&f.state, &mut c.response);
                let ev = ModelCalled {
                    model: request.model.clone(),
                    request_digest: request.digest(),
                    response: c.response,
                    usage: c.usage,
                    latency_ms,
                    worker: self.cfg.worker_id.clone(),
                };
                self.append(f, Event::ModelCalled(ev)).await
            }
            Err(e) => {
                let retryable = e.is_retryable();
                let attempt = f.state.model_failures + 1;
                tracing::warn!(session = %f.id, attempt, retryable, error = %e, "model call failed");
                let ev = ModelFailed {
                    model: request.model.clone(),
                    error: e.to_string(),
                    retryable,
                    attempt,
                    worker: self.cfg.worker_id.clone(),
                };
                self.append(f, Event::ModelFailed(ev)).await?;
                if retryable {
                    let base = Duration::from_millis(250 * (1u64 << attempt.min(6)));
                    let jitter = rand::thread_rng().gen_range(0..=base.as_millis() as u64 / 2);
                    let wait = e
                        .retry_after()
                        .unwrap_or(base + Duration::from_millis(jitter))
                        .min(Duration::from_secs(60));
                    tokio::select! {
                        _ = self.draining() => {}
                        _ = self.with_heartbeat(job, tokio::time::sleep(wait)) => {}
                    }
                }
                Ok(())
            }
        }
    }

    /// Replaces, in every message of `request`, the references to resume tokens this
    /// session was given by the tokens themselves. Returns (token, reference) pairs.
    fn reveal_tokens(
        &self,
        state: &SessionState,
        request: &mut ModelRequest,
    ) -> Vec<(String, String)> {
        if state.resume_refs.is_empty() {
            return vec![];
        }
        let secret = &self.cfg.token_secret.0;
        let shown: Vec<(String, String)> = state
            .resume_refs
            .iter()
            .filter_map(|r| Some((skein_core::token::from_reference(secret, r)?, r.clone())))
            .collect();
        let reveal = |text: &str| {
            skein_core::token::replace_references(text, &state.resume_refs, |r| {
                skein_core::token::from_reference(secret, r)
            })
        };
        for m in &mut request.messages {
            match m {
                skein_core::Message::System { content }
                | skein_core::Message::User { content }
                | skein_core::Message::Tool { content, .. } => *content = reveal(content),
                skein_core::Message::Assistant {
                    content,
                    tool_calls,
                } => {
                    if let Some(c) = content {
                        *c = reveal(c);
                    }
                    for call in tool_calls {
                        map_strings(&mut call.args, &reveal);
                    }
                }
            }
        }
        shown
    }

    /// Gives every tool call a non-empty id not used before in the session, so events can
    /// name calls without ambiguity.
    fn fix_call_ids(&self, state: &SessionState, resp: &mut skein_core::ModelResponse) {
        let mut used: BTreeSet<String> = state
            .transcript
            .iter()
            .filter_map(|m| match m {
                skein_core::Message::Assistant { tool_calls, .. } => Some(tool_calls),
                _ => None,
            })
            .flatten()
            .map(|c| c.id.clone())
            .collect();
        for (k, c) in resp.tool_calls.iter_mut().enumerate() {
            if c.id.is_empty() || used.contains(&c.id) {
                c.id = format!("t{}_{}", state.steps + 1, k + 1);
            }
            used.insert(c.id.clone());
        }
    }

    async fn delegate(&self, f: &mut Folded, def: &AgentDef, ds: Vec<Delegation>) -> Result<()> {
        let started = std::time::SystemTime::now();
        let Some(parent_sub) = f.state.submitted.clone() else {
            return Err(Error::NotFound(format!("{} has no Submitted event", f.id)));
        };
        let mut parent_events = Vec::with_capacity(ds.len());
        let mut creations = vec![];
        let mut jobs = vec![];
        for d in ds {
            if let Some(resume) = &d.resume {
                parent_events.push(self.resume_child(f, &d, resume).await?);
                if let Some(Event::Delegated(_)) = parent_events.last() {
                    let (cf, _) = self.load(&d.child).await?;
                    let pool = cf.state.submitted.as_ref().and_then(|s| s.pool.clone());
                    self.keep(cf);
                    jobs.push((pool.unwrap_or_else(|| DEFAULT_POOL.into()), d.child.clone()));
                }
                continue;
            }
            let child_def: Arc<AgentDef> = match &d.custom {
                Some(c) => Arc::new(AgentDef::custom(def, &c.system_prompt, &c.tools)?),
                None => match self.agents.get(&d.agent) {
                    Some(x) => Arc::new(x.clone()),
                    None => {
                        parent_events.push(Event::ToolReturned(ToolReturned {
                            call: d.call.clone(),
                            output: format!("call_agent: unknown agent `{}`", d.agent),
                            error: true,
                            ms: 0,
                            blob: None,
                        }));
                        continue;
                    }
                },
            };
            let def_digest = child_def.digest.clone();
            let hash = mission_hash(&MissionKey {
                def_digest: &def_digest,
                model: &child_def.front.model,
                mission: &d.mission,
                context: d.context.as_deref(),
                inputs: &d.inputs,
                strategy: child_def.front.strategy.as_deref(),
            });
            // A child handed tasks of the plan writes to it: its run is never shared.
            // An agent that may have side effects is neither answered from the cache nor
            // shared: its effects must happen in this tree.
            let caching =
                !parent_sub.no_cache && self.agents.caching(&child_def).cached && d.grant.is_none();
            if caching {
                if let Some(hit) = self.backend.cache.get(&hash, now_ms()).await? {
                    parent_events.push(Event::CacheHit(CacheHit {
                        call: d.call.clone(),
                        mission_hash: hash,
                        source: hit.source,
                        answer: hit.answer,
                        saved: hit.usage,
                        steps: hit.steps,
                    }));
                    continue;
                }
            }
            if caching {
                if let Some(running) = self.single_flight(&hash, &d.child).await? {
                    // An identical mission is running: wait for it instead of a new run.
                    // Watch before recording, so its end cannot slip past unheard.
                    let my_pool = parent_sub
                        .pool
                        .clone()
                        .unwrap_or_else(|| DEFAULT_POOL.into());
                    self.backend
                        .notices
                        .watch(&running, &f.id, &my_pool)
                        .await?;
                    parent_events.push(Event::Delegated(Delegated {
                        call: d.call,
                        child: running,
                        agent: d.agent,
                        mission_hash: hash,
                        allotted_tokens: None,
                        shared: true,
                        resumed: false,
                        owns_tasks: vec![],
                    }));
                    continue;
                }
            }
            let pool = child_def.front.pool.clone();
            let submitted = Submitted {
                agent: d.agent.clone(),
                def_digest,
                mission: d.mission.clone(),
                context: d.context.clone(),
                inputs: d.inputs.clone(),
                mission_hash: hash.clone(),
                parent: Some(ParentRef {
                    session: f.id.clone(),
                    call: d.call.clone(),
                    pool: parent_sub.pool.clone(),
                }),
                depth: d.depth,
                budget: d.budget,
                trace: Some(crate::trace::for_child(
                    &d.child,
                    parent_sub.trace.as_deref(),
                )),
                ancestry: d.ancestry.clone(),
                no_cache: parent_sub.no_cache || d.grant.is_some(),
                forked_from: None,
                pool: pool.clone(),
                plan: d.grant.clone(),
            };
            creations.push((d.child.clone(), child_def, submitted));
            jobs.push((pool.unwrap_or_else(|| DEFAULT_POOL.into()), d.child.clone()));
            parent_events.push(Event::Delegated(Delegated {
                call: d.call,
                child: d.child,
                agent: d.agent,
                mission_hash: hash,
                allotted_tokens: d.budget.tokens,
                shared: false,
                resumed: false,
                owns_tasks: d
                    .grant
                    .as_ref()
                    .map(|g| g.tasks.iter().map(|t| t.id.clone()).collect())
                    .unwrap_or_default(),
            }));
        }
        // Children first (in parallel, so their flushes are shared), then the parent's
        // record of them, then the jobs: a crash anywhere leaves nothing dangling.
        let created = join_all(creations.into_iter().map(|(id, def, sub)| async move {
            self.backend.blobs.put(def.text.as_bytes()).await?;
            self.create(&id, sub).await
        }))
        .await;
        for c in created {
            c?;
        }
        let delegated = crate::spans::delegated(&parent_events);
        self.append_all(f, parent_events).await?;
        crate::spans::delegations(&f.id, &f.state, started, &delegated);
        for (pool, child) in jobs {
            self.backend.jobs.push(&pool, &child).await?;
        }
        Ok(())
    }

    /// Takes a sub-agent's proposals to its parent's plan and records each verdict as the
    /// tool's result. The verdict is the parent's `PatchApplied`/`PatchRejected`, written
    /// from here under the log's optimistic concurrency (like a person's answer); after a
    /// crash the verdict already recorded there is reused, so nothing is merged twice.
    async fn propose(&self, f: &mut Folded, ps: Vec<skein_core::decide::Proposal>) -> Result<()> {
        let sub = f.state.submitted.clone();
        let owner = sub.as_ref().and_then(|s| s.parent.clone());
        let agent = sub.map(|s| s.agent).unwrap_or_default();
        let me = f.id.to_string();
        let mut events = vec![];
        for p in ps {
            let verdict = match &owner {
                Some(o) => {
                    self.merge_proposal(&o.session, &me, &agent, &p.call, &p.patch)
                        .await?
                }
                None => Err(skein_core::plan::Rejection::Invalid {
                    reason: "this session has no parent whose plan it could patch".into(),
                }),
            };
            let (j, error) = skein_core::plan::verdict_json(&verdict);
            events.push(Event::ToolReturned(ToolReturned {
                call: p.call,
                output: j.to_string(),
                error,
                ms: 0,
                blob: None,
            }));
        }
        self.append_all(f, events).await
    }

    async fn merge_proposal(
        &self,
        owner: &SessionId,
        from: &str,
        agent: &str,
        call: &str,
        patch: &skein_core::plan::Patch,
    ) -> Result<std::result::Result<u64, skein_core::plan::Rejection>> {
        use skein_core::event::{PatchApplied, PatchRejected};
        let key = skein_core::state::verdict_key(from, call);
        for _ in 0..8 {
            let (mut pf, _) = self.load(owner).await?;
            if let Some(v) = pf.state.plan_verdicts.get(&key).cloned() {
                self.keep(pf);
                return Ok(v);
            }
            if pf.state.status.is_terminal() {
                self.keep(pf);
                return Ok(Err(skein_core::plan::Rejection::Invalid {
                    reason: "the plan's owner has finished; its plan no longer changes".into(),
                }));
            }
            let author = skein_core::plan::Author::Delegate {
                session: from,
                agent,
            };
            let verdict = pf
                .state
                .plan
                .merge(author, patch, self.cfg.limits.plan_unlink)
                .map(|p| p.version);
            let body = match &verdict {
                Ok(version) => Event::PatchApplied(PatchApplied {
                    from: from.to_string(),
                    agent: agent.to_string(),
                    call: Some(call.to_string()),
                    base_version: patch.base_version,
                    ops: patch.ops.clone(),
                    version: *version,
                }),
                Err(reason) => Event::PatchRejected(PatchRejected {
                    from: from.to_string(),
                    agent: agent.to_string(),
                    call: Some(call.to_string()),
                    base_version: patch.base_version,
                    reason: reason.clone(),
                }),
            };
            match self.append(&mut pf, body).await {
                Ok(()) => {
                    self.keep(pf);
                    return Ok(verdict);
                }
                // The owner's log moved on: decide again on the fresh plan.
                Err(Error::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::Backend(format!(
            "{owner}: too many concurrent appends while merging a plan patch"
        )))
    }

    /// Continues a paused child with the parent model's answers: checks the token against
    /// the child's log, records the answers there, and returns the parent's event — a
    /// `Delegated {resumed}` or, when the token does not hold, a tool error.
    async fn resume_child(
        &self,
        f: &Folded,
        d: &Delegation,
        resume: &skein_core::decide::Resume,
    ) -> Result<Event> {
        let refuse = |why: String| {
            Event::ToolReturned(ToolReturned {
                call: d.call.clone(),
                output: format!("call_agent: resume_token refused: {why}"),
                error: true,
                ms: 0,
                blob: None,
            })
        };
        if let Err(Error::Rejected(why)) =
            crate::hitl::check_answer_size("the answers", resume.answers.to_string().len())
        {
            return Ok(refuse(why));
        }
        let by = format!("{}#{}", f.id, d.call);
        // A crash after the answers were recorded but before `Delegated`: finish the job.
        let (cf, _) = self.load(&d.child).await?;
        let ours = !cf.state.used_tokens.is_empty()
            && self
                .backend
                .log
                .read(&d.child, 1)
                .await?
                .iter()
                .any(|r| matches!(&r.env.body, Event::InputProvided(p) if p.by.as_deref() == Some(by.as_str())));
        let mission_hash = cf
            .state
            .submitted
            .as_ref()
            .map(|s| s.mission_hash.clone())
            .unwrap_or_default();
        self.keep(cf);
        if !ours {
            // The model's token was recorded as its reference: only one this session was
            // given stands for a token.
            let token = if resume
                .token
                .trim()
                .starts_with(skein_core::token::REF_PREFIX)
            {
                let r = resume.token.trim();
                match f
                    .state
                    .resume_refs
                    .contains(r)
                    .then(|| skein_core::token::from_reference(&self.cfg.token_secret.0, r))
                    .flatten()
                {
                    Some(t) => t,
                    None => return Ok(refuse("it is not a token this session was given".into())),
                }
            } else {
                resume.token.clone()
            };
            let (claims, cf) = match crate::hitl::check_token(self, &token, "input").await {
                Ok(x) => x,
                Err(Error::Rejected(why)) => return Ok(refuse(why)),
                Err(e) => return Err(e),
            };
            if claims.session != d.child {
                self.keep(cf);
                return Ok(refuse(format!(
                    "it belongs to session {}",
                    claims.session.display()
                )));
            }
            let questions = cf
                .state
                .pending_inputs
                .iter()
                .find(|p| p.token_id == claims.nonce)
                .map(|p| p.questions.clone())
                .unwrap_or_default();
            if let Err(Error::Rejected(why)) =
                crate::hitl::check_answers(&questions, &resume.answers)
            {
                self.keep(cf);
                return Ok(refuse(why));
            }
            let nonce = claims.nonce.clone();
            let body = Event::InputProvided(InputProvided {
                answers: resume.answers.clone(),
                token_id: nonce.clone(),
                by: Some(by),
            });
            let valid = |g: &Folded| g.state.pending_inputs.iter().any(|p| p.token_id == nonce);
            match crate::hitl::append_from_outside(self, cf, body, valid).await {
                Ok(cf) => self.keep(cf),
                Err(Error::Rejected(why)) => return Ok(refuse(why)),
                Err(e) => return Err(e),
            }
        }
        Ok(Event::Delegated(Delegated {
            call: d.call.clone(),
            child: d.child.clone(),
            agent: d.agent.clone(),
            mission_hash,
            allotted_tokens: None,
            shared: false,
            resumed: true,
            owns_tasks: vec![],
        }))
    }

    /// Puts follow-up questions to finished `chat: true` children: each child's log
    /// continues with the question, and this session waits for its new answer.
    async fn clarify(&self, f: &mut Folded, v: Vec<skein_core::decide::Clarify>) -> Result<()> {
        let mut events = vec![];
        let mut jobs = vec![];
        for c in v {
            let (cf, _) = self.load(&c.child).await?;
            let records = self.backend.log.read(&c.child, 1).await?;
            // After a crash the question may already be in the child's log.
            let asked = records.iter().any(|r| {
                matches!(&r.env.body, Event::ClarificationRequested(q) if q.from == f.id && q.call == c.call)
            });
            let mission_hash = cf
                .state
                .submitted
                .as_ref()
                .map(|s| s.mission_hash.clone())
                .unwrap_or_default();
            let pool = cf.state.submitted.as_ref().and_then(|s| s.pool.clone());
            if !asked {
                if cf.state.status != Status::Completed {
                    self.keep(cf);
                    events.push(Event::ToolReturned(ToolReturned {
                        call: c.call,
                        output: format!(
                            "ask_clarification: {} is busy; ask again once it has answered",
                            c.child.display()
                        ),
                        error: true,
                        ms: 0,
                        blob: None,
                    }));
                    continue;
                }
                let body =
                    Event::ClarificationRequested(skein_core::event::ClarificationRequested {
                        from: f.id.clone(),
                        call: c.call.clone(),
                        question: c.question.clone(),
                    });
                let cf = crate::hitl::append_from_outside(self, cf, body, |g| {
                    g.state.status == Status::Completed
                })
                .await?;
                self.keep(cf);
            } else {
                self.keep(cf);
            }
            jobs.push((pool.unwrap_or_else(|| DEFAULT_POOL.into()), c.child.clone()));
            events.push(Event::Delegated(Delegated {
                call: c.call,
                child: c.child,
                agent: c.agent,
                mission_hash,
                allotted_tokens: None,
                shared: false,
                resumed: true,
                owns_tasks: vec![],
            }));
        }
        self.append_all(f, events).await?;
        for (pool, child) in jobs {
            self.backend.jobs.push(&pool, &child).await?;
        }
        Ok(())
    }

    /// Claims the run of `hash` for `child`; returns the session to share instead when an
    /// identical run is under way. A holder that ended without an answer to share (failed,
    /// cancelled) is replaced.
    async fn single_flight(&self, hash: &str, child: &SessionId) -> Result<Option<SessionId>> {
        for _ in 0..3 {
            let Some(holder) = self.backend.cache.claim_inflight(hash, child).await? else {
                return Ok(None);
            };
            match self.backend.log.last(&holder).await? {
                Some(r)
                    if r.env.body.is_terminal() && !matches!(r.env.body, Event::Completed(_)) =>
                {
                    self.backend.cache.release_inflight(hash, &holder).await?;
                }
                // Running, or completed (its notices may still be on their way).
                Some(_) => return Ok(Some(holder)),
                // Claimed but not yet created: the creator is between claim and append.
                None => return Ok(Some(holder)),
            }
        }
        Ok(None)
    }

    async fn run_tools(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        runs: Vec<ToolRun>,
        job: &Job,
    ) -> Result<()> {
        let ctx = ToolContext {
            session: f.id.clone(),
            workspace: self.backend.workspaces.for_tree(&f.id.root_id()),
        };
        let (resumed, fresh): (Vec<ToolRun>, Vec<ToolRun>) =
            runs.into_iter().partition(|r| r.resumed);
        let mut to_run = vec![];
        let mut events = vec![];
        for r in resumed {
            if self.tools.idempotent(&r.tool) || def.front.idempotent_tools.contains(&r.tool) {
                to_run.push(r);
            } else {
                events.push(Event::ToolReturned(ToolReturned {
                    call: r.call,
                    output: format!(
                        "the outcome of this `{}` call is unknown: the worker running it \
                         stopped before it returned. It was not run again because the tool \
                         is not idempotent; check its effects before calling it again.",
                        r.tool
                    ),
                    error: true,
                    ms: 0,
                    blob: None,
                }));
            }
        }
        self.append_all(f, events).await?;
        let called: Vec<Event> = fresh
            .iter()
            .map(|r| {
                Event::ToolCalled(ToolCalled {
                    call: r.call.clone(),
                    tool: r.tool.clone(),
                    args: r.args.clone(),
                    worker: self.cfg.worker_id.clone(),
                })
            })
            .collect();
        self.append_all(f, called).await?;
        to_run.extend(fresh);
        if to_run.is_empty() {
            return Ok(());
        }
        let tools: HashMap<String, String> = to_run
            .iter()
            .map(|r| (r.call.clone(), r.tool.clone()))
            .collect();
        let (parallel, serial): (Vec<ToolRun>, Vec<ToolRun>) = to_run
            .into_iter()
            .partition(|r| self.tools.parallel(&r.tool));
        let work = async {
            let mut outs = join_all(parallel.iter().map(|r| self.run_one(&ctx, r))).await;
            for r in &serial {
                outs.push(self.run_one(&ctx, r).await);
            }
            outs
        };
        let outs = self.with_heartbeat(job, work).await;
        let mut returned = vec![];
        for o in outs {
            let o = o?;
            let tool = tools.get(&o.call).map_or("", String::as_str);
            crate::spans::tool_call(&f.id, &f.state, tool, &o.call, o.ms, o.error);
            returned.push(Event::ToolReturned(o));
        }
        self.append_all(f, returned).await
    }

    async fn run_one(&self, ctx: &ToolContext, r: &ToolRun) -> Result<ToolReturned> {
        let out = if self.tools.get(&r.tool).is_some() {
            self.tools.run(ctx, &r.tool, &r.args).await
        } else {
            skein_tools::ToolOutcome {
                output: format!("tool `{}` is not available on this worker", r.tool),
                error: true,
                ms: 0,
            }
        };
        let (output, blob) = if out.output.len() > self.cfg.blob_threshold {
            let hash = self.backend.blobs.put(out.output.as_bytes()).await?;
            let mut cut = self.cfg.blob_threshold;
            while !out.output.is_char_boundary(cut) {
                cut -= 1;
            }
            // A file read as text maps shown bytes to file bytes one to one, unless invalid
            // bytes were replaced: then only the way on is named, not the number.
            let shown = &out.output[..cut];
            let read_on = if r.tool != "read_file" || out.error {
                String::new()
            } else if shown.contains('\u{FFFD}') {
                "; read_file reads on from a later `offset`".to_string()
            } else {
                let from = r.args.get("offset").and_then(Value::as_u64).unwrap_or(0);
                format!("; read on with offset {}", from.saturating_add(cut as u64))
            };
            let preview = format!(
                "{shown}\n… [{} bytes in all, only the first {cut} shown here; the rest is not \
                 shown (stored as blob {hash}){read_on}]",
                out.output.len()
            );
            (
                preview,
                Some(BlobRef {
                    hash,
                    size: out.output.len() as u64,
                }),
            )
        } else {
            (out.output, None)
        };
        Ok(ToolReturned {
            call: r.call.clone(),
            output,
            error: out.error,
            ms: out.ms,
            blob,
        })
    }

    /// Records `ChildSettled` for every child of the turn that has ended. A cold load
    /// checks every outstanding child (healing a notice lost in a crash, and re-waking a
    /// child whose job was lost); afterwards only the notices are read.
    async fn collect_settlements(
        &self,
        f: &mut Folded,
        cold: bool,
        pushed: &BTreeSet<SessionId>,
    ) -> Result<usize> {
        let mut outstanding: HashMap<SessionId, Vec<String>> = HashMap::new();
        let mut shared = vec![];
        for slot in &f.state.turn {
            if let skein_core::state::SlotState::Delegated {
                child, shared: s, ..
            } = &slot.state
            {
                outstanding
                    .entry(child.clone())
                    .or_default()
                    .push(slot.call.id.clone());
                if *s {
                    shared.push(child.clone());
                }
            }
        }
        if outstanding.is_empty() {
            return Ok(0);
        }
        let notes = self.backend.notices.read(&f.id, f.cursor).await?;
        if let Some((pos, _)) = notes.last() {
            f.cursor = *pos;
        }
        // Shared runs are few and may have ended before we started watching them: always
        // look at them directly.
        let mut candidates: Vec<SessionId> = if cold {
            outstanding.keys().cloned().collect()
        } else {
            notes
                .into_iter()
                .map(|(_, c)| c)
                .filter(|c| outstanding.contains_key(c))
                .collect()
        };
        candidates.extend(shared);
        candidates.sort();
        candidates.dedup();
        let lasts = join_all(candidates.iter().map(|c| self.backend.log.last(c))).await;
        let mut events = vec![];
        let mut repush = vec![];
        // Result patches of this batch merge one after the other.
        let mut plan = f.state.plan.clone();
        for (child, last) in candidates.iter().zip(lasts) {
            let Some(calls) = outstanding.get(child) else {
                continue;
            };
            match last? {
                Some(rec) => match match outcome_of(&rec.env.body) {
                    Some(o) => Some(o),
                    None => self.needs_input(child).await?,
                } {
                    Some(mut outcome) => {
                        self.result_patch(f, child, &mut outcome, &mut plan, &mut events);
                        for call in calls {
                            events.push(Event::ChildSettled(ChildSettled {
                                call: call.clone(),
                                child: child.clone(),
                                outcome: outcome.clone(),
                            }));
                        }
                    }
                    None if cold && !pushed.contains(child) => repush.push(child.clone()),
                    None => {}
                },
                None => tracing::warn!(session = %f.id, %child, "delegated child has no log"),
            }
        }
        // A cold load cannot know whether the jobs of children still running were ever
        // published (a crash may have come between `Delegated` and the push): push them
        // again, many at a time. A push of a job that exists only leaves a wake marker.
        let pushes = futures::stream::iter(repush.into_iter().map(|child| async move {
            let first = self.backend.log.read(&child, 1).await?;
            let pool = first
                .first()
                .and_then(|r| match &r.env.body {
                    Event::Submitted(s) => s.pool.clone(),
                    _ => None,
                })
                .unwrap_or_else(|| DEFAULT_POOL.into());
            self.backend.jobs.push(&pool, &child).await
        }))
        .buffer_unordered(32)
        .collect::<Vec<Result<()>>>()
        .await;
        for p in pushes {
            p?;
        }
        let n = events.len();
        self.append_all(f, events).await?;
        Ok(n)
    }

    /// A child handed tasks of this session's plan may end its answer with a ```patch
    /// block: it is merged here, before the child's `ChildSettled`, and the verdict joins
    /// the outcome the model is shown (`patch`). Recorded once: a verdict already in the
    /// log is reused.
    fn result_patch(
        &self,
        f: &Folded,
        child: &SessionId,
        outcome: &mut Outcome,
        plan: &mut skein_core::plan::Plan,
        events: &mut Vec<Event>,
    ) {
        use skein_core::event::{PatchApplied, PatchRejected};
        use skein_core::plan::{verdict_json, Author, Rejection};
        let Outcome::Completed { answer, patch, .. } = outcome else {
            return;
        };
        let from = child.to_string();
        if plan.owned_by(&from).is_empty() {
            return;
        }
        let Some(read) = skein_core::plan::patch_in_answer(answer) else {
            return;
        };
        let key = skein_core::state::verdict_key(&from, skein_core::state::RESULT_PATCH);
        let verdict = match (f.state.plan_verdicts.get(&key), read) {
            (Some(v), _) => v.clone(),
            (None, Err(reason)) => Err(Rejection::Invalid { reason }),
            (None, Ok(p)) => {
                let agent = f
                    .state
                    .children
                    .values()
                    .find(|c| &c.child == child)
                    .map(|c| c.agent.clone())
                    .unwrap_or_default();
                let author = Author::Delegate {
                    session: &from,
                    agent: &agent,
                };
                let v = plan.merge(author, &p, self.cfg.limits.plan_unlink);
                let verdict = v.as_ref().map(|n| n.version).map_err(Clone::clone);
                events.push(match &v {
                    Ok(next) => Event::PatchApplied(PatchApplied {
                        from: from.clone(),
                        agent,
                        call: None,
                        base_version: p.base_version,
                        ops: p.ops,
                        version: next.version,
                    }),
                    Err(reason) => Event::PatchRejected(PatchRejected {
                        from: from.clone(),
                        agent,
                        call: None,
                        base_version: p.base_version,
                        reason: reason.clone(),
                    }),
                });
                if let Ok(next) = v {
                    *plan = next;
                }
                verdict
            }
        };
        *patch = Some(verdict_json(&verdict).0);
    }

    /// The outcome a parent is shown for a child paused on a question: the questions and a
    /// token to resume it with.
    async fn needs_input(&self, child: &SessionId) -> Result<Option<Outcome>> {
        let (cf, _) = self.load(child).await?;
        let out = (cf.state.status == Status::AwaitingInput)
            .then(|| cf.state.pending_inputs.first().cloned())
            .flatten()
            .map(|p| Outcome::NeedsInput {
                questions: p.questions.clone(),
                context: p.context.clone(),
                defaults: p.defaults.clone(),
                // The log keeps the token's id; the parent's model is shown the token.
                token: String::new(),
                token_id: p.token_id.clone(),
                seq: p.seq,
            });
        self.keep(cf);
        Ok(out)
    }

    /// What happens once a session has ended: cache its answer, wake its parent, announce
    /// a root. Idempotent: a redelivered job does it again harmlessly.
    async fn on_terminal(&self, f: &Folded) -> Result<()> {
        let Some(sub) = &f.state.submitted else {
            return Ok(());
        };
        // Only the answer to the mission that was hashed is cached, never one to a
        // follow-up question (`chat: true`).
        if f.state.status == Status::Completed && !sub.no_cache && f.state.follow_ups == 0 {
            let def = self.def_for(&f.state).await?;
            if self.agents.caching(&def).cached {
                let ttl = match &def.front.cache {
                    Some(skein_core::agent::CacheSetting::Ttl { ttl }) => {
                        // Checked when the definition was parsed.
                        skein_core::duration::parse(ttl).ok().or(self.cfg.cache_ttl)
                    }
                    _ => self.cfg.cache_ttl,
                };
                let now = now_ms();
                let entry = CacheEntry {
                    answer: f.state.answer.clone().unwrap_or_default(),
                    usage: f.state.usage_total(),
                    source: f.id.clone(),
                    steps: f.state.steps,
                    created: now,
                    expires: ttl.map(|t| now + t.as_millis() as u64),
                };
                self.backend.cache.put(&sub.mission_hash, &entry).await?;
            }
        }
        self.backend
            .cache
            .release_inflight(&sub.mission_hash, &f.id)
            .await?;
        for (w, pool) in self.backend.notices.watchers(&f.id).await? {
            self.backend.notices.post(&w, &f.id).await?;
            self.backend.jobs.push(&pool, &w).await?;
        }
        match &sub.parent {
            Some(p) => {
                self.backend.notices.post(&p.session, &f.id).await?;
                let pool = p.pool.clone().unwrap_or_else(|| DEFAULT_POOL.into());
                self.backend.jobs.push(&pool, &p.session).await?;
            }
            None => {
                if let Some(a) = &self.backend.announcer {
                    let r = RootResult {
                        session: f.id.to_string(),
                        status: f.state.status.as_str().to_string(),
                        answer: f.state.answer.clone(),
                        error: f.state.error.clone(),
                        usage: f.state.usage_total(),
                    };
                    a.root_finished(&r).await?;
                }
            }
        }
        Ok(())
    }

    /// Roots of the trees that sessions of `scope` wait on through a shared run
    /// (single-flight) and that are not in it yet.
    async fn shared_trees(&self, scope: &Scope) -> Result<Vec<SessionId>> {
        let mut out = BTreeSet::new();
        for root in scope.roots() {
            for id in self.backend.log.tree(&root).await? {
                let records = self.backend.log.read(&id, 1).await?;
                let mut f = Folded::new(id.clone());
                f.absorb(&records)?;
                for slot in &f.state.turn {
                    if let skein_core::state::SlotState::Delegated {
                        child,
                        shared: true,
                        ..
                    } = &slot.state
                    {
                        if !scope.wants(child) {
                            out.insert(child.root_id());
                        }
                    }
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Re-enqueues every session of the tree that has not ended (what makes `resume`
    /// work after a crash). Returns how many were enqueued.
    pub async fn requeue_tree(&self, root: &SessionId) -> Result<usize> {
        let mut n = 0;
        for id in self.backend.log.tree(root).await? {
            let (f, _) = self.load(&id).await?;
            let pool = f
                .state
                .submitted
                .as_ref()
                .and_then(|s| s.pool.clone())
                .unwrap_or_else(|| DEFAULT_POOL.into());
            let terminal = f.state.status.is_terminal();
            // A finished child whose parent may not have heard of it is woken too.
            if !terminal
                || f.state
                    .submitted
                    .as_ref()
                    .is_some_and(|s| s.parent.is_some())
            {
                self.backend.jobs.push(&pool, &id).await?;
                n += 1;
            }
            self.keep(f);
        }
        Ok(n)
    }

    /// Runs workers in this process until the tree of `root` ends or has nothing left to
    /// run (paused for a person, or stuck); returns the root's final fold. Only this
    /// tree's jobs are taken (and those of a tree holding a run it shares): other trees
    /// waiting in the same queue stay as they are until they are run themselves.
    pub async fn run_tree(
        self: &Arc<Self>,
        root: &SessionId,
        concurrency: usize,
    ) -> Result<Folded> {
        let pools = self.pools();
        let scope = Arc::new(Scope::new(root));
        let (stop, handles) = self.spawn_in(pools.clone(), concurrency, Some(scope.clone()));
        let mut rx = self.subscribe();
        // Watch the root's last record (not the fold cache the workers use).
        let result: Result<()> = async {
            loop {
                let last = self.backend.log.last(root).await?;
                if last.as_ref().is_some_and(|r| r.env.body.is_terminal()) {
                    return Ok(());
                }
                let mut pending = 0;
                let s = scope.clone();
                let want = move |id: &SessionId| s.wants(id);
                for p in &pools {
                    pending += self.backend.jobs.depth_matching(p, &want).await?;
                }
                if pending == 0 {
                    // Nothing left here: unless a session waits on a run in another
                    // tree, which then joins the scope, the tree is paused or stuck.
                    let more = self.shared_trees(&scope).await?;
                    if more.is_empty() {
                        return Ok(());
                    }
                    scope.extend(more);
                    continue;
                }
                let _ = tokio::time::timeout(Duration::from_millis(250), rx.recv()).await;
            }
        }
        .await;
        let _ = stop.send(true);
        for h in handles {
            let _ = h.await;
        }
        result?;
        let records = self.backend.log.read(root, 1).await?;
        let mut f = Folded::new(root.clone());
        f.absorb(&records)?;
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_tool_called_free_of_side_effects_is_declared_idempotent() {
        let cfg = skein_tools::ToolsConfig::default();
        let tools = ToolBox::builtin(&cfg);
        let mut checked = 0;
        for name in skein_core::agent::SIDE_EFFECT_FREE_TOOLS {
            if tools.get(name).is_some() {
                assert!(tools.idempotent(name), "{name}");
                checked += 1;
            }
        }
        assert_eq!(checked, 3, "read_file, list_dir and search_files");
        for name in tools.names() {
            if !tools.idempotent(&name) {
                assert!(
                    !skein_core::agent::SIDE_EFFECT_FREE_TOOLS.contains(&name.as_str()),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn outages_back_off_long_enough_to_outlast_a_leader_election() {
        let down = Error::Backend("request timed out".into());
        let waits: Vec<Duration> = (1..=5).map(|a| retry_delay(&down, a)).collect();
        assert!(waits.windows(2).all(|w| w[1] == w[0] * 2), "{waits:?}");
        // The five deliveries before a dead letter span well over ten seconds.
        assert!(waits.iter().sum::<Duration>() >= Duration::from_secs(15));
        let conflict = Error::Conflict {
            session: "s".into(),
            expected: 1,
            actual: 2,
        };
        assert!(retry_delay(&conflict, 1) <= Duration::from_millis(100));
        assert!(retry_delay(&down, 60) <= Duration::from_secs(40));
    }
}
