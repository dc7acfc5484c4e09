//! Trees: the list of roots, starting one, a tree's rows, its timeline and its audit
//! export.

use super::*;
use skein_runtime::ports::roots::RootFilter;

#[derive(Deserialize, IntoParams)]
pub struct SessionsQuery {
    /// Only roots in this status (`running`, `awaiting_input`, `completed`, …).
    pub status: Option<String>,
    /// Only roots of this agent.
    pub agent: Option<String>,
    /// Only roots started at or after this time (ms since the Unix epoch).
    pub since: Option<u64>,
    /// Only roots started before this time (ms since the Unix epoch).
    pub until: Option<u64>,
    /// Only roots whose mission contains this text (any case).
    pub q: Option<String>,
    /// At most this many, newest first (default 100, at most 1000).
    pub limit: Option<usize>,
    /// The next page: the `x-skein-next-cursor` header of the page before.
    pub cursor: Option<String>,
}

/// The response header that carries the cursor of the next page of `/api/sessions`.
pub const NEXT_CURSOR: &str = "x-skein-next-cursor";

/// Root sessions, newest first: the rows of `skein sessions --json`, one page of them.
/// When more follow, header `x-skein-next-cursor` holds the `cursor` of the next page.
#[utoipa::path(get, path = "/api/sessions", tag = "trees", params(SessionsQuery),
    responses((status = 200, description = "SessionRow objects, as `skein sessions --json`; \
        header `x-skein-next-cursor` when a next page follows", body = Vec<Object>),
        (status = 400, body = ErrorBody)))]
pub(super) async fn sessions(
    State(ui): State<Arc<Ui>>,
    Query(q): Query<SessionsQuery>,
) -> std::result::Result<Response, ApiError> {
    let filter = RootFilter {
        status: q.status,
        agent: q.agent,
        since: q.since,
        until: q.until,
        text: q.q,
    };
    let (rows, next) = crate::commands::show::root_rows(
        &ui.backend,
        &filter,
        q.limit.unwrap_or(100),
        q.cursor.as_deref().filter(|c| !c.is_empty()),
    )
    .await?;
    let body = Json(serde_json::to_value(rows).map_err(|e| bad(e.to_string()))?);
    Ok(match next {
        Some(c) => ([(NEXT_CURSOR, c)], body).into_response(),
        None => body.into_response(),
    })
}

#[derive(Deserialize, ToSchema)]
pub struct Start {
    pub agent: String,
    pub mission: String,
    /// Root session id (a-z, 0-9, `-`, `_`); the same submission again is a no-op.
    pub id: Option<String>,
    pub context: Option<String>,
    #[serde(default)]
    pub no_cache: bool,
    /// The tree's priority for model quotas, -100 to 100 (default 0): where a model's
    /// limits make calls wait, a higher priority goes first.
    pub priority: Option<i32>,
}

#[derive(Serialize, ToSchema)]
pub struct Started {
    pub session: String,
}

/// Starts a tree (as `skein run` / `skein submit`); it runs in this process on the
/// embedded store, on the cluster's workers with --nats.
#[utoipa::path(post, path = "/api/sessions", tag = "actions", request_body = Start,
    responses((status = 200, body = Started), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub(super) async fn start(State(ui): State<Arc<Ui>>, Json(s): Json<Start>) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    if s.mission.trim().is_empty() {
        return Err(bad("the mission is empty"));
    }
    let id = rt
        .submit(Submission {
            agent: s.agent,
            mission: s.mission,
            id: s.id.filter(|i| !i.is_empty()),
            context: s.context.filter(|c| !c.is_empty()),
            inputs: Value::Null,
            budget: None,
            no_cache: s.no_cache,
            priority: s.priority,
            ..Default::default()
        })
        .await?;
    Ok(Json(Started {
        session: id.display(),
    }))
}

#[derive(Serialize, ToSchema)]
pub struct TreeView {
    pub root: String,
    /// As `skein tree --json`'s summary.
    #[schema(value_type = Object)]
    pub summary: Value,
    /// SessionRow objects, parents before children.
    #[schema(value_type = Vec<Object>)]
    pub sessions: Value,
    /// The plan the root owns now.
    #[schema(value_type = Object)]
    pub plan: Value,
    /// On NATS, the tree's last announced result, as `skein.results.<root>` carried it
    /// (read from stream `SKEIN_RESULTS`, as `skein submit --wait` and `skein.api.status`
    /// read it); null before the tree's first end, and on the embedded store.
    #[schema(value_type = Object)]
    pub result: Value,
    /// Sessions of the tree whose step waits for room in the store (a full disk, a
    /// JetStream store at its limits), as this process's runtime sees them: `session`,
    /// `since_ms`, `reason`. They run on once there is room.
    #[schema(value_type = Vec<Object>)]
    pub waiting_for_room: Value,
    /// Sessions of the tree waiting for a model's quota (their jobs are back in the queue
    /// until their turn): `key` (`provider:model`), `session`, `root`, `since_ms`,
    /// `due_ms`, `reason`.
    #[schema(value_type = Vec<Object>)]
    pub waiting_for_quota: Value,
}

