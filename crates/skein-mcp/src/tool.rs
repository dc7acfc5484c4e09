//! An MCP server's tool as a skein tool: its name prefixed with the server's, its
//! approval decided from its annotations and the config, its result turned into the text
//! a model reads (images, audio and resources kept as blobs).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use serde_json::Value;
use skein_tools::{Result, Tool, ToolContext, ToolError, ToolSource};

use crate::client::{McpError, Server};
use crate::config::{Approval, MAX_TOOL_NAME, SEPARATOR};
use crate::protocol::{CallResult, Content, ToolDef};

/// The name the model and agent files know a server's tool by, or why it has none.
pub fn exposed_name(server: &str, tool: &str) -> std::result::Result<String, String> {
    let full = format!("{server}{SEPARATOR}{tool}");
    if tool.is_empty()
        || !tool
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!(
            "tool `{}` of server `{server}` is not offered: its name may hold only ASCII \
             letters, digits, `_` and `-` for a model to call it",
            tool.escape_debug()
        ));
    }
    if full.len() > MAX_TOOL_NAME {
        return Err(format!(
            "tool `{tool}` of server `{server}` is not offered: `{full}` is longer than \
             {MAX_TOOL_NAME} bytes, the most a model accepts"
        ));
    }
    Ok(full)
}

/// Whether calls of `tool` wait for a person's approval under the server's config.
pub fn needs_approval(server: &Server, tool: &ToolDef) -> bool {
    let cfg = &server.cfg;
    if cfg.require_approval.contains(&tool.name) {
        return true;
    }
    if cfg.skip_approval.contains(&tool.name) {
        return false;
    }
    match cfg.approval {
        Approval::Always => true,
        Approval::Never => false,
        Approval::Annotations => {
            tool.annotations.destructive_hint == Some(true) || !tool.read_only()
        }
    }
}

/// One tool of one server.
pub struct McpTool {
    server: Arc<Server>,
    /// The server's own name for it.
    tool: String,
    name: String,
    /// Decided at start: the runtime's approval rules are fixed for a worker's life.
    approval: bool,
    /// First listed after the worker started: the approval rules do not name it, so it
    /// runs only while it needs no approval.
    later: bool,
    /// What it was first listed as, for a server that listed it no more.
    listed: ToolDef,
}

impl McpTool {
    pub fn new(server: Arc<Server>, def: ToolDef) -> std::result::Result<Self, String> {
        let name = exposed_name(&server.name, &def.name)?;
        Ok(Self {
            approval: needs_approval(&server, &def),
            later: false,
            tool: def.name.clone(),
            name,
            listed: def,
            server,
        })
    }

    /// A tool the server listed after the worker started (after it said its list
    /// changed, or once started again). The approval rules, fixed at start, do not name
    /// it: it never waits for approval, and a call is refused while its annotations or
    /// the config say it would need it.
    pub fn listed_later(server: Arc<Server>, def: ToolDef) -> std::result::Result<Self, String> {
        let mut t = Self::new(server, def)?;
        t.approval = false;
        t.later = true;
        Ok(t)
    }
}

