//! Intake: the `SKEIN_MISSIONS` stream captures `skein.missions.submit`; any worker takes
//! from it. A valid payload becomes a root session (its `id`, or else the `Nats-Msg-Id`
//! header, is the root id, so resubmitting is a no-op); an invalid one is answered on
//! `skein.missions.rejected` with the reason and acked, so it never blocks the stream.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, AckKind};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::json;
use skein_runtime::worker::{Runtime, Submission};
use skein_runtime::Error;
use tokio::sync::watch;

use crate::backend::{NatsStore, MISSIONS};

pub const REJECTED: &str = "skein.missions.rejected";

/// Parses one submission: JSON, or msgpack when `Content-Type: application/msgpack`.
pub fn parse(
    payload: &[u8],
    content_type: Option<&str>,
    msg_id: Option<&str>,
) -> Result<Submission, String> {
    let mut sub: Submission = if content_type
        .is_some_and(|c| c.eq_ignore_ascii_case("application/msgpack"))
    {
        rmp_serde::from_slice(payload).map_err(|e| format!("invalid msgpack submission: {e}"))?
    } else {
        serde_json::from_slice(payload).map_err(|e| format!("invalid JSON submission: {e}"))?
    };
    if sub.id.is_none() {
        if let Some(m) = msg_id {
            skein_core::id::validate_token(m)
                .map_err(|e| format!("Nats-Msg-Id `{m}` cannot be a session id: {e}"))?;
            sub.id = Some(m.to_string());
        }
    }
    Ok(sub)
}

async fn reject(store: &NatsStore, reason: &str, msg_id: Option<&str>, seq: u64, payload: &[u8]) {
    let excerpt: String = String::from_utf8_lossy(payload).chars().take(200).collect();
    let body = json!({"reason": reason, "msg_id": msg_id, "stream_seq": seq, "payload": excerpt});
    if let Err(e) = store
        .client
        .publish(REJECTED, Bytes::from(body.to_string()))
        .await
    {
        tracing::warn!(error = %e, "could not publish a rejection");
    }
}

/// Takes submissions until `stop` turns true.
pub async fn run(rt: Arc<Runtime>, store: Arc<NatsStore>, mut stop: watch::Receiver<bool>) {
    let cons = loop {
        let stream = store.js.get_stream(MISSIONS).await;
        let c = match stream {
            Ok(s) => s
                .get_or_create_consumer(
                    "intake",
                    consumer::pull::Config {
                        durable_name: Some("intake".into()),
                        ack_policy: consumer::AckPolicy::Explicit,
                        ack_wait: Duration::from_secs(30),
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match c {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!(error = %e, "intake consumer not ready");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    };
    while !*stop.borrow() {
        let batch = cons
            .fetch()
            .max_messages(32)
            .expires(Duration::from_millis(500))
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "intake fetch failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        while let Some(msg) = batch.next().await {
            let Ok(msg) = msg else { continue };
            handle(&rt, &store, msg).await;
        }
    }
}

async fn handle(rt: &Runtime, store: &NatsStore, msg: jetstream::Message) {
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    let headers = msg.headers.clone();
    let get = |k: &str| {
        headers
            .as_ref()
            .and_then(|h| h.get(k))
            .map(|v| v.as_str().to_string())
    };
    let msg_id = get("Nats-Msg-Id");
    let ctype = get("Content-Type");
    let outcome = match parse(&msg.payload, ctype.as_deref(), msg_id.as_deref()) {
        Err(reason) => Err(reason),
        Ok(sub) => match rt.submit(sub).await {
            Ok(id) => {
                tracing::info!(session = %id, "mission accepted");
                Ok(())
            }
            Err(Error::Rejected(reason)) => Err(reason),
            Err(e) => {
                // The infrastructure failed, not the submission: try it again later.
                tracing::warn!(error = %e, "intake failed; the submission will be delivered again");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
                return;
            }
        },
    };
    if let Err(reason) = outcome {
        tracing::info!(seq, reason = %reason, "mission rejected");
        reject(store, &reason, msg_id.as_deref(), seq, &msg.payload).await;
    }
    if let Err(e) = msg.double_ack().await {
        tracing::warn!(error = %e, "intake ack failed");
    }
}
