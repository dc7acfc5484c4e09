//! Definition versions and workers that differ in what they can serve. A generated world
//! gains: versions of its definitions pushed and rolled back while trees run (changed
//! prompts, an agent that only one version holds), trees submitted between the changes,
//! workers that each lack something (one of their own agent files, the `alt` model
//! provider, a tool, or the newer record format), and one tree whose model provider no
//! worker has. The runtime decides everything the way a cluster worker does (the pin at
//! submission, the version of each step, the hand-back of what a worker lacks, the bound
//! for what nobody can serve, the record format agreed among the live workers); this file
//! only says who has what, and checks the logs afterwards.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{AgentSet, Definitions, Event, Record, SessionId};
use skein_runtime::defs::{Need, Offer, Peers};
use skein_runtime::ports::{Durability, EventLog};
use skein_runtime::worker::{Runtime, Submission};
use skein_runtime::{Backend, Result};
use skein_tools::ToolBox;

use crate::faults::Rng;
use crate::gen::{Scenario, Tree};
use crate::memory::MemStore;

/// The provider some agents use instead of `scripted` (the same scripts), which some
/// workers lack.
pub const ALT: &str = "alt";
/// The provider of the stranded agent: no worker has it.
pub const NOWHERE: &str = "nowhere";
/// The agent only one pushed version holds.
pub const NOVEL: &str = "novel";
/// The agent whose model no worker can serve.
pub const STRANDED: &str = "stranded";
/// How often workers read each other's advertisements (as the cluster's every 5 s).
const ADVERTISE: Duration = Duration::from_secs(5);

/// What a simulated worker lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lack {
    Nothing,
    /// One agent of its own files.
    Agent(String),
    /// The `alt` provider.
    Provider,
    /// One tool of the tool box.
    Tool(String),
    /// It reads only the first record format (an earlier release).
    OlderFormat,
}

/// One pushed version: its digest, its files, its agents.
pub struct Pushed {
    pub digest: String,
    pub defs: Definitions,
    pub agents: Arc<AgentSet>,
}

/// A change of the current version at a virtual time: the version (by index) made current.
#[derive(Debug, Clone, Copy)]
struct Change {
    at_ms: u64,
    to: usize,
}

/// A live worker as the others see it.
#[derive(Clone)]
struct Live {
    offer: Offer,
    reads: u16,
    full: bool,
}

/// The versions, the workers' differences, and what was seen of both.
pub struct Mix {
    /// The workers' own files (every agent; each worker may lack one).
    pub local_files: Vec<(String, String)>,
    pub pushed: Vec<Pushed>,
    changes: Vec<Change>,
    /// Trees submitted after the changes: (virtual ms, tree).
    late: Mutex<Vec<(u64, Tree)>>,
    /// Agents no other agent starts (a worker may lack one of them).
    droppable: Vec<String>,
    /// Tools the agents use from the tool box (a worker may lack one).
    tools: Vec<String>,
    rng: Mutex<Rng>,
    live: Arc<Mutex<BTreeMap<String, Live>>>,
    /// The version current now (None: the workers' own files).
    current: Mutex<Option<usize>>,
    next_change: Mutex<usize>,
    last_agreed: Mutex<Option<tokio::time::Instant>>,
    /// The version each root was pinned to when it was submitted.
    pub pins: Mutex<BTreeMap<SessionId, Option<String>>>,
    /// What each worker lacked, by worker.
    pub lacks: Mutex<BTreeMap<String, Lack>>,
    /// Times a worker asked whether another has what it lacks, by need.
    pub asked: Arc<Mutex<BTreeMap<String, u64>>>,
    /// Reads an earlier release's worker refused (a record of a newer format).
    pub newer_refused: Arc<AtomicU64>,
    /// Records written in the newer format.
    pub newer_written: AtomicU64,
}

