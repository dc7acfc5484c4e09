//! `skein bench`: measures the embedded runtime and prints a table.
//!
//! - steps per second with a zero-latency scripted model (a fan-out tree; a step is one
//!   model turn, its tool calls counted apart),
//! - the time to fold a 10,000-event log (decode + fold, from memory and from the store),
//! - fan-out wall time against its ideal: the orchestrator delegates to N children in one
//!   turn, each child makes 4 tool-calling turns and 1 answer, then the orchestrator
//!   answers; with 50 ms model latency the critical path is 7 model turns = 350 ms. Beside
//!   it, how long the model calls took on average as the workers recorded them (the
//!   script's latency plus any wait for a free worker thread once the answer is due),
//! - the fan-out of 8 at zero latency as a whole `skein run` process (start-up included),
//!   and the fan-out of 1,024 as a whole process printing its progress, with its CPU time.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use skein_core::event::{genesis_hash, ModelCalled, Submitted, ToolCalled, ToolReturned};
use skein_core::{
    AgentSet, Budget, Envelope, Event, Limits, ModelResponse, Record, SessionId, SessionState,
    ToolCall, Usage,
};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_runtime::inspect::{summarize, tree_rows};
use skein_runtime::ports::Durability;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;

use crate::app::{read_agent_files, App};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Fan-out widths to measure (children of one turn).
    #[arg(long, value_delimiter = ',', default_values_t = vec![8usize, 256])]
    pub fanout: Vec<usize>,
    /// Children in the zero-latency throughput run.
    #[arg(long, default_value_t = 64)]
    pub throughput_children: usize,
    /// Events in the fold measurement.
    #[arg(long, default_value_t = 10_000)]
    pub fold_events: u64,
    /// Model latency of the fan-out runs (ms).
    #[arg(long, default_value_t = 50)]
    pub latency_ms: u64,
    /// Runs of each fan-out width; its row shows the run of median wall time.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub fanout_runs: u32,
    /// Only the reused-store series: a warm-up and this many runs of the first fan-out
    /// width, each a whole client process (`skein run`, or `skein submit --wait` against
    /// one `skein worker` process on NATS) on one store, every run printed.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub reuse: Option<u32>,
    /// Instead of the runs above: build a store of this many finished trees (a list
    /// measures each size and the growth between them) and time the commands that read it.
    #[arg(long, value_delimiter = ',')]
    pub history: Vec<usize>,
    /// Instead of the runs above: the model-quota benchmark. A tree of the largest
    /// `--fanout`, then a tree of one part, against a quota-enforcing test server (its
    /// own process, `skein-quota-server` beside this binary), the limit declared and only
    /// learned, on the embedded store and on NATS (`--nats URL`, else a nats-server
    /// started for the run); prints the 429s, the wall time against the quota's floor
    /// and the small tree's latency.
    #[arg(long)]
    pub quota: bool,
    /// With `--quota`: the quota, in requests a minute.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub quota_rpm: u64,
    /// With `--quota`: the window the test server counts requests in (ms).
    #[arg(long, default_value_t = 6_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub quota_window_ms: u64,
    /// With `--quota`: the NATS workers.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub quota_workers: u64,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Measure the NATS backend on a nats-server started for the run (with `--nats URL`,
    /// on that server instead).
    #[arg(long)]
    pub nats_local: bool,
    /// With `--nats-local`: the started server's JetStream `sync_interval` (`always`
    /// fsyncs every write before acknowledging it; nats-server 2.10 and later).
    #[arg(long)]
    pub sync: Option<String>,
}

/// Writes the bench agents and scripts with the given model latency.
pub(crate) fn write_agents(
    dir: &Path,
    latency: u64,
    cache_leaf: bool,
    pool: Option<&str>,
) -> Result<()> {
    let pool_line = pool.map(|p| format!("pool: {p}\n")).unwrap_or_default();
    std::fs::create_dir_all(dir.join("agents"))?;
    std::fs::create_dir_all(dir.join("scripts"))?;
    std::fs::write(
        dir.join("agents/fanout.md"),
        format!(
            "---\nname: fanout\nmodel: scripted:fanout\nagents: [leaf]\ncache: false\n{pool_line}\
             limits: {{max_children_per_turn: 100000, max_tool_calls_per_turn: 100000, max_steps: 4}}\n---\nFan out.\n"
        ),
    )?;
    std::fs::write(
        dir.join("agents/leaf.md"),
        format!(
            "---\nname: leaf\nmodel: scripted:leaf\ntools: [list_dir]\n{pool_line}\
             idempotent_tools: [list_dir]\ncache: {cache_leaf}\n---\nLook around, then answer.\n"
        ),
    )?;
    std::fs::write(
        dir.join("scripts/fanout.yaml"),
        format!(
            "latency_ms: {latency}\nturns:\n  - tool_calls:\n      - tool: call_agent\n        \
             repeat: \"{{{{ inputs.n }}}}\"\n        args: {{agent: leaf, mission: \"part {{{{ i }}}}\"}}\n  \
             - answer: \"{{{{ results | length }}}} parts done\"\n"
        ),
    )?;
    let mut leaf = format!("latency_ms: {latency}\nturns:\n");
    for _ in 0..4 {
        leaf.push_str("  - tool_calls:\n      - tool: list_dir\n        args: {path: \".\"}\n");
    }
    leaf.push_str("  - answer: \"done with {{ mission }}\"\n");
    std::fs::write(dir.join("scripts/leaf.yaml"), leaf)?;
    super::bench_hops::write_relay(dir, &pool_line)?;
    Ok(())
}

