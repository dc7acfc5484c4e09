//! `skein bench --history N`: what the commands that read a store cost once it holds N
//! finished trees.
//!
//! One real tree is run first (a whole `skein run` of a one-turn scripted agent at zero
//! latency); its records are then written again under N − 1 new root ids through the
//! event log port, each chain of hashes made anew, each tree started a second before the
//! next and with a mission of its own. So the store holds the records a run writes, as
//! many as N runs would, without taking N runs' time. Then each command is run as a whole
//! process, as a person runs it, five times, and its median wall time is kept with the
//! most memory that run held (as last seen before it exits): `skein sessions` (the newest
//! 20, a filtered page and the next page), `skein tree` and `skein events` of one tree,
//! and a one-turn `skein run`. Beside them: opening the store in this process, and the
//! bytes the store and its index of roots keep per tree.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use skein_core::event::genesis_hash;
use skein_core::{Envelope, Event, Record, SessionId};
use skein_runtime::ports::Durability;
use skein_sled::SledStore;

/// Writes `one`, the one-turn agent (and its script) the trees are runs of, into `dir`'s
/// `agents/` and `scripts/`.
pub(crate) fn write_one(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir.join("agents"))?;
    std::fs::create_dir_all(dir.join("scripts"))?;
    std::fs::write(
        dir.join("agents/one.md"),
        "---\nname: one\nmodel: scripted:one\ncache: false\n---\nAnswer at once.\n",
    )?;
    std::fs::write(
        dir.join("scripts/one.yaml"),
        "latency_ms: 0\nturns:\n  - answer: \"done: {{ mission }}\"\n",
    )?;
    Ok(())
}

/// The one-turn agent the trees are runs of, and a config naming it.
fn write_agent(dir: &Path) -> Result<PathBuf> {
    write_one(dir)?;
    let config = dir.join("skein.toml");
    std::fs::write(
        &config,
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n",
    )?;
    Ok(config)
}

/// A finished whole process: its wall ms, the most memory it held (KiB), its output.
pub(crate) struct Whole {
    pub(crate) ms: f64,
    max_rss_kib: Option<u64>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// Runs `exe` with `args` on the bench's config and data directory, to its end.
fn whole(exe: &Path, config: &Path, data: &Path, args: &[&str]) -> Result<Whole> {
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--config")
        .arg(config)
        .arg("--data")
        .arg(data)
        .args(args)
        .env_remove("SKEIN_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let mut child = cmd.spawn().context("starting skein")?;
    let peak = watch_peak(child.id());
    // Read both pipes to their ends (a thread for stderr, so neither fills and blocks).
    let mut err_pipe = child.stderr.take().context("stderr")?;
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err_pipe, &mut s);
        s
    });
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        std::io::Read::read_to_string(&mut out, &mut stdout)?;
    }
    let stderr = err.join().unwrap_or_default();
    let status = child.wait()?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let max_rss_kib = peak.join().unwrap_or(None);
    anyhow::ensure!(
        status.success(),
        "skein {} failed: {}",
        args.join(" "),
        stderr.trim()
    );
    Ok(Whole {
        ms,
        max_rss_kib,
        stdout,
        stderr,
    })
}

