//! Answers that stream: server-sent events, and the two wire formats' deltas put back
//! together into the body a non-streamed answer would have had.
//!
//! Both providers read a streamed answer the same way: [`SseParser`] cuts the bytes into
//! events, an accumulator ([`OpenAiStream`], [`AnthropicStream`]) folds each event into
//! the answer so far and hands every piece of text to the caller's sink as it comes, and
//! [`OpenAiStream::finish`] / [`AnthropicStream::finish`] give back the JSON body the
//! provider's ordinary reader then reads, with all its leniency. So a streamed and a
//! non-streamed answer become the same [`crate::Completion`], and the log records one
//! `ModelCalled` either way.
//!
//! A stream that ends before the format's end marker (`[DONE]` or a `finish_reason`;
//! `message_stop`) is an [`Error::Connect`]: retryable, and nothing of it is recorded.

use serde_json::{json, Map, Value};

use crate::{error_in_body, Error, Result};

/// Where the text of an answer goes, a piece at a time, while it arrives.
pub type TextSink<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// Longest event (or unterminated line) kept while waiting for its end: an answer's
/// events are small, so a server that sends more without a break is not speaking SSE.
const MAX_EVENT: usize = 8 << 20;

/// A server-sent-events decoder: bytes in, `(event, data)` pairs out.
/// Kept instead of `eventsource-stream`: docs/providers.md (Streaming) gives the comparison.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line not yet ended.
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
    /// Whether a `\r` ended the last line, so a `\n` right after it is not a second end.
    after_cr: bool,
}

impl SseParser {
    /// Feeds bytes; returns the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<(String, String)>> {
        let mut out = vec![];
        for &b in bytes {
            if self.after_cr && b == b'\n' {
                self.after_cr = false;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\r' || b == b'\n' {
                let line = std::mem::take(&mut self.line);
                self.line_done(&String::from_utf8_lossy(&line), &mut out);
            } else {
                self.line.push(b);
            }
            if self.line.len() + self.data.len() > MAX_EVENT {
                return Err(Error::Malformed(format!(
                    "a server-sent event is longer than {MAX_EVENT} bytes"
                )));
            }
        }
        Ok(out)
    }

    /// The event the stream's end completes, if the last one lacked its blank line.
    pub fn finish(&mut self) -> Vec<(String, String)> {
        let mut out = vec![];
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&String::from_utf8_lossy(&line), &mut out);
        }
        self.line_done("", &mut out);
        out
    }

    fn line_done(&mut self, line: &str, out: &mut Vec<(String, String)>) {
        if line.is_empty() {
            if self.has_data {
                let event = std::mem::take(&mut self.event);
                out.push((event, std::mem::take(&mut self.data)));
            }
            self.event.clear();
            self.has_data = false;
            return;
        }
        if line.starts_with(':') {
            return; // a comment (keep-alive)
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => self.event = value.to_string(),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            _ => {} // id, retry, unknown fields
        }
    }
}

fn parse_data(data: &str) -> Result<Value> {
    serde_json::from_str(data).map_err(|e| {
        Error::Malformed(format!(
            "a streamed event is not JSON ({e}): {}",
            skein_core::text::clip_with_ellipsis(data, 200)
        ))
    })
}

fn cut(what: &str, received: usize) -> Error {
    Error::Connect(format!(
        "the answer's stream ended before {what} ({received} characters of text received); \
         nothing of it is kept"
    ))
}

/// One tool call being put together from its pieces.
#[derive(Debug, Default)]
struct PartialCall {
    id: Value,
    name: String,
    arguments: String,
    /// Arguments a server sent already decoded.
    decoded: Option<Value>,
}

/// A streamed chat completion (OpenAI format) being put together.
#[derive(Debug, Default)]
pub struct OpenAiStream {
    content: String,
    calls: Vec<PartialCall>,
    legacy: Option<PartialCall>,
    finish_reason: Option<String>,
    usage: Option<Value>,
    done: bool,
    events: usize,
}

