//! skein-tools: the built-in tools agents call, and the sandboxing that keeps a model in
//! its box. The runtime asks a [`ToolBox`] for the schemas a model sees and to run a call;
//! tools that steer the runtime itself (`call_agent`, `ask_user`, …) are handled by the
//! runtime, not here. This crate never depends on the runtime or on a message broker.
//!
//! Every argument object is checked against the tool's JSON Schema ([`schema`]) before the
//! tool runs; files stay inside the tree's [`Workspace`]; `http_fetch` refuses private and
//! metadata addresses after DNS resolution ([`net`]); `shell` is off unless configured.
//! See `docs/tools.md` for the rules and the `[tools]` settings.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use async_trait::async_trait;
use serde_json::Value;
use skein_core::{SessionId, ToolSpec};

pub mod config;
pub mod files;
pub mod http;
pub mod net;
pub mod schema;
pub mod search;
pub mod shell;
mod text;
pub mod workspace;

pub use config::{Cidr, FilesConfig, HttpConfig, SearchConfig, ShellConfig, ToolsConfig};
pub use workspace::{DirEntry, FilePart, LocalWorkspace, Usage, Walk, Workspace};

/// What a tool gets to work with.
#[derive(Clone)]
pub struct ToolContext {
    pub session: SessionId,
    pub workspace: Arc<dyn Workspace>,
    /// Where a tool may keep binary results (an MCP server's images), when the caller
    /// offers a store.
    pub blobs: Option<Arc<dyn skein_ports::ports::Blobs>>,
    /// Where a long call tells how far it has got (an MCP server's progress
    /// notifications), when someone watches: shown live, never recorded.
    pub progress: Option<ProgressSink>,
}

