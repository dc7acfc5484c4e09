//! An answer made without some child's answer is not cached (features: cache, cancel).
//!
//! `top` asks `mid`, a cached agent, which asks `helper`. A person cancels the helper
//! while it runs: `mid` answers without it, and so does `top`. Neither answer is what a
//! fresh run of the mission gives, so neither may answer a later call from the cache:
//! a second tree asking `mid` the same runs it afresh. Without the cancel, the second
//! tree's call is answered from the cache (the test would otherwise pass for a cache
//! that never hits).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::delegations;
use skein_core::event::DelegationKind;
use skein_core::{Event, SessionId};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;

/// One `call_agent` turn to `agent` on "the job", then an answer with its result.
fn asks(agent: &str, me: &str) -> String {
    format!(
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {{agent: {agent}, \
         mission: \"the job\"}}\n  - answer: \"{me}: {{{{ results[0].result }}}}\"\n"
    )
}

struct World {
    _dir: tempfile::TempDir,
    _store: Arc<SledStore>,
    rt: Arc<Runtime>,
}

fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let agents = skein_core::testing::scripted_agents(
        dir.path(),
        &[
            ("top", "agents: [mid]\n", &asks("mid", "top")),
            (
                "mid",
                "agents: [helper]\ncache: {ttl: 1h}\n",
                &asks("helper", "mid"),
            ),
            ("helper", "", "turns:\n  - answer: helped\n"),
        ],
    );
    let (store, rt) = common::scripted_runtime(dir.path(), agents, RuntimeConfig::default());
    World {
        _dir: dir,
        _store: store,
        rt,
    }
}

impl World {
    async fn submit(&self, id: &str) -> SessionId {
        self.rt
            .submit(Submission {
                agent: "top".into(),
                mission: "m".into(),
                id: Some(id.into()),
                ..Default::default()
            })
            .await
            .unwrap()
    }

    /// Runs jobs until the helper's comes up, which is claimed and handed back: its run
    /// has not begun.
    async fn run_until_the_helper(&self) -> SessionId {
        let jobs = &self.rt.backend.jobs;
        loop {
            let job = jobs
                .claim("default", Duration::from_millis(500))
                .await
                .unwrap()
                .expect("a job");
            if job.session.as_str().ends_with(".helper-1") {
                jobs.retry(&job, Duration::ZERO).await.unwrap();
                return job.session;
            }
            self.rt.process(&job).await.unwrap();
            jobs.ack(&job).await.unwrap();
        }
    }

    /// The tree's end, which must be a completion: its answer and whether it is partial.
    async fn ending(&self, id: &SessionId) -> (String, bool) {
        self.rt.requeue_tree(id).await.unwrap();
        self.rt.run_tree(id, 2).await.unwrap();
        match self
            .rt
            .backend
            .log
            .last(id)
            .await
            .unwrap()
            .unwrap()
            .env
            .body
        {
            Event::Completed(c) => (c.answer, c.partial),
            other => panic!("{id} did not complete: {}", other.kind()),
        }
    }

    /// How the second tree's `top` got its `mid`: a run of its own, or the cache.
    async fn seconds_mid(&self) -> Vec<&'static str> {
        let second = self.submit("second").await;
        self.ending(&second).await;
        let mut how: Vec<&str> = delegations(&self.rt, &second)
            .await
            .into_iter()
            .map(|(_, k)| match k {
                DelegationKind::Started => "started",
                _ => "other",
            })
            .collect();
        let log = self.rt.backend.log.read(&second, 1).await.unwrap();
        if log.iter().any(|r| matches!(r.env.body, Event::CacheHit(_))) {
            how.push("cache hit");
        }
        how
    }
}

#[tokio::test]
async fn an_answer_made_without_a_cancelled_childs_answer_is_not_cached_at_any_depth() {
    let w = world();
    let first = w.submit("first").await;
    let helper = w.run_until_the_helper().await;
    skein_runtime::control::cancel(&w.rt, &helper, "cancelled by a person")
        .await
        .unwrap();
    let (answer, partial) = w.ending(&first).await;
    assert!(answer.starts_with("top: mid: "), "{answer}");
    assert!(
        partial,
        "top's answer was made without the helper's: {answer}"
    );
    let mid = first.child("mid", 1);
    match w.rt.backend.log.last(&mid).await.unwrap().unwrap().env.body {
        Event::Completed(c) => assert!(c.partial, "mid's answer: {}", c.answer),
        other => panic!("mid did not complete: {}", other.kind()),
    }
    // `skein tree` shows which answers are partial: the two that went on without the
    // helper's, and not the helper's own end (a cancel).
    let rows = skein_runtime::inspect::tree_rows(&w.rt.backend, &first)
        .await
        .unwrap();
    let shown: Vec<(&str, bool)> = rows.iter().map(|r| (r.agent.as_str(), r.partial)).collect();
    assert_eq!(shown, vec![("top", true), ("mid", true), ("helper", false)]);
    assert_eq!(
        w.seconds_mid().await,
        vec!["started"],
        "mid's partial answer was served from the cache"
    );
}

#[tokio::test]
async fn a_whole_answer_is_cached_as_before() {
    let w = world();
    let first = w.submit("first").await;
    let (answer, partial) = w.ending(&first).await;
    assert_eq!(answer, "top: mid: helped");
    assert!(!partial);
    assert_eq!(w.seconds_mid().await, vec!["cache hit"]);
}
