//! The cluster's front doors with real processes: connection flags against servers that
//! require credentials (and that no secret is ever printed), the `skein.api` micro
//! service, `skein watch`, and `skein sessions` on NATS.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE};
use common::*;
use serde_json::{json, Value};
use skein_core::SessionId;
use skein_testnats::{Auth, NatsServer};

const SECRET: &str = "api-suite-secret-not-for-production";
const TOKEN: &str = "tok-4f1c9a7e-never-print-me";
const USER: &str = "skein-tester";
const PASSWORD: &str = "pw-8d2b6c31-never-print-me";

/// `skein` with the sandbox's config and data, the cluster's token secret, and none of
/// the connection variables of the calling environment.
fn cmd(sb: &Sandbox) -> Command {
    let mut c = skein(&sb.config(), &sb.data());
    c.env("SKEIN_TOKEN_SECRET", SECRET);
    for v in [
        "SKEIN_NATS_USER",
        "SKEIN_NATS_PASSWORD",
        "SKEIN_NATS_TOKEN",
        "SKEIN_NATS_CREDS",
        "SKEIN_NATS_TLS_CA",
        "SKEIN_NATS_TLS_CERT",
        "SKEIN_NATS_TLS_KEY",
        "SKEIN_NATS_TLS_REQUIRED",
    ] {
        c.env_remove(v);
    }
    c
}

/// Runs a command to its end; one that is still running after `limit` is killed and the
/// test fails with what it printed (a hang is a failure, never a pass).
fn finish_within(mut c: Command, limit: Duration) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("skein starts");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = vec![];
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out.join().expect("stdout reader");
    let stderr = err.join().expect("stderr reader");
    let Some(status) = status else {
        panic!(
            "skein still running after {limit:?}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        );
    };
    Output {
        status,
        stdout,
        stderr,
    }
}

fn run(c: Command) -> Output {
    finish_within(c, Duration::from_secs(120))
}

