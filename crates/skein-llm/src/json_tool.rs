//! Tool calling through plain text (`tool_mode = "json"`), and lenient decoding of tool
//! arguments for every mode.
//!
//! In JSON mode no `tools` field is sent. The tools are described in the system prompt
//! ([`tool_prompt`]), and the model is asked to answer with exactly one of
//!
//! ```json
//! {"tool_calls": [{"name": "read_file", "arguments": {"path": "notes.md"}}]}
//! {"answer": "the final answer"}
//! ```
//!
//! [`parse_answer`] reads that back leniently: code fences, prose before or after, a
//! trailing comma, a single call instead of a list, a bare list of calls, the OpenAI
//! `{"function": {...}}` shape, arguments given as a JSON string.
//!
//! An answer that cannot be read is handled by one rule: text without any `{` is taken as
//! the final answer (the model simply answered in prose); anything else becomes one tool
//! call named [`crate::INVALID_TOOL_CALL`] whose arguments follow the `_raw`/`_error`
//! convention (see the crate docs), so the runtime reports the problem to the model as a
//! failed tool call and the model can correct itself on its next turn — a model
//! that meant to call a tool is told, instead of its broken JSON being passed off as the
//! answer. [`crate::Error::Malformed`] stays reserved for a response body the transport
//! could not decode.
//!
//! [`rewrite_messages`] turns a transcript into what such a model can read: its earlier
//! calls as the JSON it was asked to write, and tool results as user messages.

use serde_json::{json, Map, Value};
use skein_core::{Message, ModelResponse, ToolCall, ToolSpec};

use crate::{args_error, malformed_args, INVALID_TOOL_CALL, RAW_KEY};

/// What a JSON-mode answer turned out to be.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// The final answer.
    Answer(String),
    /// Tool calls, with any prose said around them.
    Calls {
        say: Option<String>,
        calls: Vec<(String, Value)>,
    },
    /// Not readable: the raw text and why.
    Invalid { raw: String, error: String },
}

/// The system prompt section that describes `tools` and the answer format.
pub fn tool_prompt(tools: &[ToolSpec]) -> String {
    let mut s = String::from(
        "# Tools\n\n\
         You can call tools. To call one or more, reply with a single JSON object and \
         nothing else:\n\n\
         {\"tool_calls\": [{\"name\": \"TOOL_NAME\", \"arguments\": {\"ARG\": \"VALUE\"}}]}\n\n\
         `arguments` must be a JSON object that fits the tool's schema below. List several \
         calls to have them run together; their results come back in the next message. \
         When you need no more tools, reply with a single JSON object holding your final \
         answer as a string:\n\n\
         {\"answer\": \"YOUR FINAL ANSWER\"}\n\n\
         Available tools:\n",
    );
    for t in tools {
        s.push_str(&format!(
            "\n## {}\n{}\nArguments schema: {}\n",
            t.name,
            t.description.trim(),
            t.parameters
        ));
    }
    s
}

/// The transcript as a model without native tool calling sees it: the tool prompt added
/// to the (first) system message, earlier calls as the JSON the model was asked for, and
/// consecutive tool results as one user message. Adjacent user messages are joined, as
/// some chat templates refuse two in a row.
pub fn rewrite_messages(messages: &[Message], tools: &[ToolSpec]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    let prompt = tool_prompt(tools);
    let mut prompt_placed = false;
    let mut results: Vec<String> = vec![];
    for m in messages {
        if let Message::Tool {
            call_id,
            name,
            content,
            is_error,
        } = m
        {
            let head = if *is_error { "Error from" } else { "Result of" };
            let id = if call_id.is_empty() {
                String::new()
            } else {
                format!(" (call {call_id})")
            };
            results.push(format!("{head} `{name}`{id}:\n{content}"));
            continue;
        }
        flush_results(&mut out, &mut results);
        match m {
            Message::System { content } if !prompt_placed => {
                prompt_placed = true;
                out.push(Message::System {
                    content: format!("{}\n\n{prompt}", content.trim_end()),
                });
            }
            Message::Assistant {
                content,
                tool_calls,
            } if !tool_calls.is_empty() => out.push(Message::Assistant {
                content: Some(render_calls(content.as_deref(), tool_calls)),
                tool_calls: vec![],
            }),
            Message::User { content } => push_user(&mut out, content.clone()),
            other => out.push(other.clone()),
        }
    }
    flush_results(&mut out, &mut results);
    if !prompt_placed {
        out.insert(0, Message::System { content: prompt });
    }
    out
}

