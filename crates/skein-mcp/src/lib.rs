//! skein-mcp: agents use the tools of Model Context Protocol servers.
//!
//! [`protocol`] holds the messages (revision 2025-06-18; 2025-03-26 accepted), [`client`]
//! a connection over stdio or Streamable HTTP and the [`client::Server`] a worker keeps,
//! [`tool`] a server's tool as a skein [`skein_tools::Tool`], and [`config`] the
//! `[mcp.servers.NAME]` table. [`McpTools::start`] starts every configured server, and
//! [`McpTools::add_to`] offers their tools in a [`skein_tools::ToolBox`], a list that
//! follows the servers' changes. See docs/mcp.md.

use std::sync::Arc;

pub mod client;
pub mod config;
pub mod protocol;
pub mod tool;

pub use client::{Connection, McpError, Server};
pub use config::{Approval, McpConfig, ServerConfig, SEPARATOR};
pub use tool::{McpSource, McpTool};

/// The servers a worker started.
#[derive(Default, Clone)]
pub struct McpTools {
    pub servers: Vec<Arc<Server>>,
    /// Servers that would not start, with why.
    pub failed: Vec<(String, String)>,
}

impl McpTools {
    /// Starts every server of `cfg` at once. A server that fails is listed in
    /// [`McpTools::failed`]; the others are kept.
    pub async fn start(cfg: &McpConfig) -> Self {
        let started =
            futures::future::join_all(cfg.servers.iter().map(|(name, c)| async move {
                (name.clone(), Server::start(name, c.clone()).await)
            }))
            .await;
        let mut out = Self::default();
        for (name, r) in started {
            match r {
                Ok(s) => out.servers.push(s),
                Err(e) => out.failed.push((name, e.to_string())),
            }
        }
        out
    }

    /// Offers the tools of every started server in `tools`, as a list that follows each
    /// server's `notifications/tools/list_changed` ([`tool::McpSource`]); returns why
    /// some are not offered (a name a model would not accept).
    pub fn add_to(&self, tools: &mut skein_tools::ToolBox) -> Vec<String> {
        let (source, skipped) = tool::McpSource::new(self.servers.clone());
        tools.add_source(Arc::new(source));
        skipped
    }

    /// Why a server is not usable now: it would not start, or it died and could not be
    /// started again.
    pub fn problems(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .failed
            .iter()
            .map(|(n, why)| format!("MCP server `{n}` will not start: {why}"))
            .collect();
        out.extend(self.servers.iter().filter_map(|s| {
            s.problem().map(|why| {
                format!(
                    "MCP server `{}` died and will not start again: {why}",
                    s.name
                )
            })
        }));
        out
    }

    /// Names of every tool offered, as agents know them.
    pub fn tool_names(&self) -> Vec<String> {
        self.servers
            .iter()
            .flat_map(|s| {
                s.tools()
                    .into_iter()
                    .filter_map(|t| tool::exposed_name(&s.name, &t.name).ok())
            })
            .collect()
    }

    /// Stops every server, all at once: a stdio server's input is closed and it is given
    /// two seconds to exit before it is killed; an HTTP session is ended.
    pub async fn close(&self) {
        futures::future::join_all(self.servers.iter().map(|s| s.close())).await;
    }
}
