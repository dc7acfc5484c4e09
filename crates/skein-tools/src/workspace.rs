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
