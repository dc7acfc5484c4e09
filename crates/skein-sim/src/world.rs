//! One simulated run: a catalogue of agents on the scripted model, several workers of the
//! real runtime on one in-memory store, trees submitted, workers killed at random moments
//! and started again, until every tree has ended or the virtual time is up.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{AgentSet, ModelRequest, Record, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::{Completion, Provider, Registry};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_tools::{ToolBox, ToolsConfig};
use tokio::task::JoinHandle;

use crate::disk::{Disk, DiskRates};
use crate::faults::{Faults, Rates, Rng};
use crate::gen::Scenario;
use crate::memory::MemStore;

/// The agents of the simulated world: delegation fan-out with tools, a handoff chain and
/// advisors. Each runs `scripted:<name>`.
pub const AGENTS: &[(&str, &str, &str)] = &[
    (
        "boss",
        "agents: [helper, drafter, manager]\n",
        r#"turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: helper, mission: "first part of {{ mission }}"}
      - tool: call_agent
        args: {agent: helper, mission: "second part of {{ mission }}"}
      - tool: call_agent
        args: {agent: drafter, mission: "draft {{ mission }}"}
  - tool_calls:
      - tool: call_agent
        args: {agent: manager, mission: "decide on the plan"}
  - answer: "done: {{ all_results | length }} results"
"#,
    ),
    (
        "helper",
        "tools: [list_dir, append_note]\ncache: false\nlimits: {timeout: 8s}\n",
        r#"turns:
  - tool_calls:
      - tool: list_dir
        args: {path: "."}
  - tool_calls:
      - tool: append_note
        args: {text: "notes on {{ mission }}"}
  - answer: "helped with {{ mission }}"
"#,
    ),
    (
        "drafter",
        "handoff: editor\n",
        "turns:\n  - answer: \"draft of {{ mission }}\"\n",
    ),
    (
        "editor",
        "",
        "turns:\n  - answer: \"edited: {{ mission | length }} chars\"\n",
    ),
    (
        "manager",
        "advisors: [legal, ops]\n",
        "turns:\n  - answer: \"decided after {{ prompt | length }} chars of advice\"\n",
    ),
    ("legal", "", "turns:\n  - answer: \"legal: fine\"\n"),
    ("ops", "", "turns:\n  - answer: \"ops: fine\"\n"),
    (
        "clerk",
        "agents: [asker]\ntools: [ask_user, write_file]\n",
        r#"turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: asker, mission: "set up the project"}
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{key: version, question: "{{ results[0].need_user_input.questions[0].question }}"}]
          context: "my helper asks"
  - tool_calls:
      - tool: call_agent
        args:
          resume_token: "{{ all_results[0].resume_token }}"
          answers: {version: "{{ results[0].answers.version }}"}
  - tool_calls:
      - tool: write_file
        args: {path: "notes.txt", content: "{{ results[0].result }}"}
  - answer: "clerk: {{ results[0] }}"
"#,
    ),
    (
        "asker",
        "tools: [ask_user]\n",
        r#"turns:
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{key: version, question: "Which version?"}]
  - answer: "asker used {{ results[0].answers.version }}"
"#,
    ),
    (
        "squad",
        "team: {members: [scout, builder], supervisor: chief}\n",
        "turns:\n  - answer: unused\n",
    ),
    (
        "scout",
        "",
        r#"turns:
  - tool_calls:
      - tool: team_broadcast
        args: {message: "found it"}
  - answer: "scout done"
"#,
    ),
    (
        "builder",
        "",
        r#"latency_ms: 3000
turns:
  - tool_calls:
      - tool: team_broadcast
        args: {message: "built"}
  - answer: "builder done"
"#,
    ),
    (
        "chief",
        "",
        r#"turns:
  - choose:
      - when: "'`scout` (exit)' in (user_messages | join(' '))"
        answer: "decided"
      - tool_calls:
          - tool: team_broadcast
            args: {message: "go on"}
  - answer: "decided"
"#,
    ),
];

