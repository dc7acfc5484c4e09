//! A tool that says it needs approval waits for one, even when `[limits]
//! approval_required` does not name it: the runtime adds every such tool it is given.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::Launch;
use serde_json::json;
use skein_core::token::{open, sign, TokenKind};
use skein_core::{AgentSet, Event, Limits, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::hitl;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_runtime::TokenRefusal;
use skein_sled::SledStore;
use skein_tools::ToolBox;

mod common;

/// A runtime whose `pilot` has run until it waits for approval of its `launch`.
async fn paused_pilot() -> (tempfile::TempDir, Arc<Runtime>, SessionId, Arc<AtomicUsize>) {
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
    (dir, rt, id, launches)
}

#[tokio::test]
async fn a_tool_asking_for_approval_waits_although_the_config_names_none() {
    let (_dir, rt, id, launches) = paused_pilot().await;
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

#[tokio::test]
async fn a_token_of_the_wrong_kind_is_refused_as_such_and_writes_nothing() {
    let (_dir, rt, id, launches) = paused_pilot().await;
    let items = hitl::inbox(&rt, std::slice::from_ref(&id)).await.unwrap();
    assert_eq!(items.len(), 1, "one approval waits");
    let approval = items[0].token.clone();
    let before = rt.backend.log.read(&id, 1).await.unwrap().len();

    // The approval token offered as an answer.
    let e = hitl::answer(&rt, &approval, json!({}), None)
        .await
        .unwrap_err();
    assert_eq!(e.token_refusal(), Some(TokenRefusal::WrongKind), "{e}");
    assert!(e.to_string().contains("approval token"), "{e}");

    // The same pause, signed as an input token, offered as a decision.
    let mut claims = open(&rt.cfg.token_secret.0, &approval).unwrap();
    assert_eq!(claims.kind, TokenKind::Approval);
    claims.kind = TokenKind::Input;
    let input = sign(&rt.cfg.token_secret.0, &claims);
    let e = hitl::decide_approval(&rt, &input, true, None, None)
        .await
        .unwrap_err();
    assert_eq!(e.token_refusal(), Some(TokenRefusal::WrongKind), "{e}");

    // A forged one and a garbled one, each with its own refusal.
    let forged = sign(b"another secret entirely", &claims);
    let e = hitl::answer(&rt, &forged, json!({}), None)
        .await
        .unwrap_err();
    assert_eq!(e.token_refusal(), Some(TokenRefusal::Forged), "{e}");
    let e = hitl::decide_approval(&rt, "skt1.zz", true, None, None)
        .await
        .unwrap_err();
    assert_eq!(e.token_refusal(), Some(TokenRefusal::Malformed), "{e}");
    assert_eq!(rt.backend.log.read(&id, 1).await.unwrap().len(), before);

    // The right token decides once; the second use is a reuse.
    hitl::decide_approval(&rt, &approval, false, Some("not today".into()), None)
        .await
        .unwrap();
    let e = hitl::decide_approval(&rt, &approval, true, None, None)
        .await
        .unwrap_err();
    assert_eq!(e.token_refusal(), Some(TokenRefusal::Reused), "{e}");
    assert_eq!(launches.load(Ordering::SeqCst), 0, "nothing ran unapproved");
}
