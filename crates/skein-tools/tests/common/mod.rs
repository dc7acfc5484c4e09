//! Helpers shared by the integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::Value;
use skein_core::SessionId;
use skein_tools::workspace::normalize;
use skein_tools::{
    DirEntry, LocalWorkspace, ToolBox, ToolContext, ToolError, ToolsConfig, Workspace,
};

pub fn ctx_for(ws: Arc<dyn Workspace>) -> ToolContext {
    ToolContext {
        session: SessionId::root("test").unwrap(),
        workspace: ws,
        blobs: None,
        progress: None,
    }
}

/// A temporary directory holding `root/` (the workspace) and `outside/` (what must stay
/// out of reach), with the workspace context.
pub struct Sandbox {
    pub dir: tempfile::TempDir,
    pub ctx: ToolContext,
}

impl Sandbox {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        std::fs::create_dir_all(dir.path().join("outside")).unwrap();
        std::fs::write(dir.path().join("outside/secret.txt"), "SECRET").unwrap();
        let ctx = ctx_for(Arc::new(LocalWorkspace::new(dir.path().join("root"))));
        Self { dir, ctx }
    }

    pub fn root(&self) -> std::path::PathBuf {
        self.dir.path().join("root")
    }

    pub fn outside(&self) -> std::path::PathBuf {
        self.dir.path().join("outside")
    }
}

pub fn builtin() -> ToolBox {
    ToolBox::builtin(&ToolsConfig::default())
}

/// Runs `name` and returns its output, failing the test on a tool error.
pub async fn ok(tb: &ToolBox, ctx: &ToolContext, name: &str, args: Value) -> String {
    let out = tb.run(ctx, name, &args).await;
    assert!(!out.error, "{name} {args} failed: {}", out.output);
    out.output
}

/// Runs `name` and returns its error, failing the test when it succeeds.
pub async fn err(tb: &ToolBox, ctx: &ToolContext, name: &str, args: Value) -> ToolError {
    match tb.try_run(ctx, name, &args).await {
        Ok(o) => panic!("{name} {args} should have failed, gave: {o}"),
        Err(e) => e,
    }
}

/// A workspace in memory, with only the three required methods: exercises the trait's
/// default `read_part` and `walk`, like a backend other than a local directory.
#[derive(Default)]
pub struct MemoryWorkspace {
    pub files: Mutex<BTreeMap<String, Vec<u8>>>,
}

#[async_trait]
impl Workspace for MemoryWorkspace {
    async fn read(&self, path: &str) -> Result<Vec<u8>, ToolError> {
        let p = normalize(path)?;
        self.files
            .lock()
            .unwrap()
            .get(&p)
            .cloned()
            .ok_or_else(|| ToolError::Failed(format!("`{path}`: no such file")))
    }

    async fn write(&self, path: &str, data: &[u8]) -> Result<(), ToolError> {
        let p = normalize(path)?;
        self.files.lock().unwrap().insert(p, data.to_vec());
        Ok(())
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>, ToolError> {
        let p = normalize(path)?;
        let prefix = if p.is_empty() {
            String::new()
        } else {
            format!("{p}/")
        };
        let mut out: Vec<DirEntry> = vec![];
        for (name, data) in self.files.lock().unwrap().iter() {
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            let (n, is_dir) = match rest.split_once('/') {
                Some((d, _)) => (d.to_string(), true),
                None => (rest.to_string(), false),
            };
            if !out.iter().any(|e| e.name == n) {
                out.push(DirEntry {
                    name: n,
                    is_dir,
                    size: if is_dir { 0 } else { data.len() as u64 },
                });
            }
        }
        out.sort();
        Ok(out)
    }
}
