//! Operating a cluster: the worker's health and metrics endpoints (`--http`), draining on
//! SIGTERM, read commands against an unreachable server, log formats, and `skein cancel`
//! on the embedded store. Real nats-server processes, real `skein` processes.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{store, SECRET};
use common::*;
use skein_core::{Event, SessionId};
use skein_testnats::{free_port, NatsServer};

/// `GET path` on 127.0.0.1:`port`: (status, body), or none when nothing answers.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    // Bodies come whole or chunked; chunk sizes are lines of hex digits alone.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        loop {
            let (size, tail) = rest.split_once("\r\n")?;
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        body.to_string()
    };
    Some((status, body))
}

/// Polls `path` until its status is `want`; panics after `limit`. Returns the body.
fn wait_status(port: u16, path: &str, want: u16, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    let mut last = None;
    while Instant::now() < deadline {
        last = http_get(port, path);
        if let Some((s, b)) = &last {
            if *s == want {
                return b.clone();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{path} did not answer {want} within {limit:?}; last: {last:?}")
}

/// One sample of the Prometheus text format: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// Parses the Prometheus text exposition format (version 0.0.4) strictly: every line is
/// empty, a `# HELP name text` or `# TYPE name kind` comment, or a sample `name{l="v",…}
/// value [timestamp]` whose name was given a type first (or is a histogram's or summary's
/// `_bucket`, `_sum` or `_count` of one), with label values escaped as the format says.
fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let name_re = regex::Regex::new(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$").unwrap();
    let sample_re = regex::Regex::new(
        r#"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\})? ([^ ]+)(?: (-?[0-9]+))?$"#,
    )
    .unwrap();
    let label_re =
        regex::Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)""#).unwrap();
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = vec![];
    for (i, line) in text.lines().enumerate() {
        let at = |why: &str| format!("line {}: {why}: {line:?}", i + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(c) = line.strip_prefix("# ") {
            let mut parts = c.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(n), _) if name_re.is_match(n) => {}
                (Some("TYPE"), Some(n), Some(t)) if name_re.is_match(n) => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&t) {
                        return Err(at("unknown type"));
                    }
                    if types.insert(n.to_string(), t.to_string()).is_some() {
                        return Err(at("a second TYPE for one metric"));
                    }
                }
                (Some("HELP" | "TYPE"), _, _) => return Err(at("malformed comment")),
                _ => {}
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let caps = sample_re.captures(line).ok_or_else(|| at("not a sample"))?;
        let name = caps[1].to_string();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| {
                types
                    .get(*f)
                    .is_some_and(|t| t == "histogram" || t == "summary")
            })
            .unwrap_or(&name);
        if !types.contains_key(family) {
            return Err(at("a sample before its TYPE"));
        }
        let labels: BTreeMap<String, String> = caps
            .get(2)
            .map(|l| {
                label_re
                    .captures_iter(l.as_str())
                    .map(|c| (c[1].to_string(), c[2].to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let value = match &caps[3] {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse::<f64>()
                .map_err(|_| at("the value is not a number"))?,
        };
        samples.push((name, labels, value));
    }
    Ok(samples)
}

#[test]
fn the_prometheus_check_refuses_what_is_not_the_text_format() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{pool=\"default\"} 3\n\
                # TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1\n";
    assert_eq!(parse_prometheus(good).unwrap().len(), 4);
    for bad in [
        "a_total 3\n",                                       // no TYPE
        "# TYPE a_total counter\na_total{pool=default} 3\n", // unquoted label
        "# TYPE a_total counter\na_total three\n",           // not a number
        "# TYPE a_total counter\n# TYPE a_total gauge\n",    // two types
        "# TYPE a_total countr\n",                           // unknown type
        "<html>metrics</html>\n",
    ] {
        assert!(parse_prometheus(bad).is_err(), "accepted {bad:?}");
    }
}

/// Sum of the samples named `name` whose labels include every pair of `with`.
fn sum(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && with
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

fn has(samples: &[Sample], name: &str) -> bool {
    samples.iter().any(|(n, _, _)| n == name)
}

fn metrics(port: u16) -> Vec<Sample> {
    let (status, body) = http_get(port, "/metrics").expect("/metrics answers");
    assert_eq!(status, 200, "{body}");
    parse_prometheus(&body).unwrap_or_else(|e| panic!("/metrics is not Prometheus text: {e}"))
}

struct Worker {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    /// `skein worker --http 127.0.0.1:PORT` on `url`, started and ready.
    fn start(url: &str, name: &str, config: &Path, env: &[(&str, &str)], args: &[&str]) -> Self {
        let port = free_port();
        let mut c = Command::new(bin());
        c.arg("--config")
            .arg(config)
            .args(["--nats", url, "worker", "--concurrency", "8"])
            .args(["--http", &format!("127.0.0.1:{port}")])
            .args(args)
            .env("SKEIN_TOKEN_SECRET", SECRET)
            .env("SKEIN__RUNTIME__WORKER_ID", name)
            .env("SKEIN_LOG", "warn")
            .env_remove("SKEIN_LOG_FORMAT")
            .env_remove("SKEIN_HTTP_ADDR")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("worker starts");
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        let log = Arc::new(Mutex::new(vec![]));
        let mut line = String::new();
        loop {
            line.clear();
            if err.read_line(&mut line).unwrap_or(0) == 0 {
                panic!("worker {name} exited before it was ready");
            }
            log.lock().unwrap().push(line.trim_end().to_string());
            if line.contains(" ready: ") {
                break;
            }
        }
        let l = log.clone();
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        Self { child, port, log }
    }

    fn logged(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn submit(url: &str, config: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .arg("--config")
        .arg(config)
        .args(["--nats", url, "submit"])
        .args(args)
        .env("SKEIN_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("skein submit runs")
}

/// One worker with `--http` runs the demo tree: /metrics parses as Prometheus text and its
/// counts agree with the tree's logs; a rejected submission is counted by reason; /readyz
/// turns false when nats-server stops and true once it is back, and the reconnect is logged
/// and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_trees_steps_and_readiness_follows_nats() {
    let mut server = NatsServer::start();
    let url = server.url();
    let w = Worker::start(&url, "ops-1", &demo_config(), &[], &[]);
    assert_eq!(http_get(w.port, "/healthz").map(|r| r.0), Some(200));
    wait_status(w.port, "/readyz", 200, Duration::from_secs(20));

    let id = format!("ops-{}", common::cluster::tag());
    let out = submit(
        &url,
        &demo_config(),
        &[
            "--id",
            &id,
            "--no-cache",
            "--wait",
            "--json",
            "Brief on event sourcing",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rejected = submit(
        &url,
        &demo_config(),
        &["--agent", "nosuch", "--wait", "a mission"],
    );
    assert!(!rejected.status.success());

    // What the logs say happened.
    let st = store(&url, 1).await;
    let b = st.backend();
    let root = SessionId::root(&id).unwrap();
    let sessions = b.log.tree(&root).await.unwrap();
    assert_eq!(sessions.len(), 5, "the demo tree");
    let (mut model_calls, mut completed, mut input_tokens, mut output_tokens) = (0, 0, 0, 0);
    let mut models = std::collections::BTreeSet::new();
    for s in &sessions {
        for r in b.log.read(s, 1).await.unwrap() {
            match &r.env.body {
                Event::ModelCalled(m) => {
                    model_calls += 1;
                    input_tokens += m.usage.input_tokens;
                    output_tokens += m.usage.output_tokens;
                    models.insert(m.model.clone());
                }
                Event::Completed(_) => completed += 1,
                _ => {}
            }
        }
    }
    assert_eq!(completed, 5);
    assert!(model_calls >= 10, "{model_calls}");

    let m = metrics(w.port);
    let count = |name: &str, with: &[(&str, &str)]| sum(&m, name, with);
    assert_eq!(
        count(
            "skein_step_duration_seconds_count",
            &[("kind", "call_model")]
        ),
        model_calls as f64,
        "a call_model step per ModelCalled"
    );
    assert_eq!(
        count("skein_step_duration_seconds_count", &[("kind", "complete")]),
        completed as f64
    );
    assert_eq!(
        count(
            "skein_model_call_duration_seconds_count",
            &[("outcome", "ok")]
        ),
        model_calls as f64
    );
    for model in &models {
        assert!(
            count(
                "skein_model_call_duration_seconds_count",
                &[("model", model)]
            ) > 0.0,
            "no latency for {model}"
        );
    }
    assert_eq!(
        count("skein_model_tokens_total", &[("direction", "input")]),
        input_tokens as f64
    );
    assert_eq!(
        count("skein_model_tokens_total", &[("direction", "output")]),
        output_tokens as f64
    );
    let claimed = count("skein_jobs_claimed_total", &[("pool", "default")]);
    let acked = count("skein_jobs_acked_total", &[("pool", "default")]);
    assert!(claimed >= sessions.len() as f64, "claimed {claimed}");
    assert!(
        acked >= sessions.len() as f64 && acked <= claimed,
        "acked {acked} of {claimed}"
    );
    assert_eq!(count("skein_intake_accepted_total", &[]), 1.0);
    assert_eq!(
        count(
            "skein_intake_rejected_total",
            &[("reason", "unknown_agent")]
        ),
        1.0
    );
    assert_eq!(
        count("skein_sessions_in_flight", &[("pool", "default")]),
        0.0
    );
    assert!(has(&m, "skein_queue_depth"), "queue depth per pool");
    assert_eq!(count("skein_queue_depth", &[("pool", "default")]), 0.0);
    assert_eq!(count("skein_ready", &[]), 1.0);
    assert_eq!(count("skein_nats_reconnects_total", &[]), 0.0);

    // NATS goes away: not ready, and the worker says why, at warn level.
    server.kill9();
    let body = wait_status(w.port, "/readyz", 503, Duration::from_secs(10));
    assert!(body.contains("NATS"), "{body}");
    assert_eq!(
        http_get(w.port, "/healthz").map(|r| r.0),
        Some(200),
        "alive all the same"
    );
    std::thread::sleep(Duration::from_secs(3));
    let logged = w.logged();
    assert!(
        logged.contains("WARN") && logged.contains("lost the connection to NATS"),
        "{logged}"
    );
    assert!(
        logged.contains("cannot reach NATS; trying again"),
        "{logged}"
    );
    assert_eq!(sum(&metrics(w.port), "skein_ready", &[]), 0.0);

    // Back: ready again, and the reconnect counted.
    server.restart();
    wait_status(w.port, "/readyz", 200, Duration::from_secs(30));
    let m = metrics(w.port);
    assert!(sum(&m, "skein_nats_reconnects_total", &[]) >= 1.0);
    assert!(w.logged().contains("connected to NATS again"));
}

/// SIGTERM while a 10 s model call is in flight: the worker abandons the call, hands its
/// job back and exits long before the call would have ended; the other worker takes the
/// job within moments (the lease is a minute) and completes the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_a_model_call_in_flight_to_another_worker_at_once() {
    let sb = Sandbox::new();
    sb.agent(
        "slow",
        "",
        "turns:\n  - answer: \"done after a long think\"\n    latency_ms: 10000\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let env = [("SKEIN__RUNTIME__LEASE", "60s")];
    let a = Worker::start(
        &url,
        "worker-a",
        &sb.config(),
        &env,
        &["--drain-timeout", "20s"],
    );
    let id = format!("drain-{}", common::cluster::tag());
    let out = submit(
        &url,
        &sb.config(),
        &["--agent", "slow", "--id", &id, "think"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Worker A holds the job and is in its model call.
    let deadline = Instant::now() + Duration::from_secs(15);
    while sum(
        &metrics(a.port),
        "skein_sessions_in_flight",
        &[("pool", "default")],
    ) < 1.0
    {
        assert!(Instant::now() < deadline, "worker A never took the job");
        std::thread::sleep(Duration::from_millis(100));
    }
    let b = Worker::start(&url, "worker-b", &sb.config(), &env, &[]);

    let mut a = a;
    let term = Instant::now();
    a.signal("-TERM");
    let status = loop {
        if let Some(s) = a.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            term.elapsed() < Duration::from_secs(20),
            "worker A did not exit within its drain timeout"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let exited = term.elapsed();
    assert!(
        status.success(),
        "a drained worker exits 0: {status}\n{}",
        a.logged()
    );
    assert!(
        exited < Duration::from_secs(5),
        "worker A waited for its model call ({exited:?}) instead of handing it back"
    );
    assert!(
        a.logged().contains("model calls in flight are handed back"),
        "{}",
        a.logged()
    );

    // Worker B has it at once: a redelivery, long before the 60 s lease (the bound leaves
    // room for a loaded machine and still tells a hand-back from a lease that ran out).
    while sum(
        &metrics(b.port),
        "skein_jobs_redelivered_total",
        &[("pool", "default")],
    ) < 1.0
    {
        assert!(
            term.elapsed() < Duration::from_secs(20),
            "worker B did not get the job within 20 s of the SIGTERM (the lease is 60 s)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = store(&url, 1).await;
    let backend = st.backend();
    let root = SessionId::root(&id).unwrap();
    loop {
        let last = backend.log.last(&root).await.unwrap();
        if last.as_ref().is_some_and(|r| r.env.body.is_terminal()) {
            break;
        }
        assert!(
            term.elapsed() < Duration::from_secs(16),
            "the session did not complete on worker B within its 10 s call and a moment"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let records = backend.log.read(&root, 1).await.unwrap();
    let calls: Vec<&str> = records
        .iter()
        .filter_map(|r| match &r.env.body {
            Event::ModelCalled(m) => Some(m.worker.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        calls,
        ["worker-b"],
        "the abandoned call left nothing in the log"
    );
    assert!(matches!(
        records.last().unwrap().env.body,
        Event::Completed(_)
    ));
    drop(b);
}

/// The sessions' traceparents: (trace id, span id) of each, root first.
async fn traces(url: &str, root: &SessionId) -> Vec<(u128, u64)> {
    let st = store(url, 1).await;
    let b = st.backend();
    let mut out = vec![];
    for s in b.log.tree(root).await.unwrap() {
        let first = b.log.read(&s, 1).await.unwrap();
        let Event::Submitted(sub) = &first[0].env.body else {
            panic!("{s}: first is not Submitted")
        };
        let tp = sub
            .trace
            .as_deref()
            .unwrap_or_else(|| panic!("{s}: no trace"));
        let (t, span, _) = skein_runtime::trace::parse(tp).unwrap_or_else(|| panic!("{s}: {tp}"));
        out.push((t, span));
    }
    out
}

/// A submission's traceparent — a `traceparent` header, or a field of the payload —
/// continues the caller's trace: the root records it, and every other session of the tree
/// records the caller's trace id with a span id of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submissions_traceparent_is_continued_with_a_span_per_session() {
    const TRACE: u128 = 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736;
    const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let server = NatsServer::start();
    let url = server.url();
    let _w = Worker::start(&url, "trace-1", &demo_config(), &[], &[]);
    let by_header = SessionId::root(&format!("tp-h-{}", common::cluster::tag())).unwrap();
    let out = submit(
        &url,
        &demo_config(),
        &[
            "--id",
            by_header.as_str(),
            "--no-cache",
            "--traceparent",
            CALLER,
            "--wait",
            "Brief on tracing",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_payload = SessionId::root(&format!("tp-p-{}", common::cluster::tag())).unwrap();
    let payload = serde_json::json!({"agent": "orchestrator", "mission": "Brief on spans",
        "id": by_payload.as_str(), "no_cache": true, "traceparent": CALLER});
    common::cluster::raw_publish(
        &url,
        "skein.missions.submit",
        &[payload.to_string().into_bytes()],
    );
    common::cluster::wait_all(
        &url,
        1,
        std::slice::from_ref(&by_payload),
        Duration::from_secs(60),
    )
    .await;
    for root in [&by_header, &by_payload] {
        let spans = traces(&url, root).await;
        assert_eq!(spans.len(), 5, "{root}");
        assert_eq!(
            spans[0],
            (TRACE, 0x00f0_67aa_0ba9_02b7),
            "{root}: the caller's context"
        );
        let mut ids = std::collections::BTreeSet::new();
        for (t, s) in &spans[1..] {
            assert_eq!(*t, TRACE, "{root}: a session left the caller's trace");
            assert_ne!(
                *s, 0x00f0_67aa_0ba9_02b7,
                "{root}: the caller's own span id"
            );
            assert!(ids.insert(*s), "{root}: two sessions share span {s:016x}");
        }
    }
    let bad = submit(
        &url,
        &demo_config(),
        &["--traceparent", "not-a-traceparent", "x"],
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a W3C traceparent"));
}

/// A read command against an address where no NATS server listens fails, saying so,
/// instead of waiting for ever.
#[test]
fn read_commands_give_up_on_an_unreachable_server() {
    let port = free_port();
    let started = Instant::now();
    let mut child = Command::new(bin())
        .args(["--nats", &format!("nats://127.0.0.1:{port}"), "sessions"])
        .env("SKEIN_LOG", "warn")
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("`skein sessions` still waits for an unreachable server after 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let took = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(
        err.contains(&format!("cannot reach NATS at nats://127.0.0.1:{port}"))
            && err.contains("within 10s"),
        "{err}"
    );
}

/// A server that runs without JetStream: a command says so, with the flag that enables
/// it, at its connect limit (not after the longer wait given to a cluster whose JetStream
/// is electing leaders).
#[test]
fn a_command_against_a_server_without_jetstream_says_so() {
    let port = free_port();
    let mut server = Command::new(skein_testnats::nats_server_bin())
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server starts");
    let up = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "nats-server did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = Command::new(bin())
        .args(["--nats", &format!("nats://127.0.0.1:{port}"), "sessions"])
        .env("SKEIN_LOG", "warn")
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .stdin(Stdio::null())
        .output()
        .expect("skein runs");
    let _ = server.kill();
    let _ = server.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("runs without JetStream: start it with -js") && err.contains("within 10s"),
        "{err}"
    );
    assert!(!err.contains("waiting up to"), "{err}");
}

/// `SKEIN_LOG_FORMAT=json`: every diagnostic line is one JSON object; text diagnostics
/// written to a pipe carry no colour codes.
#[test]
fn logs_are_json_lines_or_plain_text_off_a_terminal() {
    let sb = Sandbox::new();
    sb.agent("solo", "", "turns:\n  - answer: \"hello\"\n");
    let run = |format: &str| {
        let out = skein(&sb.config(), &sb.data())
            .args([
                "run",
                "--agent",
                "solo",
                "--json",
                "--no-cache",
                "say hello",
            ])
            .env("SKEIN_LOG", "skein_runtime=debug")
            .env("SKEIN_LOG_FORMAT", format)
            .env_remove("NO_COLOR")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stderr).unwrap()
    };
    let json = run("json");
    let lines: Vec<&str> = json.lines().filter(|l| !l.is_empty()).collect();
    assert!(lines.len() >= 2, "{json}");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"));
        assert_eq!(v["level"], "DEBUG", "{l}");
        assert!(
            v["target"].as_str().unwrap().starts_with("skein_runtime"),
            "{l}"
        );
        assert!(v["fields"]["message"].is_string(), "{l}");
    }
    let text = run("text");
    assert!(text.contains("DEBUG") && text.contains("step"), "{text}");
    assert!(!text.contains('\u{1b}'), "colour codes in a pipe: {text:?}");

    let bad = skein(&sb.config(), &sb.data())
        .args(["sessions"])
        .env("SKEIN_LOG_FORMAT", "yaml")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("yaml"));
}

/// `skein cancel` on the embedded store: a tree paused for a person is cancelled, its
/// question leaves the inbox and its token no longer answers, a second cancel has nothing
/// to do, and an unknown id is an error naming it.
#[test]
fn cancel_works_on_the_embedded_store() {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args:\n          questions: [{key: who, question: \"Who?\"}]\n  - answer: \"hi {{ results[0].answers.who }}\"\n",
    );
    let out = skein(&sb.config(), &sb.data())
        .args(["run", "--agent", "asker", "--json", "greet"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "paused: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = json_of(&out)["session"].as_str().unwrap().to_string();

    let inbox = run_ok({
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["inbox", "--json"]);
        c
    });
    let token = json_of(&inbox)[0]["token"].as_str().unwrap().to_string();
    let out = run_ok({
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["cancel", &id, "--reason", "not needed", "--json"]);
        c
    });
    assert_eq!(json_of(&out)["cancelled"], 1);
    let status = run_ok({
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["sessions", "--json"]);
        c
    });
    let rows = json_of(&status);
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["session"] == id.as_str())
        .unwrap();
    assert_eq!(row["status"], "cancelled", "{row}");
    let inbox = run_ok({
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["inbox", "--json"]);
        c
    });
    assert_eq!(json_of(&inbox), serde_json::json!([]));
    let answer = skein(&sb.config(), &sb.data())
        .args(["answer", &token, "--set", "who=Ada"])
        .output()
        .unwrap();
    assert_eq!(
        answer.status.code(),
        Some(1),
        "a cancelled session takes no answer"
    );

    let again = run_ok({
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["cancel", &id]);
        c
    });
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to cancel"));

    let missing = skein(&sb.config(), &sb.data())
        .args(["cancel", "nosuch"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no session nosuch"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
}

type Spans = Arc<Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>>;

/// Spans an in-test OTLP/HTTP receiver got: each decoded from the protobuf body of an
/// export request, with the `service.instance.id` of the process that sent it; and every
/// request header line it was sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Spans,
    headers: Arc<Mutex<Vec<String>>>,
    port: u16,
}

impl Receiver {
    /// Plain HTTP.
    fn start() -> Self {
        Self::start_with(None)
    }

    /// HTTP over TLS with `tls`, or plain HTTP without.
    fn start_with(tls: Option<Arc<rustls::ServerConfig>>) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let r = Receiver {
            port: listener.local_addr().unwrap().port(),
            ..Receiver::default()
        };
        let rx = r.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().map_while(Result::ok) {
                let rx = rx.clone();
                let tls = tls.clone();
                std::thread::spawn(move || match tls {
                    None => serve_otlp(conn, &rx),
                    Some(cfg) => {
                        let Ok(server) = rustls::ServerConnection::new(cfg) else {
                            return;
                        };
                        serve_otlp(rustls::StreamOwned::new(server, conn), &rx)
                    }
                });
            }
        });
        r
    }

    fn spans(&self) -> Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)> {
        self.spans.lock().unwrap().clone()
    }

    fn headers(&self) -> Vec<String> {
        self.headers.lock().unwrap().clone()
    }
}

/// Answers OTLP/HTTP export requests on one connection (keep-alive) until it closes or
/// fails (a TLS handshake the client gave up on).
fn serve_otlp(conn: impl Read + Write, rx: &Receiver) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message;
    let mut r = BufReader::new(conn);
    loop {
        let mut len = 0usize;
        let mut path = String::new();
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if path.is_empty() {
                path = l.to_string();
            }
            rx.headers.lock().unwrap().push(l.to_string());
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap();
                }
                assert!(
                    !k.eq_ignore_ascii_case("content-encoding"),
                    "a compressed export: {l}"
                );
            }
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).unwrap();
        assert!(path.starts_with("POST /v1/traces "), "{path}");
        let req = ExportTraceServiceRequest::decode(body.as_slice()).expect("OTLP protobuf");
        for rs in req.resource_spans {
            let instance = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.instance.id")
                .and_then(|a| a.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    rx.spans.lock().unwrap().push((instance.clone(), s));
                }
            }
        }
        let w = r.get_mut();
        let _ = w.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n",
        );
        let _ = w.flush();
    }
}

/// A TLS configuration for 127.0.0.1 with a certificate made here, and that certificate
/// as PEM (the CA a client must be given to trust it).
fn self_signed_tls() -> (Arc<rustls::ServerConfig>, String) {
    let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![made.cert.der().clone()], key)
    .unwrap();
    (Arc::new(cfg), made.cert.pem())
}

/// Spans reach a collector behind TLS whose certificate only the CA named by
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` vouches for, with the headers of
/// `OTEL_EXPORTER_OTLP_HEADERS`; without that CA nothing is sent, and a CA file that is
/// not there stops the command with the variable named. The header's value is never
/// in the command's output.
#[test]
fn spans_go_to_a_collector_over_tls_with_the_configured_headers() {
    const AUTH: &str = "Bearer otlp-test-token-5f2c";
    let sb = Sandbox::new();
    sb.agent(
        "solo",
        "tools: [list_dir]\n",
        "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {path: \".\"}\n  - answer: \"seen\"\n",
    );
    let (tls, ca) = self_signed_tls();
    let ca_file = sb.dir.path().join("collector-ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let rx = Receiver::start_with(Some(tls));
    let run = |ca: Option<&Path>| {
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["run", "--agent", "solo", "--json", "look"])
            .env(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("https://127.0.0.1:{}", rx.port),
            )
            .env(
                "OTEL_EXPORTER_OTLP_HEADERS",
                format!("authorization={AUTH},x-tenant=t1"),
            )
            .env("OTEL_EXPORTER_OTLP_TIMEOUT", "5000")
            .env("SKEIN_LOG", "info")
            .env_remove("OTEL_EXPORTER_OTLP_CERTIFICATE");
        if let Some(ca) = ca {
            c.env("OTEL_EXPORTER_OTLP_CERTIFICATE", ca);
        }
        c.output().unwrap()
    };

    // Not trusted without the CA: the run completes, and no span arrives.
    let out = run(None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rx.spans().is_empty(), "sent without trusting the collector");

    // With it: the run's spans arrive, sent with the headers. The process sends what it
    // buffered before it exits.
    let out = run(Some(&ca_file));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spans = rx.spans();
    assert!(
        spans.iter().any(|(_, s)| s.name.contains("solo")),
        "{:?}",
        spans.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()
    );
    let headers = rx.headers();
    assert!(
        headers
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&format!("authorization: {AUTH}"))),
        "{headers:?}"
    );
    assert!(
        headers
            .iter()
            .any(|h| h.eq_ignore_ascii_case("x-tenant: t1")),
        "{headers:?}"
    );
    for o in [&out.stdout, &out.stderr] {
        assert!(
            !String::from_utf8_lossy(o).contains("otlp-test-token"),
            "leaked"
        );
    }

    // A CA file that is not there is named, before anything runs.
    let out = run(Some(&sb.dir.path().join("missing.pem")));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("OTEL_EXPORTER_OTLP_CERTIFICATE") && err.contains("missing.pem"),
        "{err}"
    );
}

fn attr(s: &opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let v = s
        .attributes
        .iter()
        .find(|a| a.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match v {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

/// The acceptance run of tracing: two workers (one per pool, so both take part) export
/// to an in-test OTLP receiver; a tree submitted with a traceparent yields one trace —
/// the caller's — with a span per session, model call, tool call and delegation, from
/// both workers, each linked to the right parent; and the jobs, notices and result the
/// tree published carry its trace context in a `traceparent` header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_is_one_trace_across_workers() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const CALLER_SPAN: &str = "00f067aa0ba902b7";
    let caller = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "pool: front\nagents: [helper]\n",
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        repeat: 2\n        args: {agent: helper, mission: \"look {{ i }}\"}\n  - answer: \"{{ results | length }} looked\"\n",
    )
    .agent(
        "helper",
        "pool: back\ntools: [list_dir]\n",
        "turns:\n  - tool_calls:\n      - tool: list_dir\n        args: {path: \".\"}\n  - answer: \"seen\"\n",
    );
    let rx = Receiver::start();
    let server = NatsServer::start();
    let url = server.url();
    let endpoint = format!("http://127.0.0.1:{}", rx.port);
    let otel = |who: &str| {
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
            ("OTEL_SERVICE_NAME", "skein-worker".to_string()),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                format!("service.instance.id={who}"),
            ),
        ]
    };
    let env_a = otel("worker-a");
    let env_b = otel("worker-b");
    let ea: Vec<(&str, &str)> = env_a.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let eb: Vec<(&str, &str)> = env_b.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let _a = Worker::start(&url, "worker-a", &sb.config(), &ea, &["--pools", "front"]);
    let _b = Worker::start(&url, "worker-b", &sb.config(), &eb, &["--pools", "back"]);

    // Everything the tree publishes, with headers.
    let client = async_nats::connect(&url).await.unwrap();
    let mut published = futures::stream::select_all([
        client.subscribe("skein.jobs.>").await.unwrap(),
        client.subscribe("skein.notices.>").await.unwrap(),
        client.subscribe("skein.results.>").await.unwrap(),
    ]);
    client.flush().await.unwrap();

    let id = format!("otel-{}", common::cluster::tag());
    let out = submit(
        &url,
        &sb.config(),
        &[
            "--agent",
            "boss",
            "--id",
            &id,
            "--traceparent",
            &caller,
            "--wait",
            "look around",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The logs: the sessions and their model calls.
    let st = store(&url, 1).await;
    let b = st.backend();
    let root = SessionId::root(&id).unwrap();
    let sessions = b.log.tree(&root).await.unwrap();
    assert_eq!(sessions.len(), 3);
    let mut model_calls = 0;
    for s in &sessions {
        model_calls += b
            .log
            .read(s, 1)
            .await
            .unwrap()
            .iter()
            .filter(|r| matches!(r.env.body, Event::ModelCalled(_)))
            .count();
    }
    assert_eq!(model_calls, 6);

    // Wait for the spans: 3 sessions, 6 model calls, 2 tool calls, 2 delegations.
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = rx.spans();
        if spans.len() >= 13 {
            std::thread::sleep(Duration::from_millis(500));
            break rx.spans();
        }
        assert!(
            Instant::now() < deadline,
            "only {} spans arrived",
            spans.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(
        spans.len(),
        13,
        "{:#?}",
        spans.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()
    );
    let mut ids = std::collections::BTreeSet::new();
    for (_, s) in &spans {
        assert_eq!(
            hex(&s.trace_id),
            TRACE,
            "{} left the caller's trace",
            s.name
        );
        assert!(
            ids.insert(hex(&s.span_id)),
            "span id {} twice",
            hex(&s.span_id)
        );
    }
    // Session spans, by session, with the worker that ended each.
    let session_span = |sid: &SessionId| {
        spans
            .iter()
            .find(|(_, s)| {
                s.name.starts_with("invoke_agent ")
                    && attr(s, "skein.session").as_deref() == Some(sid.as_str())
            })
            .unwrap_or_else(|| panic!("no span for session {sid}"))
    };
    let (who, root_span) = session_span(&root);
    assert_eq!(who, "worker-a");
    assert_eq!(
        hex(&root_span.parent_span_id),
        CALLER_SPAN,
        "the root continues the caller"
    );
    assert_eq!(
        attr(root_span, "gen_ai.agent.name").as_deref(),
        Some("boss")
    );
    let root_id = hex(&root_span.span_id);
    for child in sessions.iter().filter(|s| **s != root) {
        let (who, span) = session_span(child);
        assert_eq!(who, "worker-b", "{child}");
        assert_eq!(
            hex(&span.parent_span_id),
            root_id,
            "{child}: parent is the root's span"
        );
    }
    let span_of = |sid: &str| {
        sessions
            .iter()
            .find(|s| s.as_str() == sid)
            .map(|s| hex(&session_span(s).1.span_id))
            .unwrap_or_else(|| panic!("unknown session {sid}"))
    };
    let named = |prefix: &str| -> Vec<&(String, opentelemetry_proto::tonic::trace::v1::Span)> {
        spans
            .iter()
            .filter(|(_, s)| s.name.starts_with(prefix))
            .collect()
    };
    let chats = named("chat ");
    assert_eq!(chats.len(), model_calls);
    for (who, s) in &chats {
        let sid = attr(s, "skein.session").unwrap();
        assert_eq!(hex(&s.parent_span_id), span_of(&sid), "{}", s.name);
        assert_eq!(attr(s, "gen_ai.operation.name").as_deref(), Some("chat"));
        assert_eq!(attr(s, "gen_ai.provider.name").as_deref(), Some("scripted"));
        let model = attr(s, "gen_ai.request.model").unwrap();
        assert_eq!(
            who,
            if model == "boss" {
                "worker-a"
            } else {
                "worker-b"
            }
        );
        assert!(
            attr(s, "gen_ai.usage.input_tokens")
                .unwrap()
                .parse::<i64>()
                .unwrap()
                > 0
        );
        assert!(attr(s, "gen_ai.usage.output_tokens").is_some());
        assert!(attr(s, "skein.cost_usd").is_some());
        assert!(s.end_time_unix_nano >= s.start_time_unix_nano);
    }
    let tools = named("execute_tool ");
    assert_eq!(tools.len(), 2);
    for (who, s) in &tools {
        assert_eq!(who, "worker-b");
        assert_eq!(attr(s, "gen_ai.tool.name").as_deref(), Some("list_dir"));
        assert_eq!(
            hex(&s.parent_span_id),
            span_of(&attr(s, "skein.session").unwrap())
        );
    }
    let delegations = named("delegate ");
    assert_eq!(delegations.len(), 2);
    for (who, s) in &delegations {
        assert_eq!(who, "worker-a");
        assert_eq!(hex(&s.parent_span_id), root_id);
        let child = attr(s, "skein.child").unwrap();
        assert_eq!(s.links.len(), 1);
        assert_eq!(
            hex(&s.links[0].span_id),
            span_of(&child),
            "links to the child's span"
        );
    }

    // Jobs, notices and the result carry the trace context.
    let mut seen = BTreeMap::new();
    while let Ok(Some(m)) = tokio::time::timeout(
        Duration::from_millis(300),
        futures::StreamExt::next(&mut published),
    )
    .await
    {
        let kind = m
            .subject
            .as_str()
            .split('.')
            .nth(1)
            .unwrap_or("")
            .to_string();
        let tp = m
            .headers
            .as_ref()
            .and_then(|h| h.get("traceparent"))
            .map(|v| v.as_str().to_string())
            .unwrap_or_else(|| panic!("{} published without a traceparent", m.subject));
        let (t, _, _) = skein_runtime::trace::parse(&tp).unwrap();
        assert_eq!(format!("{t:032x}"), TRACE, "{}", m.subject);
        *seen.entry(kind).or_insert(0) += 1;
    }
    for kind in ["jobs", "notices", "results"] {
        assert!(
            seen.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} seen: {seen:?}"
        );
    }
}

/// Retention on NATS: `skein gc --nats` archives a finished tree to files and removes it
/// (a dry run first lists it and removes nothing); then a worker with
/// `nats.retain_finished` removes the next finished tree by itself, archives it in the
/// object store, and counts what it removed in /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_on_nats_archives_removes_and_counts_finished_trees() {
    let server = NatsServer::start();
    let url = server.url();
    let tmp = tempfile::tempdir().unwrap();
    let gc = |args: &[&str]| {
        let out = Command::new(bin())
            .arg("--config")
            .arg(demo_config())
            .args(["--nats", &url, "gc", "--older-than", "0s", "--json"])
            .args(args)
            .env("SKEIN_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let run_tree = |id: &str| {
        let out = submit(
            &url,
            &demo_config(),
            &[
                "--id",
                id,
                "--no-cache",
                "--wait",
                "Brief on event sourcing",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        SessionId::root(id).unwrap()
    };
    let st = store(&url, 1).await;
    let b = st.backend();
    let listed = |b: skein_runtime::ports::Backend| async move {
        let f = skein_runtime::ports::roots::RootFilter::default();
        let page = b.log.roots_page(&f, 100, None).await.unwrap();
        page.roots.into_iter().map(|s| s.root).collect::<Vec<_>>()
    };

    let first = {
        let _w = Worker::start(&url, "gc-1", &demo_config(), &[], &[]);
        run_tree(&format!("gc-{}", common::cluster::tag()))
    };
    let dry = gc(&["--dry-run"]);
    assert_eq!(
        dry["removable"],
        serde_json::json!([first.as_str()]),
        "{dry}"
    );
    assert_eq!(
        b.log.tree(&first).await.unwrap().len(),
        5,
        "nothing removed"
    );
    let dir = tmp.path().join("archive");
    let out = gc(&["--archive", dir.to_str().unwrap()]);
    assert_eq!(out["removed"]["trees"], 1, "{out}");
    assert_eq!(out["removed"]["sessions"], 5, "{out}");
    let export = std::fs::read(dir.join(format!("{}.jsonl", first.as_str()))).unwrap();
    let check = skein_runtime::audit::verify(&mut export.as_slice()).unwrap();
    assert!(check.findings.is_empty(), "{:?}", check.findings);
    assert!(b.log.tree(&first).await.unwrap().is_empty());
    assert!(!listed(b.clone()).await.contains(&first.to_string()));

    let w = Worker::start(
        &url,
        "gc-2",
        &demo_config(),
        &[
            ("SKEIN__NATS__RETAIN_FINISHED", "1s"),
            ("SKEIN__NATS__RETENTION_EVERY", "1s"),
        ],
        &[],
    );
    let second = run_tree(&format!("gc-{}", common::cluster::tag()));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = metrics(w.port);
        if sum(&m, "skein_gc_removed_trees_total", &[]) >= 1.0 {
            assert_eq!(sum(&m, "skein_gc_removed_trees_total", &[]), 1.0);
            assert_eq!(sum(&m, "skein_gc_removed_sessions_total", &[]), 5.0);
            assert!(sum(&m, "skein_gc_removed_bytes_total", &[]) > 0.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker removed nothing: {}",
            w.logged()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(b.log.tree(&second).await.unwrap().is_empty());
    assert!(!listed(b.clone()).await.contains(&second.to_string()));
    let archived = st
        .archive_get(&format!("{}.jsonl", second.as_str()))
        .await
        .unwrap()
        .expect("archived in skein_archive");
    let check = skein_runtime::audit::verify(&mut archived.as_slice()).unwrap();
    assert!(check.findings.is_empty(), "{:?}", check.findings);
}
