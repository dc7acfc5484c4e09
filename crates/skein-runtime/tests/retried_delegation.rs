//! Where a delegation meets a crash, a shared run and a question (features: cache's single
//! flight, resume after a crash, ask_user answered by the parent's model, cancel, usage).
//!
//! - A step that delegated writes its children before its own record of them. After a
//!   crash between the two, the step runs again: each call must take the child its earlier
//!   attempt created, even when another tree now holds the mission's single-flight claim.
//!   Sharing that run instead left the first child running unrecorded: the mission was
//!   paid for twice, and the child's tokens counted in no total (a generated world of the
//!   simulation found it, seed 6333 of `--generated`).
//! - A child that asked a question its parent's model answered is named by two of the
//!   parent's calls (the one that started it, the one that answered it). A parent ended
//!   before it settled the child counted what the child spent since its question twice
//!   (seed 1484 of `--versions --swarm`).
//! - Two holders of a parent's job (a lease ran out) run the same step, which answers the
//!   child's question: the second finds the child answered and moved on. That answer was
//!   its own call's; recorded as a refusal instead, the child ran on unrecorded and its
//!   tokens reached no total (swarm seed 12768).
//! - A step that puts a follow-up to a `chat: true` child writes the question into the
//!   child's log before its own record of it. The child may answer (a sweep wakes it) and
//!   its asker be cancelled before that record is written: the child's first answer was
//!   counted when it was settled, the follow-up's never. A cancelled session rolled up
//!   only the children it had not settled, and the follow-up's tokens reached no total
//!   (swarm seed 4145 of `--generated --inner-cancels`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use skein_core::event::{DelegationKind, Outcome};
use skein_core::message::Usage;
use skein_core::{AgentSet, Event, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::ports::roots::{RootFilter, RootsPage};
use skein_runtime::ports::{Durability, EventLog};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;
use skein_tools::ToolBox;

/// Agents named as given, each with the given lines of front matter and its script written
/// to `dir` for the scripted model.
fn agents_in(dir: &std::path::Path, agents: &[(&str, &str, &str)]) -> Arc<AgentSet> {
    Arc::new(skein_core::testing::scripted_agents(dir, agents))
}

/// A runtime on a sled store of its own under `dir` (named `name`).
fn runtime(dir: &std::path::Path, name: &str, agents: Arc<AgentSet>) -> Arc<Runtime> {
    let store = SledStore::open(
        &dir.join(format!("{name}-data")),
        &dir.join(format!("{name}-ws")),
    )
    .unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir)));
    Runtime::new(
        store.backend(),
        agents,
        models,
        ToolBox::new(),
        RuntimeConfig::default(),
    )
}

