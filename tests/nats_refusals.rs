//! What the cluster's front doors refuse, with real worker processes: a different mission
//! under a taken id (on `skein.missions.submit`, `skein.api.submit` and `skein submit`), and
//! answers or reasons over the size limit (on `skein.answers`, `skein.api.answer` and
//! `skein.api.approve`). A refusal names what was wrong and writes nothing.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::Duration;

use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE};
use common::*;
use futures::StreamExt;
use serde_json::{json, Value};
use skein_core::SessionId;
use skein_testnats::NatsServer;

const SECRET: &str = "refusals-secret-not-for-production";

fn worker(sb: &Sandbox, url: &str) -> Child {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url, "worker", "--concurrency", "8"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .env("SKEIN__RUNTIME__WORKER_ID", "refusals")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("worker starts");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            err.read_line(&mut line).expect("worker stderr") > 0,
            "the worker exited before it was ready"
        );
        if line.contains("ready") {
            break;
        }
    }
    std::thread::spawn(move || for _ in err.lines() {});
    child
}

fn cli(sb: &Sandbox, url: &str, args: &[&str]) -> std::process::Output {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url])
        .args(args)
        .env("SKEIN_TOKEN_SECRET", SECRET);
    c.output().expect("skein runs")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A request to `skein.api.<endpoint>`: the reply, or the service error's code and text.
async fn api(
    client: &async_nats::Client,
    endpoint: &str,
    body: Value,
) -> Result<Value, (u16, String)> {
    let m = tokio::time::timeout(
        Duration::from_secs(30),
        client.request(format!("skein.api.{endpoint}"), body.to_string().into()),
    )
    .await
    .unwrap_or_else(|_| panic!("no reply from skein.api.{endpoint}"))
    .unwrap_or_else(|e| panic!("skein.api.{endpoint}: {e}"));
    if let Some(h) = &m.headers {
        if let Some(code) = h.get(NATS_SERVICE_ERROR_CODE) {
            let text = h
                .get(NATS_SERVICE_ERROR)
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            return Err((code.as_str().parse().expect("a numeric code"), text));
        }
    }
    Ok(serde_json::from_slice(&m.payload).expect("a JSON reply"))
}

async fn next_json(sub: &mut async_nats::Subscriber, what: &str) -> Value {
    let m = tokio::time::timeout(Duration::from_secs(60), sub.next())
        .await
        .unwrap_or_else(|_| panic!("nothing on {what}"))
        .unwrap_or_else(|| panic!("{what} closed"));
    serde_json::from_slice(&m.payload).expect("JSON")
}

