//! `skein ui`: a web view of trees, live, replayable and answerable.
//!
//! One axum server: the page (plain HTML, JS and CSS embedded in the binary, see
//! [`assets`]) and the JSON API under `/api` it uses, documented as OpenAPI at
//! `/api/openapi.json` (see [`api`]).
//!
//! On the embedded store this process is the store's only user (sled admits one), so it
//! hosts the runtime as `skein run` does: its work loops run the trees started, answered,
//! approved or forked from the page, and any job an interrupted run left in the queue.
//! With `--nats` it reads the cluster and hands work to the cluster's workers.
//!
//! Security:
//! - every `/api` call needs a token, asked as `Authorization: Bearer …` or the cookie
//!   `/api/login` sets: the one given (`--auth-token` or `SKEIN_UI_TOKEN`), else a random
//!   one made at start and printed in the URL the page is opened with (the page logs in
//!   with it and drops it from the address bar), so another account on a shared machine
//!   cannot read the inbox or answer for you;
//! - `--no-auth` serves without a token, on loopback only, with a warning;
//! - without a token, a request must name a loopback host (`Host`), so a page of another
//!   site cannot reach the API through a DNS name rebound to 127.0.0.1;
//! - every request that changes something carries the per-process token of `/api/info` in
//!   `X-Skein-Csrf` (a header another site's page cannot set without a CORS preflight this
//!   server never grants), and an `Origin`, when sent, must be this server's;
//! - the page puts model text into the document as text only (`textContent`).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use clap::Args;
use skein_core::{AgentSet, Limits};
use skein_runtime::worker::Runtime;
use skein_runtime::Backend;
use skein_sled::SledStore;
use tokio::sync::{broadcast, watch};

use crate::app::App;

pub mod api;
mod assets;
mod live;

pub use live::Live;

/// Header that carries the per-process CSRF token on every request that changes state.
pub const CSRF_HEADER: &str = "x-skein-csrf";
/// Cookie that carries the auth token after `/api/login`.
pub const AUTH_COOKIE: &str = "skein_ui_auth";
/// Shortest `--auth-token` accepted.
pub const MIN_AUTH_TOKEN: usize = 16;

#[derive(Args, Debug)]
pub struct UiArgs {
    /// Address to serve on. Port 0 picks a free port (the address is printed on stderr).
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
    pub addr: SocketAddr,
    /// Token a browser or script must present (16+ characters); required when --addr is
    /// not a loopback address. Prefer the environment variable: a flag shows in the
    /// process list.
    #[arg(
        long,
        env = "SKEIN_UI_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub auth_token: Option<String>,
    /// Serve without a token (loopback only): every account on this machine can then read
    /// the trees and answer or approve for you. Without it and without --auth-token, a
    /// random token is made and printed in the URL.
    #[arg(long, conflicts_with = "auth_token")]
    pub no_auth: bool,
    /// Jobs worked on at once on the embedded store (default from config).
    #[arg(long)]
    pub concurrency: Option<usize>,
}

/// What every handler shares.
pub struct Ui {
    pub backend: Backend,
    /// The runtime that answers, approves, starts and forks; `Err` says why there is none
    /// (on NATS without `SKEIN_TOKEN_SECRET`), and the page stays read-only.
    pub rt: std::result::Result<Arc<Runtime>, String>,
    pub agents: Arc<AgentSet>,
    pub limits: Limits,
    /// `embedded` or `nats`.
    pub kind: &'static str,
    pub csrf: String,
    pub auth: Option<String>,
    /// Only loopback `Host`s are served (loopback binding without a token).
    pub loopback_only: bool,
    pub live: broadcast::Sender<Live>,
    /// Flips to true when the server stops: live streams end so the server can.
    pub stopping: watch::Receiver<bool>,
    /// On NATS, where trees' announced results are read (stream `SKEIN_RESULTS`).
    pub results: Option<Arc<skein_nats::NatsStore>>,
    /// The embedded store, whose retention totals `/metrics` shows.
    pub store: Option<Arc<SledStore>>,
}

/// Refuses an address other than loopback without a token, and a token too short to
/// guess slowly.
pub fn check_binding(addr: &SocketAddr, token: Option<&str>) -> Result<()> {
    match token {
        Some(t) if t.len() < MIN_AUTH_TOKEN => anyhow::bail!(
            "--auth-token (SKEIN_UI_TOKEN) is {} characters; at least {MIN_AUTH_TOKEN} are needed",
            t.len()
        ),
        None if !addr.ip().is_loopback() => anyhow::bail!(
            "--addr {addr} is not a loopback address: anyone who reaches it could read every \
             tree and answer for you; drop --no-auth (a token is then made and printed), \
             pass --auth-token (or set SKEIN_UI_TOKEN, 16+ characters), or serve on 127.0.0.1"
        ),
        _ => Ok(()),
    }
}

