//! `skein mcp`: skein as a Model Context Protocol server, so that any MCP client (a
//! desktop assistant, an IDE's agent, another framework) can start trees, read them, and
//! answer what waits for a person.
//!
//! Two transports: stdio (the default: one JSON-RPC message a line on stdin and stdout,
//! diagnostics on stderr; see [`stdio`]) and Streamable HTTP with `--http ADDR` (one
//! endpoint, `/mcp`, guarded by the web view's token rules; see [`http`]). The tools are
//! in [`tools`], the messages in [`wire`].
//!
//! As `skein ui` does, on the embedded store this process hosts the runtime (its work
//! loops run the trees started or answered through it, and any job an interrupted run
//! left queued); with `--nats` it hands work to the cluster's workers and reads the
//! cluster's logs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};
use skein_runtime::worker::Runtime;
use skein_runtime::Backend;
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::AbortHandle;

use crate::app::App;

pub mod http;
pub mod stdio;
pub mod tools;
pub mod wire;

use wire::{code, Id, RpcError};

#[derive(Args, Debug)]
pub struct McpArgs {
    /// Serve Streamable HTTP on this address (endpoint `/mcp`) instead of stdio. Port 0
    /// picks a free port (the address is printed on stderr).
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// With --http: the token a client must send as `Authorization: Bearer …` (16+
    /// characters); required when the address is not a loopback address. Prefer the
    /// environment variable: a flag shows in the process list.
    /// Over stdio it is not used (the client started this process), so the variable may
    /// stay set.
    #[arg(
        long,
        env = "SKEIN_MCP_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub auth_token: Option<String>,
    /// With --http: serve without a token (loopback only). Without it and without
    /// --auth-token, a random token is made and printed on stderr.
    #[arg(long, conflicts_with = "auth_token", requires = "http")]
    pub no_auth: bool,
    /// Jobs worked on at once on the embedded store (default from config).
    #[arg(long)]
    pub concurrency: Option<usize>,
}

/// What every request shares.
pub struct Host {
    pub backend: Backend,
    pub rt: Arc<Runtime>,
    /// `embedded` or `nats`.
    pub kind: &'static str,
}