fn text(o: &Output) -> String {
    format!(
        "status: {}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn succeeded(o: Output) -> Output {
    assert!(o.status.success(), "skein failed:\n{}", text(&o));
    o
}

/// A worker process on `url` with extra global flags, ready when it says so.
fn worker(sb: &Sandbox, url: &str, flags: &[&str], envs: &[(&str, &str)]) -> Child {
    let mut c = cmd(sb);
    c.args(["--nats", url])
        .args(flags)
        .args(["worker", "--concurrency", "8"])
        .env("SKEIN__RUNTIME__WORKER_ID", "api-worker")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    let mut child = c.spawn().expect("worker starts");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    let mut seen = String::new();
    loop {
        line.clear();
        let n = err.read_line(&mut line).expect("worker stderr");
        seen.push_str(&line);
        if n == 0 {
            let _ = child.kill();
            panic!("the worker exited before it was ready:\n{seen}");
        }
        if line.contains("ready") {
            break;
        }
    }
    std::thread::spawn(move || for _ in err.lines() {});
    child
}

fn sandbox() -> Sandbox {
    let sb = Sandbox::new();
    sb.agent("quick", "", "turns:\n  - answer: \"done: {{ mission }}\"\n")
        .agent(
            "boss",
            "agents: [helper]\n",
            r#"
latency_ms: 100
turns:
  - tool_calls:
      - tool: call_agent
        repeat: 2
        args: {agent: helper, mission: "part {{ i + 1 }} of {{ mission }}"}
  - answer: "boss has {{ results | length }} parts"
"#,
        )
        .agent(
            "helper",
            "",
            "latency_ms: 150\nturns:\n  - answer: \"helper did {{ mission }}\"\n",
        )
        .agent(
            "sleeper",
            "agents: [dozer]\n",
            r#"
turns:
  - tool_calls:
      - tool: call_agent
        args: {agent: dozer, mission: "sleep on {{ mission }}"}
  - answer: "woke up"
"#,
        )
        .agent(
            "dozer",
            "",
            // Long enough that the tree is still running when the test cancels it; the test
            // never waits for this call to end.
            "latency_ms: 120000\nturns:\n  - answer: \"slept\"\n",
        );
    sb
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The test's own connection to the store, logged in as `login` says.
async fn store(url: &str, login: Login) -> std::sync::Arc<skein_nats::NatsStore> {
    let mut cfg = skein_nats::NatsConfig {
        urls: vec![url.to_string()],
        ..skein_nats::NatsConfig::default()
    };
    match login {
        Login::Token => cfg.token = Some(TOKEN.into()),
        Login::Password => {
            cfg.user = Some(USER.into());
            cfg.password = Some(PASSWORD.into());
        }
    }
    tokio::time::timeout(
        Duration::from_secs(120),
        skein_nats::NatsStore::connect(&cfg, Duration::from_secs(30)),
    )
    .await
    .expect("the test reaches NATS in time")
    .expect("the test reaches NATS")
}

#[derive(Clone, Copy)]
enum Login {
    Token,
    Password,
}

fn assert_hidden(what: &str, out: &Output, secrets: &[&str]) {
    let all = text(out);
    for s in secrets {
        assert!(!all.contains(s), "{what} shows a secret:\n{all}");
    }
}

/// A read command against a server that requires `auth`: refused without credentials (or
/// with wrong ones) with an error naming the flags; works with the flags and with their
/// environment variables; never prints the secret, not even with debug logs or in
/// `--dump-config`.
fn read_commands_need_and_hide(auth: Auth, with: &[&str], env: &[(&str, &str)], wrong: &[&str]) {
    let server = NatsServer::start_with_auth(&auth);
    let url = server.url();
    let sb = sandbox();
    let secrets = [TOKEN, PASSWORD];
    let sessions = |extra: &[&str], env: &[(&str, &str)]| {
        let mut c = cmd(&sb);
        c.args(["sessions", "--nats", &url, "--json"]).args(extra);
        for (k, v) in env {
            c.env(k, v);
        }
        run(c)
    };

    let none = sessions(&[], &[]);
    assert!(
        !none.status.success(),
        "no credentials, yet:\n{}",
        text(&none)
    );
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(
        err.contains("requires credentials") && err.contains("--nats-token"),
        "the error should say what is missing and what to pass:\n{err}"
    );

    let bad = sessions(wrong, &[]);
    assert!(
        !bad.status.success(),
        "wrong credentials, yet:\n{}",
        text(&bad)
    );
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("refused the credentials"),
        "{}",
        text(&bad)
    );
    assert_hidden("a refused connection", &bad, &secrets);

    let flags = succeeded(sessions(with, &[]));
    assert_eq!(json_of(&flags), json!([]), "{}", text(&flags));
    let vars = succeeded(sessions(&[], env));
    assert_eq!(json_of(&vars), json!([]), "{}", text(&vars));

    // Flags after the verb work as well as before it.
    let mut c = cmd(&sb);
    c.arg("--nats")
        .arg(&url)
        .args(with)
        .args(["sessions", "--json"]);
    succeeded(run(c));

    let mut c = cmd(&sb);
    c.args(["sessions", "--nats", &url, "--json", "--log", "debug"])
        .args(with);
    let debug = succeeded(run(c));
    assert!(
        String::from_utf8_lossy(&debug.stderr).contains("DEBUG"),
        "debug logs were expected:\n{}",
        text(&debug)
    );
    assert_hidden("a run with --log debug", &debug, &secrets);

    let mut c = cmd(&sb);
    c.args(["sessions", "--nats", &url, "--log", "debug"]);
    for (k, v) in env {
        c.env(k, v);
    }
    assert_hidden(
        "a run with the variables and --log debug",
        &succeeded(run(c)),
        &secrets,
    );

    let mut c = cmd(&sb);
    c.args(["--nats", &url, "sessions", "--dump-config"])
        .args(with);
    for (k, v) in env {
        c.env(k, v);
    }
    let dump = succeeded(run(c));
    assert!(
        String::from_utf8_lossy(&dump.stdout).contains("<redacted>"),
        "{}",
        text(&dump)
    );
    assert_hidden("--dump-config", &dump, &secrets);
    assert_hidden(
        "`skein --help`",
        &{
            let mut c = cmd(&sb);
            c.arg("--help");
            for (k, v) in env {
                c.env(k, v);
            }
            succeeded(run(c))
        },
        &secrets,
    );
}

#[test]
fn a_token_server_refuses_reads_without_the_token_and_never_sees_it_printed() {
    read_commands_need_and_hide(
        Auth::Token(TOKEN.into()),
        &["--nats-token", TOKEN],
        &[("SKEIN_NATS_TOKEN", TOKEN)],
        &["--nats-token", "not-the-token"],
    );
}

#[test]
fn a_password_server_refuses_reads_without_the_password_and_never_sees_it_printed() {
    read_commands_need_and_hide(
        Auth::UserPassword {
            user: USER.into(),
            password: PASSWORD.into(),
        },
        &["--nats-user", USER, "--nats-password", PASSWORD],
        &[("SKEIN_NATS_USER", USER), ("SKEIN_NATS_PASSWORD", PASSWORD)],
        &["--nats-user", USER, "--nats-password", "not-the-password"],
    );
}

#[test]
fn urls_with_user_info_are_redacted_in_logs_dumps_and_errors() {
    let server = NatsServer::start_with_auth(&Auth::UserPassword {
        user: USER.into(),
        password: PASSWORD.into(),
    });
    let port = server.url().rsplit(':').next().expect("port").to_string();
    let url = format!("nats://{USER}:{PASSWORD}@127.0.0.1:{port}");
    let sb = sandbox();

    let mut c = cmd(&sb);
    c.args(["sessions", "--json", "--log", "debug"])
        .env("SKEIN_NATS_URL", &url);
    let out = succeeded(run(c));
    assert_eq!(json_of(&out), json!([]));
    assert_hidden("a run on a URL with a password", &out, &[PASSWORD]);

    let mut c = cmd(&sb);
    c.args(["--nats", &url, "sessions", "--dump-config"]);
    let dump = succeeded(run(c));
    let shown = format!("{USER}:***@127.0.0.1:{port}");
    assert!(
        String::from_utf8_lossy(&dump.stdout).contains(&shown),
        "{}",
        text(&dump)
    );
    assert_hidden("--dump-config", &dump, &[PASSWORD]);

    // A URL that cannot be parsed is named in the error, without its secret.
    let broken = format!("nats://{USER}:{PASSWORD}@127.0.0.1:{port}:bad");
    let mut c = cmd(&sb);
    c.args(["sessions", "--nats", &broken]);
    let out = run(c);
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{port}:bad")), "{err}");
    assert_hidden("a URL error", &out, &[PASSWORD]);

    // Wrong credentials in the URL: refused, named redacted.
    let wrong = format!("nats://{USER}:wrong-{PASSWORD}@127.0.0.1:{port}");
    let mut c = cmd(&sb);
    c.args(["sessions", "--nats", &wrong]);
    let out = run(c);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused the credentials"),
        "{}",
        text(&out)
    );
    assert_hidden("a refused URL", &out, &[PASSWORD]);
}

