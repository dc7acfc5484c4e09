//! The JSON API under `/api` that the page uses, and its OpenAPI document.
//!
//! Every view is one of the runtime's own: the rows of `skein tree` / `skein sessions`
//! ([`skein_runtime::inspect`]), the inbox and the token checks of `skein inbox` /
//! `answer` / `approve` / `deny` ([`skein_runtime::hitl`]), the verdict of
//! `replay --verify`, `fork` ([`skein_runtime::replay`]) and the audit export
//! ([`skein_runtime::audit`]).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use skein_core::{Event, Record, SessionId, SessionState};
use skein_runtime::inspect::{fold_records, row, summarize, tree_rows};
use skein_runtime::replay::{fork, verify_tree, ForkSpec};
use skein_runtime::worker::{Runtime, Submission};
use skein_runtime::{hitl, Error};
use utoipa::{IntoParams, OpenApi, ToSchema};

use super::{Ui, AUTH_COOKIE};
use crate::render;

/// A refusal or a failure, as `{"error": "..."}` with a status that says whose it was.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// What was wrong, in words.
    pub error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let text = crate::config::scrub(&self.1);
        (self.0, Json(ErrorBody { error: text })).into_response()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::Refused { .. } | Error::Core(_) => StatusCode::BAD_REQUEST,
            Error::IdTaken { .. } | Error::Conflict { .. } => StatusCode::CONFLICT,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.report().to_string())
    }
}

impl From<skein_core::Error> for ApiError {
    fn from(e: skein_core::Error) -> Self {
        ApiError(StatusCode::BAD_REQUEST, e.to_string())
    }
}

fn bad(why: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, why.into())
}

fn not_found(id: &SessionId) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!("no session {}", id.display()),
    )
}

type ApiResult<T> = std::result::Result<Json<T>, ApiError>;

impl Ui {
    fn runtime(&self) -> Result<&Arc<Runtime>, ApiError> {
        self.rt.as_ref().map_err(|why| {
            ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("this server is read-only: {why}"),
            )
        })
    }

    async fn records(&self, id: &SessionId) -> Result<Vec<Record>, ApiError> {
        let records = self.backend.log.read(id, 1).await?;
        if records.is_empty() {
            return Err(not_found(id));
        }
        Ok(records)
    }
}

fn session_id(s: &str) -> Result<SessionId, ApiError> {
    Ok(SessionId::parse(s)?)
}

/// Who answered, as recorded in the log.
fn who() -> Option<String> {
    Some(match std::env::var("USER") {
        Ok(u) => format!("ui:{u}"),
        Err(_) => "ui".into(),
    })
}

pub fn routes() -> Router<Arc<Ui>> {
    Router::new()
        .route("/api/openapi.json", get(openapi))
        .route("/api/info", get(info))
        .route("/api/login", post(login))
        .route("/api/sessions", get(sessions).post(start))
        .route("/api/trees/{root}", get(tree))
        .route("/api/trees/{root}/timeline", get(timeline))
        .route("/api/trees/{root}/audit", get(audit))
        .route("/api/sessions/{id}/events", get(events))
        .route("/api/sessions/{id}/state", get(state))
        .route("/api/sessions/{id}/verify", get(verify))
        .route("/api/sessions/{id}/plan", get(plan))
        .route("/api/sessions/{id}/fork", post(fork_session))
        .route("/api/inbox", get(inbox))
        .route("/api/answer", post(answer))
        .route("/api/approve", post(approve))
        .route("/api/live", get(super::live::live))
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "skein ui",
        description = "The JSON API of `skein ui`: trees, sessions, their logs and states, \
            the inbox, and the live feed. Session ids in paths are percent-encoded \
            (`root%2Fresearcher-1`). Requests that change something must carry the header \
            `X-Skein-Csrf` with the `csrf` of GET /api/info; a server started with \
            --auth-token also wants `Authorization: Bearer <token>` (or the cookie \
            POST /api/login sets)."
    ),
    paths(
        info,
        login,
        sessions,
        start,
        tree,
        timeline,
        audit,
        events,
        state,
        verify,
        plan,
        fork_session,
        inbox,
        answer,
        approve,
        super::live::live
    ),
    components(schemas(
        ErrorBody,
        Info,
        AgentInfo,
        Login,
        Start,
        Started,
        TreeView,
        Timeline,
        Step,
        EventView,
        StateView,
        Verdicts,
        PlanView,
        PlanChange,
        Fork,
        Answer,
        Decision,
        super::Live
    ))
)]
pub struct ApiDoc;