/// One tree: every session, summarised (as `skein tree --json`).
#[utoipa::path(get, path = "/api/trees/{root}", tag = "trees",
    params(("root" = String, Path, description = "root session id")),
    responses((status = 200, body = TreeView), (status = 404, body = ErrorBody)))]
pub(super) async fn tree(
    State(ui): State<Arc<Ui>>,
    Path(root): Path<String>,
) -> ApiResult<TreeView> {
    let root = session_id(&root)?.root_id();
    let rows = tree_rows(&ui.backend, &root).await?;
    if rows.is_empty() {
        return Err(not_found(&root));
    }
    let records = ui.records(&root).await?;
    let f = fold_records(&root, &records)?;
    // This process's own sessions waiting for room, and those the store's other workers
    // mark so.
    let mut waiting = match &ui.rt {
        Ok(rt) => rt.waiting_for_room(),
        Err(_) => vec![],
    };
    for w in ui.backend.jobs.waiting_for_room().await.unwrap_or_default() {
        if !waiting.iter().any(|x| x.session == w.session) {
            waiting.push(w);
        }
    }
    waiting.retain(|w| skein_core::SessionId::parse(&w.session).is_ok_and(|s| root.contains(&s)));
    // Those waiting for a model's quota: this process's, and the shared quota's list.
    let mut quota = match &ui.rt {
        Ok(rt) => rt.waiting_for_quota(),
        Err(_) => vec![],
    };
    if let Some(q) = &ui.backend.quota {
        for w in q.waiting().await.unwrap_or_default() {
            if !quota.iter().any(|x| x.session == w.session) {
                quota.push(w);
            }
        }
    }
    quota.retain(|w| skein_core::SessionId::parse(&w.session).is_ok_and(|s| root.contains(&s)));
    Ok(Json(TreeView {
        root: root.display(),
        summary: json(&summarize(&rows))?,
        sessions: json(&rows)?,
        plan: json(&f.state.planning.plan)?,
        result: match &ui.results {
            Some(store) => match store.last_result(&root).await? {
                Some(r) => json(&r.result)?,
                None => Value::Null,
            },
            None => Value::Null,
        },
        waiting_for_room: json(&waiting)?,
        waiting_for_quota: json(&quota)?,
    }))
}

#[derive(Serialize, ToSchema)]
pub struct Step {
    /// `model`, `tool`, `cache` (a delegation answered from the cache) or `wait` (for a
    /// person).
    pub kind: String,
    /// Model, tool or agent name.
    pub name: String,
    /// ms since the Unix epoch.
    pub start: u64,
    pub end: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cost: f64,
    pub error: bool,
}

#[derive(Serialize, ToSchema)]
pub struct Timeline {
    pub session: String,
    pub depth: u32,
    pub agent: String,
    pub status: String,
    pub start: u64,
    /// The terminal event's time, or the latest event's while it runs.
    pub end: u64,
    pub steps: Vec<Step>,
}

fn steps_of(records: &[Record]) -> Vec<Step> {
    let mut out = vec![];
    let mut open: std::collections::HashMap<String, usize> = Default::default();
    let blank = |kind: &str, name: &str, start: u64, end: u64| Step {
        kind: kind.into(),
        name: name.into(),
        start,
        end,
        input_tokens: 0,
        output_tokens: 0,
        cache_read_tokens: 0,
        cost: 0.0,
        error: false,
    };
    let mut waiting: Option<(usize, &str)> = None;
    for r in records {
        let at = r.env.at;
        match &r.env.body {
            Event::ModelCalled(m) => {
                let mut s = blank("model", &m.model, at.saturating_sub(m.latency_ms), at);
                s.input_tokens = m.usage.input_tokens;
                s.output_tokens = m.usage.output_tokens;
                s.cache_read_tokens = m.usage.cache_read_tokens;
                s.cost = m.usage.cost;
                out.push(s);
            }
            Event::ModelFailed(m) => {
                let mut s = blank("model", &m.model, at, at);
                s.error = true;
                out.push(s);
            }
            Event::ToolCalled(t) => {
                open.insert(t.call.clone(), out.len());
                out.push(blank("tool", &t.tool, at, at));
            }
            Event::ToolReturned(t) => {
                if let Some(&i) = open.get(&t.call) {
                    out[i].end = at.max(out[i].start);
                    out[i].error = t.error;
                }
            }
            Event::CacheHit(h) => {
                let mut s = blank("cache", &h.source.display(), at, at);
                s.input_tokens = h.saved.input_tokens;
                s.output_tokens = h.saved.output_tokens;
                out.push(s);
            }
            Event::InputRequested(_) | Event::ApprovalRequested(_) => {
                waiting = Some((out.len(), r.env.body.kind()));
                out.push(blank("wait", r.env.body.kind(), at, at));
            }
            Event::InputProvided(_) | Event::ApprovalGiven(_) => {
                if let Some((i, _)) = waiting.take() {
                    out[i].end = at;
                }
            }
            _ => {}
        }
    }
    if let (Some((i, _)), Some(last)) = (waiting, records.last()) {
        out[i].end = last.env.at.max(out[i].start);
    }
    out
}

