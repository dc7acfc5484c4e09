//! Workspace file tools: `read_file`, `write_file`, `list_dir` (also as `list_directory`),
//! `get_file_info`. They work on any
//! [`Workspace`](crate::Workspace) backend; the backend keeps paths inside the tree's files.

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::FilesConfig;
use crate::schema::derived;
use crate::text::decode_prefix;
use crate::{Tool, ToolContext, ToolError};

/// Deserializes already validated arguments into `T`.
pub(crate) fn args<T: for<'de> Deserialize<'de>>(args: Value) -> Result<T, ToolError> {
    serde_json::from_value(args).map_err(|e| ToolError::InvalidArgs(e.to_string()))
}

/// `list_dir`, and the same tool under the planner reference's name `list_directory`.
pub struct ListDir {
    cfg: FilesConfig,
    name: &'static str,
}

impl ListDir {
    pub fn new(cfg: FilesConfig) -> Self {
        Self {
            cfg,
            name: "list_dir",
        }
    }

    /// The same tool under another name (`list_directory`).
    pub fn named(cfg: FilesConfig, name: &'static str) -> Self {
        Self { cfg, name }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListArgs {
    /// Directory relative to the workspace root; "." or empty for the root.
    #[serde(default)]
    pub(crate) path: String,
}

#[async_trait]
impl Tool for ListDir {
    fn name(&self) -> &str {
        self.name
    }
    fn description(&self) -> &str {
        "List a directory of the workspace: one entry a line, directories ending in `/`, \
         files with their size."
    }
    fn parameters(&self) -> Value {
        derived::<ListArgs>()
    }
    fn idempotent(&self) -> bool {
        true
    }
    async fn call(&self, ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: ListArgs = args(a)?;
        let entries = ctx.workspace.list(&a.path).await?;
        if entries.is_empty() {
            return Ok("(empty directory)".into());
        }
        let shown = entries.len().min(self.cfg.max_list_entries);
        let mut out: Vec<String> = entries[..shown]
            .iter()
            .map(|e| {
                if e.is_dir {
                    format!("{}/", e.name)
                } else {
                    format!("{} ({} bytes)", e.name, e.size)
                }
            })
            .collect();
        if shown < entries.len() {
            out.push(format!(
                "… [{} more entries not shown; {} in all]",
                entries.len() - shown,
                entries.len()
            ));
        }
        Ok(out.join("\n"))
    }
}

/// `get_file_info`: what an entry of the workspace is, without reading it whole into the
/// conversation: its kind, size, time of last change (where the backend keeps it) and,
/// for a text file, its line count.
pub struct GetFileInfo {
    cfg: FilesConfig,
}

impl GetFileInfo {
    pub fn new(cfg: FilesConfig) -> Self {
        Self { cfg }
    }
}

/// Files larger than this are not read to count their lines.
const MAX_COUNTED_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct InfoArgs {
    /// File or directory relative to the workspace root.
    pub(crate) path: String,
}

#[async_trait]
impl Tool for GetFileInfo {
    fn name(&self) -> &str {
        "get_file_info"
    }
    fn description(&self) -> &str {
        "Facts about a file or directory of the workspace: kind, size in bytes, time of \
         last modification and, for a file, its number of lines."
    }
    fn parameters(&self) -> Value {
        derived::<InfoArgs>()
    }
    fn idempotent(&self) -> bool {
        true
    }
    async fn call(&self, ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: InfoArgs = args(a)?;
        let path = crate::workspace::normalize(&a.path)?;
        let (parent, name) = match path.rsplit_once('/') {
            Some((p, n)) => (p.to_string(), n.to_string()),
            None => (String::new(), path.clone()),
        };
        let (kind, size) = if path.is_empty() {
            ("directory", 0)
        } else {
            let entries = ctx.workspace.list(&parent).await?;
            let Some(e) = entries.into_iter().find(|e| e.name == name) else {
                return Err(ToolError::Failed(format!(
                    "`{path}`: no such file or directory"
                )));
            };
            (if e.is_dir { "directory" } else { "file" }, e.size)
        };
        let modified = ctx.workspace.modified(&path).await?;
        let mut v = json!({
            "path": if path.is_empty() { "." } else { path.as_str() },
            "kind": kind,
            "size": size,
            "modified": modified.map(|ms| {
                let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
                humantime::format_rfc3339_seconds(t).to_string()
            }),
        });
        if kind == "file" {
            v["lines"] = if size <= MAX_COUNTED_BYTES.min(self.cfg.max_read_bytes as u64 * 64) {
                let bytes = ctx.workspace.read(&path).await?;
                let mut n = bytes.iter().filter(|b| **b == b'\n').count();
                if bytes.last().is_some_and(|b| *b != b'\n') {
                    n += 1;
                }
                json!(n)
            } else {
                Value::Null
            };
        }
        Ok(v.to_string())
    }
}

/// `read_file`.
pub struct ReadFile {
    cfg: FilesConfig,
}

impl ReadFile {
    pub fn new(cfg: FilesConfig) -> Self {
        Self { cfg }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReadArgs {
    /// File relative to the workspace root.
    #[schemars(length(min = 1))]
    pub(crate) path: String,
    /// Byte to start at (default 0).
    #[serde(default)]
    pub(crate) offset: u64,
}

#[async_trait]
impl Tool for ReadFile {
    fn name(&self) -> &str {
        "read_file"
    }
    fn description(&self) -> &str {
        "Read a text file of the workspace. A long file is cut; the note at the end tells \
         the offset to read on from."
    }
    fn parameters(&self) -> Value {
        derived::<ReadArgs>()
    }
    fn idempotent(&self) -> bool {
        true
    }
    async fn call(&self, ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: ReadArgs = args(a)?;
        let part = ctx
            .workspace
            .read_part(&a.path, a.offset, self.cfg.max_read_bytes)
            .await?;
        if a.offset > part.size {
            return Err(ToolError::InvalidArgs(format!(
                "`offset` {} is past the end of `{}` ({} bytes)",
                a.offset, a.path, part.size
            )));
        }
        let more = a.offset + (part.data.len() as u64) < part.size;
        if !more {
            return Ok(String::from_utf8_lossy(&part.data).into_owned());
        }
        let (mut text, used) = decode_prefix(&part.data);
        let end = a.offset + used as u64;
        text.push_str(&format!(
            "\n… [truncated: bytes {}..{end} of {} shown; read on with offset {end}]",
            a.offset, part.size
        ));
        Ok(text)
    }
}

/// `write_file`.
pub struct WriteFile {
    cfg: FilesConfig,
}

impl WriteFile {
    pub fn new(cfg: FilesConfig) -> Self {
        Self { cfg }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct WriteArgs {
    /// File relative to the workspace root.
    #[schemars(length(min = 1))]
    pub(crate) path: String,
    /// The whole new content.
    pub(crate) content: String,
}

#[async_trait]
impl Tool for WriteFile {
    fn name(&self) -> &str {
        "write_file"
    }
    fn description(&self) -> &str {
        "Write a text file in the workspace, replacing it if it exists; missing \
         directories are created."
    }
    fn parameters(&self) -> Value {
        derived::<WriteArgs>()
    }
    fn idempotent(&self) -> bool {
        true
    }
    fn parallel(&self) -> bool {
        false
    }
    async fn call(&self, ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: WriteArgs = args(a)?;
        if a.content.len() > self.cfg.max_write_bytes {
            return Err(ToolError::Refused(format!(
                "`content` is {} bytes; at most {} may be written at once",
                a.content.len(),
                self.cfg.max_write_bytes
            )));
        }
        let room = ctx.workspace.usage(&a.path).await?;
        let after = room
            .total
            .saturating_sub(room.of_path)
            .saturating_add(a.content.len() as u64);
        if after > self.cfg.max_workspace_bytes {
            return Err(ToolError::Refused(format!(
                "writing {} bytes to `{}` would bring the workspace to {after} bytes; its \
                 files may hold at most {} bytes together (tools.files.max_workspace_bytes)",
                a.content.len(),
                a.path,
                self.cfg.max_workspace_bytes
            )));
        }
        ctx.workspace.write(&a.path, a.content.as_bytes()).await?;
        Ok(format!("wrote {} bytes to {}", a.content.len(), a.path))
    }
}
