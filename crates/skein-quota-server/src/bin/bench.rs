//! `skein-quota-bench [--fanout N] [--rpm R] [--window-ms W] [--workers K]
//! [--concurrency C] [--only NAME]`:
//! a tree of N parts, and a tree of one part submitted once the wide one is under way,
//! against the quota server (started here, as its own process, from beside this binary)
//! at R requests a minute, counted in windows of W ms; for each configuration — the limit
//! declared or only learned, on the embedded store or on NATS with K workers, each with C
//! work loops (16) — prints
//! the 429s received, the wall time against the quota's floor (requests ÷ rate) and the
//! small tree's latency. NATS runs need `nats-server` on PATH (a throwaway one is
//! started).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use skein_quota_server::harness::{wide_then_small, Fleet, ServerProcess, Setup, Store};

fn arg(args: &[String], name: &str, default: u64) -> Result<u64> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args
                .get(i + 1)
                .with_context(|| format!("{name} needs a value"))?;
            v.parse()
                .with_context(|| format!("{name} `{v}` is not a whole number"))
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let fanout = arg(&args, "--fanout", 256)? as usize;
    let rpm = arg(&args, "--rpm", 600)?;
    let window_ms = arg(&args, "--window-ms", 6_000)?;
    let workers = arg(&args, "--workers", 3)? as usize;
    let concurrency = arg(&args, "--concurrency", 16)? as usize;
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    if rpm == 0 || window_ms == 0 || fanout == 0 {
        bail!("--rpm, --window-ms and --fanout must be at least 1");
    }
    let limit = (rpm as f64 * window_ms as f64 / 60_000.0).round().max(1.0) as usize;
    let bin: PathBuf = std::env::current_exe()?
        .parent()
        .context("no directory")?
        .join("skein-quota-server");
    println!(
        "quota: fan-out {fanout} then 1, {rpm} requests/min ({limit} per {window_ms} ms window), \
         {workers} NATS workers"
    );
    println!(
        "{:<18} {:>6} {:>9} {:>9} {:>7} {:>10}",
        "config", "429s", "wall ms", "floor ms", "vs", "small ms"
    );
    let mut nats_server = None;
    for (name, declared, nats) in [
        ("embedded declared", true, false),
        ("embedded learned", false, false),
        ("nats declared", true, true),
        ("nats learned", false, true),
    ] {
        if only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let store = if nats {
            let s = nats_server.get_or_insert_with(skein_testnats::NatsServer::start);
            Store::Nats(s.url())
        } else {
            Store::Embedded
        };
        let server = ServerProcess::start(&bin, limit, window_ms)?;
        let setup = Setup {
            store,
            declared_rpm: declared.then_some(rpm),
            workers,
            concurrency,
        };
        let fleet = Fleet::start(&server.url, &setup).await?;
        let f = wide_then_small(
            &fleet,
            &server,
            fanout,
            1,
            rpm,
            Duration::from_secs(600),
            name,
        )
        .await?;
        fleet.stop().await;
        println!(
            "{:<18} {:>6} {:>9.0} {:>9.0} {:>6.1}% {:>10.0}{}",
            name,
            f.rate_limited,
            f.wide_ms,
            f.floor_ms,
            (f.wide_ms / f.floor_ms - 1.0) * 100.0,
            f.small_ms,
            if f.small_first {
                ""
            } else {
                "  (the small tree ended after the wide one)"
            }
        );
    }
    if only.as_deref().is_none_or(|o| "cost".contains(o)) {
        let nats = nats_server.get_or_insert_with(skein_testnats::NatsServer::start);
        cost(&nats.url()).await?;
    }
    Ok(())
}

/// What asking costs per model call, alone (no wait): the in-memory quota and the NATS
/// one, with a rate limit (ask only) and with a concurrency limit too (ask and give back).
async fn cost(nats: &str) -> Result<()> {
    use skein_ports::quota::{Decision, LocalQuota, Quota, QuotaAsk, QuotaLimits};
    use std::sync::Arc;
    let nc = skein_nats::NatsConfig {
        urls: vec![nats.to_string()],
        ..Default::default()
    };
    let store = skein_nats::NatsStore::connect(&nc, Duration::from_secs(30)).await?;
    let shared: Arc<dyn Quota> = store;
    let local: Arc<dyn Quota> = Arc::new(LocalQuota::new());
    let rate = QuotaLimits {
        requests_per_minute: Some(1_000_000_000),
        ..Default::default()
    };
    let both = QuotaLimits {
        concurrent_requests: Some(1_000_000),
        ..rate
    };
    println!("quota cost per model call (no wait), 500 calls each:");
    for (name, q) in [("embedded", &local), ("nats", &shared)] {
        for (what, limits) in [("rate", rate), ("rate+concurrency", both)] {
            let n = 500;
            let started = std::time::Instant::now();
            for i in 0..n {
                let ask = QuotaAsk {
                    key: format!("bench:{what}"),
                    session: format!("s{i}"),
                    root: "r".into(),
                    priority: 0,
                    input_tokens: 100,
                };
                match q.acquire(&ask, &limits).await? {
                    Decision::Go(p) => q.release(&p, &limits, Some((100, 10))).await?,
                    Decision::Wait { reason, .. } => bail!("a call waited: {reason}"),
                }
            }
            let us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
            println!("  {name:<9} {what:<17} {us:>8.1} µs");
        }
    }
    Ok(())
}
