//! A session that waits when its `limits.timeout` runs out (for a person, or for a child
//! that waits for one) ends then, timed out, at the first wake-up after its deadline: it
//! is not driven again, and its job does not come back. (A drive of a waiting session
//! that did not have to wait for anything used to finish before its deadline's timer was
//! ever looked at, and the session was woken again every few milliseconds for as long as
//! it waited.) The person's approval that comes after the timeout is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::Launch;
use skein_core::{AgentSet, Event, SessionId, Status};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::hitl;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_runtime::TokenRefusal;
use skein_sled::SledStore;
use skein_tools::ToolBox;

mod common;

/// What `pilot` runs: one `launch`, which waits for approval, then an answer.
const PILOT: &str =
    "turns:\n  - tool_calls:\n      - tool: launch\n        args: {}\n  - answer: \"{{ results[0] }}\"\n";

/// A runtime on a real sled store in `dir` with `agents` (name, front matter past the
/// name and model, script), the `launch` tool, and one tree of `root` submitted.
async fn submitted(
    dir: &std::path::Path,
    agents: &[(&str, &str, &str)],
    root: &str,
) -> (Arc<SledStore>, Arc<Runtime>, SessionId, Arc<AtomicUsize>) {
    let mut files = vec![];
    for (name, front, script) in agents {
        std::fs::write(dir.join(format!("{name}.yaml")), script).unwrap();
        files.push((
            format!("{name}.md"),
            format!("---\nname: {name}\nmodel: scripted:{name}\n{front}---\nDo it.\n"),
        ));
    }
    let agents = AgentSet::load(&files, &["launch".to_string()]).unwrap();
    let store = SledStore::open(&dir.join("data"), &dir.join("ws")).unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir)));
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
            agent: root.into(),
            mission: "go".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    (store, rt, id, launches)
}

/// Works every job until the tree waits (a tenth of a second with no job).
async fn until_the_tree_waits(rt: &Runtime) {
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
}

/// Works each wake-up as it comes until two seconds pass without one: returns how many
/// came. More than `most` fails at once.
async fn wake_ups(rt: &Runtime, most: usize) -> usize {
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
            wakes <= most,
            "sessions are woken again and again past the deadline"
        );
    }
    wakes
}

/// The session's status and the reason of its cancel (it must end cancelled).
async fn cancelled_why(rt: &Runtime, id: &SessionId) -> String {
    let (f, _) = rt.load(id).await.unwrap();
    assert_eq!(
        f.state.status,
        Status::Cancelled,
        "{id}: {:?}",
        f.state.status
    );
    let records = rt.backend.log.read(id, 1).await.unwrap();
    match &records.last().unwrap().env.body {
        Event::Cancelled(c) => c.reason.clone(),
        other => panic!("{id}: expected a cancel last, got {}", other.kind()),
    }
}

#[tokio::test]
async fn a_waiting_session_past_its_timeout_ends_at_its_next_wake_and_is_not_woken_again() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, rt, id, launches) = submitted(
        dir.path(),
        &[(
            "pilot",
            "tools: [launch]\nlimits: {timeout: 1500ms}\n",
            PILOT,
        )],
        "pilot",
    )
    .await;
    until_the_tree_waits(&rt).await;
    // The person's item, taken while the pilot waits.
    let items = hitl::inbox(&rt, std::slice::from_ref(&id)).await.unwrap();
    assert_eq!(items.len(), 1, "one approval waits");
    let wakes = wake_ups(&rt, 2).await;
    let why = cancelled_why(&rt, &id).await;
    assert!(
        why.contains("ran past its limits.timeout of 1500ms"),
        "{why}"
    );
    // The timer's wake-up ends it; the cancel pushes one more, which finds it ended.
    assert_eq!(wakes, 2, "one wake-up past the deadline ends it");
    // The approval comes too late: refused, as the session has ended, and nothing runs.
    let e = hitl::decide_approval(&rt, &items[0].token, true, None, None)
        .await
        .unwrap_err();
    assert_eq!(e.token_refusal(), Some(TokenRefusal::Ended), "{e}");
    let next = rt.backend.jobs.claim("default", Duration::from_millis(200));
    assert!(next.await.unwrap().is_none(), "the refusal woke nothing");
    assert_eq!(launches.load(Ordering::SeqCst), 0, "nothing ran unapproved");
}

#[tokio::test]
async fn a_parent_waiting_for_its_child_past_its_timeout_ends_with_its_subtree() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, rt, id, launches) = submitted(
        dir.path(),
        &[
            (
                "boss",
                "agents: [pilot]\nlimits: {timeout: 1500ms}\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: pilot, mission: \"launch it\"}\n  - answer: \"{{ results[0].result }}\"\n",
            ),
            ("pilot", "tools: [launch]\n", PILOT),
        ],
        "boss",
    )
    .await;
    until_the_tree_waits(&rt).await;
    let wakes = wake_ups(&rt, 4).await;
    let why = cancelled_why(&rt, &id).await;
    assert!(
        why.contains("`boss` ran past its limits.timeout of 1500ms"),
        "{why}"
    );
    let child = SessionId::parse(&format!("{id}.pilot-1")).unwrap();
    let why = cancelled_why(&rt, &child).await;
    assert!(why.contains("timed out"), "{why}");
    // The boss's timer; the cancel's wake-up of each session; the child's end, which
    // wakes its parent. Each finds what it wakes ended but the first.
    assert_eq!(wakes, 4, "wake-ups past the deadline");
    assert_eq!(launches.load(Ordering::SeqCst), 0, "nothing ran unapproved");
}
