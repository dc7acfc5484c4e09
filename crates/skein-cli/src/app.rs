//! What every command needs: the configuration, the agent catalogue, and a backend.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use skein_core::AgentSet;
use skein_llm::Registry;
use skein_runtime::worker::{Runtime, RuntimeConfig};
use skein_runtime::Backend;
use skein_sled::SledStore;
use skein_tools::ToolBox;

use crate::config::{self, SkeinConfig};
use crate::GlobalArgs;

pub struct App {
    pub global: GlobalArgs,
    pub cfg: SkeinConfig,
    /// The MCP servers of `[mcp]`, started by the first command that needs tools.
    pub mcp: std::sync::OnceLock<skein_mcp::McpTools>,
}

/// Reads every agent definition under `dir` as (file name, text), sorted: each `*.md` in
/// it, and each `NAME/agent.md` (the layout of the planner reference, one directory per
/// agent). A subdirectory holding Markdown files but no `agent.md` is refused with the
/// layout it should have, never skipped in silence. A file larger than an agent
/// definition may be ([`skein_core::agent::MAX_DEFINITION_BYTES`]) is refused without
/// being read whole.
pub fn read_agent_files(dir: &Path) -> Result<Vec<(String, String)>> {
    let mut files = vec![];
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the agents directory {}", dir.display()))?;
    for e in entries {
        let p = e?.path();
        if p.is_dir() {
            let inner = p.join("agent.md");
            if inner.is_file() {
                files.push((inner.display().to_string(), read_agent_file(&inner)?));
                continue;
            }
            let has_md = std::fs::read_dir(&p)
                .with_context(|| format!("cannot read {}", p.display()))?
                .filter_map(|e| e.ok())
                .any(|e| e.path().extension().is_some_and(|x| x == "md"));
            if has_md {
                anyhow::bail!(
                    "{}: an agent's directory holds its definition as `agent.md` (the layout \
                     `agents/NAME/agent.md`); rename the definition to agent.md, or move it \
                     up to {}/NAME.md",
                    p.display(),
                    dir.display()
                );
            }
        } else if p.extension().is_some_and(|x| x == "md") {
            files.push((p.display().to_string(), read_agent_file(&p)?));
        }
    }
    files.sort();
    Ok(files)
}