/// How many trees of `boss` a run submits (then one of `squad` and two of `clerk`), and how
/// many worker processes it keeps.
pub const TREES: usize = 3;
pub const WORKERS: usize = 2;
/// How long a claimed job is held without a heartbeat.
pub const LEASE: Duration = Duration::from_secs(5);
/// Virtual time a run may take before a tree that has not ended is a violation.
pub const TIME_LIMIT: Duration = Duration::from_secs(30 * 60);
/// Virtual time after it, with no fault and nobody at the inbox, for a tree between two
/// steps to end or come to rest waiting on a person (a lease, a retry's wait, a sweep
/// after trouble).
pub const SETTLE: Duration = Duration::from_secs(30);
/// Virtual time after it, with no fault and every item of the inbox answered, for the
/// trees still open to end.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(10 * 60);
/// The chance, per scheduler tick, that an operator cancels an open session inside a tree
/// (with `Setup::inner_cancels`).
pub const INNER_CANCEL: f64 = 0.03;

/// The chance that a person's turn at the inbox answers an item of an earlier listing
/// (with `Setup::stale_tokens`).
pub const STALE_ANSWER: f64 = 0.25;
/// A generated world's time limit: its slowest script takes seconds a turn.
pub const GENERATED_TIME_LIMIT: Duration = Duration::from_secs(10 * 60);
/// A generated world's drain: a minute of answering everything.
pub const GENERATED_DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// A scripted model that fails some calls the way a provider's outage does (retryable).
struct Flaky {
    inner: ScriptedProvider,
    faults: Arc<Faults>,
    lease: Duration,
}

#[async_trait]
impl Provider for Flaky {
    async fn complete(&self, model: &str, req: &ModelRequest) -> skein_llm::Result<Completion> {
        if let Some(slow) = self.faults.slow_call(self.lease) {
            tokio::time::sleep(slow).await;
        }
        if self.faults.model_fails() {
            return Err(skein_llm::Error::Connect("simulated outage".into()));
        }
        self.inner.complete(model, req).await
    }
}

/// A tool with a side effect that must not happen twice: it appends a note, and counts
/// its runs by session. The log says how often a call was started; this says how often
/// the tool really ran.
struct AppendNote {
    runs: Arc<std::sync::Mutex<BTreeMap<SessionId, u32>>>,
    faults: Arc<Faults>,
}

#[async_trait]
impl skein_tools::Tool for AppendNote {
    fn name(&self) -> &str {
        "append_note"
    }
    fn description(&self) -> &str {
        "Appends a note to the tree's log book (not idempotent)."
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": false
        })
    }
    async fn call(
        &self,
        ctx: &skein_tools::ToolContext,
        _args: serde_json::Value,
    ) -> skein_tools::Result<String> {
        // Slow now and then: up to twice the lease, so a lost heartbeat may hand the job
        // to another worker while this one is still writing.
        if let Some(slow) = self.faults.slow_call(LEASE) {
            tokio::time::sleep(slow).await;
        }
        *self
            .runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(ctx.session.clone())
            .or_default() += 1;
        Ok("noted".into())
    }
}