/// A request to `skein.api.<endpoint>`: the reply body and, for a service error, its code
/// and text.
async fn api(
    client: &async_nats::Client,
    endpoint: &str,
    body: Value,
) -> (Value, Option<(u16, String)>) {
    api_raw(client, endpoint, body.to_string().into_bytes()).await
}

async fn api_raw(
    client: &async_nats::Client,
    endpoint: &str,
    body: Vec<u8>,
) -> (Value, Option<(u16, String)>) {
    let m = tokio::time::timeout(
        Duration::from_secs(30),
        client.request(format!("skein.api.{endpoint}"), body.into()),
    )
    .await
    .unwrap_or_else(|_| panic!("no reply from skein.api.{endpoint}"))
    .unwrap_or_else(|e| panic!("skein.api.{endpoint}: {e}"));
    let err = m.headers.as_ref().and_then(|h| {
        let code = h.get(NATS_SERVICE_ERROR_CODE)?.as_str().parse().ok()?;
        let text = h
            .get(NATS_SERVICE_ERROR)
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        Some((code, text))
    });
    let v = if err.is_some() {
        Value::Null
    } else {
        serde_json::from_slice(&m.payload).unwrap_or_else(|e| {
            panic!(
                "skein.api.{endpoint} replied with no JSON ({e}): {}",
                String::from_utf8_lossy(&m.payload)
            )
        })
    };
    (v, err)
}

