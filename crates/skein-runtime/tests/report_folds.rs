//! The report at the end of a run is made from the folds the runtime kept while it wrote
//! the tree's records: its rows must be those of the tree read back from the logs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use skein_core::{AgentSet, Limits};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::inspect::{rows_of_folds, tree_rows};
use skein_runtime::session::Folded;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::{ToolBox, ToolsConfig};

/// A lead that delegates to three leaves, each listing the workspace twice.
fn runtime(dir: &std::path::Path) -> (Arc<SledStore>, Arc<Runtime>) {
    std::fs::write(
        dir.join("lead.yaml"),
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        repeat: 3\n        \
         args: {agent: leaf, mission: \"part {{ i }}\"}\n  - answer: \"{{ results | length }} parts\"\n",
    )
    .unwrap();
    let mut leaf = String::from("turns:\n");
    for _ in 0..2 {
        leaf.push_str("  - tool_calls:\n      - tool: list_dir\n        args: {path: \".\"}\n");
    }
    leaf.push_str("  - answer: \"done with {{ mission }}\"\n");
    std::fs::write(dir.join("leaf.yaml"), leaf).unwrap();
    let agents = AgentSet::load(
        &[
            (
                "lead.md".into(),
                "---\nname: lead\nmodel: scripted:lead\nagents: [leaf]\ncache: false\n---\nLead.\n"
                    .into(),
            ),
            (
                "leaf.md".into(),
                "---\nname: leaf\nmodel: scripted:leaf\ntools: [list_dir]\n\
                 idempotent_tools: [list_dir]\ncache: false\n---\nLook.\n"
                    .into(),
            ),
        ],
        &[],
    )
    .unwrap();
    let store = SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap();
    let rt = on(&store, agents, dir);
    (store, rt)
}

/// A runtime with `agents` on `store`, keeping no fold yet.
fn on(store: &Arc<SledStore>, agents: AgentSet, dir: &std::path::Path) -> Arc<Runtime> {
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir)));
    Runtime::new(
        store.backend(),
        Arc::new(agents),
        models,
        ToolBox::builtin(&ToolsConfig::default()),
        RuntimeConfig {
            limits: Limits::default(),
            ..RuntimeConfig::default()
        },
    )
}

#[tokio::test]
async fn the_rows_of_the_folds_a_run_kept_are_those_read_back_from_the_logs() {
    // Given a tree run to its end in this runtime.
    let dir = tempfile::tempdir().unwrap();
    let (store, rt) = runtime(dir.path());
    let id = rt
        .submit(Submission {
            agent: "lead".into(),
            mission: "three parts".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let root = rt.run_tree(&id, 4).await.unwrap();
    assert_eq!(root.state.ending.answer.as_deref(), Some("3 parts"));

    // When its rows are made from the folds it kept, and from its logs read again.
    let held = rows_of_folds(&rt.tree_folds_held(&id).await.unwrap());
    let read = tree_rows(&rt.backend, &id).await.unwrap();

    // Then they are the same rows, tool calls and workers and end times included.
    assert_eq!(held.len(), 4);
    assert_eq!(
        held.iter().map(|r| r.tool_calls).sum::<u32>(),
        6,
        "{held:?}"
    );
    assert!(held.iter().all(|r| r.ended_at.is_some()), "{held:?}");
    assert_eq!(
        serde_json::to_value(&held).unwrap(),
        serde_json::to_value(&read).unwrap()
    );

    // And a runtime that kept no fold (a later process) reads the logs for the same rows.
    let fresh = on(&store, rt.agents.as_ref().clone(), dir.path());
    let cold = rows_of_folds(&fresh.tree_folds_held(&id).await.unwrap());
    assert_eq!(
        serde_json::to_value(&cold).unwrap(),
        serde_json::to_value(&read).unwrap()
    );

    // And the root's fold the run handed back (the one it kept) is its log's, folded
    // afresh: the same state, to the last record and its hash.
    let mut whole = Folded::new(id.clone());
    whole
        .absorb(&rt.backend.log.read(&id, 1).await.unwrap())
        .unwrap();
    assert_eq!(root.last_hash, whole.last_hash);
    assert_eq!(root.state, whole.state);
}

#[tokio::test]
async fn a_kept_fold_behind_its_log_is_read_forward_for_the_rows_and_left_as_it_was_kept() {
    // Given a tree submitted in one runtime, which keeps the root's fold as submitted, and
    // cancelled by another on the same store: the first runtime's fold lacks that record.
    let dir = tempfile::tempdir().unwrap();
    let (store, rt) = runtime(dir.path());
    let id = rt
        .submit(Submission {
            agent: "lead".into(),
            mission: "stopped early".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let (f, _) = rt.load(&id).await.unwrap();
    assert_eq!(f.state.status, skein_core::Status::Running);
    rt.keep_state(f);
    let other = on(&store, rt.agents.as_ref().clone(), dir.path());
    assert_eq!(
        skein_runtime::control::cancel(&other, &id, "not needed")
            .await
            .unwrap(),
        1
    );

    // When the first runtime makes the tree's rows from the folds it holds.
    let held = rt.tree_folds_held(&id).await.unwrap();

    // Then they show the cancel, as the logs read back do.
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].state.status, skein_core::Status::Cancelled);
    assert_eq!(
        serde_json::to_value(rows_of_folds(&held)).unwrap(),
        serde_json::to_value(tree_rows(&rt.backend, &id).await.unwrap()).unwrap()
    );
    // And a later load of the session in that runtime reads the same state.
    let (loaded, _) = rt.load(&id).await.unwrap();
    assert_eq!(loaded.state, held[0].state);
    assert_eq!(loaded.last_hash, held[0].last_hash);
}
