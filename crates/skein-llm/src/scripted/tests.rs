//! Tests of `scripted`.

use super::*;

#[test]
fn stream_pieces_rejoin_to_the_text() {
    for text in ["", "one", "a b", &"word ".repeat(100), "tail space "] {
        let p = stream_pieces(text);
        assert_eq!(p.concat(), text);
        assert!(p.len() <= 16, "{} pieces", p.len());
    }
    assert_eq!(stream_pieces("a b c").len(), 3);
}
use skein_core::message::RequestMeta;

fn req(messages: Vec<Message>) -> ModelRequest {
    ModelRequest {
        model: "scripted:t".into(),
        messages,
        tools: vec![],
        temperature: None,
        max_tokens: None,
        top_p: None,
        top_k: None,
        prompt_cache: false,
        meta: RequestMeta {
            session: "s".into(),
            agent: "a".into(),
            mission: "Brief on X".into(),
            context: None,
            inputs: serde_json::json!({"n": 3}),
            ..Default::default()
        },
    }
}

const SCRIPT: &str = r#"
latency_ms: 0
turns:
  - tool_calls:
      - tool: call_agent
        repeat: "{{ inputs.n }}"
        args: {agent: researcher, mission: "Research {{ mission }} part {{ i + 1 }}"}
  - choose:
      - when: "results | length == 0"
        answer: "nothing"
      - answer: "got {{ results | length }}: {{ results[0].result }}"
"#;

#[test]
fn repeats_and_templates_calls_then_answers_from_results() {
    let s = parse_script("t", SCRIPT).unwrap();
    let r0 = req(vec![Message::System {
        content: "p".into(),
    }]);
    let (resp, _) = answer(&s, &r0).unwrap();
    assert_eq!(resp.tool_calls.len(), 3);
    assert_eq!(resp.tool_calls[2].id, "call_1_3");
    assert_eq!(
        resp.tool_calls[2].args["mission"],
        "Research Brief on X part 3"
    );

    let mut msgs = r0.messages.clone();
    msgs.push(Message::Assistant {
        content: None,
        tool_calls: resp.tool_calls.clone(),
    });
    for c in &resp.tool_calls {
        msgs.push(Message::Tool {
            call_id: c.id.clone(),
            name: c.name.clone(),
            content: serde_json::json!({"success": true, "result": format!("r-{}", c.id)})
                .to_string(),
            is_error: false,
        });
    }
    let (resp, _) = answer(&s, &req(msgs.clone())).unwrap();
    assert_eq!(resp.content.as_deref(), Some("got 3: r-call_1_1"));
    assert!(resp.tool_calls.is_empty());

    msgs.push(Message::Assistant {
        content: Some("x".into()),
        tool_calls: vec![],
    });
    let e = answer(&s, &req(msgs)).unwrap_err().to_string();
    assert!(e.contains("2 turns; turn 3"), "{e}");
}

fn answer_of(turn: &str, limits: TemplateLimits) -> Result<(ModelResponse, u64)> {
    let s = parse_script("t", &format!("turns:\n  - {turn}\n")).unwrap();
    let r0 = req(vec![Message::System {
        content: "p".into(),
    }]);
    answer_within(&s, &r0, limits)
}

fn refusal(turn: &str, limits: TemplateLimits) -> String {
    let started = std::time::Instant::now();
    let e = answer_of(turn, limits).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    e.to_string()
}

#[test]
fn a_condition_with_closing_braces_is_refused_not_a_panic() {
    for when in ["x }} y", "s}}t", "results }} | length"] {
        let e = refusal(
            &format!("choose:\n      - when: \"{when}\"\n        answer: a"),
            TemplateLimits::default(),
        );
        assert!(e.contains("without `{{ }}`"), "{e}");
    }
}

#[test]
fn an_endless_template_runs_out_of_steps() {
    // 10^8 loop rounds: far past the default budget of an answer.
    let e = refusal(
        r#"answer: "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}done""#,
        TemplateLimits::default(),
    );
    assert!(
        e.contains("took more than 10000000 steps") && e.contains("template `{% for i"),
        "{e}"
    );
}

#[test]
fn the_steps_are_counted_for_the_whole_answer() {
    // Each call's template alone is cheap; a hundred of them are not.
    let turn = r#"tool_calls:
      - tool: t
        repeat: 100
        args: {x: "{% for k in range(50) %}{{ k }}{% endfor %}"}"#;
    let cheap = TemplateLimits {
        fuel: 2_000,
        ..TemplateLimits::default()
    };
    let e = answer_of(turn, cheap).unwrap_err().to_string();
    assert!(e.contains("more than 2000 steps"), "{e}");
    let (resp, _) = answer_of(turn, TemplateLimits::default()).unwrap();
    assert_eq!(resp.tool_calls.len(), 100);
}

#[test]
fn a_template_calling_itself_is_stopped_at_the_depth_limit() {
    let e = refusal(
        r#"answer: "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}""#,
        TemplateLimits::default(),
    );
    assert!(
        e.contains("recursion limit exceeded") && e.contains("at most 100 levels"),
        "{e}"
    );
}