async fn wait_for_status(client: &async_nats::Client, id: &str, want: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (v, err) = api(client, "status", json!({"session": id})).await;
        assert!(err.is_none(), "status of {id}: {err:?}");
        if v["status"] == want {
            return v;
        }
        assert!(Instant::now() < deadline, "{id} never became {want}: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn the_api_service_is_discoverable_submits_reports_cancels_and_codes_its_errors() {
    // The worker and this client log in: the service runs behind credentials as well.
    let server = NatsServer::start_with_auth(&Auth::UserPassword {
        user: USER.into(),
        password: PASSWORD.into(),
    });
    let url = server.url();
    let sb = sandbox();
    let _workers = Workers(vec![worker(
        &sb,
        &url,
        &["--nats-user", USER],
        &[("SKEIN_NATS_PASSWORD", PASSWORD)],
    )]);
    let rt = rt();
    rt.block_on(async {
        let client =
            async_nats::ConnectOptions::with_user_and_password(USER.into(), PASSWORD.into())
                .connect(url.as_str())
                .await
                .expect("the test client connects");

        // Discovery: the micro service answers PING and INFO under its name.
        let ping = client
            .request("$SRV.PING.skein", "".into())
            .await
            .expect("$SRV.PING.skein");
        let ping: Value = serde_json::from_slice(&ping.payload).expect("ping JSON");
        assert_eq!(ping["name"], "skein", "{ping}");
        assert_eq!(ping["type"], "io.nats.micro.v1.ping_response", "{ping}");
        let info = client
            .request("$SRV.INFO.skein", "".into())
            .await
            .expect("$SRV.INFO.skein");
        let info: Value = serde_json::from_slice(&info.payload).expect("info JSON");
        let subjects: Vec<&str> = info["endpoints"]
            .as_array()
            .unwrap_or_else(|| panic!("no endpoints: {info}"))
            .iter()
            .filter_map(|e| e["subject"].as_str())
            .collect();
        for e in ["submit", "status", "cancel", "answer", "approve"] {
            assert!(
                subjects.contains(&format!("skein.api.{e}").as_str()),
                "{e} missing from {info}"
            );
        }

        // Submit: a session id back, and the tree runs to its end.
        let (v, err) = api(
            &client,
            "submit",
            json!({"agent": "quick", "mission": "say hi", "id": "api-quick"}),
        )
        .await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(v["session"], "api-quick", "{v}");
        let done = wait_for_status(&client, "api-quick", "completed").await;
        assert_eq!(done["answer"], "done: say hi", "{done}");
        assert_eq!(done["session"], "api-quick", "{done}");

        // The caller's mistakes: 400 with the reason, 404 for what does not exist.
        let (_, err) = api(
            &client,
            "submit",
            json!({"agent": "nobody", "mission": "x"}),
        )
        .await;
        let (code, why) = err.expect("an unknown agent is refused");
        assert_eq!(code, 400, "{why}");
        assert!(why.contains("unknown agent `nobody`"), "{why}");
        assert!(why.starts_with("refused(unknown_agent): "), "{why}");
        // A token refusal is named by why it was refused.
        let (_, err) = api(
            &client,
            "answer",
            json!({"token": "not-a-token", "answers": {"q": "a"}}),
        )
        .await;
        let (code, why) = err.expect("a token that does not open is refused");
        assert_eq!(code, 400, "{why}");
        assert!(why.starts_with("refused(token_malformed): "), "{why}");
        let (_, err) = api_raw(&client, "submit", b"{not json".to_vec()).await;
        let (code, why) = err.expect("a payload that is not JSON is refused");
        assert_eq!(code, 400, "{why}");
        assert!(why.contains("invalid request"), "{why}");
        let (_, err) = api(&client, "submit", json!({"agent": "quick"})).await;
        assert_eq!(
            err.map(|e| e.0),
            Some(400),
            "a submission without a mission"
        );
        let (_, err) = api(&client, "status", json!({"session": "never-submitted"})).await;
        let (code, why) = err.expect("an unknown session");
        assert_eq!(code, 404, "{why}");
        assert!(why.contains("never-submitted"), "{why}");
        let (_, err) = api(&client, "status", json!({"session": "Not An Id!"})).await;
        assert_eq!(err.map(|e| e.0), Some(400), "a malformed session id");
        let (_, err) = api(&client, "cancel", json!({"session": "never-submitted"})).await;
        assert_eq!(err.map(|e| e.0), Some(404), "cancelling an unknown session");

        // Cancel a running tree: the root waits on a child that is in a long model call.
        let (v, err) = api(
            &client,
            "submit",
            json!({"agent": "sleeper", "mission": "the couch", "id": "api-sleeper"}),
        )
        .await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(v["session"], "api-sleeper");
        let s = store(&url, Login::Password).await;
        let root = SessionId::parse("api-sleeper").expect("id");
        let deadline = Instant::now() + Duration::from_secs(60);
        let child = loop {
            let tree = s.backend().log.tree(&root).await.expect("tree");
            if let Some(c) = tree.iter().find(|c| **c != root) {
                break c.clone();
            }
            assert!(
                Instant::now() < deadline,
                "the child never started: {tree:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        wait_for_status(&client, "api-sleeper", "waiting").await;
        let (v, err) = api(&client, "status", json!({"session": child.as_str()})).await;
        assert!(err.is_none(), "{err:?}");
        assert!(
            v["status"] == "new" || v["status"] == "running",
            "the child should still be at work: {v}"
        );
        let (v, err) = api(
            &client,
            "cancel",
            json!({"session": "api-sleeper", "reason": "the test is over"}),
        )
        .await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(v["cancelled"], 2, "root and child: {v}");
        wait_for_status(&client, "api-sleeper", "cancelled").await;
        wait_for_status(&client, child.as_str(), "cancelled").await;
        // Cancelling what has ended changes nothing.
        let (v, err) = api(&client, "cancel", json!({"session": "api-sleeper"})).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(v["cancelled"], 0, "{v}");

        // A fault of the infrastructure is not the caller's: with the events stream gone,
        // a status read fails with a 5xx code.
        s.js.delete_stream(skein_nats::backend::EVENTS)
            .await
            .expect("delete the events stream");
        let (_, err) = api(&client, "status", json!({"session": "api-quick"})).await;
        let (code, why) = err.expect("a status read without an events stream fails");
        assert!((500..600).contains(&code), "{code}: {why}");
    });
}

/// `skein watch` event lines as (session, seq, kind); the lines of streamed model text
/// (`session │ text`) are not events.
fn watched(out: &Output) -> Vec<(String, u64, String)> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.contains(" │ "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 4, "not an event line: {l:?}");
            let seq = f[1].parse().unwrap_or_else(|_| panic!("no seq in {l:?}"));
            (f[0].to_string(), seq, f[3].to_string())
        })
        .collect()
}

