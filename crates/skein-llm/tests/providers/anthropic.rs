//! Anthropic Messages API: the body and headers sent, and recorded answers read.

use serde_json::json;
use skein_llm::anthropic::AnthropicProvider;
use skein_llm::{Provider, ProviderKind};

use crate::mock::{Canned, MockServer};
use crate::{conversation_with_tool_results, request, settings, system, user, weather_tool, KEY};

const TOOL_USE: &str = include_str!("../fixtures/anthropic_tool_use.json");
const TEXT: &str = include_str!("../fixtures/anthropic_text.json");

#[tokio::test]
async fn request_body_and_headers() {
    let server = MockServer::start(vec![Canned::fixture(TOOL_USE)]).await;
    let p = AnthropicProvider::new(settings(ProviderKind::Anthropic, &server.url)).unwrap();
    let mut msgs = conversation_with_tool_results();
    msgs.insert(2, system("Answer briefly."));
    let req = request("test:claude-sonnet-4-20250514", msgs, vec![weather_tool()]);

    let c = p.complete("claude-sonnet-4-20250514", &req).await.unwrap();

    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    let r = &seen[0];
    assert_eq!(r.path, "/v1/messages");
    assert_eq!(r.headers["x-api-key"], KEY);
    assert_eq!(r.headers["anthropic-version"], "2023-06-01");
    assert!(!r.headers.contains_key("authorization"));
    let b = &r.body;
    assert_eq!(b["model"], "claude-sonnet-4-20250514");
    assert_eq!(b["max_tokens"], 4096);
    assert_eq!(
        b["system"],
        "You are a weather assistant.\n\nAnswer briefly."
    );
    assert_eq!(
        b["tools"],
        json!([{
            "name": "get_weather",
            "description": "Current weather of a city.",
            "input_schema": weather_tool().parameters,
        }])
    );
    // tool_choice left to the API default (auto).
    assert!(b.get("tool_choice").is_none());
    assert_eq!(
        b["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Oslo?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking both."},
                {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_b", "name": "get_weather", "input": {"city": "Oslo"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_a", "content": "{\"temp_c\": 21}"},
                {"type": "tool_result", "tool_use_id": "call_b", "content": "station offline", "is_error": true},
                {"type": "text", "text": "And tomorrow?"}
            ]}
        ])
    );

    let resp = &c.response;
    assert_eq!(
        resp.content.as_deref(),
        Some("I'll check the weather in both cities.")
    );
    assert_eq!(resp.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(resp.tool_calls.len(), 2);
    assert_eq!(resp.tool_calls[0].id, "toolu_fixture_a");
    assert_eq!(resp.tool_calls[0].name, "get_weather");
    assert_eq!(resp.tool_calls[0].args, json!({"city": "Paris"}));
    assert_eq!(
        resp.tool_calls[1].args,
        json!({"city": "Oslo", "unit": "celsius"})
    );
    assert_eq!((c.usage.input_tokens, c.usage.output_tokens), (410, 96));
    assert!(!c.usage.estimated);
}

#[tokio::test]
async fn text_answer_stop_reason_and_cache_usage() {
    let server = MockServer::start(vec![Canned::fixture(TEXT)]).await;
    let mut s = settings(ProviderKind::Anthropic, &format!("{}/v1", server.url));
    s.max_tokens = Some(64);
    s.parallel_tool_calls = Some(false);
    let p = AnthropicProvider::new(s).unwrap();
    let mut req = request("test:c", vec![user("Weather?")], vec![weather_tool()]);
    req.temperature = Some(0.5);
    req.top_p = Some(0.8);
    req.top_k = Some(20);
    let c = p.complete("c", &req).await.unwrap();
    let r = &server.requests()[0];
    assert_eq!(r.path, "/v1/messages", "a /v1 base is not doubled");
    assert_eq!(r.body["max_tokens"], 64);
    assert_eq!(r.body["temperature"], json!(0.5));
    assert_eq!(r.body["top_p"], json!(0.8));
    assert_eq!(r.body["top_k"], 20);
    assert!(r.body.get("system").is_none());
    assert_eq!(
        r.body["tool_choice"],
        json!({"type": "auto", "disable_parallel_tool_use": true})
    );
    assert_eq!(
        c.response.content.as_deref(),
        Some("It is sunny in Paris and snowing in Oslo.")
    );
    assert!(c.response.tool_calls.is_empty());
    assert_eq!(c.response.finish_reason.as_deref(), Some("length"));
    assert_eq!((c.usage.input_tokens, c.usage.output_tokens), (100, 12));
}

#[tokio::test]
async fn overloaded_is_a_retryable_http_error() {
    let overloaded =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    let server = MockServer::start(vec![
        Canned::json(529, &overloaded),
        Canned::json(529, &overloaded),
    ])
    .await;
    let mut s = settings(ProviderKind::Anthropic, &server.url);
    s.http.max_retries = 1;
    let p = AnthropicProvider::new(s).unwrap();
    let e = p
        .complete("c", &request("test:c", vec![user("x")], vec![]))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, skein_llm::Error::Http { status: 529, message, .. } if message == "Overloaded"),
        "{e:?}"
    );
    assert!(e.is_retryable());
    assert_eq!(server.requests().len(), 2);
}
