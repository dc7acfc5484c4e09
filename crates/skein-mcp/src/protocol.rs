//! The messages of the Model Context Protocol (revision 2025-06-18, and 2025-03-26, which
//! a server may answer with) that a client sends and reads: JSON-RPC 2.0 requests,
//! responses and notifications, `initialize`, `tools/list` and `tools/call`.
//!
//! Everything a server sends is read by [`parse_messages`], which never panics and
//! refuses what is not JSON-RPC 2.0 with a reason; results are read by the `from_value`
//! functions of each type, which name the field that is wrong.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// The revision this client asks for.
pub const LATEST_VERSION: &str = "2025-06-18";
/// Revisions this client speaks; a server answering with another is refused.
pub const SUPPORTED_VERSIONS: &[&str] = &["2025-06-18", "2025-03-26"];

/// JSON-RPC error codes used here.
pub mod codes {
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
}

/// A request id: the client sends numbers; a server may use strings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestId {
    Num(i64),
    Str(String),
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Num(n) => write!(f, "{n}"),
            Self::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// One message from a server.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// The answer to one of the client's requests.
    Response {
        id: RequestId,
        result: Result<Value, RpcError>,
    },
    /// A request of the server's own (`ping`, `roots/list`, `sampling/createMessage`, …).
    Request {
        id: RequestId,
        method: String,
        params: Value,
    },
    /// A notification (`notifications/tools/list_changed`, `notifications/progress`, …).
    Notification { method: String, params: Value },
}

/// What is wrong with a message a server sent.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct ProtocolError(pub String);

fn bad(s: impl Into<String>) -> ProtocolError {
    ProtocolError(s.into())
}

/// Reads the bytes of one message (an object) or a batch (an array of them).
pub fn parse_messages(bytes: &[u8]) -> Result<Vec<Incoming>, ProtocolError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
    match v {
        Value::Array(items) => {
            if items.is_empty() {
                return Err(bad("an empty batch"));
            }
            items.into_iter().map(parse_message).collect()
        }
        v => Ok(vec![parse_message(v)?]),
    }
}

/// Reads one JSON-RPC 2.0 message.
pub fn parse_message(v: Value) -> Result<Incoming, ProtocolError> {
    let Value::Object(mut m) = v else {
        return Err(bad("a message must be a JSON object"));
    };
    if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(bad("`jsonrpc` must be \"2.0\""));
    }
    let id = match m.remove("id") {
        None => None,
        Some(Value::Null) => Some(None),
        Some(v) => Some(Some(
            serde_json::from_value::<RequestId>(v)
                .map_err(|_| bad("`id` must be a string or an integer"))?,
        )),
    };
    if let Some(method) = m.remove("method") {
        let Value::String(method) = method else {
            return Err(bad("`method` must be a string"));
        };
        let params = match m.remove("params") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(p @ (Value::Object(_) | Value::Array(_))) => p,
            Some(_) => return Err(bad(format!("`{method}`: `params` must be an object"))),
        };
        return Ok(match id {
            None => Incoming::Notification { method, params },
            Some(None) => return Err(bad(format!("request `{method}` with a null id"))),
            Some(Some(id)) => Incoming::Request { id, method, params },
        });
    }
    let Some(Some(id)) = id else {
        // An error about a message the server could not read carries a null id: no call
        // of ours can be matched with it.
        return Err(match m.get("error").and_then(|e| e.get("message")) {
            Some(msg) => bad(format!("the server reported an error without an id: {msg}")),
            None => bad("a response without an id"),
        });
    };
    match (m.remove("result"), m.remove("error")) {
        (Some(result), None) => Ok(Incoming::Response {
            id,
            result: Ok(result),
        }),
        (None, Some(err)) => {
            let err: RpcError = serde_json::from_value(err)
                .map_err(|e| bad(format!("response {id}: malformed `error`: {e}")))?;
            Ok(Incoming::Response {
                id,
                result: Err(err),
            })
        }
        (Some(_), Some(_)) => Err(bad(format!("response {id} has both `result` and `error`"))),
        (None, None) => Err(bad(format!(
            "response {id} has neither `result` nor `error`"
        ))),
    }
}

