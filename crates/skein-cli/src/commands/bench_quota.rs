//! `skein bench --quota`: the model-quota benchmark (`skein_quota_server::bench`) — a wide
//! tree and a small one against a quota-enforcing test server run as its own process,
//! with the limit declared or only learned, on the embedded store and on NATS — printing
//! the 429s received, the wall time against the quota's floor and the small tree's
//! latency for each configuration. Only in builds with the `nats-local` feature, which
//! carry the test servers' launchers.

use std::process::ExitCode;

use anyhow::Result;

use super::bench::BenchArgs;
use crate::app::App;

#[cfg(feature = "nats-local")]
pub async fn run(app: &App, a: &BenchArgs) -> Result<ExitCode> {
    use serde_json::json;
    use skein_quota_server::bench;
    let o = bench::Options {
        fanout: a.fanout.iter().copied().max().unwrap_or(256),
        rpm: a.quota_rpm,
        window_ms: a.quota_window_ms,
        workers: a.quota_workers as usize,
        ..bench::Options::default()
    };
    let server = bench::server_beside_me()?;
    if !a.json {
        crate::outln!("skein bench --quota\n{}", bench::heading(&o))?;
    }
    let mut local = None;
    let given = app.global.nats.clone();
    let rows = bench::run(
        &o,
        &server,
        || match &given {
            Some(u) => Ok(u.split(',').next().unwrap_or_default().to_string()),
            None => Ok(local
                .get_or_insert_with(skein_testnats::NatsServer::start)
                .url()),
        },
        |r| {
            if !a.json {
                crate::outln!("{}", bench::line(r))?;
            }
            Ok(())
        },
    )
    .await?;
    if a.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                let f = &r.figures;
                json!({"config": r.name, "rate_limited": f.rate_limited, "answered": f.answered,
                       "wall_ms": f.wide_ms, "floor_ms": f.floor_ms,
                       "over_floor_pct": r.over_floor(), "small_ms": f.small_ms,
                       "small_first": f.small_first})
            })
            .collect();
        crate::outln!(
            "{}",
            json!({"quota": {"fanout": o.fanout, "rpm": o.rpm, "window_ms": o.window_ms,
                             "workers": o.workers, "concurrency": o.concurrency,
                             "configs": rows}})
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "nats-local"))]
pub async fn run(_app: &App, _a: &BenchArgs) -> Result<ExitCode> {
    anyhow::bail!(
        "this skein was built without `bench --quota`: build it with \
         `cargo build --release -p skein-cli --features nats-local`, and the quota test \
         server beside it with `cargo build --release -p skein-quota-server`"
    )
}
