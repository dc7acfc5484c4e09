//! Tests of `stream`.

use super::*;
use std::sync::Mutex;

fn all(p: &mut SseParser, bytes: &[u8]) -> Vec<(String, String)> {
    let mut out = p.feed(bytes).unwrap();
    out.extend(p.finish());
    out
}

#[test]
fn sse_events_split_anywhere_and_any_line_end() {
    let text = "event: a\r\ndata: {\"x\":1}\r\n\r\n: keep-alive\n\ndata: one\ndata: two\n\nevent: b\rdata:x\r\r";
    let whole = all(&mut SseParser::default(), text.as_bytes());
    assert_eq!(
        whole,
        vec![
            ("a".into(), "{\"x\":1}".into()),
            (String::new(), "one\ntwo".into()),
            ("b".into(), "x".into())
        ]
    );
    // Byte by byte gives the same events.
    let mut p = SseParser::default();
    let mut got = vec![];
    for b in text.as_bytes() {
        got.extend(p.feed(std::slice::from_ref(b)).unwrap());
    }
    got.extend(p.finish());
    assert_eq!(got, whole);
}

#[test]
fn a_last_event_without_its_blank_line_still_counts() {
    assert_eq!(
        all(&mut SseParser::default(), b"data: [DONE]"),
        vec![(String::new(), "[DONE]".into())]
    );
}

#[test]
fn an_endless_line_is_refused() {
    let mut p = SseParser::default();
    let big = vec![b'a'; MAX_EVENT + 1];
    assert!(p.feed(&big).is_err());
}

#[test]
fn openai_pieces_become_one_answer() {
    let seen: Mutex<Vec<String>> = Mutex::new(vec![]);
    let on_text = |t: &str| seen.lock().unwrap().push(t.to_string());
    let mut s = OpenAiStream::default();
    for d in [
        r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"content":"Hel"}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"content":"lo"}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"list_dir","arguments":""}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"pa"}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"th\":\".\"}"}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}"#,
        "[DONE]",
    ] {
        s.push(d, &on_text).unwrap();
    }
    let body = s.finish().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec!["Hel", "lo"]);
    assert_eq!(body["choices"][0]["message"]["content"], "Hello");
    let call = &body["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["id"], "c1");
    assert_eq!(call["function"]["name"], "list_dir");
    assert_eq!(call["function"]["arguments"], "{\"path\":\".\"}");
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(body["usage"]["prompt_tokens"], 11);
}

#[test]
fn an_openai_stream_cut_short_is_a_retryable_failure() {
    let mut s = OpenAiStream::default();
    s.push(
        r#"{"choices":[{"index":0,"delta":{"content":"half an ans"}}]}"#,
        &|_| {},
    )
    .unwrap();
    let e = s.finish().unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().contains("11 characters"), "{e}");
}

#[test]
fn done_without_a_finish_reason_is_a_cut_answer() {
    let mut s = OpenAiStream::default();
    for d in [
        r#"{"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}"#,
        "[DONE]",
    ] {
        s.push(d, &|_| {}).unwrap();
    }
    let e = s.finish().unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().contains("[DONE] alone"), "{e}");
}

#[test]
fn an_error_in_the_stream_is_the_servers_error() {
    let mut s = OpenAiStream::default();
    let e = s
        .push(
            r#"{"error":{"message":"context too long","code":400}}"#,
            &|_| {},
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::Http { status: 400, .. }),
        "{e:?} should be a 400"
    );
}

#[test]
fn anthropic_events_become_one_answer() {
    let seen: Mutex<Vec<String>> = Mutex::new(vec![]);
    let on_text = |t: &str| seen.lock().unwrap().push(t.to_string());
    let mut s = AnthropicStream::default();
    for (ev, d) in [
        (
            "message_start",
            r#"{"type":"message_start","message":{"usage":{"input_tokens":20,"cache_read_input_tokens":100,"output_tokens":1}}}"#,
        ),
        (
            "content_block_start",
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        ),
        ("ping", r#"{"type":"ping"}"#),
        (
            "content_block_delta",
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Look"}}"#,
        ),
        (
            "content_block_delta",
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"ing."}}"#,
        ),
        (
            "content_block_stop",
            r#"{"type":"content_block_stop","index":0}"#,
        ),
        (
            "content_block_start",
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"tu1","name":"list_dir","input":{}}}"#,
        ),
        (
            "content_block_delta",
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"path\": "}}"#,
        ),
        (
            "content_block_delta",
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"\".\"}"}}"#,
        ),
        (
            "message_delta",
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":15}}"#,
        ),
        ("message_stop", r#"{"type":"message_stop"}"#),
    ] {
        s.push(ev, d, &on_text).unwrap();
    }
    let body = s.finish().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec!["Look", "ing."]);
    assert_eq!(body["content"][0]["text"], "Looking.");
    assert_eq!(body["content"][1]["input"], json!({"path": "."}));
    assert_eq!(body["stop_reason"], "tool_use");
    assert_eq!(body["usage"]["output_tokens"], 15);
    assert_eq!(body["usage"]["cache_read_input_tokens"], 100);
}

#[test]
fn anthropic_cut_and_error_events() {
    let mut s = AnthropicStream::default();
    s.push(
        "message_start",
        r#"{"type":"message_start","message":{}}"#,
        &|_| {},
    )
    .unwrap();
    assert!(s.finish().unwrap_err().is_retryable());
    let mut s = AnthropicStream::default();
    let e = s
        .push(
            "error",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            &|_| {},
        )
        .unwrap_err();
    assert!(matches!(e, Error::Http { status: 529, .. }), "{e:?}");
    assert!(e.is_retryable());
    let mut s = AnthropicStream::default();
    let e = s
        .push(
            "content_block_delta",
            r#"{"type":"content_block_delta","index":3,"delta":{"type":"text_delta","text":"x"}}"#,
            &|_| {},
        )
        .unwrap_err();
    assert!(e.to_string().contains("never started"), "{e}");
}