/// A random token of 32 hex digits.
fn random_token() -> String {
    use rand::RngCore;
    let mut b = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Compares two secrets in time that does not depend on where they differ.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How the server is guarded.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// `--auth-token` / `SKEIN_UI_TOKEN`: known to whoever gave it, never printed.
    Given(String),
    /// Made here and printed in the URL.
    Made(String),
    /// `--no-auth`.
    Off,
}

impl Auth {
    fn of(a: &UiArgs) -> Self {
        match a.auth_token.clone().filter(|t| !t.is_empty()) {
            Some(t) => Auth::Given(t),
            None if a.no_auth => Auth::Off,
            None => Auth::Made(format!("{}{}", random_token(), random_token())),
        }
    }

    fn token(&self) -> Option<&str> {
        match self {
            Auth::Given(t) | Auth::Made(t) => Some(t),
            Auth::Off => None,
        }
    }
}

pub async fn ui(app: &App, a: UiArgs) -> Result<ExitCode> {
    let how = Auth::of(&a);
    let auth = how.token().map(str::to_string);
    check_binding(&a.addr, auth.as_deref())?;
    if let Some(t) = &auth {
        crate::config::register_secrets(vec![t.clone()]);
    }
    let agents = Arc::new(app.agents()?);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (live_tx, _) = broadcast::channel(4096);
    let mut store: Option<Arc<SledStore>> = None;
    let mut workers = None;
    let mut results = None;
    let (backend, rt, kind) = if app.global.nats.is_some() {
        let nats = app.nats().await?;
        results = Some(nats.clone());
        let backend = nats.backend();
        let rt = app.runtime(backend.clone()).map_err(|e| {
            tracing::warn!(error = %e, "the page is read-only");
            format!("{e:#}")
        });
        live::follow_nats(nats.client.clone(), live_tx.clone(), stop_rx.clone()).await?;
        (backend, rt, "nats")
    } else {
        let (s, backend) = app.open_embedded()?;
        store = Some(s);
        let rt = app.runtime(backend.clone())?;
        live::follow_runtime(&rt, live_tx.clone(), stop_rx.clone());
        let conc = a.concurrency.unwrap_or(app.cfg.runtime.concurrency);
        workers = Some(rt.spawn_workers(rt.pools(), conc));
        (backend, Ok(rt), "embedded")
    };
    let ui = Arc::new(Ui {
        backend,
        rt,
        agents,
        limits: app.decision_limits()?,
        kind,
        csrf: random_token(),
        auth,
        loopback_only: a.addr.ip().is_loopback(),
        live: live_tx,
        stopping: stop_rx,
        results,
        store: store.clone(),
    });
    let listener = tokio::net::TcpListener::bind(a.addr)
        .await
        .with_context(|| format!("cannot listen on {}", a.addr))?;
    let local = listener.local_addr()?;
    match &how {
        // The URL carries the token, as a notebook server's does: the page logs in with it.
        Auth::Made(t) => crate::errln!("skein ui on http://{local}/?token={t} ({kind})"),
        Auth::Given(_) => crate::errln!(
            "skein ui on http://{local}/ ({kind}); log in with the token given \
             (--auth-token / SKEIN_UI_TOKEN)"
        ),
        Auth::Off => {
            crate::errln!(
                "warning: --no-auth: every account on this machine can read the trees and \
                 the inbox, and answer or approve as you"
            );
            crate::errln!("skein ui on http://{local}/ ({kind})");
        }
    }
    let served = axum::serve(listener, router(ui))
        .with_graceful_shutdown(async move {
            super::cluster::terminated().await;
            let _ = stop_tx.send(true);
        })
        .await;
    if let Some((stop, loops)) = workers {
        let _ = stop.send(true);
        for h in loops {
            let _ = h.await;
        }
    }
    if let Some(s) = store {
        s.flush().await?;
    }
    served.context("the web server failed")?;
    Ok(ExitCode::SUCCESS)
}

/// The whole application: page, API and the guards in front of them.
pub fn router(ui: Arc<Ui>) -> axum::Router {
    axum::Router::new()
        .merge(assets::routes())
        .merge(api::routes())
        .route("/metrics", axum::routing::get(metrics))
        .layer(axum::middleware::from_fn_with_state(ui.clone(), guard))
        .with_state(ui)
}

