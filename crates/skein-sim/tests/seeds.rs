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
            assert_eq!(run.roots.len(), skein_sim::world::TREES + 3);
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

/// Seeds that found a bug, with the bug. A seed's schedule follows the code, so after
/// later changes it may no longer take the path that found its bug; it stays in the suite
/// as one more seed, and the bug's own test guards the fix.
const REGRESSIONS: &[(u64, bool, &str)] = &[
    (
        53,
        true,
        "a delegation retried after a crash took its own child's cache entry as a hit, so \
         the child's usage never rolled up",
    ),
    (
        149,
        false,
        "the same bug, as the plain schedule of this version finds it",
    ),
    (
        3,
        false,
        "a sub-agent that asks a person was shared with another tree, whose person then \
         answered its question",
    ),
    (
        5,
        false,
        "a sub-agent's answer that used a person's answer was cached, and another tree got \
         it without being asked",
    ),
    (
        33997,
        true,
        "two children ended close together, one notice late: their wake-ups coalesced into \
         one, whose look saw the other notice and did not check every child, and nothing \
         woke the parent again",
    ),
];

#[test]
fn the_seeds_that_found_bugs_keep_every_invariant() {
    for (seed, swarm, bug) in REGRESSIONS {
        let (_, v) = skein_sim::simulate(*seed, *swarm);
        assert!(
            v.violations.is_empty(),
            "seed {seed} ({bug}): {:?}",
            v.violations
        );
    }
}

#[test]
fn a_seed_takes_the_same_path_every_time() {
    for (seed, swarm) in [(7, false), (5003, true), (53, true)] {
        let records = |run: &skein_sim::world::Run| -> Vec<Vec<u8>> {
            run.logs
                .values()
                .flatten()
                .map(|r| r.bytes.clone())
                .collect()
        };
        let (a, va) = skein_sim::simulate(seed, swarm);
        let (b, vb) = skein_sim::simulate(seed, swarm);
        assert!(!records(&a).is_empty());
        assert_eq!(records(&a), records(&b), "seed {seed}: the logs differ");
        assert_eq!(a.crashes, b.crashes, "seed {seed}");
        assert_eq!(a.virtual_ms, b.virtual_ms, "seed {seed}");
        assert_eq!(va.violations, vb.violations, "seed {seed}");
    }
}
