//! A node loss never strands a cluster. The operator's scenario, repeated with seeded
//! randomness: a 3-node JetStream cluster with every stream on three replicas, three
//! `skein worker` processes given every node's address, orchestrator missions published
//! with the raw NATS protocol to the first node, then one node killed with SIGKILL at a
//! random moment — a random node, the leader of `SKEIN_JOBS` or the leader of
//! `SKEIN_EVENTS` — and started again on its own store after a random delay. Every tree
//! must complete (none stranded, none failed), every log's hash chain and every decision
//! must verify afterwards, and an independent subscriber must hear no tree's result twice.
//!
//! `SKEIN_NODE_LOSS_REPS` (default 2), `SKEIN_NODE_LOSS_MISSIONS` (default 60) and
//! `SKEIN_NODE_LOSS_SEED` (default: from the clock, printed) set the repetitions, the
//! missions per repetition and the first seed; a failing repetition prints its seed, and
//! `SKEIN_NODE_LOSS_SEED=<seed> SKEIN_NODE_LOSS_REPS=1` replays its schedule.

mod common;

use std::time::{Duration, Instant};

use common::cluster::*;
use common::*;
use skein_core::{Event, SessionId};
use skein_testnats::Cluster;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}"))
        })
        .unwrap_or(default)
}

/// xorshift64*: enough to draw a schedule from a seed, reproducibly.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Which node the schedule kills.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Random,
    JobsLeader,
    EventsLeader,
}

async fn leader_of(js: &async_nats::jetstream::Context, stream: &str) -> Option<String> {
    let mut s = js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    info.cluster.as_ref().and_then(|c| c.leader.clone())
}

/// What each root's log ends with, for a failure message.
async fn states(b: &skein_runtime::Backend, roots: &[SessionId]) -> Vec<(SessionId, String)> {
    let mut out = vec![];
    for r in roots {
        let last = match tokio::time::timeout(Duration::from_secs(5), b.log.last(r)).await {
            Ok(Ok(Some(rec))) => rec.env.body.kind().to_string(),
            Ok(Ok(None)) => "no log".into(),
            Ok(Err(e)) => format!("unreadable: {e}"),
            Err(_) => "read timed out".into(),
        };
        out.push((r.clone(), last));
    }
    out
}

