//! Model answers' text on core NATS while it arrives: `skein.stream.<session>`.
//!
//! A worker publishes every [`TextDelta`] of the sessions it runs as JSON
//! (`{"session", "seq", "attempt", "text"}`) on the subject of its session. Any NATS client
//! can watch a tree with `nats sub 'skein.stream.<root>'` and `'skein.stream.<root>.>'`.
//! The subjects are core NATS, not JetStream: nothing is stored, a watcher that is not
//! subscribed misses the text, and the log still records each answer whole, as one
//! `ModelCalled`. A try that fails is followed by deltas of the next try (`attempt` + 1),
//! whose text replaces it.

use std::sync::Arc;

use skein_core::SessionId;
use skein_runtime::worker::{Runtime, TextDelta};
use tokio::sync::{broadcast, watch};

/// Subjects of streamed text begin with this.
pub const PREFIX: &str = "skein.stream";

/// The subject `session`'s text goes to.
pub fn subject(session: &SessionId) -> String {
    format!("{PREFIX}.{session}")
}

/// Publishes the text deltas of `rt` until `stop` turns true. Deltas the client cannot
/// keep up with are dropped (and counted in a warning), never queued without bound.
pub async fn forward(
    rt: Arc<Runtime>,
    client: async_nats::Client,
    mut stop: watch::Receiver<bool>,
) {
    let mut rx = rt.subscribe_text();
    loop {
        let d: TextDelta = tokio::select! {
            _ = stop.changed() => return,
            d = rx.recv() => match d {
                Ok(d) => d,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(dropped = n, "streamed text fell behind; pieces dropped");
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
        };
        let Ok(payload) = serde_json::to_vec(&d) else {
            continue;
        };
        if let Err(e) = client.publish(subject(&d.session), payload.into()).await {
            tracing::debug!(error = %e, "streamed text not published");
        }
    }
}
