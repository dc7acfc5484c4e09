//! OpenAI-compatible chat completions: `POST {base_url}/chat/completions`.
//!
//! One wire format covers OpenAI, vLLM, Ollama, llama.cpp's server, LM Studio and
//! OpenRouter, so the answer is read leniently: `content` may be null, a string or a
//! list of text parts; tool calls may come as `tool_calls`, as a legacy `function_call`,
//! or both (then `tool_calls` alone counts); ids may be missing, numeric or repeated (an empty id is left empty, and the
//! runtime gives every call a unique id); `arguments` may be a JSON string with any
//! spacing, an already-decoded object, or a string that is not JSON at all (then the call
//! is kept with the `_raw`/`_error` arguments the crate docs describe).

use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use reqwest::header::{HeaderMap, AUTHORIZATION};
use serde_json::{json, Map, Value};
use skein_core::{Message, ModelRequest, ModelResponse, ToolCall, ToolSpec, Usage};

use crate::config::{ProviderSettings, ToolMode};
use crate::http::{header_map, secret_header, HttpClient};
use crate::json_tool::{decode_arguments, response_from_text, rewrite_messages};
use crate::stream::{OpenAiStream, TextSink};
use crate::{
    args_error, error_in_body, estimate_usage, malformed_args, wire_number, Completion, Error,
    Provider, Result, INVALID_TOOL_CALL,
};

/// A provider speaking the OpenAI chat completions format.
pub struct OpenAiProvider {
    settings: ProviderSettings,
    http: HttpClient,
    headers: HeaderMap,
    /// Set once the server has shown it cannot stream an answer to a request with tools.
    no_tool_streams: AtomicBool,
}

impl OpenAiProvider {
    pub fn new(settings: ProviderSettings) -> Result<Self> {
        let http = HttpClient::new(&settings.name, settings.http.clone())?;
        let headers = header_map(&settings.name, &settings.headers)?;
        Ok(Self {
            settings,
            http,
            headers,
            no_tool_streams: AtomicBool::new(false),
        })
    }

    pub fn settings(&self) -> &ProviderSettings {
        &self.settings
    }

    fn json_mode(&self, req: &ModelRequest) -> bool {
        self.settings.tool_mode == ToolMode::Json && !req.tools.is_empty()
    }

    /// The JSON body sent for `req` to model `model`.
    pub fn request_body(&self, model: &str, req: &ModelRequest) -> Value {
        let s = &self.settings;
        let json_mode = self.json_mode(req);
        let messages = if json_mode {
            rewrite_messages(&req.messages, &req.tools)
        } else {
            req.messages.clone()
        };
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert(
            "messages".into(),
            Value::Array(messages.iter().map(wire_message).collect()),
        );
        if !json_mode && !req.tools.is_empty() {
            body.insert(
                "tools".into(),
                Value::Array(req.tools.iter().map(wire_tool).collect()),
            );
            body.insert("tool_choice".into(), tool_choice(&s.tool_choice));
            if let Some(p) = s.parallel_tool_calls {
                body.insert("parallel_tool_calls".into(), json!(p));
            }
        }
        if let Some(t) = req.temperature.or(s.temperature) {
            body.insert("temperature".into(), wire_number(t));
        }
        if let Some(m) = req.max_tokens.or(s.max_tokens) {
            body.insert("max_tokens".into(), json!(m));
        }
        if let Some(p) = req.top_p {
            body.insert("top_p".into(), wire_number(p));
        }
        if let Some(k) = req.top_k {
            body.insert("top_k".into(), json!(k));
        }
        Value::Object(body)
    }

    /// [`OpenAiProvider::request_body`] asking for a stream of server-sent events.
    pub fn stream_body(&self, model: &str, req: &ModelRequest) -> Value {
        let mut body = self.request_body(model, req);
        body["stream"] = json!(true);
        if self.settings.stream_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }

    fn headers(&self) -> Result<(HeaderMap, Option<crate::ApiKey>)> {
        let s = &self.settings;
        let key = s.key.resolve(&s.name)?;
        let mut headers = self.headers.clone();
        if let Some(k) = &key {
            headers.insert(
                AUTHORIZATION,
                secret_header(&s.name, &format!("Bearer {}", k.expose()))?,
            );
        }
        Ok((headers, key))
    }
}