/// A request as sent.
pub fn request(id: i64, method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

/// A notification as sent.
pub fn notification(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": method, "params": params})
}

/// The answer to a server's request.
pub fn response(id: &RequestId, result: Result<Value, RpcError>) -> Value {
    match result {
        Ok(r) => json!({"jsonrpc": "2.0", "id": id, "result": r}),
        Err(e) => json!({"jsonrpc": "2.0", "id": id, "error": e}),
    }
}

/// The `initialize` parameters of this client. It offers no client capabilities (no
/// roots, no sampling, no elicitation): a server's requests for them are refused.
pub fn initialize_params() -> Value {
    json!({
        "protocolVersion": LATEST_VERSION,
        "capabilities": {},
        "clientInfo": {"name": "skein", "version": env!("CARGO_PKG_VERSION")},
    })
}

/// Name and version of the other side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Implementation {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub version: String,
}

/// What a server answered to `initialize`.
#[derive(Debug, Clone, PartialEq)]
pub struct InitializeResult {
    pub protocol_version: String,
    /// The server offers tools at all.
    pub tools: bool,
    /// It sends `notifications/tools/list_changed`.
    pub tools_list_changed: bool,
    pub server_info: Implementation,
    pub instructions: Option<String>,
}

impl InitializeResult {
    /// Reads the result, refusing a revision this client does not speak.
    pub fn from_value(v: &Value) -> Result<Self, ProtocolError> {
        let version = v
            .get("protocolVersion")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("initialize: no `protocolVersion` in the result"))?;
        if !SUPPORTED_VERSIONS.contains(&version) {
            return Err(bad(format!(
                "initialize: the server speaks protocol revision {version:?}; this client \
                 speaks {}",
                SUPPORTED_VERSIONS.join(" and ")
            )));
        }
        let caps = v.get("capabilities").unwrap_or(&Value::Null);
        if !caps.is_object() {
            return Err(bad("initialize: `capabilities` must be an object"));
        }
        let tools = caps.get("tools");
        Ok(Self {
            protocol_version: version.to_string(),
            tools: tools.is_some_and(Value::is_object),
            tools_list_changed: tools
                .and_then(|t| t.get("listChanged"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            server_info: v
                .get("serverInfo")
                .and_then(|s| serde_json::from_value(s.clone()).ok())
                .unwrap_or_default(),
            instructions: v
                .get("instructions")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }
}

/// What a tool's annotations say about it (all hints: a server may be wrong or lie).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolAnnotations {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only_hint: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destructive_hint: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotent_hint: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_world_hint: Option<bool>,
}

/// One tool of a `tools/list` answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub title: Option<String>,
    pub description: String,
    /// Shared: a worker offers it at every turn that has the tool.
    pub input_schema: std::sync::Arc<Value>,
    pub output_schema: Option<Value>,
    pub annotations: ToolAnnotations,
}

impl ToolDef {
    pub fn from_value(v: &Value) -> Result<Self, ProtocolError> {
        let name = v
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("a tool without a string `name`"))?;
        let input_schema = v
            .get("inputSchema")
            .cloned()
            .ok_or_else(|| bad(format!("tool `{}`: no `inputSchema`", name.escape_debug())))?;
        if input_schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err(bad(format!(
                "tool `{}`: `inputSchema` must be an object schema (`type: object`)",
                name.escape_debug()
            )));
        }
        let annotations = match v.get("annotations") {
            None | Some(Value::Null) => ToolAnnotations::default(),
            Some(a) => serde_json::from_value(a.clone()).map_err(|e| {
                bad(format!(
                    "tool `{}`: malformed `annotations`: {e}",
                    name.escape_debug()
                ))
            })?,
        };
        Ok(Self {
            name: name.to_string(),
            title: v.get("title").and_then(Value::as_str).map(str::to_string),
            description: v
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            input_schema: input_schema.into(),
            output_schema: v.get("outputSchema").filter(|s| s.is_object()).cloned(),
            annotations,
        })
    }

    /// The tool says it changes nothing (`readOnlyHint: true`).
    pub fn read_only(&self) -> bool {
        self.annotations.read_only_hint == Some(true)
    }
}

/// One page of `tools/list`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolsPage {
    pub tools: Vec<ToolDef>,
    pub next_cursor: Option<String>,
}

