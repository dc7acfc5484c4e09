//! The Streamable HTTP transport: one endpoint, `/mcp`.
//!
//! - `POST` carries one JSON-RPC message. A notification or a response is taken with
//!   `202 Accepted`; a request is answered with `application/json`, except a
//!   `tools/call` from a client that accepts `text/event-stream`: that answer is an event
//!   stream (kept alive with comments while a tree is waited for) of the call's progress
//!   notifications, if it asked for them (`_meta.progressToken`), then the response.
//! - `initialize` opens a session: its answer carries `Mcp-Session-Id`, which every later
//!   request must send (`400` without it, `404` for one unknown or ended). A request
//!   naming a protocol version (`MCP-Protocol-Version`) this server does not speak is
//!   refused with `400`. At most [`MAX_SESSIONS`] are open at once.
//! - `DELETE` with the session's id ends it (its requests in flight are stopped).
//! - `GET` (a stream the server opens) is not offered: `405`.
//!
//! The guard is the web view's (see `skein ui`): a token as `Authorization: Bearer …`
//! (the one given with `--auth-token` / `SKEIN_MCP_TOKEN`, else one made at start and
//! printed on stderr); `--no-auth` on loopback only, where a request must then name a
//! loopback `Host` (against DNS rebinding); and an `Origin`, when sent, must be this
//! server's own, so no other site's page can call it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc;

use super::wire::{self, code, Incoming, RpcError};
use super::{lock, Host, McpArgs, Session};
use crate::commands::ui::{check_binding, host_part, same_secret};

/// The header that names a session.
pub const SESSION_HEADER: &str = "mcp-session-id";
/// The header that names the protocol version a request speaks.
pub const VERSION_HEADER: &str = "mcp-protocol-version";
/// The largest request body read.
pub const MAX_BODY: usize = 16 << 20;
/// Sessions open at once; `initialize` is refused past it until a client ends one.
pub const MAX_SESSIONS: usize = 256;

/// How the endpoint is guarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    /// `--auth-token` / `SKEIN_MCP_TOKEN`: known to whoever gave it, never printed.
    Given(String),
    /// Made here and printed on stderr.
    Made(String),
    /// `--no-auth` (loopback only).
    Off,
}

impl Auth {
    /// The guard for `addr`, refusing what the web view refuses: another address than
    /// loopback without a token, and a token too short.
    pub fn settle(addr: &SocketAddr, a: &McpArgs) -> Result<Self> {
        let how = match a.auth_token.clone().filter(|t| !t.is_empty()) {
            Some(t) => Auth::Given(t),
            None if a.no_auth => Auth::Off,
            None => Auth::Made(random_token()),
        };
        check_binding(addr, how.token()).map_err(|e| {
            anyhow::anyhow!(
                "{}",
                e.to_string()
                    .replace(
                        "--auth-token (SKEIN_UI_TOKEN)",
                        "--auth-token (SKEIN_MCP_TOKEN)"
                    )
                    .replace("SKEIN_UI_TOKEN", "SKEIN_MCP_TOKEN")
            )
        })?;
        if let Some(t) = how.token() {
            crate::config::register_secrets(vec![t.to_string()]);
        }
        Ok(how)
    }

    fn token(&self) -> Option<&str> {
        match self {
            Auth::Given(t) | Auth::Made(t) => Some(t),
            Auth::Off => None,
        }
    }
}