/// The tree as a timeline: each session's span, and its model, tool, cache and waiting
/// steps with their tokens and cost.
#[utoipa::path(get, path = "/api/trees/{root}/timeline", tag = "trees",
    params(("root" = String, Path, description = "root session id")),
    responses((status = 200, body = Vec<Timeline>), (status = 404, body = ErrorBody)))]
pub(super) async fn timeline(
    State(ui): State<Arc<Ui>>,
    Path(root): Path<String>,
) -> ApiResult<Vec<Timeline>> {
    let root = session_id(&root)?.root_id();
    let rows = tree_rows(&ui.backend, &root).await?;
    if rows.is_empty() {
        return Err(not_found(&root));
    }
    let mut out = vec![];
    for r in rows {
        let id = session_id(&r.session)?;
        let records = ui.backend.log.read(&id, 1).await?;
        let last = records.last().map(|x| x.env.at).unwrap_or(r.started_at);
        out.push(Timeline {
            session: r.session,
            depth: r.depth,
            agent: r.agent,
            status: r.status,
            start: r.started_at,
            end: r.ended_at.unwrap_or(last),
            steps: steps_of(&records),
        });
    }
    Ok(Json(out))
}

/// The audit export of a tree (as `skein audit export`): JSON lines, one event a line,
/// then a manifest.
#[utoipa::path(get, path = "/api/trees/{root}/audit", tag = "trees",
    params(("root" = String, Path, description = "root (or any) session id: that session and everything under it")),
    responses((status = 200, description = "JSON lines", content_type = "application/x-ndjson"),
        (status = 404, body = ErrorBody)))]
pub(super) async fn audit(
    State(ui): State<Arc<Ui>>,
    Path(root): Path<String>,
) -> Result<Response, ApiError> {
    let id = session_id(&root)?;
    // The export writes to a `dyn Write`, which cannot cross an await of a handler's
    // (sendable) future: it runs to the end on a blocking thread.
    let (backend, source) = (ui.backend.clone(), id.clone());
    let handle = tokio::runtime::Handle::current();
    let buf = tokio::task::spawn_blocking(move || {
        let mut buf: Vec<u8> = vec![];
        handle
            .block_on(skein_runtime::audit::export(&backend, &source, &mut buf))
            .map(|_| buf)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    let name = format!("{}.audit.jsonl", id.to_string().replace('.', "_"));
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ndjson".to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}\""),
            ),
        ],
        buf,
    )
        .into_response())
}

#[derive(Deserialize, ToSchema)]
pub struct Cancel {
    /// Why (recorded in the log of every session cancelled).
    pub reason: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct Cancelled {
    pub session: String,
    /// Sessions cancelled (0: every one had ended already).
    pub cancelled: usize,
}

/// Cancels a tree: its root and every session under it still running or waiting (as
/// `skein cancel ROOT`).
#[utoipa::path(post, path = "/api/trees/{root}/cancel", tag = "actions",
    params(("root" = String, Path, description = "root session id")),
    request_body = Cancel,
    responses((status = 200, body = Cancelled), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub(super) async fn cancel_tree(
    State(ui): State<Arc<Ui>>,
    Path(root): Path<String>,
    Json(c): Json<Cancel>,
) -> ApiResult<Cancelled> {
    let rt = ui.runtime()?;
    let id = session_id(&root)?;
    if !id.is_root() {
        return Err(bad(format!("{} is not a root session", id.display())));
    }
    hitl::check_answer_size("the reason", c.reason.as_deref().map_or(0, str::len))?;
    let reason = c
        .reason
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| {
            format!(
                "cancelled from the web view by {}",
                who().unwrap_or_default()
            )
        });
    let n = skein_runtime::control::cancel(rt, &id, &reason).await?;
    Ok(Json(Cancelled {
        session: id.display(),
        cancelled: n,
    }))
}
