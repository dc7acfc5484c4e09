//! Workspaces: the files a tree's agents read and write.

use std::path::PathBuf;

use async_trait::async_trait;

use crate::ToolError;

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DirEntry {
    pub name: String,
    pub is_dir: bool,
    pub size: u64,
}

/// A tree's files. Paths are relative, `/`-separated; implementations refuse any path
/// that would leave the workspace.
#[async_trait]
pub trait Workspace: Send + Sync {
    async fn read(&self, path: &str) -> Result<Vec<u8>, ToolError>;
    async fn write(&self, path: &str, data: &[u8]) -> Result<(), ToolError>;
    async fn list(&self, path: &str) -> Result<Vec<DirEntry>, ToolError>;
}

/// A local directory.
pub struct LocalWorkspace {
    root: PathBuf,
}

impl LocalWorkspace {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &std::path::Path {
        &self.root
    }
}

/// Resolves a relative workspace path under `root`, refusing absolute paths, `..`, and
/// anything whose resolved location (symlinks followed) leaves the root.
fn resolve(root: &std::path::Path, path: &str) -> Result<PathBuf, ToolError> {
    let p = std::path::Path::new(path);
    if p.is_absolute() {
        return Err(ToolError::Refused(format!(
            "`{path}`: absolute paths are refused"
        )));
    }
    if p.components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(ToolError::Refused(format!("`{path}`: `..` is refused")));
    }
    let full = root.join(p);
    let root_real = root
        .canonicalize()
        .map_err(|e| ToolError::Failed(e.to_string()))?;
    // The deepest existing ancestor must resolve inside the root.
    let mut probe = full.clone();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    let real = probe
        .canonicalize()
        .map_err(|e| ToolError::Failed(e.to_string()))?;
    if !real.starts_with(&root_real) {
        return Err(ToolError::Refused(format!("`{path}` leaves the workspace")));
    }
    Ok(full)
}

#[async_trait]
impl Workspace for LocalWorkspace {
    async fn read(&self, path: &str) -> Result<Vec<u8>, ToolError> {
        std::fs::create_dir_all(&self.root).map_err(|e| ToolError::Failed(e.to_string()))?;
        let p = resolve(&self.root, path)?;
        tokio::fs::read(&p)
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))
    }

    async fn write(&self, path: &str, data: &[u8]) -> Result<(), ToolError> {
        std::fs::create_dir_all(&self.root).map_err(|e| ToolError::Failed(e.to_string()))?;
        let p = resolve(&self.root, path)?;
        if let Some(parent) = p.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        }
        tokio::fs::write(&p, data)
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>, ToolError> {
        std::fs::create_dir_all(&self.root).map_err(|e| ToolError::Failed(e.to_string()))?;
        let p = resolve(&self.root, path)?;
        let mut rd = tokio::fs::read_dir(&p)
            .await
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        let mut out = vec![];
        while let Some(e) = rd
            .next_entry()
            .await
            .map_err(|e| ToolError::Failed(e.to_string()))?
        {
            let md = e
                .metadata()
                .await
                .map_err(|e| ToolError::Failed(e.to_string()))?;
            out.push(DirEntry {
                name: e.file_name().to_string_lossy().into_owned(),
                is_dir: md.is_dir(),
                size: md.len(),
            });
        }
        out.sort();
        Ok(out)
    }
}
