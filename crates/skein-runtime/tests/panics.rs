//! A panic while a job is processed (a provider or tool a library user plugged in, a bug)
//! is caught: the job is handed back, the work loop goes on, and the next delivery
//! finishes the session.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{AgentSet, Event, ModelRequest};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::{Completion, Provider, Registry};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::ToolBox;

/// Panics on its first call, then answers as the scripted provider would.
struct PanicsOnce {
    calls: AtomicUsize,
    inner: ScriptedProvider,
}

#[async_trait]
impl Provider for PanicsOnce {
    async fn complete(&self, model: &str, req: &ModelRequest) -> skein_llm::Result<Completion> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("provider bug on the first call");
        }
        self.inner.complete(model, req).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_step_is_caught_and_the_session_finishes_on_the_next_delivery() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("solo.yaml"), "turns:\n  - answer: done\n").unwrap();
    let agents = AgentSet::load(
        &[(
            "solo.md".into(),
            "---\nname: solo\nmodel: flaky:solo\n---\nAnswer.\n".into(),
        )],
        &[],
    )
    .unwrap();
    let store = SledStore::open(&dir.path().join("data"), &dir.path().join("ws")).unwrap();
    let mut models = Registry::new();
    let provider = Arc::new(PanicsOnce {
        calls: AtomicUsize::new(0),
        inner: ScriptedProvider::new(dir.path()),
    });
    models.insert("flaky", provider.clone());
    let rt = Runtime::new(
        store.backend(),
        Arc::new(agents),
        models,
        ToolBox::new(),
        RuntimeConfig::default(),
    );
    let id = rt
        .submit(Submission {
            agent: "solo".into(),
            mission: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let (stop, handles) = rt.spawn_workers(vec!["default".into()], 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let last = rt.backend.log.last(&id).await.unwrap().unwrap();
        if last.env.body.is_terminal() {
            assert!(
                matches!(last.env.body, Event::Completed(_)),
                "{}",
                last.env.body.kind()
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the session never finished after the panic (last event {})",
            last.env.body.kind()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        provider.calls.load(Ordering::SeqCst),
        2,
        "one panic, one answer"
    );
    let _ = stop.send(true);
    for h in handles {
        // Every loop and the sweeper ended normally: none died with the panic.
        h.await.unwrap();
    }
}
