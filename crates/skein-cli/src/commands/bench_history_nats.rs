//! `skein bench --history N --nats-local` (or `--nats URL`): what reading and writing a
//! NATS store costs once it holds N finished trees.
//!
//! A `skein worker` process runs one real tree (a one-turn scripted agent at zero
//! latency); its records are written again under N − 1 new root ids through the event
//! log port (so the index of roots is written as a submission writes it), one tree after
//! the other in start order, each a second before the next. Then each command runs as a
//! whole process against the server, five times, and its median wall time is kept:
//! `skein sessions` (the newest 20, the next page, a filtered page, and a filter of each
//! kind that matches few trees or none: mission text, agent, status, time range), `skein tree` and
//! `skein events` of one tree, `skein submit --wait` of a one-turn tree (its submission,
//! its step and its completion) and of a tree with one delegation hop. Beside them, in
//! this process: the open roots (what a worker's sweep and start read), and how long a
//! new worker process takes to be ready.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use serde_json::json;
use skein_core::SessionId;
use skein_runtime::ports::Durability;

use super::bench_history::{median_of, replicate, Whole};
use crate::app::App;

const SECRET: &str = "bench-history-secret";

/// The agents: `one` answers at once; `two` hands one part to `one`, then answers.
fn write_agents(dir: &Path) -> Result<std::path::PathBuf> {
    super::bench_history::write_one(dir)?;
    std::fs::write(
        dir.join("agents/two.md"),
        "---\nname: two\nmodel: scripted:two\nagents: [one]\ncache: false\n---\nHand one part on.\n",
    )?;
    std::fs::write(
        dir.join("scripts/two.yaml"),
        "latency_ms: 0\nturns:\n  - tool_calls:\n      - tool: call_agent\n        \
         args: {agent: one, mission: \"the part\"}\n  - answer: \"{{ results | length }} part done\"\n",
    )?;
    let config = dir.join("skein.toml");
    std::fs::write(
        &config,
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n",
    )?;
    Ok(config)
}

