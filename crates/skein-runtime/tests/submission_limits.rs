//! A submission's mission, context and inputs are capped where every entry (CLI, NATS
//! intake, `skein.api.submit`) hands it over: `Runtime::submit`. A refusal names the part,
//! its size and the limit, and creates nothing. So is a priority out of its range.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::json;
use skein_core::limits::{MAX_CONTEXT_BYTES, MAX_INPUTS_BYTES, MAX_MISSION_BYTES};
use skein_core::AgentSet;
use skein_runtime::worker::{RuntimeConfig, Submission};
use skein_runtime::Error;

#[tokio::test]
async fn oversized_parts_of_a_submission_are_refused_and_nothing_is_created() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("plain.yaml"), "turns:\n  - answer: ok\n").unwrap();
    let agents = AgentSet::load(
        &[(
            "plain.md".into(),
            "---\nname: plain\nmodel: scripted:plain\n---\nAnswer.\n".into(),
        )],
        &[],
    )
    .unwrap();
    let (_store, rt) = common::scripted_runtime(dir.path(), agents, RuntimeConfig::default());
    let sub = |mission: String, context: Option<String>, inputs: serde_json::Value| Submission {
        agent: "plain".into(),
        mission,
        context,
        inputs,
        ..Default::default()
    };
    // 10 MB of context, as once accepted.
    let cases = [
        (
            sub("m".into(), Some("c".repeat(10_000_000)), json!(null)),
            format!("context is 10000000 bytes; at most {MAX_CONTEXT_BYTES} are accepted"),
        ),
        (
            sub(
                "m".into(),
                Some("c".repeat(MAX_CONTEXT_BYTES + 1)),
                json!(null),
            ),
            format!("context is {} bytes", MAX_CONTEXT_BYTES + 1),
        ),
        (
            sub("m".into(), None, json!({"x": "i".repeat(MAX_INPUTS_BYTES)})),
            format!(
                "inputs are {} bytes as JSON; at most {MAX_INPUTS_BYTES} are accepted",
                MAX_INPUTS_BYTES + 8
            ),
        ),
        (
            sub("m".repeat(MAX_MISSION_BYTES + 1), None, json!(null)),
            format!("mission is {} bytes", MAX_MISSION_BYTES + 1),
        ),
    ];
    let mut cases = cases.to_vec();
    for p in [101, -101, i32::MAX] {
        cases.push((
            Submission {
                priority: Some(p),
                ..sub("m".into(), None, json!(null))
            },
            format!("priority {p} is out of range"),
        ));
    }
    for (s, want) in cases {
        let e = rt.submit(s).await.unwrap_err();
        assert!(
            matches!(
                e,
                Error::Refused {
                    kind: skein_runtime::RefusalKind::Invalid,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains(&want), "wanted `{want}`: {e}");
    }
    assert!(rt.backend.log.roots().await.unwrap().is_empty());
    assert_eq!(rt.backend.jobs.depth("default").await.unwrap(), 0);
    // At the limits, a submission is taken.
    let id = rt
        .submit(sub(
            "m".repeat(MAX_MISSION_BYTES),
            Some("c".repeat(MAX_CONTEXT_BYTES)),
            json!({"x": "i".repeat(MAX_INPUTS_BYTES - 8)}),
        ))
        .await
        .unwrap();
    assert_eq!(rt.backend.log.roots().await.unwrap(), vec![id]);
}
