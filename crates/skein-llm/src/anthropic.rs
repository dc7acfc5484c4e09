//! Anthropic Messages API: `POST {base_url}/v1/messages`.
//!
//! The system prompt is the top-level `system` field (every system message, joined);
//! assistant tool calls are `tool_use` blocks and their results `tool_result` blocks in
//! the following user message (consecutive results merged into one message, as the API
//! wants); `max_tokens` is always sent. `stop_reason` is mapped to the OpenAI-style
//! `finish_reason` the rest of skein reads: `end_turn`/`stop_sequence` → `stop`,
//! `tool_use` → `tool_calls`, `max_tokens` → `length`; any other value passes through.
//!
//! When the request asks for prompt caching (an agent's `prompt_cache: true`), the
//! stable prefix carries `cache_control` breakpoints: the last tool, the system prompt,
//! and the last block of the conversation so far, so the next turn of the same session
//! reads all of it from the cache. Cache reads and writes come back in the usage.

use async_trait::async_trait;
use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{json, Map, Value};
use skein_core::{Message, ModelRequest, ModelResponse, ToolCall, ToolSpec, Usage};

use crate::config::{ProviderSettings, ToolMode};
use crate::http::{header_map, secret_header, HttpClient};
use crate::json_tool::{decode_arguments, response_from_text, rewrite_messages};
use crate::stream::{AnthropicStream, TextSink};
use crate::{
    error_in_body, estimate_usage, wire_number, Completion, Error, Provider, Result, RAW_KEY,
};

/// The API version this provider speaks.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` when neither the request nor the config sets one.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// A provider speaking the Anthropic Messages format.
pub struct AnthropicProvider {
    settings: ProviderSettings,
    http: HttpClient,
    headers: HeaderMap,
}

impl AnthropicProvider {
    pub fn new(settings: ProviderSettings) -> Result<Self> {
        let http = HttpClient::new(&settings.name, settings.http.clone())?;
        let mut headers = HeaderMap::new();
        headers.insert(
            "anthropic-version",
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
        // Configured headers may override the version.
        headers.extend(header_map(&settings.name, &settings.headers)?);
        Ok(Self {
            settings,
            http,
            headers,
        })
    }

    pub fn settings(&self) -> &ProviderSettings {
        &self.settings
    }

    fn json_mode(&self, req: &ModelRequest) -> bool {
        self.settings.tool_mode == ToolMode::Json && !req.tools.is_empty()
    }

    /// `{base_url}/v1/messages`; a base URL that already ends in `/v1` is not doubled.
    pub fn url(&self) -> String {
        let base = &self.settings.base_url;
        if base.ends_with("/v1") {
            format!("{base}/messages")
        } else {
            format!("{base}/v1/messages")
        }
    }

    /// The JSON body sent for `req` to model `model`.
    pub fn request_body(&self, model: &str, req: &ModelRequest) -> Value {
        let s = &self.settings;
        let json_mode = self.json_mode(req);
        let rewritten;
        let messages = if json_mode {
            rewritten = rewrite_messages(&req.messages, &req.tools);
            &rewritten
        } else {
            &req.messages
        };
        let (system, turns) = wire_messages(messages);
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert(
            "max_tokens".into(),
            json!(req
                .max_tokens
                .or(s.max_tokens)
                .unwrap_or(DEFAULT_MAX_TOKENS)),
        );
        let cache = || json!({"type": "ephemeral"});
        if let Some(system) = system {
            if req.prompt_cache {
                body.insert(
                    "system".into(),
                    json!([{"type": "text", "text": system, "cache_control": cache()}]),
                );
            } else {
                body.insert("system".into(), json!(system));
            }
        }
        let mut turns = turns;
        if req.prompt_cache {
            let last = turns
                .last_mut()
                .and_then(|t| t.get_mut("content"))
                .and_then(Value::as_array_mut)
                .and_then(|blocks| blocks.last_mut());
            if let Some(block) = last {
                block["cache_control"] = cache();
            }
        }
        body.insert("messages".into(), Value::Array(turns));
        if !json_mode && !req.tools.is_empty() {
            let mut tools: Vec<Value> = req.tools.iter().map(wire_tool).collect();
            if req.prompt_cache {
                if let Some(t) = tools.last_mut() {
                    t["cache_control"] = cache();
                }
            }
            body.insert("tools".into(), Value::Array(tools));
            if let Some(choice) = tool_choice(&s.tool_choice, s.parallel_tool_calls) {
                body.insert("tool_choice".into(), choice);
            }
        }
        if let Some(t) = req.temperature.or(s.temperature) {
            body.insert("temperature".into(), wire_number(t));
        }
        if let Some(p) = req.top_p {
            body.insert("top_p".into(), wire_number(p));
        }
        if let Some(k) = req.top_k {
            body.insert("top_k".into(), json!(k));
        }
        Value::Object(body)
    }

    fn headers(&self) -> Result<(HeaderMap, Option<crate::ApiKey>)> {
        let s = &self.settings;
        let key = s.key.resolve(&s.name)?;
        let mut headers = self.headers.clone();
        if let Some(k) = &key {
            headers.insert("x-api-key", secret_header(&s.name, k.expose())?);
        }
        Ok((headers, key))
    }

    fn named(&self, model: &str, e: Error) -> Error {
        let name = &self.settings.name;
        match e {
            Error::Malformed(m) => Error::Malformed(format!("{name}:{model}: {m}")),
            Error::Connect(m) if !m.starts_with(name.as_str()) => {
                Error::Connect(format!("{name}:{model}: {m}"))
            }
            other => other,
        }
    }
}

#[async_trait]
impl Provider for AnthropicProvider {
    fn known_secrets(&self) -> Vec<String> {
        self.settings.current_key().into_iter().collect()
    }