struct TreeRun {
    wall_ms: f64,
    /// The CPU this process used while the tree ran (every worker thread), ms.
    cpu_ms: Option<f64>,
    model_ms: f64,
    phases: Phases,
    sessions: usize,
    model_turns: u32,
    tool_calls: u32,
    events: u64,
    /// The event log's `fdatasync` calls while the tree ran.
    log_syncs: u64,
}

/// An embedded runtime on a fresh store with the bench agents at `latency`.
fn embedded(app: &App, latency: u64) -> Result<(tempfile::TempDir, Arc<SledStore>, Arc<Runtime>)> {
    let tmp = tempfile::tempdir()?;
    write_agents(tmp.path(), latency, false, None)?;
    let store = SledStore::open(&tmp.path().join("data"), &tmp.path().join("ws"))?;
    let agents = Arc::new(AgentSet::load(
        &read_agent_files(&tmp.path().join("agents"))?,
        &[],
    )?);
    let mut models = Registry::new();
    models.insert(
        "scripted",
        Arc::new(ScriptedProvider::new(tmp.path().join("scripts"))),
    );
    let cfg = RuntimeConfig {
        limits: Limits {
            max_children_per_turn: 100_000,
            ..Limits::default()
        },
        // As `skein run` on the embedded store batches a wide turn's delegations.
        delegation_batch: app.cfg.runtime.delegation_batch_on(false),
        ..RuntimeConfig::default()
    };
    let rt = Runtime::new(store.backend(), agents, models, app.tools()?, cfg);
    Ok((tmp, store, rt))
}

/// One relay of [`bench_hops::HOPS`] delegations in a row with a zero-latency model:
/// (wall ms, delegate hops, settle hops).
async fn run_relay(app: &App) -> Result<(f64, Vec<f64>, Vec<f64>)> {
    let (_tmp, _store, rt) = embedded(app, 0)?;
    let started = Instant::now();
    let id = rt
        .submit(Submission {
            agent: "relay".into(),
            mission: "relay".into(),
            no_cache: true,
            ..Default::default()
        })
        .await?;
    let root = rt.run_tree(&id, 4).await?;
    let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(
        root.state.ending.answer.as_deref() == Some("relayed"),
        "the relay did not complete: {:?} {:?}",
        root.state.status,
        root.state.ending.error
    );
    let (delegate, settle) = super::bench_hops::hops(&rt.backend, &id).await?;
    Ok((wall_ms, delegate, settle))
}

async fn run_fanout(app: &App, latency: u64, n: usize) -> Result<TreeRun> {
    let (_tmp, store, rt) = embedded(app, latency)?;
    let backend = rt.backend.clone();
    let syncs_before = store.log_syncs();
    let cpu_before = own_cpu_ms();
    let started = Instant::now();
    let id = rt
        .submit(Submission {
            agent: "fanout".into(),
            mission: format!("bench fan-out of {n}"),
            inputs: json!({ "n": n }),
            budget: Some(Budget::default()),
            no_cache: true,
            ..Default::default()
        })
        .await?;
    let root = rt.run_tree(&id, n + 8).await?;
    let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
    let cpu_ms = cpu_before.zip(own_cpu_ms()).map(|(a, b)| b - a);
    let log_syncs = store.log_syncs() - syncs_before;
    if root.state.ending.answer.as_deref() != Some(&format!("{n} parts done")) {
        anyhow::bail!(
            "fan-out of {n} did not complete: {:?} {:?}",
            root.state.status,
            root.state.ending.error
        );
    }
    let rows = tree_rows(&backend, &id).await?;
    let s = summarize(&rows);
    let (model_ms, phases) = tree_times(&*backend.log, &id).await?;
    let mut events = 0;
    for sid in backend.log.tree(&id).await? {
        events += backend
            .log
            .last(&sid)
            .await?
            .map(|r| r.env.seq)
            .unwrap_or(0);
    }
    Ok(TreeRun {
        wall_ms,
        cpu_ms,
        model_ms,
        phases,
        sessions: s.sessions,
        model_turns: s.steps,
        tool_calls: s.tool_calls,
        events,
        log_syncs,
    })
}

