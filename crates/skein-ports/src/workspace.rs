//! Workspaces: the files a tree's agents read and write, as a backend offers them. The
//! local directory (`LocalWorkspace`) is in `skein-tools`.

use std::collections::VecDeque;
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;

/// A tool failure the model is shown as a tool error.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The arguments do not fit the tool's schema or make no sense together.
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    /// The sandbox said no: a path leaving the workspace, a private address, a size cap.
    #[error("{0}")]
    Refused(String),
    /// The tool ran and something went wrong (file missing, connection reset, …).
    #[error("{0}")]
    Failed(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

/// One entry of a directory listing (or, from [`Workspace::walk`], a file named by its
/// whole workspace path).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DirEntry {
    pub name: String,
    pub is_dir: bool,
    pub size: u64,
}

/// A piece of a file: the bytes asked for and the size of the whole file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePart {
    pub data: Vec<u8>,
    pub size: u64,
}

/// The files under a directory, as far as a walk went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Walk {
    /// Files by workspace path, sorted.
    pub files: Vec<DirEntry>,
    /// The walk stopped at its limit; more files exist.
    pub truncated: bool,
}

/// What the files of a workspace hold, for its size cap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of every file together.
    pub total: u64,
    /// Bytes of the file at the path asked about (0 when there is none): what writing it
    /// anew would give back.
    pub of_path: u64,
}

/// A tree's files. Paths are relative, `/`-separated; implementations refuse any path
/// that would leave the workspace.
#[async_trait]
pub trait Workspace: Send + Sync {
    async fn read(&self, path: &str) -> Result<Vec<u8>, ToolError>;
    async fn write(&self, path: &str, data: &[u8]) -> Result<(), ToolError>;
    async fn list(&self, path: &str) -> Result<Vec<DirEntry>, ToolError>;

    /// At most `max` bytes of a file from `offset` on, and the file's whole size. The
    /// default reads the whole file; a backend that can read a range should.
    async fn read_part(&self, path: &str, offset: u64, max: usize) -> Result<FilePart, ToolError> {
        let data = self.read(path).await?;
        let size = data.len() as u64;
        let start = usize::try_from(offset.min(size)).unwrap_or(data.len());
        let end = start.saturating_add(max).min(data.len());
        Ok(FilePart {
            data: data[start..end].to_vec(),
            size,
        })
    }

    /// The files under `path`, recursively, at most `max_files` of them (shallower ones
    /// first), each named by its workspace path. Built on [`Workspace::list`]; a
    /// subdirectory that cannot be listed is skipped.
    async fn walk(&self, path: &str, max_files: usize) -> Result<Walk, ToolError> {
        let start = normalize(path)?;
        let mut out = Walk::default();
        let mut dirs = VecDeque::from([start]);
        let mut first = true;
        // Directories count against the limit too, so a deep empty tree ends.
        let mut budget = max_files.saturating_mul(2).max(1);
        while let Some(dir) = dirs.pop_front() {
            let entries = match self.list(&dir).await {
                Ok(e) => e,
                Err(e) if first => return Err(e),
                Err(_) => continue,
            };
            first = false;
            for e in entries {
                if out.files.len() >= max_files || budget == 0 {
                    out.truncated = true;
                    break;
                }
                budget -= 1;
                let full = join(&dir, &e.name);
                if e.is_dir {
                    dirs.push_back(full);
                } else {
                    out.files.push(DirEntry { name: full, ..e });
                }
            }
            if out.truncated {
                break;
            }
        }
        out.files.sort();
        Ok(out)
    }

    /// The bytes all files hold, and the file at `path` alone (see [`Usage`]). The default
    /// walks the whole workspace; a backend that can sum faster should.
    async fn usage(&self, path: &str) -> Result<Usage, ToolError> {
        let target = normalize(path)?;
        let all = self.walk("", usize::MAX).await?;
        Ok(Usage {
            total: all.files.iter().map(|f| f.size).sum(),
            of_path: all
                .files
                .iter()
                .find(|f| f.name == target)
                .map_or(0, |f| f.size),
        })
    }

    /// The directory on this machine the workspace is, when it is one (for `shell`).
    fn local_root(&self) -> Option<&Path> {
        None
    }

    /// When the entry at `path` was last modified (ms since the epoch), where the backend
    /// keeps that; None where it does not.
    async fn modified(&self, path: &str) -> Result<Option<u64>, ToolError> {
        normalize(path)?;
        Ok(None)
    }
}

/// Refuses a path holding NUL or any other control character (newline, tab, ESC, DEL, the
/// C1 range): no file a tool makes may have a name that breaks a listing, a log line or a
/// terminal. Every workspace, local or in an object store, checks this first.
pub fn check_path_chars(path: &str) -> Result<(), ToolError> {
    match path.chars().find(|c| c.is_control()) {
        None => Ok(()),
        Some(c) => Err(ToolError::Refused(format!(
            "`{}`: a path holding a control character ({}) is refused",
            path.escape_debug(),
            if c == '\0' {
                "NUL".to_string()
            } else {
                format!("U+{:04X}", c as u32)
            }
        ))),
    }
}

/// A workspace path in canonical form: no leading `/` (refused), no `.` or empty
/// segments, no `..` (refused); `""` is the root.
pub fn normalize(path: &str) -> Result<String, ToolError> {
    if path.starts_with('/') || Path::new(path).is_absolute() {
        return Err(ToolError::Refused(format!(
            "`{path}`: absolute paths are refused; paths are relative to the workspace"
        )));
    }
    check_path_chars(path)?;
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                return Err(ToolError::Refused(format!(
                    "`{path}`: `..` is refused; paths stay inside the workspace"
                )))
            }
            s => parts.push(s),
        }
    }
    Ok(parts.join("/"))
}

/// `name` in directory `dir` (`""`: the root).
pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}