/// What one run saw: its trees, every log at the end, and what struck it.
pub struct Run {
    pub roots: Vec<SessionId>,
    /// The limits every worker ran with (replay decides under the same).
    pub limits: skein_core::Limits,
    pub logs: BTreeMap<SessionId, Vec<Record>>,
    pub agents: Arc<AgentSet>,
    pub store: Arc<MemStore>,
    pub faults: Arc<Faults>,
    /// Virtual ms of each worker kill.
    pub crashes: Vec<u64>,
    /// Virtual ms of each restart of the whole process after a failed sync.
    pub restarts: Vec<u64>,
    /// Trees an operator cancelled.
    pub cancelled: Vec<SessionId>,
    /// What the person did, and what a used token got when it was sent again.
    pub person: Person,
    /// How often `append_note` (not idempotent) really ran, by session.
    pub writes: BTreeMap<SessionId, u32>,
    pub virtual_ms: u64,
    /// The queues when the run stopped (taken in virtual time).
    pub jobs_at_end: Vec<String>,
    /// Trees that had not ended when the run's time was up, with nothing of theirs in
    /// the inbox: nobody could have moved them on.
    pub unlisted: Vec<SessionId>,
    /// The shared limiter of a world with a declared quota.
    pub quota: Option<Arc<crate::quota::SimQuota>>,
    /// The definition versions and the workers' differences, when the run has them.
    pub mix: Option<Arc<crate::versions::Mix>>,
    pub _dir: tempfile::TempDir,
}

/// The fixed world: the agents of [`AGENTS`]; `TREES` trees of `boss` (the second on a
/// budget it may run out of), one of `squad` and two of `clerk`.
pub fn fixed() -> Scenario {
    Scenario {
        agents: AGENTS
            .iter()
            .map(|(name, front, script)| crate::gen::Agent {
                name: name.to_string(),
                front: front.to_string(),
                script: script.to_string(),
            })
            .collect(),
        extra_tools: vec!["append_note".into()],
        trees: (0..TREES + 3)
            .map(|i| crate::gen::Tree {
                agent: match i {
                    i if i < TREES => "boss",
                    i if i == TREES => "squad",
                    _ => "clerk",
                }
                .into(),
                mission: format!("topic {i}"),
                budget: (i == 1).then_some(700),
            })
            .collect(),
        approval_required: vec!["write_file".into()],
        quota: None,
    }
}

/// How a world runs: the faults (none, the plain rates, or a swarm's drawn from the
/// seed) and whether its trees may use the cache.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub swarm: bool,
    /// No fault at all, and a person who acts on every tick (a reference run).
    pub calm: bool,
    pub no_cache: bool,
    /// Virtual time the trees have before the liveness check.
    pub time_limit: Duration,
    /// Virtual time after it for the trees to end once everything is answered.
    pub drain_limit: Duration,
    /// The log lies on a disk that fails, fills and rots (`disk.rs`); not in a calm run.
    pub disk: bool,
    /// An operator also cancels sessions inside trees (`skein cancel` of a child: its
    /// subtree ends, its parent goes on), drawn from a stream of their own; not in a calm
    /// run.
    pub inner_cancels: bool,
    /// The person also answers, now and then, an item of an earlier look at the inbox
    /// (drawn from a stream of their own): its session may since have ended (cancelled,
    /// timed out, cut off by its team's end), and then the answer must be refused. Not in
    /// a calm run.
    pub stale_tokens: bool,
    /// The trees are submitted over a few virtual seconds (each after a pause drawn from
    /// a stream of its own) rather than all at once, so that a later tree meets the cache
    /// entries of an earlier one old, or expired.
    pub spread: bool,
}

impl Setup {
    /// A generated world's run under the seed's faults (`swarm`: rates drawn per seed),
    /// with the disk's faults or without.
    pub fn generated(swarm: bool, disk: bool) -> Self {
        Self {
            swarm,
            calm: false,
            no_cache: false,
            time_limit: GENERATED_TIME_LIMIT,
            drain_limit: GENERATED_DRAIN_LIMIT,
            disk,
            inner_cancels: false,
            stale_tokens: false,
            spread: false,
        }
    }
}

struct Worker {
    stop: tokio::sync::watch::Sender<bool>,
    handles: Vec<JoinHandle<()>>,
}

impl Worker {
    /// A kill -9: every task of the process is dropped at whatever await it stands.
    fn kill(self) {
        let _ = self.stop.send(true);
        for h in self.handles {
            h.abort();
        }
    }
}