/// One client's conversation: what `initialize` settled, and the requests in flight (so
/// that `notifications/cancelled` can stop one).
#[derive(Default)]
pub struct Session {
    version: Mutex<Option<&'static str>>,
    client: Mutex<Option<String>>,
    in_flight: Mutex<HashMap<Id, AbortHandle>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    /// The protocol version `initialize` settled on, if it was called.
    pub fn version(&self) -> Option<&'static str> {
        *lock(&self.version)
    }

    /// Who answers and decides through this session, as the log records it.
    fn who(&self) -> Option<String> {
        let client = lock(&self.client).clone();
        Some(format!("mcp:{}", client.as_deref().unwrap_or("client")))
    }

    /// Stops every request in flight (the client went away).
    pub fn stop_all(&self) {
        for (_, h) in lock(&self.in_flight).drain() {
            h.abort();
        }
    }

    /// Answers a request; `None` when it was cancelled (no response is sent then).
    /// Notifications the request makes (progress) go to `out`.
    pub async fn request(
        self: &Arc<Self>,
        host: &Arc<Host>,
        id: Id,
        method: String,
        params: Value,
        out: UnboundedSender<Value>,
    ) -> Option<Value> {
        let (me, host2, id2) = (self.clone(), host.clone(), id.clone());
        let task = tokio::spawn(async move {
            match me.answer(&host2, &method, params, out).await {
                Ok(v) => wire::result(&id2, v),
                Err(e) => wire::error(Some(&id2), &e),
            }
        });
        lock(&self.in_flight).insert(id.clone(), task.abort_handle());
        // Should the caller stop waiting (an HTTP client that went away), the request
        // stops too.
        let _leave = Leave {
            session: self,
            id: &id,
            task: task.id(),
        };
        let r = task.await;
        match r {
            Ok(v) => Some(v),
            Err(e) if e.is_cancelled() => None,
            Err(e) => Some(wire::error(
                Some(&id),
                &RpcError::new(code::INTERNAL_ERROR, format!("the request failed: {e}")),
            )),
        }
    }

    /// Takes a notification from the client.
    pub fn notified(&self, method: &str, params: &Value) {
        if method == "notifications/cancelled" {
            let Some(id) = params
                .get("requestId")
                .and_then(|v| serde_json::from_value::<Id>(v.clone()).ok())
            else {
                return;
            };
            if let Some(h) = lock(&self.in_flight).remove(&id) {
                tracing::debug!(?id, "request cancelled by the client");
                h.abort();
            }
        }
        // `notifications/initialized` and anything else need nothing.
    }

    async fn answer(
        &self,
        host: &Arc<Host>,
        method: &str,
        params: Value,
        out: UnboundedSender<Value>,
    ) -> Result<Value, RpcError> {
        match method {
            "initialize" => return Ok(self.initialize(&params)),
            "ping" => return Ok(json!({})),
            _ => {}
        }
        if self.version().is_none() {
            return Err(RpcError::new(
                code::NOT_INITIALIZED,
                format!("`{method}` before `initialize`: initialize the session first"),
            ));
        }
        match method {
            "tools/list" => Ok(json!({ "tools": tools::list() })),
            "tools/call" => {
                let Some(name) = params.get("name").and_then(Value::as_str) else {
                    return Err(RpcError::new(
                        code::INVALID_PARAMS,
                        "tools/call needs `name`, the tool's name (see tools/list)",
                    ));
                };
                let a = params.get("arguments").cloned().unwrap_or(Value::Null);
                if !(a.is_null() || a.is_object()) {
                    return Err(RpcError::new(
                        code::INVALID_PARAMS,
                        "tools/call: `arguments` must be an object",
                    ));
                }
                let progress =
                    wire::progress_token(&params).map(|t| tools::ProgressSink::new(t, out));
                tools::call(host, name, a, self.who(), progress).await
            }
            other => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!(
                    "no method `{}` here: this server offers tools only (tools/list, \
                     tools/call) and ping",
                    crate::render::safe_line(other)
                ),
            )),
        }
    }

    fn initialize(&self, params: &Value) -> Value {
        let asked = params.get("protocolVersion").and_then(Value::as_str);
        let version = wire::negotiate(asked);
        *lock(&self.version) = Some(version);
        let client: String = params["clientInfo"]["name"]
            .as_str()
            .unwrap_or("client")
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c))
            .take(64)
            .collect();
        *lock(&self.client) = Some(client);
        json!({
            "protocolVersion": version,
            "capabilities": { "tools": { "listChanged": false } },
            "serverInfo": {
                "name": "skein",
                "title": "skein",
                "version": env!("CARGO_PKG_VERSION"),
            },
            "instructions": "Start trees of agents with start_tree (it waits for the answer \
                unless told not to), read them with tree_status, and answer what waits for a \
                person with list_inbox, answer_question, approve and deny.",
        })
    }
}

/// Stops a request and forgets it once its caller is done with it, however it ended.
struct Leave<'a> {
    session: &'a Session,
    id: &'a Id,
    task: tokio::task::Id,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut in_flight = lock(&self.session.in_flight);
        // Only this request's own entry (a client may reuse an id once it was answered).
        if in_flight.get(self.id).is_some_and(|h| h.id() == self.task) {
            if let Some(h) = in_flight.remove(self.id) {
                h.abort();
            }
        }
    }
}

pub async fn mcp(app: &App, a: McpArgs) -> Result<ExitCode> {
    // Checked before anything is opened.
    let auth = match a.http {
        Some(addr) => Some(http::Auth::settle(&addr, &a)?),
        None => None,
    };
    let mut store = None;
    let mut workers = None;
    let (backend, rt, kind) = if app.global.nats.is_some() {
        let nats = app.nats().await?;
        let backend = nats.backend();
        let rt = app.runtime(backend.clone())?;
        (backend, rt, "nats")
    } else {
        let (s, backend) = app.open_embedded()?;
        store = Some(s);
        let rt = app.runtime(backend.clone())?;
        let conc = a.concurrency.unwrap_or(app.cfg.runtime.concurrency);
        workers = Some(rt.spawn_workers(rt.pools(), conc));
        (backend, rt, "embedded")
    };
    let host = Arc::new(Host { backend, rt, kind });
    let served = match (a.http, auth) {
        (Some(addr), Some(auth)) => http::serve(host, addr, auth).await,
        _ => stdio::serve(host).await,
    };
    if let Some((stop, loops)) = workers {
        let _ = stop.send(true);
        for h in loops {
            let _ = h.await;
        }
    }
    if let Some(s) = store {
        s.flush().await?;
    }
    served?;
    Ok(ExitCode::SUCCESS)
}