/// Where a fan-out tree's wall time went, read from its records' stamps (whole ms, each
/// stamped by the process that wrote it; on NATS the workers share this machine's clock).
/// A model call begins its `latency_ms` before its `ModelCalled` is stamped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phases {
    /// The root's submission → its last delegation recorded: its first turn.
    pub root_turn: u64,
    /// Of that turn, its model call.
    pub root_model: u64,
    /// The last delegation recorded → the last child's first model call begun: the
    /// children made, their jobs pushed and claimed.
    pub spread: u64,
    /// A child's first model call begun → its completion: the median child's and the
    /// longest.
    pub child_median: u64,
    pub child_longest: u64,
    /// The last child's completion → the root's completion: its notices read and folded,
    /// and its last turn.
    pub gather: u64,
    /// Of that, the root's last model call.
    pub gather_model: u64,
}

impl Phases {
    pub(crate) fn json(&self) -> serde_json::Value {
        json!({"root_turn_ms": self.root_turn, "root_model_ms": self.root_model,
               "spread_ms": self.spread, "child_median_ms": self.child_median,
               "child_longest_ms": self.child_longest, "gather_ms": self.gather,
               "gather_model_ms": self.gather_model})
    }

    /// One line, for under a table of fan-out rows.
    pub(crate) fn line(&self, latency_ms: u64) -> String {
        format!(
            "root's first turn {} ms (model {}); delegations recorded → the last child's first \
             model call {} ms; a child, first model call → completed: median {} ms, longest {} \
             (its model calls alone 5 × {latency_ms} = {}); the last child completed → the \
             root completed {} ms (model {})",
            self.root_turn,
            self.root_model,
            self.spread,
            self.child_median,
            self.child_longest,
            5 * latency_ms,
            self.gather,
            self.gather_model
        )
    }
}

/// Prints the lines of [`Phases::line`] under a table of fan-out rows.
pub(crate) fn print_phases(lines: &[String]) -> Result<()> {
    crate::outln!("  where the median tree's time went, from its records' stamps:")?;
    for l in lines {
        crate::outln!("{l}")?;
    }
    Ok(())
}

/// One read of the fan-out tree of `root`: the mean time of its model calls (their
/// `ModelCalled.latency_ms`, ms) and its [`Phases`].
pub(crate) async fn tree_times(
    log: &dyn skein_runtime::ports::EventLog,
    root: &SessionId,
) -> Result<(f64, Phases)> {
    let (mut model_sum, mut model_calls) = (0u64, 0u64);
    let (mut last_delegated, mut root_done, mut submitted) = (0, 0, None);
    let mut root_models = vec![];
    let mut lives = vec![];
    let (mut last_start, mut last_done) = (0, 0);
    for sid in log.tree(root).await? {
        let records = log.read(&sid, 1).await?;
        for r in &records {
            if let Event::ModelCalled(m) = &r.env.body {
                model_sum += m.latency_ms;
                model_calls += 1;
            }
        }
        if sid == *root {
            for r in &records {
                match &r.env.body {
                    Event::Submitted(_) => submitted = submitted.or(Some(r.env.at)),
                    Event::Delegated(_) => last_delegated = last_delegated.max(r.env.at),
                    Event::ModelCalled(m) => root_models.push((r.env.at, m.latency_ms)),
                    Event::Completed(_) => root_done = r.env.at,
                    _ => {}
                }
            }
            continue;
        }
        let start = records.iter().find_map(|r| match &r.env.body {
            Event::ModelCalled(m) => Some(r.env.at.saturating_sub(m.latency_ms)),
            _ => None,
        });
        let done = records.iter().find_map(|r| match &r.env.body {
            Event::Completed(_) => Some(r.env.at),
            _ => None,
        });
        if let (Some(start), Some(done)) = (start, done) {
            last_start = last_start.max(start);
            last_done = last_done.max(done);
            lives.push(done.saturating_sub(start));
        }
    }
    anyhow::ensure!(
        !lives.is_empty() && root_done > 0,
        "tree {root}: no completed children, or the root did not complete"
    );
    lives.sort_unstable();
    let phases = Phases {
        root_turn: last_delegated.saturating_sub(submitted.unwrap_or(last_delegated)),
        root_model: root_models
            .iter()
            .find(|(at, _)| *at <= last_delegated)
            .map_or(0, |m| m.1),
        spread: last_start.saturating_sub(last_delegated),
        child_median: lives[lives.len() / 2],
        child_longest: lives[lives.len() - 1],
        gather: root_done.saturating_sub(last_done),
        gather_model: root_models
            .iter()
            .rev()
            .find(|(at, _)| *at > last_done)
            .map_or(0, |m| m.1),
    };
    Ok((model_sum as f64 / model_calls.max(1) as f64, phases))
}