/// Runs one seed's fixed world to its end (on the current, paused, runtime), with the
/// disk's faults or without.
pub async fn run(seed: u64, swarm: bool, disk: bool) -> Run {
    let setup = Setup {
        swarm,
        calm: false,
        no_cache: false,
        time_limit: TIME_LIMIT,
        drain_limit: DRAIN_LIMIT,
        disk,
        inner_cancels: false,
        stale_tokens: false,
        spread: false,
    };
    run_scenario(seed, setup, &fixed())
        .await
        .expect("the simulation's agents load")
}

/// Runs a world to its end; an agent set the loader refuses is returned as its error.
pub async fn run_scenario(seed: u64, setup: Setup, scenario: &Scenario) -> Result<Run, String> {
    run_mixed(seed, setup, scenario, None).await
}

/// [`run_scenario`], with definition versions and workers that differ (`mix`) or without.
pub async fn run_mixed(
    seed: u64,
    setup: Setup,
    scenario: &Scenario,
    mix: Option<Arc<crate::versions::Mix>>,
) -> Result<Run, String> {
    let files = mix
        .as_ref()
        .map_or_else(|| scenario.files(), |m| m.local_files.clone());
    let agents =
        Arc::new(AgentSet::load(&files, &scenario.extra_tools).map_err(|e| e.to_string())?);
    let mut rng = Rng::new(seed);
    let rates = if setup.calm {
        Rates::NONE
    } else if setup.swarm {
        Rates::swarm(&mut rng)
    } else {
        Rates::DEFAULT
    };
    let faults = Arc::new(Faults::new(rates, rng));
    // Cancels inside trees come from a stream of their own, so that the other faults of a
    // seed fall as they do without them (until the first such cancel changes the world).
    let mut inner = (setup.inner_cancels && !setup.calm).then(|| Rng::new(seed ^ 0x1ce_ca9c));
    let clock = Arc::new(crate::faults::SimClock::new(seed));
    let dir = tempfile::tempdir().expect("a scratch directory");
    for a in &scenario.agents {
        std::fs::write(dir.path().join(format!("{}.yaml", a.name)), &a.script).expect("script");
    }
    let disk = (setup.disk && !setup.calm).then(|| {
        let mut rng = Rng::new(seed ^ 0xd15c_d15c);
        let rates = if setup.swarm {
            DiskRates::swarm(&mut rng)
        } else {
            DiskRates::DEFAULT
        };
        Disk::start(rates, faults.clone(), rng)
    });
    let store = MemStore::on_disk(LEASE, faults.clone(), dir.path().join("ws"), disk);
    if mix.is_some() {
        store.shuffle_claims();
    }
    let mut tools_cfg = ToolsConfig::default();
    tools_cfg.http.enabled = false;
    let writes = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let quota = scenario
        .quota
        .map(|l| crate::quota::SimQuota::new(l, clock.clone()));
    let toolbox = || {
        let mut b = ToolBox::builtin(&tools_cfg);
        b.insert(Arc::new(AppendNote {
            runs: writes.clone(),
            faults: faults.clone(),
        }));
        b
    };
    let start = |n: usize| -> (Arc<Runtime>, Worker) {
        let mut models = Registry::new();
        let scripted = || {
            Arc::new(Flaky {
                inner: ScriptedProvider::new(dir.path()).on_tokio_clock(),
                faults: faults.clone(),
                lease: LEASE,
            })
        };
        models.insert("scripted", scripted());
        let quota_model = quota.as_ref().map(|q| {
            models.insert(crate::quota::PROVIDER, q.provider(scripted()));
            models.set_limits(
                crate::quota::PROVIDER,
                crate::quota::declared(&q.limits),
                BTreeMap::new(),
            );
            q.clone()
        });
        let mut cfg = RuntimeConfig {
            worker_id: format!("w{n}"),
            lease: LEASE,
            clock: clock.clone(),
            // One secret for the cluster, as its workers share one: a token from one
            // worker's inbox is checked by another.
            token_secret: skein_runtime::secret::Secret(b"simulated cluster".to_vec()),
            // Half the worlds record a turn's delegations one batch after another (the
            // first of one call), so that crashes and faults fall between the batches.
            delegation_batch: if seed % 2 == 1 { 1 } else { 0 },
            ..RuntimeConfig::default()
        };
        // The person approves or denies writes; nothing else waits for approval.
        cfg.limits.approval_required = scenario.approval_required.clone();
        let (agents, tools, mut backend) = match &mix {
            Some(m) => m.worker(
                &cfg.worker_id,
                agents.clone(),
                &mut models,
                scripted(),
                toolbox(),
                &store,
            ),
            None => (agents.clone(), toolbox(), store.backend()),
        };
        if let Some(q) = quota_model {
            backend.quota = Some(q);
        }
        let rt = Runtime::new(backend, agents, models, tools, cfg);
        if let Some(m) = &mix {
            m.started(&rt);
        }
        let (stop, handles) = rt.spawn_workers(vec!["default".into()], 4);
        (rt.clone(), Worker { stop, handles })
    };
    // The worker an operator's commands go through: one that reads every record.
    let reader = |runtimes: &[Arc<Runtime>]| mix.as_ref().map_or(0, |m| m.reader(runtimes));
    let mut workers: Vec<Worker> = vec![];
    let mut runtimes = vec![];
    for n in 0..WORKERS {
        let (rt, w) = start(n);
        runtimes.push(rt);
        workers.push(w);
    }
    let mut next_worker = WORKERS;
    let t0 = tokio::time::Instant::now();
    let mut restarts = vec![];
    // A sync of the log failed and the store stopped (fail-stop): the process exits, and
    // is started again a little later on what the disk kept, waking every open tree as
    // `skein resume` does.
    macro_rules! restart_if_stopped {
        () => {
            if store.disk().is_some_and(|d| d.stopped()) {
                if let Some(q) = &quota {
                    q.killing();
                }
                for w in workers.drain(..) {
                    w.kill();
                }
                if let Some(m) = &mix {
                    runtimes.iter().for_each(|rt| m.gone(rt));
                }
                runtimes.clear();
                restarts.push(t0.elapsed().as_millis() as u64);
                tokio::time::sleep(Duration::from_millis(200 + faults.draw(1800))).await;
                store.reopen();
                for _ in 0..WORKERS {
                    let (rt, w) = start(next_worker);
                    next_worker += 1;
                    runtimes.push(rt);
                    workers.push(w);
                }
                for _ in 0..20 {
                    match runtimes[reader(&runtimes)].sweep_open_trees().await {
                        Err(e) if e.is_retryable() => {
                            tokio::time::sleep(Duration::from_millis(100)).await
                        }
                        _ => break,
                    }
                }
            }
        };
    }
    // Submitters retry while the backend is unreachable, as a client would.
    let mut roots = vec![];
    let mut spread = (setup.spread && !setup.calm).then(|| Rng::new(seed ^ 0x5bead));
    for (i, tree) in scenario.trees.iter().enumerate() {
        if let Some(rng) = spread.as_mut().filter(|_| i > 0) {
            tokio::time::sleep(Duration::from_millis(rng.below(4000))).await;
            restart_if_stopped!();
        }
        let sub = Submission {
            agent: tree.agent.clone(),
            mission: tree.mission.clone(),
            id: Some(format!("tree-{i}")),
            budget: tree.budget.map(|t| skein_core::Budget {
                tokens: Some(t),
                max_steps: None,
            }),
            no_cache: setup.no_cache,
            ..Default::default()
        };
        loop {
            match runtimes[0].submit(sub.clone()).await {
                Ok(id) => {
                    roots.push(id);
                    break;
                }
                Err(e) if e.is_retryable() => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    restart_if_stopped!();
                }
                Err(e) => panic!("submission refused: {e}"),
            }
        }
    }
    let mut crashes = vec![];
    let mut cancelled = vec![];
    let mut person = Person {
        stale: (setup.stale_tokens && !setup.calm).then(|| Rng::new(seed ^ 0x57a1_e70c)),
        ..Person::default()
    };
    loop {
        tokio::time::sleep(Duration::from_millis(50 + faults.draw(400))).await;
        restart_if_stopped!();
        if let Some(m) = &mix {
            let t = t0.elapsed().as_millis() as u64;
            m.tick(t, &runtimes, &store, &mut roots).await;
        }
        let pending = mix.as_ref().is_some_and(|m| m.pending());
        if (roots_ended(&store, &roots) && !pending)
            || t0.elapsed() > crate::quota::extend(quota.as_deref(), setup.time_limit)
        {
            break;
        }
        if faults.cancel() {
            let open: Vec<&SessionId> = roots.iter().filter(|r| !store.ended(r)).collect();
            if !open.is_empty() {
                let r = open[faults.draw(open.len() as u64) as usize].clone();
                let rt = &runtimes[faults.draw(runtimes.len() as u64) as usize];
                operator_cancel(rt, &r).await;
                cancelled.push(r);
            }
        }
        if let Some(rng) = inner.as_mut().filter(|_| faults.on()) {
            if rng.chance(INNER_CANCEL) {
                let open: Vec<SessionId> = store
                    .logs()
                    .into_iter()
                    .filter(|(id, log)| {
                        !id.is_root() && log.last().is_some_and(|r| !r.env.body.is_terminal())
                    })
                    .map(|(id, _)| id)
                    .collect();
                if !open.is_empty() {
                    let s = open[rng.below(open.len() as u64) as usize].clone();
                    let rt = &runtimes[rng.below(runtimes.len() as u64) as usize];
                    operator_cancel(rt, &s).await;
                    cancelled.push(s);
                }
            }
        }
        if faults.person() {
            let rt = runtimes[faults.draw(runtimes.len() as u64) as usize].clone();
            person.act(&rt, &store, &roots, &faults).await;
        }
        if faults.crash() {
            let k = faults.draw(workers.len() as u64) as usize;
            if let Some(q) = &quota {
                q.killing();
            }
            if let Some(m) = &mix {
                m.gone(&runtimes[k]);
            }
            workers.remove(k).kill();
            runtimes.remove(k);
            crashes.push(t0.elapsed().as_millis() as u64);
            let (rt, w) = start(next_worker);
            next_worker += 1;
            runtimes.push(rt);
            workers.push(w);
        }
    }
    // Liveness: a tree that has not ended must wait on something a person can see. Then
    // the person answers and approves everything, with no fault, until every tree ends.
    faults.stop();
    restart_if_stopped!();
    // A tree may be between two steps when the faults stop (a person answered it just
    // before): it has a little while, with nobody at the inbox, to end or come to rest
    // waiting on a person. One that does neither is stuck.
    let settling = tokio::time::Instant::now();
    let unlisted = loop {
        let mut unlisted = vec![];
        for root in roots.iter().filter(|r| !store.ended(r)) {
            let items = skein_runtime::hitl::inbox(
                &runtimes[reader(&runtimes)],
                std::slice::from_ref(root),
            )
            .await
            .unwrap_or_default();
            if items.is_empty() && !crate::quota::waits(quota.as_deref(), root).await {
                unlisted.push(root.clone());
            }
        }
        if unlisted.is_empty() || settling.elapsed() >= SETTLE {
            break unlisted;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        restart_if_stopped!();
    };
    let drained = tokio::time::Instant::now();
    let drain_limit = crate::quota::drain_limit(quota.as_deref(), setup.drain_limit);
    // Every tree ends, and its ending is announced (the worker that ended the root
    // announces it in the same job; a job that failed at it runs again).
    while !roots_announced(&store, &roots) && drained.elapsed() < drain_limit {
        let open: Vec<SessionId> = roots.iter().filter(|r| !store.ended(r)).cloned().collect();
        person.answer_all(&runtimes[reader(&runtimes)], &open).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        restart_if_stopped!();
    }
    let virtual_ms = t0.elapsed().as_millis() as u64;
    for w in workers {
        w.kill();
    }
    let logs = store.logs();
    let jobs_at_end = store.jobs_report();
    let writes = writes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let limits = skein_core::Limits {
        approval_required: scenario.approval_required.clone(),
        ..skein_core::Limits::default()
    };
    Ok(Run {
        roots,
        limits,
        logs,
        agents,
        store,
        faults,
        crashes,
        restarts,
        cancelled,
        person,
        writes,
        virtual_ms,
        jobs_at_end,
        unlisted,
        quota,
        mix,
        _dir: dir,
    })
}