/// The OpenAPI document of this API.
async fn openapi() -> Response {
    match ApiDoc::openapi().to_pretty_json() {
        Ok(s) => ([(header::CONTENT_TYPE, "application/json")], s).into_response(),
        Err(e) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[derive(Serialize, ToSchema)]
pub struct AgentInfo {
    pub name: String,
    pub description: String,
}

#[derive(Serialize, ToSchema)]
pub struct Info {
    /// `embedded` or `nats`.
    pub backend: String,
    /// The token to send as `X-Skein-Csrf` with every POST.
    pub csrf: String,
    /// Whether answers, approvals, new trees and forks are possible here.
    pub writable: bool,
    /// Why not, when they are not.
    pub read_only_reason: Option<String>,
    pub agents: Vec<AgentInfo>,
    pub version: String,
}

/// What this server is, and the CSRF token of this process.
#[utoipa::path(get, path = "/api/info", tag = "meta",
    responses((status = 200, body = Info), (status = 401, body = ErrorBody)))]
async fn info(State(ui): State<Arc<Ui>>) -> Json<Info> {
    Json(Info {
        backend: ui.kind.into(),
        csrf: ui.csrf.clone(),
        writable: ui.rt.is_ok(),
        read_only_reason: ui.rt.as_ref().err().cloned(),
        agents: ui
            .agents
            .agents
            .iter()
            .map(|(name, d)| AgentInfo {
                name: name.clone(),
                description: d.front.description.clone(),
            })
            .collect(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

#[derive(Deserialize, ToSchema)]
pub struct Login {
    pub token: String,
}

/// Trades the server's token for an HttpOnly, SameSite=Strict cookie (for the page and
/// its live feed, which cannot send headers).
#[utoipa::path(post, path = "/api/login", tag = "meta", request_body = Login,
    responses((status = 204, description = "cookie set"), (status = 401, body = ErrorBody)))]
async fn login(State(ui): State<Arc<Ui>>, Json(l): Json<Login>) -> Response {
    match &ui.auth {
        Some(want) if super::same_secret(l.token.as_bytes(), want.as_bytes()) => (
            StatusCode::NO_CONTENT,
            [(
                header::SET_COOKIE,
                format!(
                    "{AUTH_COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
                    l.token
                ),
            )],
        )
            .into_response(),
        Some(_) => ApiError(StatusCode::UNAUTHORIZED, "wrong token".into()).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    }
}

#[derive(Deserialize, IntoParams)]
pub struct SessionsQuery {
    /// Only roots in this status (`running`, `awaiting_input`, `completed`, …).
    pub status: Option<String>,
    /// Only roots of this agent.
    pub agent: Option<String>,
    /// Only roots started at or after this time (ms since the Unix epoch).
    pub since: Option<u64>,
    /// Only roots whose mission contains this text (any case).
    pub q: Option<String>,
    /// At most this many, newest first (default 100).
    pub limit: Option<usize>,
}

/// Root sessions, newest first: the rows of `skein sessions --json`.
#[utoipa::path(get, path = "/api/sessions", tag = "trees", params(SessionsQuery),
    responses((status = 200, description = "SessionRow objects, as `skein sessions --json`",
        body = Vec<Object>)))]
