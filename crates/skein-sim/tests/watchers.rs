//! Who is told when a child ends. A shared run (one whose mission another tree joined)
//! releases its single-flight claim and tells its watchers; a child of an agent with
//! `cache: false` never claims its mission, so nobody can watch it, and its end asks
//! neither (on NATS each is a round trip on the way to its parent). Features that meet:
//! the cache's single flight, `cache: false`, and the wake-up of a parent.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::event::DelegationKind;
use skein_core::{AgentSet, Event, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::ports::{Cache, CacheEntry, Notices};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sim::faults::{Faults, Rates, Rng};
use skein_sim::memory::MemStore;
use skein_tools::{ToolBox, ToolsConfig};

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
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("boss.yaml"),
            "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n      - tool: call_agent\n        args: {agent: plain, mission: \"the same chore\"}\n  - answer: \"{{ results | length }} answers\"\n",
        )
        .unwrap();
        // The shared run takes a while, so the second tree's call finds it under way.
        std::fs::write(
            dir.path().join("helper.yaml"),
            "latency_ms: 5000\nturns:\n  - answer: helped\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("plain.yaml"), "turns:\n  - answer: plain\n").unwrap();
        let files = vec![
            (
                "boss.md".to_string(),
                "---\nname: boss\nmodel: scripted:boss\nagents: [helper, plain]\ncache: false\n---\nYou are boss.\n"
                    .to_string(),
            ),
            (
                "helper.md".to_string(),
                "---\nname: helper\nmodel: scripted:helper\n---\nYou help.\n".to_string(),
            ),
            (
                "plain.md".to_string(),
                "---\nname: plain\nmodel: scripted:plain\ncache: false\n---\nYou are plain.\n"
                    .to_string(),
            ),
        ];
        let agents = Arc::new(AgentSet::load(&files, &[]).unwrap());
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
        let mut models = Registry::new();
        models.insert(
            "scripted",
            Arc::new(ScriptedProvider::new(dir.path()).on_tokio_clock()),
        );
        let mut tools = ToolsConfig::default();
        tools.http.enabled = false;
        let cfg = RuntimeConfig {
            worker_id: "w0".into(),
            lease: Duration::from_secs(30),
            clock: Arc::new(skein_sim::faults::SimClock::new(1)),
            token_secret: skein_runtime::secret::Secret(b"a watchers test secret".to_vec()),
            ..RuntimeConfig::default()
        };
        let runtime = Runtime::new(backend, agents, models, ToolBox::builtin(&tools), cfg);
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
