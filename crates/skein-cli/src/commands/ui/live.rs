//! The live feed of the page: what changed, fed by the runtime's progress broadcast on the
//! embedded store, or by the event subjects `skein watch` follows on NATS, and served as
//! server-sent events.

use std::convert::Infallible;
use std::sync::Arc;

use anyhow::Result;
use axum::extract::{Query, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use skein_core::SessionId;
use skein_runtime::worker::{Runtime, TextDelta};
use tokio::sync::{broadcast, watch};
use utoipa::{IntoParams, ToSchema};

use super::api::ApiError;
use super::Ui;

/// One item of the live feed.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Live {
    /// An event was appended to a session's log.
    Event {
        /// Session id, slashed form (`root/researcher-1`).
        session: String,
        root: String,
        seq: u64,
        kind: String,
        /// The session's status after it, when known (embedded store).
        status: Option<String>,
    },
    /// A piece of a model answer's text while it arrives (never recorded).
    Text {
        session: String,
        root: String,
        seq: u64,
        attempt: u32,
        text: String,
    },
}

impl Live {
    fn root(&self) -> &str {
        match self {
            Live::Event { root, .. } | Live::Text { root, .. } => root,
        }
    }

    fn text(d: &TextDelta) -> Self {
        Live::Text {
            session: d.session.display(),
            root: d.session.root_id().to_string(),
            seq: d.seq,
            attempt: d.attempt,
            text: d.text.clone(),
        }
    }
}

/// Forwards the runtime's progress and streamed text to `tx` until `stop`.
pub fn follow_runtime(rt: &Arc<Runtime>, tx: broadcast::Sender<Live>, stop: watch::Receiver<bool>) {
    let mut progress = rt.subscribe();
    let mut text = rt.subscribe_text();
    let mut stop = stop;
    tokio::spawn(async move {
        loop {
            let item = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                p = progress.recv() => match p {
                    // A running tool's progress is for `skein run`'s terminal view.
                    Ok(p) if p.kind == skein_runtime::worker::TOOL_PROGRESS => continue,
                    Ok(p) => Live::Event {
                        session: p.session.display(),
                        root: p.session.root_id().to_string(),
                        seq: p.seq,
                        kind: p.kind,
                        status: Some(p.status.as_str().to_string()),
                    },
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                d = text.recv() => match d {
                    Ok(d) => Live::text(&d),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            };
            // Nobody listening is not an error.
            let _ = tx.send(item);
        }
    });
}

/// Follows every tree's events (`skein.events.>`) and streamed text on the cluster.
pub async fn follow_nats(
    client: async_nats::Client,
    tx: broadcast::Sender<Live>,
    stop: watch::Receiver<bool>,
) -> Result<()> {
    let mut events = client.subscribe("skein.events.>").await?;
    let mut text = client
        .subscribe(format!("{}.>", skein_nats_worker::text::PREFIX))
        .await?;
    let mut stop = stop;
    tokio::spawn(async move {
        loop {
            let items = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                m = events.next() => {
                    let Some(m) = m else { return };
                    // Anyone may publish here: what does not decode is not shown. A
                    // message may hold several records of one session.
                    let Ok(records) = skein_nats::frame::decode(&m.payload) else { continue };
                    records
                        .iter()
                        .map(|r| Live::Event {
                            session: r.env.session.display(),
                            root: r.env.session.root_id().to_string(),
                            seq: r.env.seq,
                            kind: r.env.body.kind().to_string(),
                            status: None,
                        })
                        .collect::<Vec<_>>()
                }
                m = text.next() => {
                    let Some(m) = m else { return };
                    let Ok(d) = serde_json::from_slice::<TextDelta>(&m.payload) else { continue };
                    if SessionId::parse(d.session.as_str()).is_err() {
                        continue;
                    }
                    vec![Live::text(&d)]
                }
            };
            for item in items {
                let _ = tx.send(item);
            }
        }
    });
    Ok(())
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct LiveQuery {
    /// Only this tree (any session id of it); every tree when absent.
    pub root: Option<String>,
}

/// The live feed as server-sent events: `event` (an event appended), `text` (a piece of
/// a model answer while it arrives) and `lagged` (items were dropped: read the state
/// again). Data is the JSON of a [`Live`] item.
#[utoipa::path(
    get, path = "/api/live", tag = "live",
    params(LiveQuery),
    responses((status = 200, description = "text/event-stream of Live items", body = Live,
        content_type = "text/event-stream"))
)]
pub async fn live(
    State(ui): State<Arc<Ui>>,
    Query(q): Query<LiveQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let root = match &q.root {
        Some(r) => Some(SessionId::parse(r)?.root_id().to_string()),
        None => None,
    };
    let rx = ui.live.subscribe();
    let items = futures::stream::unfold(rx, move |mut rx| {
        let root = root.clone();
        async move {
            loop {
                match rx.recv().await {
                    Ok(item) => {
                        if root.as_deref().is_some_and(|r| r != item.root()) {
                            continue;
                        }
                        let name = match &item {
                            Live::Event { .. } => "event",
                            Live::Text { .. } => "text",
                        };
                        let ev = Event::default()
                            .event(name)
                            .json_data(&item)
                            .unwrap_or_else(|_| Event::default().event("lagged").data("{}"));
                        return Some((Ok(ev), rx));
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        return Some((Ok(Event::default().event("lagged").data("{}")), rx))
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        }
    });
    let mut stop = ui.stopping.clone();
    let items = items.take_until(async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    Ok(Sse::new(items).keep_alive(KeepAlive::default()))
}