#[async_trait]
impl Provider for OpenAiProvider {
    fn known_secrets(&self) -> Vec<String> {
        self.settings.current_key().into_iter().collect()
    }

    async fn complete(&self, model: &str, req: &ModelRequest) -> Result<Completion> {
        let s = &self.settings;
        let (headers, key) = self.headers()?;
        let url = format!("{}/chat/completions", s.base_url);
        let body = self.request_body(model, req);
        let answer = self
            .http
            .post_json(&url, &headers, &body, key.as_ref())
            .await?;
        parse_response(&answer, req, self.json_mode(req))
            .map_err(|e| with_provider(e, &s.name, model))
    }

    async fn complete_streaming(
        &self,
        model: &str,
        req: &ModelRequest,
        on_text: TextSink<'_>,
    ) -> Result<Completion> {
        let s = &self.settings;
        let native_tools = !req.tools.is_empty() && !self.json_mode(req);
        let tools_whole =
            native_tools && (!s.stream_tools || self.no_tool_streams.load(Ordering::Relaxed));
        if !s.stream || tools_whole {
            return self.complete(model, req).await;
        }
        let (headers, key) = self.headers()?;
        let url = format!("{}/chat/completions", s.base_url);
        let body = self.stream_body(model, req);
        let mut acc = OpenAiStream::default();
        let whole = self
            .http
            .post_stream(&url, &headers, &body, key.as_ref(), &mut |_, data| {
                acc.push(data, on_text)
            })
            .await
            .map_err(|e| with_provider(e, &s.name, model))?;
        let answer = match whole {
            Some(v) => v,
            None if native_tools && acc.is_empty() => {
                // An empty stream for a request with tools: the server cannot stream
                // answers that may call tools (llama-cpp-python answers 200 and then
                // nothing). Such requests are asked for whole from now on.
                if !self.no_tool_streams.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        provider = %s.name,
                        "the server sent an empty stream for a request with tools; \
                         asking for whole answers when tools are offered \
                         (set stream_tools = false to skip this try)"
                    );
                }
                return self.complete(model, req).await;
            }
            None => acc.finish().map_err(|e| with_provider(e, &s.name, model))?,
        };
        parse_response(&answer, req, self.json_mode(req))
            .map_err(|e| with_provider(e, &s.name, model))
    }
}

fn with_provider(e: Error, provider: &str, model: &str) -> Error {
    match e {
        Error::Malformed(m) => Error::Malformed(format!("{provider}:{model}: {m}")),
        Error::Connect(m) if !m.starts_with(provider) => {
            Error::Connect(format!("{provider}:{model}: {m}"))
        }
        other => other,
    }
}

fn wire_tool(t: &ToolSpec) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
        }
    })
}

/// `auto`, `none` and `required` as they are; any other value names the one tool the
/// model must call.
fn tool_choice(choice: &str) -> Value {
    match choice {
        "auto" | "none" | "required" => json!(choice),
        name => json!({"type": "function", "function": {"name": name}}),
    }
}

/// Arguments as the JSON string the format wants; arguments that could not be read are
/// sent back as the model wrote them.
fn wire_arguments(args: &Value) -> String {
    match (args_error(args), args) {
        (Some((raw, _)), _) => raw.to_string(),
        (None, Value::Null) => "{}".into(),
        (None, v) => v.to_string(),
    }
}

fn wire_message(m: &Message) -> Value {
    match m {
        Message::System { content } => json!({"role": "system", "content": content}),
        Message::User { content } => json!({"role": "user", "content": content}),
        Message::Assistant {
            content,
            tool_calls,
        } => {
            if tool_calls.is_empty() {
                return json!({"role": "assistant", "content": content.as_deref().unwrap_or("")});
            }
            let calls: Vec<Value> = tool_calls
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": wire_arguments(&c.args)},
                    })
                })
                .collect();
            // Never `content: null`: llama.cpp's server (llama-cpp-python) refuses it with
            // HTTP 500 on the next request, and "" is read as no text by every server.
            json!({"role": "assistant", "content": content.as_deref().unwrap_or(""), "tool_calls": calls})
        }
        Message::Tool {
            call_id,
            content,
            is_error,
            ..
        } => {
            // The format has no error flag; say it in the text.
            let content = if *is_error {
                format!("Error: {content}")
            } else {
                content.clone()
            };
            json!({"role": "tool", "tool_call_id": call_id, "content": content})
        }
    }
}

