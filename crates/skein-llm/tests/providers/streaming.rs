//! Answers that stream, over HTTP: the request asks for a stream, the text reaches the
//! sink piece by piece, and the completion equals what a whole answer would give.
//! Streams cut short are retryable failures; a server that ignores `stream` still works.

use std::sync::Mutex;

use serde_json::json;
use skein_llm::anthropic::AnthropicProvider;
use skein_llm::openai::OpenAiProvider;
use skein_llm::{Error, Provider, ProviderKind};

use crate::mock::{Canned, MockServer};
use crate::{request, settings, user, weather_tool, KEY};

fn collect() -> Mutex<Vec<String>> {
    Mutex::new(vec![])
}

#[tokio::test]
async fn openai_text_streams_and_usage_comes_at_the_end() {
    let server = MockServer::start(vec![Canned::sse(&[
        ("", r#"{"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}"#),
        ("", r#"{"choices":[{"index":0,"delta":{"content":"Paris is"},"finish_reason":null}]}"#),
        ("", r#"{"choices":[{"index":0,"delta":{"content":" the capital."},"finish_reason":null}]}"#),
        ("", r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#),
        ("", r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":5}}}"#),
        ("", "[DONE]"),
    ])])
    .await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let seen = collect();
    let c = p
        .complete_streaming("m", &request("test:m", vec![user("hi")], vec![]), &|t| {
            seen.lock().unwrap().push(t.to_string())
        })
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec!["Paris is", " the capital."]);
    assert_eq!(c.response.content.as_deref(), Some("Paris is the capital."));
    assert_eq!(c.response.finish_reason.as_deref(), Some("stop"));
    assert_eq!((c.usage.input_tokens, c.usage.output_tokens), (9, 4));
    assert_eq!(c.usage.cache_read_tokens, 5);
    assert!(!c.usage.estimated);
    let b = &server.requests()[0].body;
    assert_eq!(b["stream"], true);
    assert_eq!(b["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn openai_stream_cut_mid_answer_is_retryable_and_names_the_provider() {
    let server = MockServer::start(vec![Canned::sse(&[(
        "",
        r#"{"choices":[{"index":0,"delta":{"content":"half of"},"finish_reason":null}]}"#,
    )])])
    .await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let e = p
        .complete_streaming("m", &request("test:m", vec![user("hi")], vec![]), &|_| {})
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Connect(_)), "{e:?}");
    assert!(e.is_retryable());
    let m = e.to_string();
    assert!(m.contains("test:m") && m.contains("7 characters"), "{m}");
    assert!(!m.contains(KEY));
}

#[tokio::test]
async fn an_empty_stream_for_a_request_with_tools_falls_back_to_whole_answers() {
    // llama-cpp-python's function-calling format answers 200 with an empty stream when
    // asked to stream a request with tools; the provider asks again without `stream`, and
    // asks for whole answers from then on.
    let whole = json!({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": null,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]}}]});
    let server = MockServer::start(vec![
        Canned::raw(200, "").header("content-type", "text/event-stream"),
        Canned::json(200, &whole),
        Canned::json(200, &whole),
    ])
    .await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let req = request(
        "test:m",
        vec![user("Weather in Oslo?")],
        vec![weather_tool()],
    );
    for _ in 0..2 {
        let c = p.complete_streaming("m", &req, &|_| {}).await.unwrap();
        assert_eq!(c.response.tool_calls[0].name, "get_weather");
    }
    let streamed: Vec<bool> = server
        .requests()
        .iter()
        .map(|r| r.body.get("stream") == Some(&json!(true)))
        .collect();
    assert_eq!(streamed, vec![true, false, false]);
}

#[tokio::test]
async fn a_server_that_ignores_stream_answers_whole() {
    let server = MockServer::start(vec![Canned::fixture(include_str!(
        "../fixtures/openai_text.json"
    ))])
    .await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let c = p
        .complete_streaming("m", &request("test:m", vec![user("hi")], vec![]), &|_| {})
        .await
        .unwrap();
    assert_eq!(
        c.response.content.as_deref(),
        Some("Paris is the capital of France.")
    );
}

#[tokio::test]
async fn stream_off_sends_no_stream_field() {
    let server = MockServer::start(vec![Canned::fixture(include_str!(
        "../fixtures/openai_text.json"
    ))])
    .await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.stream = false;
    let p = OpenAiProvider::new(s).unwrap();
    p.complete_streaming("m", &request("test:m", vec![user("hi")], vec![]), &|_| {})
        .await
        .unwrap();
    let b = server.requests()[0].body.clone();
    assert!(
        b.get("stream").is_none() && b.get("stream_options").is_none(),
        "{b}"
    );
}

#[tokio::test]
async fn anthropic_streams_text_and_tool_input_with_cache_usage() {
    let server = MockServer::start(vec![Canned::sse(&[
        ("message_start", r#"{"type":"message_start","message":{"id":"m1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":12,"cache_creation_input_tokens":300,"cache_read_input_tokens":0,"output_tokens":1}}}"#),
        ("content_block_start", r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#),
        ("content_block_delta", r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Checking"}}"#),
        ("content_block_delta", r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" Oslo."}}"#),
        ("content_block_stop", r#"{"type":"content_block_stop","index":0}"#),
        ("content_block_start", r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{}}}"#),
        ("content_block_delta", r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"city\": \"Os"}}"#),
        ("content_block_delta", r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"lo\"}"}}"#),
        ("content_block_stop", r#"{"type":"content_block_stop","index":1}"#),
        ("message_delta", r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":22}}"#),
        ("message_stop", r#"{"type":"message_stop"}"#),
    ])])
    .await;
    let p = AnthropicProvider::new(settings(ProviderKind::Anthropic, &server.url)).unwrap();
    let mut req = request(
        "test:claude",
        vec![crate::system("You forecast."), user("Weather in Oslo?")],
        vec![weather_tool()],
    );
    req.prompt_cache = true;
    let seen = collect();
    let c = p
        .complete_streaming("claude", &req, &|t| seen.lock().unwrap().push(t.into()))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec!["Checking", " Oslo."]);
    assert_eq!(c.response.content.as_deref(), Some("Checking Oslo."));
    assert_eq!(c.response.tool_calls[0].id, "toolu_1");
    assert_eq!(c.response.tool_calls[0].args, json!({"city": "Oslo"}));
    assert_eq!(c.response.finish_reason.as_deref(), Some("tool_calls"));
    // Input counts every input token; the cache figures say which were cached.
    assert_eq!(c.usage.input_tokens, 312);
    assert_eq!(c.usage.cache_write_tokens, 300);
    assert_eq!(c.usage.output_tokens, 22);
    // The request asked for a stream, with cache breakpoints on the stable prefix.
    let b = &server.requests()[0].body;
    assert_eq!(b["stream"], true);
    let ephemeral = json!({"type": "ephemeral"});
    assert_eq!(b["system"][0]["text"], "You forecast.");
    assert_eq!(b["system"][0]["cache_control"], ephemeral);
    assert_eq!(b["tools"][0]["cache_control"], ephemeral);
    let last = b["messages"].as_array().unwrap().last().unwrap();
    let block = last["content"].as_array().unwrap().last().unwrap();
    assert_eq!(block["cache_control"], ephemeral);
}

#[tokio::test]
async fn anthropic_without_prompt_cache_sends_no_breakpoints() {
    let server = MockServer::start(vec![Canned::fixture(include_str!(
        "../fixtures/anthropic_text.json"
    ))])
    .await;
    let p = AnthropicProvider::new(settings(ProviderKind::Anthropic, &server.url)).unwrap();
    let req = request(
        "test:claude",
        vec![crate::system("You forecast."), user("hi")],
        vec![weather_tool()],
    );
    p.complete("claude", &req).await.unwrap();
    let b = server.requests()[0].body.to_string();
    assert!(!b.contains("cache_control"), "{b}");
    assert!(!b.contains("\"stream\""), "{b}");
}

#[tokio::test]
async fn anthropic_overload_inside_the_stream_is_retryable() {
    let server = MockServer::start(vec![Canned::sse(&[
        (
            "message_start",
            r#"{"type":"message_start","message":{"usage":{"input_tokens":3}}}"#,
        ),
        (
            "error",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        ),
    ])])
    .await;
    let p = AnthropicProvider::new(settings(ProviderKind::Anthropic, &server.url)).unwrap();
    let e = p
        .complete_streaming(
            "claude",
            &request("test:claude", vec![user("hi")], vec![]),
            &|_| {},
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Http { status: 529, .. }), "{e:?}");
    assert!(e.is_retryable());
    assert!(e.to_string().contains("Overloaded"), "{e}");
}
