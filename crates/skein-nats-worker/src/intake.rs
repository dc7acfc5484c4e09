//! Intake: the `SKEIN_MISSIONS` stream captures `skein.missions.submit`; any worker takes
//! from it. A valid payload becomes a root session (its `id`, or else the `Nats-Msg-Id`
//! header, is the root id, so resubmitting is a no-op; a message with neither gets an id
//! derived from its place in the stream, so a redelivery after a crash is a no-op too); an
//! invalid one, or one whose id an earlier, different submission holds, is answered on
//! `skein.missions.rejected` with the reason and acked, so it never blocks the stream. An
//! accepted one is announced on `skein.missions.accepted`. Both verdicts name the
//! submission's sequence in the stream (what its publisher's ack said), and are sent
//! before the submission is acked: a worker that dies in between leaves the submission to
//! be judged, and its verdict sent, again.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, AckKind};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::json;
use skein_runtime::defs::Need;
use skein_runtime::worker::{Runtime, Submission};
use skein_runtime::Error;
use tokio::sync::watch;

use skein_nats::backend::{NatsStore, MISSIONS};

pub const REJECTED: &str = "skein.missions.rejected";
/// Deliveries of a submission naming an agent this worker lacks before it is judged here
/// all the same (refused, as unknown).
const HAND_BACK_DELIVERIES: i64 = 20;
/// How long such a submission waits before it is delivered again.
const HAND_BACK_DELAY: Duration = Duration::from_millis(300);
/// Where intake says it accepted a submission: `{"id", "msg_id", "stream_seq"}`.
pub const ACCEPTED: &str = "skein.missions.accepted";

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

/// The root id of a submission that names none: a ULID whose time is when the server
/// stored the message and whose other 80 bits hash that time and the stream sequence. Every
/// delivery of one message — to any worker, after any crash — yields the same id, so a
/// worker that dies between creating the root and acking cannot cause a second root; a
/// stream created anew (sequences start again) gives new ids because the times differ.
pub fn derived_id(published_nanos: i128, stream_seq: u64) -> String {
    let ms = u64::try_from(published_nanos.max(0) / 1_000_000).unwrap_or(u64::MAX);
    let mut h = blake3::Hasher::new();
    h.update(b"skein intake root id");
    h.update(&published_nanos.to_le_bytes());
    h.update(&stream_seq.to_le_bytes());
    let mut bits = [0u8; 16];
    bits[6..].copy_from_slice(&h.finalize().as_bytes()[..10]);
    ulid::Ulid::from_parts(ms, u128::from_be_bytes(bits))
        .to_string()
        .to_lowercase()
}

/// Publishes the rejection; false when it could not be sent (the message is then
/// delivered again rather than acked without its answer). `id` is the root id the
/// submission asked for, when it named one.
async fn reject(
    store: &NatsStore,
    reason: &str,
    msg_id: Option<&str>,
    id: Option<&str>,
    seq: u64,
    payload: &[u8],
) -> bool {
    let excerpt: String = String::from_utf8_lossy(payload).chars().take(200).collect();
    let body = json!({
        "reason": reason, "msg_id": msg_id, "id": id, "stream_seq": seq, "payload": excerpt,
    });
    let sent = store
        .client
        .publish(REJECTED, Bytes::from(body.to_string()))
        .await;
    if let Err(e) = &sent {
        tracing::warn!(error = %e, "could not publish a rejection");
    }
    sent.is_ok()
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
                tracing::warn!(stream = MISSIONS, consumer = "intake", error = %e,
                    "intake consumer not ready");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    };
    // Since when pulls fail, and when that was last reported.
    let mut failing: Option<(std::time::Instant, std::time::Instant)> = None;
    while !*stop.borrow() {
        // A pull that gets no answer (the consumer's leader lost) is given up after its
        // expiry and a grace period; intake that keeps failing says so at error level.
        let pulled = tokio::time::timeout(Duration::from_secs(5), async {
            let mut batch = cons
                .fetch()
                .max_messages(32)
                .expires(Duration::from_millis(500))
                .messages()
                .await?;
            let mut msgs = vec![];
            while let Some(msg) = batch.next().await {
                if let Ok(msg) = msg {
                    msgs.push(msg);
                }
            }
            Ok::<_, async_nats::Error>(msgs)
        })
        .await;
        let msgs = match pulled {
            Ok(Ok(m)) => {
                if let Some((since, _)) = failing.take() {
                    tracing::warn!(after = ?since.elapsed(), "intake takes submissions again");
                }
                m
            }
            Ok(Err(e)) => {
                stalled(&mut failing, &e.to_string());
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(_) => {
                stalled(&mut failing, "no answer to a pull within 5s");
                continue;
            }
        };
        for msg in msgs {
            handle(&rt, &store, msg).await;
        }
    }
}

