//! `skein bench --reuse RUNS`: the fan-out run repeated on one store, measured from
//! outside as a user meets it. Each run is a whole client process of this binary: `skein
//! run` on the embedded store, or `skein submit --wait` against one `skein worker` process
//! (with intake) on NATS. Printed for every run: the client process's wall time and the
//! tree's own wall time (root created → root ended, from its log), so a slowdown of a store
//! that only grows shows, and whether it lies in the tree or around it.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;

use super::bench::{write_agents, BenchArgs};
use crate::app::App;

/// One run as measured.
struct Run {
    process_ms: f64,
    tree_ms: u64,
}

pub async fn run(app: &App, a: &BenchArgs, runs: u32) -> Result<ExitCode> {
    let n = a.fanout.first().copied().unwrap_or(256);
    let tmp = tempfile::tempdir()?;
    let nats = a.nats_local || app.global.nats.is_some();
    // A pool of its own on NATS: another cluster's workers never take these jobs.
    let pool = nats.then(|| format!("reuse{}", &skein_runtime::new_root_id().as_str()[18..]));
    write_agents(tmp.path(), a.latency_ms, false, pool.as_deref())?;
    let config = tmp.path().join("skein.toml");
    // A server started here to sync every write gets the workers' setting for one, as in
    // the fan-out runs.
    let fsynced_here =
        a.nats_local && app.global.nats.is_none() && a.sync.as_deref() == Some("always");
    std::fs::write(
        &config,
        format!(
            "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n\n[runtime]\nconcurrency = {}\n\n\
             [limits]\nmax_children_per_turn = 100000\n{}",
            n + 16,
            if fsynced_here {
                "\n[nats]\ngroup_commit = true\n"
            } else {
                ""
            }
        ),
    )?;
    let secret = format!("bench-{}", skein_runtime::new_root_id());
    let ideal = 7 * a.latency_ms;

    // Kept alive for the whole series: the server (if started here) and the worker.
    let mut _server = None;
    let mut _worker = None;
    let mut version = "embedded (log file + sled)".to_string();
    let url = if nats {
        let (server, url, sync) = match &app.global.nats {
            Some(u) => (None, u.clone(), "as configured on that server".to_string()),
            None => super::bench_nats::local_server(a.sync.as_deref())?,
        };
        _server = server;
        let client = async_nats::connect(url.split(',').next().unwrap_or_default())
            .await
            .context("connect")?;
        version = format!(
            "nats-server {} (fsync: {sync}; group commit {})",
            client.server_info().version,
            if fsynced_here { "on" } else { "off" }
        );
        let pool = pool.as_deref().unwrap_or_default();
        _worker = Some(
            super::bench_nats::spawn_worker(
                &config,
                tmp.path(),
                &url,
                pool,
                &secret,
                Some(n + 16),
                true,
            )
            .await?,
        );
        Some(url)
    } else {
        None
    };
    if !a.json {
        crate::outln!(
            "skein bench --reuse — {version}; fan-out of {n}, {} ms model latency (ideal {ideal} ms); \
             one store, a warm-up then {runs} runs, each a whole client process",
            a.latency_ms
        )?;
        crate::outln!(
            "  {:>5} {:>12} {:>9} {:>7}",
            "run",
            "process ms",
            "tree ms",
            "ratio"
        )?;
    }
    let mut measured = vec![];
    for k in 0..=runs {
        let id = format!("reuse-{k}-{}", &skein_runtime::new_root_id().as_str()[18..]);
        let r = one_run(tmp.path(), &config, url.as_deref(), &secret, &id, n)?;
        if !a.json {
            let label = if k == 0 {
                "warm".to_string()
            } else {
                k.to_string()
            };
            crate::outln!(
                "  {label:>5} {:>12.0} {:>9} {:>7.3}",
                r.process_ms,
                r.tree_ms,
                r.tree_ms as f64 / ideal.max(1) as f64
            )?;
        }
        measured.push(r);
    }
    let mut trees: Vec<u64> = measured[1..].iter().map(|r| r.tree_ms).collect();
    trees.sort_unstable();
    let mut procs: Vec<f64> = measured[1..].iter().map(|r| r.process_ms).collect();
    procs.sort_by(f64::total_cmp);
    let median_tree = trees[trees.len() / 2];
    let median_proc = procs[procs.len() / 2];
    let last = measured.last().map_or(0, |r| r.tree_ms);
    if a.json {
        crate::outln!(
            "{}",
            json!({"backend": version, "n": n, "latency_ms": a.latency_ms, "ideal_ms": ideal,
                   "warm_up": {"process_ms": measured[0].process_ms, "tree_ms": measured[0].tree_ms},
                   "runs": measured[1..].iter().map(|r| json!({"process_ms": r.process_ms, "tree_ms": r.tree_ms})).collect::<Vec<_>>(),
                   "median_tree_ms": median_tree, "median_process_ms": median_proc})
        )?;
    } else {
        crate::outln!(
            "  median: process {median_proc:.0} ms, tree {median_tree} ms; last run's tree against the median: {:.2}×",
            last as f64 / median_tree.max(1) as f64
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One client process running the fan-out to its end, then its tree's wall time read back.
fn one_run(
    dir: &Path,
    config: &Path,
    url: Option<&str>,
    secret: &str,
    id: &str,
    n: usize,
) -> Result<Run> {
    let exe = std::env::current_exe()?;
    let base = |cmd: &mut Command| {
        cmd.arg("--config")
            .arg(config)
            .arg("--data")
            .arg(dir.join("data"))
            .env("SKEIN_TOKEN_SECRET", secret)
            .env("SKEIN_LOG", "error")
            .stdin(Stdio::null());
        if let Some(u) = url {
            cmd.args(["--nats", u]);
        }
    };
    let inputs = json!({ "n": n }).to_string();
    let mut cmd = Command::new(&exe);
    base(&mut cmd);
    match url {
        Some(_) => cmd.args(["submit", "--wait"]),
        None => cmd.args(["run", "--json"]),
    };
    cmd.args(["--agent", "fanout", "--id", id, "--inputs", &inputs])
        .arg(format!("fan out to {n}"));
    let started = Instant::now();
    let out = cmd.output().context("cannot start a client process")?;
    let process_ms = started.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(
        out.status.success(),
        "run {id} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let mut tree = Command::new(&exe);
    base(&mut tree);
    let shown = tree
        .args(["tree", id, "--json"])
        .output()
        .context("cannot read the tree back")?;
    anyhow::ensure!(
        shown.status.success(),
        "skein tree {id}: {}",
        String::from_utf8_lossy(&shown.stderr).trim()
    );
    let v: serde_json::Value = serde_json::from_slice(&shown.stdout)
        .with_context(|| format!("skein tree {id} --json printed no JSON"))?;
    let tree_ms = v["summary"]["wall_ms"]
        .as_u64()
        .with_context(|| format!("skein tree {id} --json has no summary.wall_ms"))?;
    Ok(Run {
        process_ms,
        tree_ms,
    })
}
