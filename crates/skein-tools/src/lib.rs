//! skein-tools: the built-in tools agents call, and the sandboxing that keeps a model in
//! its box. The runtime asks a [`ToolBox`] for the schemas a model sees and to run a call;
//! tools that steer the runtime itself (`call_agent`, `ask_user`, …) are handled by the
//! runtime, not here. This crate never depends on the runtime or on a message broker.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;
use skein_core::{SessionId, ToolSpec};

pub mod files;
pub mod workspace;

pub use workspace::{LocalWorkspace, Workspace};

/// What a tool gets to work with.
#[derive(Clone)]
pub struct ToolContext {
    pub session: SessionId,
    pub workspace: Arc<dyn Workspace>,
}

/// A tool failure the model is shown as a tool error.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Failed(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

/// One built-in tool.
#[async_trait]
pub trait Tool: Send + Sync {
    fn name(&self) -> &str;
    fn description(&self) -> &str;
    /// JSON Schema of the arguments object: what the model sees.
    fn parameters(&self) -> Value;
    /// May run at the same time as other tools of the same turn.
    fn parallel(&self) -> bool {
        true
    }
    /// Safe to run again when a crash hid its outcome.
    fn idempotent(&self) -> bool {
        false
    }
    fn requires_approval(&self) -> bool {
        false
    }
    fn timeout(&self) -> Duration {
        Duration::from_secs(30)
    }
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<String, ToolError>;
}

/// The outcome of one run, as recorded in `ToolReturned`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    pub output: String,
    pub error: bool,
    pub ms: u64,
}

/// Tools by name.
#[derive(Clone, Default)]
pub struct ToolBox {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

/// Settings of the built-in tools (`[tools]` in config).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {}

impl ToolBox {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every built-in tool, configured.
    pub fn builtin(_cfg: &ToolsConfig) -> Self {
        let mut b = Self::new();
        b.insert(Arc::new(files::ListDir));
        b.insert(Arc::new(files::ReadFile));
        b.insert(Arc::new(files::WriteFile));
        b
    }

    pub fn insert(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.name().to_string(), tool);
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    pub fn names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }

    pub fn spec(&self, name: &str) -> Option<ToolSpec> {
        self.tools.get(name).map(|t| ToolSpec {
            name: t.name().to_string(),
            description: t.description().to_string(),
            parameters: t.parameters(),
        })
    }

    pub fn idempotent(&self, name: &str) -> bool {
        self.tools.get(name).is_some_and(|t| t.idempotent())
    }

    pub fn parallel(&self, name: &str) -> bool {
        self.tools.get(name).is_some_and(|t| t.parallel())
    }

    /// Runs a tool with its timeout. Never panics and never fails: every problem is a
    /// tool error the model reads.
    pub async fn run(&self, ctx: &ToolContext, name: &str, args: &Value) -> ToolOutcome {
        let started = Instant::now();
        let Some(tool) = self.tools.get(name) else {
            return ToolOutcome {
                output: format!("unknown tool `{name}`"),
                error: true,
                ms: 0,
            };
        };
        let limit = tool.timeout();
        let result = match tokio::time::timeout(limit, tool.call(ctx, args.clone())).await {
            Ok(r) => r,
            Err(_) => Err(ToolError::Timeout(limit)),
        };
        let ms = started.elapsed().as_millis() as u64;
        match result {
            Ok(output) => ToolOutcome {
                output,
                error: false,
                ms,
            },
            Err(e) => ToolOutcome {
                output: format!("{name}: {e}"),
                error: true,
                ms,
            },
        }
    }
}