impl OpenAiStream {
    /// Whether no event at all has been read.
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// Folds one event's data in, sending its text to `on_text`.
    pub fn push(&mut self, data: &str, on_text: TextSink<'_>) -> Result<()> {
        self.events += 1;
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v = parse_data(data)?;
        if let Some(e) = error_in_body(&v, "choices") {
            return Err(e);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return Ok(()); // the usage chunk has no choices
        };
        // Some servers send the whole message as `message` in a chunk.
        let delta = choice
            .get("delta")
            .or_else(|| choice.get("message"))
            .filter(|d| d.is_object());
        if let Some(d) = delta {
            if let Some(text) = crate::openai::content_text(d.get("content")) {
                if !text.is_empty() {
                    on_text(&text);
                    self.content.push_str(&text);
                }
            }
            if let Some(calls) = d.get("tool_calls").and_then(Value::as_array) {
                for (pos, tc) in calls.iter().enumerate() {
                    let index = tc
                        .get("index")
                        .and_then(Value::as_u64)
                        .map(|i| i as usize)
                        .unwrap_or(pos);
                    if index >= crate::MAX_STREAMED_CALLS {
                        return Err(Error::Malformed(format!(
                            "a streamed tool call has index {index}; at most {} are read",
                            crate::MAX_STREAMED_CALLS
                        )));
                    }
                    if self.calls.len() <= index {
                        self.calls.resize_with(index + 1, PartialCall::default);
                    }
                    merge_call(&mut self.calls[index], tc);
                }
            }
            if let Some(fc) = d.get("function_call").filter(|f| f.is_object()) {
                merge_call(self.legacy.get_or_insert_with(PartialCall::default), fc);
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_string());
        }
        Ok(())
    }

    /// The body a non-streamed answer would have had; an error if the stream was cut.
    /// An answer is whole only with its finish reason: llama-cpp-python ends a stream it
    /// interrupts (for a newer request) with `[DONE]` and no finish reason.
    pub fn finish(self) -> Result<Value> {
        if self.finish_reason.is_none() {
            let what = if self.done {
                "its finish reason (it ended with [DONE] alone: the server cut the answer)"
            } else {
                "its finish reason"
            };
            return Err(cut(what, self.content.chars().count()));
        }
        let mut msg = Map::new();
        msg.insert("role".into(), json!("assistant"));
        msg.insert(
            "content".into(),
            if self.content.is_empty() {
                Value::Null
            } else {
                json!(self.content)
            },
        );
        let wire = |c: PartialCall| {
            let arguments = match c.decoded {
                Some(v) => v,
                None => json!(c.arguments),
            };
            json!({"id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": arguments}})
        };
        let calls: Vec<Value> = self
            .calls
            .into_iter()
            .filter(|c| !c.name.is_empty() || !c.arguments.is_empty() || c.decoded.is_some())
            .map(wire)
            .collect();
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(l) = self.legacy {
            let arguments = l.decoded.unwrap_or_else(|| json!(l.arguments));
            msg.insert(
                "function_call".into(),
                json!({"name": l.name, "arguments": arguments}),
            );
        }
        let mut body = json!({"choices": [{"index": 0, "message": msg,
                                            "finish_reason": self.finish_reason}]});
        if let Some(u) = self.usage {
            body["usage"] = u;
        }
        Ok(body)
    }
}

fn merge_call(c: &mut PartialCall, piece: &Value) {
    if let Some(id) = piece.get("id").filter(|i| !i.is_null()) {
        let empty = id.as_str().is_some_and(|s| s.is_empty());
        if !empty {
            c.id = id.clone();
        }
    }
    let f = piece.get("function").unwrap_or(piece);
    if let Some(name) = f.get("name").and_then(Value::as_str) {
        // The name comes whole in one piece; a server that repeats it is not doubled.
        if c.name.is_empty() {
            c.name = name.to_string();
        } else if !name.is_empty() && name != c.name {
            c.name.push_str(name);
        }
    }
    match f.get("arguments") {
        Some(Value::String(s)) => c.arguments.push_str(s),
        Some(v) if !v.is_null() => c.decoded = Some(v.clone()),
        _ => {}
    }
}

/// A streamed Messages API answer (Anthropic format) being put together.
#[derive(Debug, Default)]
pub struct AnthropicStream {
    blocks: Vec<Value>,
    /// Partial JSON of each `tool_use` block's input, by block index.
    inputs: Vec<String>,
    stop_reason: Option<String>,
    usage: Map<String, Value>,
    text_chars: usize,
    done: bool,
}

