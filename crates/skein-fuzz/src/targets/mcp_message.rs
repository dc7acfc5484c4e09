//! `mcp_message`: what an MCP server sends a client. The input is read twice, as the
//! client reads each transport: as lines of a stdio server (each a message or a batch)
//! and as the event stream of a Streamable HTTP answer (cut in two at a drawn point). Each
//! response's result is read as every result the client asks for (`initialize`,
//! `tools/list`, `tools/call`), each listed tool is named and judged for approval as a
//! worker does, and each call result is rendered for the model.

use std::sync::Arc;

use serde_json::Value;
use skein_core::SessionId;
use skein_mcp::client::SseReader;
use skein_mcp::protocol::{self, CallResult, Incoming, InitializeResult, Progress, ToolsPage};
use skein_tools::{LocalWorkspace, ToolContext};

use super::{Spec, Target};
use crate::structured::reshape_json;
use crate::Result;

pub const SPEC: Spec = Spec {
    name: "mcp_message",
    about: "MCP server messages (stdio lines and Streamable HTTP event streams): \
            initialize, tools/list pages, tools/call results, notifications",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Messages::new()?)),
    reshape: |rng, seed, dict| reshape_json(rng, seed, dict),
    tokens: &[
        "jsonrpc",
        "2.0",
        "id",
        "result",
        "error",
        "method",
        "params",
        "protocolVersion",
        "2025-06-18",
        "2025-03-26",
        "capabilities",
        "tools",
        "listChanged",
        "nextCursor",
        "inputSchema",
        "annotations",
        "readOnlyHint",
        "destructiveHint",
        "content",
        "structuredContent",
        "isError",
        "text",
        "image",
        "resource",
        "resource_link",
        "mimeType",
        "data",
        "notifications/progress",
        "notifications/tools/list_changed",
        "notifications/cancelled",
        "progressToken",
        "data: ",
        "\n\n",
    ],
};

pub struct Messages {
    rt: tokio::runtime::Runtime,
    ctx: ToolContext,
    _dir: tempfile::TempDir,
}

impl Messages {
    fn new() -> Result<Self> {
        let setup = |e: &dyn std::fmt::Display| crate::Error::setup("mcp_message", e);
        let dir = tempfile::tempdir().map_err(|e| setup(&e))?;
        Ok(Self {
            rt: super::tokio_runtime("mcp_message")?,
            ctx: ToolContext {
                session: SessionId::root("fuzz").map_err(|e| setup(&e))?,
                workspace: Arc::new(LocalWorkspace::new(dir.path().to_path_buf())),
                blobs: None,
                progress: None,
            },
            _dir: dir,
        })
    }

    fn message(&self, m: Incoming) -> bool {
        match m {
            Incoming::Response { result: Ok(r), .. } => {
                let mut ok = InitializeResult::from_value(&r).is_ok();
                if let Ok(page) = ToolsPage::from_value(&r) {
                    ok = true;
                    for t in &page.tools {
                        let _ = skein_mcp::tool::exposed_name("fuzz", &t.name);
                        let _ = skein_tools::schema::check_schema(&t.input_schema);
                        let _ = skein_tools::schema::validate(&t.input_schema, &Value::Null);
                        let _ = t.read_only();
                    }
                }
                if let Ok(c) = CallResult::from_value(&r) {
                    ok = true;
                    let text = self
                        .rt
                        .block_on(skein_mcp::tool::render(&c, &self.ctx, 4096, "fuzz"));
                    assert!(
                        text.len() <= 4096 + 200,
                        "a rendered result past its cap: {} bytes",
                        text.len()
                    );
                }
                ok
            }
            Incoming::Response { result: Err(_), .. } | Incoming::Request { .. } => true,
            Incoming::Notification { params, .. } => match Progress::from_params(&params) {
                // The live view's line stays one short line, whatever the server sent.
                Some(p) => {
                    let line = p.line();
                    !line.contains(['\n', '\r']) && line.len() <= 2 * 64 + 2 + 200
                }
                None => true,
            },
        }
    }
}

