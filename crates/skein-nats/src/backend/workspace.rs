//! Workspaces in the object store `skein_workspace`, objects `<root>/<path>`.

use std::sync::Arc;

use async_nats::jetstream::object_store;
use async_trait::async_trait;
use futures::StreamExt;
use skein_core::SessionId;
use skein_runtime::ports::Workspaces;
use skein_tools::workspace::DirEntry;
use skein_tools::{ToolError, Usage, Workspace};
use tokio::io::AsyncReadExt;

use super::NatsStore;

impl Workspaces for NatsStore {
    fn for_tree(&self, root: &SessionId) -> Arc<dyn Workspace> {
        if let Some(dir) = &self.cfg.workspace_dir {
            return Arc::new(skein_tools::workspace::LocalWorkspace::new(
                dir.join(root.as_str()),
            ));
        }
        Arc::new(ObjectWorkspace {
            store: self.workspace.clone(),
            root: root.to_string(),
        })
    }
}

/// A tree's workspace in the object store: objects named `<root>/<path>`, so a file one
/// worker writes is there for every other.
pub struct ObjectWorkspace {
    store: object_store::ObjectStore,
    root: String,
}

/// Normalises a workspace path, refusing anything that could name another tree's files.
pub fn clean_path(path: &str) -> std::result::Result<String, ToolError> {
    if path.starts_with('/') || path.contains('\\') {
        return Err(ToolError::Refused(format!(
            "`{path}`: absolute paths are refused"
        )));
    }
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(ToolError::Refused(format!("`{path}`: `..` is refused"))),
            s => parts.push(s),
        }
    }
    Ok(parts.join("/"))
}

#[async_trait]
impl Workspace for ObjectWorkspace {
    async fn read(&self, path: &str) -> std::result::Result<Vec<u8>, ToolError> {
        let p = clean_path(path)?;
        let mut obj = self
            .store
            .get(format!("{}/{p}", self.root))
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        let mut out = vec![];
        obj.read_to_end(&mut out)
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?;
        Ok(out)
    }

    async fn write(&self, path: &str, data: &[u8]) -> std::result::Result<(), ToolError> {
        let p = clean_path(path)?;
        if p.is_empty() {
            return Err(ToolError::Refused("a file needs a name".into()));
        }
        let mut r = data;
        self.store
            .put(format!("{}/{p}", self.root).as_str(), &mut r)
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        Ok(())
    }

    async fn list(&self, path: &str) -> std::result::Result<Vec<DirEntry>, ToolError> {
        let p = clean_path(path)?;
        let prefix = if p.is_empty() {
            format!("{}/", self.root)
        } else {
            format!("{}/{p}/", self.root)
        };
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?;
        let mut out: Vec<DirEntry> = vec![];
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| ToolError::Failed(e.to_string()))?;
            if info.deleted {
                continue;
            }
            let Some(rest) = info.name.strip_prefix(&prefix) else {
                continue;
            };
            let (name, is_dir) = match rest.split_once('/') {
                Some((d, _)) => (d.to_string(), true),
                None => (rest.to_string(), false),
            };
            if !out.iter().any(|e| e.name == name) {
                out.push(DirEntry {
                    name,
                    is_dir,
                    size: if is_dir { 0 } else { info.size as u64 },
                });
            }
        }
        out.sort();
        Ok(out)
    }

    /// One pass over the object list (the default lists directory by directory).
    async fn usage(&self, path: &str) -> std::result::Result<Usage, ToolError> {
        let target = format!("{}/{}", self.root, clean_path(path)?);
        let prefix = format!("{}/", self.root);
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?;
        let mut u = Usage::default();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| ToolError::Failed(e.to_string()))?;
            if info.deleted || !info.name.starts_with(&prefix) {
                continue;
            }
            u.total = u.total.saturating_add(info.size as u64);
            if info.name == target {
                u.of_path = info.size as u64;
            }
        }
        Ok(u)
    }
}