fn one_loss(seed: u64, missions_n: usize) {
    let mut rng = Rng::new(seed);
    let victim_kind = match rng.below(3) {
        0 => Victim::Random,
        1 => Victim::JobsLeader,
        _ => Victim::EventsLeader,
    };
    let kill_after = Duration::from_millis(300 + rng.below(2700));
    let down_for = Duration::from_millis(500 + rng.below(9500));
    let mut cluster = Cluster::start();
    let urls = cluster.urls();
    let logs: Vec<LogLines> = (0..3).map(|_| LogLines::default()).collect();
    let _workers = Workers(
        (0..3)
            .map(|i| worker_logged(&urls, &format!("nl{i}"), 3, Some(logs[i].clone())))
            .collect(),
    );
    let (ids, payloads) = missions(&format!("nl{}", tag()), missions_n);
    // An independent subscriber of the results, moving to another node if its own is
    // killed (what it misses then, it misses): no tree's result may come twice.
    let tally = ResultTally::subscribe(&(0..3).map(|i| cluster.url(i)).collect::<Vec<_>>());
    raw_publish(&cluster.url(0), "skein.missions.submit", &payloads);
    let rt = rt();
    // One client for the checks, connected before the loss (it reconnects by itself).
    let st = rt.block_on(store(&urls, 3));
    let b = st.backend();
    std::thread::sleep(kill_after);
    let victim = match victim_kind {
        Victim::Random => rng.below(3) as usize,
        Victim::JobsLeader | Victim::EventsLeader => {
            let stream = if matches!(victim_kind, Victim::JobsLeader) {
                "SKEIN_JOBS"
            } else {
                "SKEIN_EVENTS"
            };
            let leader = rt.block_on(leader_of(&st.js, stream));
            leader
                .and_then(|l| cluster.index_of(&l))
                .unwrap_or_else(|| rng.below(3) as usize)
        }
    };
    let schedule = format!(
        "seed {seed}: kill {} ({victim_kind:?}) after {kill_after:?}, restart after {down_for:?}",
        cluster.name(victim)
    );
    eprintln!("node loss: {schedule}");
    cluster.kill9(victim);
    std::thread::sleep(down_for);
    cluster.revive(victim);
    let revived = Instant::now();
    // Every tree ends, and ends completed.
    let limit = Duration::from_secs(180);
    let open = rt.block_on(async {
        loop {
            let open: Vec<(SessionId, String)> = states(&b, &ids)
                .await
                .into_iter()
                .filter(|(_, last)| last != "Completed")
                .collect();
            let failed = open.iter().any(|(_, last)| last == "Failed");
            if open.is_empty() || failed || revived.elapsed() > limit {
                return open;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    if !open.is_empty() {
        let mut report = format!(
            "{} of {} trees did not complete within {limit:?} of the restart ({schedule}):\n",
            open.len(),
            ids.len()
        );
        for (id, last) in open.iter().take(10) {
            report.push_str(&format!("  {id}: last event {last}\n"));
        }
        for (i, log) in logs.iter().enumerate() {
            let lines = log.lock().unwrap_or_else(|p| p.into_inner());
            let tail: Vec<&String> = lines.iter().rev().take(15).collect();
            report.push_str(&format!("worker nl{i}, last lines:\n"));
            for l in tail.into_iter().rev() {
                report.push_str(&format!("  {l}\n"));
            }
        }
        for i in 0..3 {
            let log = cluster.log(i);
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            report.push_str(&format!("{}, last lines:\n", cluster.name(i)));
            for l in tail.into_iter().rev() {
                report.push_str(&format!("  {l}\n"));
            }
        }
        panic!("{report}");
    }
    // Every log: the chain, one terminal event and it is Completed, no duplicated tool
    // call, and every decision re-derived from the log.
    // A replica that was just restarted may answer direct reads before it has caught up
    // (reads may come from any replica; appends are checked by the leader): wait until
    // every log reads whole, ending in its terminal event, before auditing.
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        for r in &ids {
            // The tree's list is a stream of its own, which may still be electing its
            // leader after the restart: asked again while it says so.
            for s in settled(|| b.log.tree(r)).await {
                loop {
                    let whole = b
                        .log
                        .read(&s, 1)
                        .await
                        .ok()
                        .and_then(|recs| recs.last().map(|x| x.env.body.is_terminal()))
                        .unwrap_or(false);
                    if whole {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "{s} does not read whole a minute after its tree ended ({schedule})"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    });
    tally.assert_at_most_once();
    let audit_started = Instant::now();
    let audited = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(300), audit(&urls, 3, &ids)).await
    });
    if audited.is_err() {
        let mut report = format!("the audit did not finish within 300s ({schedule})\n");
        for i in 0..3 {
            let log = cluster.log(i);
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            report.push_str(&format!("{}, last lines:\n", cluster.name(i)));
            for l in tail.into_iter().rev() {
                report.push_str(&format!("  {l}\n"));
            }
        }
        panic!("{report}");
    }
    eprintln!(
        "node loss: {} trees audited in {:?}",
        ids.len(),
        audit_started.elapsed()
    );
    // What the servers went through, for the record.
    let mut resets = std::collections::BTreeMap::<String, usize>::new();
    let mut catchup_errors = 0;
    for i in 0..3 {
        let log = cluster.log(i);
        for l in log.lines() {
            if let Some((_, stream)) = l.split_once("Resetting stream cluster state for ") {
                *resets.entry(stream.trim().to_string()).or_default() += 1;
            }
        }
        catchup_errors += log.matches("errored, will retry").count();
    }
    eprintln!(
        "node loss: the servers reset streams {resets:?} and failed {catchup_errors} catch-ups"
    );
    // No session of any tree failed on the way (a failed child would show in its log).
    for r in &ids {
        for s in rt.block_on(settled(|| b.log.tree(r))) {
            let recs = rt.block_on(b.log.read(&s, 1)).unwrap();
            assert!(
                !recs
                    .iter()
                    .any(|x| matches!(x.env.body, Event::Failed(_) | Event::Cancelled(_))),
                "{s} failed ({schedule})"
            );
        }
    }
}

#[test]
fn a_node_killed_at_random_never_strands_or_fails_a_tree() {
    let _serial = serial();
    let reps = env_num("SKEIN_NODE_LOSS_REPS", 2);
    let n = env_num("SKEIN_NODE_LOSS_MISSIONS", 60) as usize;
    let first = env_num(
        "SKEIN_NODE_LOSS_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1),
    );
    eprintln!(
        "node loss: {reps} repetitions of {n} missions from seed {first} on {}",
        skein_testnats::nats_server_version()
    );
    for rep in 0..reps {
        let started = Instant::now();
        one_loss(first + rep, n);
        eprintln!(
            "node loss: repetition {} of {reps} completed every tree in {:?}",
            rep + 1,
            started.elapsed()
        );
    }
}

/// Whether any line is a warning or an error that names one of `names`.
fn says(lines: &LogLines, names: &[&str]) -> Option<String> {
    let lines = lines.lock().unwrap_or_else(|p| p.into_inner());
    lines
        .iter()
        .find(|l| {
            (l.contains("WARN") || l.contains("ERROR")) && names.iter().any(|n| l.contains(n))
        })
        .cloned()
}

#[test]
fn a_worker_that_cannot_make_progress_says_so_naming_the_stream() {
    let _serial = serial();
    let mut cluster = Cluster::start();
    let urls = cluster.urls();
    let log = LogLines::default();
    let mut w = Workers(vec![worker_logged(&urls, "stuck", 3, Some(log.clone()))]);
    // Two of three nodes gone: no stream has a quorum, nothing can be claimed.
    cluster.kill9(1);
    cluster.kill9(2);
    let lost = Instant::now();
    let line = loop {
        if let Some(l) = says(&log, &["SKEIN_JOBS", "pool-default", "SKEIN_MISSIONS"]) {
            break l;
        }
        assert!(
            lost.elapsed() < Duration::from_secs(30),
            "no warning or error naming the job stream or its consumer within 30s of losing \
             the quorum; the worker logged: {:?}",
            log.lock().unwrap_or_else(|p| p.into_inner())
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("after {:?}: {line}", lost.elapsed());
    // And it keeps saying so while the outage lasts, naming a stream or consumer.
    let first = log.lock().unwrap_or_else(|p| p.into_inner()).len();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let later: Vec<String> = log.lock().unwrap_or_else(|p| p.into_inner())[first..].to_vec();
        if later.iter().any(|l| {
            (l.contains("ERROR") || l.contains("WARN"))
                && (l.contains("SKEIN_") || l.contains("pool-"))
        }) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker went quiet during the outage: {later:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The streams that lost their replicas are reported too, naming them.
    let deadline = Instant::now() + Duration::from_secs(50);
    loop {
        let later: Vec<String> = log.lock().unwrap_or_else(|p| p.into_inner())[first..].to_vec();
        if later
            .iter()
            .any(|l| l.contains("ERROR") && l.contains("not catching up") && l.contains("SKEIN_"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no error naming a stream that lost its replicas: {later:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // SIGTERM with no server to finish anything on: the worker exits within its drain
    // timeout instead of waiting for the cluster.
    let pid = w.0[0].id();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let asked = Instant::now();
    let status = loop {
        if let Some(s) = w.0[0].try_wait().unwrap() {
            break s;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "the worker ignored SIGTERM for a minute with its servers gone"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "a drained worker exits 0: {status}");
    w.0.clear();
}