/// Delegation → settled latency of cache hits: a tree of `n` delegations runs once to
/// fill the cache, then again, where every delegation is a hit. Returns (mean ms per hit
/// over the hit span, hits per second).
async fn cache_hit_bench(app: &App, n: usize) -> Result<(f64, f64)> {
    let tmp = tempfile::tempdir()?;
    write_agents(tmp.path(), 0, true, None)?;
    let store = SledStore::open(&tmp.path().join("data"), &tmp.path().join("ws"))?;
    let backend = store.backend();
    let agents = Arc::new(AgentSet::load(
        &read_agent_files(&tmp.path().join("agents"))?,
        &[],
    )?);
    let mut models = Registry::new();
    models.insert(
        "scripted",
        Arc::new(ScriptedProvider::new(tmp.path().join("scripts"))),
    );
    let cfg = RuntimeConfig {
        limits: Limits {
            max_children_per_turn: 100_000,
            ..Limits::default()
        },
        // As `skein run` on the embedded store batches a wide turn's delegations.
        delegation_batch: app.cfg.runtime.delegation_batch_on(false),
        ..RuntimeConfig::default()
    };
    let rt = Runtime::new(backend.clone(), agents, models, app.tools()?, cfg);
    let mut span_ms = 0.0;
    for round in 0..2 {
        let id = rt
            .submit(Submission {
                agent: "fanout".into(),
                mission: format!("cache bench round {round}"),
                inputs: json!({ "n": n }),
                ..Default::default()
            })
            .await?;
        let root = rt.run_tree(&id, 64).await?;
        anyhow::ensure!(
            root.state.status.is_terminal(),
            "cache bench round {round} did not end: {:?} after {} steps, {:?}",
            root.state.status,
            root.state.steps,
            root.state.ending.error
        );
        if round == 1 {
            anyhow::ensure!(
                root.state.accounting.cache_hits as usize == n,
                "expected {n} hits, got {}",
                root.state.accounting.cache_hits
            );
            let records = backend.log.read(&id, 1).await?;
            let start = records
                .iter()
                .find(|r| matches!(r.env.body, Event::ModelCalled(_)))
                .map(|r| r.env.at);
            let end = records
                .iter()
                .filter(|r| matches!(r.env.body, Event::CacheHit(_)))
                .map(|r| r.env.at)
                .max();
            if let (Some(s), Some(e)) = (start, end) {
                span_ms = (e.saturating_sub(s)) as f64;
            }
        }
    }
    let per_hit = span_ms / n as f64;
    Ok((
        per_hit,
        if span_ms > 0.0 {
            n as f64 / (span_ms / 1000.0)
        } else {
            f64::INFINITY
        },
    ))
}

/// Whole `skein run` processes of the zero-latency fan-out, each on a data directory of its
/// own in one temporary directory that holds the bench agents and a config naming them.
struct WholeRuns {
    dir: tempfile::TempDir,
    config: std::path::PathBuf,
    exe: std::path::PathBuf,
}

impl WholeRuns {
    fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        write_agents(dir.path(), 0, false, None)?;
        let config = dir.path().join("skein.toml");
        std::fs::write(
            &config,
            "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n",
        )?;
        Ok(Self {
            dir,
            config,
            exe: std::env::current_exe()?,
        })
    }

    /// Run `k` of the fan-out of `n`: with `--json` (no progress), or as a person runs it.
    fn command(&self, n: usize, k: usize, json: bool) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.arg("--config")
            .arg(&self.config)
            .arg("--data")
            .arg(self.dir.path().join(format!("data-{k}")))
            .args(["run", "--agent", "fanout", "--no-cache"]);
        if json {
            cmd.arg("--json");
        }
        cmd.arg("--inputs")
            .arg(json!({ "n": n }).to_string())
            .arg(format!("whole-process fan-out {k}"))
            .env_remove("SKEIN_LOG")
            .stdin(std::process::Stdio::null());
        cmd
    }
}

/// How many whole-process runs of the fan-out of 8 the bench makes. A run takes about as
/// long as a context switch or two under load takes on a small machine, so its figure
/// is the median of many: a median of five moved by a millisecond and more between runs
/// of the bench.
const WHOLE_RUNS: usize = 21;

