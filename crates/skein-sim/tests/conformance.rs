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
        person: 0.0,
        ..Rates::NONE
    };
    let faults = Arc::new(Faults::new(none, Rng::new(1)));
    let store = MemStore::new(Duration::from_secs(1), faults, dir.path().join("ws"));
    (dir, store.backend())
}

skein_runtime::conformance_tests!(memory);