#[test]
fn an_answer_is_capped_in_size() {
    // 100 MB of text asked for; the answer stops at 4 MiB.
    let e = refusal(
        r#"answer: "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}""#,
        TemplateLimits::default(),
    );
    assert!(e.contains("renders to more than 4194304 bytes"), "{e}");
    let small = TemplateLimits {
        max_bytes: 1000,
        ..TemplateLimits::default()
    };
    // Every part of the answer counts: plain text, names, ids and arguments.
    assert!(answer_of(&format!("answer: \"{}\"", "z".repeat(999)), small).is_ok());
    let e = answer_of(&format!("answer: \"{}\"", "z".repeat(1001)), small)
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than 1000 bytes"), "{e}");
    let e = answer_of(
        "tool_calls:\n      - tool: t\n        repeat: 30\n        args: {x: \"{{ 'q' * 30 }}\"}",
        small,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("more than 1000 bytes"), "{e}");
    // A repeat count no answer could hold is refused before any call is made.
    let e = refusal(
        "tool_calls:\n      - tool: t\n        repeat: \"{{ 10 ** 12 }}\"\n        args: {}",
        TemplateLimits::default(),
    );
    assert!(e.contains("renders to more than"), "{e}");
}

#[tokio::test]
async fn a_runaway_template_fails_the_model_call() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
            dir.path().join("loop.yaml"),
            "turns:\n  - answer: \"{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}\"\n",
        )
        .unwrap();
    let p = ScriptedProvider::new(dir.path()).with_limits(TemplateLimits {
        fuel: 50_000,
        ..TemplateLimits::default()
    });
    let e = p
        .complete("loop", &req(vec![]))
        .await
        .expect_err("the call fails");
    let shown = e.to_string();
    assert!(
        shown.contains("scripted:loop") && shown.contains("more than 50000 steps"),
        "{shown}"
    );
    assert!(!e.is_retryable());
}

#[test]
fn bad_script_is_named() {
    let e = parse_script("x.yaml", "turns: [{tool_calls: [{tol: 1}]}]").unwrap_err();
    assert!(e.to_string().contains("x.yaml"), "{e}");
    assert!(parse_script("y.yaml", "turns: []")
        .unwrap_err()
        .to_string()
        .contains("no turns"));
}

/// Each variable is worked out only for a template that reads it; wherever a template
/// reads one (a macro, a loop, a `set`, a condition, a repeated call's arguments), it
/// sees the same value as every other.
#[test]
fn every_way_of_reading_a_variable_sees_it() {
    let cases = [
        ("{{ mission }}", "Brief on X"),
        (
            "{% macro m() %}{{ mission }}/{{ agent }}{% endmacro %}{{ m() }}",
            "Brief on X/a",
        ),
        ("{% set x = inputs.n %}{{ x * 2 }}", "6"),
        (
            "{% for r in results %}{{ r.k }}{% endfor %}|{{ all_results | length }}",
            "12|3",
        ),
        (
            "{{ prompt }}+{{ user_messages | join(',') }}",
            "first+second,third",
        ),
        (
            "{{ session }} {{ turn }} {{ context is none }} {{ plan is none }}",
            "s 2 True True",
        ),
        ("{{ nothing_by_this_name }}.", "."),
        (
            "{% filter upper %}{{ mission }}{% endfilter %}",
            "BRIEF ON X",
        ),
        ("{% if results %}{{ results[1].k }}{% endif %}", "2"),
    ];
    let msgs = vec![
        Message::System {
            content: "p".into(),
        },
        Message::User {
            content: "first".into(),
        },
        Message::Assistant {
            content: None,
            tool_calls: vec![],
        },
        Message::Tool {
            call_id: "a".into(),
            name: "t".into(),
            content: "{\"k\": 0}".into(),
            is_error: false,
        },
        Message::User {
            content: "second".into(),
        },
        Message::User {
            content: "third".into(),
        },
        Message::Assistant {
            content: None,
            tool_calls: vec![],
        },
        Message::Tool {
            call_id: "b".into(),
            name: "t".into(),
            content: "{\"k\": 1}".into(),
            is_error: false,
        },
        Message::Tool {
            call_id: "c".into(),
            name: "t".into(),
            content: "{\"k\": 2}".into(),
            is_error: false,
        },
    ];
    let mut r = req(msgs);
    r.meta.plan = serde_json::Value::Null;
    for (template, want) in cases {
        let text = format!(
            "turns:\n  - answer: x\n  - answer: x\n  - answer: {}\n",
            serde_json::to_string(template).unwrap()
        );
        let s = parse_script("t", &text).unwrap();
        let (resp, _) = answer(&s, &r).unwrap();
        assert_eq!(resp.content.as_deref(), Some(want), "{template}");
    }
    // A condition reads them the same way.
    let text = "turns:\n  - answer: x\n  - answer: x\n  - choose:\n      - when: \"results | length == 2 and mission == 'Brief on X'\"\n        answer: yes\n      - answer: no\n";
    let (resp, _) = answer(&parse_script("t", text).unwrap(), &r).unwrap();
    assert_eq!(resp.content.as_deref(), Some("yes"));
}

#[test]
fn a_script_asked_for_by_many_at_once_is_parsed_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.yaml"), SCRIPT).unwrap();
    let p = ScriptedProvider::new(dir.path());
    let start = std::sync::Barrier::new(8);
    let loaded: Vec<Arc<Script>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    p.load("t").unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for l in &loaded[1..] {
        assert!(
            Arc::ptr_eq(&loaded[0], l),
            "the script was parsed more than once"
        );
    }
}