async fn sessions(State(ui): State<Arc<Ui>>, Query(q): Query<SessionsQuery>) -> ApiResult<Value> {
    let needle =
        q.q.as_deref()
            .map(str::to_lowercase)
            .filter(|s| !s.is_empty());
    let mut rows = vec![];
    for id in ui.backend.log.roots().await? {
        let records = ui.backend.log.read(&id, 1).await?;
        let f = fold_records(&id, &records)?;
        let r = row(&id, &records, &f.state);
        let keep = q
            .status
            .as_deref()
            .is_none_or(|s| s.is_empty() || r.status == s)
            && q.agent
                .as_deref()
                .is_none_or(|a| a.is_empty() || r.agent == a)
            && q.since.is_none_or(|t| r.started_at >= t)
            && needle
                .as_deref()
                .is_none_or(|n| r.mission.to_lowercase().contains(n));
        if keep {
            rows.push(r);
        }
    }
    rows.sort_by_key(|r| std::cmp::Reverse(r.started_at));
    rows.truncate(q.limit.unwrap_or(100));
    Ok(Json(
        serde_json::to_value(rows).map_err(|e| bad(e.to_string()))?,
    ))
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
async fn start(State(ui): State<Arc<Ui>>, Json(s): Json<Start>) -> ApiResult<Started> {
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
}

fn json<T: Serialize>(v: &T) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// One tree: every session, summarised (as `skein tree --json`).
#[utoipa::path(get, path = "/api/trees/{root}", tag = "trees",
    params(("root" = String, Path, description = "root session id")),
    responses((status = 200, body = TreeView), (status = 404, body = ErrorBody)))]