async fn wait_status(client: &async_nats::Client, id: &str, want: &str) -> Value {
    for _ in 0..600 {
        let v = api(client, "status", json!({"session": id})).await;
        if let Ok(v) = &v {
            if v["status"] == want {
                return v.clone();
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{id} never became {want}");
}

/// The seq of the last record of every session of the tree of `root`.
async fn heads(store: &std::sync::Arc<skein_nats::NatsStore>, root: &str) -> Vec<(String, u64)> {
    let b = store.backend();
    let root = SessionId::parse(root).expect("id");
    let mut out = vec![];
    for id in b.log.tree(&root).await.expect("tree") {
        let last = b.log.last(&id).await.expect("last").map(|r| r.env.seq);
        out.push((id.to_string(), last.unwrap_or(0)));
    }
    out
}

async fn connect_store(url: &str) -> std::sync::Arc<skein_nats::NatsStore> {
    let cfg = skein_nats::NatsConfig {
        urls: vec![url.to_string()],
        ..Default::default()
    };
    skein_nats::NatsStore::connect(&cfg, Duration::from_secs(30))
        .await
        .expect("the test reaches NATS")
}

#[test]
fn a_different_mission_under_a_taken_id_is_refused_everywhere_and_the_same_one_is_a_no_op() {
    let sb = Sandbox::new();
    sb.agent("quick", "", "turns:\n  - answer: \"done: {{ mission }}\"\n");
    let server = NatsServer::start();
    let url = server.url();
    let _workers = Workers(vec![worker(&sb, &url)]);
    let rt = rt();
    rt.block_on(async {
        let client = async_nats::connect(url.as_str()).await.expect("connects");
        let mut rejected = client
            .subscribe("skein.missions.rejected")
            .await
            .expect("subscribe");
        let mut results = client
            .subscribe("skein.results.dup-1")
            .await
            .expect("subscribe");
        let submit = |mission: &str| {
            json!({"agent": "quick", "mission": mission, "id": "dup-1"}).to_string()
        };
        client
            .publish("skein.missions.submit", submit("first").into())
            .await
            .expect("publish");
        let done = next_json(&mut results, "skein.results.dup-1").await;
        assert_eq!(done["answer"], "done: first", "{done}");
        let store = connect_store(&url).await;
        let before = heads(&store, "dup-1").await;

        // The same payload again: accepted, nothing new in the log, and the result is not
        // announced a second time; it stays readable from the results stream.
        let mut accepted = client
            .subscribe("skein.missions.accepted")
            .await
            .expect("subscribe");
        client
            .publish("skein.missions.submit", submit("first").into())
            .await
            .expect("publish");
        let verdict = next_json(&mut accepted, "skein.missions.accepted").await;
        assert_eq!(verdict["id"], "dup-1", "{verdict}");
        assert!(
            tokio::time::timeout(Duration::from_millis(700), results.next())
                .await
                .is_err(),
            "a resubmitted tree's result was announced again"
        );
        assert_eq!(heads(&store, "dup-1").await, before);
        let stored = store
            .last_result(&SessionId::parse("dup-1").expect("id"))
            .await
            .expect("read")
            .expect("the result is stored");
        assert_eq!(stored.result.answer.as_deref(), Some("done: first"));

        // Another mission under the id: a notice on skein.missions.rejected naming it, no
        // result, nothing written.
        client
            .publish("skein.missions.submit", submit("second").into())
            .await
            .expect("publish");
        let notice = next_json(&mut rejected, "skein.missions.rejected").await;
        assert_eq!(notice["id"], "dup-1", "{notice}");
        let reason = notice["reason"].as_str().expect("a reason");
        assert!(
            reason.contains("session id `dup-1` is already taken by a different submission")
                && reason.contains("another mission"),
            "{reason}"
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(700), results.next())
                .await
                .is_err(),
            "the old result was published for a refused submission"
        );

        // skein.api.submit: the same is answered with the session, another is a 409.
        let same = api(
            &client,
            "submit",
            json!({"agent": "quick", "mission": "first", "id": "dup-1"}),
        )
        .await
        .expect("the same submission is accepted");
        assert_eq!(same["session"], "dup-1");
        let (code, why) = api(
            &client,
            "submit",
            json!({"agent": "quick", "mission": "third", "id": "dup-1"}),
        )
        .await
        .expect_err("another mission under a taken id");
        assert_eq!(code, 409, "{why}");
        assert!(
            why.contains("`dup-1`") && why.contains("another mission"),
            "{why}"
        );
        // Another priority is another submission too; naming the same one (none is 0) is not.
        let (code, why) = api(
            &client,
            "submit",
            json!({"agent": "quick", "mission": "first", "id": "dup-1", "priority": 7}),
        )
        .await
        .expect_err("another priority under a taken id");
        assert_eq!(code, 409, "{why}");
        assert!(why.contains("priority 0, not 7"), "{why}");
        let same = api(
            &client,
            "submit",
            json!({"agent": "quick", "mission": "first", "id": "dup-1", "priority": 0}),
        )
        .await
        .expect("the same priority is the same submission");
        assert_eq!(same["session"], "dup-1");
        let status = wait_status(&client, "dup-1", "completed").await;
        assert_eq!(status["answer"], "done: first");
        // The status of a root carries its announced result, read from the stream.
        assert_eq!(status["result"]["answer"], "done: first", "{status}");
        assert_eq!(status["result"]["session"], "dup-1", "{status}");
        assert!(
            tokio::time::timeout(Duration::from_millis(500), results.next())
                .await
                .is_err(),
            "the result was announced again"
        );
        assert_eq!(heads(&store, "dup-1").await, before);
    });

    // `skein submit --wait` says so and fails.
    let out = cli(
        &sb,
        &url,
        &[
            "submit", "--agent", "quick", "--id", "dup-1", "--wait", "fourth",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("rejected") && err.contains("`dup-1`"), "{err}");
    let out = cli(
        &sb,
        &url,
        &[
            "submit", "--agent", "quick", "--id", "dup-1", "--wait", "first",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "done: first");
}

#[test]
fn answers_and_reasons_over_the_limit_are_refused_on_every_nats_entry() {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [\"which?\"]}\n  - answer: \"got {{ results[0].answers.q1 }}\"\n",
    )
    .agent(
        "scribe",
        "tools: [write_file]\n",
        "turns:\n  - tool_calls:\n      - tool: write_file\n        args: {path: a.txt, content: x}\n  - answer: \"{{ results[0] }}\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let _workers = Workers(vec![worker(&sb, &url)]);
    let rt = rt();
    rt.block_on(async {
        let client = async_nats::connect(url.as_str()).await.expect("connects");
        for (agent, id) in [("asker", "q-1"), ("scribe", "w-1")] {
            api(
                &client,
                "submit",
                json!({"agent": agent, "mission": "go", "id": id}),
            )
            .await
            .expect("submitted");
        }
        wait_status(&client, "q-1", "awaiting_input").await;
        wait_status(&client, "w-1", "awaiting_approval").await;
    });
    let inbox: Vec<Value> =
        serde_json::from_slice(&cli(&sb, &url, &["inbox", "--json"]).stdout).expect("inbox");
    let token = |s: &str| {
        inbox
            .iter()
            .find(|i| i["session"] == s)
            .and_then(|i| i["token"].as_str())
            .unwrap_or_else(|| panic!("no token for {s}: {inbox:?}"))
            .to_string()
    };
    let (question, approval) = (token("q-1"), token("w-1"));
    rt.block_on(async {
        let client = async_nats::connect(url.as_str()).await.expect("connects");
        let store = connect_store(&url).await;
        let before = (heads(&store, "q-1").await, heads(&store, "w-1").await);
        let big = "x".repeat(70_000);
        let limit = "at most 65536 bytes are accepted";

        let mut refused = client
            .subscribe("skein.answers.rejected")
            .await
            .expect("subscribe");
        client
            .publish(
                "skein.answers",
                json!({"token": question, "answers": {"q1": big}})
                    .to_string()
                    .into(),
            )
            .await
            .expect("publish");
        let r = next_json(&mut refused, "skein.answers.rejected").await;
        let why = r["reason"].as_str().expect("a reason");
        assert!(
            why.contains("the answer is 700") && why.contains(limit),
            "{why}"
        );

        let (code, why) = api(
            &client,
            "answer",
            json!({"token": question, "answers": {"q1": big}}),
        )
        .await
        .expect_err("an oversized answer");
        assert_eq!(code, 400, "{why}");
        assert!(why.contains(limit), "{why}");
        let (code, why) = api(
            &client,
            "approve",
            json!({"token": approval, "approved": false, "reason": big}),
        )
        .await
        .expect_err("an oversized reason");
        assert_eq!(code, 400, "{why}");
        assert!(
            why.contains("the reason is 70000 bytes") && why.contains(limit),
            "{why}"
        );
        assert_eq!(
            (heads(&store, "q-1").await, heads(&store, "w-1").await),
            before,
            "a refused answer wrote"
        );

        // Within the limit, both go through.
        api(
            &client,
            "answer",
            json!({"token": question, "answers": {"q1": "blue"}}),
        )
        .await
        .expect("a small answer");
        let done = wait_status(&client, "q-1", "completed").await;
        assert_eq!(done["answer"], "got blue");
        api(
            &client,
            "approve",
            json!({"token": approval, "approved": false, "reason": "no"}),
        )
        .await
        .expect("a small reason");
        wait_status(&client, "w-1", "completed").await;
    });
}

/// Runs `skein` like [`cli`], failing the test if it has not ended within `limit`.
fn cli_within(sb: &Sandbox, url: &str, args: &[&str], limit: Duration) -> std::process::Output {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url])
        .args(args)
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("skein runs");
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "`skein {}` did not end within {limit:?}; it printed {} / {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

/// `skein submit` says what the intake decided before it says anything else: a refused
/// submission fails with the reason, an accepted one prints its id, and with no worker to
/// judge it the command ends after `--verdict-timeout` saying so.
#[test]
fn submit_reports_the_intakes_verdict_before_it_prints_success() {
    let sb = Sandbox::new();
    sb.agent("quick", "", "turns:\n  - answer: \"done: {{ mission }}\"\n");
    let server = NatsServer::start();
    let url = server.url();
    let limit = Duration::from_secs(60);
    {
        let _workers = Workers(vec![worker(&sb, &url)]);
        let out = cli_within(
            &sb,
            &url,
            &["submit", "--agent", "nobody-by-this-name", "anything"],
            limit,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "a refused submission succeeded: {err}"
        );
        assert!(
            err.contains("rejected") && err.contains("nobody-by-this-name"),
            "{err}"
        );
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let out = cli_within(
            &sb,
            &url,
            &["submit", "--agent", "quick", "--id", "verdict-ok", "hello"],
            limit,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "verdict-ok");
    }
    // No worker now: nobody judges it, and the command says so instead of claiming success.
    let out = cli_within(
        &sb,
        &url,
        &[
            "submit",
            "--agent",
            "quick",
            "--verdict-timeout",
            "1s",
            "unjudged",
        ],
        limit,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("no worker judged"), "{err}");
}

/// `skein submit --wait` on a tree that pauses for a person ends with exit code 3 and
/// prints what waits, with the command that answers it, as `skein run` does.
#[test]
fn submit_wait_exits_3_with_what_waits_when_the_tree_pauses() {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args: {questions: [{key: colour, question: \"Which colour?\"}]}\n  - answer: \"got {{ results[0].answers.colour }}\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let _workers = Workers(vec![worker(&sb, &url)]);
    let limit = Duration::from_secs(60);
    let out = cli_within(
        &sb,
        &url,
        &[
            "submit", "--agent", "asker", "--id", "pauses", "--wait", "pick",
        ],
        limit,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{text} / {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("waiting for you") && text.contains("Which colour?"),
        "{text}"
    );
    assert!(text.contains("skein answer "), "{text}");
    // The same with --json: the inbox item and its token, which answers the question.
    let out = cli_within(
        &sb,
        &url,
        &[
            "submit", "--agent", "asker", "--id", "pauses", "--wait", "--json", "pick",
        ],
        limit,
    );
    assert_eq!(out.status.code(), Some(3));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["status"], "awaiting_input", "{v}");
    let token = v["waiting"][0]["token"].as_str().expect("a token");
    let out = cli_within(&sb, &url, &["answer", token, "--set", "colour=teal"], limit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli_within(
        &sb,
        &url,
        &[
            "submit", "--agent", "asker", "--id", "pauses", "--wait", "pick",
        ],
        limit,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "got teal");
}

/// `skein watch` on an id under which nothing is recorded ends with an error after a short
/// bound; with `--wait-for-start` it waits, and follows the tree once it starts.
#[test]
fn watch_on_an_unknown_id_ends_with_an_error_unless_told_to_wait() {
    let sb = Sandbox::new();
    sb.agent("quick", "", "turns:\n  - answer: \"done: {{ mission }}\"\n");
    let server = NatsServer::start();
    let url = server.url();
    let _workers = Workers(vec![worker(&sb, &url)]);
    let limit = Duration::from_secs(60);
    let out = cli_within(&sb, &url, &["watch", "never-submitted"], limit);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("no tree never-submitted") && err.contains("--wait-for-start"),
        "{err}"
    );
    // Told to wait: it is still waiting when the tree is submitted, and then follows it.
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", &url, "watch", "later", "--wait-for-start"])
        .env("SKEIN_TOKEN_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut watching = c.spawn().expect("skein runs");
    std::thread::sleep(Duration::from_secs(6));
    assert!(
        watching.try_wait().expect("wait").is_none(),
        "watch --wait-for-start gave up"
    );
    let out = cli_within(
        &sb,
        &url,
        &["submit", "--agent", "quick", "--id", "later", "now"],
        limit,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = std::time::Instant::now();
    while watching.try_wait().expect("wait").is_none() {
        assert!(started.elapsed() < limit, "watch did not end with the tree");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = watching.wait_with_output().expect("output");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("later") && text.contains("done: now"),
        "{text}"
    );
}
