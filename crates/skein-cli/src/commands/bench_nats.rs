//! `skein bench --nats-local` (or `--nats URL`): the JetStream backend's figures.
//!
//! Workers run in this process, each with its own NATS connection, state cache and
//! runtime — the same code a `skein worker` process runs. Printed: delegation latency
//! (a parent's `Delegated` → the child's first model call starting) p50/p99, steps per
//! second with a zero-latency model on 1 and 3 workers, fan-out wall time against its
//! ideal for N = 8, 256, 1024, and the resident memory of one `skein worker` process (a
//! child process of the bench) idle and with 1,000 sessions in flight.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use skein_core::{AgentSet, Budget, Event, Limits, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_nats::{NatsConfig, NatsStore};
use skein_runtime::ports::RootResult;
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use tokio::sync::watch;

use super::bench::{write_agents, BenchArgs};
use super::bench_hops::pct;
use crate::app::{read_agent_files, App};

struct Fleet {
    runtimes: Vec<Arc<Runtime>>,
    /// Every worker's connection: results are awaited on the first; all are closed when
    /// the fleet stops (a connection left open would warn of the lost server once the
    /// bench stops the one it started).
    clients: Vec<async_nats::Client>,
    stops: Vec<watch::Sender<bool>>,
    handles: Vec<tokio::task::JoinHandle<()>>,
    _tmp: tempfile::TempDir,
}

impl Fleet {
    async fn start(
        app: &App,
        cfg: &NatsConfig,
        workers: usize,
        conc: usize,
        latency: u64,
    ) -> Result<Self> {
        Self::start_with(app, cfg, workers, conc, latency, false).await
    }

    async fn start_with(
        app: &App,
        cfg: &NatsConfig,
        workers: usize,
        conc: usize,
        latency: u64,
        cache: bool,
    ) -> Result<Self> {
        let tmp = tempfile::tempdir()?;
        let pool = format!("bench{}", &skein_runtime::new_root_id().as_str()[18..]);
        write_agents(tmp.path(), latency, cache, Some(&pool))?;
        let agents = Arc::new(AgentSet::load(
            &read_agent_files(&tmp.path().join("agents"))?,
            &[],
        )?);
        let mut fleet = Fleet {
            runtimes: vec![],
            clients: vec![],
            stops: vec![],
            handles: vec![],
            _tmp: tmp,
        };
        for i in 0..workers {
            let store = NatsStore::connect(cfg, Duration::from_secs(30)).await?;
            fleet.clients.push(store.client.clone());
            let mut models = Registry::new();
            models.insert(
                "scripted",
                Arc::new(ScriptedProvider::new(fleet._tmp.path().join("scripts"))),
            );
            let rc = RuntimeConfig {
                worker_id: format!("bench-w{}", i + 1),
                limits: Limits {
                    max_children_per_turn: 100_000,
                    ..Limits::default()
                },
                // As a `skein worker` batches a wide turn's delegations (off unless set).
                delegation_batch: app.cfg.runtime.delegation_batch_on(true),
                ..RuntimeConfig::default()
            };
            let rt = Runtime::new(store.backend(), agents.clone(), models, app.tools()?, rc);
            let (stop, handles) = rt.spawn_workers(vec![pool.clone()], conc);
            fleet.runtimes.push(rt);
            fleet.stops.push(stop);
            fleet.handles.extend(handles);
        }
        Ok(fleet)
    }

    /// Runs one fan-out tree of `n` children; returns (root, wall ms).
    async fn fanout(&self, n: usize) -> Result<(SessionId, f64)> {
        self.fanout_with(n, true, "", || {}).await
    }

