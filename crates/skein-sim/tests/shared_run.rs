//! Shared runs (a mission's single flight) at their edges.
//!
//! A shared run that never starts: the mission's single-flight claim is held for a run
//! whose caller ended before it created the run (an operator cancelled it). A tree that
//! delegates the same mission waits on that run; it must not wait for ever. (A generated
//! world found it: seed 6154 of `--generated`, before the fix.)
//!
//! Who is told when a child ends: see the second test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::event::{DelegationKind, Outcome};
use skein_core::{AgentSet, Event, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::ports::{Cache, CacheEntry, Notices};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sim::faults::{Faults, Rates, Rng};
use skein_sim::memory::MemStore;
use skein_tools::{ToolBox, ToolsConfig};

/// The store's cache, except that the first mission claimed is held by `ghost` until
/// `ghost`'s claim is released.
struct GhostClaim {
    inner: Arc<MemStore>,
    ghost: SessionId,
    held: Mutex<Option<(String, bool)>>,
}

#[async_trait]
impl Cache for GhostClaim {
    async fn get(&self, hash: &str, now: u64) -> skein_runtime::Result<Option<CacheEntry>> {
        self.inner.get(hash, now).await
    }
    async fn put(&self, hash: &str, entry: &CacheEntry) -> skein_runtime::Result<()> {
        self.inner.put(hash, entry).await
    }
    async fn claim_inflight(
        &self,
        hash: &str,
        session: &SessionId,
    ) -> skein_runtime::Result<Option<SessionId>> {
        {
            let mut held = self.held.lock().unwrap();
            match held.as_ref() {
                None => {
                    *held = Some((hash.to_string(), true));
                    return Ok(Some(self.ghost.clone()));
                }
                Some((h, true)) if h == hash => return Ok(Some(self.ghost.clone())),
                _ => {}
            }
        }
        self.inner.claim_inflight(hash, session).await
    }
    async fn release_inflight(&self, hash: &str, session: &SessionId) -> skein_runtime::Result<()> {
        if *session == self.ghost {
            let mut held = self.held.lock().unwrap();
            if let Some((h, on)) = held.as_mut() {
                if h == hash {
                    *on = false;
                }
            }
            return Ok(());
        }
        self.inner.release_inflight(hash, session).await
    }
}

#[test]
fn a_shared_run_whose_caller_ended_before_creating_it_fails_the_call() {
    skein_sim::paused_runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let agents = agents_in(
            dir.path(),
            &[
                (
                    "boss",
                    "agents: [helper]\n",
                    "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"success: {{ results[0].success }}\"\n",
                ),
                ("helper", "", "turns:\n  - answer: done\n"),
            ],
        );
        let faults = Arc::new(Faults::new(Rates::NONE, Rng::new(1)));
        let store = MemStore::new(Duration::from_secs(5), faults, dir.path().join("ws"));
        let ghost = SessionId::parse("ghost.helper-1").unwrap();
        let mut backend = store.backend();
        backend.cache = Arc::new(GhostClaim {
            inner: store.clone(),
            ghost: ghost.clone(),
            held: Mutex::new(None),
        });
        let runtime = runtime_on(backend, agents, dir.path(), Duration::from_secs(5));
        // The caller that claimed the mission: cancelled before it created its run.
        let caller = runtime
            .submit(Submission {
                agent: "boss".into(),
                mission: "first".into(),
                id: Some("ghost".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        skein_runtime::control::cancel(&runtime, &caller, "cancelled by an operator")
            .await
            .unwrap();
        let tree = runtime
            .submit(Submission {
                agent: "boss".into(),
                mission: "second".into(),
                id: Some("tree".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        let (stop, handles) = runtime.spawn_workers(vec!["default".into()], 2);
        let t0 = tokio::time::Instant::now();
        while !store.ended(&tree) && t0.elapsed() < Duration::from_secs(600) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = stop.send(true);
        for h in handles {
            h.abort();
        }
        let logs = store.logs();
        let log = logs.get(&tree).unwrap();
        let shared = log.iter().any(|r| {
            matches!(&r.env.body, Event::Delegated(d) if d.kind == skein_core::event::DelegationKind::Shared && d.child == ghost)
        });
        assert!(shared, "the call did not wait on the claimed run: {log:?}");
        let failed = log.iter().find_map(|r| match &r.env.body {
            Event::ChildSettled(c) if c.child == ghost => match &c.outcome {
                Outcome::Failed { error, .. } => Some(error.clone()),
                _ => None,
            },
            _ => None,
        });
        let error = failed.expect("the call on the run that never started was not settled");
        assert!(error.contains("never started"), "{error}");
        // The tree goes on: its model reads the failure and answers.
        match log.last().map(|r| &r.env.body) {
            Some(Event::Completed(c)) => {
                assert!(!c.answer.contains("true"), "{}", c.answer)
            }
            other => panic!("the tree did not complete: {other:?}"),
        }
    });
}

/// Agents named as given, each with the given lines of front matter and its script written
/// to `dir` for the scripted model.
fn agents_in(dir: &std::path::Path, agents: &[(&str, &str, &str)]) -> Arc<AgentSet> {
    Arc::new(skein_core::testing::scripted_agents(dir, agents))
}

/// A runtime on `backend`, its scripted model reading the scripts in `dir` on tokio's
/// (paused) clock.
fn runtime_on(
    backend: skein_runtime::ports::Backend,
    agents: Arc<AgentSet>,
    dir: &std::path::Path,
    lease: Duration,
) -> Arc<Runtime> {
    let mut models = Registry::new();
    models.insert(
        "scripted",
        Arc::new(ScriptedProvider::new(dir).on_tokio_clock()),
    );
    let mut tools = ToolsConfig::default();
    tools.http.enabled = false;
    let cfg = RuntimeConfig {
        worker_id: "w0".into(),
        lease,
        clock: Arc::new(skein_sim::faults::SimClock::new(1)),
        token_secret: skein_runtime::secret::Secret(b"a shared run test".to_vec()),
        ..RuntimeConfig::default()
    };
    Runtime::new(backend, agents, models, ToolBox::builtin(&tools), cfg)
}

// The second test: who is told when a child ends. A shared run (one whose mission another
// tree joined) releases its single-flight claim and tells its watchers, and the tree that
// joined it completes; a child of an agent with `cache: false` is never shared, so its end
// asks for neither (on NATS each is a round trip on the way to its parent). Features that
// meet: the cache's single flight, `cache: false`, and the wake-up of a parent.

/// The store's cache and notices, noting whose claim was released and whose watchers
/// were read.
struct Noting {
    inner: Arc<MemStore>,
    released: Mutex<BTreeSet<SessionId>>,
    watched: Mutex<BTreeSet<SessionId>>,
}

#[async_trait]
impl Cache for Noting {
    async fn get(&self, hash: &str, now: u64) -> skein_runtime::Result<Option<CacheEntry>> {
        self.inner.get(hash, now).await
    }
    async fn put(&self, hash: &str, entry: &CacheEntry) -> skein_runtime::Result<()> {
        self.inner.put(hash, entry).await
    }
    async fn claim_inflight(
        &self,
        hash: &str,
        session: &SessionId,
    ) -> skein_runtime::Result<Option<SessionId>> {
        self.inner.claim_inflight(hash, session).await
    }
    async fn release_inflight(&self, hash: &str, session: &SessionId) -> skein_runtime::Result<()> {
        self.released.lock().unwrap().insert(session.clone());
        self.inner.release_inflight(hash, session).await
    }
}

#[async_trait]
impl Notices for Noting {
    async fn post(&self, parent: &SessionId, child: &SessionId) -> skein_runtime::Result<()> {
        self.inner.post(parent, child).await
    }
    async fn read(
        &self,
        parent: &SessionId,
        after: u64,
    ) -> skein_runtime::Result<Vec<(u64, SessionId)>> {
        self.inner.read(parent, after).await
    }
    async fn watch(
        &self,
        target: &SessionId,
        watcher: &SessionId,
        pool: &str,
    ) -> skein_runtime::Result<()> {
        self.inner.watch(target, watcher, pool).await
    }
    async fn watchers(
        &self,
        target: &SessionId,
    ) -> skein_runtime::Result<Vec<(SessionId, String)>> {
        self.watched.lock().unwrap().insert(target.clone());
        self.inner.watchers(target).await
    }
}

#[test]
fn a_shared_run_tells_its_watchers_and_an_uncached_child_asks_for_none() {
    skein_sim::paused_runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        // The shared run takes a while, so the second tree's call finds it under way.
        let agents = agents_in(
            dir.path(),
            &[
                (
                    "boss",
                    "agents: [helper, plain]\ncache: false\n",
                    "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n      - tool: call_agent\n        args: {agent: plain, mission: \"the same chore\"}\n  - answer: \"{{ results | length }} answers\"\n",
                ),
                ("helper", "", "latency_ms: 5000\nturns:\n  - answer: helped\n"),
                ("plain", "cache: false\n", "turns:\n  - answer: plain\n"),
            ],
        );
        let faults = Arc::new(Faults::new(Rates::NONE, Rng::new(1)));
        let store = MemStore::new(Duration::from_secs(5), faults, dir.path().join("ws"));
        let noting = Arc::new(Noting {
            inner: store.clone(),
            released: Mutex::default(),
            watched: Mutex::default(),
        });
        let mut backend = store.backend();
        backend.cache = noting.clone();
        backend.notices = noting.clone();
        let runtime = runtime_on(backend, agents, dir.path(), Duration::from_secs(30));
        let (stop, handles) = runtime.spawn_workers(vec!["default".into()], 4);
        let first = runtime
            .submit(Submission {
                agent: "boss".into(),
                mission: "first".into(),
                id: Some("first".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let second = runtime
            .submit(Submission {
                agent: "boss".into(),
                mission: "second".into(),
                id: Some("second".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        let t0 = tokio::time::Instant::now();
        while !(store.ended(&first) && store.ended(&second))
            && t0.elapsed() < Duration::from_secs(600)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = stop.send(true);
        for h in handles {
            h.abort();
        }
        let logs = store.logs();
        let delegated = |root: &SessionId, agent: &str| {
            logs[root]
                .iter()
                .find_map(|r| match &r.env.body {
                    Event::Delegated(d) if d.agent == agent => Some((d.child.clone(), d.kind)),
                    _ => None,
                })
                .unwrap_or_else(|| panic!("{root} delegated no {agent}"))
        };
        let (helper, kind) = delegated(&first, "helper");
        assert_eq!(kind, DelegationKind::Started);
        let (joined, kind) = delegated(&second, "helper");
        assert_eq!(
            (joined, kind),
            (helper.clone(), DelegationKind::Shared),
            "the second tree joins the first tree's run of the same mission"
        );
        for root in [&first, &second] {
            match logs[root].last().map(|r| &r.env.body) {
                Some(Event::Completed(c)) => assert_eq!(c.answer, "2 answers"),
                other => panic!("{root} did not complete: {other:?}"),
            }
        }
        let plains: Vec<SessionId> = [&first, &second]
            .into_iter()
            .map(|root| delegated(root, "plain").0)
            .collect();
        assert_ne!(plains[0], plains[1], "an uncached mission is never shared");
        let released = noting.released.lock().unwrap().clone();
        let watched = noting.watched.lock().unwrap().clone();
        assert!(
            released.contains(&helper) && watched.contains(&helper),
            "the shared run released its claim ({released:?}) and read its watchers ({watched:?})"
        );
        for p in &plains {
            assert!(
                !released.contains(p) && !watched.contains(p),
                "{p} (cache: false) asked for a claim it never held or for watchers"
            );
        }
    });
}
