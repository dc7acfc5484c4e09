//! `skein cancel ID`: cancels a session and everything under it, on either backend.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use skein_core::SessionId;

use crate::app::App;

#[derive(Args, Debug)]
pub struct CancelArgs {
    /// The session to cancel (a root cancels its whole tree).
    pub id: String,
    /// Why (recorded in the log of every session cancelled).
    #[arg(long)]
    pub reason: Option<String>,
    /// Embedded store: record the cancellations only; do not run the tree on so that the
    /// parents of a cancelled sub-tree hear of it (`skein resume` does that later).
    #[arg(long)]
    pub no_run: bool,
    /// Print `{"session": …, "cancelled": N}`.
    #[arg(long)]
    pub json: bool,
}

pub async fn cancel(app: &App, a: CancelArgs) -> Result<ExitCode> {
    let id = SessionId::parse(&a.id)?;
    let (store, backend) = app.backend().await?;
    let rt = app.runtime(backend)?;
    let who = std::env::var("USER").unwrap_or_else(|_| "someone".into());
    let reason = a
        .reason
        .clone()
        .unwrap_or_else(|| format!("cancelled with `skein cancel` by {who}"));
    let n = skein_runtime::control::cancel(&rt, &id, &reason).await?;
    if a.json {
        crate::outln!(
            "{}",
            serde_json::json!({"session": id.to_string(), "cancelled": n})
        )?;
    } else if n == 0 {
        crate::outln!(
            "nothing to cancel: {} and every session under it had ended",
            id.display()
        )?;
    } else {
        crate::outln!("cancelled {n} session(s) of {}", id.display())?;
    }
    // On a cluster the workers tell the parents. Embedded, a cancelled sub-tree's parent
    // is woken here and the tree runs on (a cancelled root ends the tree: nothing to run).
    if let Some(s) = &store {
        if n > 0 && !id.is_root() && !a.no_run {
            let root = id.root_id();
            rt.requeue_tree(&root).await?;
            crate::errln!("continuing {root}");
            let code = super::run::drive(&rt, &root, app.cfg.runtime.concurrency, false).await;
            s.flush().await?;
            return code;
        }
        s.flush().await?;
    }
    Ok(ExitCode::SUCCESS)
}