impl Target for Messages {
    fn run(&mut self, data: &[u8]) -> bool {
        let mut accepted = false;
        // A stdio server: one message (or batch) a line.
        for line in data.split(|b| *b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if let Ok(msgs) = protocol::parse_messages(line) {
                for m in msgs {
                    accepted |= self.message(m);
                }
            }
        }
        // A Streamable HTTP answer as an event stream, arriving in two pieces.
        let cut = data.first().map_or(0, |b| *b as usize % (data.len() + 1));
        let mut sse = SseReader::default();
        let mut events = vec![];
        for piece in [&data[..cut], &data[cut..]] {
            if let Ok(e) = sse.push(piece) {
                events.extend(e);
            }
        }
        for e in events {
            if let Ok(msgs) = protocol::parse_messages(e.as_bytes()) {
                for m in msgs {
                    accepted |= self.message(m);
                }
            }
        }
        accepted
    }
}

/// Seeds: what the reference servers send, and some of what they must not.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let lines = |ls: &[&str]| ls.join("\n").into_bytes();
    vec![
        (
            "initialize.jsonl".into(),
            lines(&[
                r#"{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"2025-06-18","capabilities":{"tools":{"listChanged":true},"logging":{}},"serverInfo":{"name":"everything","version":"1.0.0"},"instructions":"Try the tools."}}"#,
            ]),
        ),
        (
            "tools-list.jsonl".into(),
            lines(&[
                r#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"read_text_file","description":"Read a file","inputSchema":{"type":"object","properties":{"path":{"type":"string"},"head":{"type":"number"}},"required":["path"],"additionalProperties":false,"$schema":"http://json-schema.org/draft-07/schema#"},"annotations":{"readOnlyHint":true,"openWorldHint":false}},{"name":"write_file","inputSchema":{"type":"object","properties":{"path":{"type":"string"},"content":{"type":"string"}},"required":["path","content"]},"annotations":{"readOnlyHint":false,"destructiveHint":true}}],"nextCursor":"page-2"}}"#,
            ]),
        ),
        (
            "call-results.jsonl".into(),
            lines(&[
                r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":3,"progress":1,"total":3,"message":"step 1"}}"#,
                r#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"text","text":"hello"},{"type":"image","data":"iVBORw0KGgo=","mimeType":"image/png"},{"type":"resource","resource":{"uri":"file:///a.txt","mimeType":"text/plain","text":"A"}},{"type":"resource_link","uri":"file:///b","name":"b"},{"type":"audio","data":"AAAA","mimeType":"audio/wav"}],"structuredContent":{"total":5},"isError":false}}"#,
                r#"{"jsonrpc":"2.0","id":4,"result":{"content":[{"type":"text","text":"Error: no such file"}],"isError":true}}"#,
                r#"{"jsonrpc":"2.0","id":5,"error":{"code":-32602,"message":"Unknown tool: nope"}}"#,
            ]),
        ),
        (
            "server-requests.jsonl".into(),
            lines(&[
                r#"{"jsonrpc":"2.0","id":"s1","method":"ping"}"#,
                r#"{"jsonrpc":"2.0","id":"s2","method":"roots/list","params":{}}"#,
                r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#,
                r#"[{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"x"}},{"jsonrpc":"2.0","id":6,"result":{}}]"#,
            ]),
        ),
        (
            "stream.sse".into(),
            concat!(
                "event: message\nid: 1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":7,\"progress\":0.5}}\n\n",
                ": keep-alive\n\n",
                "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\n",
                "data: \"result\":{\"content\":[{\"type\":\"text\",\"text\":\"done\"}]}}\r\n\r\n"
            )
            .as_bytes()
            .to_vec(),
        ),
        (
            "refused.jsonl".into(),
            lines(&[
                r#"{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"1999-01-01","capabilities":{}}}"#,
                r#"{"jsonrpc":"1.0","id":1,"result":{}}"#,
                r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}"#,
                r#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"x","inputSchema":{"type":"string"}}]}}"#,
                "[]",
            ]),
        ),
    ]
}
