//! `skein gc`: retention. Finished trees older than an age are exported (the audit format,
//! one file per tree) when asked, then removed: from the embedded store here, from the
//! cluster with `--nats` (`gc_nats.rs`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use skein_core::SessionId;
use skein_runtime::ports::roots::RootSummary;
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
    /// With `--nats`: first archive each tree in the cluster's object store
    /// `skein_archive`, as `<root>.jsonl`.
    #[arg(long, conflicts_with = "archive")]
    pub archive_store: bool,
    /// Only list the trees that would be removed.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}

pub async fn gc(app: &App, a: GcArgs) -> Result<ExitCode> {
    if app.global.nats.is_some() {
        return gc_on_nats(app, a).await;
    }
    anyhow::ensure!(
        !a.archive_store,
        "--archive-store archives into the cluster's object store: use it with --nats"
    );
    let (store, b) = app.open_embedded()?;
    let before = skein_runtime::now_ms().saturating_sub(a.older_than.as_millis() as u64);
    let found = store.removable_trees(before).await?;
    let roots: Vec<SessionId> = found
        .iter()
        .map(|s| SessionId::parse(&s.root))
        .collect::<std::result::Result<_, _>>()?;
    if a.dry_run || roots.is_empty() {
        return list_removable(&a, &found);
    }
    if let Some(dir) = &a.archive {
        for root in &roots {
            super::gc_nats::archive_to_dir(&b, dir, root).await?;
        }
    }
    let workspaces = app
        .cfg
        .workspace_dir
        .clone()
        .unwrap_or_else(|| app.global.data.join("workspaces"));
    drop(b);
    drop(store);
    let removed = remove_trees(&app.global.data, &roots)?;
    skein_runtime::metrics::gc_removed(
        removed.trees,
        removed.sessions,
        removed
            .log_bytes_before
            .saturating_sub(removed.log_bytes_after),
    );
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

/// Prints the trees that would be removed (`--dry-run`, or nothing to remove).
fn list_removable(a: &GcArgs, found: &[RootSummary]) -> Result<ExitCode> {
    if a.json {
        let ids: Vec<&str> = found.iter().map(|s| s.root.as_str()).collect();
        crate::outln!(
            "{}",
            serde_json::json!({ "removable": ids, "removed": null })
        )?;
    } else {
        for s in found {
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
    Ok(ExitCode::SUCCESS)
}

/// `skein gc --nats …`: the same on the cluster's streams, while workers run.
async fn gc_on_nats(app: &App, a: GcArgs) -> Result<ExitCode> {
    use super::gc_nats::{remove_trees, Archive};
    let store = app.nats().await?;
    let b = store.backend();
    let before = skein_runtime::now_ms().saturating_sub(a.older_than.as_millis() as u64);
    let found = store.removable_trees(before).await?;
    if a.dry_run || found.is_empty() {
        return list_removable(&a, &found);
    }
    let archive = match (&a.archive, a.archive_store) {
        (Some(dir), _) => Archive::Dir(dir),
        (None, true) => Archive::Store,
        (None, false) => Archive::None,
    };
    let removed = remove_trees(&store, &b, &found, &archive).await?;
    if a.json {
        crate::outln!(
            "{}",
            serde_json::json!({
                "removable": found.iter().map(|s| s.root.as_str()).collect::<Vec<_>>(),
                "removed": removed,
            })
        )?;
    } else {
        crate::outln!(
            "removed {} trees ({} sessions, {} records, {} bytes, {} workspace objects, {} \
             cache entries){}",
            removed.trees,
            removed.sessions,
            removed.records,
            removed.bytes,
            removed.workspace_objects,
            removed.cache_entries,
            match &archive {
                Archive::Dir(d) => format!("; archived in {}", d.display()),
                Archive::Store => "; archived in the object store skein_archive".to_string(),
                Archive::None => String::new(),
            }
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