/// `/metrics` on the embedded store: what retention (`skein gc`) removed from it so far,
/// in the Prometheus text format, under the names a worker uses. Like a worker's, it asks
/// no token: it shows counts only. On a cluster the workers serve it (`--http`).
async fn metrics(State(ui): State<Arc<Ui>>) -> Response {
    let Some(store) = ui.store.clone() else {
        return refuse(
            StatusCode::NOT_FOUND,
            "on a cluster the workers serve /metrics (skein worker --http)",
        );
    };
    match tokio::task::spawn_blocking(move || store.removed_totals()).await {
        Ok(Ok(t)) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            retention_text(&t),
        )
            .into_response(),
        Ok(Err(e)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("cannot read the retention totals: {}", e.report()),
        ),
        Err(e) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("cannot read the retention totals: {e}"),
        ),
    }
}

/// The retention totals as Prometheus counters, with the help texts of
/// [`skein_runtime::metrics::NAMES`].
fn retention_text(t: &skein_sled::gc::RemovedTotals) -> String {
    use skein_runtime::metrics as m;
    let mut out = String::new();
    for (name, n) in [
        (m::GC_REMOVED_TREES, t.trees),
        (m::GC_REMOVED_SESSIONS, t.sessions),
        (m::GC_REMOVED_BYTES, t.bytes),
    ] {
        let help = m::NAMES
            .iter()
            .find(|(k, _)| *k == name)
            .map_or("", |(_, h)| *h);
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {n}\n"
        ));
    }
    out
}

fn refuse(status: StatusCode, why: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": why }))).into_response()
}

/// The host part of a `Host` or `Origin` value (`[::1]:8080` → `[::1]`).
pub(crate) fn host_part(v: &str) -> &str {
    let v = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .unwrap_or(v);
    if v.starts_with('[') {
        return v.split_inclusive(']').next().unwrap_or(v);
    }
    v.split(':').next().unwrap_or(v)
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Whether the request presents the auth token, as a bearer or as the login cookie.
pub fn authorised(ui: &Ui, headers: &HeaderMap) -> bool {
    let Some(want) = &ui.auth else { return true };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    [bearer, cookie(headers, AUTH_COOKIE)]
        .into_iter()
        .flatten()
        .any(|t| same_secret(t.as_bytes(), want.as_bytes()))
}

/// Host check, authentication and CSRF, in front of every route.
async fn guard(State(ui): State<Arc<Ui>>, req: Request<Body>, next: Next) -> Response {
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if ui.loopback_only
        && ui.auth.is_none()
        && !matches!(host_part(host), "127.0.0.1" | "localhost" | "[::1]")
    {
        return refuse(
            StatusCode::FORBIDDEN,
            "this server answers only to a loopback host name (127.0.0.1, localhost, [::1])",
        );
    }
    let path = req.uri().path();
    let api = path.starts_with("/api/");
    let open = !api || path == "/api/login" || path == "/api/openapi.json";
    if !open && !authorised(&ui, headers) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "this server needs its token: send `Authorization: Bearer <token>` or log in \
             on the page",
        );
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) && path != "/api/login" {
        let given = headers
            .get(CSRF_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !same_secret(given.as_bytes(), ui.csrf.as_bytes()) {
            return refuse(
                StatusCode::FORBIDDEN,
                "missing or wrong X-Skein-Csrf header: take `csrf` from GET /api/info",
            );
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let from = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or(origin);
        if req.method() != Method::GET && from != host {
            return refuse(
                StatusCode::FORBIDDEN,
                "a request from another site's page is refused",
            );
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_addresses_need_a_long_enough_token() {
        let lo: SocketAddr = "127.0.0.1:8080".parse().unwrap_or_else(|_| unreachable!());
        let any: SocketAddr = "0.0.0.0:8080".parse().unwrap_or_else(|_| unreachable!());
        assert!(check_binding(&lo, None).is_ok());
        let e = check_binding(&any, None).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("--no-auth")),
            "{e:?}"
        );
        let e = check_binding(&any, Some("short"))
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("at least 16")),
            "{e:?}"
        );
        assert!(check_binding(&any, Some("0123456789abcdef")).is_ok());
    }

    #[test]
    fn host_parts() {
        assert_eq!(host_part("127.0.0.1:8080"), "127.0.0.1");
        assert_eq!(host_part("localhost"), "localhost");
        assert_eq!(host_part("[::1]:80"), "[::1]");
        assert_eq!(host_part("http://evil.example:8080"), "evil.example");
    }

    #[test]
    fn retention_totals_read_as_prometheus_counters() {
        let text = retention_text(&skein_sled::gc::RemovedTotals {
            trees: 3,
            sessions: 7,
            bytes: 4096,
        });
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            samples,
            [
                "skein_gc_removed_trees_total 3",
                "skein_gc_removed_sessions_total 7",
                "skein_gc_removed_bytes_total 4096"
            ]
        );
        assert!(
            text.contains("# TYPE skein_gc_removed_bytes_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP skein_gc_removed_trees_total Finished trees"),
            "{text}"
        );
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
    }
}