/// Submits a tree `tree` of `agent`.
async fn submit(rt: &Runtime, agent: &str) -> SessionId {
    rt.submit(Submission {
        agent: agent.into(),
        mission: "m".into(),
        id: Some("tree".into()),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Writes each log whole into `log`, as the logs a first life of a process left.
async fn write_logs(log: &dyn EventLog, logs: &[(&SessionId, &[skein_core::Record])]) {
    for (id, records) in logs {
        log.append(id, 0, records, Durability::Now).await.unwrap();
    }
}

/// A tree of `agent` run to its end on a store of its own under `dir` (`first`): what a
/// test takes the logs a step stopped in the middle leaves from.
async fn run_whole(
    dir: &std::path::Path,
    agents: Arc<AgentSet>,
    agent: &str,
) -> (Arc<Runtime>, SessionId) {
    let first = runtime(dir, "first", agents);
    let root = submit(&first, agent).await;
    first.run_tree(&root, 2).await.unwrap();
    (first, root)
}

/// What the model calls recorded in `ids`' logs spent.
async fn spent_by(rt: &Runtime, ids: &[&SessionId]) -> Usage {
    let mut total = Usage::default();
    for id in ids {
        for r in rt.backend.log.read(id, 1).await.unwrap() {
            if let Event::ModelCalled(m) = &r.env.body {
                total.add(&m.usage);
            }
        }
    }
    total
}

#[tokio::test]
async fn a_step_run_again_after_a_crash_takes_its_own_child_over_another_tree_s_run() {
    let dir = tempfile::tempdir().unwrap();
    let agents = agents_in(
        dir.path(),
        &[
            (
                "boss",
                "agents: [helper]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"the same job\"}\n  - answer: \"boss: {{ results[0].result }}\"\n",
            ),
            ("helper", "", "turns:\n  - answer: helped\n"),
        ],
    );
    // The first life: the boss's first step writes its child, then its record of it.
    let first = runtime(dir.path(), "first", agents.clone());
    let root = submit(&first, "boss").await;
    let job = first
        .backend
        .jobs
        .claim("default", Duration::from_secs(1))
        .await
        .unwrap()
        .expect("the boss's job");
    assert_eq!(job.session, root);
    first.process(&job).await.unwrap();
    let made = common::delegations(&first, &root).await;
    assert_eq!(made.len(), 1, "{made:?}");
    let child = made[0].0.clone();
    // What a crash between the two appends leaves: the child's log, and the boss's log
    // without its record of the child.
    let boss_log: Vec<_> = first
        .backend
        .log
        .read(&root, 1)
        .await
        .unwrap()
        .into_iter()
        .take_while(|r| !matches!(r.env.body, Event::Delegated(_)))
        .collect();
    let child_log = first.backend.log.read(&child, 1).await.unwrap();
    let hash = match &child_log[0].env.body {
        Event::Submitted(s) => s.mission_hash.clone(),
        other => panic!("the child's first record is {}", other.kind()),
    };
    let second = runtime(dir.path(), "second", agents);
    write_logs(
        &*second.backend.log,
        &[(&root, &boss_log), (&child, &child_log)],
    )
    .await;
    // Meanwhile another tree started a run of the same mission and holds its claim.
    let other = SessionId::parse("other.helper-1").unwrap();
    assert_eq!(
        second
            .backend
            .cache
            .claim_inflight(&hash, &other)
            .await
            .unwrap(),
        None
    );
    // The restart wakes the tree (as `skein resume` does) and runs it.
    second.requeue_tree(&root).await.unwrap();
    second.run_tree(&root, 2).await.unwrap();
    assert_eq!(
        common::delegations(&second, &root).await,
        vec![(child.clone(), DelegationKind::Started)],
        "the call did not take its own child"
    );
    let last = second.backend.log.last(&root).await.unwrap().unwrap();
    match &last.env.body {
        Event::Completed(c) => {
            assert_eq!(c.answer, "boss: helped");
            // Every token spent in the tree is in its total: the child's too.
            assert_eq!(c.usage_total, spent_by(&second, &[&root, &child]).await);
        }
        other => panic!("the tree did not complete: {}", other.kind()),
    }
}

#[tokio::test]
async fn a_session_ended_before_it_settled_a_child_it_answered_counts_the_child_once() {
    let dir = tempfile::tempdir().unwrap();
    let agents = agents_in(
        dir.path(),
        &[
            (
                "top",
                "agents: [mid]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: mid, mission: \"part\"}\n  - answer: \"top done\"\n",
            ),
            (
                "mid",
                "agents: [asker]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: asker, mission: \"job\"}\n  - when: \"results | selectattr('need_user_input', 'defined') | list | length > 0\"\n    tool_calls:\n      - tool: call_agent\n        args:\n          resume_token: \"{{ (results | selectattr('need_user_input', 'defined') | first).resume_token }}\"\n          answers: {k: \"this way\"}\n  - answer: \"mid done\"\n",
            ),
            (
                "asker",
                "tools: [ask_user]\n",
                "turns:\n  - tool_calls:\n      - tool: ask_user\n        args:\n          questions: [{key: k, question: \"Which way?\"}]\n  - answer: \"asker went {{ results[0].answers.k }}, a long answer to spend tokens on\"\n",
            ),
        ],
    );
    let rt = runtime(dir.path(), "data", agents);
    let root = submit(&rt, "top").await;
    let jobs = &rt.backend.jobs;
    let ended = |r: Option<skein_core::Record>| r.is_some_and(|r| r.env.body.is_terminal());
    // Run the tree job by job until `mid` answered the asker's question and the asker
    // answered, then cancel `mid` before it settles the asker.
    let (mid, asker) = loop {
        let job = jobs
            .claim("default", Duration::from_secs(1))
            .await
            .unwrap()
            .expect("a job while the tree runs");
        let kids = common::delegations(&rt, &root).await;
        if let Some((mid, _)) = kids.first() {
            let theirs = common::delegations(&rt, mid).await;
            let answered = theirs.iter().any(|(_, k)| *k == DelegationKind::Resumed);
            if let Some((asker, _)) = theirs.first() {
                if job.session == *mid
                    && answered
                    && ended(rt.backend.log.last(asker).await.unwrap())
                {
                    jobs.ack(&job).await.unwrap();
                    break (mid.clone(), asker.clone());
                }
            }
        }
        rt.process(&job).await.unwrap();
        jobs.ack(&job).await.unwrap();
    };
    skein_runtime::control::cancel(&rt, &mid, "cancelled by an operator")
        .await
        .unwrap();
    let end = rt.run_tree(&root, 2).await.unwrap();
    assert!(end.state.status.is_terminal(), "{:?}", end.state.status);
    let settled = rt
        .backend
        .log
        .read(&root, 1)
        .await
        .unwrap()
        .into_iter()
        .find_map(|r| match r.env.body {
            Event::ChildSettled(c) if c.child == mid => Some(c.outcome),
            _ => None,
        });
    match settled {
        Some(Outcome::Failed { usage, .. }) => {
            // What `mid` and the asker spent (the asker's answer after its question too),
            // each token once.
            let spent = spent_by(&rt, &[&mid, &asker]).await;
            assert!(spent.output_tokens > 0);
            assert_eq!(usage, spent);
        }
        other => panic!("`mid` was not settled as cancelled: {other:?}"),
    }
}

/// The store's log, except that the first append to `session` finds there, first, what
/// another holder of the same step wrote: `theirs`, appended just before.
struct Beaten {
    inner: Arc<dyn EventLog>,
    session: SessionId,
    theirs: std::sync::Mutex<Option<(u64, Vec<skein_core::Record>)>>,
}

#[async_trait::async_trait]
impl EventLog for Beaten {
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[skein_core::Record],
        durability: Durability,
    ) -> skein_runtime::Result<()> {
        if *session == self.session {
            let theirs = self.theirs.lock().unwrap().take();
            if let Some((after, theirs)) = theirs {
                self.inner
                    .append(session, after, &theirs, Durability::Now)
                    .await?;
            }
        }
        self.inner
            .append(session, expected_last, records, durability)
            .await
    }
    async fn read(
        &self,
        session: &SessionId,
        from_seq: u64,
    ) -> skein_runtime::Result<Vec<skein_core::Record>> {
        self.inner.read(session, from_seq).await
    }
    async fn last(&self, session: &SessionId) -> skein_runtime::Result<Option<skein_core::Record>> {
        self.inner.last(session).await
    }
    async fn tree(&self, root: &SessionId) -> skein_runtime::Result<Vec<SessionId>> {
        self.inner.tree(root).await
    }
    async fn read_tree(
        &self,
        root: &SessionId,
        ids: &[SessionId],
    ) -> skein_runtime::Result<Option<Vec<Vec<skein_core::Record>>>> {
        self.inner.read_tree(root, ids).await
    }
    async fn roots(&self) -> skein_runtime::Result<Vec<SessionId>> {
        self.inner.roots().await
    }
    async fn roots_page(
        &self,
        filter: &RootFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> skein_runtime::Result<RootsPage> {
        self.inner.roots_page(filter, limit, cursor).await
    }
    async fn open_roots(&self) -> skein_runtime::Result<Vec<SessionId>> {
        self.inner.open_roots().await
    }
}

#[tokio::test]
async fn a_step_that_finds_its_own_answer_given_by_another_run_of_it_resumes_the_child() {
    let dir = tempfile::tempdir().unwrap();
    let agents = agents_in(
        dir.path(),
        &[
            (
                "clerk",
                "agents: [asker]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: asker, mission: \"set up\"}\n  - when: \"results | selectattr('need_user_input', 'defined') | list | length > 0\"\n    tool_calls:\n      - tool: call_agent\n        args:\n          resume_token: \"{{ (results | selectattr('need_user_input', 'defined') | first).resume_token }}\"\n          answers: {k: \"v78\"}\n  - answer: \"clerk: {{ results[0].result }}\"\n",
            ),
            (
                "asker",
                "tools: [ask_user]\n",
                "turns:\n  - tool_calls:\n      - tool: ask_user\n        args:\n          questions: [{key: k, question: \"Which version?\"}]\n  - answer: \"asker used {{ results[0].answers.k }}\"\n",
            ),
        ],
    );
    // The step as one holder ran it, to its end.
    let (first, root) = run_whole(dir.path(), agents.clone(), "clerk").await;
    let asker = common::delegations(&first, &root).await[0].0.clone();
    let clerk_log = first.backend.log.read(&root, 1).await.unwrap();
    let asker_log = first.backend.log.read(&asker, 1).await.unwrap();
    let resumed = clerk_log
        .iter()
        .position(
            |r| matches!(&r.env.body, Event::Delegated(d) if d.kind == DelegationKind::Resumed),
        )
        .expect("the clerk resumed the asker");
    let answered = asker_log
        .iter()
        .position(|r| matches!(r.env.body, Event::InputProvided(_)))
        .expect("the asker was answered");
    // The other holder: the clerk's step is to run again (its log stops before its record
    // of the resume), and the asker is paused; the first append to the asker finds the
    // other run's answers there, and the asker's answer after them.
    let store = SledStore::open(
        &dir.path().join("second-data"),
        &dir.path().join("second-ws"),
    )
    .unwrap();
    let mut backend = store.backend();
    backend.log = Arc::new(Beaten {
        inner: backend.log.clone(),
        session: asker.clone(),
        theirs: std::sync::Mutex::new(Some((answered as u64, asker_log[answered..].to_vec()))),
    });
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir.path())));
    let second = Runtime::new(
        backend,
        agents,
        models,
        ToolBox::new(),
        RuntimeConfig::default(),
    );
    write_logs(
        &*store,
        &[
            (&root, &clerk_log[..resumed]),
            (&asker, &asker_log[..answered]),
        ],
    )
    .await;
    second.requeue_tree(&root).await.unwrap();
    second.run_tree(&root, 2).await.unwrap();
    let kinds: Vec<DelegationKind> = common::delegations(&second, &root)
        .await
        .into_iter()
        .map(|(_, k)| k)
        .collect();
    assert_eq!(
        kinds,
        vec![DelegationKind::Started, DelegationKind::Resumed],
        "the call did not take the answer given by its other run as its own"
    );
    let last = second.backend.log.last(&root).await.unwrap().unwrap();
    match &last.env.body {
        Event::Completed(c) => {
            assert_eq!(c.answer, "clerk: asker used v78");
            assert_eq!(c.usage_total, spent_by(&second, &[&root, &asker]).await);
        }
        other => panic!("the tree did not complete: {}", other.kind()),
    }
}

