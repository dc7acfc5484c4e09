//! The `skein.api` micro service (request/reply; discoverable with `nats micro ls`):
//! `skein.api.submit`, `.status`, `.cancel`, `.answer`, `.approve`. Also `skein.answers`:
//! `nats pub skein.answers '{"token": …, "answers": {…}}'` answers a question of the inbox.

use std::sync::Arc;

use async_nats::service::ServiceExt;
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use skein_core::SessionId;
use skein_runtime::worker::{Runtime, Submission};
use skein_runtime::{hitl, Error};
use tokio::sync::watch;

use skein_nats::backend::NatsStore;

/// A service error whose code tells whose fault it was: 400 (the request cannot be
/// accepted), 404 (no such session) and 409 with a session id taken by a different
/// submission are the caller's; 500 (stored data or definitions are broken) and 503 (NATS
/// failed; try again) and 507 (the store is full; try again once there is room) the
/// infrastructure's; 409 on an append means another writer got
/// there first (try again). The text goes in a header, so it is one line.
fn service_error(e: &Error) -> async_nats::service::error::Error {
    let code = match e {
        Error::Refused { .. } | Error::Core(skein_core::Error::InvalidId(_)) => 400,
        Error::NotFound(_) => 404,
        Error::Conflict { .. } | Error::IdTaken { .. } => 409,
        Error::Unavailable { .. } | Error::Interrupted(_) | Error::Lacking(_) => 503,
        Error::Full { .. } => 507,
        Error::Corrupt { .. } | Error::Core(_) => 500,
    };
    let text = e
        .report()
        .to_string()
        .split(['\r', '\n'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    // A refusal leads with its stable name, so a client can tell a stale token from a
    // forged one, or an unknown agent from a malformed request, without reading the prose.
    let status = match e.refusal() {
        Some(kind) => format!("refused({}): {text}", refusal_name(kind)),
        None => text,
    };
    async_nats::service::error::Error { status, code }
}

/// The stable name of a refusal: its kind, and for a token why it was refused
/// (`token_stale`, `token_forged`, ...).
pub fn refusal_name(kind: skein_runtime::error::RefusalKind) -> String {
    match kind {
        skein_runtime::error::RefusalKind::Token(t) => format!("token_{}", t.as_str()),
        other => other.as_str().to_string(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionReq {
    session: String,
    #[serde(default)]
    reason: Option<String>,
}

/// An answer to a question of the inbox: the body of `skein.answers` and `skein.api.answer`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnswerReq {
    pub token: String,
    pub answers: Value,
}

/// Reads the body of `skein.answers` or `skein.api.answer`.
pub fn parse_answer_request(body: &[u8]) -> serde_json::Result<AnswerReq> {
    serde_json::from_slice(body)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApproveReq {
    token: String,
    approved: bool,
    #[serde(default)]
    reason: Option<String>,
}

// Shared with `skein cancel` and the embedded backend.
pub use skein_runtime::control::{cancel, status};

async fn serve(
    rt: &Runtime,
    store: &NatsStore,
    endpoint: &str,
    body: &[u8],
) -> Result<Value, Error> {
    let parse_err = |e: serde_json::Error| Error::invalid(format!("invalid request: {e}"));
    match endpoint {
        "submit" => {
            let sub: Submission = serde_json::from_slice(body).map_err(parse_err)?;
            let id = skein_runtime::spans::scoped(rt.submit(sub)).await?;
            Ok(json!({"session": id.to_string()}))
        }
        "status" => {
            let r: SessionReq = serde_json::from_slice(body).map_err(parse_err)?;
            let id = SessionId::parse(&r.session)?;
            let mut v = status(rt, &id).await?;
            // A root's announced result, as `skein.results.<root>` carried it: read from
            // the stream, as every reader of results does.
            if id.is_root() {
                let last = store.last_result(&id).await?;
                v["result"] = last.map_or(Value::Null, |r| json!(r.result));
            }
            Ok(v)
        }
        "cancel" => {
            let r: SessionReq = serde_json::from_slice(body).map_err(parse_err)?;
            let reason = r
                .reason
                .unwrap_or_else(|| "cancelled through skein.api".into());
            let n = cancel(rt, &SessionId::parse(&r.session)?, &reason).await?;
            Ok(json!({"cancelled": n}))
        }
        "answer" => {
            let r = parse_answer_request(body).map_err(parse_err)?;
            let s = hitl::answer(rt, &r.token, r.answers, Some("skein.api".into())).await?;
            Ok(json!({"session": s.to_string()}))
        }
        "approve" => {
            let r: ApproveReq = serde_json::from_slice(body).map_err(parse_err)?;
            let s =
                hitl::decide_approval(rt, &r.token, r.approved, r.reason, Some("skein.api".into()))
                    .await?;
            Ok(json!({"session": s.to_string()}))
        }
        other => Err(Error::NotFound(format!("unknown endpoint {other}"))),
    }
}

/// Serves `skein.api.*` and `skein.answers` until `stop` turns true.
pub async fn run(
    rt: Arc<Runtime>,
    store: Arc<NatsStore>,
    stop: watch::Receiver<bool>,
) -> Result<(), Error> {
    let serving = start(rt, store, stop).await?;
    let _ = serving.await;
    Ok(())
}

/// Registers `skein.api.*` and `skein.answers` and returns once the server has them (a
/// request made after this returns finds a responder), serving them in the background
/// until `stop` turns true.
pub async fn start(
    rt: Arc<Runtime>,
    store: Arc<NatsStore>,
    mut stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let service = store
        .client
        .service_builder()
        .description("skein: submit missions, read their status, cancel, answer, approve")
        .start("skein", env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| Error::unavailable("nats service", e))?;
    let group = service.group("skein.api");
    let mut tasks = vec![];
    for name in ["submit", "status", "cancel", "answer", "approve"] {
        let mut ep = group
            .endpoint(name)
            .await
            .map_err(|e| Error::unavailable(format!("endpoint {name}"), e))?;
        let rt = rt.clone();
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(req) = ep.next().await {
                let reply = match serve(&rt, &store, name, &req.message.payload).await {
                    Ok(v) => Ok(Bytes::from(v.to_string())),
                    Err(e) => Err(service_error(&e)),
                };
                if let Err(e) = req.respond(reply).await {
                    tracing::warn!(endpoint = name, error = %e, "reply failed");
                }
            }
        }));
    }
    let mut answers = store
        .client
        .queue_subscribe("skein.answers", "skein-answers".into())
        .await
        .map_err(|e| Error::unavailable("subscribe skein.answers", e))?;
    let client = store.client.clone();
    let rt2 = rt.clone();
    tasks.push(tokio::spawn(async move {
        while let Some(msg) = answers.next().await {
            let res = match parse_answer_request(&msg.payload) {
                Ok(r) => hitl::answer(&rt2, &r.token, r.answers, Some("skein.answers".into()))
                    .await
                    .map(|s| json!({"session": s.to_string()})),
                Err(e) => Err(Error::invalid(format!("invalid answer: {e}"))),
            };
            let (subject, body) = match res {
                Ok(v) => ("skein.answers.accepted", v),
                Err(e) => (
                    "skein.answers.rejected",
                    json!({"reason": e.report().to_string()}),
                ),
            };
            let _ = client.publish(subject, Bytes::from(body.to_string())).await;
            if let Some(reply) = msg.reply {
                let _ = client.publish(reply, Bytes::from(body.to_string())).await;
            }
        }
    }));
    // The server handles one connection's messages in order: once it answers a request
    // sent after every subscription, it has them all.
    let ping = format!("$SRV.PING.skein.{}", service.info().await.id);
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        store.client.request(ping, Bytes::new()),
    )
    .await
    .map_err(|_| Error::unavailable_because("nats service: no answer to its own ping"))?
    .map_err(|e| Error::unavailable("nats service: ping", e))?;
    Ok(tokio::spawn(async move {
        let _ = stop.changed().await;
        for t in tasks {
            t.abort();
        }
        let _ = service.stop().await;
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use skein_runtime::error::RefusalKind;
    use skein_runtime::TokenRefusal;

    #[test]
    fn a_refusal_leads_with_its_name_and_other_errors_do_not() {
        let e = service_error(&Error::refused(
            RefusalKind::UnknownAgent,
            "unknown agent `x`",
        ));
        assert_eq!(
            (e.code, e.status.as_str()),
            (400, "refused(unknown_agent): unknown agent `x`")
        );
        let e = service_error(&Error::refused(
            RefusalKind::Token(TokenRefusal::Stale),
            "line one\nline two",
        ));
        assert_eq!(e.status, "refused(token_stale): line one; line two");
        let e = service_error(&Error::NotFound("session s".into()));
        assert_eq!((e.code, e.status.as_str()), (404, "not found: session s"));
    }
}