/// An operator's `skein cancel` of `id` (a tree, or a session inside one), tried again
/// while the backend is unreachable.
async fn operator_cancel(rt: &Runtime, id: &SessionId) {
    for _ in 0..20 {
        match skein_runtime::control::cancel(rt, id, "cancelled by an operator").await {
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => break,
        }
    }
}

fn roots_ended(store: &MemStore, roots: &[SessionId]) -> bool {
    roots.iter().all(|r| store.ended(r))
}

fn roots_announced(store: &MemStore, roots: &[SessionId]) -> bool {
    roots.iter().all(|r| store.announced(r))
}

/// A person at the inbox: answers questions and decides approvals whenever the seed says,
/// sends a used token again now and then (it must be refused), and retries what failed
/// because the backend was unreachable on a later turn, as anyone would. With a stream
/// of its own (`Setup::stale_tokens`) it also answers, now and then, an item it listed
/// earlier and may have left on the screen while its session ended.
#[derive(Debug, Default)]
pub struct Person {
    pub answers: u32,
    pub approvals: u32,
    pub denials: u32,
    /// Tokens this person used, and how often one was accepted again (never, or a bug).
    used: Vec<(String, bool)>,
    pub reused_accepted: u32,
    pub reuse_tries: u32,
    /// Draws for answering earlier listings, and the items of those listings (at most
    /// [`KEPT_ITEMS`], the newest).
    pub stale: Option<Rng>,
    kept: Vec<skein_runtime::hitl::InboxItem>,
    /// Items of an earlier listing answered, and how many of those answers were taken.
    /// Taken is right while the item's session still waits on it; the logs' invariants
    /// find one taken after its session ended (no record follows an end).
    pub stale_tries: u32,
    pub stale_taken: u32,
    /// Of those tries, the ones at a session that had already ended.
    pub stale_ended: u32,
    /// Answers taken for a session that had ended before they were sent: each one a bug.
    pub taken_after_end: Vec<String>,
}

