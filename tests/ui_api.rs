//! `skein ui`'s JSON API and its guards, through the real binary on a temporary embedded
//! store: every refusal (binding, token, host, CSRF, origin, a bad resume token, a bad
//! seq) and the views the page is built from.

mod common;

use std::time::Duration;

use common::ui::UiServer;
use common::*;
use serde_json::{json, Value};

fn asking(sb: &Sandbox) {
    sb.agent(
        "asker",
        "tools: [ask_user]\n",
        r#"
turns:
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{key: version, question: "Which Python version?"}]
  - answer: "set up with Python {{ results[0].answers.version }}"
"#,
    );
}

async fn start(ui: &UiServer, http: &reqwest::Client, agent: &str, id: &str) {
    let csrf = ui.csrf(http).await;
    let r = http
        .post(format!("{}/api/sessions", ui.url))
        .header("x-skein-csrf", csrf)
        .json(&json!({"agent": agent, "mission": "go", "id": id}))
        .send()
        .await
        .expect("start");
    assert!(r.status().is_success(), "{:?}", r.text().await);
}

#[test]
fn another_address_than_loopback_needs_a_token() {
    let sb = Sandbox::new();
    asking(&sb);
    let out = skein(&sb.config(), &sb.data())
        .args(["ui", "--addr", "0.0.0.0:0", "--no-auth"])
        .env_remove("SKEIN_UI_TOKEN")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("--auth-token"),
        "{err}"
    );
    // A token and --no-auth contradict each other.
    let out = skein(&sb.config(), &sb.data())
        .args(["ui", "--no-auth", "--auth-token", "a-long-enough-ui-token"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot be used with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = skein(&sb.config(), &sb.data())
        .args(["ui", "--addr", "0.0.0.0:0"])
        .env("SKEIN_UI_TOKEN", "short")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 16"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_token_every_api_call_needs_it_and_the_login_cookie_works() {
    let sb = Sandbox::new();
    asking(&sb);
    let token = "a-long-enough-ui-token";
    let ui = UiServer::start(&sb.config(), &sb.data(), &["--auth-token", token]);
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}/api/info", ui.url))
        .send()
        .await
        .expect("info");
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.expect("json");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("token")),
        "{body}"
    );
    let r = http
        .get(format!("{}/api/sessions", ui.url))
        .bearer_auth("a-long-enough-ui-tokeX")
        .send()
        .await
        .expect("sessions");
    assert_eq!(r.status(), 401, "a wrong token is refused");
    let r = http
        .get(format!("{}/api/sessions", ui.url))
        .bearer_auth(token)
        .send()
        .await
        .expect("sessions");
    assert_eq!(r.status(), 200);
    // The page itself loads without the token (it holds no data) and asks for it.
    let r = http.get(format!("{}/", ui.url)).send().await.expect("page");
    assert_eq!(r.status(), 200);
    // Login: a wrong token sets nothing, the right one an HttpOnly, SameSite cookie.
    let r = http
        .post(format!("{}/api/login", ui.url))
        .json(&json!({"token": "wrong"}))
        .send()
        .await
        .expect("login");
    assert_eq!(r.status(), 401);
    let r = http
        .post(format!("{}/api/login", ui.url))
        .json(&json!({"token": token}))
        .send()
        .await
        .expect("login");
    assert_eq!(r.status(), 204);
    let cookie = r
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .expect("cookie")
        .to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().expect("pair");
    let r = http
        .get(format!("{}/api/info", ui.url))
        .header("cookie", pair)
        .send()
        .await
        .expect("info");
    assert_eq!(r.status(), 200);
    assert!(
        !ui.stderr().contains(token),
        "the token was written to the log"
    );
}