    async fn fanout_with(
        &self,
        n: usize,
        no_cache: bool,
        tag: &str,
        on_poll: impl FnMut(),
    ) -> Result<(SessionId, f64)> {
        let started = Instant::now();
        let (id, results) = self
            .submit(Submission {
                agent: "fanout".into(),
                mission: format!("nats fan-out of {n}{tag}"),
                inputs: json!({ "n": n }),
                budget: Some(Budget::default()),
                no_cache,
                ..Default::default()
            })
            .await?;
        completed(
            &self.runtimes[0],
            &id,
            &format!("fan-out {n}"),
            results,
            Duration::from_millis(5),
            on_poll,
        )
        .await?;
        Ok((id, started.elapsed().as_secs_f64() * 1000.0))
    }

    /// As [`Fleet::fanout_with`] (no cache), with the CPU this process (its workers, and
    /// the bench's wait for the result) and the server `spid` used while the tree ran.
    async fn fanout_measured(
        &self,
        n: usize,
        tag: &str,
        spid: Option<u32>,
        on_poll: impl FnMut(),
    ) -> Result<Measured> {
        let server = || spid.and_then(super::bench::pid_cpu_ms);
        let (own0, server0) = (super::bench::own_cpu_ms(), server());
        let traffic0 = self.traffic();
        let (root, wall) = self.fanout_with(n, true, tag, on_poll).await?;
        Ok(Measured {
            root,
            wall,
            own_cpu: own0.zip(super::bench::own_cpu_ms()).map(|(a, b)| b - a),
            server_cpu: server0.zip(server()).map(|(a, b)| b - a),
            traffic: self.traffic().since(&traffic0),
        })
    }

    /// What the workers' connections have sent and received so far, all together.
    fn traffic(&self) -> Traffic {
        use std::sync::atomic::Ordering::Relaxed;
        self.clients.iter().fold(Traffic::default(), |t, c| {
            let s = c.statistics();
            Traffic {
                out_messages: t.out_messages + s.out_messages.load(Relaxed),
                in_messages: t.in_messages + s.in_messages.load(Relaxed),
                out_bytes: t.out_bytes + s.out_bytes.load(Relaxed),
                in_bytes: t.in_bytes + s.in_bytes.load(Relaxed),
            }
        })
    }

    /// Runs one relay of delegations in a row; returns (root, wall ms).
    async fn relay(&self) -> Result<(SessionId, f64)> {
        let started = Instant::now();
        let (id, results) = self
            .submit(Submission {
                agent: "relay".into(),
                mission: "nats relay".into(),
                no_cache: true,
                ..Default::default()
            })
            .await?;
        completed(
            &self.runtimes[0],
            &id,
            "relay",
            results,
            Duration::from_millis(5),
            || {},
        )
        .await?;
        Ok((id, started.elapsed().as_secs_f64() * 1000.0))
    }

    /// Submits through the first worker, listening first for the tree's result.
    async fn submit(&self, sub: Submission) -> Result<(SessionId, async_nats::Subscriber)> {
        let client = self.clients.first().context("a fleet without workers")?;
        submit_listening(&self.runtimes[0], client, sub).await
    }

    async fn stop(self) {
        for s in &self.stops {
            let _ = s.send(true);
        }
        for h in self.handles {
            let _ = h.await;
        }
        for c in &self.clients {
            // The bench goes on without it if the server is already gone.
            let _ = c.drain().await;
        }
    }
}

/// One fan-out tree: its root, its wall time and the CPU spent while it ran, ms.
struct Measured {
    root: SessionId,
    wall: f64,
    /// This process's: the workers', and the bench's wait for the result.
    own_cpu: Option<f64>,
    /// The server's, when the bench started it.
    server_cpu: Option<f64>,
    /// What the workers' connections sent and received meanwhile.
    traffic: Traffic,
}

/// Messages and bytes of NATS connections, as the client counts them: every publish,
/// request and reply, job delivery and ack, with their headers.
#[derive(Clone, Copy, Debug, Default)]
struct Traffic {
    out_messages: u64,
    in_messages: u64,
    out_bytes: u64,
    in_bytes: u64,
}

