//! Tests of `json_tool`.

use super::*;
use crate::ERROR_KEY;

fn calls(p: &Parsed) -> Vec<(String, Value)> {
    match p {
        Parsed::Calls { calls, .. } => calls.clone(),
        other => panic!("expected calls, got {other:?}"),
    }
}

/// The end of one bracket's span, scanned on its own: what `Spans` must agree with.
fn end_alone(text: &str, start: usize) -> Option<usize> {
    let mut stack: Vec<u8> = vec![];
    let (mut in_string, mut escaped) = (false, false);
    for (k, &b) in text.as_bytes().iter().enumerate().skip(start) {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' => stack.push(b'}'),
            b'[' => stack.push(b']'),
            b'}' | b']' => {
                if stack.pop() != Some(b) {
                    return None;
                }
                if stack.is_empty() {
                    return Some(k + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[test]
fn spans_agree_with_a_scan_from_each_bracket() {
    // Every string over a small alphabet of brackets, quotes and escapes, up to 6 long.
    let alphabet = ['{', '}', '[', ']', '"', '\\', 'x'];
    let mut texts = vec![String::new()];
    for _ in 0..6 {
        let longer: Vec<String> = texts
            .iter()
            .filter(|t| t.len() == texts.last().map_or(0, String::len))
            .flat_map(|t| alphabet.iter().map(move |c| format!("{t}{c}")))
            .collect();
        texts.extend(longer);
    }
    for text in &texts {
        let mut spans = Spans::new(text);
        let starts: Vec<usize> = text
            .char_indices()
            .filter(|(_, c)| *c == '{' || *c == '[')
            .map(|(i, _)| i)
            .collect();
        // Queried in the order parse_answer asks, and each again afterwards.
        for &st in starts.iter().chain(&starts) {
            assert_eq!(
                spans.end(st).map(|(e, _)| e),
                end_alone(text, st),
                "{text:?} from {st}"
            );
        }
    }
}

#[test]
fn unclosed_and_deep_brackets_are_read_in_linear_time() {
    // Each of these took seconds to minutes when every bracket was scanned anew.
    let texts = [
        "{".repeat(100_000),
        "{\"a\":".repeat(40_000),
        format!("{}{}", "[".repeat(50_000), "]".repeat(50_000)),
        format!("{}{}", "{\"a\":".repeat(40_000), "1}".repeat(40_000)),
    ];
    for t in &texts {
        let started = std::time::Instant::now();
        let p = parse_answer(t);
        assert!(!matches!(p, Parsed::Calls { .. }), "{}", &t[..20]);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{} bytes took {:?}",
            t.len(),
            started.elapsed()
        );
    }
    // A call after a long unclosed prefix is still found.
    let t = format!(
        "{} {{\"tool_calls\": [{{\"name\": \"read_file\", \"arguments\": {{}}}}]}}",
        "[".repeat(50_000)
    );
    assert_eq!(calls(&parse_answer(&t))[0].0, "read_file");
}

#[test]
fn plain_prose_is_the_answer() {
    assert_eq!(
        parse_answer("  The capital is Paris.\n"),
        Parsed::Answer("The capital is Paris.".into())
    );
    assert_eq!(
        parse_answer("see [1] and [2]"),
        Parsed::Answer("see [1] and [2]".into())
    );
}

#[test]
fn answer_object() {
    assert_eq!(
        parse_answer(r#"{"answer": "42"}"#),
        Parsed::Answer("42".into())
    );
    assert_eq!(
        parse_answer("Done.\n```json\n{\"answer\": \"ok\",}\n```"),
        Parsed::Answer("ok".into())
    );
    assert_eq!(
        parse_answer(r#"{"answer": {"n": 1}}"#),
        Parsed::Answer("{\n  \"n\": 1\n}".into())
    );
    assert_eq!(
        parse_answer(r#"{"tool_calls": [], "answer": "none needed"}"#),
        Parsed::Answer("none needed".into())
    );
}

#[test]
fn canonical_calls_list() {
    let p = parse_answer(
        r#"{"tool_calls": [{"name": "read_file", "arguments": {"path": "a.md"}},
                               {"name": "list_dir", "arguments": {}}]}"#,
    );
    assert_eq!(
        calls(&p),
        vec![
            ("read_file".into(), json!({"path": "a.md"})),
            ("list_dir".into(), json!({}))
        ]
    );
    assert!(matches!(p, Parsed::Calls { say: None, .. }));
}

#[test]
fn fenced_with_prose_and_trailing_commas() {
    let text = "I'll look that up.\n\n```json\n{\n  \"tool_calls\": [\n    {\"name\": \"search\", \"arguments\": {\"q\": \"rust, async\",},},\n  ],\n}\n```\nThen I'll summarize.";
    let p = parse_answer(text);
    assert_eq!(
        calls(&p),
        vec![("search".into(), json!({"q": "rust, async"}))]
    );
    let Parsed::Calls { say, .. } = p else {
        unreachable!()
    };
    assert_eq!(
        say.as_deref(),
        Some("I'll look that up.\n\nThen I'll summarize.")
    );
}

#[test]
fn single_call_shapes() {
    let shapes = [
        r#"{"tool_calls": {"name": "f", "arguments": {"x": 1}}}"#,
        r#"{"tool_call": {"name": "f", "arguments": {"x": 1}}}"#,
        r#"{"name": "f", "arguments": {"x": 1}}"#,
        r#"{"tool": "f", "args": {"x": 1}}"#,
        r#"{"name": "f", "parameters": {"x": 1}}"#,
        r#"[{"name": "f", "arguments": {"x": 1}}]"#,
        r#"{"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}"#,
        r#"{"name": "f", "arguments": "{\"x\": 1}"}"#,
        r#"{"name": "f", "arguments": "\"{\\\"x\\\": 1}\""}"#,
    ];
    for s in shapes {
        assert_eq!(
            calls(&parse_answer(s)),
            vec![("f".into(), json!({"x": 1}))],
            "{s}"
        );
    }
}

#[test]
fn several_objects_one_after_another() {
    let p = parse_answer(
        "{\"name\": \"a\", \"arguments\": {}}\n{\"name\": \"b\", \"arguments\": {\"k\": [1,2]}}",
    );
    assert_eq!(
        calls(&p),
        vec![("a".into(), json!({})), ("b".into(), json!({"k": [1, 2]}))]
    );
}

#[test]
fn missing_arguments_are_empty() {
    assert_eq!(
        calls(&parse_answer(r#"{"tool_calls": [{"name": "now"}]}"#)),
        vec![("now".into(), json!({}))]
    );
}

#[test]
fn braces_inside_strings_do_not_confuse() {
    let p = parse_answer(r#"{"name": "write_file", "arguments": {"text": "fn main() { } ]"}}"#);
    assert_eq!(
        calls(&p),
        vec![("write_file".into(), json!({"text": "fn main() { } ]"}))]
    );
}

#[test]
fn unparsable_arguments_keep_the_call() {
    let p = parse_answer(r#"{"name": "f", "arguments": "{x: 1"}"#);
    let c = calls(&p);
    assert_eq!(c[0].0, "f");
    assert!(args_error(&c[0].1).is_some());
    assert_eq!(c[0].1[RAW_KEY], "{x: 1");
}

#[test]
fn unreadable_json_is_an_invalid_call() {
    for text in [
        r#"{"tool_calls": [{"name": "f", "arguments": {"x": 1}"#,
        r#"Here: {"tool_calls": [{"arguments": {}}]}"#,
        r#"{"result": 3}"#,
        r#"{'name': 'f'}"#,
        r#"{"tool_calls": "f"}"#,
    ] {
        match parse_answer(text) {
            Parsed::Invalid { raw, error } => {
                assert_eq!(raw, text);
                assert!(error.contains("could not read"), "{error}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
    let Parsed::Invalid { error, .. } =
        parse_answer(r#"{"tool_calls": [{"name": "f", "arguments": {"x": 1}"#)
    else {
        unreachable!()
    };
    assert!(error.contains("cut off"), "{error}");
    let Parsed::Invalid { error, .. } = parse_answer(r#"{"tool_calls": [{"args": {}}]}"#) else {
        unreachable!()
    };
    assert!(error.contains("no \"name\""), "{error}");
}

#[test]
fn response_from_invalid_text_is_a_synthetic_call() {
    let r = response_from_text("{oops", Some("stop".into()));
    assert_eq!(r.tool_calls.len(), 1);
    assert_eq!(r.tool_calls[0].name, INVALID_TOOL_CALL);
    assert_eq!(r.tool_calls[0].id, "");
    assert_eq!(r.tool_calls[0].args[RAW_KEY], "{oops");
    assert!(r.tool_calls[0].args[ERROR_KEY].is_string());
    assert_eq!(r.finish_reason.as_deref(), Some("tool_calls"));

    let r = response_from_text("Paris.", Some("stop".into()));
    assert_eq!(r.content.as_deref(), Some("Paris."));
    assert!(r.tool_calls.is_empty());
    assert_eq!(r.finish_reason.as_deref(), Some("stop"));
}

#[test]
fn decode_arguments_forms() {
    assert_eq!(decode_arguments(&json!(null)), json!({}));
    assert_eq!(decode_arguments(&json!("  ")), json!({}));
    assert_eq!(decode_arguments(&json!({"a": 1})), json!({"a": 1}));
    assert_eq!(
        decode_arguments(&json!(" {\n \"a\" :\t1 , } \n")),
        json!({"a": 1})
    );
    let bad = decode_arguments(&json!("{\"a\": "));
    assert_eq!(bad[RAW_KEY], "{\"a\": ");
    assert!(bad[ERROR_KEY].as_str().unwrap().contains("not valid JSON"));
}

#[test]
fn trailing_commas_only_outside_strings() {
    assert_eq!(strip_trailing_commas(r#"{"a": ",}", }"#), r#"{"a": ",}" }"#);
    assert_eq!(strip_trailing_commas("[1,2,\n]"), "[1,2\n]");
    assert_eq!(
        strip_trailing_commas(r#"{"a": "\",]"}"#),
        r#"{"a": "\",]"}"#
    );
}

fn spec(name: &str) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: format!("Does {name}."),
        parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}}).into(),
    }
}

#[test]
fn prompt_names_tools_schemas_and_shapes() {
    let p = tool_prompt(&[spec("read_file"), spec("list_dir")]);
    for needle in [
        "## read_file",
        "Does list_dir.",
        r#"Arguments schema: {"properties":{"path":{"type":"string"}},"type":"object"}"#,
        r#"{"tool_calls": [{"name": "TOOL_NAME""#,
        r#"{"answer": "YOUR FINAL ANSWER"}"#,
    ] {
        assert!(p.contains(needle), "{needle} not in {p}");
    }
}

#[test]
fn rewrite_turns_calls_and_results_into_text() {
    let msgs = vec![
        Message::System {
            content: "You are helpful.".into(),
        },
        Message::User {
            content: "Read a.md".into(),
        },
        Message::Assistant {
            content: None,
            tool_calls: vec![
                ToolCall {
                    id: "t1_1".into(),
                    name: "read_file".into(),
                    args: json!({"path": "a.md"}),
                },
                ToolCall {
                    id: "t1_2".into(),
                    name: "read_file".into(),
                    args: json!({"path": "b.md"}),
                },
            ],
        },
        Message::Tool {
            call_id: "t1_1".into(),
            name: "read_file".into(),
            content: "hello".into(),
            is_error: false,
        },
        Message::Tool {
            call_id: "t1_2".into(),
            name: "read_file".into(),
            content: "no such file".into(),
            is_error: true,
        },
        Message::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: "t2_1".into(),
                name: INVALID_TOOL_CALL.into(),
                args: malformed_args("{broken", "why"),
            }],
        },
        Message::Tool {
            call_id: "t2_1".into(),
            name: INVALID_TOOL_CALL.into(),
            content: "could not read".into(),
            is_error: true,
        },
    ];
    let out = rewrite_messages(&msgs, &[spec("read_file")]);
    assert_eq!(out.len(), 6, "{out:#?}");
    let Message::System { content } = &out[0] else {
        panic!("{out:#?}")
    };
    assert!(content.starts_with("You are helpful.\n\n# Tools"));
    let Message::Assistant {
        content: Some(a),
        tool_calls,
    } = &out[2]
    else {
        panic!("{out:#?}")
    };
    assert!(tool_calls.is_empty());
    let v: Value = serde_json::from_str(a).unwrap();
    assert_eq!(v["tool_calls"][1]["arguments"]["path"], "b.md");
    let Message::User { content } = &out[3] else {
        panic!("{out:#?}")
    };
    assert!(content.contains("Result of `read_file` (call t1_1):\nhello"));
    assert!(content.contains("Error from `read_file` (call t1_2):\nno such file"));
    assert_eq!(
        out[4],
        Message::Assistant {
            content: Some("{broken".into()),
            tool_calls: vec![]
        }
    );
    assert!(matches!(&out[5], Message::User { content } if content.contains("could not read")));
    for m in &out {
        assert!(!matches!(m, Message::Tool { .. }));
    }
}

#[test]
fn rewrite_adds_a_system_message_when_none() {
    let out = rewrite_messages(
        &[Message::User {
            content: "hi".into(),
        }],
        &[spec("x")],
    );
    assert!(matches!(&out[0], Message::System { content } if content.starts_with("# Tools")));
    assert_eq!(out.len(), 2);
}
