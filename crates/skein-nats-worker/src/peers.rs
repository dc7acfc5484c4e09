//! The worker's place among the others: it advertises what it has and reads (KV
//! `skein_workers`) every few seconds, and asks the others' entries whether one of them
//! has what it lacks.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use skein_nats::backend::{NatsStore, WorkerInfo, WORKER_TTL_SECS};
use skein_runtime::defs::{Need, Offer, Peers};
use skein_runtime::worker::Runtime;
use skein_runtime::Result;
use tokio::sync::watch;

/// How often a worker writes its entry again (well within the entries' lifetime).
const EVERY: Duration = Duration::from_secs(WORKER_TTL_SECS / 3);
/// How long a reading of the live workers is used again.
const FRESH: Duration = Duration::from_secs(1);

/// What this worker says of itself now.
pub fn info(rt: &Runtime, pools: &[String]) -> WorkerInfo {
    let offer = rt.offer();
    WorkerInfo {
        worker: rt.cfg.worker_id.clone(),
        at: skein_runtime::now_ms(),
        agents: offer.agents,
        providers: offer.providers,
        tools: offer.tools,
        mcp: offer.mcp,
        pools: pools.to_vec(),
        defs: rt.current_version().digest.clone(),
        reads: skein_core::event::read_format(),
        build: env!("CARGO_PKG_VERSION").to_string(),
        stopped: false,
        lists_trees: true,
    }
}

/// Advertises this worker until `stop` turns true.
pub async fn advertise(
    rt: Arc<Runtime>,
    store: Arc<NatsStore>,
    pools: Vec<String>,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        if let Err(e) = store.advertise(&info(&rt, &pools)).await {
            tracing::warn!(error = %e.report(), "cannot advertise the worker");
        }
        match store.live_workers().await {
            Ok(live) => agree_on_format(&rt, &live),
            Err(e) => tracing::warn!(error = %e.report(), "cannot read the live workers"),
        }
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Writes the newest record format every live worker reads (this one included). A worker
/// of an earlier release that advertises itself brings the cluster back to the format it
/// reads within one round of advertisements; until a worker has read the others it writes
/// the first format.
pub fn agree_on_format(rt: &Runtime, live: &[WorkerInfo]) {
    if rt.agree_on_format(live.iter().map(|w| w.reads)) {
        tracing::info!(
            format = rt.write_format(),
            workers = live.len(),
            "record format written now (the newest every live worker reads)"
        );
    }
}

/// The other live workers, read from their entries.
pub struct NatsPeers {
    store: Arc<NatsStore>,
    me: String,
    read: Mutex<Option<(Instant, Arc<Vec<WorkerInfo>>)>>,
}

impl NatsPeers {
    pub fn new(store: Arc<NatsStore>, me: String) -> Self {
        Self {
            store,
            me,
            read: Mutex::new(None),
        }
    }

    /// Every live worker (this one included), read at most once a second.
    pub async fn live(&self) -> Result<Arc<Vec<WorkerInfo>>> {
        if let Some((at, w)) = &*self.read.lock().unwrap_or_else(|p| p.into_inner()) {
            if at.elapsed() < FRESH {
                return Ok(w.clone());
            }
        }
        let w = Arc::new(self.store.live_workers().await?);
        *self.read.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), w.clone()));
        Ok(w)
    }
}

#[async_trait::async_trait]
impl Peers for NatsPeers {
    async fn served_elsewhere(&self, need: &Need, defs: Option<&str>) -> Result<bool> {
        let live = self.live().await?;
        Ok(live.iter().filter(|w| w.worker != self.me).any(|w| {
            let offer = Offer {
                agents: w.agents.clone(),
                providers: w.providers.clone(),
                tools: w.tools.clone(),
                mcp: w.mcp.clone(),
            };
            need.met_by(defs, &offer)
        }))
    }
}
