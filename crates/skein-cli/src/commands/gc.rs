//! `skein gc`: retention on the embedded store. Finished trees older than an age are
//! exported (the audit format, one file per tree) when asked, then removed.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use skein_core::SessionId;
use skein_sled::gc::remove_trees;

use crate::app::App;
use crate::render;

#[derive(Args, Debug)]
pub struct GcArgs {
    /// Remove the finished trees whose last event is older than this: `90s`, `30m`, `12h`,
    /// `30d`. A tree in flight, or waiting for a person, is never removed.
    #[arg(long, value_parser = super::show::parse_age)]
    pub older_than: Duration,
    /// First export each tree into this directory as `<root>.jsonl` (as `skein audit
    /// export` writes it; `skein audit verify` checks it); a tree is removed only once its
    /// export is written, synced and verified.
    #[arg(long)]
    pub archive: Option<PathBuf>,
    /// Only list the trees that would be removed.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}

pub async fn gc(app: &App, a: GcArgs) -> Result<ExitCode> {
    let (store, b) = app.open_embedded()?;
    let before = skein_runtime::now_ms().saturating_sub(a.older_than.as_millis() as u64);
    let found = store.removable_trees(before).await?;
    let roots: Vec<SessionId> = found
        .iter()
        .map(|s| SessionId::parse(&s.root))
        .collect::<std::result::Result<_, _>>()?;
    if a.dry_run || roots.is_empty() {
        if a.json {
            let ids: Vec<&str> = found.iter().map(|s| s.root.as_str()).collect();
            crate::outln!(
                "{}",
                serde_json::json!({ "removable": ids, "removed": null })
            )?;
        } else {
            for s in &found {
                crate::outln!(
                    "{} {} {}",
                    render::safe_line(&s.root),
                    s.status,
                    s.updated_at
                )?;
            }
            crate::errln!(
                "{} finished tree(s) older than the cut-off{}",
                found.len(),
                if a.dry_run {
                    "; nothing removed (--dry-run)"
                } else {
                    ""
                }
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(dir) = &a.archive {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for root in &roots {
            let path = dir.join(format!("{}.jsonl", root.as_str()));
            let tmp = dir.join(format!(".{}.jsonl.part", root.as_str()));
            let mut f = std::io::BufWriter::new(
                std::fs::File::create(&tmp)
                    .with_context(|| format!("cannot create {}", tmp.display()))?,
            );
            skein_runtime::audit::export(&b, root, &mut f).await?;
            f.flush()?;
            f.into_inner()?.sync_all()?;
            let check = skein_runtime::audit::verify(&mut std::io::BufReader::new(
                std::fs::File::open(&tmp)?,
            ))?;
            anyhow::ensure!(
                check.findings.is_empty(),
                "the export of {} does not verify; nothing was removed",
                root.display()
            );
            std::fs::rename(&tmp, &path)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        std::fs::File::open(dir)?.sync_all()?;
    }
    let workspaces = app
        .cfg
        .workspace_dir
        .clone()
        .unwrap_or_else(|| app.global.data.join("workspaces"));
    drop(b);
    drop(store);
    let removed = remove_trees(&app.global.data, &roots)?;
    for root in &roots {
        let ws = workspaces.join(root.as_str());
        if ws.is_dir() {
            if let Err(e) = std::fs::remove_dir_all(&ws) {
                crate::errln!("could not remove the workspace {}: {e}", ws.display());
            }
        }
    }
    if a.json {
        crate::outln!(
            "{}",
            serde_json::json!({
                "removable": roots.iter().map(SessionId::as_str).collect::<Vec<_>>(),
                "removed": removed,
            })
        )?;
    } else {
        crate::outln!(
            "removed {} trees ({} sessions, {} records, {} cache entries); the event log \
             went from {} to {} bytes{}",
            removed.trees,
            removed.sessions,
            removed.records,
            removed.cache_entries,
            removed.log_bytes_before,
            removed.log_bytes_after,
            a.archive
                .as_ref()
                .map(|d| format!("; archived in {}", d.display()))
                .unwrap_or_default()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
