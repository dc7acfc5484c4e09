//! A session that waits (for a person, here) when its `limits.timeout` runs out ends
//! then, timed out, at the first wake-up after its deadline: it is not driven again, and
//! its job does not come back. (A drive of a waiting session that did not have to wait for
//! anything used to finish before its deadline's timer was ever looked at, and the
//! session was woken again every few milliseconds for as long as it waited.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use skein_core::{AgentSet, Event, Status};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::{Tool, ToolBox, ToolContext};

/// A tool that asks a person first; it counts its runs.
struct Launch(Arc<AtomicUsize>);

#[async_trait]
impl Tool for Launch {
    fn name(&self) -> &str {
        "launch"
    }
    fn description(&self) -> &str {
        "Launches the thing."
    }
    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    }
    fn requires_approval(&self) -> bool {
        true
    }
    async fn call(&self, _ctx: &ToolContext, _args: Value) -> skein_tools::Result<String> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok("launched".into())
    }
}

#[tokio::test]
async fn a_waiting_session_past_its_timeout_ends_at_its_next_wake_and_is_not_woken_again() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("pilot.yaml"),
        "turns:\n  - tool_calls:\n      - tool: launch\n        args: {}\n  - answer: \"{{ results[0] }}\"\n",
    )
    .unwrap();
    let agents = AgentSet::load(
        &[(
            "pilot.md".into(),
            "---\nname: pilot\nmodel: scripted:pilot\ntools: [launch]\n\
             limits: {timeout: 1500ms}\n---\nLaunch.\n"
                .into(),
        )],
        &["launch".to_string()],
    )
    .unwrap();
    let store = SledStore::open(&dir.path().join("data"), &dir.path().join("ws")).unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir.path())));
    let launches = Arc::new(AtomicUsize::new(0));
    let mut tools = ToolBox::new();
    tools.insert(Arc::new(Launch(launches.clone())));
    let rt = Runtime::new(
        store.backend(),
        Arc::new(agents),
        models,
        tools,
        RuntimeConfig::default(),
    );
    let id = rt
        .submit(Submission {
            agent: "pilot".into(),
            mission: "go".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // Every job until the pilot waits for its approval (a tenth of a second with no job).
    while let Some(job) = rt
        .backend
        .jobs
        .claim("default", Duration::from_millis(100))
        .await
        .unwrap()
    {
        rt.process(&job).await.unwrap();
        rt.backend.jobs.ack(&job).await.unwrap();
    }
    let (f, _) = rt.load(&id).await.unwrap();
    assert_eq!(
        f.state.status,
        Status::AwaitingApproval,
        "{:?}",
        f.state.status
    );
    // Then each wake-up as it comes: the one its deadline's timer pushes, and any after
    // it, until two seconds pass without one.
    let mut wakes = 0;
    while let Some(job) = rt
        .backend
        .jobs
        .claim("default", Duration::from_secs(2))
        .await
        .unwrap()
    {
        wakes += 1;
        rt.process(&job).await.unwrap();
        rt.backend.jobs.ack(&job).await.unwrap();
        assert!(
            wakes <= 2,
            "the session is woken again and again past its deadline"
        );
    }
    let (f, _) = rt.load(&id).await.unwrap();
    assert_eq!(f.state.status, Status::Cancelled, "{:?}", f.state.status);
    let records = rt.backend.log.read(&id, 1).await.unwrap();
    match &records.last().unwrap().env.body {
        Event::Cancelled(c) => assert!(
            c.reason.contains("ran past its limits.timeout of 1500ms"),
            "{}",
            c.reason
        ),
        other => panic!("expected the timeout's cancel, got {}", other.kind()),
    }
    // The timer's wake-up ends it; the cancel pushes one more, which finds it ended.
    assert_eq!(wakes, 2, "one wake-up past the deadline ends it");
    assert_eq!(launches.load(Ordering::SeqCst), 0, "nothing ran unapproved");
}
