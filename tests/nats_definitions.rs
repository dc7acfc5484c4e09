//! Definitions pushed to a running cluster, with real worker processes on a real
//! nats-server: the workers have none of the agents in their own files, serve the version
//! the cluster holds without a restart, and run every tree to its end on the version it
//! was submitted under, across a push made while trees run and a rollback.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::cluster::raw_publish;
use common::*;
use serde_json::Value;
use skein_core::{AgentDef, AgentSet, Event, Limits, SessionId};
use skein_testnats::NatsServer;

const SECRET: &str = "definitions-secret-not-for-production";

/// `boss` thinks for a while (long enough for a push to land meanwhile), then starts
/// `helper`; each says which version it is.
fn version(name: &str) -> Sandbox {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        &format!("description: boss of {name}\nagents: [helper]\ncache: false\n"),
        &format!(
            "turns:\n  - latency_ms: 4000\n    tool_calls:\n      - tool: call_agent\n        \
             args: {{agent: helper, mission: \"help with {{{{ mission }}}}\"}}\n  \
             - answer: \"boss {name} done\"\n"
        ),
    )
    .agent(
        "helper",
        "cache: false\n",
        &format!("turns:\n  - answer: \"helper {name}: {{{{ mission }}}}\"\n"),
    );
    sb
}

fn worker(sb: &Sandbox, url: &str, name: &str) -> Child {
    worker_with(sb, url, name, &[], false).0
}

/// A worker with `env` set, serving /readyz and /metrics on a port of its own when `http`
/// (its address returned).
fn worker_with(
    sb: &Sandbox,
    url: &str,
    name: &str,
    env: &[(&str, &str)],
    http: bool,
) -> (Child, Option<String>) {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url, "worker", "--concurrency", "8"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__RUNTIME__WORKER_ID", name)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if http {
        c.args(["--http", "127.0.0.1:0"]);
    }
    let mut child = c.spawn().expect("worker starts");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    let mut addr = None;
    loop {
        line.clear();
        assert!(
            err.read_line(&mut line).expect("worker stderr") > 0,
            "worker {name} exited before it was ready"
        );
        if let Some(rest) = line.split("health and metrics on http://").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_string);
        }
        if line.contains("ready") && !line.contains("health and metrics") {
            break;
        }
    }
    let tag = name.to_string();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if std::env::var_os("SKEIN_E2E_VERBOSE").is_some() {
                eprintln!("[{tag}] {l}");
            }
        }
    });
    (child, addr)
}

/// The body of `GET path` on a worker's listener.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("listener");
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Stops a worker as its supervisor would (SIGTERM: it drains and says it stops).
fn stop(c: &mut Child) {
    std::process::Command::new("kill")
        .args(["-TERM", &c.id().to_string()])
        .status()
        .unwrap();
    let _ = c.wait();
}

fn cli(sb: &Sandbox, url: &str, args: &[&str]) -> std::process::Output {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url])
        .args(args)
        .env("SKEIN_TOKEN_SECRET", SECRET);
    c.output().expect("skein runs")
}

