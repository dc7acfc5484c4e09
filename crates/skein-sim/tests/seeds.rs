//! The simulation in the test suite: a batch of seeds, plain and swarm, with every
//! invariant holding. (`cargo run --release -p skein-sim -- --seeds N` runs many more.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[test]
fn a_batch_of_seeds_keeps_every_invariant() {
    for seed in 1..=40 {
        for swarm in [false, true] {
            let (run, v) = skein_sim::simulate(seed, swarm);
            assert!(
                v.violations.is_empty(),
                "seed {seed} (swarm {swarm}): {:?}",
                v.violations
            );
            // Not vacuous: every tree ran, with its patterns.
            assert_eq!(run.roots.len(), skein_sim::world::TREES + 1);
            for kind in [
                "HandedOff",
                "AdvisorsConsulted",
                "TeamStarted",
                "TeamBroadcast",
            ] {
                assert!(
                    v.kinds.get(kind).copied().unwrap_or(0) > 0,
                    "{kind}: {:?}",
                    v.kinds
                );
            }
        }
    }
}