fn flush_results(out: &mut Vec<Message>, results: &mut Vec<String>) {
    if results.is_empty() {
        return;
    }
    let mut text = std::mem::take(results).join("\n\n");
    text.push_str(
        "\n\nReply with {\"tool_calls\": [...]} to call more tools, or {\"answer\": \"...\"}.",
    );
    push_user(out, text);
}

fn push_user(out: &mut Vec<Message>, content: String) {
    if let Some(Message::User { content: prev }) = out.last_mut() {
        prev.push_str("\n\n");
        prev.push_str(&content);
    } else {
        out.push(Message::User { content });
    }
}

/// An earlier turn's calls, written as the model was asked to write them. A turn that
/// could not be read is shown as the model wrote it.
fn render_calls(content: Option<&str>, calls: &[ToolCall]) -> String {
    if let [only] = calls {
        if only.name == INVALID_TOOL_CALL {
            if let Some(raw) = only.args.get(RAW_KEY).and_then(Value::as_str) {
                return raw.to_string();
            }
        }
    }
    let list: Vec<Value> = calls
        .iter()
        .map(|c| {
            let args = match args_error(&c.args) {
                Some((raw, _)) => Value::String(raw.to_string()),
                None => c.args.clone(),
            };
            json!({"name": c.name, "arguments": args})
        })
        .collect();
    let body = json!({ "tool_calls": list }).to_string();
    match content.map(str::trim).filter(|c| !c.is_empty()) {
        Some(c) => format!("{c}\n\n{body}"),
        None => body,
    }
}

/// A model's JSON-mode answer as a response. Calls get empty ids (the runtime assigns
/// them).
pub fn response_from_text(text: &str, finish_reason: Option<String>) -> ModelResponse {
    match parse_answer(text) {
        Parsed::Answer(a) => ModelResponse {
            content: Some(a),
            tool_calls: vec![],
            finish_reason,
        },
        Parsed::Calls { say, calls } => ModelResponse {
            content: say,
            tool_calls: calls
                .into_iter()
                .map(|(name, args)| ToolCall {
                    id: String::new(),
                    name,
                    args,
                })
                .collect(),
            finish_reason: Some("tool_calls".into()),
        },
        Parsed::Invalid { raw, error } => ModelResponse {
            content: None,
            tool_calls: vec![ToolCall {
                id: String::new(),
                name: INVALID_TOOL_CALL.into(),
                args: malformed_args(&raw, &error),
            }],
            finish_reason: Some(match finish_reason.as_deref() {
                Some("length") => "length".into(),
                _ => "tool_calls".into(),
            }),
        },
    }
}

