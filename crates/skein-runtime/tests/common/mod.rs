//! Shared setup of the runtime tests: one `solo` agent that answers "done", on a real sled
//! store, with the scripted model.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{json, Value};

use skein_core::event::DelegationKind;
use skein_core::{AgentSet, Event, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::{Tool, ToolBox, ToolContext};

/// A runtime of `agents` on a real sled store in `dir` (`data/`, and the workspaces in
/// `ws/`), with the scripted model reading its scripts from `dir`. Keep the store (and the
/// directory) alive as long as the runtime.
pub fn scripted_runtime(
    dir: &std::path::Path,
    agents: impl Into<Arc<AgentSet>>,
    cfg: RuntimeConfig,
) -> (Arc<SledStore>, Arc<Runtime>) {
    let store = SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir)));
    let rt = Runtime::new(store.backend(), agents.into(), models, ToolBox::new(), cfg);
    (store, rt)
}

/// A runtime with the `solo` agent and `cfg`, and one submitted mission of it. Keep the
/// directory alive as long as the runtime.
pub async fn solo(cfg: RuntimeConfig) -> (tempfile::TempDir, Arc<Runtime>, SessionId) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("solo.yaml"), "turns:\n  - answer: done\n").unwrap();
    let agents = AgentSet::load(
        &[(
            "solo.md".into(),
            "---\nname: solo\nmodel: scripted:solo\n---\nAnswer.\n".into(),
        )],
        &[],
    )
    .unwrap();
    let (_store, rt) = scripted_runtime(dir.path(), agents, cfg);
    let id = rt
        .submit(Submission {
            agent: "solo".into(),
            mission: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    (dir, rt, id)
}

/// Takes the next job of the default pool (one must come within a second) and acks it
/// unrun, as a job lost to the backend, or run elsewhere, would leave the queue.
pub async fn take_job_unrun(rt: &Runtime) {
    let jobs = &rt.backend.jobs;
    let j = jobs
        .claim("default", std::time::Duration::from_secs(1))
        .await
        .unwrap()
        .expect("a job within a second");
    jobs.ack(&j).await.unwrap();
}

/// The children `id`'s log delegated to, in order, with how.
pub async fn delegations(rt: &Runtime, id: &SessionId) -> Vec<(SessionId, DelegationKind)> {
    rt.backend
        .log
        .read(id, 1)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|r| match r.env.body {
            Event::Delegated(d) => Some((d.child, d.kind)),
            _ => None,
        })
        .collect()
}

/// A tool with a side effect worth a person's look (it asks for approval first): it
/// counts its launches.
pub struct Launch(pub Arc<AtomicUsize>);

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