impl Traffic {
    fn since(&self, before: &Traffic) -> Traffic {
        Traffic {
            out_messages: self.out_messages.saturating_sub(before.out_messages),
            in_messages: self.in_messages.saturating_sub(before.in_messages),
            out_bytes: self.out_bytes.saturating_sub(before.out_bytes),
            in_bytes: self.in_bytes.saturating_sub(before.in_bytes),
        }
    }

    /// Per model turn of a tree of `turns`, for the JSON report.
    fn per_turn_json(&self, turns: u32) -> serde_json::Value {
        let per = |v: u64| v as f64 / f64::from(turns.max(1));
        json!({"out_messages": per(self.out_messages), "in_messages": per(self.in_messages),
               "out_bytes": per(self.out_bytes), "in_bytes": per(self.in_bytes)})
    }

    /// The line under a fan-out row.
    fn line(&self, turns: u32) -> String {
        let per = |v: u64| v as f64 / f64::from(turns.max(1));
        format!(
            "the workers' NATS traffic per model turn: {:.2} messages out ({:.0} bytes), {:.2} in ({:.0} bytes)",
            per(self.out_messages),
            per(self.out_bytes),
            per(self.in_messages),
            per(self.in_bytes)
        )
    }
}

/// Starts a `skein worker` process on `pool` (its submission intake on when `intake`) and
/// waits until it is ready.
pub(crate) async fn spawn_worker(
    config: &std::path::Path,
    dir: &std::path::Path,
    url: &str,
    pool: &str,
    secret: &str,
    concurrency: Option<usize>,
    intake: bool,
) -> Result<Reaped> {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("--config")
        .arg(config)
        .arg("--data")
        .arg(dir.join("data"))
        .args(["--nats", url, "worker", "--no-api"])
        .args(["--pools", pool]);
    if !intake {
        cmd.arg("--no-intake");
    }
    if let Some(c) = concurrency {
        cmd.args(["--concurrency", &c.to_string()]);
    }
    let mut child = cmd
        .env("SKEIN_TOKEN_SECRET", secret)
        .env("SKEIN_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("cannot start a `skein worker` process")?;
    let stderr = child.stderr.take();
    let worker = Reaped(child);
    let ready = tokio::task::spawn_blocking(move || {
        let mut lines = std::io::BufReader::new(stderr?).lines();
        let ready = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains("ready"));
        // Keep draining so the worker never blocks on a full pipe.
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
        Some(ready)
    });
    let ready = tokio::time::timeout(Duration::from_secs(60), ready)
        .await
        .context("the worker process did not get ready in 60 s")??;
    anyhow::ensure!(
        ready == Some(true),
        "the worker process exited before it was ready"
    );
    Ok(worker)
}

