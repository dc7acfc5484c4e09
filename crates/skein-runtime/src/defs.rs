//! The versions of definitions a worker runs sessions on. A worker starts with its own
//! files (the embedded default); a cluster may hold pushed versions (a
//! [`skein_core::Definitions`] stored in the blob store under its digest), one of them
//! current. A tree is pinned to the version current when its root was submitted (the
//! `defs` of its `Submitted`): each of its sessions runs on that version, whichever worker
//! takes the step and whatever is current by then.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use skein_core::{AgentSet, Definitions, SessionState};
use skein_llm::scripted::{ScriptSource, ScriptedProvider};
use skein_llm::Registry;

use crate::runtime::{lock, Runtime};
use crate::{Error, Result};

/// One version in force on this worker: its agents and the models its sessions call
/// (the worker's providers, with the version's scripts for `scripted`).
pub struct Version {
    /// None: the worker's own files.
    pub digest: Option<String>,
    pub agents: Arc<AgentSet>,
    pub models: Registry,
    /// The `[limits]` its trees decide under: the version's, else the worker's own.
    pub limits: skein_core::Limits,
    /// [`skein_core::hash::RunShape::limits_digest`] of `limits`.
    pub limits_digest: String,
}

/// The local version, the cluster's current one, and every pushed version read so far.
#[derive(Default)]
pub struct Catalogue {
    local: Option<Arc<Version>>,
    current: RwLock<Option<Arc<Version>>>,
    read: Mutex<HashMap<String, Arc<Version>>>,
}

impl Catalogue {
    pub(crate) fn new(agents: Arc<AgentSet>, models: Registry, limits: skein_core::Limits) -> Self {
        Self {
            local: Some(Arc::new(Version {
                digest: None,
                agents,
                models,
                limits: limits.clone(),
                limits_digest: skein_core::hash::RunShape::limits_digest(&limits),
            })),
            ..Default::default()
        }
    }
}

impl Runtime {
    fn local_version(&self) -> Arc<Version> {
        match &self.defs.local {
            Some(v) => v.clone(),
            None => Arc::new(Version {
                digest: None,
                agents: self.agents.clone(),
                models: self.models.clone(),
                limits: self.cfg.limits.clone(),
                limits_digest: skein_core::hash::RunShape::limits_digest(&self.cfg.limits),
            }),
        }
    }

    /// The version new trees are pinned to: the cluster's current one, else the worker's
    /// own files.
    pub fn current_version(&self) -> Arc<Version> {
        let current = self
            .defs
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        current.unwrap_or_else(|| self.local_version())
    }

    /// Makes `digest` the version new trees are pinned to (None: back to the worker's
    /// own files). The version is read and checked first: one that cannot be used leaves
    /// the current one in force.
    pub async fn set_current_version(&self, digest: Option<&str>) -> Result<Arc<Version>> {
        let v = match digest {
            Some(d) => self.version(d).await?,
            None => self.local_version(),
        };
        *self.defs.current.write().unwrap_or_else(|p| p.into_inner()) = digest.map(|_| v.clone());
        Ok(v)
    }

    /// The version a session runs on: the one its tree was pinned to.
    pub async fn version_of(&self, state: &SessionState) -> Result<Arc<Version>> {
        match state.submitted.as_ref().and_then(|s| s.defs.as_deref()) {
            Some(d) => self.version(d).await,
            None => Ok(self.local_version()),
        }
    }

    /// The agents a session's decisions see (who it may call, with which settings).
    pub async fn agents_of(&self, state: &SessionState) -> Result<Arc<AgentSet>> {
        Ok(self.version_of(state).await?.agents.clone())
    }

    /// A pushed version, read from the blob store once per process.
    pub async fn version(&self, digest: &str) -> Result<Arc<Version>> {
        if let Some(v) = lock(&self.defs.read).get(digest) {
            return Ok(v.clone());
        }
        let bytes = self.backend.blobs.get(digest).await?.ok_or_else(|| {
            // Named by a record or by the current pointer, so it was stored first: a
            // store that answers "absent" cannot answer yet, and the step is tried again.
            Error::unavailable_because(format!(
                "definitions version {digest} is not in the blob store"
            ))
        })?;
        let defs = Definitions::decode(&bytes)?;
        if blake3::hash(&bytes).to_hex().as_str() != digest {
            return Err(Error::corrupt_because(format!(
                "definitions version {digest}: its bytes do not hash to its name"
            )));
        }
        let agents = Arc::new(defs.agent_set(&[])?);
        let mut models = self.models.clone();
        if !defs.scripts.is_empty() {
            models.insert(
                "scripted",
                Arc::new(ScriptedProvider::from_source(ScriptSource::Texts(
                    defs.scripts.clone(),
                ))),
            );
        }
        if defs.default_provider.is_some() {
            models.set_default_provider(defs.default_provider.clone());
        }
        let limits = match defs.limits {
            Some(mut l) => {
                // A tool that asks for a person's approval gets it whatever they say.
                for name in self.tools.names() {
                    if self.tools.requires_approval(&name) && !l.approval_required.contains(&name) {
                        l.approval_required.push(name);
                    }
                }
                l
            }
            None => self.cfg.limits.clone(),
        };
        let v = Arc::new(Version {
            digest: Some(digest.to_string()),
            agents,
            models,
            limits_digest: skein_core::hash::RunShape::limits_digest(&limits),
            limits,
        });
        lock(&self.defs.read).insert(digest.to_string(), v.clone());
        Ok(v)
    }
}

