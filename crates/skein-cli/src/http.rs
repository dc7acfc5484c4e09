//! The worker's HTTP listener (`skein worker --http ADDR`, or `SKEIN_HTTP_ADDR`):
//!
//! - `/healthz`: 200 while the process answers (liveness);
//! - `/readyz`: 200 when the worker is connected to NATS, every stream it needs answers,
//!   no pool's claims are failing, every MCP server of `[mcp]` runs and it is not
//!   draining; 503 with the reason otherwise. A ready worker says below which definitions
//!   version is current, which record format it writes and reads, and what it handed back
//!   to other workers for want of it;
//! - `/metrics`: every metric of [`skein_runtime::metrics`] in the Prometheus text format.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use skein_nats::NatsStore;
use skein_runtime::metrics as m;
use skein_runtime::worker::Runtime;

/// How long a scrape waits for the depth of one pool.
const DEPTH_LIMIT: Duration = Duration::from_secs(1);

/// What the endpoints look at.
pub struct Ops {
    pub prometheus: PrometheusHandle,
    pub rt: Arc<Runtime>,
    pub store: Arc<NatsStore>,
    pub pools: Vec<String>,
    /// The MCP servers the worker started: one that will not start makes it not ready.
    pub mcp: skein_mcp::McpTools,
}

/// Installs the Prometheus recorder for the whole process: from here on the metrics the
/// runtime records are kept. Call once, before the work starts.
pub fn install_recorder() -> Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets(m::DURATION_BUCKETS)
        .context("histogram buckets")?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    for (name, help) in m::NAMES {
        if name.ends_with("_total") {
            metrics::describe_counter!(*name, *help);
        } else if name.ends_with("_seconds") {
            metrics::describe_histogram!(*name, metrics::Unit::Seconds, *help);
        } else {
            metrics::describe_gauge!(*name, *help);
        }
    }
    // Present from the first scrape, before anything happened.
    m::ready(false);
    metrics::counter!(m::NATS_RECONNECTS).increment(0);
    metrics::counter!(m::INTAKE_ACCEPTED).increment(0);
    m::gc_removed(0, 0, 0);
    Ok(handle)
}

/// Why the worker is not ready, or nothing when it is.
pub async fn readiness(ops: &Ops) -> Result<(), String> {
    let res = async {
        if ops.rt.is_draining() {
            return Err("draining: the worker is stopping".to_string());
        }
        skein_nats::health::check(&ops.store).await?;
        let failing = ops.rt.loops.health.failing();
        if !failing.is_empty() {
            let pools: Vec<String> = failing
                .iter()
                .map(|(p, d)| format!("{p} (for {:.1}s)", d.as_secs_f64()))
                .collect();
            return Err(format!("claims are failing from pool {}", pools.join(", ")));
        }
        let mcp = ops.mcp.problems();
        if !mcp.is_empty() {
            return Err(mcp.join("; "));
        }
        Ok(())
    }
    .await;
    m::ready(res.is_ok());
    res
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(ops): State<Arc<Ops>>) -> impl IntoResponse {
    match readiness(&ops).await {
        Ok(()) => (StatusCode::OK, format!("ready\n{}", detail(&ops.rt))),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// What a ready worker runs on, and what it left to others for want of it.
fn detail(rt: &Runtime) -> String {
    let v = rt.current_version();
    let mut out = format!(
        "definitions: {}\nrecord format: writes {}, reads up to {}\n",
        v.digest
            .as_deref()
            .map(skein_core::definitions::short)
            .unwrap_or("the worker's own files"),
        rt.write_format(),
        skein_core::event::read_format()
    );
    let now = skein_runtime::now_ms();
    for (need, times, at) in rt.lacking() {
        out.push_str(&format!(
            "handed back for want of {need}: {times} times, last {:.1}s ago\n",
            now.saturating_sub(at) as f64 / 1000.0
        ));
    }
    out
}

async fn metrics_text(State(ops): State<Arc<Ops>>) -> impl IntoResponse {
    let depths = futures::future::join_all(ops.pools.iter().map(|p| {
        let jobs = ops.rt.backend.jobs.clone();
        async move { (p, tokio::time::timeout(DEPTH_LIMIT, jobs.depth(p)).await) }
    }))
    .await;
    for (pool, d) in depths {
        // A depth that cannot be read now keeps its last value.
        if let Ok(Ok(n)) = d {
            m::queue_depth(pool, n);
        }
    }
    let _ = readiness(&ops).await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        ops.prometheus.render(),
    )
}

/// Listens on `addr` and serves the endpoints in the background; returns the address
/// bound (the port chosen when `addr` asks for port 0) and the serving task.
pub async fn serve(
    addr: SocketAddr,
    ops: Arc<Ops>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (--http / SKEIN_HTTP_ADDR)"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(ops);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the health and metrics listener stopped");
        }
    });
    Ok((bound, task))
}