/// One agent definition file, at most [`skein_core::agent::MAX_DEFINITION_BYTES`].
pub fn read_agent_file(p: &Path) -> Result<String> {
    use std::io::Read;
    let max = skein_core::agent::MAX_DEFINITION_BYTES;
    let f = std::fs::File::open(p).with_context(|| format!("cannot read {}", p.display()))?;
    let mut bytes = Vec::new();
    f.take(max as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {}", p.display()))?;
    if bytes.len() > max {
        let size = std::fs::metadata(p)
            .map(|m| format!("{} bytes", m.len()))
            .unwrap_or_else(|_| format!("more than {max} bytes"));
        anyhow::bail!(
            "{}: the file is {size}; an agent definition may be at most {max} bytes (256 KiB)",
            p.display()
        );
    }
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", p.display()))
}

/// The MCP servers a command started are stopped when it ends, as the protocol asks (a
/// stdio server's input closed, then a kill if it lingers), so a server finishes what
/// it was told last (a cancelled call) instead of dying mid-way.
impl Drop for App {
    fn drop(&mut self) {
        let Some(mcp) = self.mcp.get().filter(|m| !m.servers.is_empty()) else {
            return;
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
            tokio::task::block_in_place(|| handle.block_on(mcp.close()));
        }
    }
}

impl App {
    pub fn new(global: GlobalArgs) -> Result<Self> {
        let source = config::Source::locate(global.config.clone());
        let mut cfg = config::load_from(&source)?;
        config::apply_nats_flags(&mut cfg.nats, &global);
        Ok(Self {
            global,
            cfg,
            mcp: std::sync::OnceLock::new(),
        })
    }

    pub fn tools(&self) -> Result<ToolBox> {
        let cfg: skein_tools::ToolsConfig = self
            .cfg
            .tools
            .clone()
            .try_into()
            .context("[tools] configuration")?;
        let mut tools = ToolBox::builtin(&cfg);
        for why in self.mcp_tools()?.add_to(&mut tools) {
            tracing::warn!("{why}");
        }
        Ok(tools)
    }

    /// The limits the decision rules run with: `[limits]`, plus every tool that asks for
    /// approval itself (an MCP server's tool that may change things), as
    /// [`Runtime::new`] adds them. Replay checks decisions with these.
    pub fn decision_limits(&self) -> Result<skein_core::Limits> {
        let tools = self.tools()?;
        let mut limits = self.cfg.limits.clone();
        for name in tools.names() {
            if tools.requires_approval(&name) && !limits.approval_required.contains(&name) {
                limits.approval_required.push(name);
            }
        }
        Ok(limits)
    }

    /// `[mcp]`, read.
    pub fn mcp_config(&self) -> Result<skein_mcp::McpConfig> {
        self.cfg
            .mcp
            .clone()
            .try_into()
            .context("[mcp] configuration")
    }

    /// The MCP servers, started once for the process (every server of `[mcp]` at once).
    /// A server that will not start is reported here (and by `/readyz` and `skein agents
    /// check`); its tools are not offered.
    pub fn mcp_tools(&self) -> Result<&skein_mcp::McpTools> {
        if let Some(m) = self.mcp.get() {
            return Ok(m);
        }
        let cfg = self.mcp_config()?;
        let started = if cfg.servers.is_empty() {
            skein_mcp::McpTools::default()
        } else {
            let handle = tokio::runtime::Handle::try_current()
                .context("MCP servers are started from within the command's runtime")?;
            anyhow::ensure!(
                handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread,
                "MCP servers need the multi-threaded runtime"
            );
            let m =
                tokio::task::block_in_place(|| handle.block_on(skein_mcp::McpTools::start(&cfg)));
            for (name, why) in &m.failed {
                tracing::warn!(server = %name, "MCP server will not start: {why}");
                crate::errln!("warning: MCP server `{name}` will not start: {why}");
            }
            m
        };
        Ok(self.mcp.get_or_init(|| started))
    }

    pub fn models(&self) -> Result<Registry> {
        let models: skein_llm::ModelsConfig = self
            .cfg
            .models
            .clone()
            .try_into()
            .context("[models] configuration")?;
        let registry = skein_llm::registry_with_scripts(&models, self.scripts())?;
        // Errors and diagnostics are scrubbed of the keys, as recorded events are.
        config::register_secrets(registry.known_secrets());
        Ok(registry)
    }

    /// Where the `scripted` model reads its scripts: `scripts_dir`, or the built-in demo's.
    pub fn scripts(&self) -> skein_llm::scripted::ScriptSource {
        use skein_llm::scripted::ScriptSource;
        if self.cfg.builtin_scripts {
            ScriptSource::Texts(crate::builtin::scripts())
        } else {
            ScriptSource::Dir(self.cfg.scripts_dir.clone())
        }
    }

    /// The agent definitions as (origin, text): every `*.md` of `agents_dir`, or the
    /// built-in demo's.
    pub fn agent_files(&self) -> Result<Vec<(String, String)>> {
        if self.cfg.builtin_agents {
            return Ok(crate::builtin::agent_files());
        }
        read_agent_files(&self.cfg.agents_dir)
    }

    pub fn agents(&self) -> Result<AgentSet> {
        let files = self.agent_files()?;
        if files.is_empty() {
            anyhow::bail!(
                "no agent definitions (*.md) in {}",
                self.cfg.agents_dir.display()
            );
        }
        Ok(AgentSet::load(&files, &[])?)
    }

    pub fn runtime_config(&self) -> Result<RuntimeConfig> {
        let mut rc = self.runtime_config_base()?;
        rc.token_secret = if self.global.nats.is_some() {
            // Every worker of a cluster must sign and check tokens with the same secret.
            let v = std::env::var("SKEIN_TOKEN_SECRET").map_err(|_| {
                anyhow::anyhow!(
                    "on NATS, set SKEIN_TOKEN_SECRET (the same value, 16+ characters, on \
                     every worker and client) so resume tokens verify everywhere"
                )
            })?;
            anyhow::ensure!(
                v.len() >= 16,
                "SKEIN_TOKEN_SECRET must be at least 16 characters"
            );
            skein_runtime::hitl::Secret(v.into_bytes())
        } else {
            skein_runtime::hitl::Secret::load_or_create("SKEIN_TOKEN_SECRET", &self.global.data)?
        };
        Ok(rc)
    }

    /// How long a claimed job is held without a heartbeat (`[runtime] lease`).
    fn lease(&self) -> Result<Duration> {
        skein_core::duration::parse_key("runtime.lease", &self.cfg.runtime.lease)
            .map_err(anyhow::Error::msg)
    }

    fn runtime_config_base(&self) -> Result<RuntimeConfig> {
        let r = &self.cfg.runtime;
        let lease = self.lease()?;
        let ttl = skein_core::duration::parse_key("cache.ttl", &self.cfg.cache.ttl)
            .map_err(anyhow::Error::msg)?;
        let mut rc = RuntimeConfig {
            limits: self.cfg.limits.clone(),
            lease,
            max_deliver: r.max_deliver,
            blob_threshold: r.blob_threshold,
            cache_ttl: (ttl > Duration::ZERO).then_some(ttl),
            state_cache: r.state_cache,
            delegation_batch: r.delegation_batch_on(self.global.nats.is_some()),
            ..RuntimeConfig::default()
        };
        if let Some(w) = &r.worker_id {
            rc.worker_id = w.clone();
        }
        rc.token_secret =
            skein_runtime::hitl::Secret::load_or_create("SKEIN_TOKEN_SECRET", &self.global.data)?;
        Ok(rc)
    }

    /// The embedded store under `--data`.
    pub fn open_embedded(&self) -> Result<(Arc<SledStore>, Backend)> {
        if self.global.nats.is_some() {
            anyhow::bail!("this command runs on the embedded store; drop --nats to use it");
        }
        let ws = self
            .cfg
            .workspace_dir
            .clone()
            .unwrap_or_else(|| self.global.data.join("workspaces"));
        let lease = self.lease()?;
        let store = SledStore::open_with_lease(&self.global.data, &ws, lease)
            .with_context(|| format!("cannot open the store in {}", self.global.data.display()))?;
        let backend = store.backend();
        Ok((store, backend))
    }

    /// The `[nats]` settings, with the connection flags (`--nats`, `--nats-user`, …) over
    /// them, and credentials written into the URLs moved to the login fields (the client
    /// would ignore them there). Every secret they hold is kept out of diagnostics from here
    /// on.
    pub fn nats_config(&self) -> Result<skein_nats::NatsConfig> {
        let mut c: skein_nats::NatsConfig = self
            .cfg
            .nats
            .clone()
            .try_into()
            .context("[nats] configuration")?;
        config::register_secrets(c.secrets());
        c.take_url_credentials();
        Ok(c)
    }

    /// Connects to the cluster named by `--nats`, or fails after [`CONNECT_LIMIT`] with
    /// what went wrong: a command someone waits for must not hang on a server that is not
    /// there.
    pub async fn nats(&self) -> Result<Arc<skein_nats::NatsStore>> {
        let lease = self.runtime_config_base()?.lease;
        let cfg = self.nats_config()?;
        let first = check_credentials(&cfg).await?;
        let connect = async {
            skein_nats::NatsStore::connect(&cfg, lease)
                .await
                .with_context(|| format!("cannot reach NATS at {}", cfg.shown_urls()))
        };
        tokio::pin!(connect);
        match tokio::time::timeout(CONNECT_LIMIT, &mut connect).await {
            Ok(r) => r,
            // A server answered, its JetStream not yet: after a node's loss the streams
            // it led elect new leaders, which takes seconds, and a command given then
            // should wait for them rather than fail.
            Err(_) if first.is_none() => {
                crate::errln!(
                    "NATS at {} answers but its JetStream does not yet (leaders being \
                     elected after a node's loss?): waiting up to {}s more",
                    cfg.shown_urls(),
                    ELECTION_LIMIT.as_secs()
                );
                match tokio::time::timeout(ELECTION_LIMIT, connect).await {
                    Ok(r) => r,
                    Err(_) => anyhow::bail!(
                        "NATS at {} answers but its JetStream did not within {}s; check the \
                         cluster's health (`nats server report jetstream`)",
                        cfg.shown_urls(),
                        (CONNECT_LIMIT + ELECTION_LIMIT).as_secs()
                    ),
                }
            }
            Err(_) => anyhow::bail!(
                "cannot reach NATS at {}: no connection within {}s ({}); check that the \
                 server runs and that --nats / SKEIN_NATS_URL names it",
                cfg.shown_urls(),
                CONNECT_LIMIT.as_secs(),
                first.unwrap_or_else(|| "its JetStream did not answer".into())
            ),
        }
    }

    /// Connects to the cluster named by `--nats`, waiting as long as it takes (a worker
    /// may start before its server); only refused credentials fail at once.
    pub async fn nats_patient(&self) -> Result<Arc<skein_nats::NatsStore>> {
        let lease = self.runtime_config_base()?.lease;
        let cfg = self.nats_config()?;
        if let Some(e) = check_credentials(&cfg).await? {
            tracing::warn!(error = %e, urls = %cfg.shown_urls(),
                "cannot reach NATS yet; trying until it answers");
        }
        skein_nats::NatsStore::connect(&cfg, lease)
            .await
            .with_context(|| format!("cannot reach NATS at {}", cfg.shown_urls()))
    }

    /// A backend for read commands: embedded, or the cluster with `--nats`.
    pub async fn backend(&self) -> Result<(Option<Arc<SledStore>>, Backend)> {
        if self.global.nats.is_some() {
            return Ok((None, self.nats().await?.backend()));
        }
        let (s, b) = self.open_embedded()?;
        Ok((Some(s), b))
    }

    pub fn runtime(&self, backend: Backend) -> Result<Arc<Runtime>> {
        let agents = Arc::new(self.agents()?);
        Ok(Runtime::new(
            backend,
            agents,
            self.models()?,
            self.tools()?,
            self.runtime_config()?,
        ))
    }
}

/// How long a command other than `skein worker` tries to reach NATS.
pub const CONNECT_LIMIT: Duration = Duration::from_secs(10);
/// How much longer it waits where a server answered but its JetStream did not (yet).
pub const ELECTION_LIMIT: Duration = Duration::from_secs(30);

/// One connection attempt with the configured credentials. The store's own connection
/// retries forever (a worker may start before its server), so a server that refuses the
/// credentials would leave a command waiting; this turns that into an error naming what
/// to pass. Any other failure, or a server without JetStream, is returned as text (and a
/// command then gives up at [`CONNECT_LIMIT`]); the store's connection retries.
async fn check_credentials(c: &skein_nats::NatsConfig) -> Result<Option<String>> {
    use async_nats::ConnectErrorKind;
    let (opts, urls, given) = skein_nats::backend::connect_options(c).await?;
    match opts.connect(urls).await {
        Ok(client) => {
            // A server without JetStream says so when it connects: its commands would
            // wait for nothing, so they take the shorter limit.
            let jetstream = client.server_info().jetstream;
            let _ = client.drain().await;
            Ok((!jetstream).then(|| {
                "the server runs without JetStream: start it with -js (or a jetstream block)"
                    .to_string()
            }))
        }
        Err(e)
            if matches!(
                e.kind(),
                ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication
            ) =>
        {
            let what = if given {
                "refused the credentials given"
            } else {
                "requires credentials and none were given"
            };
            anyhow::bail!(
                "NATS at {} {what} ({e}): pass --nats-user with --nats-password, \
                 --nats-token or --nats-creds (or SKEIN_NATS_USER/SKEIN_NATS_PASSWORD, \
                 SKEIN_NATS_TOKEN, SKEIN_NATS_CREDS, or `[nats]` in the config)",
                c.shown_urls()
            )
        }
        Err(e) => Ok(Some(config::scrub(&e.to_string()))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::read_agent_files;

    #[test]
    fn an_agents_directory_per_agent_loads_and_one_without_agent_md_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let agents = dir.path();
        std::fs::write(agents.join("writer.md"), "w").unwrap();
        std::fs::create_dir_all(agents.join("planner")).unwrap();
        std::fs::write(agents.join("planner/agent.md"), "p").unwrap();
        // A directory with no Markdown in it (a scratch dir, say) is not an agent's.
        std::fs::create_dir_all(agents.join("notes")).unwrap();
        std::fs::write(agents.join("notes/todo.txt"), "t").unwrap();
        let files = read_agent_files(agents).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|(p, _)| {
                p.trim_start_matches(&agents.display().to_string())
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["/planner/agent.md", "/writer.md"]);
        std::fs::create_dir_all(agents.join("reviewer")).unwrap();
        std::fs::write(agents.join("reviewer/reviewer.md"), "r").unwrap();
        let e = read_agent_files(agents).unwrap_err().to_string();
        assert!(
            e.contains("reviewer: an agent's directory holds its definition as `agent.md`"),
            "{e}"
        );
    }
}
