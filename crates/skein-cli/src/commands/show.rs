//! Read commands: `sessions`, `tree`, `events`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use skein_core::SessionId;
use skein_runtime::inspect::{fold_records, row, summarize, tree_rows};

use crate::app::App;
use crate::render;

#[derive(Args, Debug)]
pub struct SessionsArgs {
    /// At most this many, newest first.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TreeArgs {
    pub id: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The session that owns the plan (usually the root).
    pub id: String,
    /// The plan as it stood after this event.
    #[arg(long)]
    pub at: Option<u64>,
    /// The tasks and version as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EventsArgs {
    pub id: String,
    /// Keep printing new events as they are appended.
    #[arg(long)]
    pub follow: bool,
    /// One JSON object per line (envelope and body).
    #[arg(long)]
    pub json: bool,
}

pub async fn sessions(app: &App, a: SessionsArgs) -> Result<ExitCode> {
    let (_store, b) = app.backend().await?;
    let mut rows = vec![];
    for id in b.log.roots().await? {
        let records = b.log.read(&id, 1).await?;
        let f = fold_records(&id, &records)?;
        rows.push(row(&id, &records, &f.state));
    }
    rows.sort_by_key(|r| std::cmp::Reverse(r.started_at));
    rows.truncate(a.limit);
    if a.json {
        crate::outln!("{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    crate::outln!(
        "{:<28} {:<13} {:<15} {:>9}  MISSION",
        "SESSION",
        "AGENT",
        "STATUS",
        "WALL"
    )?;
    for r in rows {
        let mission: String = r.mission.replace('\n', " ").chars().take(60).collect();
        let line = format!(
            "{:<28} {:<13} {:<15} {:>9}  {}",
            r.session,
            r.agent,
            r.status,
            render::ms(r.wall_ms),
            mission
        );
        crate::outln!("{}", render::safe_line(&line))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn tree(app: &App, a: TreeArgs) -> Result<ExitCode> {
    let (_store, b) = app.backend().await?;
    let id = SessionId::parse(&a.id)?;
    let rows = tree_rows(&b, &id.root_id()).await?;
    let rows: Vec<_> = rows
        .into_iter()
        .filter(|r| SessionId::parse(&r.session).is_ok_and(|s| id.contains(&s)))
        .collect();
    if rows.is_empty() {
        anyhow::bail!("no session {id}");
    }
    let summary = summarize(&rows);
    let plan = plan_at(&b, &id, None).await?;
    // Sessions whose step waits for room in the store, as the workers mark them; a store
    // that cannot list them (or keeps none: the embedded one) shows none.
    let waiting: Vec<_> = b
        .jobs
        .waiting_for_room()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|w| SessionId::parse(&w.session).is_ok_and(|s| id.contains(&s)))
        .collect();
    // Sessions waiting for a model's quota, as the shared quota lists them (on NATS; the
    // embedded store's quota lives in the process that runs the tree).
    let quota: Vec<_> = match &b.quota {
        Some(q) => q.waiting().await.unwrap_or_default(),
        None => vec![],
    }
    .into_iter()
    .filter(|w| SessionId::parse(&w.session).is_ok_and(|s| id.contains(&s)))
    .collect();
    if a.json {
        let v = serde_json::json!({"root": id.to_string(), "summary": summary, "sessions": rows, "plan": plan, "waiting_for_room": waiting, "waiting_for_quota": quota});
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        crate::out!("{}", render::tree_table(&rows))?;
        crate::outln!("{}", render::summary_line(&summary))?;
        if !waiting.is_empty() {
            crate::outln!(
                "waiting for room in the store ({} sessions; they run on once there is room):",
                waiting.len()
            )?;
            for w in &waiting {
                crate::outln!(
                    "  {}: {}",
                    render::safe_line(&w.session),
                    render::safe_line(&w.reason)
                )?;
            }
        }
        if !quota.is_empty() {
            crate::outln!(
                "waiting for a model's quota ({} sessions; each asks again when its turn comes):",
                quota.len()
            )?;
            for w in &quota {
                crate::outln!(
                    "  {}: {}",
                    render::safe_line(&w.session),
                    render::safe_line(&w.reason)
                )?;
            }
        }
        if !plan.is_empty() {
            crate::out!("\n{}", render::safe(&plan.render_markdown()))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The plan `id` owns, folded from its log up to `at` (all of it by default).
async fn plan_at(
    b: &skein_runtime::Backend,
    id: &SessionId,
    at: Option<u64>,
) -> Result<skein_core::plan::Plan> {
    let records = b.log.read(id, 1).await?;
    if records.is_empty() {
        anyhow::bail!("no session {id}");
    }
    if let Some(at) = at {
        let last = records.last().map(|r| r.env.seq).unwrap_or(0);
        anyhow::ensure!(
            at >= 1 && at <= last,
            "--at {at}: the log of {id} has seqs 1..={last}"
        );
    }
    let state = skein_core::SessionState::fold(
        records
            .iter()
            .map(|r| &r.env)
            .take_while(|e| at.is_none_or(|a| e.seq <= a)),
    );
    Ok(state.planning.plan)
}

pub async fn plan(app: &App, a: PlanArgs) -> Result<ExitCode> {
    let (_store, b) = app.backend().await?;
    let id = SessionId::parse(&a.id)?;
    let plan = plan_at(&b, &id, a.at).await?;
    if a.json {
        crate::outln!("{}", serde_json::to_string_pretty(&plan)?)?;
    } else {
        crate::out!("{}", render::safe(&plan.render_markdown()))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn events(app: &App, a: EventsArgs) -> Result<ExitCode> {
    let (_store, b) = app.backend().await?;
    let id = SessionId::parse(&a.id)?;
    let mut next = 1;
    let mut t0 = None;
    loop {
        let records = b.log.read(&id, next).await?;
        if records.is_empty() && next == 1 && !a.follow {
            anyhow::bail!("no session {id}");
        }
        for r in &records {
            let start = *t0.get_or_insert(r.env.at);
            if a.json {
                let v = serde_json::json!({
                    "session": r.env.session.to_string(),
                    "seq": r.env.seq,
                    "at": r.env.at,
                    "v": r.env.v,
                    "prev": r.env.prev,
                    "hash": r.hash(),
                    "kind": r.env.body.kind(),
                    "body": r.env.body.to_json(),
                });
                crate::outln!("{v}")?;
            } else {
                crate::outln!("{}", render::event_line(r, start))?;
            }
            next = r.env.seq + 1;
        }
        if !a.follow {
            break;
        }
        if records.last().is_some_and(|r| r.env.body.is_terminal()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(ExitCode::SUCCESS)
}
