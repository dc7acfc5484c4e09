//! `skein ui --nats`: the page's API on a cluster (a real nats-server and a `skein worker`
//! process): trees started from it run on the cluster's workers, the live feed follows
//! the event subjects, and without the cluster's token secret it stays read-only.

mod common;

use std::time::Duration;

use common::cluster::{worker, SECRET};
use common::ui::UiServer;
use common::*;
use serde_json::{json, Value};
use skein_testnats::NatsServer;

#[tokio::test(flavor = "multi_thread")]
async fn a_tree_started_from_the_page_runs_on_the_clusters_workers_and_streams_live() {
    let server = NatsServer::start();
    let url = server.url();
    let mut w = worker(&url, "ui-w1", 1);
    let data = tempfile::tempdir().expect("dir");
    let ui = UiServer::start_env(
        &demo_config(),
        data.path(),
        &["--nats", &url],
        &[("SKEIN_TOKEN_SECRET", SECRET)],
    );
    let http = reqwest::Client::new();
    let info: Value = ui.get_json(&http, "/api/info").await;
    assert_eq!(info["backend"], "nats");
    assert_eq!(info["writable"], true, "{info}");
    let mut feed = http
        .get(format!("{}/api/live?root=onnats", ui.url))
        .send()
        .await
        .expect("live");
    let r = http
        .post(format!("{}/api/sessions", ui.url))
        .header("x-skein-csrf", info["csrf"].as_str().expect("csrf"))
        .json(&json!({"agent": "orchestrator", "mission": "a brief on queues", "id": "onnats"}))
        .send()
        .await
        .expect("start");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let done =
        regex::Regex::new(r#""session":"onnats","root":"onnats","seq":\d+,"kind":"Completed""#)
            .expect("regex");
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done.is_match(&seen) {
        let chunk = tokio::time::timeout_at(deadline, feed.chunk())
            .await
            .unwrap_or_else(|_| panic!("no Completed of the root on the feed: {seen}"))
            .expect("chunk")
            .expect("the feed ended");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("\"session\":\"onnats/writer-4\""), "{seen}");
    // The result the cluster announced, read from its stream as every reader does.
    let tree = ui
        .wait_for(&http, "/api/trees/onnats", Duration::from_secs(30), |v| {
            v["sessions"][0]["status"] == "completed" && !v["result"].is_null()
        })
        .await;
    assert_eq!(tree["summary"]["sessions"], 5);
    assert_eq!(tree["result"]["session"], "onnats", "{tree}");
    assert_eq!(tree["result"]["status"], "completed", "{tree}");
    assert_eq!(
        tree["result"]["answer"], tree["sessions"][0]["answer"],
        "{tree}"
    );
    let workers = tree["sessions"][0]["workers"].as_array().expect("workers");
    assert!(
        workers.iter().any(|w| w == "ui-w1"),
        "run by the cluster's worker: {workers:?}"
    );
    let v: Value = ui
        .get_json(&http, "/api/sessions/onnats/verify?tree=true")
        .await;
    assert_eq!(v["ok"], true, "{v}");

    // Without the cluster's secret the page reads but writes nothing.
    let ro = UiServer::start(&demo_config(), data.path(), &["--nats", &url]);
    let info: Value = ro.get_json(&http, "/api/info").await;
    assert_eq!(info["writable"], false);
    assert!(
        info["read_only_reason"]
            .as_str()
            .is_some_and(|r| r.contains("SKEIN_TOKEN_SECRET")),
        "{info}"
    );
    let r = http
        .post(format!("{}/api/sessions", ro.url))
        .header("x-skein-csrf", info["csrf"].as_str().expect("csrf"))
        .json(&json!({"agent": "orchestrator", "mission": "no"}))
        .send()
        .await
        .expect("start");
    assert_eq!(r.status(), 503);
    let rows: Value = ro.get_json(&http, "/api/sessions").await;
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{rows}");
    let _ = w.kill();
    let _ = w.wait();
}

/// On a cluster the inboxes read the open roots (`SKEIN_ROOT_OPEN`): a question still
/// waiting is listed by the page's API, `skein inbox` and the MCP tool, and the question
/// of a tree cancelled since is not. `/metrics` (the embedded store's retention totals)
/// answers 404 on a cluster.
#[tokio::test(flavor = "multi_thread")]
async fn on_a_cluster_the_inboxes_list_a_waiting_question_and_not_an_ended_trees() {
    let sb = Sandbox::new();
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        "turns:\n  - tool_calls:\n      - tool: ask_user\n        args:\n          \
         questions: [{key: version, question: \"Which version?\"}]\n  - answer: \"ok\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let mut w = common::cluster::worker_on(&sb.config(), &url, "ui-inbox-w1", 1, None);
    let ui = UiServer::start_env(
        &sb.config(),
        &sb.data(),
        &["--nats", &url],
        &[("SKEIN_TOKEN_SECRET", SECRET)],
    );
    let http = reqwest::Client::new();
    let csrf = ui.csrf(&http).await;
    for id in ["waits", "ends"] {
        let r = http
            .post(format!("{}/api/sessions", ui.url))
            .header("x-skein-csrf", &csrf)
            .json(&json!({"agent": "asker", "mission": "ask", "id": id}))
            .send()
            .await
            .expect("start");
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let sessions = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|i| i["session"].as_str().unwrap_or("?").to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    ui.wait_for(&http, "/api/inbox", Duration::from_secs(30), |v| {
        sessions(v) == ["ends", "waits"]
    })
    .await;
    let r = http
        .post(format!("{}/api/trees/ends/cancel", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"reason": "not needed"}))
        .send()
        .await
        .expect("cancel");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    ui.wait_for(&http, "/api/trees/ends", Duration::from_secs(30), |v| {
        v["sessions"][0]["status"] == "cancelled"
    })
    .await;
    let api: Value = ui.get_json(&http, "/api/inbox").await;
    assert_eq!(sessions(&api), ["waits"], "{api}");
    assert_eq!(api[0]["kind"], "question", "{api}");
    let mut cli = skein(&sb.config(), &sb.data());
    cli.env("SKEIN_TOKEN_SECRET", SECRET)
        .args(["--nats", &url, "inbox", "--json"]);
    let out = cli.output().expect("skein inbox");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(listed, api, "skein inbox and the page's API differ");
    let mut mcp = skein(&sb.config(), &sb.data());
    mcp.env("SKEIN_TOKEN_SECRET", SECRET).args(["--nats", &url]);
    let items = mcp_list_inbox(mcp);
    assert_eq!(
        Value::Array(items),
        api,
        "the MCP tool and the page's API differ"
    );
    // The retention totals of /metrics are the embedded store's: here the workers count.
    let r = http
        .get(format!("{}/metrics", ui.url))
        .send()
        .await
        .expect("metrics");
    assert_eq!(r.status(), 404);
    let why = r.text().await.expect("text");
    assert!(why.contains("skein worker --http"), "{why}");
    let _ = w.kill();
    let _ = w.wait();
}