async fn tree(State(ui): State<Arc<Ui>>, Path(root): Path<String>) -> ApiResult<TreeView> {
    let root = session_id(&root)?.root_id();
    let rows = tree_rows(&ui.backend, &root).await?;
    if rows.is_empty() {
        return Err(not_found(&root));
    }
    let records = ui.records(&root).await?;
    let f = fold_records(&root, &records)?;
    Ok(Json(TreeView {
        root: root.display(),
        summary: json(&summarize(&rows))?,
        sessions: json(&rows)?,
        plan: json(&f.state.plan)?,
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
async fn timeline(State(ui): State<Arc<Ui>>, Path(root): Path<String>) -> ApiResult<Vec<Timeline>> {
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
async fn audit(State(ui): State<Arc<Ui>>, Path(root): Path<String>) -> Result<Response, ApiError> {
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
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
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

#[derive(Serialize, ToSchema)]
pub struct EventView {
    pub seq: u64,
    /// ms since the Unix epoch.
    pub at: u64,
    pub kind: String,
    /// One readable line, as `skein events` prints it.
    pub line: String,
    pub hash: String,
    /// The whole event.
    #[schema(value_type = Object)]
    pub body: Value,
}

/// A session's log, readable and whole.
#[utoipa::path(get, path = "/api/sessions/{id}/events", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded")),
    responses((status = 200, body = Vec<EventView>), (status = 404, body = ErrorBody)))]
async fn events(State(ui): State<Arc<Ui>>, Path(id): Path<String>) -> ApiResult<Vec<EventView>> {
    let id = session_id(&id)?;
    let records = ui.records(&id).await?;
    let t0 = records.first().map(|r| r.env.at).unwrap_or(0);
    Ok(Json(
        records
            .iter()
            .map(|r| EventView {
                seq: r.env.seq,
                at: r.env.at,
                kind: r.env.body.kind().to_string(),
                line: render::event_line(r, t0),
                hash: r.hash(),
                body: r.env.body.to_json(),
            })
            .collect(),
    ))
}

#[derive(Deserialize, IntoParams)]
pub struct AtQuery {
    /// The seq to fold up to (default: the last).
    pub at: Option<u64>,
}

#[derive(Serialize, ToSchema)]
pub struct StateView {
    pub session: String,
    pub at: u64,
    pub last_seq: u64,
    /// The folded SessionState (as `skein replay --at N --json`): `transcript`
    /// (messages), `plan`, `turn` (the current turn's calls and where each stands),
    /// `children`, `pending_inputs`, `pending_approvals`, `status`, `usage_own`, …
    #[schema(value_type = Object)]
    pub state: Value,
}

/// The folded state of a session at any seq (as `skein replay --at`).
#[utoipa::path(get, path = "/api/sessions/{id}/state", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded"), AtQuery),
    responses((status = 200, body = StateView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
async fn state(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Query(q): Query<AtQuery>,
) -> ApiResult<StateView> {
    let id = session_id(&id)?;
    let records = ui.records(&id).await?;
    let last = records.len() as u64;
    let at = q.at.unwrap_or(last);
    if at < 1 || at > last {
        return Err(bad(format!(
            "at={at}: the log of {} has seqs 1..={last}",
            id.display()
        )));
    }
    let f = fold_records(&id, &records[..at as usize])?;
    Ok(Json(StateView {
        session: id.display(),
        at,
        last_seq: last,
        state: json(&f.state)?,
    }))
}

#[derive(Deserialize, IntoParams)]
pub struct VerifyQuery {
    /// Every session under this one too.
    #[serde(default)]
    pub tree: bool,
}

#[derive(Serialize, ToSchema)]
pub struct Verdicts {
    pub ok: bool,
    /// SessionVerdict objects: `session`, `events`, `ok`, `problem`, `seq`.
    #[schema(value_type = Vec<Object>)]
    pub sessions: Value,
}

/// The verdict of `skein replay --verify`: every hash chain checked, every decision
/// re-derived from the recorded outputs.
#[utoipa::path(get, path = "/api/sessions/{id}/verify", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded"), VerifyQuery),
    responses((status = 200, body = Verdicts), (status = 404, body = ErrorBody)))]
async fn verify(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Query(q): Query<VerifyQuery>,
) -> ApiResult<Verdicts> {
    let id = session_id(&id)?;
    ui.records(&id).await?;
    let verdicts = verify_tree(&ui.backend, &id, &ui.agents, &ui.limits).await?;
    let verdicts: Vec<_> = verdicts
        .into_iter()
        .filter(|v| q.tree || v.session == id.display())
        .collect();
    Ok(Json(Verdicts {
        ok: verdicts.iter().all(|v| v.ok),
        sessions: json(&verdicts)?,
    }))
}

#[derive(Serialize, ToSchema)]
pub struct PlanChange {
    pub seq: u64,
    pub at: u64,
    /// `PatchApplied` or `PatchRejected`.
    pub kind: String,
    /// The agent that proposed it, and its session.
    pub agent: String,
    pub from: String,
    /// The plan's version after it (applied patches).
    pub version: Option<u64>,
    /// Why it was refused (rejected patches).
    pub reason: Option<String>,
    /// The patch's operations (applied patches).
    #[schema(value_type = Vec<Object>)]
    pub ops: Value,
}

#[derive(Serialize, ToSchema)]
pub struct PlanView {
    pub session: String,
    /// The plan now (or at `at`).
    #[schema(value_type = Object)]
    pub plan: Value,
    pub markdown: String,
    pub changes: Vec<PlanChange>,
}

/// The plan a session owns and how it changed: every patch applied or rejected.
#[utoipa::path(get, path = "/api/sessions/{id}/plan", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded"), AtQuery),
    responses((status = 200, body = PlanView), (status = 404, body = ErrorBody)))]
async fn plan(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Query(q): Query<AtQuery>,
) -> ApiResult<PlanView> {
    let id = session_id(&id)?;
    let records = ui.records(&id).await?;
    let state = SessionState::fold(
        records
            .iter()
            .map(|r| &r.env)
            .take_while(|e| q.at.is_none_or(|a| e.seq <= a)),
    );
    let mut changes = vec![];
    for r in &records {
        let (agent, from, version, reason, ops) = match &r.env.body {
            Event::PatchApplied(p) => (&p.agent, &p.from, Some(p.version), None, json(&p.ops)?),
            Event::PatchRejected(p) => (
                &p.agent,
                &p.from,
                None,
                Some(p.reason.to_string()),
                Value::Array(vec![]),
            ),
            _ => continue,
        };
        changes.push(PlanChange {
            seq: r.env.seq,
            at: r.env.at,
            kind: r.env.body.kind().to_string(),
            agent: agent.clone(),
            from: SessionId::parse(from)
                .map(|s| s.display())
                .unwrap_or_else(|_| from.clone()),
            version,
            reason,
            ops,
        });
    }
    Ok(Json(PlanView {
        session: id.display(),
        markdown: state.plan.render_markdown(),
        plan: json(&state.plan)?,
        changes,
    }))
}

#[derive(Deserialize, ToSchema)]
pub struct Fork {
    /// The last event of the source kept in the fork.
    pub at: u64,
    /// Id of the new root session.
    pub new_id: Option<String>,
    /// Continue on another model (`provider:model`).
    pub model: Option<String>,
}

/// A new root session from a prefix of this one, continued live (as `skein fork`).
#[utoipa::path(post, path = "/api/sessions/{id}/fork", tag = "actions",
    params(("id" = String, Path, description = "session id, percent-encoded")),
    request_body = Fork,
    responses((status = 200, body = Started), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
async fn fork_session(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Json(f): Json<Fork>,
) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    let source = session_id(&id)?;
    let id = fork(
        rt,
        &source,
        f.at,
        ForkSpec {
            model: f.model.filter(|m| !m.is_empty()),
            agent_text: None,
            id: f.new_id.filter(|i| !i.is_empty()),
        },
    )
    .await?;
    Ok(Json(Started {
        session: id.display(),
    }))
}

#[derive(Deserialize, IntoParams)]
pub struct InboxQuery {
    /// Only this tree (any session id of it).
    pub root: Option<String>,
}

/// Every pending question (of a root) and approval, with its token (as
/// `skein inbox --json`). An approval's `preview` is the call's whole arguments.
#[utoipa::path(get, path = "/api/inbox", tag = "inbox", params(InboxQuery),
    responses((status = 200, description = "InboxItem objects, as `skein inbox --json`",
        body = Vec<Object>), (status = 503, body = ErrorBody)))]