impl Runtime {
    /// [`Runtime::version_of`] for the steps of a drive, which reads the session's version
    /// (and so has it in memory) before it decides anything: versions read are never
    /// forgotten. A version not read yet, which no step meets, would be the worker's own.
    pub(crate) fn version_known(&self, state: &SessionState) -> Arc<Version> {
        match state.submitted.as_ref().and_then(|s| s.defs.as_deref()) {
            Some(d) => match lock(&self.defs.read).get(d) {
                Some(v) => v.clone(),
                None => {
                    tracing::error!(defs = d, "a step met a definitions version not read yet");
                    self.local_version()
                }
            },
            None => self.local_version(),
        }
    }
}

/// Something a session's step needs that a worker may lack.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Need {
    /// An agent the session may start (a tree on the workers' own files, where workers
    /// may have different agents).
    Agent(String),
    /// The model provider of the session's agent.
    Provider(String),
    /// A tool of the session's agent (one of the worker's tool box, not the runtime's).
    Tool(String),
    /// An MCP server whose tools the session's agent lists (`SERVER__TOOL`).
    Mcp(String),
}

impl std::fmt::Display for Need {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Need::Agent(a) => write!(f, "the agent `{a}`"),
            Need::Provider(p) => write!(f, "the model provider `{p}`"),
            Need::Tool(t) => write!(f, "the tool `{t}`"),
            Need::Mcp(m) => write!(f, "the MCP server `{m}`"),
        }
    }
}

impl Need {
    /// A short label for metrics: `agent:NAME`, `provider:NAME`, `tool:NAME`, `mcp:NAME`.
    pub fn label(&self) -> String {
        match self {
            Need::Agent(a) => format!("agent:{a}"),
            Need::Provider(p) => format!("provider:{p}"),
            Need::Tool(t) => format!("tool:{t}"),
            Need::Mcp(m) => format!("mcp:{m}"),
        }
    }

    /// Whether a worker that advertises `offer` has this need, for a tree pinned to
    /// `defs` (none: the workers' own files). A pushed version's agents are the same on
    /// every worker; what a worker does not say (an earlier release advertises no tools)
    /// it may have.
    pub fn met_by(&self, defs: Option<&str>, offer: &Offer) -> bool {
        match self {
            Need::Agent(a) => defs.is_some() || offer.agents.iter().any(|x| x == a),
            Need::Provider(p) => offer.providers.iter().any(|x| x == p),
            Need::Tool(t) => offer
                .tools
                .as_ref()
                .is_none_or(|v| v.iter().any(|x| x == t)),
            Need::Mcp(m) => offer.mcp.as_ref().is_none_or(|v| v.iter().any(|x| x == m)),
        }
    }
}

/// What a worker has that a session may need: its own agents, its model providers, its
/// tools and MCP servers (None: not said, as by an earlier release).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Offer {
    pub agents: Vec<String>,
    pub providers: Vec<String>,
    pub tools: Option<Vec<String>>,
    pub mcp: Option<Vec<String>>,
}

/// The other live workers of a cluster, as they advertise themselves.
#[async_trait::async_trait]
pub trait Peers: Send + Sync {
    /// Whether another live worker has `need` (for a tree pinned to `defs`, or on its own
    /// files when `defs` is none).
    async fn served_elsewhere(&self, need: &Need, defs: Option<&str>) -> Result<bool>;
}

/// What this worker handed back for want of something, for `/readyz`.
#[derive(Default)]
pub struct Lacks {
    peers: std::sync::OnceLock<Arc<dyn Peers>>,
    seen: Mutex<std::collections::BTreeMap<Need, (u64, u64)>>,
}