#[async_trait]
impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        if self.listed.description.is_empty() {
            self.listed.title.as_deref().unwrap_or("")
        } else {
            &self.listed.description
        }
    }

    fn parameters(&self) -> Value {
        Value::clone(&self.schema())
    }

    /// The schema the server lists now (or as first listed), without copying it.
    fn schema(&self) -> Arc<Value> {
        self.server
            .tool_schema(&self.tool)
            .unwrap_or_else(|| self.listed.input_schema.clone())
    }

    /// Calls of one tool may overlap; the server's `max_concurrency` bounds them.
    fn parallel(&self) -> bool {
        true
    }

    /// Run again after a crash only when the server says so of a read-only tool.
    fn idempotent(&self) -> bool {
        self.listed.read_only() && self.listed.annotations.idempotent_hint != Some(false)
    }

    fn requires_approval(&self) -> bool {
        self.approval
    }

    /// A little more than the server's own limits (a start again, if it died, then the
    /// call), which cancel the call first.
    fn timeout(&self) -> Duration {
        self.server.cfg.startup_timeout + self.server.cfg.timeout + Duration::from_secs(5)
    }

    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<String> {
        let now = self.server.tool(&self.tool);
        let Some(def) = now else {
            return Err(ToolError::Refused(format!(
                "the server `{}` no longer lists this tool",
                self.server.name
            )));
        };
        // The approval rule was fixed at start; a tool that has become one needing
        // approval since is not run without it.
        if !self.approval && needs_approval(&self.server, &def) {
            return Err(ToolError::Refused(if self.later {
                format!(
                    "the server `{}` listed this tool after the worker started, and it needs \
                     a person's approval; it can be called once the worker restarts",
                    self.server.name
                )
            } else {
                format!(
                    "the server `{}` now describes this tool as one that changes things; it \
                     runs again once the worker restarts and asks for approval",
                    self.server.name
                )
            }));
        }
        // Progress the server sends goes to whoever watches, as `3/10 message`.
        let listener = ctx.progress.clone().map(|sink| {
            let name = self.name.clone();
            Arc::new(move |p: &crate::protocol::Progress| sink(&name, &p.line()))
                as crate::client::ProgressListener
        });
        let result = self
            .server
            .call_heard(&self.tool, args, listener)
            .await
            .map_err(|e| match e {
                McpError::Timeout(d) => ToolError::Timeout(d),
                McpError::Rpc(r) if r.code == crate::protocol::codes::INVALID_PARAMS => {
                    ToolError::InvalidArgs(r.message)
                }
                e => ToolError::Failed(format!("server `{}`: {e}", self.server.name)),
            })?;
        let text = render(
            &result,
            ctx,
            self.server.cfg.max_output_bytes,
            &self.server.name,
        )
        .await;
        if result.is_error {
            Err(ToolError::Failed(text))
        } else {
            Ok(text)
        }
    }
}

/// The tools of a worker's servers as a list that follows their changes. A tool a server
/// lists now is offered, with two exceptions that keep the approval rules (fixed when the
/// worker starts, and re-derived the same by replay) true: a tool first listed later that
/// would need approval is not offered, and a call of it is refused; a tool listed no more
/// is not offered, and a call of it is a tool error saying so.
pub struct McpSource {
    servers: Vec<Arc<Server>>,
    /// Every tool seen, by the name the model knows it by.
    seen: Mutex<BTreeMap<String, Arc<McpTool>>>,
}