async fn inbox(State(ui): State<Arc<Ui>>, Query(q): Query<InboxQuery>) -> ApiResult<Value> {
    let rt = ui.runtime()?;
    let roots = match &q.root {
        Some(r) => vec![session_id(r)?.root_id()],
        None => ui.backend.log.roots().await?,
    };
    Ok(Json(json(&hitl::inbox(rt, &roots).await?)?))
}

#[derive(Deserialize, ToSchema)]
pub struct Answer {
    /// The question's token, from the inbox.
    pub token: String,
    /// One answer per question key.
    #[schema(value_type = Object)]
    pub answers: Value,
}

/// Answers a root's question (the same token checks as `skein answer`); the tree runs on.
#[utoipa::path(post, path = "/api/answer", tag = "inbox", request_body = Answer,
    responses((status = 200, body = Started, description = "the session that was answered"),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
async fn answer(State(ui): State<Arc<Ui>>, Json(a): Json<Answer>) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    let session = hitl::answer(rt, a.token.trim(), a.answers, who()).await?;
    Ok(Json(Started {
        session: session.display(),
    }))
}

#[derive(Deserialize, ToSchema)]
pub struct Decision {
    /// The approval's token, from the inbox.
    pub token: String,
    /// true to approve, false to deny.
    pub approved: bool,
    /// Why (recorded; shown to the model on a denial).
    pub reason: Option<String>,
}

/// Approves or denies a tool call (the same token checks as `skein approve` / `deny`);
/// the tree runs on.
#[utoipa::path(post, path = "/api/approve", tag = "inbox", request_body = Decision,
    responses((status = 200, body = Started, description = "the session decided on"),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
async fn approve(State(ui): State<Arc<Ui>>, Json(d): Json<Decision>) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    let reason = d.reason.filter(|r| !r.trim().is_empty());
    let session = hitl::decide_approval(rt, d.token.trim(), d.approved, reason, who()).await?;
    Ok(Json(Started {
        session: session.display(),
    }))
}
