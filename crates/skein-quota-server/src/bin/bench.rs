//! `skein-quota-bench [--fanout N] [--rpm R] [--window-ms W] [--workers K]
//! [--concurrency C] [--only NAME]`:
//! the quota benchmark of `skein_quota_server::bench` (as `skein bench --quota` runs it),
//! the quota server started from beside this binary; then what asking the quota costs per
//! call. NATS runs need `nats-server` on PATH (a throwaway one is started).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use skein_quota_server::bench;

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
    let d = bench::Options::default();
    let o = bench::Options {
        fanout: arg(&args, "--fanout", d.fanout as u64)? as usize,
        rpm: arg(&args, "--rpm", d.rpm)?,
        window_ms: arg(&args, "--window-ms", d.window_ms)?,
        workers: arg(&args, "--workers", d.workers as u64)? as usize,
        concurrency: arg(&args, "--concurrency", d.concurrency as u64)? as usize,
        only: args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1).cloned()),
    };
    let bin = bench::server_beside_me()?;
    println!("{}", bench::heading(&o));
    let mut nats_server = None;
    bench::run(
        &o,
        &bin,
        || {
            Ok(nats_server
                .get_or_insert_with(skein_testnats::NatsServer::start)
                .url())
        },
        |r| {
            println!("{}", bench::line(r));
            Ok(())
        },
    )
    .await?;
    if o.only.as_deref().is_none_or(|w| "cost".contains(w)) {
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
