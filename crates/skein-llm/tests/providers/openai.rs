//! OpenAI-compatible chat completions: the body sent, and recorded answers read.

use serde_json::json;
use skein_llm::openai::OpenAiProvider;
use skein_llm::{args_error, Provider, ProviderKind, ERROR_KEY, INVALID_TOOL_CALL, RAW_KEY};

use crate::mock::{Canned, MockServer};
use crate::{conversation_with_tool_results, request, settings, user, weather_tool, KEY};

const PARALLEL: &str = include_str!("../fixtures/openai_parallel_tool_calls.json");
const LEGACY: &str = include_str!("../fixtures/openai_legacy_function_call.json");
const QUIRKS: &str = include_str!("../fixtures/openai_quirks.json");

#[tokio::test]
async fn request_body_maps_messages_tools_and_headers() {
    let server = MockServer::start(vec![Canned::fixture(PARALLEL)]).await;
    let mut s = settings(ProviderKind::OpenAi, &format!("{}/v1/", server.url));
    s.headers.insert("X-Title".into(), "skein".into());
    s.parallel_tool_calls = Some(true);
    s.max_tokens = Some(512);
    let p = OpenAiProvider::new(s).unwrap();
    let mut req = request(
        "test:gpt-4o-mini",
        conversation_with_tool_results(),
        vec![weather_tool()],
    );
    req.temperature = Some(0.2);
    req.top_p = Some(0.9);
    req.top_k = Some(40);

    let c = p.complete("gpt-4o-mini", &req).await.unwrap();

    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    let r = &seen[0];
    assert_eq!(r.method, "POST");
    assert_eq!(r.path, "/v1/chat/completions");
    assert_eq!(r.headers["authorization"], format!("Bearer {KEY}"));
    assert_eq!(r.headers["x-title"], "skein");
    assert!(r.headers["content-type"].starts_with("application/json"));
    let b = &r.body;
    assert_eq!(b["model"], "gpt-4o-mini");
    assert_eq!(b["temperature"], json!(0.2));
    assert_eq!(b["top_p"], json!(0.9));
    assert_eq!(b["top_k"], 40);
    assert_eq!(b["max_tokens"], 512);
    assert_eq!(b["tool_choice"], "auto");
    assert_eq!(b["parallel_tool_calls"], true);
    assert_eq!(
        b["tools"],
        json!([{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city.",
                "parameters": weather_tool().parameters,
            }
        }])
    );
    let m = b["messages"].as_array().unwrap();
    assert_eq!(m.len(), 6);
    assert_eq!(
        m[0],
        json!({"role": "system", "content": "You are a weather assistant."})
    );
    assert_eq!(
        m[1],
        json!({"role": "user", "content": "Weather in Paris and Oslo?"})
    );
    assert_eq!(m[2]["role"], "assistant");
    assert_eq!(m[2]["content"], "Checking both.");
    let calls = m[2]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["id"], "call_a");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    // Arguments travel as a JSON string.
    let args: serde_json::Value =
        serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Oslo"}));
    assert_eq!(
        m[3],
        json!({"role": "tool", "tool_call_id": "call_a", "content": "{\"temp_c\": 21}"})
    );
    assert_eq!(m[4]["tool_call_id"], "call_b");
    assert_eq!(m[4]["content"], "Error: station offline");
    assert_eq!(m[5], json!({"role": "user", "content": "And tomorrow?"}));

    // The answer: two parallel calls, ids kept, arguments decoded.
    let resp = &c.response;
    assert_eq!(resp.content, None);
    assert_eq!(resp.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(resp.tool_calls.len(), 2);
    assert_eq!(resp.tool_calls[0].id, "call_weather_paris");
    assert_eq!(resp.tool_calls[0].args, json!({"city": "Paris"}));
    assert_eq!(resp.tool_calls[1].id, "call_weather_oslo");
    assert_eq!(
        resp.tool_calls[1].args,
        json!({"city": "Oslo", "unit": "celsius"})
    );
    assert_eq!(c.usage.input_tokens, 120);
    assert_eq!(c.usage.output_tokens, 30);
    assert!(!c.usage.estimated);
}

#[tokio::test]
async fn no_tools_sends_no_tool_fields_and_no_key_sends_no_auth() {
    let server = MockServer::start(vec![Canned::fixture(include_str!(
        "../fixtures/openai_text.json"
    ))])
    .await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.key = skein_llm::KeySource::None;
    s.parallel_tool_calls = Some(false);
    let p = OpenAiProvider::new(s).unwrap();
    let c = p
        .complete("m", &request("test:m", vec![user("hi")], vec![]))
        .await
        .unwrap();
    assert_eq!(
        c.response.content.as_deref(),
        Some("Paris is the capital of France.")
    );
    assert_eq!(c.response.finish_reason.as_deref(), Some("stop"));
    let r = &server.requests()[0];
    assert!(!r.headers.contains_key("authorization"), "{:?}", r.headers);
    let b = r.body.as_object().unwrap();
    for absent in [
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
    ] {
        assert!(!b.contains_key(absent), "{absent} in {b:?}");
    }
}