/// Reads a JSON-mode answer (see the module docs for what is accepted).
pub fn parse_answer(text: &str) -> Parsed {
    let trimmed = text.trim();
    if !trimmed.contains('{') {
        return Parsed::Answer(trimmed.to_string());
    }
    let mut calls = vec![];
    let mut answer = None;
    let mut used: Vec<(usize, usize)> = vec![];
    let mut first_error: Option<String> = None;
    let mut cut_off = false;
    let mut seen_object = false;
    let bytes = trimmed.as_bytes();
    let mut spans = Spans::new(trimmed);
    let mut i = 0;
    while let Some(off) = trimmed[i..].find(['{', '[']) {
        let start = i + off;
        let is_object = bytes[start] == b'{';
        let first_object = is_object && !seen_object;
        seen_object |= is_object;
        let Some((end, depth)) = spans.end(start) else {
            cut_off |= first_object;
            i = start + 1;
            continue;
        };
        let parsed = if depth > MAX_JSON_DEPTH {
            Err(format!("nested deeper than {MAX_JSON_DEPTH} levels"))
        } else {
            parse_lenient(&trimmed[start..end])
        };
        match parsed.and_then(|v| interpret(&v)) {
            Ok(Interpreted::Calls(c)) => {
                calls.extend(c);
                used.push((start, end));
                i = end;
            }
            Ok(Interpreted::Answer(a)) => {
                answer.get_or_insert(a);
                used.push((start, end));
                i = end;
            }
            Err(e) => {
                if is_object && first_error.is_none() {
                    first_error = Some(e);
                }
                i = start + 1;
            }
        }
    }
    if !calls.is_empty() {
        let say = prose_outside(trimmed, &used).or(answer);
        return Parsed::Calls { say, calls };
    }
    if let Some(a) = answer {
        return Parsed::Answer(a);
    }
    let error = match first_error {
        _ if cut_off => "the JSON object is not closed (was the answer cut off?)".into(),
        Some(e) => e,
        None => "no JSON object found".into(),
    };
    Parsed::Invalid {
        raw: text.to_string(),
        error: format!(
            "could not read a tool call or an answer: {error}. Reply with \
             {{\"tool_calls\": [{{\"name\": ..., \"arguments\": {{...}}}}]}} or \
             {{\"answer\": \"...\"}}"
        ),
    }
}

enum Interpreted {
    Answer(String),
    Calls(Vec<(String, Value)>),
}

fn interpret(v: &Value) -> Result<Interpreted, String> {
    match v {
        Value::Object(o) => {
            let listed = o.get("tool_calls").or_else(|| o.get("tool_call"));
            if let Some(tc) = listed {
                let calls = match tc {
                    Value::Array(a) => a.iter().map(call_from).collect::<Result<Vec<_>, _>>()?,
                    Value::Object(_) => vec![call_from(tc)?],
                    Value::Null => vec![],
                    _ => return Err("\"tool_calls\" must be a list of calls".into()),
                };
                if !calls.is_empty() {
                    return Ok(Interpreted::Calls(calls));
                }
            }
            if let Some(a) = o.get("answer").or_else(|| o.get("final_answer")) {
                return Ok(Interpreted::Answer(match a {
                    Value::String(s) => s.clone(),
                    other => serde_json::to_string_pretty(other).unwrap_or_default(),
                }));
            }
            if listed.is_some() {
                return Err("\"tool_calls\" is empty and there is no \"answer\"".into());
            }
            if ["name", "tool", "function"]
                .iter()
                .any(|k| o.contains_key(*k))
            {
                return Ok(Interpreted::Calls(vec![call_from(v)?]));
            }
            Err("expected an object with \"tool_calls\" or \"answer\"".into())
        }
        Value::Array(a) if !a.is_empty() => Ok(Interpreted::Calls(
            a.iter().map(call_from).collect::<Result<Vec<_>, _>>()?,
        )),
        _ => Err("expected a JSON object".into()),
    }
}

const ARG_KEYS: [&str; 4] = ["arguments", "args", "parameters", "input"];

fn call_from(v: &Value) -> Result<(String, Value), String> {
    let o = v.as_object().ok_or("a tool call must be a JSON object")?;
    let empty = Map::new();
    let f = o
        .get("function")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let name = ["name", "tool"]
        .iter()
        .find_map(|k| o.get(*k))
        .or_else(|| f.get("name"))
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .ok_or("a tool call has no \"name\"")?;
    let args = ARG_KEYS
        .iter()
        .find_map(|k| o.get(*k))
        .or_else(|| ARG_KEYS.iter().find_map(|k| f.get(*k)));
    Ok((
        name.to_string(),
        args.map(decode_arguments).unwrap_or_else(|| json!({})),
    ))
}

/// Tool arguments as a value, whatever form they came in: an object is kept; a JSON
/// string is decoded (leniently, and once more if it held JSON again); null or an empty
/// string is `{}`; a string that cannot be decoded becomes `{"_raw", "_error"}`.
pub fn decode_arguments(v: &Value) -> Value {
    match v {
        Value::Null => json!({}),
        Value::String(s) => {
            let t = s.trim();
            if t.is_empty() {
                return json!({});
            }
            match parse_lenient(t) {
                Ok(Value::String(inner)) => match parse_lenient(inner.trim()) {
                    Ok(o @ Value::Object(_)) => o,
                    _ => Value::String(inner),
                },
                Ok(v) => v,
                Err(e) => malformed_args(s, &format!("arguments are not valid JSON: {e}")),
            }
        }
        other => other.clone(),
    }
}