/// Resident memory of process `pid` in KiB (0 when it cannot be read).
pub(crate) fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Kills the worker process when the measurement ends, however it ends.
pub(crate) struct Reaped(pub(crate) std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Resident memory, in KiB, of the worker process and of the server (when the bench
/// started it, so its pid is known).
struct MemoryFigures {
    idle: u64,
    idle_1100: u64,
    peak: u64,
    /// The server's before the 1,000 sessions were submitted, and its peak while they ran.
    server: Option<(u64, u64)>,
    /// The peak of worker and server together, sampled at the same moments.
    together: u64,
}

/// Starts a real `skein worker` process (this binary) on a pool of its own and reads its
/// resident memory once it is ready and idle; then another with 1,100 loops, idle, and
/// while it runs a fan-out of 1,000 children with 2 s model calls (all in flight at
/// once), sampling it (and the server, `server_pid`) every 50 ms.
async fn worker_process_memory(
    app: &App,
    cfg: &NatsConfig,
    url: &str,
    server_pid: Option<u32>,
) -> Result<MemoryFigures> {
    let tmp = tempfile::tempdir()?;
    let pool = format!("benchmem{}", &skein_runtime::new_root_id().as_str()[18..]);
    write_agents(tmp.path(), 2000, false, Some(&pool))?;
    let config = tmp.path().join("skein.toml");
    std::fs::write(
        &config,
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n\n[limits]\nmax_children_per_turn = 100000\n",
    )?;
    let secret = format!("bench-{}", skein_runtime::new_root_id());
    // Idle as deployed (the default concurrency), then with a loop for each of 1,100
    // sessions, which the loaded figure needs.
    let idle = {
        let worker = spawn_worker(&config, tmp.path(), url, &pool, &secret, None, false).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        rss_kib(worker.0.id())
    };
    let worker = spawn_worker(&config, tmp.path(), url, &pool, &secret, Some(1100), false).await?;
    let pid = worker.0.id();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_1100 = rss_kib(pid);

    // Submit from this process, which runs no worker: every step runs in the child.
    let store = NatsStore::connect(cfg, Duration::from_secs(30)).await?;
    let agents = Arc::new(AgentSet::load(
        &read_agent_files(&tmp.path().join("agents"))?,
        &[],
    )?);
    let submitter = Runtime::new(
        store.backend(),
        agents,
        Registry::new(),
        app.tools()?,
        RuntimeConfig::default(),
    );
    let (id, results) = submit_listening(
        &submitter,
        &store.client,
        Submission {
            agent: "fanout".into(),
            mission: "memory of a worker with 1000 sessions in flight".into(),
            inputs: json!({ "n": 1000 }),
            budget: Some(Budget::default()),
            no_cache: true,
            ..Default::default()
        },
    )
    .await?;
    let mut peak = idle_1100;
    let server_before = server_pid.map(rss_kib);
    let mut server_peak = server_before.unwrap_or(0);
    let mut together = 0;
    completed(
        &submitter,
        &id,
        "the memory run",
        results,
        Duration::from_millis(50),
        || {
            let w = rss_kib(pid);
            let s = server_pid.map_or(0, rss_kib);
            peak = peak.max(w);
            server_peak = server_peak.max(s);
            together = together.max(w + s);
        },
    )
    .await?;
    drop(worker);
    let _ = store.client.drain().await;
    Ok(MemoryFigures {
        idle,
        idle_1100,
        peak,
        server: server_before.map(|b| (b, server_peak)),
        together,
    })
}

/// Submits `sub` under a new root id, subscribed beforehand to the tree's result on
/// `skein.results.<root>`, as a client waiting for it would be.
async fn submit_listening(
    rt: &Runtime,
    client: &async_nats::Client,
    mut sub: Submission,
) -> Result<(SessionId, async_nats::Subscriber)> {
    let id = skein_runtime::new_root_id();
    let results = client.subscribe(format!("skein.results.{id}")).await?;
    sub.id = Some(id.to_string());
    let submitted = rt.submit(sub).await?;
    anyhow::ensure!(submitted == id, "submitted as {submitted}, not {id}");
    Ok((id, results))
}

/// Waits until `id` ends, calling `on_poll` every `every` meanwhile; an error unless it
/// completed within 10 minutes. The end is heard as a client hears it, on the result
/// subject. The log is read only once a second, in case that announcement (core NATS,
/// at most once) was lost: reading it every few milliseconds, as this once did, put the
/// bench's own requests in the server's queue beside the tree's.
async fn completed(
    rt: &Runtime,
    id: &SessionId,
    what: &str,
    mut results: async_nats::Subscriber,
    every: Duration,
    mut on_poll: impl FnMut(),
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut looked = Instant::now();
    loop {
        on_poll();
        let status = match tokio::time::timeout(every, results.next()).await {
            Ok(Some(m)) => {
                let r: RootResult = serde_json::from_slice(&m.payload)
                    .with_context(|| format!("the result of {what}"))?;
                Some(r.status)
            }
            Ok(None) => anyhow::bail!("the result subscription of {what} ended"),
            Err(_) if looked.elapsed() >= Duration::from_secs(1) => {
                looked = Instant::now();
                rt.backend
                    .log
                    .last(id)
                    .await?
                    .filter(|r| r.env.body.is_terminal())
                    .map(|r| match r.env.body {
                        Event::Completed(_) => skein_core::Status::Completed,
                        Event::Cancelled(_) => skein_core::Status::Cancelled,
                        _ => skein_core::Status::Failed,
                    })
            }
            Err(_) => None,
        };
        if let Some(status) = status {
            anyhow::ensure!(
                status == skein_core::Status::Completed,
                "{what} ended {status}"
            );
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{what} did not finish in 10 minutes"
        );
    }
}

async fn delegation_latencies(rt: &Runtime, root: &SessionId) -> Result<Vec<f64>> {
    let b = &rt.backend;
    let mut delegated: HashMap<SessionId, u64> = HashMap::new();
    for r in b.log.read(root, 1).await? {
        if let Event::Delegated(d) = &r.env.body {
            delegated.insert(d.child.clone(), r.env.at);
        }
    }
    let mut out = vec![];
    for (child, at) in delegated {
        for r in b.log.read(&child, 1).await? {
            if let Event::ModelCalled(m) = &r.env.body {
                let call_started = r.env.at.saturating_sub(m.latency_ms);
                out.push(call_started.saturating_sub(at) as f64);
                break;
            }
        }
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

/// A nats-server started for the run: only in builds with the `nats-local` feature, so the
/// production binary does not carry the test server launcher.
#[cfg(feature = "nats-local")]
pub(crate) fn local_server(
    sync: Option<&str>,
) -> Result<(Option<skein_testnats::NatsServer>, String, String)> {
    let s = skein_testnats::NatsServer::start_with_sync(sync);
    let u = s.url();
    let said = match sync {
        None => "default (JetStream sync_interval 2m; the publish ack means in the server's memory and page cache)".to_string(),
        Some("always") => "sync_interval always (every write is fsynced before its publish ack)".to_string(),
        Some(other) => format!("sync_interval {other}"),
    };
    Ok((Some(s), u, said))
}

#[cfg(feature = "nats-local")]
pub(crate) fn server_pid(s: &Option<skein_testnats::NatsServer>) -> Option<u32> {
    s.as_ref().and_then(|s| s.pid())
}

/// Stands in for the server this build cannot start.
#[cfg(not(feature = "nats-local"))]
pub(crate) struct NoServer;

#[cfg(not(feature = "nats-local"))]
pub(crate) fn server_pid(_: &Option<NoServer>) -> Option<u32> {
    None
}

#[cfg(not(feature = "nats-local"))]
pub(crate) fn local_server(_sync: Option<&str>) -> Result<(Option<NoServer>, String, String)> {
    anyhow::bail!(
        "this skein was built without `bench --nats-local`: pass --nats URL of a running \
         nats-server, or build with `cargo build --release --features nats-local`"
    )
}

pub async fn run(app: &App, a: &BenchArgs) -> Result<ExitCode> {
    let (server, url, sync) = match &app.global.nats {
        Some(u) => (None, u.clone(), "as configured on that server".to_string()),
        None => local_server(a.sync.as_deref())?,
    };
    let mut cfg = app.nats_config()?;
    cfg.urls = url.split(',').map(str::to_string).collect();
    // A server started to sync every write gets the workers' setting for one.
    if server.is_some() && a.sync.as_deref() == Some("always") {
        cfg.group_commit = true;
    }
    let client = async_nats::connect(url.split(',').next().unwrap_or_default())
        .await
        .context("connect")?;
    let version = client.server_info().version.clone();
    let mut results = serde_json::Map::new();
    results.insert(
        "server".into(),
        json!({"version": version, "sync": sync, "group_commit": cfg.group_commit}),
    );
    // The disk of a server started here (its store is in the temporary directory); a
    // server elsewhere has a disk this machine cannot time.
    let disk = if server.is_some() {
        Some(super::bench::sync_probe().await?)
    } else {
        None
    };
    if let Some(d) = disk {
        results.insert("disk_sync_us".into(), super::bench::sync_json(d));
    }
    if !a.json {
        crate::outln!(
            "skein bench — NATS JetStream backend, nats-server {version}, one server on loopback"
        )?;
        crate::outln!(
            "fsync: {sync}; group commit of the log's appends: {}",
            if cfg.group_commit {
                "on (nats.group_commit)"
            } else {
                "off"
            }
        )?;
        if let Some(d) = disk {
            crate::outln!("{}", super::bench::sync_line(d))?;
        }
        crate::outln!()?;
    }

    // Memory of one `skein worker` process: idle, then with 1,000 sessions in flight.
    let m = worker_process_memory(app, &cfg, &url, server_pid(&server))
        .await
        .context("memory run")?;
    let mib = |k: u64| k as f64 / 1024.0;
    results.insert(
        "worker_rss_kib".into(),
        json!({"process": "skein worker", "idle": m.idle, "idle_1100_loops": m.idle_1100,
               "peak_1000_in_flight": m.peak}),
    );
    if !a.json {
        crate::outln!("worker resident memory (a `skein worker` process): idle {:.1} MiB (default concurrency); with 1,100 loops idle {:.1} MiB, with 1,000 sessions in flight (2 s model calls) peak {:.1} MiB", mib(m.idle), mib(m.idle_1100), mib(m.peak))?;
    }
    if let Some((before, peak)) = m.server {
        let per_session = peak.saturating_sub(before) as f64 / 1001.0;
        results.insert(
            "server_rss_kib".into(),
            json!({"before": before, "peak_1000_in_flight": peak,
                   "per_session_in_flight": per_session, "with_worker_peak": m.together}),
        );
        if !a.json {
            crate::outln!("nats-server resident memory: {:.1} MiB before, peak {:.1} MiB with the same 1,000 sessions in flight ({per_session:.0} KiB per session); worker and server together peak {:.1} MiB", mib(before), mib(peak), mib(m.together))?;
        }
    }

    // Throughput with a zero-latency model, 1 and 3 workers.
    let mut tp = vec![];
    for workers in [1usize, 3] {
        let fleet = Fleet::start(app, &cfg, workers, 64, 0).await?;
        let (root, wall) = fleet.fanout(a.throughput_children).await?;
        let rows = skein_runtime::inspect::tree_rows(&fleet.runtimes[0].backend, &root).await?;
        let turns = skein_runtime::inspect::summarize(&rows).steps;
        let lat = if workers == 3 {
            delegation_latencies(&fleet.runtimes[0], &root).await?
        } else {
            vec![]
        };
        fleet.stop().await;
        let sps = turns as f64 / (wall / 1000.0);
        tp.push(
            json!({"workers": workers, "model_turns": turns, "wall_ms": wall, "steps_per_s": sps}),
        );
        if !a.json {
            crate::outln!("throughput, zero-latency model, {workers} worker(s): {sps:.0} steps/s ({turns} model turns in {wall:.0} ms)")?;
        }
        if !lat.is_empty() {
            let (p50, p99) = (pct(&lat, 0.5), pct(&lat, 0.99));
            results.insert(
                "delegation_latency_ms".into(),
                json!({"samples": lat.len(), "p50": p50, "p99": p99}),
            );
            if !a.json {
                crate::outln!("  under that burst, Delegated → child's first model call (queueing included), {} children: p50 {p50:.0} ms, p99 {p99:.0} ms", lat.len())?;
            }
        }
    }
    results.insert("throughput".into(), json!(tp));

    // The hops alone: one delegation at a time, one worker.
    let fleet = Fleet::start(app, &cfg, 1, 64, 0).await?;
    let (relay, wall) = fleet.relay().await?;
    let (delegate, settle) = super::bench_hops::hops(&fleet.runtimes[0].backend, &relay).await?;
    // The fan-out of 8 at zero latency on the same warm worker, submitted and awaited as
    // a client does (the result heard on its subject): the L = 0, N = 8 figure.
    let mut small = vec![];
    for _ in 0..5 {
        small.push(fleet.fanout(8).await?.1);
    }
    fleet.stop().await;
    small.sort_by(f64::total_cmp);
    let title = format!(
        "\nhop latency, zero-latency model, 1 worker, {} delegations one after another:",
        super::bench_hops::HOPS
    );
    let hops = super::bench_hops::report(&title, wall, &delegate, &settle, a.json)?;
    results.insert("hops".into(), hops);
    results.insert(
        "fanout_l0_n8".into(),
        json!({"runs_ms": small, "median_ms": small[small.len() / 2]}),
    );
    if !a.json {
        crate::outln!(
            "fan-out of 8 at zero latency on that worker, from submission to the result heard on its subject, median of {}: {:.1} ms",
            small.len(),
            small[small.len() / 2]
        )?;
    }

    // Fan-out against its ideal, on one worker and on three (in this process), with the
    // peak resident memory of the server and of this process, which hosts the workers.
    let ideal = 7.0 * a.latency_ms as f64;
    if !a.json {
        crate::outln!(
            "\nfan-out, {} ms model latency, ideal = 7 × {} ms = {ideal:.0} ms; median of {} trees (the first of each row on fresh workers, in a first round over the rows, the others one after another on fresh workers again); peak resident memory of nats-server and of the bench process (its workers) during the first; the mean recorded time of the median tree's model calls (whole ms, rounded down); the CPU the bench process (its workers) and the server used while the median tree ran, that per model turn, and both spread over this machine's {} cores (the least wall time that CPU allows):",
            a.latency_ms,
            a.latency_ms,
            a.fanout_runs,
            super::bench::cores()
        )?;
        crate::outln!(
            "  {:>6} {:>8} {:>10} {:>10} {:>8} {:>11} {:>10} {:>14} {:>13} {:>14} {:>12} {:>12}",
            "N",
            "workers",
            "wall ms",
            "ideal ms",
            "ratio",
            "server MiB",
            "bench MiB",
            "model call ms",
            "bench CPU ms",
            "server CPU ms",
            "µs per turn",
            "CPU / cores"
        )?;
    }
    let spid = server_pid(&server);
    let mut fan = vec![];
    let widths: Vec<usize> = if a.fanout == vec![8, 256] {
        vec![8, 256, 1024]
    } else {
        a.fanout.clone()
    };
    let rows: Vec<(usize, usize)> = widths.iter().flat_map(|&n| [(n, 1usize), (n, 3)]).collect();
    // First one tree per row, in order, with the memory watched: the server keeps every
    // tree's records, so a peak taken after more trees would hold theirs too. Then the
    // rest of each row's trees, for the median of the wall times.
    let mut first = vec![];
    let mut phase_lines = vec![];
    for &(n, workers) in &rows {
        let fleet = Fleet::start(app, &cfg, workers, n / workers + 16, a.latency_ms).await?;
        let (mut server_peak, mut own_peak) = (0, 0);
        let tree = fleet
            .fanout_measured(n, " (0)", spid, || {
                server_peak = server_peak.max(spid.map_or(0, rss_kib));
                own_peak = own_peak.max(rss_kib(std::process::id()));
            })
            .await?;
        fleet.stop().await;
        first.push((tree, server_peak, own_peak));
    }
    for (&(n, workers), (tree, server_peak, own_peak)) in rows.iter().zip(first) {
        let fleet = Fleet::start(app, &cfg, workers, n / workers + 16, a.latency_ms).await?;
        let mut trees = vec![tree];
        for k in 1..a.fanout_runs {
            trees.push(
                fleet
                    .fanout_measured(n, &format!(" ({k})"), spid, || {})
                    .await?,
            );
        }
        trees.sort_by(|x, y| x.wall.total_cmp(&y.wall));
        let runs_ms: Vec<f64> = trees.iter().map(|t| t.wall).collect();
        let t = trees.swap_remove(trees.len() / 2);
        let backend = &fleet.runtimes[0].backend;
        let (model_ms, phases) = super::bench::tree_times(&*backend.log, &t.root).await?;
        let turns = skein_runtime::inspect::summarize(
            &skein_runtime::inspect::tree_rows(backend, &t.root).await?,
        )
        .steps;
        fleet.stop().await;
        let server_mib = spid.map(|_| server_peak as f64 / 1024.0);
        let own_mib = own_peak as f64 / 1024.0;
        let cpu = t.own_cpu.map(|c| c + t.server_cpu.unwrap_or(0.0));
        let per_turn = cpu.map(|c| c * 1000.0 / f64::from(turns.max(1)));
        let floor = cpu.map(|c| c / super::bench::cores() as f64);
        let shown = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
        if !a.json {
            crate::outln!(
                "  {:>6} {:>8} {:>10.0} {:>10.0} {:>8.3} {:>11} {:>10.1} {:>14.1} {:>13} {:>14} {:>12} {:>12}",
                n,
                workers,
                t.wall,
                ideal,
                t.wall / ideal,
                server_mib.map_or("-".to_string(), |m| format!("{m:.1}")),
                own_mib,
                model_ms,
                shown(t.own_cpu),
                shown(t.server_cpu),
                shown(per_turn),
                shown(floor)
            )?;
        }
        fan.push(
            json!({"n": n, "workers": workers, "wall_ms": t.wall, "ideal_ms": ideal,
                        "ratio": t.wall / ideal, "server_peak_mib": server_mib,
                        "bench_process_peak_mib": own_mib, "model_call_ms": model_ms,
                        "bench_process_cpu_ms": t.own_cpu, "server_cpu_ms": t.server_cpu,
                        "model_turns": turns, "cpu_us_per_model_turn": per_turn,
                        "cpu_over_cores_ms": floor,
                        "phases": phases.json(),
                        "nats_traffic_per_model_turn": t.traffic.per_turn_json(turns),
                        "runs_ms": runs_ms}),
        );
        phase_lines.push(format!(
            "  N = {n}, {workers} worker(s): {}",
            phases.line(a.latency_ms)
        ));
        phase_lines.push(format!("    {}", t.traffic.line(turns)));
    }
    results.insert("fanout".into(), json!(fan));
    if !a.json {
        super::bench::print_phases(&phase_lines)?;
    }

    // Cache hits: the same 200 delegations twice; the second time every one is a hit.
    let fleet = Fleet::start_with(app, &cfg, 1, 64, 0, true).await?;
    fleet.fanout_with(200, false, " (warm-up)", || {}).await?;
    let (root, _) = fleet.fanout_with(200, false, " (hits)", || {}).await?;
    let records = fleet.runtimes[0].backend.log.read(&root, 1).await?;
    fleet.stop().await;
    let start = records
        .iter()
        .find(|r| matches!(r.env.body, Event::ModelCalled(_)))
        .map(|r| r.env.at);
    let hits: Vec<u64> = records
        .iter()
        .filter(|r| matches!(r.env.body, Event::CacheHit(_)))
        .map(|r| r.env.at)
        .collect();
    anyhow::ensure!(
        hits.len() == 200,
        "expected 200 cache hits, saw {}",
        hits.len()
    );
    let span = start
        .map(|s| hits.iter().max().copied().unwrap_or(s).saturating_sub(s))
        .unwrap_or(0) as f64;
    results.insert(
        "cache_hit".into(),
        json!({"hits": 200, "span_ms": span, "ms_per_hit": span / 200.0}),
    );
    if !a.json {
        crate::outln!(
            "\ncache hit, delegation → settled (200 hits in one turn): {:.2} ms per hit ({span:.0} ms for all, including the lookups in the KV bucket)",
            span / 200.0
        )?;
    }
    if a.json {
        crate::outln!("{}", serde_json::to_string_pretty(&results)?)?;
    }
    // Stops the server started for the run, if any.
    #[cfg(feature = "nats-local")]
    drop(server);
    #[cfg(not(feature = "nats-local"))]
    let _ = server;
    Ok(ExitCode::SUCCESS)
}
