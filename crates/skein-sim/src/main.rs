//! `skein-sim --seeds N [--swarm]` runs seeds 1..=N and prints the violations found;
//! `skein-sim --seed S` runs one seed and prints its schedule and verdict. The log lies on
//! a disk that fails, fills and rots unless `--no-disk-faults` is given.

use std::process::ExitCode;
use std::time::Instant;

use std::sync::atomic::Ordering;

fn usage() -> ExitCode {
    eprintln!(
        "usage: skein-sim [--generated [--known-shapes-only] | --versions] [--inner-cancels] [--stale-tokens] [--short-ttl] (--seeds N [--from S] | --seed S [--dump DIR] [--trace SESSION]) [--swarm] [--no-disk-faults]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let swarm = args.iter().any(|a| a == "--swarm");
    let disk = !args.iter().any(|a| a == "--no-disk-faults");
    let value = |flag: &str| -> Option<u64> {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1)?.parse().ok()
    };
    let opts = skein_sim::gen::Options {
        // Every shape is drawn unless told otherwise (`--open-bugs`, which asked for
        // them before their bugs were fixed, is still accepted).
        open: !args.iter().any(|a| a == "--known-shapes-only"),
        inner_cancels: args.iter().any(|a| a == "--inner-cancels"),
        stale_tokens: args.iter().any(|a| a == "--stale-tokens"),
        short_ttl: args.iter().any(|a| a == "--short-ttl"),
    };
    if args.iter().any(|a| a == "--versions") {
        let trace = args
            .iter()
            .position(|a| a == "--trace")
            .and_then(|i| args.get(i + 1))
            .cloned();
        return match (value("--seed"), value("--seeds")) {
            (Some(seed), _) => versions_many(seed, 1, (swarm, disk, opts), Some(trace)),
            (None, Some(n)) => {
                versions_many(value("--from").unwrap_or(1), n, (swarm, disk, opts), None)
            }
            _ => usage(),
        };
    }
    if args.iter().any(|a| a == "--generated") {
        let dump = args
            .iter()
            .position(|a| a == "--dump")
            .and_then(|i| args.get(i + 1))
            .map(std::path::PathBuf::from);
        return match (value("--seed"), value("--seeds")) {
            (Some(seed), _) => generated_one(seed, swarm, opts, disk, dump.as_deref()),
            (None, Some(n)) => generated_many(value("--from").unwrap_or(1), n, swarm, opts, disk),
            _ => usage(),
        };
    }
    if let Some(seed) = value("--seed") {
        let (run, v) = skein_sim::simulate_on(seed, swarm, disk);
        let f = &run.faults;
        println!(
            "seed {seed}{}{}",
            if swarm { " (swarm)" } else { "" },
            if disk { "" } else { " (no disk faults)" }
        );
        println!("rates: {:?}", f.rates);
        println!(
            "schedule: worker kills at {:?} virtual ms; trees cancelled {:?}; {} conflicts, \
             {} unreachable calls, {} notices lost, {} posted twice, {} late, {} model \
             failures, {} slow calls, {} slow job pushes, {} slow appends, {} slow reads, {} \
             heartbeats lost; \
             {} virtual ms",
            run.crashes,
            run.cancelled,
            f.conflicts.load(Ordering::Relaxed),
            f.unreachable.load(Ordering::Relaxed),
            f.notices_lost.load(Ordering::Relaxed),
            f.notices_twice.load(Ordering::Relaxed),
            f.notices_late.load(Ordering::Relaxed),
            f.model_failures.load(Ordering::Relaxed),
            f.slow_calls.load(Ordering::Relaxed),
            f.slow_pushes.load(Ordering::Relaxed),
            f.slow_appends.load(Ordering::Relaxed),
            f.slow_reads.load(Ordering::Relaxed),
            f.heartbeats_lost.load(Ordering::Relaxed),
            run.virtual_ms
        );
        if let Some(d) = run.store.disk() {
            println!("disk rates: {:?}", d.rates);
            println!("{}; restarts at {:?} virtual ms", d.report(), run.restarts);
        }
        println!(
            "person: {} answers, {} approvals, {} denials, {} used tokens sent again",
            run.person.answers, run.person.approvals, run.person.denials, run.person.reuse_tries
        );
        println!(
            "sessions {}, events {}, trees failed {}",
            v.sessions, v.events, v.failed_roots
        );
        println!("events by kind: {:?}", v.kinds);
        print_records(&run);
        return match v.violations.first() {
            None => {
                println!("ok: every invariant holds");
                ExitCode::SUCCESS
            }
            Some(first) => {
                println!("first violation: {first}");
                println!("jobs at the end:");
                for j in &run.jobs_at_end {
                    println!("  {j}");
                }
                if let Some(s) = first.split(':').next() {
                    if let Ok(id) = skein_core::SessionId::parse(s) {
                        if let Some(recs) = run.logs.get(&id) {
                            println!("log of {id}:");
                            for r in recs {
                                println!(
                                    "  {} {}",
                                    r.env.seq,
                                    serde_json::to_string(&r.env.body.to_json())
                                        .unwrap_or_default()
                                        .chars()
                                        .take(160)
                                        .collect::<String>()
                                );
                            }
                        }
                    }
                }
                for root in &run.roots {
                    if run.store.ended(root) {
                        continue;
                    }
                    println!("tree {root} did not end:");
                    for (id, recs) in run.logs.range(root.clone()..) {
                        if !root.contains(id) {
                            break;
                        }
                        let kinds: Vec<String> = recs
                            .iter()
                            .map(|r| match &r.env.body {
                                skein_core::Event::ChildSettled(c) => {
                                    format!("ChildSettled({})", c.call)
                                }
                                skein_core::Event::Delegated(d) => format!("Delegated({})", d.call),
                                e => e.kind().to_string(),
                            })
                            .collect();
                        println!("  {id}: {}", kinds.join(" "));
                    }
                }
                ExitCode::FAILURE
            }
        };
    }
    let Some(n) = value("--seeds") else {
        return usage();
    };
    let from = value("--from").unwrap_or(1);
    let started = Instant::now();
    let mut bad = 0u64;
    let mut kinds = std::collections::BTreeMap::new();
    let (mut crashes, mut conflicts, mut unreachable, mut lost, mut twice, mut model) =
        (0, 0, 0, 0, 0, 0);
    let (mut late, mut slow, mut beats, mut cancels, mut pushes, mut appends) = (0, 0, 0, 0, 0, 0);
    let mut reads = 0;
    let (mut answers, mut decisions, mut reuses) = (0, 0, 0);
    let mut disk_sum = DiskSum::default();
    let mut most = MostClaims::default();
    for seed in from..from + n {
        let (run, v) = skein_sim::simulate_on(seed, swarm, disk);
        disk_sum.add(&run);
        most.add(seed, &v);
        let f = &run.faults;
        crashes += run.crashes.len() as u64;
        conflicts += f.conflicts.load(Ordering::Relaxed);
        unreachable += f.unreachable.load(Ordering::Relaxed);
        lost += f.notices_lost.load(Ordering::Relaxed);
        twice += f.notices_twice.load(Ordering::Relaxed);
        model += f.model_failures.load(Ordering::Relaxed);
        late += f.notices_late.load(Ordering::Relaxed);
        slow += f.slow_calls.load(Ordering::Relaxed);
        beats += f.heartbeats_lost.load(Ordering::Relaxed);
        pushes += f.slow_pushes.load(Ordering::Relaxed);
        appends += f.slow_appends.load(Ordering::Relaxed);
        reads += f.slow_reads.load(Ordering::Relaxed);
        cancels += run.cancelled.len() as u64;
        answers += run.person.answers;
        decisions += run.person.approvals + run.person.denials;
        reuses += run.person.reuse_tries;
        for (k, c) in v.kinds {
            *kinds.entry(k).or_insert(0u64) += c;
        }
        if let Some(first) = v.violations.first() {
            bad += 1;
            println!(
                "seed {seed}: {first} (replay with --seed {seed}{}{})",
                if swarm { " --swarm" } else { "" },
                if disk { "" } else { " --no-disk-faults" }
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "seeds {n} (from {from}{}), violations {bad}, {:.1} s, {:.0} seeds/s",
        if swarm { ", swarm" } else { "" },
        secs,
        n as f64 / secs.max(1e-9)
    );
    most.print();
    println!(
        "faults: {crashes} worker kills, {conflicts} append conflicts, {unreachable} \
         unreachable calls, {lost} notices lost, {twice} posted twice, {late} late, {model} \
         model failures, {slow} slow model calls, {pushes} slow job pushes, {appends} slow appends, \
         {reads} slow reads, {beats} heartbeats lost, {cancels} trees cancelled"
    );
    println!(
        "person: {answers} answers, {decisions} approvals decided, {reuses} used tokens sent \
         again (all refused unless a violation says otherwise)"
    );
    disk_sum.print(disk);
    println!("events by kind: {kinds:?}");
    if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn flags(swarm: bool, opts: skein_sim::gen::Options, disk: bool) -> String {
    format!(
        "--generated{}{}{}{}{}{}",
        if opts.open {
            ""
        } else {
            " --known-shapes-only"
        },
        if opts.inner_cancels {
            " --inner-cancels"
        } else {
            ""
        },
        if opts.stale_tokens {
            " --stale-tokens"
        } else {
            ""
        },
        if opts.short_ttl { " --short-ttl" } else { "" },
        if swarm { " --swarm" } else { "" },
        if disk { "" } else { " --no-disk-faults" }
    )
}

/// The most claims of one session's job in one run, over many seeds: how many, in which
/// seed, of which session.
#[derive(Default)]
struct MostClaims(Option<(u64, u64, String)>);

impl MostClaims {
    fn add(&mut self, seed: u64, v: &skein_sim::invariants::Verdict) {
        if let Some((id, n)) = &v.most_claimed {
            if self.0.as_ref().is_none_or(|(m, _, _)| n > m) {
                self.0 = Some((*n, seed, id.to_string()));
            }
        }
    }

    fn print(&self) {
        if let Some((n, seed, id)) = &self.0 {
            println!(
                "most claims of one session's job in a run: {n} (seed {seed}, {id}; a run may \
                 make {} and one per {} virtual ms)",
                skein_sim::invariants::CLAIMS_BASE,
                skein_sim::invariants::CLAIMS_EVERY_MS
            );
        }
    }
}

/// What the disk's faults did over many seeds.
#[derive(Default)]
struct DiskSum {
    syncs_failed: u64,
    restarts: u64,
    dropped: u64,
    writes_failed: u64,
    fulls: u64,
    full_refusals: u64,
    damaged: u64,
    refused_opens: u64,
}

impl DiskSum {
    fn add(&mut self, run: &skein_sim::world::Run) {
        let Some(d) = run.store.disk() else { return };
        let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        self.syncs_failed += n(&d.syncs_failed);
        self.restarts += run.restarts.len() as u64;
        self.dropped += n(&d.dropped);
        self.writes_failed += n(&d.writes_failed);
        self.fulls += n(&d.fulls);
        self.full_refusals += n(&d.full_refusals);
        self.damaged += n(&d.damaged);
        self.refused_opens += n(&d.refused_opens);
    }

    fn print(&self, on: bool) {
        if !on {
            println!("disk faults: off");
            return;
        }
        println!(
            "disk: {} syncs failed ({} restarts, {} unsynced records dropped), {} writes \
             failed, full {} times ({} appends refused), {} bytes flipped at rest ({} opens \
             refused)",
            self.syncs_failed,
            self.restarts,
            self.dropped,
            self.writes_failed,
            self.fulls,
            self.full_refusals,
            self.damaged,
            self.refused_opens
        );
    }
}

/// One generated seed: its verdict, and its agent set written out with `--dump DIR`.
fn generated_one(
    seed: u64,
    swarm: bool,
    opts: skein_sim::gen::Options,
    disk: bool,
    dump: Option<&std::path::Path>,
) -> ExitCode {
    let g = skein_sim::simulate_generated_on(seed, swarm, opts, disk);
    println!("seed {seed} ({})", flags(swarm, opts, disk));
    if let Some(dir) = dump {
        match g.scenario.dump(dir) {
            Ok(lines) => {
                println!(
                    "agent set written to {}; to check and run it:",
                    dir.display()
                );
                for l in lines {
                    println!("  {l}");
                }
            }
            Err(e) => {
                eprintln!(
                    "error: cannot write the agent set to {}: {e}",
                    dir.display()
                );
                return ExitCode::FAILURE;
            }
        }
    } else {
        println!(
            "agents: {}",
            g.scenario
                .agents
                .iter()
                .map(|a| a.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let trees: Vec<String> = g
            .scenario
            .trees
            .iter()
            .map(|t| format!("{} {:?}", t.agent, t.mission))
            .collect();
        println!("trees: {}", trees.join("; "));
        println!("(write the set out with --dump DIR)");
    }
    if let Some(why) = &g.refused {
        println!("the loader refused the set: {why}");
        return ExitCode::FAILURE;
    }
    if let Some(run) = &g.run {
        print_records(run);
        if let Some(d) = run.store.disk() {
            println!("{}; restarts at {:?} virtual ms", d.report(), run.restarts);
        }
        if let Some(q) = &run.quota {
            println!(
                "{}; workers killed at {:?} virtual ms",
                q.report(),
                run.crashes
            );
        }
    }
    let v = &g.verdict;
    println!(
        "sessions {}, events {}, trees failed {}, cache hits compared {} (not comparable {})",
        v.sessions, v.events, v.failed_roots, g.hits_checked, g.hits_unmatched
    );
    println!("events by kind: {:?}", v.kinds);
    if v.violations.is_empty() {
        println!("ok: every invariant holds");
        return ExitCode::SUCCESS;
    }
    for violation in &v.violations {
        println!("violation: {violation}");
    }
    if let Some(run) = &g.run {
        // The trees named by a violation, every session with its events and the tokens
        // its own model calls spent.
        for root in &run.roots {
            let named = v
                .violations
                .iter()
                .any(|x| x.starts_with(&format!("{root}:")) || x.starts_with(&format!("{root}.")));
            if !named {
                continue;
            }
            println!("tree {root}:");
            for (id, recs) in run.logs.range(root.clone()..) {
                if !root.contains(id) {
                    break;
                }
                let own: u64 = recs
                    .iter()
                    .map(|r| match &r.env.body {
                        skein_core::Event::ModelCalled(m) => m.usage.total_tokens(),
                        _ => 0,
                    })
                    .sum();
                let kinds: Vec<&str> = recs.iter().map(|r| r.env.body.kind()).collect();
                println!("  {id} ({own} tokens of its own): {}", kinds.join(" "));
                for r in recs {
                    if let skein_core::Event::Failed(f) = &r.env.body {
                        println!("    failed at seq {}: {}", r.env.seq, f.error);
                    }
                }
            }
        }
    }
    ExitCode::FAILURE
}

/// The seeds of `known-seeds.txt` for these flags: each fails on a bug known and still
/// open (its line says which). A line is `SEED FLAGS… | diagnosis`; `#` starts a comment.
fn known_seeds(flags: &str) -> std::collections::BTreeMap<u64, String> {
    let text = include_str!("../known-seeds.txt");
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let (head, why) = l.split_once('|')?;
            let mut words = head.split_whitespace();
            let seed = words.next()?.parse().ok()?;
            let rest: Vec<&str> = words.collect();
            (rest.join(" ") == flags).then(|| (seed, why.trim().to_string()))
        })
        .collect()
}

/// Generated seeds `from..from + n`: a line for each that fails, and the figures. A seed
/// listed in `known-seeds.txt` that fails is reported as known and does not fail the run.
fn generated_many(
    from: u64,
    n: u64,
    swarm: bool,
    opts: skein_sim::gen::Options,
    disk: bool,
) -> ExitCode {
    let known = known_seeds(&flags(swarm, opts, disk));
    let mut disk_sum = DiskSum::default();
    let mut known_failed = 0u64;
    let started = Instant::now();
    let (mut bad, mut refused, mut agents, mut trees, mut checked, mut unmatched) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut kinds = std::collections::BTreeMap::new();
    let mut stale = (0u32, 0u32, 0u32);
    let mut expired = 0u64;
    let mut dropped = 0u64;
    let mut most = MostClaims::default();
    for seed in from..from + n {
        let g = skein_sim::simulate_generated_on(seed, swarm, opts, disk);
        if let Some(run) = &g.run {
            disk_sum.add(run);
        }
        agents += g.scenario.agents.len() as u64;
        trees += g.scenario.trees.len() as u64;
        checked += g.hits_checked;
        unmatched += g.hits_unmatched;
        if let Some(run) = &g.run {
            expired += run.store.expired_reads();
            dropped += run.store.dropped_pushes();
            stale.0 += run.person.stale_tries;
            stale.1 += run.person.stale_ended;
            stale.2 += run.person.stale_taken;
        }
        if let Some(why) = &g.refused {
            refused += 1;
            println!(
                "seed {seed}: the loader refused the generated set: {why} (see it with --seed {seed} {} --dump DIR)",
                flags(swarm, opts, disk)
            );
            continue;
        }
        most.add(seed, &g.verdict);
        for (k, c) in &g.verdict.kinds {
            *kinds.entry(k.clone()).or_insert(0u64) += c;
        }
        if let Some(first) = g.verdict.violations.first() {
            if let Some(why) = known.get(&seed) {
                known_failed += 1;
                println!("seed {seed}: known, {why}: {first}");
                continue;
            }
            bad += 1;
            println!(
                "seed {seed}: {first} (replay with --seed {seed} {} --dump DIR)",
                flags(swarm, opts, disk)
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "generated configurations {n} (seeds from {from}{}), {agents} agents, {trees} trees; \
         refused by the loader {refused}, violations {bad}; {:.1} s, {:.0} seeds/s",
        if swarm { ", swarm" } else { "" },
        secs,
        n as f64 / secs.max(1e-9)
    );
    println!(
        "cache hits compared with a fresh run {checked} (not comparable {unmatched}); reads \
         of an expired entry {expired}; pushes dropped for sessions ended for good {dropped}"
    );
    most.print();
    if opts.stale_tokens {
        println!(
            "items of an earlier look at the inbox answered {} ({} of them after their \
             session ended), taken {} (each taken while its session still waited on it, \
             unless a violation says otherwise)",
            stale.0, stale.1, stale.2
        );
    }
    disk_sum.print(disk);
    println!(
        "known seeds (crates/skein-sim/known-seeds.txt) in this range that failed: {known_failed}"
    );
    println!("events by kind: {kinds:?}");
    if bad == 0 && refused == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// With `SKEIN_SIM_DUMP` set, every record in virtual-time order (in full for the sessions
/// whose ids start with its value).
fn print_records(run: &skein_sim::world::Run) {
    if std::env::var_os("SKEIN_SIM_DUMP").is_some() {
        let mut all: Vec<_> = run.logs.values().flatten().collect();
        all.sort_by_key(|r| (r.env.at, r.env.session.clone(), r.env.seq));
        let show = std::env::var("SKEIN_SIM_DUMP").unwrap_or_default();
        for r in all {
            if !show.is_empty() && r.env.session.as_str().starts_with(show.as_str()) {
                println!(
                    "{} {} {} {}",
                    r.env.at,
                    r.env.session,
                    r.env.seq,
                    serde_json::to_string(&r.env.body.to_json()).unwrap_or_default()
                );
            } else {
                println!(
                    "{} {} {} {}",
                    r.env.at,
                    r.env.session,
                    r.env.seq,
                    r.env.body.kind()
                );
            }
        }
    }
}

/// Generated worlds with definition versions and workers that differ (`--versions`).
/// `show`: print each session and what the run saw (one seed), with every record of the
/// sessions under the traced one (virtual ms since the start, kind, body).
fn versions_many(
    from: u64,
    n: u64,
    (swarm, disk, opts): (bool, bool, skein_sim::gen::Options),
    show: Option<Option<String>>,
) -> ExitCode {
    let started = Instant::now();
    let (mut bad, mut refused, mut trees, mut newer_refused, mut newer_written) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut asked = std::collections::BTreeMap::<String, u64>::new();
    let mut lacks = std::collections::BTreeMap::<String, u64>::new();
    let mut most = MostClaims::default();
    for seed in from..from + n {
        let Some((run, v)) = skein_sim::simulate_versions_with(seed, swarm, disk, opts) else {
            refused += 1;
            continue;
        };
        let Some(mix) = &run.mix else { continue };
        most.add(seed, &v);
        trees += run.roots.len() as u64;
        newer_refused += mix.newer_refused.load(Ordering::Relaxed);
        newer_written += mix.newer_written.load(Ordering::Relaxed);
        fn guard<T: Clone>(m: &std::sync::Mutex<T>) -> T {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        }
        let seen: std::collections::BTreeMap<String, u64> = guard(&mix.asked);
        for (k, c) in seen {
            *asked.entry(k).or_default() += c;
        }
        let l: std::collections::BTreeMap<String, skein_sim::versions::Lack> = guard(&mix.lacks);
        for lack in l.values() {
            let k = format!("{lack:?}");
            let k = k.split('(').next().unwrap_or_default().to_string();
            *lacks.entry(k).or_default() += 1;
        }
        if let Some(trace) = &show {
            for (id, recs) in &run.logs {
                if let Some(skein_core::Event::Submitted(s)) = recs.first().map(|r| &r.env.body) {
                    println!(
                        "{id}: {} on {:?}, ends {}",
                        s.agent,
                        s.defs.as_deref().map(skein_core::definitions::short),
                        recs.last().map(|r| r.env.body.kind()).unwrap_or("-")
                    );
                    if let Some(skein_core::Event::Failed(f)) = recs.last().map(|r| &r.env.body) {
                        println!("  failed: {}", f.error);
                    }
                }
            }
            if let Some(traced) = trace
                .as_deref()
                .and_then(|t| skein_core::SessionId::parse(t).ok())
            {
                for (id, recs) in run.logs.iter().filter(|(id, _)| traced.contains(id)) {
                    for r in recs {
                        let body = format!("{:?}", r.env.body);
                        println!(
                            "  {id} #{} +{} ms {}",
                            r.env.seq,
                            r.env
                                .at
                                .saturating_sub(skein_sim::faults::SimClock::EPOCH_MS),
                            body.chars().take(300).collect::<String>()
                        );
                    }
                }
            }
            println!("jobs at the end: {:?}", run.jobs_at_end);
            println!(
                "asked: {:?}; newer refused {}",
                mix.asked.lock().map(|l| l.clone()).unwrap_or_default(),
                mix.newer_refused.load(Ordering::Relaxed)
            );
            println!(
                "workers' lacks: {:?}",
                mix.lacks.lock().map(|l| l.clone()).unwrap_or_default()
            );
            println!(
                "crashes at {:?}, restarts at {:?}, {} virtual ms",
                run.crashes, run.restarts, run.virtual_ms
            );
            println!("violations: {:#?}", v.violations);
        }
        if let Some(first) = v.violations.first() {
            bad += 1;
            println!(
                "seed {seed}: {first} (replay with --versions --seed {seed}{}{})",
                if swarm { " --swarm" } else { "" },
                if disk { "" } else { " --no-disk-faults" }
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "versions: {n} seeds (from {from}{}), {trees} trees, refused by the loader {refused}, \
         violations {bad}; {secs:.1} s",
        if swarm { ", swarm" } else { "" }
    );
    println!("workers by what they lacked: {lacks:?}");
    println!("asked whether another worker has it, by need: {asked:?}");
    println!(
        "records of the newer format written {newer_written}; reads an earlier release refused {newer_refused}"
    );
    most.print();
    if bad > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
