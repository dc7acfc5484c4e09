//! The ports' conformance suite on the in-memory store (with no faults): the simulation's
//! backend keeps the contracts the sled and JetStream backends keep.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use skein_runtime::ports::Backend;
use skein_sim::faults::{Faults, Rates, Rng};
use skein_sim::memory::MemStore;

async fn memory() -> (tempfile::TempDir, Backend) {
    let dir = tempfile::tempdir().unwrap();
    let none = Rates {
        conflict: 0.0,
        unreachable: 0.0,
        notice_lost: 0.0,
        notice_twice: 0.0,
        model_fails: 0.0,
        crash: 0.0,
        notice_late: 0.0,
        slow: 0.0,
        heartbeat_lost: 0.0,
        cancel: 0.0,
        person: 0.0,
        slow_push: 0.0,
    };
    let faults = Arc::new(Faults::new(none, Rng::new(1)));
    let store = MemStore::new(Duration::from_secs(1), faults, dir.path().join("ws"));
    (dir, store.backend())
}

skein_runtime::conformance_tests!(memory);
