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
use skein_runtime::inspect::{fold_records, summarize, tree_rows};
use skein_runtime::replay::{fork, verify_tree, ForkSpec};
use skein_runtime::worker::{Runtime, Submission};
use skein_runtime::{hitl, Error, TokenRefusal};
use utoipa::{IntoParams, OpenApi, ToSchema};

use super::{Ui, AUTH_COOKIE};
use crate::render;

mod inbox;
mod logs;
mod trees;

use inbox::*;
use logs::*;
use trees::*;

/// A refusal or a failure, as `{"error": "..."}` with a status that says whose it was;
/// a refused token also names why (`{"error": "...", "refusal": "stale"}`).
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String, pub Option<TokenRefusal>);

impl ApiError {
    fn new(status: StatusCode, text: impl Into<String>) -> Self {
        ApiError(status, text.into(), None)
    }
}

#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// What was wrong, in words.
    pub error: String,
    /// Why a token was refused: `malformed`, `forged`, `wrong_kind`, `no_session`,
    /// `ended`, `stale`, `reused` or `misdirected`. Absent for anything but a token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let text = crate::config::scrub(&self.1);
        let body = ErrorBody {
            error: text,
            refusal: self.2.map(|r| r.as_str().to_string()),
        };
        (self.0, Json(body)).into_response()
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
        ApiError(status, e.report().to_string(), e.token_refusal())
    }
}

impl From<skein_core::Error> for ApiError {
    fn from(e: skein_core::Error) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, e.to_string())
    }
}

fn bad(why: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, why)
}

fn not_found(id: &SessionId) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no session {}", id.display()),
    )
}

type ApiResult<T> = std::result::Result<Json<T>, ApiError>;

impl Ui {
    fn runtime(&self) -> Result<&Arc<Runtime>, ApiError> {
        self.rt.as_ref().map_err(|why| {
            ApiError::new(
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

fn json<T: Serialize>(v: &T) -> Result<Value, ApiError> {
    serde_json::to_value(v)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
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
        .route("/api/trees/{root}/cancel", post(cancel_tree))
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
        cancel_tree,
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
        Cancel,
        Cancelled,
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
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
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
        Some(_) => ApiError::new(StatusCode::UNAUTHORIZED, "wrong token").into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    }
}