/// Every event of the tree under `root`, as `skein watch` names them.
async fn tree_events(url: &str, root: &SessionId) -> Vec<(String, u64, String)> {
    let s = store(url, Login::Token).await;
    let b = s.backend();
    let mut out = vec![];
    for id in b.log.tree(root).await.expect("tree") {
        for r in b.log.read(&id, 1).await.expect("read") {
            out.push((
                r.env.session.display(),
                r.env.seq,
                r.env.body.kind().to_string(),
            ));
        }
    }
    out.sort();
    out
}

fn check_watch(out: &Output, expected: &[(String, u64, String)]) {
    assert!(out.status.success(), "watch failed:\n{}", text(out));
    let mut got = watched(out);
    let n = got.len();
    got.sort();
    got.dedup();
    assert_eq!(got.len(), n, "an event was printed twice:\n{}", text(out));
    assert_eq!(got, expected, "watch output:\n{}", text(out));
}

#[test]
fn watch_prints_every_event_of_a_tree_once_and_sessions_lists_the_roots() {
    let server = NatsServer::start_with_auth(&Auth::Token(TOKEN.into()));
    let url = server.url();
    let sb = sandbox();
    let auth = [("SKEIN_NATS_TOKEN", TOKEN)];
    let _workers = Workers(vec![worker(&sb, &url, &[], &auth)]);
    let with_token = |mut c: Command| {
        c.env("SKEIN_NATS_TOKEN", TOKEN);
        c
    };

    // Several trees, each watched from its submission on, while it runs.
    let mut roots = vec![];
    for i in 0..3 {
        let id = format!("watched-{i}");
        let mut c = with_token(cmd(&sb));
        c.args(["--nats", &url, "submit", "--agent", "boss", "--id", &id])
            .arg(format!("plan number {i}"));
        succeeded(run(c));
        let mut w = with_token(cmd(&sb));
        w.args(["watch", &id, "--nats", &url]);
        roots.push((id, std::thread::spawn(move || run(w))));
    }
    let rt = rt();
    let mut ids = vec![];
    for (id, watch) in roots {
        let out = watch.join().expect("watch thread");
        let root = SessionId::parse(&id).expect("id");
        let expected = rt.block_on(tree_events(&url, &root));
        assert_eq!(
            expected.iter().filter(|e| e.1 == 1).count(),
            3,
            "boss and two helpers: {expected:?}"
        );
        assert_eq!(
            expected
                .iter()
                .rev()
                .find(|e| e.0 == id)
                .map(|e| e.2.as_str()),
            Some("Completed"),
            "{expected:?}"
        );
        check_watch(&out, &expected);

        // On an ended tree, watch prints the history and exits.
        let mut w = with_token(cmd(&sb));
        w.args(["watch", &id, "--nats", &url]);
        check_watch(&run(w), &expected);
        ids.push(id);
    }

    // One more root through the service, then every root is listed.
    let quick = rt.block_on(async {
        let client = async_nats::ConnectOptions::with_token(TOKEN.into())
            .connect(url.as_str())
            .await
            .expect("the test client connects");
        let (v, err) = api(
            &client,
            "submit",
            json!({"agent": "quick", "mission": "listed too"}),
        )
        .await;
        assert!(err.is_none(), "{err:?}");
        let id = v["session"].as_str().expect("a session id").to_string();
        wait_for_status(&client, &id, "completed").await;
        id
    });
    ids.push(quick.clone());
    let mut c = with_token(cmd(&sb));
    c.args(["sessions", "--nats", &url, "--json"]);
    let out = succeeded(run(c));
    let rows = json_of(&out);
    let listed: Vec<&str> = rows
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {rows}"))
        .iter()
        .filter_map(|r| r["session"].as_str())
        .collect();
    let mut want: Vec<&str> = ids.iter().map(String::as_str).collect();
    let mut got = listed.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "only roots, every one: {rows}");
    for r in rows.as_array().into_iter().flatten() {
        assert_eq!(r["status"], "completed", "{r}");
        let agent = if r["session"] == quick.as_str() {
            "quick"
        } else {
            "boss"
        };
        assert_eq!(r["agent"], agent, "{r}");
    }
}