impl ToolsPage {
    pub fn from_value(v: &Value) -> Result<Self, ProtocolError> {
        let tools = v
            .get("tools")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("tools/list: the result has no `tools` array"))?;
        Ok(Self {
            tools: tools
                .iter()
                .map(ToolDef::from_value)
                .collect::<Result<_, _>>()?,
            next_cursor: v
                .get("nextCursor")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }
}

/// One piece of a tool's result.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Text(String),
    /// Base64 data, as sent.
    Image {
        data: String,
        mime_type: String,
    },
    Audio {
        data: String,
        mime_type: String,
    },
    /// A resource the server points to but does not send.
    ResourceLink {
        uri: String,
        name: String,
    },
    /// A resource sent whole: text, or base64 data.
    Resource {
        uri: String,
        mime_type: Option<String>,
        text: Option<String>,
        blob: Option<String>,
    },
    /// A kind this client does not know: kept as JSON.
    Other(Value),
}

impl Content {
    pub fn from_value(v: &Value) -> Result<Self, ProtocolError> {
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("a content item without a string `type`"))?;
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let need = |k: &str| s(k).ok_or_else(|| bad(format!("{kind} content without `{k}`")));
        Ok(match kind {
            "text" => Self::Text(need("text")?),
            "image" => Self::Image {
                data: need("data")?,
                mime_type: need("mimeType")?,
            },
            "audio" => Self::Audio {
                data: need("data")?,
                mime_type: need("mimeType")?,
            },
            "resource_link" => Self::ResourceLink {
                uri: need("uri")?,
                name: s("name").unwrap_or_default(),
            },
            "resource" => {
                let r = v
                    .get("resource")
                    .filter(|r| r.is_object())
                    .ok_or_else(|| bad("resource content without a `resource` object"))?;
                let rs = |k: &str| r.get(k).and_then(Value::as_str).map(str::to_string);
                Self::Resource {
                    uri: rs("uri").ok_or_else(|| bad("an embedded resource without `uri`"))?,
                    mime_type: rs("mimeType"),
                    text: rs("text"),
                    blob: rs("blob"),
                }
            }
            _ => Self::Other(v.clone()),
        })
    }
}

/// What `tools/call` answered.
#[derive(Debug, Clone, PartialEq)]
pub struct CallResult {
    pub content: Vec<Content>,
    pub structured: Option<Value>,
    /// The tool failed (`isError`): the model reads why.
    pub is_error: bool,
}

impl CallResult {
    pub fn from_value(v: &Value) -> Result<Self, ProtocolError> {
        let content = match v.get("content") {
            Some(Value::Array(items)) => items
                .iter()
                .map(Content::from_value)
                .collect::<Result<_, _>>()?,
            // 2025-06-18 requires `content`, but a result with only `structuredContent`
            // is still readable.
            None if v.get("structuredContent").is_some() => vec![],
            _ => return Err(bad("tools/call: the result has no `content` array")),
        };
        Ok(Self {
            content,
            structured: v.get("structuredContent").cloned(),
            is_error: v.get("isError").and_then(Value::as_bool).unwrap_or(false),
        })
    }
}

/// What a `notifications/progress` says.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    pub token: Value,
    pub progress: f64,
    pub total: Option<f64>,
    pub message: Option<String>,
}

impl Progress {
    pub fn from_params(p: &Value) -> Option<Self> {
        Some(Self {
            token: p.get("progressToken")?.clone(),
            progress: p.get("progress")?.as_f64()?,
            total: p.get("total").and_then(Value::as_f64),
            message: p.get("message").and_then(Value::as_str).map(str::to_string),
        })
    }