/// How many listed items the person keeps on the screen.
const KEPT_ITEMS: usize = 32;

/// Answers to every question of `item`, each `value`.
fn answers_to(item: &skein_runtime::hitl::InboxItem, value: &str) -> serde_json::Value {
    let mut answers = serde_json::Map::new();
    for q in &item.questions {
        if let Some(k) = q.get("key").and_then(|k| k.as_str()) {
            answers.insert(k.into(), value.into());
        }
    }
    answers.into()
}

impl Person {
    /// Answers every question and approves every call the inbox lists for `roots`.
    async fn answer_all(&mut self, rt: &Arc<Runtime>, roots: &[SessionId]) {
        let Ok(items) = skein_runtime::hitl::inbox(rt, roots).await else {
            return;
        };
        for item in items {
            let ok = if item.kind == skein_runtime::hitl::InboxKind::Question {
                let answers = answers_to(&item, "the last word");
                skein_runtime::hitl::answer(rt, &item.token, answers, None)
                    .await
                    .is_ok()
            } else {
                skein_runtime::hitl::decide_approval(rt, &item.token, true, None, None)
                    .await
                    .is_ok()
            };
            if ok {
                if item.kind == skein_runtime::hitl::InboxKind::Question {
                    self.answers += 1;
                } else {
                    self.approvals += 1;
                }
            }
        }
    }