/// `serde_json`, then again without trailing commas.
pub fn parse_lenient(text: &str) -> Result<Value, String> {
    match serde_json::from_str(text) {
        Ok(v) => Ok(v),
        Err(first) => {
            let fixed = strip_trailing_commas(text);
            if fixed.len() != text.len() {
                if let Ok(v) = serde_json::from_str(&fixed) {
                    return Ok(v);
                }
            }
            Err(first.to_string())
        }
    }
}

/// Drops each comma (outside strings) that only whitespace separates from `}` or `]`.
fn strip_trailing_commas(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    for (k, &c) in chars.iter().enumerate() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        if c == '"' {
            in_string = true;
        } else if c == ',' {
            let next = chars[k + 1..].iter().find(|x| !x.is_whitespace());
            if matches!(next, Some('}') | Some(']')) {
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// JSON nested deeper than this is not parsed: `serde_json` refuses it anyway.
const MAX_JSON_DEPTH: usize = 128;

/// Where the bracket at each position closes (JSON strings respected), and how deep the
/// span between nests. A scan from one bracket also settles every bracket it passes
/// outside strings, so a text with thousands of unclosed brackets is read in a few
/// passes, not one pass per bracket.
struct Spans<'a> {
    text: &'a [u8],
    /// For a bracket's position: the end of its span (exclusive) and its depth, or none
    /// when it never closes.
    ends: std::collections::HashMap<usize, Option<(usize, usize)>>,
}

impl<'a> Spans<'a> {
    fn new(text: &'a str) -> Self {
        Self {
            text: text.as_bytes(),
            ends: Default::default(),
        }
    }

    /// The end and depth of the span the bracket at `start` opens.
    fn end(&mut self, start: usize) -> Option<(usize, usize)> {
        if !self.ends.contains_key(&start) {
            self.scan(start);
        }
        self.ends.get(&start).copied().flatten()
    }

    fn scan(&mut self, start: usize) {
        // Open brackets: position, the closer they need, the depth of what they hold.
        let mut stack: Vec<(usize, u8, usize)> = vec![];
        let mut in_string = false;
        let mut escaped = false;
        for (k, &b) in self.text.iter().enumerate().skip(start) {
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
                b'{' => stack.push((k, b'}', 1)),
                b'[' => stack.push((k, b']', 1)),
                b'}' | b']' => match stack.pop() {
                    Some((open, closer, depth)) if closer == b => {
                        self.ends.insert(open, Some((k + 1, depth)));
                        match stack.last_mut() {
                            Some(outer) => outer.2 = outer.2.max(depth + 1),
                            None => return,
                        }
                    }
                    // A wrong closer: no bracket still open closes.
                    mismatched => {
                        for (open, _, _) in mismatched.into_iter().chain(stack.drain(..)) {
                            self.ends.insert(open, None);
                        }
                        return;
                    }
                },
                _ => {}
            }
        }
        for (open, _, _) in stack {
            self.ends.insert(open, None);
        }
    }
}

/// The text outside the used spans, without code-fence markers; `None` if nothing is left.
fn prose_outside(text: &str, used: &[(usize, usize)]) -> Option<String> {
    let mut rest = String::new();
    let mut at = 0;
    for &(s, e) in used {
        rest.push_str(&text[at..s]);
        rest.push('\n');
        at = e;
    }
    rest.push_str(&text[at..]);
    let mut kept: Vec<&str> = vec![];
    for line in rest
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("```"))
    {
        if !(line.is_empty() && kept.last().is_some_and(|l| l.is_empty())) {
            kept.push(line);
        }
    }
    let joined = kept.join("\n");
    let joined = joined.trim();
    (!joined.is_empty()).then(|| joined.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