/// Started as a person starts it, on loopback without a token: the server makes one, prints
/// it in its URL, and wants it on every API call; `--no-auth` is an explicit choice, and
/// says what it gives away.
#[tokio::test(flavor = "multi_thread")]
async fn by_default_the_server_makes_a_token_and_prints_it_in_its_url() {
    let sb = Sandbox::new();
    asking(&sb);
    let ui = UiServer::start_default(&sb.config(), &sb.data(), &[], &[]);
    let token = ui
        .printed
        .split_once("/?token=")
        .map(|(_, t)| t.to_string())
        .unwrap_or_else(|| panic!("no token in {}", ui.printed));
    assert!(token.len() >= 32, "{token}");
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}/api/inbox", ui.url))
        .send()
        .await
        .expect("inbox");
    assert_eq!(r.status(), 401, "another local account, without the token");
    let r = http
        .get(format!("{}/api/inbox", ui.url))
        .bearer_auth(&token)
        .send()
        .await
        .expect("inbox");
    assert_eq!(r.status(), 200);
    drop(ui);

    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    assert!(!ui.printed.contains("token"), "{}", ui.printed);
    assert!(
        ui.stderr()
            .contains("warning: --no-auth: every account on this machine"),
        "{}",
        ui.stderr()
    );
    let r = http
        .get(format!("{}/api/inbox", ui.url))
        .send()
        .await
        .expect("inbox");
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn foreign_hosts_missing_csrf_and_foreign_origins_are_refused() {
    let sb = Sandbox::new();
    asking(&sb);
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let http = reqwest::Client::new();
    // A DNS name rebound to 127.0.0.1 arrives with its own Host.
    let r = http
        .get(format!("{}/api/info", ui.url))
        .header("host", "attacker.example")
        .send()
        .await
        .expect("info");
    assert_eq!(r.status(), 403);
    let body: Value = r.json().await.expect("json");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("loopback")),
        "{body}"
    );
    let body = json!({"agent": "asker", "mission": "go"});
    let post = |csrf: Option<&str>, origin: Option<&str>| {
        let mut r = http.post(format!("{}/api/sessions", ui.url)).json(&body);
        if let Some(c) = csrf {
            r = r.header("x-skein-csrf", c);
        }
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        r.send()
    };
    let r = post(None, None).await.expect("post");
    assert_eq!(r.status(), 403);
    let e: Value = r.json().await.expect("json");
    assert!(
        e["error"]
            .as_str()
            .is_some_and(|e| e.contains("X-Skein-Csrf")),
        "{e}"
    );
    let r = post(Some("00000000000000000000000000000000"), None)
        .await
        .expect("post");
    assert_eq!(r.status(), 403, "a wrong CSRF token");
    let csrf = ui.csrf(&http).await;
    let r = post(Some(&csrf), Some("http://attacker.example"))
        .await
        .expect("post");
    assert_eq!(r.status(), 403, "another site's origin");
    let sessions: Value = ui.get_json(&http, "/api/sessions").await;
    assert_eq!(sessions, json!([]), "a refused request started a tree");
    let own = ui.url.trim_start_matches("http://").to_string();
    let r = post(Some(&csrf), Some(&format!("http://{own}")))
        .await
        .expect("post");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn answers_go_through_the_command_lines_token_checks() {
    let sb = Sandbox::new();
    asking(&sb);
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let http = reqwest::Client::new();
    start(&ui, &http, "asker", "q1").await;
    let inbox = ui
        .wait_for(&http, "/api/inbox?root=q1", Duration::from_secs(30), |v| {
            v.as_array().is_some_and(|a| !a.is_empty())
        })
        .await;
    let token = inbox[0]["token"].as_str().expect("token").to_string();
    let csrf = ui.csrf(&http).await;
    let answer = |token: String, answers: Value| {
        http.post(format!("{}/api/answer", ui.url))
            .header("x-skein-csrf", &csrf)
            .json(&json!({"token": token, "answers": answers}))
            .send()
    };
    // A refused token also says why, as a name a page can act on.
    let check = |r: reqwest::Response, status: u16, words: &'static str| async move {
        assert_eq!(r.status(), status);
        let e: Value = r.json().await.expect("json");
        assert!(
            e["error"].as_str().is_some_and(|t| t.contains(words)),
            "{e}"
        );
        e["refusal"].clone()
    };
    let why = check(
        answer("forged".into(), json!({"version": "3"}))
            .await
            .expect("post"),
        400,
        "token",
    )
    .await;
    assert_eq!(why, "malformed");
    let why = check(
        answer(token.clone(), json!({})).await.expect("post"),
        400,
        "missing answers",
    )
    .await;
    assert_eq!(why, Value::Null, "not a refused token");
    let r = http
        .post(format!("{}/api/approve", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"token": token, "approved": true}))
        .send()
        .await
        .expect("post");
    assert_eq!(
        check(r, 400, "cannot be used to approve").await,
        "wrong_kind"
    );
    let r = answer(token.clone(), json!({"version": "3.12"}))
        .await
        .expect("post");
    assert_eq!(r.status(), 200);
    ui.wait_for(&http, "/api/trees/q1", Duration::from_secs(30), |v| {
        v["sessions"][0]["status"] == "completed"
    })
    .await;
    let why = check(
        answer(token, json!({"version": "3.12"}))
            .await
            .expect("post"),
        400,
        "reused token",
    )
    .await;
    assert_eq!(why, "reused");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_views_of_a_finished_tree_and_their_refusals() {
    let data = tempfile::tempdir().expect("dir");
    let ui = UiServer::start(&demo_config(), data.path(), &[]);
    let http = reqwest::Client::new();
    start(&ui, &http, "orchestrator", "d1").await;
    let tree = ui
        .wait_for(&http, "/api/trees/d1", Duration::from_secs(60), |v| {
            v["sessions"][0]["status"] == "completed"
        })
        .await;
    assert_eq!(tree["summary"]["sessions"], 5);
    let get = |path: String| {
        let http = http.clone();
        let url = format!("{}{path}", ui.url);
        async move {
            let r = http.get(url).send().await.expect("get");
            let status = r.status().as_u16();
            (status, r.text().await.expect("body"))
        }
    };
    let (s, body) = get("/api/sessions/d1%2Fresearcher-1/state?at=1".into()).await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["state"]["status"], "running");
    assert_eq!(v["at"], 1);
    let (s, body) = get("/api/sessions/d1%2Fresearcher-1/state?at=99".into()).await;
    assert_eq!(s, 400);
    assert!(body.contains("seqs 1..="), "{body}");
    let (s, body) = get("/api/sessions/d1%2Fnobody-9/events".into()).await;
    assert_eq!(s, 404, "{body}");
    let (s, body) = get("/api/sessions/Not%20an%20id/events".into()).await;
    assert_eq!(s, 400, "{body}");
    let (s, body) = get("/api/sessions/d1/verify?tree=true".into()).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["sessions"].as_array().map(Vec::len), Some(5));
    let (s, body) = get("/api/trees/d1/timeline".into()).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).expect("json");
    let steps: Vec<&Value> = v
        .as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| r["steps"].as_array().expect("steps"))
        .collect();
    assert_eq!(steps.iter().filter(|s| s["kind"] == "tool").count(), 3);
    assert!(steps
        .iter()
        .filter(|s| s["kind"] == "model")
        .all(|s| s["input_tokens"].as_u64() > Some(0)));
    // The audit export is the command line's: it verifies with `skein audit verify`.
    let r = http
        .get(format!("{}/api/trees/d1/audit", ui.url))
        .send()
        .await
        .expect("audit");
    assert!(r
        .headers()
        .get("content-disposition")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("attachment")));
    let export = r.bytes().await.expect("bytes");
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("d1.jsonl");
    std::fs::write(&file, &export).expect("write");
    let out = skein(&demo_config(), &dir.path().join("other"))
        .args(["audit", "verify"])
        .arg(&file)
        .output()
        .expect("verify");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A fork from the page's API runs in the server like any tree.
    let csrf = ui.csrf(&http).await;
    let r = http
        .post(format!("{}/api/sessions/d1/fork", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"at": 2, "new_id": "d1fork"}))
        .send()
        .await
        .expect("fork");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    ui.wait_for(&http, "/api/trees/d1fork", Duration::from_secs(60), |v| {
        v["sessions"][0]["status"] == "completed"
    })
    .await;
    let r = http
        .post(format!("{}/api/sessions/d1/fork", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"at": 0}))
        .send()
        .await
        .expect("fork");
    assert_eq!(r.status(), 400);
    // Filters of the sessions list.
    let (_, body) = get("/api/sessions?q=GO&status=completed&agent=orchestrator".into()).await;
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(2), "{v}");
    let (_, body) = get("/api/sessions?status=failed".into()).await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("json"),
        json!([])
    );
    let (_, body) = get(format!("/api/sessions?since={}", u64::MAX / 2)).await;
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("json"),
        json!([])
    );
    // Pages of one, each naming the next page's cursor until the last; the same roots as
    // one page of them all.
    let all: Value = ui.get_json(&http, "/api/sessions").await;
    let all: Vec<Value> = all.as_array().expect("rows").clone();
    assert!(all.len() >= 2, "{all:?}");
    let (mut paged, mut cursor) = (vec![], String::new());
    loop {
        let r = http
            .get(format!("{}/api/sessions?limit=1&cursor={cursor}", ui.url))
            .send()
            .await
            .expect("page");
        assert_eq!(r.status(), 200);
        let next = r
            .headers()
            .get("x-skein-next-cursor")
            .map(|v| v.to_str().expect("ascii").to_string());
        let rows: Value = r.json().await.expect("json");
        paged.extend(rows.as_array().expect("rows").iter().cloned());
        match next {
            Some(c) => cursor = c,
            None => break,
        }
    }
    assert_eq!(paged, all);
    let (s, body) = get("/api/sessions?cursor=nonsense".into()).await;
    assert_eq!(s, 400, "{body}");
    assert!(body.contains("cursor"), "{body}");
    // The API is documented, every path the page uses among it.
    let (_, body) = get("/api/openapi.json".into()).await;
    let doc: Value = serde_json::from_str(&body).expect("json");
    for p in [
        "/api/sessions",
        "/api/trees/{root}",
        "/api/trees/{root}/timeline",
        "/api/sessions/{id}/state",
        "/api/sessions/{id}/verify",
        "/api/inbox",
        "/api/answer",
        "/api/approve",
        "/api/live",
    ] {
        assert!(doc["paths"].get(p).is_some(), "{p} is not documented");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_live_feed_streams_a_running_trees_events() {
    let data = tempfile::tempdir().expect("dir");
    let ui = UiServer::start(&demo_config(), data.path(), &[]);
    let http = reqwest::Client::new();
    let mut feed = http
        .get(format!("{}/api/live?root=live1", ui.url))
        .send()
        .await
        .expect("live");
    assert_eq!(
        feed.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    start(&ui, &http, "orchestrator", "live1").await;
    let mut seen = String::new();
    let done =
        regex::Regex::new(r#""session":"live1","root":"live1","seq":\d+,"kind":"Completed""#)
            .expect("regex");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done.is_match(&seen) {
        let chunk = tokio::time::timeout_at(deadline, feed.chunk())
            .await
            .unwrap_or_else(|_| panic!("the feed went quiet before the tree ended: {seen}"))
            .expect("chunk")
            .expect("the feed ended");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("event: event"), "{seen}");
    assert!(
        seen.contains("\"session\":\"live1/researcher-1\""),
        "{seen}"
    );
    assert!(seen.contains("event: text"), "streamed text: {seen}");
    let r = http
        .get(format!("{}/api/live?root=Bad%20Id", ui.url))
        .send()
        .await
        .expect("live");
    assert_eq!(r.status(), 400);
}

/// `/metrics` of `ui`: its samples, `name value` each, and the whole text.
async fn samples(ui: &UiServer, http: &reqwest::Client) -> (Vec<String>, String) {
    let r = http
        .get(format!("{}/metrics", ui.url))
        .send()
        .await
        .expect("metrics");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("text");
    let samples = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    (samples, text)
}

/// On the embedded store `skein ui` serves `/metrics` with what retention removed: zero
/// before any `skein gc`, then the sums of every run's trees, sessions and bytes.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_what_every_gc_removed_from_the_embedded_store() {
    let sb = Sandbox::new();
    sb.agent("quick", "", "turns:\n  - answer: \"done\"\n");
    let http = reqwest::Client::new();
    {
        let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
        let (samples, text) = samples(&ui, &http).await;
        assert_eq!(
            samples,
            [
                "skein_gc_removed_trees_total 0",
                "skein_gc_removed_sessions_total 0",
                "skein_gc_removed_bytes_total 0"
            ],
            "{text}"
        );
        assert!(text.contains("# TYPE skein_gc_removed_trees_total counter"));
    }
    let run = |args: &[&str]| -> Value {
        let out = skein(&sb.config(), &sb.data())
            .args(args)
            .output()
            .expect("skein");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON")
    };
    let mut bytes = 0;
    for ids in [&["one", "two"][..], &["three"]] {
        for id in ids {
            run(&["run", "--agent", "quick", "--id", id, "--json", "go"]);
        }
        let gc = run(&["gc", "--older-than", "0s", "--json"]);
        assert_eq!(gc["removed"]["trees"], ids.len(), "{gc}");
        let r = &gc["removed"];
        bytes += r["log_bytes_before"].as_u64().expect("before")
            - r["log_bytes_after"].as_u64().expect("after");
    }
    assert!(bytes > 0);
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let (samples, text) = samples(&ui, &http).await;
    assert_eq!(
        samples,
        [
            "skein_gc_removed_trees_total 3".to_string(),
            "skein_gc_removed_sessions_total 3".to_string(),
            format!("skein_gc_removed_bytes_total {bytes}")
        ],
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tree_started_from_the_ui_takes_its_priority() {
    let sb = Sandbox::new();
    asking(&sb);
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let http = reqwest::Client::new();
    let csrf = ui.csrf(&http).await;
    let post = |body: Value| {
        http.post(format!("{}/api/sessions", ui.url))
            .header("x-skein-csrf", csrf.clone())
            .json(&body)
            .send()
    };
    let r = post(json!({"agent": "asker", "mission": "go", "id": "p7", "priority": 7}))
        .await
        .expect("post");
    assert!(r.status().is_success(), "{:?}", r.text().await);
    let state: Value = ui.get_json(&http, "/api/sessions/p7/state").await;
    assert_eq!(state["state"]["submitted"]["priority"], 7, "{state}");
    // Out of range: refused, naming the range; nothing started.
    let r = post(json!({"agent": "asker", "mission": "go", "id": "p500", "priority": 500}))
        .await
        .expect("post");
    assert_eq!(r.status(), 400);
    let body = r.text().await.expect("body");
    assert!(body.contains("-100"), "{body}");
    // The same id with another priority is another submission.
    let r = post(json!({"agent": "asker", "mission": "go", "id": "p7", "priority": 3}))
        .await
        .expect("post");
    assert_eq!(r.status(), 409);
    let body = r.text().await.expect("body");
    assert!(body.contains("priority 7, not 3"), "{body}");
    let sessions: Value = ui.get_json(&http, "/api/sessions").await;
    assert_eq!(sessions.as_array().map(Vec::len), Some(1), "{sessions}");
}