/// Deliveries of a job nobody can serve before its session is failed with the reason
/// (the first ones leave time for a worker that is starting to advertise itself).
pub const UNSERVED_DELIVERIES: u32 = 3;

impl Runtime {
    /// Lets this worker hand work it cannot do to the `peers` that can.
    pub fn set_peers(&self, peers: Arc<dyn Peers>) {
        let _ = self.lacks.peers.set(peers);
    }

    /// What this worker lacks and handed work back for: (need, times, last at ms).
    pub fn lacking(&self) -> Vec<(Need, u64, u64)> {
        lock(&self.lacks.seen)
            .iter()
            .map(|(n, (times, at))| (n.clone(), *times, *at))
            .collect()
    }

    /// What a session's steps need that this worker lacks: an agent it may start (on the
    /// workers' own files only: a pushed version is the same everywhere), its model's
    /// provider, or a tool or MCP server its agent lists.
    pub async fn lacks(&self, state: &SessionState) -> Result<Option<Need>> {
        let def = self.def_for(state).await?;
        let version = self.version_of(state).await?;
        // A custom agent is made at run time by its caller's session, not read from files.
        let custom = state
            .submitted
            .as_ref()
            .is_some_and(|s| s.parent.is_some() && s.agent == "custom" && def.name() == "custom");
        if version.digest.is_none() && !custom && version.agents.get(def.name()).is_none() {
            // Its own agent, with its scripts and settings, is another worker's.
            return Ok(Some(Need::Agent(def.name().to_string())));
        }
        if version.digest.is_none() {
            if let Some(a) = def
                .starts()
                .into_iter()
                .find(|a| version.agents.get(a).is_none())
            {
                return Ok(Some(Need::Agent(a.to_string())));
            }
        }
        if let Ok((provider, _)) = version.models.resolve(&def.front.model) {
            if !version.models.has(provider) {
                return Ok(Some(Need::Provider(provider.to_string())));
            }
        }
        Ok(self.lacks_tool(&def))
    }

    /// The first MCP server or tool of `def` (its `mcp` and its `tools`) this worker's
    /// tool box lacks; the runtime's own tools every worker has.
    fn lacks_tool(&self, def: &skein_core::AgentDef) -> Option<Need> {
        let names = self.tools.names();
        let has_server = |server: &str| {
            let prefix = format!("{server}{}", skein_core::agent::MCP_SEPARATOR);
            names.iter().any(|n| n.starts_with(&prefix))
        };
        if let Some(server) = def.front.mcp.iter().find(|s| !has_server(s)) {
            return Some(Need::Mcp(server.clone()));
        }
        for t in &def.front.tools {
            if skein_core::runtime_tool::RuntimeTool::parse(t).is_some() {
                continue;
            }
            if let Some(server) = skein_core::agent::mcp_server_of(t) {
                if !has_server(server) {
                    return Some(Need::Mcp(server.to_string()));
                }
            } else if self.tools.get(t).is_none() {
                return Some(Need::Tool(t.clone()));
            }
        }
        None
    }

    /// What this worker has that a session may need (what it advertises).
    pub fn offer(&self) -> Offer {
        let tools = self.tools.names();
        let mut mcp: Vec<String> = tools
            .iter()
            .filter_map(|t| skein_core::agent::mcp_server_of(t).map(str::to_string))
            .collect();
        mcp.sort();
        mcp.dedup();
        Offer {
            agents: self.agents.agents.keys().cloned().collect(),
            providers: self
                .models
                .names()
                .into_iter()
                .map(str::to_string)
                .collect(),
            tools: Some(tools),
            mcp: Some(mcp),
        }
    }

    /// Whether another live worker has `need`; false when this worker knows of no others
    /// (one process, or no peers given).
    pub async fn served_elsewhere(&self, need: &Need, defs: Option<&str>) -> bool {
        let Some(peers) = self.lacks.peers.get() else {
            return false;
        };
        match peers.served_elsewhere(need, defs).await {
            Ok(yes) => yes,
            Err(e) => {
                // Unknown: hand back, and let the bound decide.
                tracing::warn!(error = %e.report(), "cannot read which workers are live");
                true
            }
        }
    }

    /// Counts a hand-back for want of `need`.
    pub fn handed_back_for(&self, need: &Need) {
        crate::metrics::job_lacking(&need.label());
        let now = self.cfg.clock.now_ms();
        let mut seen = lock(&self.lacks.seen);
        let e = seen.entry(need.clone()).or_insert((0, now));
        e.0 += 1;
        e.1 = now;
    }

    /// Whether this worker knows of other workers at all (a cluster worker does).
    pub fn has_peers(&self) -> bool {
        self.lacks.peers.get().is_some()
    }
}
