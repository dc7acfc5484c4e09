//! The quota server as a child process, a fleet of workers calling it, and the run of a
//! wide tree with a small one submitted after it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use skein_core::{AgentSet, Limits, SessionId, Status};
use skein_llm::{ApiKey, KeySource, ProviderKind, ProviderSettings, Registry};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};

/// The server, running as a child process; killed when dropped.
pub struct ServerProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl ServerProcess {
    /// Starts `bin` with a quota of `limit` requests per `window_ms` for each key.
    pub fn start(bin: &Path, limit: usize, window_ms: u64) -> Result<Self> {
        Self::start_slow(bin, limit, window_ms, 0)
    }

    /// [`ServerProcess::start`], each admitted request answered after `latency_ms`.
    pub fn start_slow(bin: &Path, limit: usize, window_ms: u64, latency_ms: u64) -> Result<Self> {
        let mut child = Command::new(bin)
            .args([
                "--limit",
                &limit.to_string(),
                "--window-ms",
                &window_ms.to_string(),
                "--latency-ms",
                &latency_ms.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let out = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let Some(url) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            bail!("the quota server said {line:?}");
        };
        Ok(Self {
            url: url.to_string(),
            child,
        })
    }

    /// What it counted: `requests`, `ok`, `rate_limited`, `max_in_window`, `by_model`.
    pub async fn stats(&self) -> Result<Value> {
        Ok(reqwest::get(format!("{}/stats", self.url))
            .await?
            .json()
            .await?)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the fleet keeps its sessions.
#[derive(Debug, Clone)]
pub enum Store {
    /// One process on a sled store.
    Embedded,
    /// `workers` processes' worth of runtimes on the NATS server at this URL.
    Nats(String),
}

/// How the fleet calls the server.
#[derive(Debug, Clone)]
pub struct Setup {
    pub store: Store,
    /// The requests a minute declared in `[models.providers.q.limits]`; none: only what
    /// the server's answers teach.
    pub declared_rpm: Option<u64>,
    /// Runtimes (workers); each with `concurrency` work loops.
    pub workers: usize,
    pub concurrency: usize,
}

/// Runtimes working, each on its own connection to the store.
pub struct Fleet {
    pub runtimes: Vec<Arc<Runtime>>,
    stops: Vec<tokio::sync::watch::Sender<bool>>,
    handles: Vec<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

const ORCHESTRATOR: &str = "---\nname: orchestrator\nmodel: q:m\nagents: [worker]\n---\nYou delegate each part to a worker.\n";
const WORKER: &str = "---\nname: worker\nmodel: q:m\n---\nYou do one part.\n";

/// The provider `q` at the server, with `setup`'s limits.
pub fn models(url: &str, declared_rpm: Option<u64>) -> Registry {
    let mut s = ProviderSettings::new("q", ProviderKind::OpenAi, format!("{url}/v1"));
    s.key = KeySource::Value(ApiKey::new("quota-test-key"));
    s.stream = false;
    let limits = skein_llm::Limits {
        requests_per_minute: declared_rpm,
        ..Default::default()
    };
    let mut r = Registry::new();
    r.set_limits("q", limits, Default::default());
    if let Ok(p) = skein_llm::build_provider(s) {
        r.insert("q", p);
    }
    r
}

impl Fleet {
    pub async fn start(url: &str, setup: &Setup) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let agents = Arc::new(AgentSet::load(
            &[
                ("orchestrator.md".into(), ORCHESTRATOR.into()),
                ("worker.md".into(), WORKER.into()),
            ],
            &[],
        )?);
        let models = models(url, setup.declared_rpm);
        let cfg = |i: usize| RuntimeConfig {
            worker_id: format!("quota-w{i}"),
            limits: Limits {
                max_children_per_turn: 4096,
                max_tool_calls_per_turn: 4096,
                ..Limits::default()
            },
            ..RuntimeConfig::default()
        };
        let mut runtimes = vec![];
        match &setup.store {
            Store::Embedded => {
                let store =
                    skein_sled::SledStore::open(&dir.path().join("data"), &dir.path().join("ws"))?;
                runtimes.push(Runtime::new(
                    store.backend(),
                    agents.clone(),
                    models.clone(),
                    skein_tools::ToolBox::new(),
                    cfg(1),
                ));
            }
            Store::Nats(nats) => {
                let nc = skein_nats::NatsConfig {
                    urls: vec![nats.clone()],
                    ..Default::default()
                };
                for i in 0..setup.workers {
                    let store =
                        skein_nats::NatsStore::connect(&nc, Duration::from_secs(30)).await?;
                    runtimes.push(Runtime::new(
                        store.backend(),
                        agents.clone(),
                        models.clone(),
                        skein_tools::ToolBox::new(),
                        cfg(i + 1),
                    ));
                }
            }
        }
        let mut fleet = Fleet {
            runtimes,
            stops: vec![],
            handles: vec![],
            _dir: dir,
        };
        for rt in &fleet.runtimes {
            let (stop, handles) = rt.spawn_workers(rt.pools(), setup.concurrency);
            fleet.stops.push(stop);
            fleet.handles.extend(handles);
        }
        Ok(fleet)
    }

    /// Submits a tree whose root delegates `fanout` parts; `tag` keeps missions apart.
    pub async fn submit(&self, fanout: usize, tag: &str) -> Result<SessionId> {
        self.submit_at(fanout, tag, None).await
    }

    /// [`Fleet::submit`], at a priority (`--priority`).
    pub async fn submit_at(
        &self,
        fanout: usize,
        tag: &str,
        priority: Option<i32>,
    ) -> Result<SessionId> {
        Ok(self.runtimes[0]
            .submit(Submission {
                agent: "orchestrator".into(),
                mission: format!("fanout={fanout} {tag}"),
                no_cache: true,
                priority,
                ..Default::default()
            })
            .await?)
    }

    /// The status of `id` as its log says.
    pub async fn status(&self, id: &SessionId) -> Result<Status> {
        let rt = &self.runtimes[0];
        let records = rt.backend.log.read(id, 1).await?;
        Ok(skein_runtime::inspect::fold_records(id, &records)?
            .state
            .status)
    }

    pub async fn stop(self) {
        for s in &self.stops {
            let _ = s.send(true);
        }
        for h in self.handles {
            let _ = h.await;
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Figures {
    /// 429 answers the server gave.
    pub rate_limited: u64,
    /// Requests it answered.
    pub answered: u64,
    /// The most requests it admitted within one window.
    pub max_in_window: u64,
    /// From the wide tree's submission to its end.
    pub wide_ms: f64,
    /// From the small tree's submission to its end.
    pub small_ms: f64,
    /// Both trees' requests ÷ the rate, in ms: the least time they can take.
    pub floor_ms: f64,
    pub small_first: bool,
    /// The most sessions the quota listed as waiting at once (sampled while polling).
    pub most_waiting: usize,
    pub wide: Status,
    pub small: Status,
}

/// Runs a tree of `wide` parts, and once its parts are asked for, a tree of `small`;
/// waits for both (at most `limit`).
pub async fn wide_then_small(
    fleet: &Fleet,
    server: &ServerProcess,
    wide: usize,
    small: usize,
    rpm: u64,
    limit: Duration,
    tag: &str,
) -> Result<Figures> {
    let before = server.stats().await?;
    let count = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let started = Instant::now();
    let w = fleet.submit(wide, &format!("wide {tag}")).await?;
    // The small tree comes once the wide one's parts are under way.
    let deadline = Instant::now() + limit;
    loop {
        let s = server.stats().await?;
        if count(&s, "requests") >= count(&before, "requests") + 4 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let small_started = Instant::now();
    let s = fleet.submit(small, &format!("small {tag}")).await?;
    let (mut wide_at, mut small_at) = (None, None);
    let (mut wide_status, mut small_status) = (Status::Running, Status::Running);
    let mut most_waiting = 0;
    let mut polls = 0u64;
    while (wide_at.is_none() || small_at.is_none()) && Instant::now() < deadline {
        polls += 1;
        // The queue, now and then (a listing reads the whole quota bucket).
        if polls % 10 == 1 {
            if let Some(q) = fleet.runtimes[0].quota() {
                most_waiting = most_waiting.max(q.waiting().await.map_or(0, |w| w.len()));
            }
        }
        if wide_at.is_none() {
            wide_status = fleet.status(&w).await?;
            if wide_status.is_terminal() {
                wide_at = Some(started.elapsed());
            }
        }
        if small_at.is_none() {
            small_status = fleet.status(&s).await?;
            if small_status.is_terminal() {
                small_at = Some(small_started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = server.stats().await?;
    let answered = count(&after, "ok") - count(&before, "ok");
    let ms = |d: Option<Duration>| d.map_or(f64::INFINITY, |d| d.as_secs_f64() * 1000.0);
    Ok(Figures {
        rate_limited: count(&after, "rate_limited") - count(&before, "rate_limited"),
        answered,
        max_in_window: count(&after, "max_in_window"),
        wide_ms: ms(wide_at),
        small_ms: ms(small_at),
        floor_ms: answered as f64 * 60_000.0 / rpm as f64,
        small_first: match (small_at, wide_at) {
            (Some(s), Some(w)) => small_started + s < started + w,
            (Some(_), None) => true,
            _ => false,
        },
        most_waiting,
        wide: wide_status,
        small: small_status,
    })
}
