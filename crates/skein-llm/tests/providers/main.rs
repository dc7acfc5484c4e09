//! Provider tests against an in-process HTTP server: the request bodies and headers each
//! provider sends, how it reads recorded answers (fixtures written from the providers'
//! public API formats), and how failures map to error kinds and retries.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod anthropic;
mod config;
mod http;
mod json_mode;
mod mock;
mod openai;
mod streaming;

use std::time::Duration;

use serde_json::json;
use skein_core::{Message, ModelRequest, ToolCall, ToolSpec};
use skein_llm::{ApiKey, KeySource, ProviderKind, ProviderSettings};

/// Obviously fake; every test that can see an error string checks it is absent.
pub const KEY: &str = "test-key-not-secret";

/// Settings for a provider at `url` with the fake key and fast retries.
pub fn settings(kind: ProviderKind, url: &str) -> ProviderSettings {
    let mut s = ProviderSettings::new("test", kind, url);
    s.key = KeySource::Value(ApiKey::new(KEY));
    s.http.backoff = Duration::from_millis(10);
    s.http.max_backoff = Duration::from_millis(40);
    s.http.timeout = Duration::from_secs(5);
    s.http.connect_timeout = Duration::from_secs(2);
    s
}

pub fn request(model: &str, messages: Vec<Message>, tools: Vec<ToolSpec>) -> ModelRequest {
    ModelRequest {
        model: model.into(),
        messages,
        tools,
        temperature: None,
        max_tokens: None,
        top_p: None,
        top_k: None,
        prompt_cache: false,
        meta: Default::default(),
    }
}

pub fn weather_tool() -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        description: "Current weather of a city.".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city"]
        })
        .into(),
    }
}

pub fn system(text: &str) -> Message {
    Message::System {
        content: text.into(),
    }
}

pub fn user(text: &str) -> Message {
    Message::User {
        content: text.into(),
    }
}

/// A transcript with one turn of two parallel calls, one of which failed.
pub fn conversation_with_tool_results() -> Vec<Message> {
    vec![
        system("You are a weather assistant."),
        user("Weather in Paris and Oslo?"),
        Message::Assistant {
            content: Some("Checking both.".into()),
            tool_calls: vec![
                ToolCall {
                    id: "call_a".into(),
                    name: "get_weather".into(),
                    args: json!({"city": "Paris"}),
                },
                ToolCall {
                    id: "call_b".into(),
                    name: "get_weather".into(),
                    args: json!({"city": "Oslo"}),
                },
            ],
        },
        Message::Tool {
            call_id: "call_a".into(),
            name: "get_weather".into(),
            content: r#"{"temp_c": 21}"#.into(),
            is_error: false,
        },
        Message::Tool {
            call_id: "call_b".into(),
            name: "get_weather".into(),
            content: "station offline".into(),
            is_error: true,
        },
        user("And tomorrow?"),
    ]
}