#[tokio::test]
async fn forced_tool_choice_names_the_function() {
    let server = MockServer::start(vec![Canned::fixture(PARALLEL)]).await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.tool_choice = "get_weather".into();
    let p = OpenAiProvider::new(s).unwrap();
    p.complete(
        "m",
        &request("test:m", vec![user("x")], vec![weather_tool()]),
    )
    .await
    .unwrap();
    assert_eq!(
        server.requests()[0].body["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
}

#[tokio::test]
async fn legacy_function_call_with_null_content_and_no_usage() {
    let server = MockServer::start(vec![Canned::fixture(LEGACY)]).await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let req = request(
        "test:m",
        vec![user("Weather in Lima?")],
        vec![weather_tool()],
    );
    let c = p.complete("m", &req).await.unwrap();
    assert_eq!(c.response.content, None);
    assert_eq!(c.response.finish_reason.as_deref(), Some("function_call"));
    assert_eq!(c.response.tool_calls.len(), 1);
    let call = &c.response.tool_calls[0];
    assert_eq!(call.id, "", "the runtime assigns the id");
    assert_eq!(call.name, "get_weather");
    assert_eq!(call.args, json!({"city": "Lima"}));
    // No usage in the answer: estimated from the text, and marked so.
    assert!(c.usage.estimated);
    assert!(c.usage.input_tokens > 0 && c.usage.output_tokens > 0);
}

#[tokio::test]
async fn quirky_answer_is_read_without_losing_a_call() {
    let server = MockServer::start(vec![Canned::fixture(QUIRKS)]).await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let c = p
        .complete(
            "qwen2.5:7b",
            &request("test:qwen2.5:7b", vec![user("go")], vec![]),
        )
        .await
        .unwrap();
    let r = &c.response;
    assert_eq!(r.content.as_deref(), Some("Let me look at both files."));
    let ids: Vec<&str> = r.tool_calls.iter().map(|c| c.id.as_str()).collect();
    let names: Vec<&str> = r.tool_calls.iter().map(|c| c.name.as_str()).collect();
    // The legacy function_call repeats a listed call, so it is not added again.
    assert_eq!(ids, ["", "7", "call_dup", "call_dup"]);
    assert_eq!(names, ["read_file", "read_file", "list_dir", "write_file"]);
    assert_eq!(
        r.tool_calls[0].args,
        json!({"path": "a.md", "max_bytes": 100})
    );
    assert_eq!(r.tool_calls[1].args, json!({"path": "b.md"}));
    assert_eq!(r.tool_calls[2].args, json!({}));
    let bad = &r.tool_calls[3].args;
    let (raw, why) = args_error(bad).expect("the _raw/_error convention");
    assert_eq!(raw, r#"{"path": "c.md", "text": "unterminated"#);
    assert!(why.contains("not valid JSON"), "{why}");
    assert_eq!(bad.as_object().unwrap().len(), 2);
    assert!(c.usage.estimated);
}

#[tokio::test]
async fn unreadable_arguments_go_back_as_written() {
    // The next request carries the call as the model wrote it.
    let server = MockServer::start(vec![Canned::fixture(PARALLEL)]).await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let msgs = vec![
        user("go"),
        skein_core::Message::Assistant {
            content: None,
            tool_calls: vec![skein_core::ToolCall {
                id: "t1_1".into(),
                name: "write_file".into(),
                args: skein_llm::malformed_args("{\"path\": ", "EOF while parsing"),
            }],
        },
        skein_core::Message::Tool {
            call_id: "t1_1".into(),
            name: "write_file".into(),
            content: "arguments are not valid JSON".into(),
            is_error: true,
        },
    ];
    p.complete("m", &request("test:m", msgs, vec![weather_tool()]))
        .await
        .unwrap();
    let b = &server.requests()[0].body;
    assert_eq!(
        b["messages"][1]["tool_calls"][0]["function"]["arguments"],
        "{\"path\": "
    );
    // Never null: strict servers refuse it.
    assert_eq!(b["messages"][1]["content"], json!(""));
}

#[tokio::test]
async fn a_call_without_a_name_becomes_an_invalid_call() {
    let body = json!({
        "choices": [{"message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]},
            "finish_reason": "tool_calls"}]
    });
    let server = MockServer::start(vec![Canned::json(200, &body)]).await;
    let p = OpenAiProvider::new(settings(ProviderKind::OpenAi, &server.url)).unwrap();
    let c = p
        .complete("m", &request("test:m", vec![user("go")], vec![]))
        .await
        .unwrap();
    let call = &c.response.tool_calls[0];
    assert_eq!(call.name, INVALID_TOOL_CALL);
    assert_eq!(call.id, "c1");
    assert!(call.args[RAW_KEY].is_string() && call.args[ERROR_KEY].is_string());
}