/// The child's peak resident memory (KiB) as `/proc` shows it, read every millisecond
/// until it exits: the last reading before it exits (its memory after that is not
/// counted). None where `/proc` is not there.
fn watch_peak(pid: u32) -> std::thread::JoinHandle<Option<u64>> {
    std::thread::spawn(move || {
        let path = format!("/proc/{pid}/status");
        let mut peak = None;
        while let Ok(s) = std::fs::read_to_string(&path) {
            let hwm = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
            match hwm {
                Some(h) => peak = Some(h),
                // A process that has exited and not been waited for shows no memory.
                None => break,
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        peak
    })
}

/// How many times each command is run; its figure is the median.
const REPEATS: usize = 5;

/// [`whole`] [`REPEATS`] times: the run of median wall time (with its memory and output).
pub(crate) fn median_of(exe: &Path, config: &Path, data: &Path, args: &[&str]) -> Result<Whole> {
    let mut runs = (0..REPEATS)
        .map(|_| whole(exe, config, data, args))
        .collect::<Result<Vec<_>>>()?;
    runs.sort_by(|a, b| a.ms.total_cmp(&b.ms));
    Ok(runs.swap_remove(REPEATS / 2))
}

/// Writes the records of `template` again as the tree `id`, started at `at`, with `mission`.
pub(crate) fn replicate(
    template: &[Record],
    id: &SessionId,
    at: u64,
    mission: &str,
) -> Result<Vec<Record>> {
    let t0 = template.first().map_or(0, |r| r.env.at);
    let mut prev = genesis_hash(id);
    let mut out = Vec::with_capacity(template.len());
    for r in template {
        let mut body = r.env.body.clone();
        if let Event::Submitted(s) = &mut body {
            s.mission = mission.to_string();
        }
        let env = Envelope {
            session: id.clone(),
            at: at + r.env.at.saturating_sub(t0),
            prev: prev.clone(),
            body,
            ..r.env.clone()
        };
        let bytes = env.encode()?;
        let rec = Record { env, bytes };
        prev = rec.hash();
        out.push(rec);
    }
    Ok(out)
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => n += dir_bytes(&e.path()),
                Ok(m) => n += m.len(),
                Err(_) => {}
            }
        }
    }
    n
}

/// The figures of one store of `n` trees, as JSON.
pub(crate) async fn run(n: usize) -> Result<serde_json::Value> {
    anyhow::ensure!(n >= 1, "--history needs at least one tree");
    let tmp = tempfile::tempdir()?;
    let config = write_agent(tmp.path())?;
    let data = tmp.path().join("data");
    let exe = std::env::current_exe()?;

    // One real tree.
    whole(
        &exe,
        &config,
        &data,
        &[
            "run",
            "--agent",
            "one",
            "--id",
            "template",
            "--no-cache",
            "template",
        ],
    )
    .context("the template tree")?;

    // N − 1 more, its records written again, older than it and a second apart.
    let t = Instant::now();
    let store = SledStore::open(&data, &tmp.path().join("ws"))?;
    let b = store.backend();
    let template_id = SessionId::root("template")?;
    let template = b.log.read(&template_id, 1).await?;
    anyhow::ensure!(
        !template.is_empty() && b.log.tree(&template_id).await?.len() == 1,
        "the template tree is not one session"
    );
    let newest = template[0].env.at;
    for k in 0..n - 1 {
        let id = SessionId::root(&format!("h{k:07}"))?;
        let at = newest - ((n - 1 - k) as u64) * 1000;
        let records = replicate(&template, &id, at, &format!("history tree {k}"))?;
        b.log.append(&id, 0, &records, Durability::Ahead).await?;
    }
    store.flush().await?;
    let write_ms = t.elapsed().as_secs_f64() * 1000.0;
    let t = Instant::now();
    store.refresh_roots()?;
    let index_ms = t.elapsed().as_secs_f64() * 1000.0;
    let (index_bytes, indexed) = store.roots_index_bytes()?;
    anyhow::ensure!(indexed == n as u64, "{indexed} roots indexed of {n}");
    let events_per_tree = template.len();
    drop(b);
    drop(store);

    // The commands, each a whole process.
    let sessions = median_of(&exe, &config, &data, &["sessions", "--json"])?;
    let rows: serde_json::Value = serde_json::from_str(&sessions.stdout)?;
    anyhow::ensure!(
        rows.as_array().map(Vec::len) == Some(20.min(n)),
        "skein sessions listed {}",
        rows.as_array().map_or(0, Vec::len)
    );
    let cursor = sessions
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("more: --cursor "))
        .map(str::to_string);
    let next = match &cursor {
        Some(c) => Some(median_of(
            &exe,
            &config,
            &data,
            &["sessions", "--json", "--cursor", c],
        )?),
        None => None,
    };
    // A rare match, so the filter reads far into the index: the oldest tree's mission.
    let filtered = median_of(
        &exe,
        &config,
        &data,
        &[
            "sessions",
            "--json",
            "--status",
            "completed",
            "--agent",
            "one",
            "--text",
            "HISTORY TREE 0",
        ],
    )?;
    let middle = if n > 1 {
        format!("h{:07}", (n - 1) / 2)
    } else {
        "template".into()
    };
    let tree = median_of(&exe, &config, &data, &["tree", "--json", &middle])?;
    let events = median_of(&exe, &config, &data, &["events", "--json", &middle])?;
    let one_run = median_of(
        &exe,
        &config,
        &data,
        &["run", "--agent", "one", "--no-cache", "--json", "one more"],
    )?;

    // Opening the store in this process, after the others let it go.
    let t = Instant::now();
    let store = SledStore::open(&data, &tmp.path().join("ws"))?;
    let open_ms = t.elapsed().as_secs_f64() * 1000.0;
    drop(store);

    let store_bytes = dir_bytes(&data);
    let kib = |w: &Whole| w.max_rss_kib;
    Ok(json!({
        "trees": n,
        "events_per_tree": events_per_tree,
        "build": {"write_ms": write_ms, "index_ms": index_ms},
        "open_ms": open_ms,
        "sessions_ms": sessions.ms,
        "sessions_max_rss_kib": kib(&sessions),
        "filtered_ms": filtered.ms,
        "next_page_ms": next.as_ref().map(|w| w.ms),
        "tree_ms": tree.ms,
        "events_ms": events.ms,
        "run_ms": one_run.ms,
        "run_max_rss_kib": kib(&one_run),
        "store_bytes_per_tree": store_bytes as f64 / n as f64,
        "index_bytes_per_tree": index_bytes as f64 / n as f64,
    }))
}

