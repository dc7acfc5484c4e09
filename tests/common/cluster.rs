//! Helpers of the NATS end-to-end suites: `skein worker` processes, raw-protocol
//! submissions (the NATS text protocol over a plain TCP socket, not skein's client code),
//! waiting for trees to end and auditing their logs.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use skein_core::{AgentSet, Event, Limits, SessionId};
use skein_nats::{NatsConfig, NatsStore};

use super::*;

pub const SECRET: &str = "test-secret-not-for-production";

pub fn worker(urls: &str, name: &str, replicas: usize) -> Child {
    worker_logged(urls, name, replicas, None)
}

/// Lines a worker wrote to stderr after its "ready" line.
pub type LogLines = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// [`worker`], keeping what it logs after "ready" in `log` when one is given.
pub fn worker_logged(urls: &str, name: &str, replicas: usize, log: Option<LogLines>) -> Child {
    worker_on(&demo_config(), urls, name, replicas, log)
}

/// [`worker_logged`] with the agents of `config`.
pub fn worker_on(
    config: &std::path::Path,
    urls: &str,
    name: &str,
    replicas: usize,
    log: Option<LogLines>,
) -> Child {
    let mut c = std::process::Command::new(bin());
    c.args(["--config"])
        .arg(config)
        .args(["--nats", urls, "worker", "--concurrency", "32"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__RUNTIME__LEASE", "3s")
        .env("SKEIN__RUNTIME__WORKER_ID", name)
        .env("SKEIN__NATS__REPLICAS", replicas.to_string())
        .env(
            "SKEIN_LOG",
            std::env::var("SKEIN_E2E_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("worker starts");
    // Wait for its "ready" line.
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("worker {name} exited before it was ready");
        }
        if line.contains("ready") {
            break;
        }
    }
    let tag = name.to_string();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if std::env::var("SKEIN_E2E_VERBOSE").is_ok() {
                eprintln!("[{tag}] {l}");
            }
            if let Some(log) = &log {
                log.lock().unwrap_or_else(|p| p.into_inner()).push(l);
            }
        }
    });
    child
}

pub fn kill9(c: &mut Child) {
    std::process::Command::new("kill")
        .args(["-9", &c.id().to_string()])
        .status()
        .unwrap();
    let _ = c.wait();
}

/// Publishes with the NATS text protocol over TCP: `PUB subject n\r\npayload\r\n`.
pub fn raw_publish(url: &str, subject: &str, payloads: &[Vec<u8>]) {
    let addr = url.trim_start_matches("nats://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut info = String::new();
    r.read_line(&mut info).unwrap();
    assert!(info.starts_with("INFO "), "{info}");
    s.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"name\":\"raw-e2e\"}\r\n")
        .unwrap();
    for p in payloads {
        s.write_all(format!("PUB {subject} {}\r\n", p.len()).as_bytes())
            .unwrap();
        s.write_all(p).unwrap();
        s.write_all(b"\r\n").unwrap();
    }
    s.write_all(b"PING\r\n").unwrap();
    let mut line = String::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line.starts_with("PONG") {
            break;
        }
        assert!(!line.starts_with("-ERR"), "{line}");
    }
    let _ = r.read(&mut [0u8; 0]);
}

pub fn missions(tag: &str, n: usize) -> (Vec<SessionId>, Vec<Vec<u8>>) {
    let ids: Vec<SessionId> = (0..n)
        .map(|i| SessionId::root(&format!("{tag}-{i}")).unwrap())
        .collect();
    let payloads = ids
        .iter()
        .map(|id| {
            serde_json::json!({"agent": "orchestrator", "mission": format!("Brief on {id}"), "id": id.to_string(), "no_cache": true})
                .to_string()
                .into_bytes()
        })
        .collect();
    (ids, payloads)
}

pub fn tag() -> String {
    skein_runtime::new_root_id().as_str()[16..].to_string()
}

pub async fn store(urls: &str, replicas: usize) -> std::sync::Arc<NatsStore> {
    let cfg = NatsConfig {
        urls: urls.split(',').map(str::to_string).collect(),
        replicas,
        ..NatsConfig::default()
    };
    NatsStore::connect(&cfg, Duration::from_secs(3))
        .await
        .unwrap()
}