    async fn act(
        &mut self,
        rt: &Arc<Runtime>,
        store: &MemStore,
        roots: &[SessionId],
        faults: &Faults,
    ) {
        if let Some(rng) = self.stale.as_mut() {
            if !self.kept.is_empty() && rng.chance(STALE_ANSWER) {
                let item = self.kept[rng.below(self.kept.len() as u64) as usize].clone();
                self.stale_tries += 1;
                let ended = SessionId::parse(&item.session).is_ok_and(|s| store.ended(&s));
                if ended {
                    self.stale_ended += 1;
                }
                let taken = if item.kind == skein_runtime::hitl::InboxKind::Question {
                    let answers = answers_to(&item, "from an old screen");
                    skein_runtime::hitl::answer(rt, &item.token, answers, None).await
                } else {
                    skein_runtime::hitl::decide_approval(
                        rt,
                        &item.token,
                        rng.chance(0.5),
                        None,
                        None,
                    )
                    .await
                };
                if taken.is_ok() {
                    self.stale_taken += 1;
                    if ended {
                        self.taken_after_end.push(format!(
                            "{}: a person's {:?} was taken after the session had ended",
                            item.session, item.kind
                        ));
                    }
                    self.used.push((
                        item.token.clone(),
                        item.kind == skein_runtime::hitl::InboxKind::Question,
                    ));
                }
                return;
            }
        }
        if !self.used.is_empty() && faults.draw(5) == 0 {
            let (token, question) = self.used[faults.draw(self.used.len() as u64) as usize].clone();
            self.reuse_tries += 1;
            let again = if question {
                skein_runtime::hitl::answer(
                    rt,
                    &token,
                    serde_json::json!({"version": "again"}),
                    None,
                )
                .await
            } else {
                skein_runtime::hitl::decide_approval(rt, &token, true, None, None).await
            };
            if again.is_ok() {
                self.reused_accepted += 1;
            }
            return;
        }
        let Ok(items) = skein_runtime::hitl::inbox(rt, roots).await else {
            return;
        };
        if items.is_empty() {
            return;
        }
        if self.stale.is_some() {
            for item in &items {
                if !self.kept.iter().any(|k| k.token == item.token) {
                    self.kept.push(item.clone());
                }
            }
            let over = self.kept.len().saturating_sub(KEPT_ITEMS);
            self.kept.drain(..over);
        }
        let item = &items[faults.draw(items.len() as u64) as usize];
        let done = if item.kind == skein_runtime::hitl::InboxKind::Question {
            // One draw per question, as the seeds' worlds were made with.
            let mut answers = serde_json::Map::new();
            for q in &item.questions {
                if let Some(k) = q.get("key").and_then(|k| k.as_str()) {
                    answers.insert(k.into(), format!("v{}", faults.draw(100)).into());
                }
            }
            let r = skein_runtime::hitl::answer(rt, &item.token, answers.into(), None).await;
            if r.is_ok() {
                self.answers += 1;
            }
            r.is_ok()
        } else {
            let yes = faults.draw(4) != 0;
            let r = skein_runtime::hitl::decide_approval(rt, &item.token, yes, None, None).await;
            if r.is_ok() {
                if yes {
                    self.approvals += 1;
                } else {
                    self.denials += 1;
                }
            }
            r.is_ok()
        };
        if done {
            self.used.push((
                item.token.clone(),
                item.kind == skein_runtime::hitl::InboxKind::Question,
            ));
        }
    }
}