    async fn complete(&self, model: &str, req: &ModelRequest) -> Result<Completion> {
        let (headers, key) = self.headers()?;
        let body = self.request_body(model, req);
        let answer = self
            .http
            .post_json(&self.url(), &headers, &body, key.as_ref())
            .await?;
        parse_response(&answer, req, self.json_mode(req)).map_err(|e| self.named(model, e))
    }

    async fn complete_streaming(
        &self,
        model: &str,
        req: &ModelRequest,
        on_text: TextSink<'_>,
    ) -> Result<Completion> {
        if !self.settings.stream {
            return self.complete(model, req).await;
        }
        let (headers, key) = self.headers()?;
        let mut body = self.request_body(model, req);
        body["stream"] = json!(true);
        let mut acc = AnthropicStream::default();
        let whole = self
            .http
            .post_stream(
                &self.url(),
                &headers,
                &body,
                key.as_ref(),
                &mut |event, data| acc.push(event, data, on_text),
            )
            .await
            .map_err(|e| self.named(model, e))?;
        let answer = match whole {
            Some(v) => v,
            None => acc.finish().map_err(|e| self.named(model, e))?,
        };
        parse_response(&answer, req, self.json_mode(req)).map_err(|e| self.named(model, e))
    }
}

fn wire_tool(t: &ToolSpec) -> Value {
    json!({"name": t.name, "description": t.description, "input_schema": t.parameters})
}

/// `tool_choice`, or `None` where the API default (`auto`, parallel calls allowed) is
/// meant.
fn tool_choice(choice: &str, parallel: Option<bool>) -> Option<Value> {
    let mut v = match choice {
        "auto" => json!({"type": "auto"}),
        "required" | "any" => json!({"type": "any"}),
        "none" => return Some(json!({"type": "none"})),
        name => json!({"type": "tool", "name": name}),
    };
    match parallel {
        Some(false) => v["disable_parallel_tool_use"] = json!(true),
        _ if choice == "auto" => return None,
        _ => {}
    }
    Some(v)
}

/// The system text (every system message, joined) and the turns, with adjacent turns of
/// one role merged, as the API requires alternation.
fn wire_messages(messages: &[Message]) -> (Option<String>, Vec<Value>) {
    let mut system: Vec<&str> = vec![];
    let mut turns: Vec<(&'static str, Vec<Value>)> = vec![];
    let mut push = |role: &'static str, blocks: Vec<Value>| {
        if blocks.is_empty() {
            return;
        }
        match turns.last_mut() {
            Some((r, b)) if *r == role => b.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    };
    for m in messages {
        match m {
            Message::System { content } => system.push(content),
            Message::User { content } => push("user", text_block(content).into_iter().collect()),
            Message::Assistant {
                content,
                tool_calls,
            } => {
                let mut blocks: Vec<Value> = content
                    .as_deref()
                    .and_then(text_block)
                    .into_iter()
                    .collect();
                blocks.extend(tool_calls.iter().map(|c| {
                    json!({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(&c.args)})
                }));
                push("assistant", blocks);
            }
            Message::Tool {
                call_id,
                content,
                is_error,
                ..
            } => {
                let mut block = json!({"type": "tool_result", "tool_use_id": call_id});
                if !content.is_empty() {
                    block["content"] = json!(content);
                }
                if *is_error {
                    block["is_error"] = json!(true);
                }
                push("user", vec![block]);
            }
        }
    }
    let system = system
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n");
    let turns = turns
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    ((!system.is_empty()).then_some(system), turns)
}

/// A text block, or none for empty text (the API refuses empty text blocks).
fn text_block(text: &str) -> Option<Value> {
    (!text.trim().is_empty()).then(|| json!({"type": "text", "text": text}))
}

/// `input` must be an object.
fn tool_input(args: &Value) -> Value {
    match args {
        Value::Object(_) => args.clone(),
        Value::Null => json!({}),
        other => json!({ RAW_KEY: other }),
    }
}

fn finish_reason(stop_reason: &str) -> String {
    match stop_reason {
        "end_turn" | "stop_sequence" => "stop",
        "tool_use" => "tool_calls",
        "max_tokens" => "length",
        other => other,
    }
    .to_string()
}

/// Reads a Messages API answer.
pub fn parse_response(body: &Value, req: &ModelRequest, json_mode: bool) -> Result<Completion> {
    if let Some(e) = error_in_body(body, "content") {
        return Err(e);
    }
    let blocks = body
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::Malformed("the answer has no `content` list".into()))?;
    let mut text = String::new();
    let mut calls = vec![];
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_use") => calls.push(ToolCall {
                id: b
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                name: b
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                args: decode_arguments(b.get("input").unwrap_or(&Value::Null)),
            }),
            // thinking, redacted_thinking, server tool blocks: not for the transcript.
            _ => {}
        }
    }
    let finish = body
        .get("stop_reason")
        .and_then(Value::as_str)
        .map(finish_reason);
    let response = if json_mode && calls.is_empty() {
        response_from_text(&text, finish)
    } else {
        ModelResponse {
            content: (!text.is_empty()).then_some(text),
            tool_calls: calls,
            finish_reason: finish,
        }
    };
    let usage = match body.get("usage").filter(|u| u.is_object()) {
        Some(u) if u.get("input_tokens").is_some() || u.get("output_tokens").is_some() => {
            let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
            Usage {
                // Cache reads and writes are input too. The counts are the server's: a sum
                // past u64 stays at the maximum rather than wrapping to a small number.
                input_tokens: n("input_tokens")
                    .saturating_add(n("cache_creation_input_tokens"))
                    .saturating_add(n("cache_read_input_tokens")),
                output_tokens: n("output_tokens"),
                cost: 0.0,
                estimated: false,
                cache_read_tokens: n("cache_read_input_tokens"),
                cache_write_tokens: n("cache_creation_input_tokens"),
            }
        }
        _ => estimate_usage(req, &response),
    };
    Ok(Completion { response, usage })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn tool_choice_forms() {
        assert_eq!(tool_choice("auto", None), None);
        assert_eq!(tool_choice("auto", Some(true)), None);
        assert_eq!(
            tool_choice("auto", Some(false)),
            Some(json!({"type": "auto", "disable_parallel_tool_use": true}))
        );
        assert_eq!(tool_choice("required", None), Some(json!({"type": "any"})));
        assert_eq!(
            tool_choice("read_file", None),
            Some(json!({"type": "tool", "name": "read_file"}))
        );
        assert_eq!(
            tool_choice("none", Some(false)),
            Some(json!({"type": "none"}))
        );
    }

    #[test]
    fn huge_cache_counts_do_not_wrap_to_a_small_usage() {
        let req = ModelRequest {
            model: "anthropic:m".into(),
            messages: vec![],
            tools: vec![],
            temperature: None,
            max_tokens: None,
            top_p: None,
            top_k: None,
            prompt_cache: false,
            meta: Default::default(),
        };
        let body = json!({
            "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "end_turn",
            "usage": {
                "input_tokens": 50,
                "cache_creation_input_tokens": 20,
                "cache_read_input_tokens": u64::MAX,
                "output_tokens": 12
            }
        });
        let c = parse_response(&body, &req, false).unwrap();
        assert_eq!(c.usage.input_tokens, u64::MAX);
        assert_eq!(c.usage.output_tokens, 12);
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(finish_reason("end_turn"), "stop");
        assert_eq!(finish_reason("tool_use"), "tool_calls");
        assert_eq!(finish_reason("max_tokens"), "length");
        assert_eq!(finish_reason("refusal"), "refusal");
    }

    #[test]
    fn user_turns_merge_and_empty_text_is_dropped() {
        let (system, turns) = wire_messages(&[
            Message::System {
                content: "a".into(),
            },
            Message::User {
                content: "one".into(),
            },
            Message::System {
                content: "b".into(),
            },
            Message::User {
                content: "two".into(),
            },
            Message::Assistant {
                content: Some("  ".into()),
                tool_calls: vec![],
            },
        ]);
        assert_eq!(system.as_deref(), Some("a\n\nb"));
        assert_eq!(
            turns,
            vec![json!({"role": "user", "content": [
                {"type": "text", "text": "one"}, {"type": "text", "text": "two"}
            ]})]
        );
    }
}