/// Runs the fan-out of `n` at zero latency as a whole `skein run` process [`WHOLE_RUNS`]
/// times, each on a fresh data directory: (wall ms of each process from spawn to exit, the
/// tree's own wall ms as the run reports it), both sorted.
async fn whole_process_fanout(n: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let runs = WholeRuns::new()?;
    let (mut whole, mut inside) = (vec![], vec![]);
    for k in 0..WHOLE_RUNS {
        let mut cmd = runs.command(n, k, true);
        let t = Instant::now();
        let out = cmd.output().await.context("starting skein run")?;
        whole.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(
            out.status.success(),
            "skein run failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("reading skein run --json")?;
        anyhow::ensure!(
            v["answer"] == json!(format!("{n} parts done")),
            "the whole-process fan-out did not complete: {}",
            v["status"]
        );
        inside.push(v["summary"]["wall_ms"].as_f64().unwrap_or(f64::NAN));
    }
    whole.sort_by(f64::total_cmp);
    inside.sort_by(f64::total_cmp);
    Ok((whole, inside))
}

/// Two fields of `/proc/<pid>/stat` (numbered as in proc(5); this process's where `pid`
/// is `None`) summed, as ms of CPU (clock ticks, 10 ms on Linux); `None` where they cannot
/// be read.
fn stat_cpu_ms(pid: Option<u32>, first: usize) -> Option<f64> {
    let path = pid.map_or_else(
        || "/proc/self/stat".to_string(),
        |p| format!("/proc/{p}/stat"),
    );
    let stat = std::fs::read_to_string(path).ok()?;
    // The fields after the command name (which may hold spaces) start at field 3.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let at = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some((at(first)? + at(first + 1)?) as f64 * 10.0)
}

/// The CPU time (user + system, every thread) of this process so far, ms, from the
/// process's CPU clock (nanoseconds, where `/proc`'s ticks are 10 ms: a fan-out of 8 takes
/// about two of them).
pub(crate) fn own_cpu_ms() -> Option<f64> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Some(t.tv_sec as f64 * 1000.0 + t.tv_nsec as f64 / 1_000_000.0)
}

/// The CPU time (user + system) of process `pid` so far, ms (in 10 ms ticks).
pub(crate) fn pid_cpu_ms(pid: u32) -> Option<f64> {
    stat_cpu_ms(Some(pid), 14)
}

/// The CPU time (user + system) of this process's waited-for children so far, ms.
fn children_cpu_ms() -> Option<f64> {
    stat_cpu_ms(None, 16)
}

/// How long this machine's disk takes to make an append durable, in µs: (median, tenth
/// percentile, ninetieth) of [`SYNC_PROBES`] appends of 600 bytes to a file in the
/// temporary directory (where the runs keep their stores), each followed by
/// `fdatasync`. Most of a short tree's wall time on the embedded store is such syncs, and
/// the same disk's sync time moves by a factor of two or more between hours, so the bench
/// prints it beside the figures it explains.
pub(crate) async fn sync_probe() -> Result<(f64, f64, f64)> {
    tokio::task::spawn_blocking(|| -> Result<(f64, f64, f64)> {
        use std::io::Write;
        let dir = tempfile::tempdir()?;
        let mut f = std::fs::File::create(dir.path().join("probe"))?;
        let record = [0x5a_u8; 600];
        let mut took = Vec::with_capacity(SYNC_PROBES);
        for _ in 0..SYNC_PROBES {
            f.write_all(&record)?;
            let t = Instant::now();
            f.sync_data()?;
            took.push(t.elapsed().as_secs_f64() * 1e6);
        }
        took.sort_by(f64::total_cmp);
        let at = |q: usize| took[(SYNC_PROBES - 1) * q / 100];
        Ok((at(50), at(10), at(90)))
    })
    .await
    .context("the disk's sync probe")?
}

/// Appends the disk's sync probe times.
const SYNC_PROBES: usize = 100;

/// The probe's figures as `--json` gives them (`disk_sync_us`).
pub(crate) fn sync_json((median, p10, p90): (f64, f64, f64)) -> serde_json::Value {
    json!({"median": median, "p10": p10, "p90": p90})
}

/// The line that tells the probe's figures.
pub(crate) fn sync_line((median, p10, p90): (f64, f64, f64)) -> String {
    format!(
        "disk of the temporary directory: an fdatasync after a 600-byte append takes {median:.0} µs (median of {SYNC_PROBES}; {p10:.0}–{p90:.0} µs from the tenth percentile to the ninetieth)"
    )
}

