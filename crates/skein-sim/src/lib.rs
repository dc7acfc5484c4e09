//! skein-sim: the whole protocol in one thread from a seed. The real runtime (the same
//! `Runtime` the workers run) drives trees on an in-memory store with a virtual clock,
//! while the seed kills workers at any moment, makes appends conflict, the backend
//! unreachable, notices vanish or double, and models fail; afterwards every log is
//! checked against the invariants.
// The simulation's own setup (a runtime, a scratch directory, the fixed world's agents)
// failing is a broken machine or a broken simulation, not a finding: it stops there.
#![allow(clippy::expect_used)]

pub mod disk;
pub mod faults;
pub mod gen;
pub mod invariants;
pub mod memory;
pub mod quota;
pub mod versions;
pub mod world;

use std::time::Duration;

pub use invariants::Verdict;

/// One seed's run and its verdict, on a fresh single-threaded runtime whose clock only
/// moves when every task waits; the disk's faults among the seed's.
pub fn simulate(seed: u64, swarm: bool) -> (world::Run, Verdict) {
    simulate_on(seed, swarm, true)
}

/// [`simulate`], with the disk's faults (`disk`) or without.
pub fn simulate_on(seed: u64, swarm: bool, disk: bool) -> (world::Run, Verdict) {
    let rt = paused_runtime();
    rt.block_on(async {
        let run = world::run(seed, swarm, disk).await;
        let verdict = invariants::check(&run).await;
        // Let the killed workers' tasks unwind before the runtime goes.
        tokio::time::sleep(Duration::from_millis(1)).await;
        (run, verdict)
    })
}

/// What one seed of a generated world found.
pub struct Generated {
    pub scenario: gen::Scenario,
    /// Why the loader refused the set, if it did (nothing ran).
    pub refused: Option<String>,
    pub run: Option<world::Run>,
    pub verdict: Verdict,
    /// Cache hits compared with a fresh run of their child, and those that could not be
    /// (the fresh run took another path to that call).
    pub hits_checked: u64,
    pub hits_unmatched: u64,
}

/// A generated world's run and its verdict: the agent set drawn from the seed, run under
/// the seed's faults; then, if any child was answered from the cache, the same world
/// again with no fault and no cache, whose answers the hits must equal.
pub fn simulate_generated(seed: u64, swarm: bool, opts: gen::Options) -> Generated {
    simulate_generated_on(seed, swarm, opts, true)
}

/// [`simulate_generated`], with the disk's faults (`disk`) or without.
pub fn simulate_generated_on(seed: u64, swarm: bool, opts: gen::Options, disk: bool) -> Generated {
    let scenario = gen::generate(seed, opts);
    let rt = paused_runtime();
    rt.block_on(async {
        let setup = world::Setup {
            inner_cancels: opts.inner_cancels,
            stale_tokens: opts.stale_tokens,
            spread: opts.short_ttl,
            ..world::Setup::generated(swarm, disk)
        };
        let run = match world::run_scenario(seed, setup, &scenario).await {
            Ok(run) => run,
            Err(e) => {
                return Generated {
                    scenario,
                    refused: Some(e),
                    run: None,
                    verdict: Verdict::default(),
                    hits_checked: 0,
                    hits_unmatched: 0,
                }
            }
        };
        let mut verdict = invariants::check(&run).await;
        let (mut checked, mut unmatched) = (0, 0);
        let hits = run
            .logs
            .values()
            .flatten()
            .any(|r| matches!(r.env.body, skein_core::Event::CacheHit(_)));
        if hits {
            let fresh = world::Setup {
                swarm: false,
                calm: true,
                no_cache: true,
                time_limit: world::GENERATED_TIME_LIMIT,
                drain_limit: world::GENERATED_DRAIN_LIMIT,
                disk: false,
                inner_cancels: false,
                stale_tokens: false,
                spread: false,
            };
            if let Ok(reference) = world::run_scenario(seed, fresh, &scenario).await {
                let (c, u) = invariants::cache_sound(&run, &reference, &mut verdict);
                (checked, unmatched) = (c, u);
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        Generated {
            scenario,
            refused: None,
            run: Some(run),
            verdict,
            hits_checked: checked,
            hits_unmatched: unmatched,
        }
    })
}

/// A generated world with definition versions pushed and rolled back while it runs and
/// workers that differ in what they can serve (`versions.rs`), under the seed's faults.
/// The process reads the newer record format from then on (workers of the earlier
/// release are modelled by what their log reads refuse). None when the loader refuses
/// the generated set (nothing runs).
pub fn simulate_versions(seed: u64, swarm: bool, disk: bool) -> Option<(world::Run, Verdict)> {
    simulate_versions_with(seed, swarm, disk, gen::Options::default())
}

/// [`simulate_versions`], with the switches of `opts` that widen the space (cancels
/// inside trees, stale answers, a short time to live); its `open` is not read (the
/// versions' worlds draw every shape).
pub fn simulate_versions_with(
    seed: u64,
    swarm: bool,
    disk: bool,
    opts: gen::Options,
) -> Option<(world::Run, Verdict)> {
    skein_core::event::act_as_next_format();
    let generated = gen::generate(
        seed,
        gen::Options {
            short_ttl: opts.short_ttl,
            ..gen::Options::default()
        },
    );
    skein_core::AgentSet::load(&generated.files(), &generated.extra_tools).ok()?;
    let (scenario, mix) = versions::Mix::draw(seed, &generated);
    let rt = paused_runtime();
    rt.block_on(async {
        let setup = world::Setup {
            inner_cancels: opts.inner_cancels,
            stale_tokens: opts.stale_tokens,
            spread: opts.short_ttl,
            ..world::Setup::generated(swarm, disk)
        };
        let run = world::run_mixed(seed, setup, &scenario, Some(std::sync::Arc::new(mix)))
            .await
            .expect("a generated world loads");
        let verdict = invariants::check(&run).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        Some((run, verdict))
    })
}

/// The simulation's runtime: one thread, its clock paused (time moves only when every task
/// waits, straight to the next timer).
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime")
}