#[tokio::test]
async fn a_follow_up_answered_after_its_asker_stopped_short_of_recording_it_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let agents = agents_in(
        dir.path(),
        &[
            (
                "top",
                "agents: [mid]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: mid, mission: \"the load\"}\n  - answer: \"top: {{ results[0].result }}\"\n",
            ),
            (
                "mid",
                "agents: [expert]\ntools: [ask_clarification]\n",
                "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {agent: expert, mission: \"estimate the load\"}\n  - tool_calls:\n      - tool: ask_clarification\n        args: {session_id: \"{{ results[0].session_id }}\", question: \"and the error bars?\"}\n  - answer: \"{{ results[0].result }}\"\n",
            ),
            (
                "expert",
                "chat: true\n",
                "turns:\n  - answer: \"the load is 42\"\n  - answer: \"plus or minus 3, after a long and careful look\"\n",
            ),
        ],
    );
    // The whole run, to take from it what a step stopped in the middle leaves.
    let (first, root) = run_whole(dir.path(), agents.clone(), "top").await;
    let mid = root.child("mid", 1);
    let expert = mid.child("expert", 1);
    let upto = |log: Vec<skein_core::Record>, last: &dyn Fn(&Event) -> bool| {
        let n = log
            .iter()
            .position(|r| last(&r.env.body))
            .expect("the record to stop at");
        log[..=n].to_vec()
    };
    let top_log = upto(first.backend.log.read(&root, 1).await.unwrap(), &|e| {
        matches!(e, Event::Delegated(_))
    });
    // `mid` took its turn that asks the follow-up, and stopped before its record of it.
    let mid_log = first.backend.log.read(&mid, 1).await.unwrap();
    let resumed = mid_log
        .iter()
        .position(
            |r| matches!(&r.env.body, Event::Delegated(d) if d.kind == DelegationKind::Resumed),
        )
        .expect("mid put the follow-up");
    let mid_log = mid_log[..resumed].to_vec();
    assert!(
        mid_log
            .iter()
            .any(|r| matches!(r.env.body, Event::ChildSettled(_))),
        "mid had settled the expert's first answer"
    );
    let expert_log = upto(first.backend.log.read(&expert, 1).await.unwrap(), &|e| {
        matches!(e, Event::ClarificationRequested(_))
    });
    let second = runtime(dir.path(), "second", agents);
    write_logs(
        &*second.backend.log,
        &[(&root, &top_log), (&mid, &mid_log), (&expert, &expert_log)],
    )
    .await;
    // The expert answers the follow-up; then an operator cancels `mid`, which never
    // recorded it.
    second.backend.jobs.push("default", &expert).await.unwrap();
    let job = second
        .backend
        .jobs
        .claim("default", Duration::from_secs(1))
        .await
        .unwrap()
        .expect("the expert's job");
    assert_eq!(job.session, expert);
    second.process(&job).await.unwrap();
    second.backend.jobs.ack(&job).await.unwrap();
    let last = |id: SessionId| {
        let rt = second.clone();
        async move { rt.backend.log.last(&id).await.unwrap().unwrap().env.body }
    };
    assert!(
        matches!(last(expert.clone()).await, Event::Completed(_)),
        "the expert did not answer the follow-up"
    );
    skein_runtime::control::cancel(&second, &mid, "cancelled by an operator")
        .await
        .unwrap();
    second.requeue_tree(&root).await.unwrap();
    second.run_tree(&root, 2).await.unwrap();
    match last(root.clone()).await {
        Event::Completed(c) => assert_eq!(
            c.usage_total,
            spent_by(&second, &[&root, &mid, &expert]).await,
            "the tree's total is not what its sessions spent"
        ),
        other => panic!("the tree did not complete: {}", other.kind()),
    }
}