/// Logs a failed pull of the intake consumer: a warning at first, an error every ten
/// seconds while it lasts.
fn stalled(failing: &mut Option<(std::time::Instant, std::time::Instant)>, error: &str) {
    let now = std::time::Instant::now();
    match failing {
        None => {
            tracing::warn!(
                stream = MISSIONS,
                consumer = "intake",
                error,
                "intake pull failed"
            );
            *failing = Some((now, now));
        }
        Some((since, reported)) if now.duration_since(*reported) >= Duration::from_secs(10) => {
            *reported = now;
            tracing::error!(stream = MISSIONS, consumer = "intake", failing_for = ?since.elapsed(),
                error, "cannot make progress: no submission can be taken");
        }
        Some(_) => {}
    }
}

async fn handle(rt: &Runtime, store: &NatsStore, msg: jetstream::Message) {
    let (seq, published, delivered) = match msg.info() {
        Ok(i) => (
            i.stream_sequence,
            i.published.unix_timestamp_nanos(),
            i.delivered,
        ),
        Err(e) => {
            // Not a JetStream delivery: nothing to derive an id from or to ack.
            tracing::warn!(error = %e, "intake got a message without stream metadata");
            return;
        }
    };
    let headers = msg.headers.clone();
    let get = |k: &str| {
        headers
            .as_ref()
            .and_then(|h| h.get(k))
            .map(|v| v.as_str().to_string())
    };
    let msg_id = get("Nats-Msg-Id");
    let ctype = get("Content-Type");
    let mut named = None;
    let outcome = match parse(&msg.payload, ctype.as_deref(), msg_id.as_deref()) {
        Err(reason) => Err(("malformed", reason)),
        Ok(mut sub) => {
            named = sub.id.clone();
            let agent = sub.agent.clone();
            // A `traceparent` header continues the caller's trace, unless the payload
            // names one itself.
            if sub.traceparent.is_none() {
                sub.traceparent = get("traceparent");
            }
            if sub.id.is_none() {
                sub.id = Some(derived_id(published, seq));
            }
            match skein_runtime::spans::scoped(rt.submit(sub)).await {
                Ok(id) => {
                    tracing::info!(session = %id, "mission accepted");
                    skein_runtime::metrics::intake_accepted();
                    let body = json!({"id": id.to_string(), "msg_id": msg_id, "stream_seq": seq});
                    // The tree exists whether or not the verdict is heard: not sent is
                    // only logged (its submitter then says it heard no verdict).
                    if let Err(e) = store
                        .client
                        .publish(ACCEPTED, Bytes::from(body.to_string()))
                        .await
                    {
                        tracing::warn!(error = %e, "could not publish an acceptance");
                    }
                    Ok(())
                }
                // An agent this worker does not know, which another live worker does (a
                // worker on other files): the submission is left for that one, a bounded
                // number of times.
                Err(Error::Refused {
                    kind: skein_runtime::RefusalKind::UnknownAgent,
                    reason,
                }) if delivered < HAND_BACK_DELIVERIES && {
                    let defs = rt.current_version().digest.clone();
                    rt.served_elsewhere(&Need::Agent(agent.clone()), defs.as_deref())
                        .await
                } =>
                {
                    let need = Need::Agent(agent);
                    tracing::info!(seq, %need, reason = %reason,
                        "submission handed back: another live worker has the agent");
                    rt.handed_back_for(&need);
                    let _ = msg.ack_with(AckKind::Nak(Some(HAND_BACK_DELAY))).await;
                    return;
                }
                Err(Error::Refused { kind, reason }) => Err((kind.as_str(), reason)),
                Err(e @ Error::IdTaken { .. }) => Err(("id_taken", e.to_string())),
                Err(e) => {
                    // The infrastructure failed, not the submission: try it again later.
                    tracing::warn!(error = %e.report(), "intake failed; the submission will be delivered again");
                    let _ = msg
                        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                        .await;
                    return;
                }
            }
        }
    };
    if let Err((kind, reason)) = outcome {
        tracing::info!(seq, reason = %reason, "mission rejected");
        if !reject(
            store,
            &reason,
            msg_id.as_deref(),
            named.as_deref(),
            seq,
            &msg.payload,
        )
        .await
        {
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
            return;
        }
        skein_runtime::metrics::intake_rejected(kind);
    }
    if let Err(e) = msg.double_ack().await {
        tracing::warn!(error = %e, "intake ack failed");
    }
}

#[cfg(test)]
mod tests {
    use super::derived_id;

    #[test]
    fn derived_ids_are_stable_per_message_and_differ_between_messages() {
        let t = 1_790_000_000_123_456_789i128;
        let a = derived_id(t, 7);
        assert_eq!(a, derived_id(t, 7), "a redelivery names the same root");
        assert_ne!(a, derived_id(t, 8));
        assert_ne!(a, derived_id(t + 1, 7), "a stream made anew gives new ids");
        // A ULID of the message's time, lowercase: a valid root id, sorted by time.
        let id = skein_core::SessionId::root(&a).expect("a valid root id");
        assert_eq!(id.as_str(), a);
        assert_eq!(a.len(), 26);
        let u = ulid::Ulid::from_string(&a.to_uppercase()).expect("a ULID");
        assert_eq!(u.timestamp_ms(), 1_790_000_000_123);
        assert!(
            derived_id(t + 5_000_000, 1) > a,
            "later messages sort later"
        );
    }
}