/// Prints the figures of [`run`] for each size, then each figure's growth from the first
/// size to the last.
pub(crate) async fn print(sizes: &[usize], as_json: bool) -> Result<()> {
    let mut all = vec![];
    for &n in sizes {
        let v = run(n)
            .await
            .with_context(|| format!("history of {n} trees"))?;
        if !as_json {
            print_one(&v)?;
        }
        all.push(v);
    }
    report(&all, "history", &FIGURES, as_json)
}

/// Prints the figures of every size taken, as JSON under `key`, or (the sizes were printed
/// as they were taken) each of `figures`' growth from the first size to the last.
pub(crate) fn report(
    all: &[serde_json::Value],
    key: &str,
    figures: &[(&str, &str)],
    as_json: bool,
) -> Result<()> {
    if as_json {
        crate::outln!("{}", serde_json::to_string_pretty(&json!({ key: all }))?)?;
        return Ok(());
    }
    if let (Some(first), Some(last)) = (all.first(), all.last()) {
        if all.len() > 1 {
            crate::outln!(
                "growth from {} to {} trees (last ÷ first):",
                first["trees"],
                last["trees"]
            )?;
            for k in figures {
                if let (Some(a), Some(b)) = (first[k.0].as_f64(), last[k.0].as_f64()) {
                    if a > 0.0 {
                        crate::outln!("  {:<28} {:.2}×", k.1, b / a)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// The figures compared across sizes: key and label.
const FIGURES: [(&str, &str); 11] = [
    ("open_ms", "open the store (in process)"),
    ("sessions_ms", "skein sessions (newest 20)"),
    ("filtered_ms", "skein sessions, filtered"),
    ("next_page_ms", "skein sessions, next page"),
    ("tree_ms", "skein tree"),
    ("events_ms", "skein events"),
    ("run_ms", "one-turn skein run"),
    ("sessions_max_rss_kib", "peak RSS, skein sessions"),
    ("run_max_rss_kib", "peak RSS, skein run"),
    ("store_bytes_per_tree", "store bytes per tree"),
    ("index_bytes_per_tree", "roots index bytes per tree"),
];

fn print_one(v: &serde_json::Value) -> Result<()> {
    crate::outln!(
        "history: {} finished one-session trees of {} events (written in {:.0} ms, indexed in {:.0} ms)",
        v["trees"],
        v["events_per_tree"],
        v["build"]["write_ms"].as_f64().unwrap_or(f64::NAN),
        v["build"]["index_ms"].as_f64().unwrap_or(f64::NAN)
    )?;
    for (k, label) in FIGURES {
        let unit = if k.ends_with("_ms") {
            "ms"
        } else if k.ends_with("_kib") {
            "KiB"
        } else {
            "B"
        };
        match v[k].as_f64() {
            Some(x) => crate::outln!("  {label:<28} {x:>10.1} {unit}")?,
            None => crate::outln!("  {label:<28} {:>10}", "n/a")?,
        }
    }
    crate::outln!()?;
    Ok(())
}