impl AnthropicStream {
    /// Folds one event in, sending its text to `on_text`.
    pub fn push(&mut self, event: &str, data: &str, on_text: TextSink<'_>) -> Result<()> {
        let v = parse_data(data)?;
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(event)
            .to_string();
        let index = || {
            v.get("index")
                .and_then(Value::as_u64)
                .map(|i| i as usize)
                .filter(|i| *i < crate::MAX_STREAMED_CALLS)
                .ok_or_else(|| {
                    Error::Malformed(format!("a streamed `{kind}` event has no usable index"))
                })
        };
        match kind.as_str() {
            "message_start" => {
                if let Some(u) = v.pointer("/message/usage").and_then(Value::as_object) {
                    self.usage.extend(u.clone());
                }
            }
            "content_block_start" => {
                let i = index()?;
                if self.blocks.len() <= i {
                    self.blocks.resize(i + 1, Value::Null);
                    self.inputs.resize(i + 1, String::new());
                }
                let mut block = v.get("content_block").cloned().unwrap_or(Value::Null);
                if let Some(t) = block.get("text").and_then(Value::as_str) {
                    if !t.is_empty() {
                        on_text(t);
                        self.text_chars += t.chars().count();
                    }
                }
                if block.get("type").and_then(Value::as_str) == Some("tool_use") {
                    // The input comes as partial JSON; an empty start value is a placeholder.
                    if let Some(o) = block.as_object_mut() {
                        o.remove("input");
                    }
                }
                self.blocks[i] = block;
            }
            "content_block_delta" => {
                let i = index()?;
                let block = self
                    .blocks
                    .get_mut(i)
                    .filter(|b| !b.is_null())
                    .ok_or_else(|| {
                        Error::Malformed(format!("a delta for block {i}, which never started"))
                    })?;
                let delta = v.get("delta").cloned().unwrap_or(Value::Null);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        let t = delta.get("text").and_then(Value::as_str).unwrap_or("");
                        if !t.is_empty() {
                            on_text(t);
                            self.text_chars += t.chars().count();
                        }
                        let whole = format!(
                            "{}{t}",
                            block.get("text").and_then(Value::as_str).unwrap_or("")
                        );
                        block["text"] = json!(whole);
                    }
                    Some("input_json_delta") => {
                        let p = delta
                            .get("partial_json")
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        self.inputs[i].push_str(p);
                    }
                    _ => {} // thinking and signature deltas: not for the transcript
                }
            }
            "message_delta" => {
                if let Some(r) = v.pointer("/delta/stop_reason").and_then(Value::as_str) {
                    self.stop_reason = Some(r.to_string());
                }
                if let Some(u) = v.get("usage").and_then(Value::as_object) {
                    // Later counts replace earlier ones (output_tokens is cumulative).
                    for (k, n) in u {
                        if !n.is_null() {
                            self.usage.insert(k.clone(), n.clone());
                        }
                    }
                }
            }
            "message_stop" => self.done = true,
            "error" => {
                let kind = v
                    .pointer("/error/type")
                    .and_then(Value::as_str)
                    .unwrap_or("error");
                let status = match kind {
                    "overloaded_error" => 529,
                    "rate_limit_error" => 429,
                    "invalid_request_error" => 400,
                    "authentication_error" => 401,
                    "permission_error" => 403,
                    "not_found_error" => 404,
                    "request_too_large" => 413,
                    _ => 500,
                };
                return Err(Error::Http {
                    status,
                    message: crate::http::error_message(data),
                    retry_after: None,
                });
            }
            _ => {} // ping, content_block_stop, unknown events
        }
        Ok(())
    }

    /// The body a non-streamed answer would have had; an error if the stream was cut.
    pub fn finish(self) -> Result<Value> {
        if !self.done {
            return Err(cut("`message_stop`", self.text_chars));
        }
        let content: Vec<Value> = self
            .blocks
            .into_iter()
            .zip(self.inputs)
            .filter(|(b, _)| !b.is_null())
            .map(|(mut b, input)| {
                if b.get("type").and_then(Value::as_str) == Some("tool_use") {
                    b["input"] = if input.trim().is_empty() {
                        json!({})
                    } else {
                        // Not JSON: kept as written, and read as arguments that could not
                        // be read.
                        serde_json::from_str(&input).unwrap_or(Value::String(input))
                    };
                }
                b
            })
            .collect();
        Ok(json!({
            "content": content,
            "stop_reason": self.stop_reason,
            "usage": Value::Object(self.usage),
        }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
