//! Retention on NATS: `skein gc --nats …` and the workers' policy (`nats.retain_finished`).
//! Each finished tree older than the cut-off is archived when asked (its audit export,
//! checked before anything is removed) and then removed from the streams (see
//! `skein_nats` `retention.rs`); what was removed is counted in `/metrics`.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;
use skein_core::SessionId;
use skein_nats::NatsStore;
use skein_runtime::ports::roots::RootSummary;
use skein_runtime::ports::Backend;

/// Where trees go before they are removed.
pub enum Archive<'a> {
    None,
    /// `<dir>/<root>.jsonl`, as `skein audit export` writes it.
    Dir(&'a Path),
    /// Object `<root>.jsonl` of the object store `skein_archive`.
    Store,
}

/// What one pass removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Removed {
    pub trees: u64,
    pub sessions: u64,
    pub records: u64,
    pub bytes: u64,
    pub workspace_objects: u64,
    pub cache_entries: u64,
    pub archived: u64,
}

/// The audit export of `root`'s tree, checked as `skein audit verify` checks it.
pub async fn verified_export(b: &Backend, root: &SessionId) -> Result<Vec<u8>> {
    // The export writes through a `dyn Write` held across its awaits, so it runs on a
    // thread of its own: the policy's task must be `Send`.
    let (b2, root2) = (b.clone(), root.clone());
    let bytes = tokio::task::spawn_blocking(move || {
        let mut buf = vec![];
        tokio::runtime::Handle::current()
            .block_on(skein_runtime::audit::export(&b2, &root2, &mut buf))
            .map(|_| buf)
    })
    .await
    .context("the export of a tree stopped")??;
    let check = skein_runtime::audit::verify(&mut bytes.as_slice())?;
    anyhow::ensure!(
        check.findings.is_empty(),
        "the export of {} does not verify; it was not removed",
        root.display()
    );
    Ok(bytes)
}

/// Writes `root`'s verified export to `dir/<root>.jsonl`, synced, through a temporary
/// file renamed into place.
pub async fn archive_to_dir(b: &Backend, dir: &Path, root: &SessionId) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let bytes = verified_export(b, root).await?;
    let path = dir.join(format!("{}.jsonl", root.as_str()));
    let tmp = dir.join(format!(".{}.jsonl.part", root.as_str()));
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Archives (as asked) and removes each tree of `trees`, one at a time: a tree whose
/// archive fails stops the pass before it is removed.
pub async fn remove_trees(
    store: &Arc<NatsStore>,
    b: &Backend,
    trees: &[RootSummary],
    archive: &Archive<'_>,
) -> Result<Removed> {
    let mut out = Removed::default();
    for s in trees {
        let root = SessionId::parse(&s.root)?;
        match archive {
            Archive::None => {}
            Archive::Dir(dir) => {
                archive_to_dir(b, dir, &root).await?;
                out.archived += 1;
            }
            Archive::Store => {
                let bytes = verified_export(b, &root).await?;
                store
                    .archive_put(&format!("{}.jsonl", root.as_str()), bytes)
                    .await?;
                out.archived += 1;
            }
        }
        // None: another worker removed it meanwhile, and counted it.
        if let Some(r) = store.remove_tree(&root).await? {
            skein_runtime::metrics::gc_removed(1, r.sessions, r.bytes);
            out.trees += 1;
            out.sessions += r.sessions;
            out.records += r.records;
            out.bytes += r.bytes;
            out.workspace_objects += r.workspace_objects;
            out.cache_entries += r.cache_entries;
        }
    }
    if out.trees > 0 {
        // The packed blocks of the index whose roots are all gone go too; only a hint,
        // so a failure is only told.
        match store.drop_emptied_blocks().await {
            Ok(n) if n > 0 => tracing::debug!(blocks = n, "blocks of removed roots dropped"),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e.report(), "blocks of removed roots were not dropped; the next pass tries again")
            }
        }
    }
    Ok(out)
}

/// The workers' retention: every `nats.retention_every` (the first time after a part of
/// it that differs between workers), the finished trees older than `nats.retain_finished`
/// are archived in `skein_archive` (unless `nats.archive_finished` is false) and
/// removed. Several workers may run it at once: a tree is removed, and counted, once.
pub async fn policy(
    store: Arc<NatsStore>,
    b: Backend,
    worker_id: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let cfg = store.config().clone();
    let Some(keep) = skein_nats::config::duration(&cfg.retain_finished).filter(|d| !d.is_zero())
    else {
        return;
    };
    let every = skein_nats::config::duration(&cfg.retention_every)
        .filter(|d| !d.is_zero())
        .unwrap_or(Duration::from_secs(3600));
    let spread = worker_id
        .bytes()
        .fold(0u64, |h, c| h.wrapping_mul(31).wrapping_add(u64::from(c)));
    let mut wait = Duration::from_millis(spread % (every.as_millis() as u64).max(1));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
        wait = every;
        let before = skein_runtime::now_ms().saturating_sub(keep.as_millis() as u64);
        let archive = if cfg.archive_finished {
            Archive::Store
        } else {
            Archive::None
        };
        let pass = async {
            let trees = store.removable_trees(before).await?;
            remove_trees(&store, &b, &trees, &archive).await
        };
        match pass.await {
            Ok(r) if r.trees > 0 => tracing::info!(
                trees = r.trees,
                sessions = r.sessions,
                bytes = r.bytes,
                cache_entries = r.cache_entries,
                archived = r.archived,
                "retention removed finished trees"
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "retention pass failed; trying again next time")
            }
        }
    }
}
