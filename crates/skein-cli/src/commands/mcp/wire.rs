//! The JSON-RPC 2.0 messages of the Model Context Protocol that `skein mcp` reads and
//! writes, and the few MCP shapes it answers with. Kept in this one file, free of the
//! rest of the command, so that a client can share it.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// The protocol version this server speaks by preference.
pub const LATEST_VERSION: &str = "2025-06-18";
/// Every version this server accepts, newest first.
pub const VERSIONS: &[&str] = &[LATEST_VERSION, "2025-03-26"];

/// JSON-RPC error codes.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL_ERROR: i64 = -32603;
    /// A request made before `initialize` (the protocol leaves the code to servers).
    pub const NOT_INITIALIZED: i64 = -32002;
}

/// The version to answer `initialize` with: the client's, if this server speaks it, else
/// the newest this server speaks (the client then decides whether to go on).
pub fn negotiate(asked: Option<&str>) -> &'static str {
    asked
        .and_then(|a| VERSIONS.iter().find(|v| **v == a))
        .copied()
        .unwrap_or(LATEST_VERSION)
}

/// A request or response id: the spec allows a string or a number (never null).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Id {
    Num(i64),
    Str(String),
}

/// One message received: a request (with `id`), a notification (without), or a
/// response to something this side sent (with `result` or `error`, no `method`).
#[derive(Debug, Clone)]
pub enum Incoming {
    Request {
        id: Id,
        method: String,
        params: Value,
    },
    Notification {
        method: String,
        params: Value,
    },
    Response {
        id: Id,
    },
}

/// What was wrong with a message that is not JSON-RPC: the error to answer with and the
/// id it carried, if one could be read.
#[derive(Debug, Clone)]
pub struct Malformed {
    pub id: Option<Id>,
    pub error: RpcError,
}

impl Incoming {
    /// Reads one message (already parsed as JSON).
    pub fn from_value(v: Value) -> Result<Self, Malformed> {
        let Value::Object(mut m) = v else {
            return Err(Malformed {
                id: None,
                error: RpcError::new(
                    code::INVALID_REQUEST,
                    "a message must be a JSON object (batches are not accepted)",
                ),
            });
        };
        let id = match m.remove("id") {
            None => None,
            Some(raw) => match serde_json::from_value::<Id>(raw) {
                Ok(id) => Some(id),
                Err(_) => {
                    return Err(Malformed {
                        id: None,
                        error: RpcError::new(
                            code::INVALID_REQUEST,
                            "`id` must be a string or an integer",
                        ),
                    })
                }
            },
        };
        let bad = |id: Option<Id>, what: &str| Malformed {
            id,
            error: RpcError::new(code::INVALID_REQUEST, what),
        };
        if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return Err(bad(id, "`jsonrpc` must be \"2.0\""));
        }
        let params = m.remove("params").unwrap_or(Value::Null);
        if !(params.is_null() || params.is_object()) {
            return Err(bad(id, "`params` must be an object"));
        }
        match (m.remove("method"), id) {
            (Some(Value::String(method)), Some(id)) => Ok(Incoming::Request { id, method, params }),
            (Some(Value::String(method)), None) => Ok(Incoming::Notification { method, params }),
            (Some(_), id) => Err(bad(id, "`method` must be a string")),
            (None, Some(id)) if m.contains_key("result") || m.contains_key("error") => {
                Ok(Incoming::Response { id })
            }
            (None, id) => Err(bad(id, "a request needs a `method`")),
        }
    }
}

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }
}

/// A response to `id`.
pub fn result(id: &Id, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// An error response; `id` is null when the request's id could not be read.
pub fn error(id: Option<&Id>, e: &RpcError) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": e})
}

/// A notification.
pub fn notification(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": method, "params": params})
}

/// `notifications/progress` for a request that sent `progressToken`.
pub fn progress(token: &Value, progress: u64, message: &str) -> Value {
    notification(
        "notifications/progress",
        json!({"progressToken": token, "progress": progress, "message": message}),
    )
}

/// The `progressToken` of a request's `_meta`, if it sent one.
pub fn progress_token(params: &Value) -> Option<Value> {
    params
        .get("_meta")
        .and_then(|m| m.get("progressToken"))
        .filter(|t| t.is_string() || t.is_i64() || t.is_u64())
        .cloned()
}

/// One tool, as `tools/list` shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Tool {
    pub name: String,
    pub title: String,
    pub description: String,
    pub input_schema: Value,
    pub annotations: ToolAnnotations,
}

/// Hints about a tool's effects.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolAnnotations {
    pub read_only_hint: bool,
    pub destructive_hint: bool,
    pub idempotent_hint: bool,
    pub open_world_hint: bool,
}

/// The result of `tools/call`: a text block, the same content as structured JSON, and
/// whether the tool failed (a failure the model reads, not a protocol error).
pub fn tool_result(text: String, structured: Option<Value>, is_error: bool) -> Value {
    let mut m = Map::new();
    m.insert("content".into(), json!([{"type": "text", "text": text}]));
    if let Some(s) = structured {
        m.insert("structuredContent".into(), s);
    }
    m.insert("isError".into(), Value::Bool(is_error));
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_negotiate_to_one_spoken_here() {
        assert_eq!(negotiate(Some("2025-03-26")), "2025-03-26");
        assert_eq!(negotiate(Some("2025-06-18")), "2025-06-18");
        assert_eq!(negotiate(Some("2024-11-05")), LATEST_VERSION);
        assert_eq!(negotiate(None), LATEST_VERSION);
    }

    #[test]
    fn messages_are_told_apart_and_bad_ones_named() {
        let r = Incoming::from_value(json!({"jsonrpc": "2.0", "id": 7, "method": "ping"}));
        assert!(matches!(r, Ok(Incoming::Request { id: Id::Num(7), .. })));
        let n =
            Incoming::from_value(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        assert!(matches!(n, Ok(Incoming::Notification { .. })));
        let resp = Incoming::from_value(json!({"jsonrpc": "2.0", "id": "a", "result": {}}));
        assert!(matches!(resp, Ok(Incoming::Response { .. })));
        let e = Incoming::from_value(json!({"id": 1, "method": "ping"})).err();
        assert!(e.is_some_and(|e| e.id == Some(Id::Num(1)) && e.error.message.contains("jsonrpc")));
        let e = Incoming::from_value(json!([1, 2])).err();
        assert!(e.is_some_and(|e| e.error.code == code::INVALID_REQUEST));
        let e =
            Incoming::from_value(json!({"jsonrpc": "2.0", "id": 2, "method": "x", "params": [1]}))
                .err();
        assert!(e.is_some_and(|e| e.error.message.contains("params")));
    }

    #[test]
    fn progress_tokens_are_read_from_meta() {
        let p = json!({"_meta": {"progressToken": "t1"}});
        assert_eq!(progress_token(&p), Some(json!("t1")));
        assert_eq!(
            progress_token(&json!({"_meta": {"progressToken": 3}})),
            Some(json!(3))
        );
        assert_eq!(progress_token(&json!({})), None);
        assert_eq!(
            progress_token(&json!({"_meta": {"progressToken": null}})),
            None
        );
    }
}
