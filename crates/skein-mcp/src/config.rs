//! `[mcp.servers.NAME]`: the MCP servers a worker may start or reach.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[mcp]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    pub servers: BTreeMap<String, ServerConfig>,
}

/// Whether a server's tools wait for a person's approval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Approval {
    /// As the tool's annotations say: a tool needs approval unless it is marked
    /// `readOnlyHint: true` (and not `destructiveHint: true`).
    #[default]
    Annotations,
    /// Every call of every tool of the server.
    Always,
    /// No call: the config vouches for the server.
    Never,
}

/// One server: a command (stdio) or a `url` (Streamable HTTP).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// The program to start (stdio). Looked up on `PATH`.
    pub command: Option<String>,
    pub args: Vec<String>,
    /// Variables set for the program, on top of the worker's environment.
    pub env: BTreeMap<String, String>,
    pub cwd: Option<PathBuf>,
    /// The server's endpoint (Streamable HTTP).
    pub url: Option<String>,
    /// Headers sent with every request, each taken from an environment variable of the
    /// worker: `{ Authorization = "TICKETS_AUTH" }`. Values never appear in logs.
    pub headers_env: BTreeMap<String, String>,
    /// Time one tool call may take; past it the call is cancelled and the model reads a
    /// tool error.
    #[serde(with = "skein_core::duration::serde")]
    pub timeout: Duration,
    /// Time the server has to start and answer `initialize` and `tools/list`.
    #[serde(with = "skein_core::duration::serde")]
    pub startup_timeout: Duration,
    /// Bytes of a result's text the model is given at most; longer text is cut with a
    /// note (images, audio and resources are kept as blobs, not counted here).
    pub max_output_bytes: usize,
    /// Calls in flight to this server at once; more wait their turn.
    pub max_concurrency: usize,
    pub approval: Approval,
    /// Tools (the server's own names) that always wait for approval.
    pub require_approval: Vec<String>,
    /// Tools (the server's own names) that never do, whatever their annotations say.
    pub skip_approval: Vec<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            command: None,
            args: vec![],
            env: BTreeMap::new(),
            cwd: None,
            url: None,
            headers_env: BTreeMap::new(),
            timeout: Duration::from_secs(60),
            startup_timeout: Duration::from_secs(30),
            max_output_bytes: 64 * 1024,
            max_concurrency: 4,
            approval: Approval::Annotations,
            require_approval: vec![],
            skip_approval: vec![],
        }
    }
}

/// Between a server's name and its tool's in the name the model sees: `git__status`.
/// Model APIs accept only letters, digits, `_` and `-` in a tool's name, so a dot is not
/// used; an agent file may still write `git.status`.
pub const SEPARATOR: &str = "__";

/// Longest name of a tool as the model sees it (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;

/// Checks a server's name: 1 to 32 ASCII letters, digits, `-` or `_`, without `__`.
pub fn validate_server_name(name: &str) -> Result<(), String> {
    const RULE: &str = "a server's name is 1 to 32 ASCII letters, digits, `-` or `_`, \
                        without `__`";
    if name.is_empty() || name.len() > 32 {
        return Err(format!("MCP server name `{}`: {RULE}", name.escape_debug()));
    }
    if name.contains(SEPARATOR)
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!("MCP server name `{}`: {RULE}", name.escape_debug()));
    }
    Ok(())
}

impl ServerConfig {
    /// What is wrong with this entry, if anything.
    pub fn check(&self, name: &str) -> Result<(), String> {
        validate_server_name(name)?;
        let at = format!("[mcp.servers.{name}]");
        match (&self.command, &self.url) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "{at}: set `command` (a stdio server) or `url` (Streamable HTTP), not both"
                ))
            }
            (None, None) => {
                return Err(format!(
                    "{at}: set `command` (a stdio server) or `url` (Streamable HTTP)"
                ))
            }
            (Some(c), None) if c.trim().is_empty() => {
                return Err(format!("{at}: `command` is empty"))
            }
            (None, Some(u)) => {
                if !(u.starts_with("http://") || u.starts_with("https://")) {
                    return Err(format!("{at}: `url` must start with http:// or https://"));
                }
                if !self.args.is_empty() || !self.env.is_empty() || self.cwd.is_some() {
                    return Err(format!(
                        "{at}: `args`, `env` and `cwd` are for a stdio server (`command`)"
                    ));
                }
            }
            (Some(_), None) => {
                if !self.headers_env.is_empty() {
                    return Err(format!(
                        "{at}: `headers_env` is for a Streamable HTTP server (`url`)"
                    ));
                }
            }
        }
        if self.max_concurrency == 0 {
            return Err(format!("{at}: `max_concurrency` must be at least 1"));
        }
        if self.timeout.is_zero() || self.startup_timeout.is_zero() {
            return Err(format!("{at}: timeouts must be longer than zero"));
        }
        if self.max_output_bytes < 256 {
            return Err(format!("{at}: `max_output_bytes` must be at least 256"));
        }
        Ok(())
    }
}