fn cli_json(sb: &Sandbox, url: &str, args: &[&str]) -> Value {
    let out = cli(sb, url, args);
    assert!(
        out.status.success(),
        "skein {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    json_of(&out)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn submit(url: &str, tag: &str, n: usize) -> Vec<SessionId> {
    let ids: Vec<SessionId> = (0..n)
        .map(|i| SessionId::root(&format!("{tag}-{i}")).expect("id"))
        .collect();
    let payloads: Vec<Vec<u8>> = ids
        .iter()
        .map(|id| {
            serde_json::json!({"agent": "boss", "mission": format!("task {id}"), "id": id.to_string()})
                .to_string()
                .into_bytes()
        })
        .collect();
    raw_publish(url, "skein.missions.submit", &payloads);
    ids
}

/// Waits until every root of `ids` exists (intake pinned it), or fails after a minute.
async fn until_submitted(b: &skein_runtime::Backend, ids: &[SessionId]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    for id in ids {
        while b.log.last(id).await.ok().flatten().is_none() {
            assert!(Instant::now() < deadline, "{id} was never accepted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The digest of each agent's definition in a sandbox's files.
fn def_digests(sb: &Sandbox) -> BTreeMap<String, String> {
    ["boss", "helper"]
        .iter()
        .map(|a| {
            let p = sb.dir.path().join(format!("agents/{a}.md"));
            let d = AgentDef::parse(a, &std::fs::read_to_string(p).expect("agent file"))
                .expect("definition");
            (a.to_string(), d.digest)
        })
        .collect()
}

#[test]
fn trees_run_to_their_end_on_the_version_they_were_submitted_under() {
    let server = NatsServer::start();
    let url = server.url();
    let (v1, v2) = (version("v1"), version("v2"));
    // The workers' own files hold an agent of another name only.
    let own = Sandbox::new();
    own.agent("placeholder", "", "turns:\n  - answer: hi\n");

    // Refused before anything is stored: a cycle, with the agents on it named.
    let bad = Sandbox::new();
    bad.agent("a", "agents: [b]\n", "turns:\n  - answer: a\n")
        .agent("b", "agents: [a]\n", "turns:\n  - answer: b\n");
    let out = cli(&bad, &url, &["agents", "push"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refused, nothing pushed"), "{err}");
    // A script that is missing is refused too.
    let unscripted = version("v1");
    std::fs::remove_file(unscripted.dir.path().join("scripts/helper.yaml")).unwrap();
    let out = cli(&unscripted, &url, &["agents", "push"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("helper"), "{err}");
    let listed = cli_json(&v1, &url, &["agents", "list", "--json"]);
    assert_eq!(
        listed,
        serde_json::json!([]),
        "a refused push stored a version"
    );

    let d1 = cli_json(&v1, &url, &["agents", "push", "--json"])["version"]
        .as_str()
        .unwrap()
        .to_string();
    let mut workers: Vec<Child> = ["w1", "w2", "w3"]
        .iter()
        .map(|n| worker(&own, &url, n))
        .collect();

    let rt = rt();
    let store = rt.block_on(common::cluster::store(&url, 1));
    let b = store.backend();
    let mut expected: Vec<(Vec<SessionId>, &str, &Sandbox)> = vec![];

    let first = submit(&url, "first", 3);
    rt.block_on(until_submitted(&b, &first));
    // Pushed while the first trees run: their helpers are started after it.
    let pushed = cli_json(&v2, &url, &["agents", "push", "--json"]);
    let d2 = pushed["version"].as_str().unwrap().to_string();
    assert_ne!(d1, d2);
    let changes: Vec<&str> = pushed["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        changes,
        ["~ agent boss.md", "~ script boss", "~ script helper"]
    );
    let pushed_at = cli_json(&v2, &url, &["agents", "list", "--json"])
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["version"] == d2.as_str())
        .expect("the second version is listed")["at"]
        .as_u64()
        .unwrap();
    let second = submit(&url, "second", 3);
    rt.block_on(until_submitted(&b, &second));
    let back = cli_json(&v2, &url, &["agents", "rollback", "--json"]);
    assert_eq!(back["current"], d1.as_str());
    // The first version made current has nothing before it.
    let out = cli(&v2, &url, &["agents", "rollback"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("nothing to roll back to"),
        "{err}"
    );
    let third = submit(&url, "third", 3);
    expected.push((first.clone(), &d1, &v1));
    expected.push((second.clone(), &d2, &v2));
    expected.push((third, &d1, &v1));

    let all: Vec<SessionId> = expected
        .iter()
        .flat_map(|(ids, _, _)| ids.clone())
        .collect();
    rt.block_on(common::cluster::wait_all(
        &url,
        1,
        &all,
        Duration::from_secs(120),
    ));

    let none = AgentSet::default();
    let mut helpers_after_push = 0;
    for (ids, digest, files) in &expected {
        let word = if *digest == d1 { "v1" } else { "v2" };
        let digests = def_digests(files);
        for root in ids {
            let sessions = rt.block_on(b.log.tree(root)).unwrap();
            assert_eq!(sessions.len(), 2, "{root}");
            for s in &sessions {
                let recs = rt.block_on(b.log.read(s, 1)).unwrap();
                let Event::Submitted(sub) = &recs[0].env.body else {
                    panic!("{s} does not start with Submitted")
                };
                assert_eq!(
                    sub.defs.as_deref(),
                    Some(*digest),
                    "{s} ran on another version"
                );
                assert_eq!(
                    sub.def_digest, digests[&sub.agent],
                    "{s}: another definition"
                );
                let Event::Completed(c) = &recs.last().unwrap().env.body else {
                    panic!("{s} did not complete: {:?}", recs.last().unwrap().env.body)
                };
                assert!(c.answer.contains(word), "{s}: {}", c.answer);
                if sub.agent == "helper" && first.contains(root) && recs[0].env.at > pushed_at {
                    helpers_after_push += 1;
                }
            }
            // Replay checks decisions with the pinned version's agents, not the caller's.
            let verdicts = rt
                .block_on(skein_runtime::replay::verify_tree(
                    &b,
                    root,
                    &none,
                    &Limits::default(),
                ))
                .unwrap();
            for v in verdicts {
                assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
            }
        }
    }
    assert!(
        helpers_after_push > 0,
        "no helper of the first trees started after the push: the push did not land mid-run"
    );

    // What people see: the version of a tree, the versions pushed, and what changed.
    let tree = cli_json(&own, &url, &["tree", first[0].as_str(), "--json"]);
    assert_eq!(tree["summary"]["defs"], d1.as_str());
    let listed = cli_json(&own, &url, &["agents", "list", "--json"]);
    let current: Vec<&Value> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["current"] == true)
        .collect();
    assert_eq!(current.len(), 1);
    assert_eq!(current[0]["version"], d1.as_str());
    let diff = cli_json(&own, &url, &["agents", "diff", &d1[..12], &d2, "--json"]);
    assert_eq!(diff["changes"].as_array().unwrap().len(), 3, "{diff}");
    // A fork moves to the current version only when asked to.
    let fork = cli(
        &own,
        &url,
        &[
            "fork",
            second[0].as_str(),
            "--at",
            "1",
            "--new-id",
            "moved",
            "--current",
        ],
    );
    assert!(
        fork.status.success(),
        "{}",
        String::from_utf8_lossy(&fork.stderr)
    );
    let kept = cli(
        &own,
        &url,
        &["fork", second[0].as_str(), "--at", "1", "--new-id", "kept"],
    );
    assert!(
        kept.status.success(),
        "{}",
        String::from_utf8_lossy(&kept.stderr)
    );
    for (id, want) in [("moved", &d1), ("kept", &d2)] {
        let id = SessionId::root(id).unwrap();
        let recs = rt.block_on(b.log.read(&id, 1)).unwrap();
        let Event::Submitted(sub) = &recs[0].env.body else {
            panic!("{id} does not start with Submitted")
        };
        assert_eq!(sub.defs.as_deref(), Some(want.as_str()), "fork {id}");
    }
    for w in &mut workers {
        let _ = w.kill();
        let _ = w.wait();
    }
}

/// Every record of every session of `roots`, read once all are complete.
fn records(
    rt: &tokio::runtime::Runtime,
    b: &skein_runtime::Backend,
    roots: &[SessionId],
) -> Vec<(SessionId, Vec<skein_core::Record>)> {
    let mut out = vec![];
    for root in roots {
        for s in rt.block_on(b.log.tree(root)).unwrap() {
            let recs = rt.block_on(b.log.read(&s, 1)).unwrap();
            out.push((s, recs));
        }
    }
    out
}

#[test]
fn a_worker_without_an_agent_or_a_tool_leaves_its_work_to_workers_that_have_it() {
    let server = NatsServer::start();
    let url = server.url();
    // No definitions pushed: each worker runs on its own files. Two have `boss` and
    // `helper`; one has neither. An agent whose provider no worker has cannot be served.
    let full = version("own");
    full.agent("stray", "", "turns:\n  - answer: never\n");
    let stray = full.dir.path().join("agents/stray.md");
    let text = std::fs::read_to_string(&stray).unwrap();
    std::fs::write(&stray, text.replace("scripted:stray", "nowhere:model")).unwrap();
    let partial = Sandbox::new();
    partial.agent("placeholder", "", "turns:\n  - answer: hi\n");
    let (mut lacking, addr) = worker_with(&partial, &url, "lacking", &[], true);
    let addr = addr.expect("the worker's listener");
    // Every agent lists `http_fetch` (unused by its script); one worker has every agent
    // but not that tool.
    for a in ["boss", "helper"] {
        let f = full.dir.path().join(format!("agents/{a}.md"));
        let text = std::fs::read_to_string(&f).unwrap();
        std::fs::write(
            &f,
            text.replacen("cache: false", "cache: false\ntools: [http_fetch]", 1),
        )
        .unwrap();
    }
    let (mut no_http, no_http_addr) = worker_with(
        &full,
        &url,
        "no-http",
        &[("SKEIN__TOOLS__HTTP__ENABLED", "false")],
        true,
    );
    let no_http_addr = no_http_addr.expect("the worker's listener");
    let mut others: Vec<Child> = ["has-1", "has-2"]
        .iter()
        .map(|n| worker(&full, &url, n))
        .collect();

    let rt = rt();
    let store = rt.block_on(common::cluster::store(&url, 1));
    let b = store.backend();
    let roots = submit(&url, "missing", 12);
    rt.block_on(common::cluster::wait_all(
        &url,
        1,
        &roots,
        Duration::from_secs(120),
    ));
    for (s, recs) in records(&rt, &b, &roots) {
        let Event::Completed(_) = &recs.last().unwrap().env.body else {
            panic!("{s} did not complete: {:?}", recs.last().unwrap().env.body)
        };
        for r in &recs {
            if let Event::ModelCalled(m) = &r.env.body {
                assert_ne!(
                    m.worker, "lacking",
                    "{s}: run by the worker without its agent"
                );
                assert_ne!(
                    m.worker, "no-http",
                    "{s}: run by the worker without its tool"
                );
            }
        }
    }
    // It said what it handed back, and why.
    let ready = http_get(&addr, "/readyz");
    assert!(ready.contains("ready"), "{ready}");
    let metrics = http_get(&addr, "/metrics");
    let lacked: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("skein_jobs_lacking_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(lacked > 0.0, "nothing handed back:\n{metrics}");
    assert!(
        ready.contains("handed back for want of the agent"),
        "{ready}"
    );
    let ready = http_get(&no_http_addr, "/readyz");
    assert!(
        ready.contains("handed back for want of the tool `http_fetch`"),
        "{ready}"
    );
    let metrics = http_get(&no_http_addr, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("skein_jobs_lacking_total{") && l.contains("tool:http_fetch")),
        "{metrics}"
    );

    // Nobody has the provider of `stray`: its tree fails after a few deliveries, saying so.
    let stray = SessionId::root("stray-0").unwrap();
    let payload = serde_json::json!({"agent": "stray", "mission": "x", "id": "stray-0"});
    raw_publish(
        &url,
        "skein.missions.submit",
        &[payload.to_string().into_bytes()],
    );
    rt.block_on(common::cluster::wait_all(
        &url,
        1,
        std::slice::from_ref(&stray),
        Duration::from_secs(60),
    ));
    let last = rt.block_on(b.log.last(&stray)).unwrap().unwrap();
    let Event::Failed(f) = &last.env.body else {
        panic!("stray ended with {:?}", last.env.body)
    };
    assert!(
        f.error.contains("no worker can serve this session")
            && f.error.contains("the model provider `nowhere`"),
        "{}",
        f.error
    );
    stop(&mut lacking);
    stop(&mut no_http);
    for w in &mut others {
        let _ = w.kill();
        let _ = w.wait();
    }
}

#[test]
fn workers_restarted_one_at_a_time_onto_a_newer_record_format_lose_no_tree() {
    // This process reads the logs as the new release does (both formats).
    skein_core::event::act_as_next_format();
    let server = NatsServer::start();
    let url = server.url();
    let (v1, v2) = (version("v1"), version("v2"));
    let own = Sandbox::new();
    own.agent("placeholder", "", "turns:\n  - answer: hi\n");
    cli_json(&v1, &url, &["agents", "push", "--json"]);
    let next = [("SKEIN_TEST_NEXT_FORMAT", "1")];
    let names = ["r1", "r2", "r3"];
    let mut workers: Vec<(Child, String)> = names
        .iter()
        .map(|n| {
            let (c, a) = worker_with(&own, &url, n, &[], true);
            (c, a.expect("listener"))
        })
        .collect();
    let rt = rt();
    let store = rt.block_on(common::cluster::store(&url, 1));
    let b = store.backend();
    let mut roots = submit(&url, "before", 4);
    let mut last_old_gone = 0;
    for (i, n) in names.iter().enumerate() {
        // One at a time: stop it, start it again as the next release.
        stop(&mut workers[i].0);
        if i == names.len() - 1 {
            last_old_gone = skein_runtime::now_ms();
        }
        let (c, a) = worker_with(&own, &url, n, &next, true);
        workers[i] = (c, a.expect("listener"));
        roots.extend(submit(&url, &format!("during-{i}"), 3));
        if i == 0 {
            // A push lands while the releases are mixed.
            cli_json(&v2, &url, &["agents", "push", "--json"]);
        }
    }
    // Every worker reads the new format now: they switch to it within one round of
    // advertisements.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !workers
        .iter()
        .all(|(_, a)| http_get(a, "/readyz").contains("record format: writes 2"))
    {
        assert!(
            Instant::now() < deadline,
            "the workers never wrote format 2"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    roots.extend(submit(&url, "after", 4));
    cli_json(&v2, &url, &["agents", "rollback", "--json"]);
    roots.extend(submit(&url, "rolled-back", 3));
    // A worker of the earlier release joins again: the others go back to the format it
    // reads, and a log it cannot read yet is left to them.
    let (mut old, _) = worker_with(&own, &url, "old-again", &[], false);
    roots.extend(submit(&url, "old-again", 4));
    rt.block_on(common::cluster::wait_all(
        &url,
        1,
        &roots,
        Duration::from_secs(180),
    ));

    let none = AgentSet::default();
    let mut newer = 0;
    for (s, recs) in records(&rt, &b, &roots) {
        let Event::Completed(_) = &recs.last().unwrap().env.body else {
            panic!("{s} did not complete: {:?}", recs.last().unwrap().env.body)
        };
        for r in &recs {
            if r.env.v == 2 {
                newer += 1;
                assert!(
                    r.env.at > last_old_gone,
                    "{s}#{}: format 2 written while a worker that cannot read it was live",
                    r.env.seq
                );
            }
        }
    }
    assert!(newer > 0, "no record of the new format was written");
    for root in &roots {
        let verdicts = rt
            .block_on(skein_runtime::replay::verify_tree(
                &b,
                root,
                &none,
                &Limits::default(),
            ))
            .unwrap();
        for v in verdicts {
            assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
        }
    }
    let _ = old.kill();
    let _ = old.wait();
    for (w, _) in &mut workers {
        let _ = w.kill();
        let _ = w.wait();
    }
}

#[test]
fn a_pushed_version_holds_its_limits_and_a_pinned_tree_keeps_them() {
    let server = NatsServer::start();
    let url = server.url();
    // The worker's own `[limits]` let `boss` start `helper`; the first version pushed
    // forbids any child (`max_depth = 0`), the second allows them again.
    let sb = version("limits");
    let strict = version("limits");
    common::configure(&strict, "[limits]\nmax_depth = 0\n");
    let d1 = cli_json(&strict, &url, &["agents", "push", "--json"])["version"]
        .as_str()
        .unwrap()
        .to_string();
    // Started after the push, it reads the current version before it takes any work.
    let own = Sandbox::new();
    own.agent("placeholder", "", "turns:\n  - answer: hi\n");
    let (mut w, addr) = worker_with(&own, &url, "w1", &[], true);
    let addr = addr.expect("the worker's listener");

    let rt = rt();
    let store = rt.block_on(common::cluster::store(&url, 1));
    let b = store.backend();
    let first = submit(&url, "strict", 1);
    rt.block_on(until_submitted(&b, &first));
    // Pushed while the first tree thinks (its call comes seconds later).
    let pushed = cli_json(&sb, &url, &["agents", "push", "--json"]);
    let d2 = pushed["version"].as_str().unwrap().to_string();
    assert_ne!(d1, d2);
    let changes: Vec<&str> = pushed["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(changes, ["~ [limits]"]);
    // The worker serves the new version once it has seen the pointer move.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http_get(&addr, "/readyz").contains(skein_core::definitions::short(&d2)) {
        assert!(
            Instant::now() < deadline,
            "the worker never took the pushed version"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let second = submit(&url, "loose", 1);
    let roots: Vec<SessionId> = first.iter().chain(&second).cloned().collect();
    rt.block_on(common::cluster::wait_all(
        &url,
        1,
        &roots,
        Duration::from_secs(60),
    ));
    for (root, digest, children) in [(&first[0], &d1, 0), (&second[0], &d2, 1)] {
        let tree = records(&rt, &b, std::slice::from_ref(root));
        let Event::Submitted(sub) = &tree[0].1[0].env.body else {
            panic!("{root}: no Submitted")
        };
        assert_eq!(sub.defs.as_deref(), Some(digest.as_str()), "{root}");
        assert!(
            matches!(tree[0].1.last().unwrap().env.body, Event::Completed(_)),
            "{root}: {:?}",
            tree[0].1.last().unwrap().env.body
        );
        assert_eq!(tree.len() - 1, children, "{root}: sessions {tree:?}");
        // Replay decides under the pinned version's limits, whatever the caller's are.
        let verdicts = rt
            .block_on(skein_runtime::replay::verify_tree(
                &b,
                root,
                &AgentSet::default(),
                &Limits::default(),
            ))
            .unwrap();
        for v in verdicts {
            assert!(v.ok, "{}: {:?} at {:?}", v.session, v.problem, v.seq);
        }
    }

    // A key in a pushed file is refused, naming the file and not the key.
    let leaky = version("leaky");
    leaky.agent(
        "helper",
        "cache: false\n",
        "turns:\n  - answer: \"use sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t\"\n",
    );
    let out = cli(&leaky, &url, &["agents", "push"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("helper") && err.contains("secret") && !err.contains("Ab3dEf6h"),
        "{err}"
    );
    let listed = cli_json(&sb, &url, &["agents", "list", "--json"]);
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    stop(&mut w);
}
