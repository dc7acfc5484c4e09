//! Workspace file tools.

use async_trait::async_trait;
use serde_json::{json, Value};

use crate::{Tool, ToolContext, ToolError};

fn path_arg(args: &Value) -> Result<String, ToolError> {
    args.get("path")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| ToolError::InvalidArgs("`path` (string) is required".into()))
}

pub struct ListDir;

#[async_trait]
impl Tool for ListDir {
    fn name(&self) -> &str {
        "list_dir"
    }
    fn description(&self) -> &str {
        "List a directory of the workspace."
    }
    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
    }
    fn idempotent(&self) -> bool {
        true
    }
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<String, ToolError> {
        let entries = ctx.workspace.list(&path_arg(&args)?).await?;
        Ok(entries
            .iter()
            .map(|e| {
                if e.is_dir {
                    format!("{}/", e.name)
                } else {
                    format!("{} ({} bytes)", e.name, e.size)
                }
            })
            .collect::<Vec<_>>()
            .join("\n"))
    }
}

pub struct ReadFile;

#[async_trait]
impl Tool for ReadFile {
    fn name(&self) -> &str {
        "read_file"
    }
    fn description(&self) -> &str {
        "Read a text file of the workspace."
    }
    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
    }
    fn idempotent(&self) -> bool {
        true
    }
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<String, ToolError> {
        let data = ctx.workspace.read(&path_arg(&args)?).await?;
        Ok(String::from_utf8_lossy(&data).into_owned())
    }
}

pub struct WriteFile;

#[async_trait]
impl Tool for WriteFile {
    fn name(&self) -> &str {
        "write_file"
    }
    fn description(&self) -> &str {
        "Write a text file in the workspace."
    }
    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]})
    }
    fn idempotent(&self) -> bool {
        true
    }
    fn parallel(&self) -> bool {
        false
    }
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<String, ToolError> {
        let path = path_arg(&args)?;
        let content = args
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| ToolError::InvalidArgs("`content` (string) is required".into()))?;
        ctx.workspace.write(&path, content.as_bytes()).await?;
        Ok(format!("wrote {} bytes to {path}", content.len()))
    }
}
