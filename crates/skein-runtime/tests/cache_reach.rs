//! A cached answer is not served once an agent it was made with has a new definition
//! (features: cache, rolling change of the definitions, patterns).
//!
//! `top` asks `mid`, a cached agent, which asks `helper`. The files change between two
//! lives of the store: `helper` now runs another model (and answers otherwise), `mid`'s
//! own file is as it was. A fresh run of `mid` answers with the new helper's answer, so
//! the entry made with the old one must not answer it. The cache key covered `mid`'s own
//! definition only, and served the old answer. The same files in both lives are answered
//! from the cache (so the test would fail for a cache that never hits).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use skein_core::Event;
use skein_runtime::worker::{RuntimeConfig, Submission};

/// The agents, `helper` on the model `helper_model`; the scripts of both helpers written.
fn agents(dir: &std::path::Path, helper_model: &str) -> skein_core::AgentSet {
    let asks = |agent: &str, me: &str| {
        format!(
            "turns:\n  - tool_calls:\n      - tool: call_agent\n        args: {{agent: {agent}, \
             mission: \"the job\"}}\n  - answer: \"{me}: {{{{ results[0].result }}}}\"\n"
        )
    };
    std::fs::write(
        dir.join("helper2.yaml"),
        "turns:\n  - answer: helped anew\n",
    )
    .unwrap();
    let mut set = skein_core::testing::scripted_agents(
        dir,
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
    if helper_model != "helper" {
        let text = set.agents["helper"].text.replace(
            "model: scripted:helper",
            &format!("model: scripted:{helper_model}"),
        );
        let files: Vec<(String, String)> = set
            .agents
            .iter()
            .map(|(name, d)| {
                let t = if name == "helper" {
                    text.clone()
                } else {
                    d.text.clone()
                };
                (format!("{name}.md"), t)
            })
            .collect();
        set = skein_core::AgentSet::load(&files, &[]).unwrap();
    }
    set
}

/// One life of the store in `dir` with the helper on `helper_model`: a tree of `top`
/// named `tree`, run to its end. Its answer, and whether `mid` was a cache hit.
async fn life(dir: &std::path::Path, helper_model: &str, tree: &str) -> (String, bool) {
    let (store, rt) =
        common::scripted_runtime(dir, agents(dir, helper_model), RuntimeConfig::default());
    let root = rt
        .submit(Submission {
            agent: "top".into(),
            mission: "m".into(),
            id: Some(tree.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    rt.run_tree(&root, 2).await.unwrap();
    let answer = match rt.backend.log.last(&root).await.unwrap().unwrap().env.body {
        Event::Completed(c) => c.answer,
        other => panic!("{tree} did not complete: {}", other.kind()),
    };
    let hit = rt
        .backend
        .log
        .read(&root, 1)
        .await
        .unwrap()
        .iter()
        .any(|r| matches!(r.env.body, Event::CacheHit(_)));
    drop(rt);
    drop(store);
    (answer, hit)
}

#[tokio::test]
async fn a_cached_answer_made_with_a_sub_agents_old_definition_is_not_served() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        life(dir.path(), "helper", "first").await,
        ("top: mid: helped".into(), false)
    );
    assert_eq!(
        life(dir.path(), "helper2", "second").await,
        ("top: mid: helped anew".into(), false),
        "mid's answer made with the old helper was served from the cache"
    );
}

#[tokio::test]
async fn the_same_definitions_in_a_later_life_are_answered_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        life(dir.path(), "helper", "first").await,
        ("top: mid: helped".into(), false)
    );
    assert_eq!(
        life(dir.path(), "helper", "second").await,
        ("top: mid: helped".into(), true)
    );
}
