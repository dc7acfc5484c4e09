//! skein-sim: the whole protocol in one thread from a seed. The real runtime (the same
//! `Runtime` the workers run) drives trees on an in-memory store with a virtual clock,
//! while the seed kills workers at any moment, makes appends conflict, the backend
//! unreachable, notices vanish or double, and models fail; afterwards every log is
//! checked against the invariants.

pub mod faults;
pub mod invariants;
pub mod memory;
pub mod world;

use std::time::Duration;

pub use invariants::Verdict;

/// One seed's run and its verdict, on a fresh single-threaded runtime whose clock only
/// moves when every task waits.
pub fn simulate(seed: u64, swarm: bool) -> (world::Run, Verdict) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let run = world::run(seed, swarm).await;
        let verdict = invariants::check(&run).await;
        // Let the killed workers' tasks unwind before the runtime goes.
        tokio::time::sleep(Duration::from_millis(1)).await;
        (run, verdict)
    })
}