    /// How far it has got, in one short line: `3/10 copying`, `0.5`, `2 steps done`. The
    /// message is cut at 200 bytes and its control characters are dropped.
    pub fn line(&self) -> String {
        let num = |n: f64| {
            if n.abs() >= 1e15 {
                format!("{n:e}")
            } else if n.fract() == 0.0 {
                format!("{}", n as i64)
            } else {
                format!("{n:.2}")
            }
        };
        let mut out = match self.total {
            Some(t) => format!("{}/{}", num(self.progress), num(t)),
            None => num(self.progress),
        };
        if let Some(m) = &self.message {
            let m: String = m.chars().filter(|c| !c.is_control()).collect();
            let m = skein_core::text::clip(m.trim(), 200);
            if !m.is_empty() {
                out.push(' ');
                out.push_str(m);
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_told_in_one_short_line() {
        let p = |v: Value| Progress::from_params(&v).unwrap().line();
        assert_eq!(
            p(json!({"progressToken": 1, "progress": 3, "total": 10, "message": "copying\n"})),
            "3/10 copying"
        );
        assert_eq!(p(json!({"progressToken": 1, "progress": 0.25})), "0.25");
        assert_eq!(p(json!({"progressToken": 1, "progress": 1e300})), "1e300");
        let long = p(json!({"progressToken": 1, "progress": 1, "message": "x".repeat(500)}));
        assert!(long.len() <= 202, "{long}");
    }

    #[test]
    fn reads_responses_requests_notifications_and_batches() {
        let m = parse_messages(br#"{"jsonrpc":"2.0","id":3,"result":{"ok":1}}"#).unwrap();
        assert_eq!(
            m,
            vec![Incoming::Response {
                id: RequestId::Num(3),
                result: Ok(json!({"ok": 1}))
            }]
        );
        let m = parse_messages(
            br#"[{"jsonrpc":"2.0","method":"notifications/tools/list_changed"},
                 {"jsonrpc":"2.0","id":"s1","method":"ping"},
                 {"jsonrpc":"2.0","id":4,"error":{"code":-32602,"message":"bad"}}]"#,
        )
        .unwrap();
        assert!(
            matches!(&m[0], Incoming::Notification { method, .. } if method == "notifications/tools/list_changed")
        );
        assert!(matches!(&m[1], Incoming::Request { id: RequestId::Str(s), .. } if s == "s1"));
        assert!(matches!(&m[2], Incoming::Response { result: Err(e), .. } if e.code == -32602));
    }

    #[test]
    fn refuses_what_is_not_json_rpc_with_a_reason() {
        for (input, says) in [
            (&b"nope"[..], "not JSON"),
            (b"[]", "empty batch"),
            (b"3", "JSON object"),
            (br#"{"id":1,"result":{}}"#, "jsonrpc"),
            (br#"{"jsonrpc":"2.0","id":1}"#, "neither"),
            (br#"{"jsonrpc":"2.0","id":1,"result":1,"error":{}}"#, "both"),
            (br#"{"jsonrpc":"2.0","id":[1],"result":1}"#, "`id`"),
            (br#"{"jsonrpc":"2.0","method":7}"#, "`method`"),
            (
                br#"{"jsonrpc":"2.0","id":null,"error":{"code":1,"message":"x"}}"#,
                "without an id",
            ),
        ] {
            let e = parse_messages(input).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn negotiation_accepts_the_two_revisions_only() {
        let r = |v: &str| {
            InitializeResult::from_value(&json!({
                "protocolVersion": v,
                "capabilities": {"tools": {"listChanged": true}},
                "serverInfo": {"name": "s", "version": "1"}
            }))
        };
        assert!(r("2025-06-18").unwrap().tools_list_changed);
        assert_eq!(r("2025-03-26").unwrap().protocol_version, "2025-03-26");
        let e = r("2024-11-05").unwrap_err().to_string();
        assert!(e.contains("2024-11-05") && e.contains("2025-06-18"), "{e}");
    }

    #[test]
    fn reads_tools_and_every_content_kind() {
        let page = ToolsPage::from_value(&json!({
            "tools": [{"name": "rm", "inputSchema": {"type": "object"},
                       "annotations": {"destructiveHint": true}}],
            "nextCursor": "c2"
        }))
        .unwrap();
        assert_eq!(page.next_cursor.as_deref(), Some("c2"));
        assert!(!page.tools[0].read_only());
        let e = ToolsPage::from_value(
            &json!({"tools": [{"name": "x", "inputSchema": {"type": "string"}}]}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("object schema"), "{e}");
        let r = CallResult::from_value(&json!({
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image", "data": "aGk=", "mimeType": "image/png"},
                {"type": "resource", "resource": {"uri": "file:///a", "text": "A"}},
                {"type": "resource_link", "uri": "file:///b", "name": "b"},
                {"type": "hologram", "x": 1}
            ],
            "structuredContent": {"n": 1},
            "isError": true
        }))
        .unwrap();
        assert!(r.is_error);
        assert_eq!(r.content.len(), 5);
        assert!(matches!(&r.content[4], Content::Other(_)));
        assert_eq!(r.structured, Some(json!({"n": 1})));
    }
}