/// Waits until every root has ended (reading the logs), or fails after `limit`.
pub async fn wait_all(urls: &str, replicas: usize, roots: &[SessionId], limit: Duration) {
    let st = store(urls, replicas).await;
    let b = st.backend();
    let deadline = Instant::now() + limit;
    loop {
        let mut open = 0;
        for r in roots {
            match b.log.last(r).await {
                Ok(Some(rec)) if rec.env.body.is_terminal() => {}
                _ => open += 1,
            }
        }
        if open == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{open} of {} trees still open after {limit:?}",
            roots.len()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The checks of one log that need nothing but the log: the hash chain, no tool call
/// recorded twice, one terminal event and it is `Completed`. Adds the workers that made
/// its model calls to `workers`.
pub fn check_log(s: &SessionId, recs: &[skein_core::Record], workers: &mut BTreeSet<String>) {
    skein_core::event::verify_chain(s, recs).unwrap_or_else(|e| panic!("{s}: {e:?}"));
    let mut calls = BTreeSet::new();
    let mut terminal = 0;
    for r in recs {
        match &r.env.body {
            Event::ToolCalled(t) => assert!(calls.insert(t.call.clone()), "{s}: {} twice", t.call),
            Event::ModelCalled(m) => {
                workers.insert(m.worker.clone());
            }
            e if e.is_terminal() => terminal += 1,
            _ => {}
        }
    }
    assert_eq!(terminal, 1, "{s}");
    assert!(
        matches!(recs.last().unwrap().env.body, Event::Completed(_)),
        "{s}: ends with {}",
        recs.last().unwrap().env.body.kind()
    );
}

/// Every tree completed; every log verifies (chain, decisions, one terminal event, no
/// duplicated step). Returns the workers that made model calls.
pub async fn audit(urls: &str, replicas: usize, roots: &[SessionId]) -> BTreeSet<String> {
    let st = store(urls, replicas).await;
    let b = st.backend();
    let files = read_agents();
    let agents = AgentSet::load(&files, &[]).unwrap();
    let mut workers = BTreeSet::new();
    for root in roots {
        let started = Instant::now();
        let limits = Limits::default();
        let verdicts =
            settled(|| skein_runtime::replay::verify_tree(&b, root, &agents, &limits)).await;
        if started.elapsed() > Duration::from_secs(2) {
            eprintln!("audit: verifying {root} took {:?}", started.elapsed());
        }
        assert_eq!(verdicts.len(), 5, "{root}");
        for v in verdicts {
            assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
        }
        for s in settled(|| b.log.tree(root)).await {
            check_log(&s, &settled(|| b.log.read(&s, 1)).await, &mut workers);
        }
    }
    workers
}

/// The checks of [`check_log`] on every log of every tree (no decision replay, which
/// would read every definition blob right after a node loss).
pub async fn chains(urls: &str, roots: &[SessionId]) {
    let st = store(urls, 3).await;
    let b = st.backend();
    let mut workers = BTreeSet::new();
    for root in roots {
        let sessions = settled(|| b.log.tree(root)).await;
        for s in sessions {
            check_log(&s, &settled(|| b.log.read(&s, 1)).await, &mut workers);
        }
    }
}

/// A read made right after a node loss, tried again while the cluster answers that it is
/// unavailable (it is electing leaders), for at most 30 s; any other error fails the test.
pub async fn settled<T, F, Fut>(mut read: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = skein_runtime::Result<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match read().await {
            Ok(v) => return v,
            Err(e @ skein_runtime::Error::Unavailable { .. }) if Instant::now() < deadline => {
                eprintln!("read after the node loss, trying again: {e}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("read after the node loss: {e}"),
        }
    }
}

pub fn read_agents() -> Vec<(String, String)> {
    std::fs::read_dir(repo().join("config/agents"))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.display().to_string(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect()
}

/// Serialises the tests of this file: each runs several processes.
pub static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// How many results each tree announced, as heard by an independent subscriber of
/// `skein.results.>`: the NATS text protocol over a plain TCP socket (no skein code, no
/// NATS client library), on the first of `urls` that answers, and on the next one should
/// its connection drop (a node killed under it).
/// Per tree: how many results were heard, and the headers of each.
type Heard = std::collections::BTreeMap<String, (u32, Vec<String>)>;

pub struct ResultTally {
    counts: std::sync::Arc<std::sync::Mutex<Heard>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for ResultTally {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl ResultTally {
    /// Subscribes, and returns once the server has the subscription.
    pub fn subscribe(urls: &[String]) -> Self {
        let counts = std::sync::Arc::new(std::sync::Mutex::new(Default::default()));
        let (ready, subscribed) = std::sync::mpsc::channel();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (urls, c, halt) = (urls.to_vec(), counts.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut ready = Some(ready);
            for url in urls.iter().cycle() {
                // Each connection's end (a node killed) moves on to the next node.
                let _ = Self::listen(url, &c, &mut ready, &halt);
                if halt.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        subscribed
            .recv_timeout(Duration::from_secs(30))
            .expect("the result subscriber connects");
        Self { counts, stop }
    }

    fn listen(
        url: &str,
        counts: &std::sync::Mutex<Heard>,
        ready: &mut Option<std::sync::mpsc::Sender<()>>,
        halt: &std::sync::atomic::AtomicBool,
    ) -> std::io::Result<()> {
        let mut s = TcpStream::connect(url.trim_start_matches("nats://"))?;
        // Woken now and then to see whether the tally is still wanted.
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut r = BufReader::new(s.try_clone()?);
        let mut line = String::new();
        r.read_line(&mut line)?;
        s.write_all(
            b"CONNECT {\"verbose\":false,\"headers\":true,\"no_responders\":false,\"name\":\"result-tally\"}\r\n\
              SUB skein.results.> 1\r\nPING\r\n",
        )?;
        let mut cut = false;
        loop {
            if !cut {
                line.clear();
            }
            cut = false;
            match r.read_line(&mut line) {
                Ok(0) => return Ok(()),
                Ok(_) if !line.ends_with('\n') => {
                    cut = true;
                    continue;
                }
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    if halt.load(std::sync::atomic::Ordering::Relaxed) {
                        return Ok(());
                    }
                    // A line cut by the timeout is read on (it is kept in `line`).
                    cut = true;
                    continue;
                }
                Err(e) => return Err(e),
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.first().copied() {
                Some("PING") => s.write_all(b"PONG\r\n")?,
                Some("PONG") => {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                }
                // MSG <subject> <sid> [reply] <bytes>; HMSG … <header bytes> <total bytes>.
                Some("MSG" | "HMSG") => {
                    let total: usize = words.last().and_then(|n| n.parse().ok()).unwrap_or(0);
                    let mut body = vec![0u8; total + 2];
                    r.read_exact(&mut body)?;
                    let root = words[1].trim_start_matches("skein.results.").to_string();
                    // The stream's seq and the ending's, for a failure message.
                    let headers = match words.first().copied() {
                        Some("HMSG") => {
                            let len: usize = words[words.len() - 2].parse().unwrap_or(0);
                            String::from_utf8_lossy(&body[..len.min(body.len())])
                                .lines()
                                .filter(|l| {
                                    l.starts_with("Nats-Sequence") || l.starts_with("Skein-Ended")
                                })
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                        _ => String::new(),
                    };
                    let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
                    let entry = counts.entry(root).or_default();
                    entry.0 += 1;
                    entry.1.push(headers);
                }
                _ => {}
            }
        }
    }

    /// Notices heard so far, per tree.
    pub fn counts(&self) -> std::collections::BTreeMap<String, u32> {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(root, (n, _))| (root.clone(), *n))
            .collect()
    }

    /// Fails on any tree announced more than once, naming what each hearing carried.
    pub fn assert_at_most_once(&self) {
        let twice: Vec<(String, (u32, Vec<String>))> = self
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, (n, _))| *n > 1)
            .map(|(root, heard)| (root.clone(), heard.clone()))
            .collect();
        assert!(
            twice.is_empty(),
            "results announced more than once: {twice:?}"
        );
    }

    /// Waits (at most `limit`) until every root was heard, then a moment more for late
    /// repeats, and fails unless each was heard exactly once.
    pub fn assert_each_exactly_once(&self, roots: &[SessionId], limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let counts = self.counts();
            let missing: Vec<&SessionId> = roots
                .iter()
                .filter(|r| !counts.contains_key(r.as_str()))
                .collect();
            if missing.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {} results never heard, e.g. {:?}",
                missing.len(),
                roots.len(),
                &missing[..missing.len().min(5)]
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_secs(2));
        self.assert_at_most_once();
        let counts = self.counts();
        for r in roots {
            assert_eq!(counts.get(r.as_str()), Some(&1), "{r}");
        }
    }
}