/// Takes a tool's name and a line saying how far its call has got (`3/10 copying`).
pub type ProgressSink = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Tools whose list may change while the process runs (an MCP server's, after it says
/// its list changed).
#[async_trait]
pub trait ToolSource: Send + Sync {
    /// Names of the tools offered now.
    fn names(&self) -> Vec<String>;
    /// Whether `name` is offered now.
    fn offers(&self, name: &str) -> bool {
        self.names().iter().any(|n| n == name)
    }
    /// A tool by name: one offered now, or one offered before, whose call then says why
    /// it does not run.
    fn get(&self, name: &str) -> Option<Arc<dyn Tool>>;
    /// Reads the list again where it was said to have changed.
    async fn refresh(&self);
}

pub use skein_ports::workspace::ToolError;

/// A `Result` whose error is a [`ToolError`].
pub type Result<T, E = ToolError> = std::result::Result<T, E>;

/// One built-in tool.
#[async_trait]
pub trait Tool: Send + Sync {
    fn name(&self) -> &str;
    fn description(&self) -> &str;
    /// JSON Schema of the arguments object: what the model sees, and what
    /// [`ToolBox::run`] checks the arguments against before [`Tool::call`].
    fn parameters(&self) -> Value;
    /// [`Tool::parameters`], shared: what [`ToolBox`] offers a model at every turn. A tool
    /// that keeps its schema shared gives it without a copy.
    fn schema(&self) -> Arc<Value> {
        Arc::new(self.parameters())
    }
    /// May run at the same time as other tools of the same turn.
    fn parallel(&self) -> bool {
        true
    }
    /// Safe to run again when a crash hid its outcome.
    fn idempotent(&self) -> bool {
        false
    }
    /// A person must approve each call before it runs.
    fn requires_approval(&self) -> bool {
        false
    }
    /// How long [`ToolBox::run`] lets a call take.
    fn timeout(&self) -> Duration {
        Duration::from_secs(30)
    }
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<String>;
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The outcome of one run, as recorded in `ToolReturned`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    pub output: String,
    pub error: bool,
    pub ms: u64,
}

/// Tools by name: a fixed table, and sources whose lists may change.
#[derive(Clone, Default)]
pub struct ToolBox {
    tools: BTreeMap<String, Fixed>,
    sources: Vec<Arc<dyn ToolSource>>,
}

/// A tool of the fixed table, with its schema: derived once when the tool is added, not
/// on every turn that offers it and every call that checks its arguments.
#[derive(Clone)]
struct Fixed {
    tool: Arc<dyn Tool>,
    parameters: Arc<Value>,
}

impl ToolBox {
    pub fn new() -> Self {
        Self::default()
    }

    /// The built-in tools `cfg` enables: the workspace file tools always, `http_fetch`
    /// unless `tools.http.enabled = false`, `shell` only with `tools.shell.enabled = true`.
    /// Enabling `shell` also makes the whole process non-dumpable (Linux), so a command
    /// run as the same user cannot read its `/proc/PID/environ` or memory.
    pub fn builtin(cfg: &ToolsConfig) -> Self {
        let mut b = Self::new();
        b.insert(Arc::new(files::ListDir::new(cfg.files.clone())));
        b.insert(Arc::new(files::ListDir::named(
            cfg.files.clone(),
            "list_directory",
        )));
        b.insert(Arc::new(files::GetFileInfo::new(cfg.files.clone())));
        b.insert(Arc::new(files::ReadFile::new(cfg.files.clone())));
        b.insert(Arc::new(files::WriteFile::new(cfg.files.clone())));
        b.insert(Arc::new(search::SearchFiles::new(cfg.search.clone())));
        if cfg.http.enabled {
            b.insert(Arc::new(http::HttpFetch::new(cfg.http.clone())));
        }
        if cfg.shell.enabled {
            // A command runs as this process's user: keep it from reading this process's
            // environment and memory through /proc.
            if let Err(e) = shell::forbid_same_user_inspection() {
                tracing::warn!(
                    error = %e,
                    "shell is enabled but this process could not be made non-dumpable; \
                     a command may read its environment through /proc"
                );
            }
            b.insert(Arc::new(shell::Shell::new(cfg.shell.clone())));
        }
        b
    }

    /// Adds (or replaces) a tool. A schema using keywords the validator does not know is
    /// logged: those keywords would not be enforced.
    pub fn insert(&mut self, tool: Arc<dyn Tool>) {
        let parameters = tool.schema();
        if let Err(e) = schema::check_schema(&parameters) {
            tracing::warn!(tool = tool.name(), error = %e, "tool schema is only partly enforced");
        }
        self.tools
            .insert(tool.name().to_string(), Fixed { tool, parameters });
    }

    /// A tool and its schema: the fixed table's as derived when it was added, a source's
    /// as the tool gives it now (its list may have changed). With `offered`, only a tool a
    /// source offers now; without, also one it offered before, as [`ToolBox::get`].
    fn with_schema(&self, name: &str, offered: bool) -> Option<(Arc<dyn Tool>, Arc<Value>)> {
        if let Some(f) = self.tools.get(name) {
            return Some((f.tool.clone(), f.parameters.clone()));
        }
        let tool = self
            .sources
            .iter()
            .filter(|s| !offered || s.offers(name))
            .find_map(|s| s.get(name))?;
        let parameters = tool.schema();
        Some((tool, parameters))
    }

    /// Adds tools whose list may change; a name of the fixed table comes first.
    pub fn add_source(&mut self, source: Arc<dyn ToolSource>) {
        self.sources.push(source);
    }

    /// Reads again the lists of the sources that were told theirs changed.
    pub async fn refresh(&self) {
        for s in &self.sources {
            s.refresh().await;
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools
            .get(name)
            .map(|f| f.tool.clone())
            .or_else(|| self.sources.iter().find_map(|s| s.get(name)))
    }

    /// Every tool offered now, by name.
    pub fn names(&self) -> Vec<String> {
        if self.sources.is_empty() {
            return self.tools.keys().cloned().collect();
        }
        let mut all: std::collections::BTreeSet<String> = self.tools.keys().cloned().collect();
        for s in &self.sources {
            all.extend(s.names());
        }
        all.into_iter().collect()
    }

    /// What a model is shown of a tool offered now.
    pub fn spec(&self, name: &str) -> Option<ToolSpec> {
        self.with_schema(name, true)
            .map(|(t, parameters)| ToolSpec {
                name: t.name().to_string(),
                description: t.description().to_string(),
                parameters,
            })
    }

    /// Every tool's spec, by name.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.names().iter().filter_map(|n| self.spec(n)).collect()
    }

    pub fn idempotent(&self, name: &str) -> bool {
        self.get(name).is_some_and(|t| t.idempotent())
    }

    pub fn parallel(&self, name: &str) -> bool {
        self.get(name).is_some_and(|t| t.parallel())
    }

    /// Whether the tool asks a person first (`shell` does).
    pub fn requires_approval(&self, name: &str) -> bool {
        self.get(name).is_some_and(|t| t.requires_approval())
    }

    /// Checks the arguments against the tool's schema, then runs it with its timeout.
    /// A panicking tool is a [`ToolError::Failed`], not a panic of the caller.
    pub async fn try_run(&self, ctx: &ToolContext, name: &str, args: &Value) -> Result<String> {
        let Some((tool, parameters)) = self.with_schema(name, false) else {
            return Err(ToolError::Refused(format!("unknown tool `{name}`")));
        };
        // A model that sends no arguments at all means "none".
        let args = match args {
            Value::Null => Value::Object(Default::default()),
            a => a.clone(),
        };
        schema::validate(&parameters, &args)
            .map_err(|errs| ToolError::InvalidArgs(errs.join("; ")))?;
        let limit = tool.timeout();
        let ctx = ctx.clone();
        let mut task = tokio::spawn(async move { tool.call(&ctx, args).await });
        // A caller that stops waiting (its step abandoned at the session's deadline, or
        // its session cancelled) stops the call too: an MCP server is told so.
        let _stop = AbortOnDrop(task.abort_handle());
        match tokio::time::timeout(limit, &mut task).await {
            Ok(Ok(r)) => r,
            Ok(Err(join)) => Err(ToolError::Failed(if join.is_panic() {
                "the tool crashed".into()
            } else {
                "the tool was cancelled".into()
            })),
            Err(_) => {
                task.abort();
                Err(ToolError::Timeout(limit))
            }
        }
    }

    /// Runs a tool like [`ToolBox::try_run`]. Never panics and never fails: every problem
    /// is a tool error the model reads, prefixed with the tool's name.
    pub async fn run(&self, ctx: &ToolContext, name: &str, args: &Value) -> ToolOutcome {
        let started = Instant::now();
        let result = self.try_run(ctx, name, args).await;
        let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
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
