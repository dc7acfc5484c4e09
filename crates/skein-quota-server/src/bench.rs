//! The quota benchmark, shared by `skein bench --quota` and `skein-quota-bench`: a tree
//! of N parts, and a tree of one part submitted once the wide one is under way, against
//! the quota server (its own process) at R requests a minute counted in windows of W ms;
//! for each configuration — the limit declared or only learned, on the embedded store or
//! on NATS with K workers of C work loops — the 429s received, the wall time against the
//! quota's floor (requests ÷ rate) and the small tree's latency.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::harness::{wide_then_small, Figures, Fleet, ServerProcess, Setup, Store};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub fanout: usize,
    pub rpm: u64,
    pub window_ms: u64,
    pub workers: usize,
    /// Work loops a worker.
    pub concurrency: usize,
    /// Only the configurations whose name contains this.
    pub only: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            fanout: 256,
            rpm: 600,
            window_ms: 6_000,
            workers: 3,
            concurrency: 16,
            only: None,
        }
    }
}

impl Options {
    /// The requests the server admits in one window: the rate over the window.
    pub fn server_limit(&self) -> usize {
        (self.rpm as f64 * self.window_ms as f64 / 60_000.0)
            .round()
            .max(1.0) as usize
    }

    fn check(&self) -> Result<()> {
        if self.rpm == 0 || self.window_ms == 0 || self.fanout == 0 {
            bail!("the rate, the window and the fan-out must be at least 1");
        }
        if self.workers == 0 || self.concurrency == 0 {
            bail!("the workers and their work loops must be at least 1");
        }
        Ok(())
    }
}

/// The configurations, by name: (name, limit declared, on NATS).
pub const CONFIGS: [(&str, bool, bool); 4] = [
    ("embedded declared", true, false),
    ("embedded learned", false, false),
    ("nats declared", true, true),
    ("nats learned", false, true),
];

/// One configuration's figures.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: &'static str,
    pub figures: Figures,
}

impl Row {
    /// The wall time over the floor, in percent.
    pub fn over_floor(&self) -> f64 {
        (self.figures.wide_ms / self.figures.floor_ms - 1.0) * 100.0
    }
}

/// The quota server's binary: `skein-quota-server` beside the running one.
pub fn server_beside_me() -> Result<PathBuf> {
    let bin = std::env::current_exe()?
        .parent()
        .context("the running binary has no directory")?
        .join("skein-quota-server");
    if !bin.exists() {
        bail!(
            "the quota test server is not at {}: build it beside this binary with \
             `cargo build --release -p skein-quota-server` (the same profile as this one)",
            bin.display()
        );
    }
    Ok(bin)
}

/// The heading of the table [`line`] writes rows of.
pub fn heading(o: &Options) -> String {
    format!(
        "quota: fan-out {} then 1, {} requests/min ({} per {} ms window), {} NATS workers, \
         {} work loops each\n{:<18} {:>6} {:>9} {:>9} {:>7} {:>10}",
        o.fanout,
        o.rpm,
        o.server_limit(),
        o.window_ms,
        o.workers,
        o.concurrency,
        "config",
        "429s",
        "wall ms",
        "floor ms",
        "vs",
        "small ms"
    )
}

/// One row of the table.
pub fn line(r: &Row) -> String {
    let f = &r.figures;
    format!(
        "{:<18} {:>6} {:>9.0} {:>9.0} {:>6.1}% {:>10.0}{}",
        r.name,
        f.rate_limited,
        f.wide_ms,
        f.floor_ms,
        r.over_floor(),
        f.small_ms,
        if f.small_first {
            ""
        } else {
            "  (the small tree ended after the wide one)"
        }
    )
}

/// Runs the configurations `o` selects, the quota server started from `server` for each;
/// the NATS ones on the nats-server `nats()` gives (asked once, when the first needs it).
/// `row` is called with each row as it is measured.
pub async fn run(
    o: &Options,
    server: &Path,
    mut nats: impl FnMut() -> Result<String>,
    mut row: impl FnMut(&Row) -> Result<()>,
) -> Result<Vec<Row>> {
    o.check()?;
    let mut url = None;
    let mut rows = vec![];
    for (name, declared, on_nats) in CONFIGS {
        if o.only.as_deref().is_some_and(|w| !name.contains(w)) {
            continue;
        }
        let store = if on_nats {
            if url.is_none() {
                url = Some(nats()?);
            }
            Store::Nats(url.clone().unwrap_or_default())
        } else {
            Store::Embedded
        };
        let srv = ServerProcess::start(server, o.server_limit(), o.window_ms)?;
        let setup = Setup {
            store,
            declared_rpm: declared.then_some(o.rpm),
            workers: o.workers,
            concurrency: o.concurrency,
        };
        let fleet = Fleet::start(&srv.url, &setup).await?;
        let figures = wide_then_small(
            &fleet,
            &srv,
            o.fanout,
            1,
            o.rpm,
            Duration::from_secs(600),
            name,
        )
        .await;
        fleet.stop().await;
        let r = Row {
            name,
            figures: figures.with_context(|| format!("the {name} run"))?,
        };
        row(&r)?;
        rows.push(r);
    }
    Ok(rows)
}