/// The figures of one store of `n` trees on the server at `url`, as JSON. The server
/// should be fresh: the trees of earlier runs count as history too.
async fn run(app: &App, url: &str, n: usize) -> Result<serde_json::Value> {
    anyhow::ensure!(n >= 1, "--history needs at least one tree");
    let tmp = tempfile::tempdir()?;
    let config = write_agents(tmp.path())?;
    let data = tmp.path().join("data");
    let exe = std::env::current_exe()?;
    let nats = |rest: &[&str]| -> Vec<String> {
        let mut v = vec!["--nats".to_string(), url.to_string()];
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };
    let whole_of = |args: Vec<String>| -> Result<Whole> {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        median_of(&exe, &config, &data, &args)
    };
    let worker =
        super::bench_nats::spawn_worker(&config, tmp.path(), url, "default", SECRET, None, true)
            .await
            .context("the worker")?;

    // One real tree.
    let tag = skein_runtime::new_root_id().as_str()[14..].to_lowercase();
    let template_id = SessionId::root(&format!("template-{tag}"))?;
    whole_of(nats(&[
        "submit",
        "--agent",
        "one",
        "--id",
        template_id.as_str(),
        "--no-cache",
        "--wait",
        "template",
    ]))
    .context("the template tree")?;

    // N − 1 more, its records written again, older than it and a second apart.
    let mut cfg = app.nats_config()?;
    cfg.urls = url.split(',').map(str::to_string).collect();
    let store = skein_nats::NatsStore::connect(&cfg, Duration::from_secs(30)).await?;
    let b = store.backend();
    let template = b.log.read(&template_id, 1).await?;
    anyhow::ensure!(
        !template.is_empty() && b.log.tree(&template_id).await?.len() == 1,
        "the template tree is not one session"
    );
    let newest = template[0].env.at;
    let t = Instant::now();
    // In start order, a few at a time: the index's stream order is start order within
    // the few a page reads again past a cursor.
    let ids: Vec<(SessionId, u64, String)> = (0..n - 1)
        .map(|k| {
            let id = SessionId::root(&format!("h{tag}{k:07}"))?;
            let at = newest - ((n - 1 - k) as u64) * 1000;
            Ok((id, at, format!("history tree {k}")))
        })
        .collect::<Result<_>>()?;
    let mut writes = futures::stream::iter(ids.iter().map(|(id, at, mission)| {
        let b = &b;
        let template = &template;
        async move {
            let records = replicate(template, id, *at, mission)?;
            b.log.append(id, 0, &records, Durability::Now).await?;
            anyhow::Ok(())
        }
    }))
    .buffered(8);
    while let Some(r) = writes.next().await {
        r?;
    }
    drop(writes);
    let write_ms = t.elapsed().as_secs_f64() * 1000.0;
    let events_per_tree = template.len();

    // The commands, each a whole process.
    let sessions = whole_of(nats(&["sessions", "--json"]))?;
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
        Some(c) => Some(whole_of(nats(&["sessions", "--json", "--cursor", c]))?),
        None => None,
    };
    // A filter that matches the newest trees (a rare match reads far back, as on the
    // embedded store).
    let filtered = whole_of(nats(&[
        "sessions",
        "--json",
        "--status",
        "completed",
        "--agent",
        "one",
        "--text",
        "HISTORY TREE",
    ]))?;
    // Filters that match few trees or none, each of its kind: they read as far back as
    // any filter does. Tree k = n / 10 is far back, in the oldest tenth.
    let k = n / 10;
    let at_k = newest - ((n - 1 - k) as u64) * 1000;
    let rows_of = |w: &Whole| -> Result<usize> {
        let v: serde_json::Value = serde_json::from_str(&w.stdout)?;
        Ok(v.as_array().map_or(0, Vec::len))
    };
    let mut rare = vec![];
    for (key, args, want) in [
        (
            "rare_text_ms",
            vec!["--text".to_string(), format!("HISTORY TREE {k}")],
            // Tree k alone: k·10 is past the newest.
            (n > 10).then_some(1),
        ),
        (
            "rare_agent_ms",
            vec!["--agent".into(), "two".into()],
            Some(0),
        ),
        (
            "rare_status_ms",
            vec!["--status".into(), "failed".into()],
            Some(0),
        ),
        (
            "rare_range_ms",
            vec![
                "--since".into(),
                at_k.to_string(),
                "--until".into(),
                (at_k + 5000).to_string(),
            ],
            (n > 10).then_some(5.min(n - 1 - k)),
        ),
    ] {
        let mut all = vec!["sessions".to_string(), "--json".to_string()];
        all.extend(args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let w = whole_of(nats(&all))?;
        let rows = rows_of(&w)?;
        anyhow::ensure!(
            want.is_none_or(|want| rows == want) && rows <= 20,
            "{key}: {rows} trees listed"
        );
        rare.push((key, w.ms));
    }
    let middle = if n > 1 {
        format!("h{tag}{:07}", (n - 1) / 2)
    } else {
        template_id.to_string()
    };
    let tree = whole_of(nats(&["tree", "--json", &middle]))?;
    let events = whole_of(nats(&["events", "--json", &middle]))?;
    let one_run = whole_of(nats(&[
        "submit",
        "--agent",
        "one",
        "--no-cache",
        "--wait",
        "one more",
    ]))?;
    let hop_run = whole_of(nats(&[
        "submit",
        "--agent",
        "two",
        "--no-cache",
        "--wait",
        "one hop",
    ]))?;

    // What a worker's sweep and start read: the open roots (none are open). The median
    // of five calls.
    let mut calls = vec![];
    let mut open = vec![];
    for _ in 0..5 {
        let t = Instant::now();
        open = b.log.open_roots().await?;
        calls.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    calls.sort_by(f64::total_cmp);
    let open_roots_ms = calls[2];
    let t = Instant::now();
    let second =
        super::bench_nats::spawn_worker(&config, tmp.path(), url, "default", SECRET, None, false)
            .await?;
    let worker_start_ms = t.elapsed().as_secs_f64() * 1000.0;
    drop(second);
    drop(worker);
    let mut figures = json!({
        "trees": n,
        "events_per_tree": events_per_tree,
        "build": {"write_ms": write_ms},
        "sessions_ms": sessions.ms,
        "filtered_ms": filtered.ms,
        "next_page_ms": next.as_ref().map(|w| w.ms),
        "tree_ms": tree.ms,
        "events_ms": events.ms,
        "run_ms": one_run.ms,
        "hop_run_ms": hop_run.ms,
        "open_roots_ms": open_roots_ms,
        "open_roots": open.len(),
        "worker_start_ms": worker_start_ms,
    });
    for (key, ms) in rare {
        figures[key] = json!(ms);
    }
    Ok(figures)
}

/// The figures compared across sizes: key and label.
const FIGURES: [(&str, &str); 13] = [
    ("sessions_ms", "skein sessions (newest 20)"),
    ("filtered_ms", "skein sessions, filtered"),
    ("rare_text_ms", "sessions, rare mission text"),
    ("rare_agent_ms", "sessions, agent of none"),
    ("rare_status_ms", "sessions, status of none"),
    ("rare_range_ms", "sessions, rare time range"),
    ("next_page_ms", "skein sessions, next page"),
    ("tree_ms", "skein tree"),
    ("events_ms", "skein events"),
    ("run_ms", "submit --wait, one turn"),
    ("hop_run_ms", "submit --wait, one hop"),
    ("open_roots_ms", "open roots (in process, median of 5)"),
    ("worker_start_ms", "a worker until ready"),
];

/// Prints the figures of [`run`] for each size (each on a fresh server when the bench
/// starts one), then each figure's growth from the first size to the last.
pub(crate) async fn print(
    app: &App,
    sizes: &[usize],
    sync: Option<&str>,
    as_json: bool,
) -> Result<()> {
    let mut all = vec![];
    for &n in sizes {
        // Kept until the figures of this size are taken, then stopped.
        let (_server, url, _) = match &app.global.nats {
            Some(u) => (None, u.clone(), String::new()),
            None => super::bench_nats::local_server(sync)?,
        };
        let v = run(app, &url, n)
            .await
            .with_context(|| format!("history of {n} trees on NATS"))?;
        if !as_json {
            print_one(&v)?;
        }
        all.push(v);
    }
    super::bench_history::report(&all, "history_nats", &FIGURES, as_json)
}

fn print_one(v: &serde_json::Value) -> Result<()> {
    crate::outln!(
        "history on NATS: {} finished one-session trees of {} events (written in {:.0} ms)",
        v["trees"],
        v["events_per_tree"],
        v["build"]["write_ms"].as_f64().unwrap_or(f64::NAN),
    )?;
    for (k, label) in FIGURES {
        match v[k].as_f64() {
            Some(x) => crate::outln!("  {label:<28} {x:>10.1} ms")?,
            None => crate::outln!("  {label:<28} {:>10}", "n/a")?,
        }
    }
    crate::outln!()?;
    Ok(())
}
