//! Read commands: `sessions`, `tree`, `events`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use skein_core::SessionId;
use skein_runtime::inspect::{fold_records, row, summarize, tree_rows, SessionRow};
use skein_runtime::ports::roots::RootFilter;

use crate::app::App;
use crate::render;

#[derive(Args, Debug)]
pub struct SessionsArgs {
    /// At most this many, newest first.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// Only roots in this status (`running`, `awaiting_input`, `completed`, …).
    #[arg(long)]
    pub status: Option<String>,
    /// Only roots of this agent.
    #[arg(long)]
    pub agent: Option<String>,
    /// Only roots started at or after this time: ms since the Unix epoch, or an age such
    /// as `90s`, `30m`, `2h`, `7d` (that long ago).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<u64>,
    /// Only roots started before this time (as `--since`).
    #[arg(long, value_parser = parse_time)]
    pub until: Option<u64>,
    /// Only roots whose mission contains this text, in any case.
    #[arg(long)]
    pub text: Option<String>,
    /// The next page: the cursor the page before printed.
    #[arg(long)]
    pub cursor: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// A time as ms since the Unix epoch, or an age (`90s`, `30m`, `2h`, `7d`) before now.
pub(crate) fn parse_time(s: &str) -> std::result::Result<u64, String> {
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(ms);
    }
    let age = parse_age(s)?;
    Ok(skein_runtime::now_ms().saturating_sub(age.as_millis() as u64))
}

/// An age: a whole number followed by `s`, `m`, `h` or `d`.
pub(crate) fn parse_age(s: &str) -> std::result::Result<Duration, String> {
    let bad = || format!("{s:?} is neither ms since the epoch nor an age such as 30m, 2h or 7d");
    let unit = s.chars().last().ok_or_else(bad)?;
    let n: u64 = s[..s.len() - unit.len_utf8()].parse().map_err(|_| bad())?;
    let secs = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return Err(bad()),
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

/// A page of roots as rows (each folded from its root's log: the cost is the page's, not
/// history's), and the cursor of the next page.
pub(crate) async fn root_rows(
    b: &skein_runtime::Backend,
    filter: &RootFilter,
    limit: usize,
    cursor: Option<&str>,
) -> skein_runtime::Result<(Vec<SessionRow>, Option<String>)> {
    let page = b.log.roots_page(filter, limit, cursor).await?;
    let mut rows = Vec::with_capacity(page.roots.len());
    for s in &page.roots {
        let id = SessionId::parse(&s.root)?;
        let records = b.log.read(&id, 1).await?;
        let f = fold_records(&id, &records)?;
        rows.push(row(&id, &records, &f.state));
    }
    Ok((rows, page.next))
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
    let filter = RootFilter {
        status: a.status,
        agent: a.agent,
        since: a.since,
        until: a.until,
        text: a.text,
    };
    let (rows, next) = root_rows(&b, &filter, a.limit, a.cursor.as_deref()).await?;
    // The next page's cursor goes to stderr: stdout stays the rows alone.
    let more = || {
        if let Some(c) = &next {
            crate::errln!("more: --cursor {}", render::safe_line(c));
        }
    };
    if a.json {
        crate::outln!("{}", serde_json::to_string_pretty(&rows)?)?;
        more();
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
    more();
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