impl Mix {
    /// The seed's versions and workers for `scenario`, and the scenario they run: its own
    /// trees, some of them later, and the stranded one. None when the scenario has no
    /// tree to run later.
    pub fn draw(seed: u64, scenario: &Scenario) -> (Scenario, Mix) {
        let mut rng = Rng::new(seed.rotate_left(29) ^ 0x7665_7273_696f_6e73);
        let mut sc = scenario.clone();
        // Some agents run on the `alt` provider.
        let alt: BTreeSet<String> = sc
            .agents
            .iter()
            .filter(|_| rng.below(3) == 0)
            .map(|a| a.name.clone())
            .collect();
        sc.agents.push(crate::gen::Agent {
            name: STRANDED.into(),
            front: String::new(),
            script: "turns:\n  - answer: \"never\"\n".into(),
        });
        sc.agents.push(crate::gen::Agent {
            name: NOVEL.into(),
            front: String::new(),
            script: "turns:\n  - answer: \"novel done\"\n".into(),
        });
        let file = |a: &crate::gen::Agent, prompt: &str| {
            let provider = if a.name == STRANDED {
                NOWHERE
            } else if alt.contains(&a.name) {
                ALT
            } else {
                "scripted"
            };
            (
                format!("{}.md", a.name),
                format!(
                    "---\nname: {}\nmodel: {provider}:{}\n{}---\nYou are {}.{prompt}\n",
                    a.name, a.name, a.front, a.name
                ),
            )
        };
        let local_files: Vec<(String, String)> = sc
            .agents
            .iter()
            .filter(|a| a.name != NOVEL)
            .map(|a| file(a, ""))
            .collect();
        // v0: a new prompt for some agents and the novel agent; v1: other prompts, the
        // novel agent removed; then a rollback to v0.
        let mut pushed = vec![];
        for v in 0..2 {
            let files: BTreeMap<String, String> = sc
                .agents
                .iter()
                .filter(|a| v == 0 || a.name != NOVEL)
                .map(|a| {
                    let prompt = if rng.below(2) == 0 {
                        format!(" Version {v} of your instructions.")
                    } else {
                        String::new()
                    };
                    file(a, &prompt)
                })
                .collect();
            // No scripts: the workers' own `scripted` provider (on the simulation's
            // clock) serves every version, as the scripts are the same.
            let defs = Definitions::new(files, BTreeMap::new());
            let agents = Arc::new(defs.agent_set(&sc.extra_tools).expect("a version loads"));
            pushed.push(Pushed {
                digest: defs.digest().expect("a digest"),
                defs,
                agents,
            });
        }
        let mut at = 0;
        let mut changes = vec![];
        let mut late = vec![];
        for to in [0, 1, 0] {
            at += 5_000 + rng.below(40_000);
            changes.push(Change { at_ms: at, to });
            for _ in 0..1 + rng.below(2) {
                if let Some(t) = scenario
                    .trees
                    .get(rng.below(scenario.trees.len() as u64) as usize)
                {
                    let mut t = t.clone();
                    t.mission = format!("{} (after change {})", t.mission, changes.len());
                    late.push((at + 1 + rng.below(3_000), t));
                }
            }
            if to == 0 {
                late.push((
                    at + 1 + rng.below(3_000),
                    Tree {
                        agent: NOVEL.into(),
                        mission: format!("new work {}", changes.len()),
                        budget: None,
                    },
                ));
            }
        }
        sc.trees.push(Tree {
            agent: STRANDED.into(),
            mission: "work nobody can do".into(),
            budget: None,
        });
        let started: BTreeSet<String> = AgentSet::load(&local_files, &sc.extra_tools)
            .map(|set| {
                set.agents
                    .values()
                    .flat_map(|d| d.starts().into_iter().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let droppable = sc
            .agents
            .iter()
            .map(|a| a.name.clone())
            .filter(|n| n != NOVEL && !started.contains(n))
            .collect();
        let tools: BTreeSet<String> = pushed[0]
            .agents
            .agents
            .values()
            .flat_map(|d| d.front.tools.iter().cloned())
            .filter(|t| skein_core::runtime_tool::RuntimeTool::parse(t).is_none())
            .collect();
        let mix = Mix {
            local_files,
            pushed,
            changes,
            late: Mutex::new(late),
            droppable,
            tools: tools.into_iter().collect(),
            rng: Mutex::new(rng),
            live: Arc::default(),
            current: Mutex::new(None),
            next_change: Mutex::new(0),
            last_agreed: Mutex::new(None),
            pins: Mutex::default(),
            lacks: Mutex::default(),
            asked: Arc::default(),
            newer_refused: Arc::default(),
            newer_written: AtomicU64::new(0),
        };
        (sc, mix)
    }

    /// What the next worker lacks: nothing for the first, and nothing when no worker
    /// that lacks nothing is live (one always is: what one lacks, another has).
    fn draw_lack(&self) -> Lack {
        let full_live = lock(&self.live).values().any(|l| l.full);
        if !full_live {
            return Lack::Nothing;
        }
        let mut rng = lock(&self.rng);
        match rng.below(5) {
            0 if !self.droppable.is_empty() => {
                Lack::Agent(self.droppable[rng.below(self.droppable.len() as u64) as usize].clone())
            }
            1 => Lack::Provider,
            2 if !self.tools.is_empty() => {
                Lack::Tool(self.tools[rng.below(self.tools.len() as u64) as usize].clone())
            }
            3 => Lack::OlderFormat,
            _ => Lack::Nothing,
        }
    }

    /// A new worker's share: its own agents, its models (without `alt` when it lacks it),
    /// its tool box and its backend (reading only the first format when it is older).
    pub fn worker(
        &self,
        id: &str,
        agents: Arc<AgentSet>,
        models: &mut skein_llm::Registry,
        alt: Arc<dyn skein_llm::Provider>,
        tools: ToolBox,
        store: &Arc<MemStore>,
    ) -> (Arc<AgentSet>, ToolBox, Backend) {
        let mut lack = self.draw_lack();
        let mut agents = agents;
        if let Lack::Agent(a) = &lack {
            let files: Vec<(String, String)> = self
                .local_files
                .iter()
                .filter(|(n, _)| n != &format!("{a}.md"))
                .cloned()
                .collect();
            match AgentSet::load(&files, &[]) {
                Ok(set) => agents = Arc::new(set),
                Err(_) => lack = Lack::Nothing,
            }
        }
        if lack != Lack::Provider {
            models.insert(ALT, alt);
        }
        let tools = match &lack {
            Lack::Tool(t) => {
                let mut b = ToolBox::new();
                for n in tools.names() {
                    if &n != t {
                        if let Some(tool) = tools.get(&n) {
                            b.insert(tool.clone());
                        }
                    }
                }
                b
            }
            _ => tools,
        };
        let mut backend = store.backend();
        let reads = if lack == Lack::OlderFormat {
            backend.log = Arc::new(OlderReader {
                inner: store.clone(),
                refused: self.newer_refused.clone(),
            });
            skein_core::event::ENVELOPE_VERSION
        } else {
            skein_core::event::read_format()
        };
        lock(&self.lacks).insert(id.to_string(), lack.clone());
        lock(&self.live).insert(
            id.to_string(),
            Live {
                offer: Offer::default(),
                reads,
                full: lack == Lack::Nothing,
            },
        );
        (agents, tools, backend)
    }

    /// A started worker: what it offers, and the peers it asks.
    pub fn started(&self, rt: &Arc<Runtime>) {
        let id = rt.cfg.worker_id.clone();
        if let Some(l) = lock(&self.live).get_mut(&id) {
            l.offer = rt.offer();
        }
        rt.set_peers(Arc::new(SimPeers {
            me: id,
            live: self.live.clone(),
            asked: self.asked.clone(),
        }));
    }

    /// A worker killed: no longer live.
    pub fn gone(&self, rt: &Runtime) {
        lock(&self.live).remove(&rt.cfg.worker_id);
    }

    /// One turn of the run: the version changes that are due, each worker's current
    /// version, the record format agreed after each round of advertisements, and the
    /// trees due now (submitted through a worker that lacks nothing).
    pub async fn tick(
        &self,
        t_ms: u64,
        runtimes: &[Arc<Runtime>],
        store: &MemStore,
        roots: &mut Vec<SessionId>,
    ) {
        use skein_runtime::ports::Blobs;
        {
            let mut next = lock(&self.next_change);
            if let Some(c) = self.changes.get(*next) {
                if c.at_ms <= t_ms {
                    *lock(&self.current) = Some(c.to);
                    *next += 1;
                }
            }
        }
        let current = *lock(&self.current);
        let want = current.map(|i| &self.pushed[i]);
        if let Some(p) = want {
            // Pushed (again: storing the same bytes is idempotent) before it is current.
            if store.put(&p.defs.encode().expect("encodes")).await.is_err() {
                return;
            }
        }
        let digest = want.map(|p| p.digest.as_str());
        for rt in runtimes {
            if rt.current_version().digest.as_deref() != digest {
                let _ = rt.set_current_version(digest).await;
            }
        }
        let due = {
            let mut agreed = lock(&self.last_agreed);
            let now = tokio::time::Instant::now();
            let due = agreed.is_none_or(|at| now.duration_since(at) >= ADVERTISE);
            if due {
                *agreed = Some(now);
            }
            due
        };
        if due {
            let reads: Vec<u16> = lock(&self.live).values().map(|l| l.reads).collect();
            for rt in runtimes {
                let own = lock(&self.live)
                    .get(&rt.cfg.worker_id)
                    .map(|l| l.reads)
                    .unwrap_or(1);
                rt.agree_on_format(reads.iter().copied().chain([own]));
            }
        }
        let Some(via) = runtimes.iter().find(|rt| {
            lock(&self.live)
                .get(&rt.cfg.worker_id)
                .is_some_and(|l| l.full)
                && rt.current_version().digest.as_deref() == digest
        }) else {
            return;
        };
        let trees: Vec<(u64, Tree)> = {
            let mut late = lock(&self.late);
            let (now, later): (Vec<_>, Vec<_>) = late.drain(..).partition(|(at, _)| *at <= t_ms);
            *late = later;
            now
        };
        for (_, tree) in trees {
            let id = format!("late-{}", roots.len());
            let sub = Submission {
                agent: tree.agent.clone(),
                mission: tree.mission.clone(),
                id: Some(id),
                ..Default::default()
            };
            let pin = via.current_version().digest.clone();
            match via.submit(sub).await {
                Ok(root) => {
                    lock(&self.pins).insert(root.clone(), pin);
                    roots.push(root);
                }
                // The novel agent is gone from the version current now: not submitted.
                Err(e) if !e.is_retryable() => {}
                Err(_) => lock(&self.late).push((t_ms + 100, tree)),
            }
        }
    }

    /// The first of `runtimes` that reads every record format (an operator's commands go
    /// through it), else the first.
    pub fn reader(&self, runtimes: &[Arc<Runtime>]) -> usize {
        let live = lock(&self.live);
        runtimes
            .iter()
            .position(|rt| {
                live.get(&rt.cfg.worker_id)
                    .is_some_and(|l| l.reads == skein_core::event::read_format())
            })
            .unwrap_or(0)
    }

    /// Trees still to be submitted.
    pub fn pending(&self) -> bool {
        !lock(&self.late).is_empty()
    }

    /// The agents of the version `defs` names (None: the workers' own files, `local`).
    pub fn agents_of(&self, defs: Option<&str>, local: &Arc<AgentSet>) -> Arc<AgentSet> {
        defs.and_then(|d| self.pushed.iter().find(|p| p.digest == d))
            .map(|p| p.agents.clone())
            .unwrap_or_else(|| local.clone())
    }

    /// The checks of the versions and the workers' differences, over the run's logs.
    pub fn check(
        &self,
        logs: &BTreeMap<SessionId, Vec<Record>>,
        roots: &[SessionId],
        local: &Arc<AgentSet>,
        violations: &mut Vec<String>,
    ) {
        let pins = lock(&self.pins).clone();
        let root_defs: BTreeMap<&SessionId, Option<String>> = roots
            .iter()
            .filter_map(
                |r| match logs.get(r).and_then(|l| l.first()).map(|r| &r.env.body) {
                    Some(Event::Submitted(s)) => Some((r, s.defs.clone())),
                    _ => None,
                },
            )
            .collect();
        for (root, pin) in &pins {
            if root_defs.get(root) != Some(pin) {
                violations.push(format!(
                    "{root}: pinned to {:?}, current when it was submitted, but its log says {:?}",
                    pin,
                    root_defs.get(root)
                ));
            }
        }
        for (id, recs) in logs {
            let Some(Event::Submitted(sub)) = recs.first().map(|r| &r.env.body) else {
                continue;
            };
            let Some((root, defs)) = root_defs.iter().find(|(r, _)| r.contains(id)) else {
                continue;
            };
            if &sub.defs != defs {
                violations.push(format!(
                    "{id}: ran on version {:?}, its tree {root} on {:?}",
                    sub.defs, defs
                ));
            }
            let agents = self.agents_of(sub.defs.as_deref(), local);
            if let Some(def) = agents.get(&sub.agent) {
                let want = blake3::hash(def.text.as_bytes()).to_hex().to_string();
                if sub.def_digest != want && sub.agent != "custom" {
                    violations.push(format!(
                        "{id}: agent `{}` ran a definition that is not its version's",
                        sub.agent
                    ));
                }
            } else if sub.agent != "custom" {
                violations.push(format!(
                    "{id}: agent `{}` is not in the version its tree is pinned to",
                    sub.agent
                ));
            }
            for r in recs {
                if r.env.v > skein_core::event::ENVELOPE_VERSION {
                    self.newer_written.fetch_add(1, Ordering::Relaxed);
                }
            }
            let failure = recs.iter().find_map(|r| match &r.env.body {
                Event::Failed(f) => Some(f.error.clone()),
                _ => None,
            });
            let stranded = sub.agent == STRANDED && sub.parent.is_none();
            let unserved = failure.as_deref().is_some_and(unserved);
            let completed = recs
                .last()
                .is_some_and(|r| matches!(r.env.body, Event::Completed(_)));
            match failure {
                // An operator may cancel it first; it never completes.
                Some(e) if stranded && !(unserved && e.contains(NOWHERE)) => violations.push(
                    format!("{id}: nobody can serve it, but it failed with another reason: {e}"),
                ),
                None if stranded && completed => {
                    violations.push(format!("{id}: nobody can serve it, yet it completed"))
                }
                Some(e) if !stranded && unserved => violations.push(format!(
                    "{id}: failed for what one worker lacks and another has: {e}"
                )),
                _ => {}
            }
        }
    }
}

/// Whether a failure's reason is what a worker lacked or could not read.
fn unserved(e: &str) -> bool {
    e.contains("no worker can serve") || e.contains("lacks") || e.contains("format")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The other live workers of the simulation, as they advertise themselves.
struct SimPeers {
    me: String,
    live: Arc<Mutex<BTreeMap<String, Live>>>,
    asked: Arc<Mutex<BTreeMap<String, u64>>>,
}

#[async_trait]
impl Peers for SimPeers {
    async fn served_elsewhere(&self, need: &Need, defs: Option<&str>) -> Result<bool> {
        *lock(&self.asked).entry(need.label()).or_default() += 1;
        Ok(lock(&self.live)
            .iter()
            .filter(|(id, _)| **id != self.me)
            .any(|(_, l)| need.met_by(defs, &l.offer)))
    }
}

/// The log as a worker of an earlier release reads it: a record of a newer format is an
/// error (the one its decoder gives), whatever else the log holds.
struct OlderReader {
    inner: Arc<MemStore>,
    refused: Arc<AtomicU64>,
}

impl OlderReader {
    fn readable(&self, recs: &[Record]) -> Result<()> {
        for r in recs {
            if let Err(e) = r.env.readable_by(skein_core::event::ENVELOPE_VERSION) {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(e.into());
            }
        }
        Ok(())
    }
}

#[async_trait]
impl EventLog for OlderReader {
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()> {
        self.inner
            .append(session, expected_last, records, durability)
            .await
    }

    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        let recs = self.inner.read(session, from_seq).await?;
        self.readable(&recs)?;
        Ok(recs)
    }

    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        let r = self.inner.last(session).await?;
        self.readable(r.as_slice())?;
        Ok(r)
    }

    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        self.inner.tree(root).await
    }

    async fn read_tree(
        &self,
        root: &SessionId,
        ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>> {
        let logs = self.inner.read_tree(root, ids).await?;
        for log in logs.iter().flatten() {
            self.readable(log)?;
        }
        Ok(logs)
    }

    async fn roots(&self) -> Result<Vec<SessionId>> {
        self.inner.roots().await
    }
}
