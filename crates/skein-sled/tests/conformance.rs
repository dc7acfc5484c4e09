//! The ports' conformance suite on the sled backend: one test per check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use skein_runtime::ports::Backend;
use skein_sled::SledStore;

async fn sled() -> (tempfile::TempDir, Backend) {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open_with_lease(
        &dir.path().join("data"),
        &dir.path().join("ws"),
        Duration::from_secs(1),
    )
    .unwrap();
    (dir, store.backend())
}

skein_runtime::conformance_tests!(sled);