fn random_token() -> String {
    use rand::RngCore;
    let mut b = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct Server {
    host: Arc<Host>,
    auth: Option<String>,
    loopback_only: bool,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
}

pub async fn serve(host: Arc<Host>, addr: SocketAddr, auth: Auth) -> Result<()> {
    let kind = host.kind;
    let server = Arc::new(Server {
        host,
        auth: auth.token().map(str::to_string),
        loopback_only: addr.ip().is_loopback(),
        sessions: Mutex::default(),
    });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    match &auth {
        Auth::Made(t) => crate::errln!(
            "skein mcp on http://{local}/mcp ({kind}); send `Authorization: Bearer {t}`"
        ),
        Auth::Given(_) => crate::errln!(
            "skein mcp on http://{local}/mcp ({kind}); send the token given \
             (--auth-token / SKEIN_MCP_TOKEN) as `Authorization: Bearer …`"
        ),
        Auth::Off => {
            crate::errln!(
                "warning: --no-auth: every account on this machine can start trees and \
                 answer or approve as you"
            );
            crate::errln!("skein mcp on http://{local}/mcp ({kind})");
        }
    }
    let app = router(server.clone());
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(super::super::cluster::terminated())
        .await;
    for (_, s) in lock(&server.sessions).drain() {
        s.stop_all();
    }
    served.context("the MCP HTTP server failed")
}

fn router(server: Arc<Server>) -> axum::Router {
    axum::Router::new()
        .route("/mcp", axum::routing::post(post).get(get).delete(delete))
        .layer(axum::middleware::from_fn_with_state(server.clone(), guard))
        .with_state(server)
}

fn refuse(status: StatusCode, id: Option<&wire::Id>, code: i64, why: &str) -> Response {
    let body = wire::error(id, &RpcError::new(code, why));
    (status, axum::Json(body)).into_response()
}

/// Host check, Origin check and authentication, in front of every request.
async fn guard(State(s): State<Arc<Server>>, req: Request<Body>, next: Next) -> Response {
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if s.loopback_only
        && s.auth.is_none()
        && !matches!(host_part(host), "127.0.0.1" | "localhost" | "[::1]")
    {
        return refuse(
            StatusCode::FORBIDDEN,
            None,
            code::INVALID_REQUEST,
            "this server answers only to a loopback host name (127.0.0.1, localhost, [::1])",
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let from = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or(origin);
        if from != host {
            return refuse(
                StatusCode::FORBIDDEN,
                None,
                code::INVALID_REQUEST,
                "a request from another site's page is refused (its Origin is not this server)",
            );
        }
    }
    if let Some(want) = &s.auth {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !same_secret(given.as_bytes(), want.as_bytes()) {
            let mut r = refuse(
                StatusCode::UNAUTHORIZED,
                None,
                code::INVALID_REQUEST,
                "this server needs its token: send `Authorization: Bearer <token>`",
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    next.run(req).await
}

fn accepts(headers: &HeaderMap, what: &str) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|m| m.split(';').next().unwrap_or("").trim())
        .any(|m| m == what || m == "*/*")
}

/// The session a request names, or the refusal to send.
fn session_of(s: &Server, headers: &HeaderMap) -> Result<Arc<Session>, (StatusCode, &'static str)> {
    let Some(id) = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()) else {
        return Err((
            StatusCode::BAD_REQUEST,
            "no Mcp-Session-Id header: send the id the answer to `initialize` carried",
        ));
    };
    match lock(&s.sessions).get(id) {
        Some(sess) => Ok(sess.clone()),
        None => Err((
            StatusCode::NOT_FOUND,
            "no such session (it ended, or this server restarted): initialize again",
        )),
    }
}

async fn post(State(s): State<Arc<Server>>, headers: HeaderMap, body: Bytes) -> Response {
    if !(accepts(&headers, "application/json") || accepts(&headers, "text/event-stream"))
        && headers.contains_key(header::ACCEPT)
    {
        return refuse(
            StatusCode::NOT_ACCEPTABLE,
            None,
            code::INVALID_REQUEST,
            "the client must accept application/json and text/event-stream",
        );
    }
    if body.len() > MAX_BODY {
        return refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            None,
            code::INVALID_REQUEST,
            &format!("a message longer than {MAX_BODY} bytes was refused"),
        );
    }
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                None,
                code::PARSE_ERROR,
                &format!("not JSON: {e}"),
            )
        }
    };
    let msg = match Incoming::from_value(v) {
        Ok(m) => m,
        Err(m) => {
            let body = wire::error(m.id.as_ref(), &m.error);
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    // `initialize` opens a session; everything else names one.
    if let Incoming::Request { id, method, params } = &msg {
        if method == "initialize" {
            if lock(&s.sessions).len() >= MAX_SESSIONS {
                return refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some(id),
                    code::INTERNAL_ERROR,
                    &format!(
                        "{MAX_SESSIONS} sessions are open: end one (DELETE with its \
                         Mcp-Session-Id) before starting another"
                    ),
                );
            }
            let sess = Arc::new(Session::default());
            let (tx, _rx) = mpsc::unbounded_channel();
            let Some(r) = sess
                .request(&s.host, id.clone(), method.clone(), params.clone(), tx)
                .await
            else {
                return StatusCode::ACCEPTED.into_response();
            };
            let sid = random_token();
            lock(&s.sessions).insert(sid.clone(), sess);
            let mut resp = axum::Json(r).into_response();
            if let Ok(h) = HeaderValue::from_str(&sid) {
                resp.headers_mut().insert(SESSION_HEADER, h);
            }
            return resp;
        }
    }
    let sess = match session_of(&s, &headers) {
        Ok(x) => x,
        Err((status, why)) => return refuse(status, None, code::INVALID_REQUEST, why),
    };
    if let Some(v) = headers.get(VERSION_HEADER) {
        let v = v.to_str().unwrap_or("");
        if !wire::VERSIONS.contains(&v) {
            return refuse(
                StatusCode::BAD_REQUEST,
                None,
                code::INVALID_REQUEST,
                &format!(
                    "MCP-Protocol-Version `{}` is not spoken here; this server speaks {}",
                    crate::render::safe_line(v),
                    wire::VERSIONS.join(", ")
                ),
            );
        }
    }
    let (id, method, params) = match msg {
        Incoming::Notification { method, params } => {
            sess.notified(&method, &params);
            return StatusCode::ACCEPTED.into_response();
        }
        Incoming::Response { .. } => return StatusCode::ACCEPTED.into_response(),
        Incoming::Request { id, method, params } => (id, method, params),
    };
    // A tool call may wait for a tree a long while: its answer is a stream (kept alive)
    // when the client takes one, so no client gives up on a silent connection.
    let streams = method == "tools/call" && accepts(&headers, "text/event-stream");
    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    if !streams {
        // Progress goes nowhere on a plain JSON answer.
        return match sess.request(&s.host, id, method, params, tx).await {
            Some(r) => axum::Json(r).into_response(),
            None => StatusCode::ACCEPTED.into_response(),
        };
    }
    let host = s.host.clone();
    tokio::spawn(async move {
        let gone = tx.clone();
        tokio::select! {
            r = sess.request(&host, id, method, params, tx.clone()) => {
                if let Some(r) = r {
                    let _ = tx.send(r);
                }
            }
            // The client dropped the stream: the request stops (see `Session::request`).
            _ = gone.closed() => {}
        }
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        let v = rx.recv().await?;
        Some((
            Ok::<_, Infallible>(Event::default().event("message").data(v.to_string())),
            rx,
        ))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn get() -> Response {
    let mut r = refuse(
        StatusCode::METHOD_NOT_ALLOWED,
        None,
        code::INVALID_REQUEST,
        "this server opens no stream of its own: POST requests to /mcp",
    );
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("POST, DELETE"));
    r
}

async fn delete(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response {
    let sess = match session_of(&s, &headers) {
        Ok(x) => x,
        Err((status, why)) => return refuse(status, None, code::INVALID_REQUEST, why),
    };
    sess.stop_all();
    if let Some(id) = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()) {
        lock(&s.sessions).remove(id);
    }
    StatusCode::NO_CONTENT.into_response()
}
