//! A permit under a concurrency limit holds its model's place while its call runs, however
//! long that is, and no longer than a lease once its worker is gone. Virtual time: a call
//! of 150 s outlasts the 60 s lease, and a worker killed during it stops renewing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use skein_core::{AgentSet, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_ports::quota::QuotaLimits;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sim::faults::{Faults, Rates, Rng, SimClock};
use skein_sim::memory::MemStore;
use skein_sim::quota::{declared, SimQuota, PROVIDER};
use skein_tools::{ToolBox, ToolsConfig};

/// How long the model takes to answer: longer than two leases.
const CALL: Duration = Duration::from_secs(150);
/// How long a dead worker's permit may hold its model's place, as docs/operations.md
/// promises.
const A_MINUTE: Duration = Duration::from_secs(60);

struct World {
    store: Arc<MemStore>,
    quota: Arc<SimQuota>,
    clock: Arc<SimClock>,
    dir: tempfile::TempDir,
}

/// A store whose agent `slow` calls a model limited to one call at a time, which answers
/// after [`CALL`].
fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("slow.yaml"),
        format!(
            "latency_ms: {}\nturns:\n  - answer: done\n",
            CALL.as_millis()
        ),
    )
    .unwrap();
    let faults = Arc::new(Faults::new(Rates::NONE, Rng::new(1)));
    let store = MemStore::new(Duration::from_secs(5), faults, dir.path().join("ws"));
    let clock = Arc::new(SimClock::new(1));
    let limits = QuotaLimits {
        concurrent_requests: Some(1),
        ..Default::default()
    };
    let quota = SimQuota::new(limits, clock.clone());
    World {
        store,
        quota,
        clock,
        dir,
    }
}

/// A worker of the world's cluster.
fn worker(w: &World, id: &str) -> Arc<Runtime> {
    let files = vec![(
        "slow.md".to_string(),
        format!("---\nname: slow\nmodel: {PROVIDER}:slow\ncache: false\n---\nTake your time.\n"),
    )];
    let agents = Arc::new(AgentSet::load(&files, &[]).unwrap());
    let mut models = Registry::new();
    let scripted = Arc::new(ScriptedProvider::new(w.dir.path()).on_tokio_clock());
    models.insert(PROVIDER, w.quota.provider(scripted));
    models.set_limits(PROVIDER, declared(&w.quota.limits), BTreeMap::new());
    let mut backend = w.store.backend();
    backend.quota = Some(w.quota.clone());
    let mut tools = ToolsConfig::default();
    tools.http.enabled = false;
    let cfg = RuntimeConfig {
        worker_id: id.into(),
        lease: Duration::from_secs(5),
        clock: w.clock.clone(),
        token_secret: skein_runtime::secret::Secret(b"a quota lease test".to_vec()),
        ..RuntimeConfig::default()
    };
    Runtime::new(backend, agents, models, ToolBox::builtin(&tools), cfg)
}

async fn submit(rt: &Runtime, id: &str) -> SessionId {
    rt.submit(Submission {
        agent: "slow".into(),
        mission: format!("job {id}"),
        id: Some(id.into()),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Waits (virtual time) until every tree of `roots` ended, for at most `limit`.
async fn until_ended(store: &MemStore, roots: &[SessionId], limit: Duration) {
    let t0 = tokio::time::Instant::now();
    while !roots.iter().all(|r| store.ended(r)) {
        assert!(
            t0.elapsed() < limit,
            "the trees did not end within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn a_call_longer_than_the_lease_keeps_its_place_until_it_ends() {
    skein_sim::paused_runtime().block_on(async {
        let w = world();
        let rt = worker(&w, "w0");
        let roots = [submit(&rt, "a").await, submit(&rt, "b").await];
        let (stop, handles) = rt.spawn_workers(vec!["default".into()], 2);
        until_ended(&w.store, &roots, CALL * 4).await;
        let _ = stop.send(true);
        for h in handles {
            h.abort();
        }
        // Two sessions, two work loops, one place: the second call waited for the first
        // to end, not for its permit's lease to run out.
        let key = format!("{PROVIDER}:slow");
        assert_eq!(
            w.quota.most_at_once().get(&key),
            Some(&1),
            "{}",
            w.quota.report()
        );
        assert_eq!(w.quota.calls.load(std::sync::atomic::Ordering::Relaxed), 2);
    });
}

#[test]
fn a_worker_that_dies_during_its_call_frees_the_place_a_lease_later() {
    skein_sim::paused_runtime().block_on(async {
        let w = world();
        let rt = worker(&w, "w0");
        let first = submit(&rt, "a").await;
        let (stop, handles) = rt.spawn_workers(vec!["default".into()], 1);
        // The call is under way (and its permit renewed twice) when the worker dies.
        tokio::time::sleep(Duration::from_secs(50)).await;
        assert_eq!(w.quota.calls.load(std::sync::atomic::Ordering::Relaxed), 1);
        w.quota.killing();
        let _ = stop.send(true);
        for h in handles {
            h.abort();
        }
        let killed = tokio::time::Instant::now();
        // Another worker of the cluster: the killed call's job comes back to it, and a new
        // tree's call asks for the place as well.
        let w2 = worker(&w, "w1");
        let second = submit(&w2, "b").await;
        let (stop, handles) = w2.spawn_workers(vec!["default".into()], 2);
        // Each tree makes its one call in turn once the dead worker's place lapsed: a
        // lease after the last renewal (at 40 s), then two calls.
        until_ended(&w.store, &[first, second], A_MINUTE * 10 + CALL * 3).await;
        let _ = stop.send(true);
        for h in handles {
            h.abort();
        }
        let took = killed.elapsed();
        assert!(
            took < A_MINUTE + CALL * 2 + Duration::from_secs(15),
            "the trees took {took:?} after the kill: the dead worker's place was held \
             longer than a lease"
        );
        assert_eq!(
            w.quota.most_at_once().get(&format!("{PROVIDER}:slow")),
            Some(&1),
            "{}",
            w.quota.report()
        );
    });
}
