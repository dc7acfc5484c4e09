//! `skein inbox`, `answer`, `approve`, `deny`.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::{Map, Value};
use skein_core::SessionId;
use skein_runtime::hitl;
use skein_runtime::hitl::InboxKind;

use crate::app::App;
use crate::render;

#[derive(Args, Debug)]
pub struct InboxArgs {
    /// Only this tree (default: every tree not yet ended).
    pub id: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct AnswerArgs {
    pub token: String,
    /// An answer, KEY=VALUE (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// All answers as one JSON object.
    #[arg(long, conflicts_with = "set")]
    pub json: Option<String>,
    /// Record the answer only; do not run the tree on.
    #[arg(long)]
    pub no_run: bool,
}

#[derive(Args, Debug)]
pub struct ApproveArgs {
    pub token: String,
    /// Why (recorded in the log; shown to the model on a denial).
    #[arg(long)]
    pub reason: Option<String>,
    #[arg(long)]
    pub no_run: bool,
}

fn who() -> Option<String> {
    std::env::var("USER").ok().map(|u| format!("cli:{u}"))
}

pub async fn inbox(app: &App, a: InboxArgs) -> Result<ExitCode> {
    let (_store, backend) = app.backend().await?;
    let rt = app.runtime(backend)?;
    let roots = match &a.id {
        Some(id) => vec![SessionId::parse(id)?.root_id()],
        // Only a tree not yet ended can wait for a person: the open roots (from the index
        // of roots), so listing costs what is open, not the whole history.
        None => rt.backend.log.open_roots().await?,
    };
    let items = hitl::inbox(&rt, &roots).await?;
    if a.json {
        crate::outln!("{}", serde_json::to_string_pretty(&items)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if items.is_empty() {
        crate::outln!("nothing is waiting for you")?;
    }
    for it in &items {
        match it.kind {
            InboxKind::Question => {
                crate::outln!(
                    "question from {} ({}):",
                    it.session,
                    render::safe_line(&it.agent)
                )?;
                if let Some(c) = &it.context {
                    crate::outln!("  context: {}", render::safe(c))?;
                }
                for q in &it.questions {
                    let key = q["key"].as_str().unwrap_or("");
                    let d = it
                        .proposed_defaults
                        .get(key)
                        .map(|d| format!(" [proposed: {}]", render::safe_line(&d.to_string())))
                        .unwrap_or_default();
                    crate::outln!(
                        "  {}: {}{d}",
                        render::safe_line(key),
                        render::safe(q["question"].as_str().unwrap_or(""))
                    )?;
                }
                crate::outln!("  answer: skein answer {} --set KEY=VALUE …", it.token)?;
            }
            _ => {
                crate::outln!(
                    "approval for `{}` in {} ({}):",
                    render::safe_line(it.tool.as_deref().unwrap_or("?")),
                    it.session,
                    render::safe_line(&it.agent)
                )?;
                // Every byte of the arguments that would run, however long.
                crate::outln!(
                    "  args: {}",
                    render::safe_line(it.preview.as_deref().unwrap_or(""))
                )?;
                crate::outln!(
                    "  skein approve {}   |   skein deny {} --reason …",
                    it.token,
                    it.token
                )?;
            }
        }
        crate::outln!()?;
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_answers(a: &AnswerArgs) -> Result<Value> {
    if let Some(j) = &a.json {
        let v: Value = serde_json::from_str(j).context("--json must be a JSON object")?;
        anyhow::ensure!(v.is_object(), "--json must be a JSON object");
        return Ok(v);
    }
    let mut m = Map::new();
    for kv in &a.set {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--set {kv}: expected KEY=VALUE"))?;
        m.insert(k.trim().to_string(), Value::String(v.to_string()));
    }
    Ok(Value::Object(m))
}

async fn continue_tree(
    app: &App,
    rt: &std::sync::Arc<skein_runtime::worker::Runtime>,
    session: &SessionId,
    no_run: bool,
) -> Result<ExitCode> {
    if no_run {
        crate::outln!("recorded for {}", session.display())?;
        return Ok(ExitCode::SUCCESS);
    }
    let root = session.root_id();
    rt.requeue_tree(&root).await?;
    crate::errln!("recorded for {}; continuing {root}", session.display());
    super::run::drive(rt, &root, app.cfg.runtime.concurrency, false).await
}

pub async fn answer(app: &App, a: AnswerArgs) -> Result<ExitCode> {
    let answers = parse_answers(&a)?;
    let (store, backend) = app.backend().await?;
    let rt = app.runtime(backend)?;
    let session = hitl::answer(&rt, &a.token, answers, who()).await?;
    // On a cluster the workers take it from here.
    let code = continue_tree(app, &rt, &session, a.no_run || store.is_none()).await;
    if let Some(s) = store {
        s.flush().await?;
    }
    code
}

pub async fn approve(app: &App, a: ApproveArgs, approved: bool) -> Result<ExitCode> {
    let (store, backend) = app.backend().await?;
    let rt = app.runtime(backend)?;
    let session = hitl::decide_approval(&rt, &a.token, approved, a.reason.clone(), who()).await?;
    let code = continue_tree(app, &rt, &session, a.no_run || store.is_none()).await;
    if let Some(s) = store {
        s.flush().await?;
    }
    code
}
