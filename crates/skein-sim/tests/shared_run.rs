//! A shared run that never starts: the mission's single-flight claim is held for a run
//! whose caller ended before it created the run (an operator cancelled it). A tree that
//! delegates the same mission waits on that run; it must not wait for ever. (A generated
//! world found it: seed 6154 of `--generated`, before the fix.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::event::Outcome;
use skein_core::{AgentSet, Event, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::ports::{Cache, CacheEntry};
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
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("boss.yaml"),
            "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"success: {{ results[0].success }}\"\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("helper.yaml"), "turns:\n  - answer: done\n").unwrap();
        let files = vec![
            (
                "boss.md".to_string(),
                "---\nname: boss\nmodel: scripted:boss\nagents: [helper]\n---\nYou are boss.\n"
                    .to_string(),
            ),
            (
                "helper.md".to_string(),
                "---\nname: helper\nmodel: scripted:helper\n---\nYou are helper.\n".to_string(),
            ),
        ];
        let agents = Arc::new(AgentSet::load(&files, &[]).unwrap());
        let faults = Arc::new(Faults::new(Rates::NONE, Rng::new(1)));
        let store = MemStore::new(Duration::from_secs(5), faults, dir.path().join("ws"));
        let ghost = SessionId::parse("ghost.helper-1").unwrap();
        let mut backend = store.backend();
        backend.cache = Arc::new(GhostClaim {
            inner: store.clone(),
            ghost: ghost.clone(),
            held: Mutex::new(None),
        });
        let mut models = Registry::new();
        models.insert(
            "scripted",
            Arc::new(ScriptedProvider::new(dir.path()).on_tokio_clock()),
        );
        let mut tools = ToolsConfig::default();
        tools.http.enabled = false;
        let cfg = RuntimeConfig {
            worker_id: "w0".into(),
            lease: Duration::from_secs(5),
            clock: Arc::new(skein_sim::faults::SimClock::new(1)),
            token_secret: skein_runtime::secret::Secret(b"a shared run test".to_vec()),
            ..RuntimeConfig::default()
        };
        let runtime = Runtime::new(backend, agents, models, ToolBox::builtin(&tools), cfg);
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