/// The machine's cores as the bench counts them (at least one).
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs the fan-out of `n` at zero latency as a whole `skein run` process, `runs` times,
/// each on a fresh data directory, as a person runs it with its output kept: progress lines
/// on stderr (a pipe, not a terminal), the answer on stdout. Returns (wall ms of each process
/// from spawn to exit, the CPU ms each used), both sorted.
async fn whole_process_with_progress(n: usize, runs: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let whole = WholeRuns::new()?;
    let (mut wall, mut cpu) = (vec![], vec![]);
    for k in 0..runs {
        let mut cmd = whole.command(n, k, false);
        let cpu_before = children_cpu_ms();
        let t = Instant::now();
        let out = cmd.output().await.context("starting skein run")?;
        wall.push(t.elapsed().as_secs_f64() * 1000.0);
        if let (Some(a), Some(b)) = (cpu_before, children_cpu_ms()) {
            cpu.push(b - a);
        }
        anyhow::ensure!(
            out.status.success(),
            "skein run failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let answer = String::from_utf8_lossy(&out.stdout);
        anyhow::ensure!(
            answer.trim() == format!("{n} parts done"),
            "the whole-process fan-out did not complete: {answer}"
        );
        anyhow::ensure!(
            !out.stderr.is_empty(),
            "the whole-process fan-out printed no progress"
        );
    }
    wall.sort_by(f64::total_cmp);
    cpu.sort_by(f64::total_cmp);
    Ok((wall, cpu))
}

/// A synthetic log of `n` events: a submission, then turns of one tool call each.
fn synthetic_log(n: u64) -> Result<(SessionId, Vec<Record>)> {
    let id = SessionId::root("benchfold")?;
    let mut prev = genesis_hash(&id);
    let mut out = Vec::with_capacity(n as usize);
    let mut push = |seq: u64, body: Event, out: &mut Vec<Record>| -> Result<()> {
        let env = Envelope::new(id.clone(), seq, 1_700_000_000_000 + seq, prev.clone(), body);
        let bytes = env.encode()?;
        let r = Record { env, bytes };
        prev = r.hash();
        out.push(r);
        Ok(())
    };
    push(
        1,
        Event::Submitted(Submitted {
            def_digest: "d".into(),
            mission: "fold".into(),
            mission_hash: "h".into(),
            no_cache: true,
            ..Submitted::for_test("leaf")
        }),
        &mut out,
    )?;
    let mut seq = 2;
    let mut turn = 0;
    while seq <= n {
        turn += 1;
        let call = format!("c{turn}");
        let bodies = [
            Event::ModelCalled(ModelCalled {
                model: "scripted:leaf".into(),
                request_digest: "r".into(),
                response: ModelResponse {
                    content: Some("looking".into()),
                    tool_calls: vec![ToolCall {
                        id: call.clone(),
                        name: "list_dir".into(),
                        args: json!({"path": "."}),
                    }],
                    finish_reason: None,
                },
                usage: Usage {
                    input_tokens: 100,
                    output_tokens: 10,
                    cost: 0.0,
                    estimated: false,
                    ..Default::default()
                },
                latency_ms: 0,
                worker: "w".into(),
            }),
            Event::ToolCalled(ToolCalled {
                call: call.clone(),
                tool: "list_dir".into(),
                args: json!({"path": "."}),
                worker: "w".into(),
            }),
            Event::ToolReturned(ToolReturned {
                call,
                output: "a.txt\nb.txt".into(),
                error: false,
                ms: 1,
                blob: None,
                refused: None,
            }),
        ];
        for b in bodies {
            if seq > n {
                break;
            }
            push(seq, b, &mut out)?;
            seq += 1;
        }
    }
    Ok((id, out))
}

async fn fold_bench(n: u64) -> Result<(f64, f64, f64)> {
    let (id, records) = synthetic_log(n)?;
    let bytes: Vec<Vec<u8>> = records.iter().map(|r| r.bytes.clone()).collect();
    // From memory: decode every record and fold; the median of five runs.
    let mut runs = vec![];
    for _ in 0..5 {
        let t = Instant::now();
        let mut state = SessionState::default();
        for b in &bytes {
            let r = Record::decode(b.clone())?;
            state.apply(&r.env);
        }
        runs.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(
            state.last_seq == n,
            "folded {} of {n} events",
            state.last_seq
        );
    }
    runs.sort_by(f64::total_cmp);
    let mem_ms = runs[runs.len() / 2];
    // From the store: read the whole log back and fold it (chain checked).
    let tmp = tempfile::tempdir()?;
    let store = SledStore::open(tmp.path(), tmp.path())?;
    let b = store.backend();
    for chunk in records.chunks(500) {
        let first = chunk[0].env.seq - 1;
        b.log.append(&id, first, chunk, Durability::Now).await?;
    }
    let t = Instant::now();
    let read = b.log.read(&id, 1).await?;
    let f = skein_runtime::inspect::fold_records(&id, &read)?;
    let store_ms = t.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(
        f.state.last_seq == n,
        "store fold saw {} events",
        f.state.last_seq
    );
    // Replay verification: fold and re-derive the decision before every event.
    let leaf = "---\nname: leaf\nmodel: scripted:leaf\ntools: [list_dir]\n\
                limits: {max_steps: 1000000}\n---\nLook around.\n";
    let set = AgentSet::load(&[("leaf.md".into(), leaf.into())], &[])?;
    let def = set.get("leaf").context("leaf agent")?;
    let envs: Vec<_> = records.iter().map(|r| r.env.clone()).collect();
    let t = Instant::now();
    skein_core::replay::verify(&envs, def, &Limits::default(), &set)
        .map_err(|d| anyhow::anyhow!("synthetic log does not verify: {d}"))?;
    let verify_ms = t.elapsed().as_secs_f64() * 1000.0;
    Ok((mem_ms, store_ms, verify_ms))
}

pub async fn run(app: &App, a: BenchArgs) -> Result<ExitCode> {
    if let Some(runs) = a.reuse {
        return super::bench_reuse::run(app, &a, runs).await;
    }
    if !a.history.is_empty() && (a.nats_local || app.global.nats.is_some()) {
        super::bench_history_nats::print(app, &a.history, a.sync.as_deref(), a.json).await?;
        return Ok(ExitCode::SUCCESS);
    }
    if !a.history.is_empty() {
        super::bench_history::print(&a.history, a.json).await?;
        return Ok(ExitCode::SUCCESS);
    }
    if a.quota {
        return super::bench_quota::run(app, &a).await;
    }
    if a.nats_local || app.global.nats.is_some() {
        return super::bench_nats::run(app, &a).await;
    }
    let mut results = serde_json::Map::new();
    let machine = format!("{} cores", cores());
    let disk = sync_probe().await?;
    results.insert("disk_sync_us".into(), sync_json(disk));
    if !a.json {
        crate::outln!("skein bench — embedded backend (log file + sled), {machine}")?;
        crate::outln!("{}\n", sync_line(disk))?;
    }

    let tp = run_fanout(app, 0, a.throughput_children)
        .await
        .context("throughput run")?;
    let steps_per_s = tp.model_turns as f64 / (tp.wall_ms / 1000.0);
    let events_per_s = tp.events as f64 / (tp.wall_ms / 1000.0);
    let cpu_per_step = tp
        .cpu_ms
        .filter(|_| tp.model_turns > 0)
        .map(|c| c * 1000.0 / f64::from(tp.model_turns));
    results.insert(
        "throughput".into(),
        json!({"children": a.throughput_children, "sessions": tp.sessions,
               "model_turns": tp.model_turns, "tool_calls": tp.tool_calls, "events": tp.events,
               "wall_ms": tp.wall_ms, "steps_per_s": steps_per_s, "events_per_s": events_per_s,
               "cpu_ms": tp.cpu_ms, "cpu_us_per_step": cpu_per_step,
               "log_syncs": tp.log_syncs}),
    );
    if !a.json {
        crate::outln!(
            "throughput, zero-latency model ({} children, 5 turns each):",
            a.throughput_children
        )?;
        crate::outln!(
            "  {:.0} steps/s (model turns), {:.0} events/s — {} turns, {} tool calls, {} events in {:.0} ms",
            steps_per_s, events_per_s, tp.model_turns, tp.tool_calls, tp.events, tp.wall_ms
        )?;
        if let (Some(cpu), Some(per)) = (tp.cpu_ms, cpu_per_step) {
            crate::outln!(
                "  CPU of the run, all threads: {cpu:.0} ms, {per:.0} µs per model turn"
            )?;
        }
        crate::outln!(
            "  event log: {} fdatasyncs, {:.2} per model turn (an append waits for one unless a later append's covers it; appends made together share it)",
            tp.log_syncs,
            tp.log_syncs as f64 / f64::from(tp.model_turns.max(1))
        )?;
        crate::outln!()?;
    }

    let (relay_ms, delegate, settle) = run_relay(app).await.context("relay run")?;
    let title = format!(
        "hop latency, zero-latency model, {} delegations one after another:",
        super::bench_hops::HOPS
    );
    let hops = super::bench_hops::report(&title, relay_ms, &delegate, &settle, a.json)?;
    results.insert("hops".into(), hops);
    if !a.json {
        crate::outln!()?;
    }

    let (mem_ms, store_ms, verify_ms) = fold_bench(a.fold_events).await?;
    results.insert(
        "fold".into(),
        json!({"events": a.fold_events, "decode_and_fold_ms": mem_ms,
               "read_and_fold_from_store_ms": store_ms,
               "replay_verify_ms": verify_ms,
               "replay_verify_events_per_s": a.fold_events as f64 / (verify_ms / 1000.0),
               "events_per_s": a.fold_events as f64 / (mem_ms / 1000.0)}),
    );
    if !a.json {
        crate::outln!("fold a {}-event log:", a.fold_events)?;
        crate::outln!(
            "  decode + fold {:.1} ms, median of 5 ({:.0} events/s); read from the log + fold {:.1} ms",
            mem_ms,
            a.fold_events as f64 / (mem_ms / 1000.0),
            store_ms
        )?;
        crate::outln!(
            "  replay --verify (fold + re-decide every event) {:.1} ms ({:.0} events/s)\n",
            verify_ms,
            a.fold_events as f64 / (verify_ms / 1000.0)
        )?;
        crate::outln!(
            "fan-out, {} ms model latency, ideal = 7 × {} ms = {} ms; median of {} runs (each on a fresh store); the mean recorded time of that run's model calls (whole ms, rounded down); the CPU this process used while it ran (every thread), and that per model turn:",
            a.latency_ms,
            a.latency_ms,
            7 * a.latency_ms,
            a.fanout_runs
        )?;
        crate::outln!(
            "  {:>6} {:>10} {:>10} {:>8} {:>9} {:>14} {:>8} {:>11}",
            "N",
            "wall ms",
            "ideal ms",
            "ratio",
            "sessions",
            "model call ms",
            "CPU ms",
            "µs per turn"
        )?;
    }
    let ideal = 7.0 * a.latency_ms as f64;
    let mut fan = vec![];
    let mut phase_lines = vec![];
    for &n in &a.fanout {
        let mut runs = vec![];
        for _ in 0..a.fanout_runs {
            runs.push(
                run_fanout(app, a.latency_ms, n)
                    .await
                    .with_context(|| format!("fan-out {n}"))?,
            );
        }
        runs.sort_by(|x, y| x.wall_ms.total_cmp(&y.wall_ms));
        let runs_ms: Vec<f64> = runs.iter().map(|r| r.wall_ms).collect();
        let r = &runs[runs.len() / 2];
        let per_turn = r
            .cpu_ms
            .map(|c| c * 1000.0 / f64::from(r.model_turns.max(1)));
        if !a.json {
            crate::outln!(
                "  {:>6} {:>10.0} {:>10.0} {:>8.3} {:>9} {:>14.1} {:>8} {:>11}",
                n,
                r.wall_ms,
                ideal,
                r.wall_ms / ideal,
                r.sessions,
                r.model_ms,
                r.cpu_ms.map_or("-".to_string(), |c| format!("{c:.0}")),
                per_turn.map_or("-".to_string(), |c| format!("{c:.0}"))
            )?;
        }
        fan.push(json!({"n": n, "wall_ms": r.wall_ms, "ideal_ms": ideal,
                        "ratio": r.wall_ms / ideal, "model_call_ms": r.model_ms,
                        "cpu_ms": r.cpu_ms, "model_turns": r.model_turns,
                        "cpu_us_per_model_turn": per_turn,
                        "phases": r.phases.json(),
                        "runs_ms": runs_ms}));
        phase_lines.push(format!("  N = {n}: {}", r.phases.line(a.latency_ms)));
    }
    results.insert("fanout".into(), json!(fan));
    if !a.json {
        print_phases(&phase_lines)?;
    }
    let sizes = skein_runtime::work_loop::job_future_sizes();
    let job_future = sizes.iter().find(|(n, _)| *n == "handle").map(|(_, s)| *s);
    results.insert("job_future_bytes".into(), json!(job_future));
    if !a.json {
        if let Some(b) = job_future {
            crate::outln!("  each job in flight is a future of {b} bytes, boxed")?;
        }
    }
    let (whole, inside) = whole_process_fanout(8).await.context("whole-process run")?;
    results.insert(
        "whole_process_l0_n8".into(),
        json!({"runs_ms": whole, "median_ms": whole[whole.len() / 2],
               "tree_ms": inside, "median_tree_ms": inside[inside.len() / 2]}),
    );
    if !a.json {
        crate::outln!(
            "\nfan-out of 8 at zero latency as a whole `skein run` process, median of {}: {:.1} ms \
             (quartiles {:.1}–{:.1}; the tree itself {:.0} ms, as the run reports it)",
            whole.len(),
            whole[whole.len() / 2],
            whole[whole.len() / 4],
            whole[whole.len() * 3 / 4],
            inside[inside.len() / 2]
        )?;
    }
    const WIDE: usize = 1024;
    let (wall, cpu) = whole_process_with_progress(WIDE, 3)
        .await
        .context("whole-process run with progress")?;
    let median = |v: &[f64]| v.get(v.len() / 2).copied();
    results.insert(
        "whole_process_l0_n1024_progress".into(),
        json!({"runs_ms": wall, "median_ms": median(&wall),
               "cpu_ms": cpu, "median_cpu_ms": median(&cpu)}),
    );
    if !a.json {
        crate::outln!(
            "fan-out of {WIDE} at zero latency as a whole `skein run` process printing its \
             progress lines (stderr a pipe), median of {}: {:.0} ms, {} of CPU",
            wall.len(),
            median(&wall).unwrap_or(f64::NAN),
            median(&cpu)
                .map(|c| format!("{c:.0} ms"))
                .unwrap_or_else(|| "an unknown amount".into())
        )?;
    }
    let (per_hit_ms, hits_per_s) = cache_hit_bench(app, 1000).await.context("cache-hit run")?;
    results.insert(
        "cache_hit".into(),
        json!({"hits": 1000, "ms_per_hit": per_hit_ms, "hits_per_s": hits_per_s}),
    );
    if !a.json {
        crate::outln!(
            "\ncache hit, delegation → settled (1000 hits in one turn): {:.3} ms per hit, {:.0} hits/s",
            per_hit_ms, hits_per_s
        )?;
    }
    if a.json {
        crate::outln!("{}", serde_json::to_string_pretty(&results)?)?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    /// The probe times real syncs of a real file, and its three figures come in order.
    #[tokio::test]
    async fn the_disk_probe_gives_its_percentiles_in_order() {
        let (median, p10, p90) = super::sync_probe().await.unwrap();
        assert!(p10 > 0.0, "{p10}");
        assert!(p10 <= median && median <= p90, "{p10} {median} {p90}");
        let line = super::sync_line((median, p10, p90));
        assert!(
            line.contains(&format!("{median:.0} µs (median of 100")),
            "{line}"
        );
    }
}
