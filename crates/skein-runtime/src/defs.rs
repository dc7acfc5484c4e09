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
}

/// The local version, the cluster's current one, and every pushed version read so far.
#[derive(Default)]
pub struct Catalogue {
    local: Option<Arc<Version>>,
    current: RwLock<Option<Arc<Version>>>,
    read: Mutex<HashMap<String, Arc<Version>>>,
}

impl Catalogue {
    pub(crate) fn new(agents: Arc<AgentSet>, models: Registry) -> Self {
        Self {
            local: Some(Arc::new(Version {
                digest: None,
                agents,
                models,
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
        let v = Arc::new(Version {
            digest: Some(digest.to_string()),
            agents,
            models,
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
