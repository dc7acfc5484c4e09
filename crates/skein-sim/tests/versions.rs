//! Generated worlds whose definitions change while they run, on workers that differ in
//! what they can serve (`versions.rs`): a batch of seeds, plain and swarm, with every
//! invariant holding, and each difference met at least once over the batch.
//! (`skein-sim --versions --seeds N [--swarm]` runs many more.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;

use skein_core::Event;

#[test]
fn versions_and_workers_that_differ_keep_every_invariant() {
    let mut asked: BTreeMap<String, u64> = BTreeMap::new();
    let (mut newer_written, mut newer_refused, mut unserved) = (0, 0, 0);
    let mut pinned: BTreeSet<Option<String>> = BTreeSet::new();
    let mut novel = 0;
    for seed in 1..=20 {
        for swarm in [false, true] {
            let Some((run, v)) = skein_sim::simulate_versions(seed, swarm, true) else {
                continue;
            };
            assert!(
                v.violations.is_empty(),
                "seed {seed} (swarm {swarm}): {:?}",
                v.violations
            );
            let mix = run.mix.as_ref().unwrap();
            for (k, c) in mix.asked.lock().unwrap().iter() {
                *asked
                    .entry(k.split(':').next().unwrap().to_string())
                    .or_default() += c;
                if k == "provider:alt" {
                    *asked.entry("alt".into()).or_default() += c;
                }
            }
            newer_written += mix.newer_written.load(Relaxed);
            newer_refused += mix.newer_refused.load(Relaxed);
            for recs in run.logs.values() {
                let Some(Event::Submitted(s)) = recs.first().map(|r| &r.env.body) else {
                    continue;
                };
                pinned.insert(s.defs.clone());
                if s.agent == skein_sim::versions::NOVEL {
                    novel += 1;
                }
                if s.agent == skein_sim::versions::STRANDED
                    && matches!(recs.last().map(|r| &r.env.body), Some(Event::Failed(_)))
                {
                    unserved += 1;
                }
            }
        }
    }
    // Not vacuous: trees ran on the workers' own files and on both pushed versions, the
    // agent only one version holds ran, every kind of lack was handed back for, records
    // of the newer format were written and an earlier release's worker refused some, and
    // the tree nobody can serve was reported.
    assert!(pinned.len() >= 3, "{pinned:?}");
    assert!(novel > 0);
    for need in ["agent", "provider", "alt", "tool"] {
        assert!(
            asked.get(need).copied().unwrap_or(0) > 0,
            "{need}: {asked:?}"
        );
    }
    assert!(
        newer_written > 0 && newer_refused > 0,
        "{newer_written} {newer_refused}"
    );
    assert!(unserved > 0);
}