impl McpSource {
    /// The servers' tools as listed now, which the approval rules are made from; returns
    /// why some are not offered too.
    pub fn new(servers: Vec<Arc<Server>>) -> (Self, Vec<String>) {
        let mut seen = BTreeMap::new();
        let mut skipped = vec![];
        for s in &servers {
            for def in s.tools() {
                match McpTool::new(s.clone(), def) {
                    Ok(t) => {
                        seen.insert(t.name.clone(), Arc::new(t));
                    }
                    Err(why) => skipped.push(why),
                }
            }
        }
        let source = Self {
            servers,
            seen: Mutex::new(seen),
        };
        (source, skipped)
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<McpTool>>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl ToolSource for McpSource {
    fn names(&self) -> Vec<String> {
        let seen = self.seen();
        let mut out = vec![];
        for s in &self.servers {
            for def in s.tools() {
                let Ok(name) = exposed_name(&s.name, &def.name) else {
                    continue;
                };
                let offered = match seen.get(&name) {
                    Some(t) => t.approval || !needs_approval(s, &def),
                    None => !needs_approval(s, &def),
                };
                if offered {
                    out.push(name);
                }
            }
        }
        out
    }

    fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        if let Some(t) = self.seen().get(name) {
            return Some(t.clone());
        }
        let (server, tool) = name.split_once(SEPARATOR)?;
        let s = self.servers.iter().find(|s| s.name == server)?;
        let t = Arc::new(McpTool::listed_later(s.clone(), s.tool(tool)?).ok()?);
        let mut seen = self.seen();
        let t = seen.entry(name.to_string()).or_insert(t).clone();
        Some(t)
    }

    async fn refresh(&self) {
        futures::future::join_all(self.servers.iter().map(|s| s.relist_if_changed())).await;
    }
}

/// What the model reads of a result: text as sent; images, audio and binary resources
/// kept as blobs and named; structured content as JSON when no text holds it; cut at
/// `max` bytes with a note.
pub async fn render(r: &CallResult, ctx: &ToolContext, max: usize, server: &str) -> String {
    let mut parts: Vec<String> = vec![];
    for c in &r.content {
        parts.push(match c {
            Content::Text(t) => t.clone(),
            Content::Image { data, mime_type } => kept("image", mime_type, data, ctx).await,
            Content::Audio { data, mime_type } => kept("audio", mime_type, data, ctx).await,
            Content::ResourceLink { uri, name } => {
                format!(
                    "[resource link: {uri}{}]",
                    if name.is_empty() {
                        String::new()
                    } else {
                        format!(" ({name})")
                    }
                )
            }
            Content::Resource {
                uri,
                mime_type,
                text,
                blob,
            } => match (text, blob) {
                (Some(t), _) => format!("[resource {uri}]\n{t}"),
                (None, Some(b)) => {
                    let what = format!("resource {uri}");
                    kept(
                        &what,
                        mime_type.as_deref().unwrap_or("application/octet-stream"),
                        b,
                        ctx,
                    )
                    .await
                }
                (None, None) => format!("[resource {uri}, empty]"),
            },
            Content::Other(v) => {
                let kind = v.get("type").and_then(Value::as_str).unwrap_or("?");
                let json = v.to_string();
                format!(
                    "[content of a kind this client does not know: `{kind}`] {}",
                    skein_core::text::clip_with_ellipsis(&json, 500)
                )
            }
        });
    }
    if let Some(s) = &r.structured {
        // A text block that says the same is enough. Servers that wrap a plain value as
        // `{"result": value}` (the Python SDK does) say it in the text too.
        let wrapped = s
            .as_object()
            .filter(|o| o.len() == 1)
            .and_then(|o| o.get("result"));
        let held = r.content.iter().any(|c| match c {
            Content::Text(t) => {
                let parsed = serde_json::from_str::<Value>(t).ok();
                parsed.as_ref() == Some(s)
                    || wrapped.is_some_and(|w| {
                        parsed.as_ref() == Some(w) || w.as_str() == Some(t.as_str())
                    })
            }
            _ => false,
        });
        if !held {
            parts.push(format!("structured content: {s}"));
        }
    }
    let all = parts.join("\n");
    if all.len() <= max {
        return all;
    }
    let shown = skein_core::text::clip(&all, max);
    format!(
        "{shown}\n… [{} bytes in all, only the first {} shown (mcp.servers.{server}.max_output_bytes)]",
        all.len(),
        shown.len()
    )
}

/// Stores base64 `data` as a blob and names it.
async fn kept(what: &str, mime: &str, data: &str, ctx: &ToolContext) -> String {
    let bytes = match base64::engine::general_purpose::STANDARD.decode(data.trim()) {
        Ok(b) => b,
        Err(_) => return format!("[{what} {mime}: its data is not valid base64]"),
    };
    match &ctx.blobs {
        Some(blobs) => match blobs.put(&bytes).await {
            Ok(hash) => format!(
                "[{what} {mime}, {} bytes, stored as blob {hash}]",
                bytes.len()
            ),
            Err(e) => format!(
                "[{what} {mime}, {} bytes, could not be stored: {e}]",
                bytes.len()
            ),
        },
        None => format!("[{what} {mime}, {} bytes, not kept]", bytes.len()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed_and_checked() {
        assert_eq!(exposed_name("git", "status").unwrap(), "git__status");
        assert!(exposed_name("git", "a.b")
            .unwrap_err()
            .contains("not offered"));
        assert!(exposed_name("git", &"x".repeat(70))
            .unwrap_err()
            .contains("64"));
    }
}
