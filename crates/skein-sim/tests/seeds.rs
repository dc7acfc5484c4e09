//! The simulation in the test suite: a batch of seeds, plain and swarm, with every
//! invariant holding. (`cargo run --release -p skein-sim -- --seeds N` runs many more.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// How often each fault of the disk struck over runs.
#[derive(Default, Debug)]
struct DiskStruck {
    restarts: u64,
    dropped: u64,
    writes_failed: u64,
    fulls: u64,
    refused_opens: u64,
}

impl DiskStruck {
    fn add(&mut self, run: &skein_sim::world::Run) {
        use std::sync::atomic::Ordering::Relaxed;
        let d = run.store.disk().expect("the log lies on a disk");
        self.restarts += run.restarts.len() as u64;
        self.dropped += d.dropped.load(Relaxed);
        self.writes_failed += d.writes_failed.load(Relaxed);
        self.fulls += d.fulls.load(Relaxed);
        self.refused_opens += d.refused_opens.load(Relaxed);
    }

    fn every_fault(&self) -> bool {
        self.restarts > 0
            && self.dropped > 0
            && self.writes_failed > 0
            && self.fulls > 0
            && self.refused_opens > 0
    }
}

#[test]
fn a_batch_of_seeds_keeps_every_invariant() {
    use std::sync::atomic::Ordering::Relaxed;
    let mut disk = DiskStruck::default();
    let (mut slow_pushes, mut slow_appends, mut slow_reads) = (0, 0, 0);
    for seed in 1..=40 {
        for swarm in [false, true] {
            let (run, v) = skein_sim::simulate(seed, swarm);
            disk.add(&run);
            slow_pushes += run.faults.slow_pushes.load(Relaxed);
            slow_appends += run.faults.slow_appends.load(Relaxed);
            slow_reads += run.faults.slow_reads.load(Relaxed);
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
    // Not vacuous either for the disk: syncs failed and the process restarted, dropping
    // records never acknowledged; writes failed; the disk filled; damage was refused.
    assert!(disk.every_fault(), "{disk:?}");
    // And the store's own slowness struck: pushes, appends and reads that took virtual
    // time.
    assert!(
        slow_pushes > 0 && slow_appends > 0 && slow_reads > 0,
        "slow pushes {slow_pushes}, slow appends {slow_appends}, slow reads {slow_reads}"
    );
}

/// Seeds whose disk did much in one run, as this version schedules them: failed syncs
/// (the store stopped, the process restarted on what the disk kept, dropping unsynced
/// records; plain seed 41 once while the trees were being submitted) and bytes flipped at
/// rest that opening refused; swarm seed 2 also filled its disk six times.
const DISK_SEEDS: &[(u64, bool)] = &[(41, false), (2, true)];

#[test]
fn seeds_whose_disk_fails_fills_and_rots_keep_every_invariant() {
    for (seed, swarm) in DISK_SEEDS {
        let (run, v) = skein_sim::simulate(*seed, *swarm);
        assert!(
            v.violations.is_empty(),
            "seed {seed} (swarm {swarm}): {:?}",
            v.violations
        );
        let mut disk = DiskStruck::default();
        disk.add(&run);
        assert!(
            disk.restarts > 0 && disk.refused_opens > 0,
            "seed {seed}: {disk:?}"
        );
    }
    // Without the disk's faults the log has no disk, and a seed still keeps every
    // invariant.
    let (run, v) = skein_sim::simulate_on(65, false, false);
    assert!(run.store.disk().is_none());
    assert!(v.violations.is_empty(), "{:?}", v.violations);
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
        12768,
        true,
        "two holders of a parent's job (a lease ran out) answered its paused child with the \
         same call: the second found the token spent and recorded a refusal, so the child \
         ran on unrecorded and its tokens reached no total",
    ),
    (
        17701,
        true,
        "a cancel tried again after its wake-up failed found the root cancelled and passed \
         it by: nobody ran its job, and the tree's end was never announced",
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

/// Generated worlds: a batch of seeds with every invariant holding, and, over the batch,
/// every kind of agent and event the generator is there to mix.
#[test]
fn generated_worlds_keep_every_invariant() {
    let mut kinds = std::collections::BTreeMap::new();
    let mut compared = 0;
    // Worlds under a declared quota, and the calls their limiter held back.
    let (mut limited, mut held) = (0, 0);
    // Pushes for sessions whose last job was acked as ended for good, which the store
    // drops as NATS does (the message left refuses them).
    let mut dropped = 0;
    for seed in 1..=30 {
        let g = skein_sim::simulate_generated(seed, false, Default::default());
        dropped += g.run.as_ref().map_or(0, |r| r.store.dropped_pushes());
        if let Some(q) = g.run.as_ref().and_then(|r| r.quota.as_ref()) {
            limited += 1;
            held += q.waits.load(std::sync::atomic::Ordering::Relaxed);
            assert!(!q.grants().is_empty(), "seed {seed}: no call was granted");
        }
        assert_eq!(g.refused, None, "seed {seed}: the loader refused the set");
        assert!(
            g.verdict.violations.is_empty(),
            "seed {seed}: {:?}",
            g.verdict.violations
        );
        compared += g.hits_checked;
        for (k, n) in g.verdict.kinds {
            *kinds.entry(k).or_insert(0) += n;
        }
    }
    for kind in [
        "HandedOff",
        "Routed",
        "AdvisorsConsulted",
        "TeamStarted",
        "InputRequested",
        "ApprovalRequested",
        "CacheHit",
        "ClarificationRequested",
        "Cancelled",
    ] {
        assert!(
            kinds.get(kind).copied().unwrap_or(0) > 0,
            "{kind}: {kinds:?}"
        );
    }
    assert!(compared > 0, "no cache hit was compared with a fresh run");
    assert!(limited > 0 && held > 0, "no world's quota held a call back");
    assert!(dropped > 0, "no push met a session ended for good");
}

/// Generated worlds that found a bug, with the bug (every shape drawn, plain faults).
const GENERATED_REGRESSIONS: &[(u64, &str)] = &[
    (
        4762,
        "a child cancelled while paused on a question still took its parent's resume",
    ),
    (
        14,
        "a narrowed child's answer was served from the cache to a call with all its tools",
    ),
    (58, "the same, served to calls of two other trees"),
    (
        123,
        "a question at the end of a handoff chain reached no inbox",
    ),
    (212, "a handoff target's question reached no inbox"),
    (
        35,
        "an advisor that asked waited for ever and its tokens never rolled up",
    ),
    (
        18,
        "a paused child's tokens were lost when its caller ended without resuming it",
    ),
    (
        66,
        "an asking agent forced to cache was shared across trees",
    ),
    (655, "a team answered whole from the cache did not replay"),
    (1743, "the same, in another world"),
    (
        7178,
        "a step retried after its crash took a cache hit for a call whose child it had \
         created, which ran unaccounted",
    ),
    (7298, "the same, in another world"),
    (
        2839,
        "a session cancelled by its timeout while a child ran settled without that \
         child's tokens",
    ),
    (1938, "the same, in another world"),
    (
        9710,
        "a timed-out session's cancel, cut short after the session's own record, let a \
         child under it run on and spend what the session's total never counted",
    ),
    (
        6333,
        "a step retried after a restart shared another tree's run of a mission whose \
         child it had created, which ran unrecorded: paid twice, counted in no total",
    ),
    (
        2922,
        "a run one call started and another call of the session shared was cancelled by \
         its own timeout; both calls delegated again, and the starter's cancelled child \
         left the session's total (only the calls that shared a run delegate again)",
    ),
];

/// The same, found with swarm faults.
const GENERATED_SWARM_REGRESSIONS: &[(u64, &str)] = &[
    (
        917,
        "a follow-up question's answer was settled with the child's earlier answer, read \
         when the parent's job was loaded (a full disk had made the step run again)",
    ),
    (
        1824,
        "a session dead-lettered at a delegation whose children were created but never \
         recorded left them running, uncounted and never cancelled",
    ),
    (
        2212,
        "a session whose timeout ran out during its model call kept its quota permit, so \
         a model limited to one call at a time stopped for ten minutes",
    ),
    (2382, "the same, under a limit of two"),
    (
        704,
        "a parent settled its child as cancelled from a notice that outlived a restart, \
         carrying a cancel the disk had not kept; the child ran on, its tokens in no total \
         (the simulation's fault: its notices now die with the process, as the embedded \
         store's do)",
    ),
    (
        1363,
        "a root's cancel, read by a worker before its sync failed, was announced, and the \
         root's later ending too (the simulation's fault: its announcements now stay with \
         the log across a restart)",
    ),
    (
        3718,
        "two calls whose shared runs another tree had cancelled delegated again, each \
         numbered by the calls decided together: a step run again after its first try had \
         created one call's child numbered it for the other call, which took it as its own \
         (each call now takes the number its own delegation left uncreated)",
    ),
    (6900, "as 2922, with swarm faults"),
    (8370, "as 2922, with swarm faults, in another world"),
    (
        6881,
        "a call whose shared run was cancelled delegated again and was answered from the \
         cache (the simulation's check took the call's first delegation for unanswered; a \
         cache hit for the call now answers it)",
    ),
    (
        3395,
        "a team's turn delegated in batches: a slow job push let a member of the first \
         batch end before its supervisor existed, and the supervisor waited for ever for \
         the member it never heard leave (a team's turn is now one batch)",
    ),
];

/// Generated worlds whose operator also cancels sessions inside the trees
/// (`--inner-cancels`) that found a bug: seed, swarm faults, the bug.
const INNER_CANCEL_REGRESSIONS: &[(u64, bool, &str)] = &[
    (
        1421,
        false,
        "a job ended after pipelining a turn's records (its model call held back by the \
         quota) and kept its fold; the append was refused, a cancel took its place in the \
         log, and the parent's settlement read the child's usage from the kept fold: 31 \
         tokens never spent in its total (a fold whose pipelined records are not made \
         sure of is no longer kept)",
    ),
    (2924, false, "as 1421, in another world"),
    (7039, true, "as 1421, with swarm faults"),
    (
        8183,
        true,
        "two children of a cached agent timed out under the faults (a fresh run has them \
         answer), and its answer without them was cached and served to another tree (an \
         answer made without some child's answer, at any depth, is no longer cached)",
    ),
    (
        9837,
        true,
        "a cache entry was made from a child's `Completed` read before its sync failed; \
         the disk did not keep it, the child was cancelled by its timeout, and the entry \
         answered another tree from a run its log does not show (the embedded store takes \
         out the entries no flush covered once a sync of its log fails; the simulation's \
         store, those whose source's answer the disk did not keep)",
    ),
    (
        21706,
        true,
        "a call whose shared run an operator cancelled delegated again and was answered \
         from the cache at once; the look counted nothing settled and the session waited \
         for a child's end that would never come (a redone call now counts as moved on)",
    ),
    (
        4145,
        true,
        "a session asked its `chat: true` child a follow-up after settling its first \
         answer, then an operator cancelled the session: the 53 tokens the child spent on \
         the follow-up reached no total, since only children not yet settled were rolled \
         up (every child the session started itself now rolls up what it spent since it \
         was last counted)",
    ),
];

#[test]
fn the_generated_worlds_with_cancels_inside_trees_that_found_bugs_keep_every_invariant() {
    let opts = skein_sim::gen::Options {
        inner_cancels: true,
        ..Default::default()
    };
    for (seed, swarm, bug) in INNER_CANCEL_REGRESSIONS {
        let g = skein_sim::simulate_generated(*seed, *swarm, opts);
        assert_eq!(g.refused, None, "seed {seed}: the loader refused the set");
        assert!(
            g.verdict.violations.is_empty(),
            "seed {seed} ({bug}): {:?}",
            g.verdict.violations
        );
    }
}

/// The widest space: cancels inside trees, a person who answers items of an earlier look
/// at the inbox (some of whose sessions have ended since: none of those answers may be
/// taken), and cache entries that expire while trees run. The worlds must meet each, or
/// the test tests nothing.
#[test]
fn worlds_with_stale_answers_and_expiring_cache_entries_keep_every_invariant() {
    let opts = skein_sim::gen::Options {
        inner_cancels: true,
        stale_tokens: true,
        short_ttl: true,
        ..Default::default()
    };
    let (mut tried_after_end, mut taken, mut expired) = (0, 0, 0);
    for seed in 1..=20 {
        let g = skein_sim::simulate_generated(seed, seed % 2 == 0, opts);
        assert!(
            g.verdict.violations.is_empty(),
            "seed {seed}: {:?}",
            g.verdict.violations
        );
        let run = g.run.expect("the world ran");
        tried_after_end += run.person.stale_ended;
        taken += run.person.stale_taken;
        expired += run.store.expired_reads();
    }
    assert!(
        tried_after_end > 0,
        "no answer was sent to a session that had ended"
    );
    assert!(
        taken > 0,
        "no answer from an old look was taken while its session waited"
    );
    assert!(expired > 0, "no cache read found an expired entry");
}

#[test]
fn the_generated_worlds_that_found_bugs_keep_every_invariant() {
    let plain = GENERATED_REGRESSIONS.iter().map(|r| (r, false));
    let swarm = GENERATED_SWARM_REGRESSIONS.iter().map(|r| (r, true));
    for ((seed, bug), swarm) in plain.chain(swarm) {
        let g = skein_sim::simulate_generated(*seed, swarm, Default::default());
        assert_eq!(g.refused, None, "seed {seed}: the loader refused the set");
        assert!(
            g.verdict.violations.is_empty(),
            "seed {seed} ({bug}): {:?}",
            g.verdict.violations
        );
    }
}

/// A seed draws the same agent set every time, and what `--dump` writes is what the
/// loader of `skein agents check` reads back.
#[test]
fn a_generated_set_is_the_same_every_time_and_loads_from_its_files() {
    use skein_sim::gen::{generate, Options};
    for seed in [1, 2, 3, 118, 4242] {
        let a = generate(seed, Options::default());
        let b = generate(seed, Options::default());
        assert_eq!(a.files(), b.files(), "seed {seed}");
        let dir = tempfile::tempdir().unwrap();
        let lines = a.dump(dir.path()).unwrap();
        assert!(lines[0].ends_with("agents check"), "{lines:?}");
        assert_eq!(lines.len(), a.trees.len() + 1);
        let mut files = vec![];
        for e in std::fs::read_dir(dir.path().join("agents")).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            files.push((name, std::fs::read_to_string(&p).unwrap()));
        }
        files.sort();
        skein_core::AgentSet::load(&files, &[]).unwrap();
        for agent in &a.agents {
            let script = dir
                .path()
                .join("scripts")
                .join(format!("{}.yaml", agent.name));
            assert_eq!(std::fs::read_to_string(script).unwrap(), agent.script);
        }
        assert!(dir.path().join("skein.toml").exists());
    }
}

/// Worlds of definition versions and workers that differ (`--versions`, swarm) whose seeds
/// found bugs: a waiting parent dead-lettered after hand-backs counted as deliveries (17,
/// 38, 74), and jobs handed back by a worker that lacked something, won back by it every
/// time while the worker that had it waited (140, 933, 1011); a tree waiting on a run it
/// shared with another tree, whose approval only the other tree's inbox listed (1294,
/// 1470); an approval whose wake-up was lost to an outage after the decision was written
/// (1496); a tree answered just before the faults stopped, checked before its next
/// step could run (117); a job handed back by one slot of a worker that lacked the newer
/// format and claimed again by its other slots, thousands of times, while the worker that
/// read it never got it (3774; later also sessions waiting past their `limits.timeout`,
/// woken every few milliseconds without end, which the bound on claims now catches); a
/// timeout that cancelled a session in the middle of a step
/// that delegated, whose unrecorded grandchild's model calls reached no total (1199); a
/// step retried after its crash that shared another tree's run of a mission whose child it
/// had created (1218); a session cancelled by its timeout before it settled a child its
/// model had answered, which counted what the child spent since its question twice (1484);
/// two jobs a worker lacked the provider for, handed back by it 0.25 s apart, whose slots
/// came back from standing aside at the instant the other job fell due and claimed it
/// first, for ever (941); a call whose shared run another tree cancelled, which delegated
/// again on a decision made before the same look's settlements were folded in, and whose
/// tree then completed with that run never settled (1876; deciding after them ended it,
/// the path between was not traced).
const VERSIONS_REGRESSIONS: &[u64] = &[
    17, 38, 74, 117, 140, 933, 941, 1011, 1199, 1218, 1294, 1470, 1484, 1496, 1876, 3774,
];

/// The same without swarm faults: a call whose shared run was cancelled delegated again
/// with the budget it had before the same look's settlements, more than was free (500);
/// a cache hit for a tree on a later version of the definitions, answered from a run made
/// when an agent under the cached one had another definition (6, 7, 16, 18: a cached
/// agent's key now covers the definitions of every agent it may start).
const VERSIONS_PLAIN_REGRESSIONS: &[u64] = &[500, 6, 7, 16, 18];

#[test]
fn the_versions_seeds_that_found_bugs_keep_every_invariant() {
    let swarm = VERSIONS_REGRESSIONS.iter().map(|s| (s, true));
    let plain = VERSIONS_PLAIN_REGRESSIONS.iter().map(|s| (s, false));
    for (seed, swarm) in swarm.chain(plain) {
        let (_, v) = skein_sim::simulate_versions(*seed, swarm, true).expect("the world loads");
        assert!(v.violations.is_empty(), "seed {seed}: {:?}", v.violations);
    }
}