/// Text of a `content` field: a string, or the text parts of a list.
pub(crate) fn content_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str()))
                .collect();
            (!texts.is_empty()).then(|| texts.concat())
        }
        _ => None,
    }
}

/// A call id as given: strings trimmed, numbers written out, anything else empty.
fn call_id(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.trim().to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

/// One entry of `tool_calls`, or a legacy `function_call` object.
fn read_call(entry: &Value, id: String) -> ToolCall {
    let f = entry.get("function").unwrap_or(entry);
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .map(str::trim)
        .unwrap_or("");
    if name.is_empty() {
        return ToolCall {
            id,
            name: INVALID_TOOL_CALL.into(),
            args: malformed_args(&entry.to_string(), "the tool call has no function name"),
        };
    }
    ToolCall {
        id,
        name: name.to_string(),
        args: decode_arguments(f.get("arguments").unwrap_or(&Value::Null)),
    }
}

/// Reads a chat completion. `json_mode`: tools were described in the prompt, so the
/// text is parsed for calls (unless the server returned native calls anyway).
pub fn parse_response(body: &Value, req: &ModelRequest, json_mode: bool) -> Result<Completion> {
    if let Some(e) = error_in_body(body, "choices") {
        return Err(e);
    }
    let choice = body
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| Error::Malformed("the answer has no `choices`".into()))?;
    let msg = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| Error::Malformed("the first choice has no `message`".into()))?;
    let content = content_text(msg.get("content"));
    let finish_reason = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .map(str::to_string);

    let mut calls: Vec<ToolCall> = msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|tc| read_call(tc, call_id(tc.get("id"))))
                .collect()
        })
        .unwrap_or_default();
    // The legacy `function_call` is read only from an answer without `tool_calls`. A
    // server that sends both means one call: llama-cpp-python's function-calling format
    // repeats the first call there, its name with a trailing `:`.
    if calls.is_empty() {
        if let Some(fc) = msg.get("function_call").filter(|f| f.is_object()) {
            calls.push(read_call(fc, String::new()));
        }
    }

    let response = if json_mode && calls.is_empty() {
        response_from_text(content.as_deref().unwrap_or(""), finish_reason)
    } else {
        ModelResponse {
            content: content.filter(|c| !c.is_empty() || calls.is_empty()),
            tool_calls: calls,
            finish_reason,
        }
    };
    let usage = match body.get("usage").filter(|u| u.is_object()) {
        Some(u) if u.get("prompt_tokens").is_some() || u.get("completion_tokens").is_some() => {
            Usage {
                input_tokens: u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0),
                output_tokens: u
                    .get("completion_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
                cost: 0.0,
                estimated: false,
                // OpenAI's automatic prompt caching reports what it read.
                cache_read_tokens: u
                    .pointer("/prompt_tokens_details/cached_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
                cache_write_tokens: 0,
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
        assert_eq!(tool_choice("auto"), json!("auto"));
        assert_eq!(tool_choice("required"), json!("required"));
        assert_eq!(
            tool_choice("read_file"),
            json!({"type": "function", "function": {"name": "read_file"}})
        );
    }

    #[test]
    fn content_forms() {
        assert_eq!(content_text(None), None);
        assert_eq!(content_text(Some(&json!(null))), None);
        assert_eq!(content_text(Some(&json!("hi"))), Some("hi".into()));
        assert_eq!(
            content_text(Some(
                &json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
            )),
            Some("ab".into())
        );
    }

    #[test]
    fn ids() {
        assert_eq!(call_id(Some(&json!(" call_1 "))), "call_1");
        assert_eq!(call_id(Some(&json!(7))), "7");
        assert_eq!(call_id(Some(&json!(null))), "");
        assert_eq!(call_id(None), "");
    }
}
