//! A tool that says it needs approval waits for one, even when `[limits]
//! approval_required` does not name it: the runtime adds every such tool it is given.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use skein_core::{AgentSet, Event, Limits};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::{Tool, ToolBox, ToolContext};

/// A tool with a side effect worth a person's look: it counts its launches.
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
async fn a_tool_asking_for_approval_waits_although_the_config_names_none() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("pilot.yaml"),
        "turns:\n  - tool_calls:\n      - tool: launch\n        args: {}\n  - answer: \"{{ results[0] }}\"\n",
    )
    .unwrap();
    let agents = AgentSet::load(
        &[(
            "pilot.md".into(),
            "---\nname: pilot\nmodel: scripted:pilot\ntools: [launch]\n---\nLaunch.\n".into(),
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
    let cfg = RuntimeConfig {
        limits: Limits {
            approval_required: vec![],
            ..Limits::default()
        },
        ..RuntimeConfig::default()
    };
    let rt = Runtime::new(store.backend(), Arc::new(agents), models, tools, cfg);
    assert!(rt
        .cfg
        .limits
        .approval_required
        .contains(&"launch".to_string()));
    let id = rt
        .submit(Submission {
            agent: "pilot".into(),
            mission: "go".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // Work every job there is.
    while let Some(job) = rt
        .backend
        .jobs
        .claim("default", Duration::from_millis(200))
        .await
        .unwrap()
    {
        rt.process(&job).await.unwrap();
        rt.backend.jobs.ack(&job).await.unwrap();
    }
    let records = rt.backend.log.read(&id, 1).await.unwrap();
    let last = &records.last().unwrap().env.body;
    match last {
        Event::ApprovalRequested(a) => assert_eq!(a.tool, "launch"),
        other => panic!("expected an approval request, got {}", other.kind()),
    }
    assert!(!records
        .iter()
        .any(|r| matches!(r.env.body, Event::ToolCalled(_))));
    assert_eq!(launches.load(Ordering::SeqCst), 0, "nothing ran unapproved");
}
