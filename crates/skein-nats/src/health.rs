//! The connection's health: what the client reports about its connection (logged, and
//! counted as reconnects), and the readiness check behind a worker's `/readyz`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::Event;

use crate::backend::{
    NatsStore, EVENTS, JOBS, MISSIONS, NOTICES, RESULTS, ROOTS, ROOT_OPEN, ROOT_STATE, TREES,
};

/// The streams a worker needs.
pub const STREAMS: [&str; 9] = [
    EVENTS, JOBS, NOTICES, MISSIONS, RESULTS, ROOTS, ROOT_STATE, ROOT_OPEN, TREES,
];

/// The counter of connections made again, the same name as the worker's metrics list
/// (`skein_runtime::metrics::NATS_RECONNECTS`) gives it.
pub const RECONNECTS: &str = "skein_nats_reconnects_total";

/// How long the readiness check waits for the server's answers.
pub const CHECK_LIMIT: Duration = Duration::from_secs(2);

/// The client's event callback: a lost connection and every failed attempt to make it
/// again are warnings (a worker that cannot reach NATS never goes quiet), a connection
/// made again is counted in `skein_nats_reconnects_total`.
pub fn event_logger() -> impl Fn(Event) -> std::future::Ready<()> + Send + Sync + 'static {
    let was_connected = Arc::new(AtomicBool::new(false));
    move |event: Event| {
        match &event {
            Event::Connected => {
                if was_connected.swap(true, Ordering::Relaxed) {
                    metrics::counter!(RECONNECTS).increment(1);
                    tracing::warn!("connected to NATS again");
                } else {
                    tracing::debug!("connected to NATS");
                }
            }
            Event::Disconnected => {
                tracing::warn!("lost the connection to NATS; reconnecting")
            }
            Event::ClientError(e) => {
                tracing::warn!(error = %e, "cannot reach NATS; trying again")
            }
            Event::ServerError(e) => tracing::warn!(error = %e, "NATS server error"),
            Event::LameDuckMode => {
                tracing::warn!("the NATS server is shutting down (lame duck mode)")
            }
            Event::SlowConsumer(sid) => {
                tracing::warn!(subscription = sid, "slow consumer: NATS dropped messages")
            }
            Event::Draining | Event::Closed => tracing::debug!(%event, "NATS connection"),
        }
        std::future::ready(())
    }
}

/// Why a worker is not ready, or nothing when it is: the connection is up and every stream
/// skein needs answers its info request.
pub async fn check(store: &NatsStore) -> Result<(), String> {
    match store.client.connection_state() {
        State::Connected => {}
        State::Disconnected => return Err("not connected to NATS".into()),
        State::Pending => return Err("still connecting to NATS".into()),
    }
    let infos = store.streams_within(&STREAMS, CHECK_LIMIT).await;
    let missing: Vec<String> = STREAMS
        .iter()
        .zip(infos)
        .filter_map(|(name, info)| match info {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(format!("stream {name}: {e}")),
            Err(_) => Some(format!("stream {name}: no answer within {CHECK_LIMIT:?}")),
        })
        .collect();
    // Requests sent just as the server went away time out before the client notices the
    // lost connection: the lost connection is the reason to give.
    if !missing.is_empty() && store.client.connection_state() != State::Connected {
        return Err("not connected to NATS".into());
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing.join("; "))
    }
}
