//! `skein ui` end to end in a real browser: headless Chromium driven through chromedriver
//! (Debian's `chromium` and `chromium-driver`), against the real binary on a temporary
//! embedded store. Without the browser these tests fail and say how to install it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::ui::UiServer;
use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use skein_testnats::free_port;

const INSTALL: &str = "the browser suite needs Chromium and its driver: install them with \
    `apt-get install chromium chromium-driver` (tests/run.sh does this when run as root), \
    or name them with CHROMIUM=/path/to/chromium and CHROMEDRIVER=/path/to/chromedriver";

/// `name` from the environment variable `var`, else the first of `candidates` on PATH.
fn find_program(var: &str, candidates: &[&str]) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "{var}={} is not a file; {INSTALL}",
            p.display()
        );
        return p;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for c in candidates {
            let p = dir.join(c);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!("{} not found on PATH; {INSTALL}", candidates.join(" or "));
}

/// chromedriver and a headless Chromium session on it; both end when dropped.
struct Browser {
    client: Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Self {
        let chromium = find_program("CHROMIUM", &["chromium", "chromium-browser"]);
        let chromedriver = find_program("CHROMEDRIVER", &["chromedriver"]);
        let port = free_port();
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}; {INSTALL}", chromedriver.display()));
        let profile = tempfile::tempdir().expect("profile dir");
        let caps = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                // Without the background-networking flags Chromium reaches out to the
                // network on its own, which a sandboxed CI refuses.
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--disable-dev-shm-usage", "--window-size=1280,1000",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            },
        });
        let caps = match caps {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let url = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(c) => break c,
                Err(e) if start.elapsed() < Duration::from_secs(30) => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("no browser session from chromedriver: {e}; {INSTALL}"),
            }
        };
        Self {
            client,
            driver,
            _profile: profile,
        }
    }

    /// Waits until `script` (a JS expression) is truthy in the page; returns its value.
    async fn until(&self, what: &str, script: &str) -> Value {
        let start = Instant::now();
        loop {
            let v = self
                .client
                .execute(&format!("return ({script});"), vec![])
                .await
                .unwrap_or(Value::Null);
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            if start.elapsed() > Duration::from_secs(30) {
                let body = self
                    .client
                    .execute("return document.body.innerText;", vec![])
                    .await
                    .unwrap_or(Value::Null);
                panic!("the page never showed {what} ({script}); it shows:\n{body}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn js(&self, script: &str) -> Value {
        self.client
            .execute(&format!("return ({script});"), vec![])
            .await
            .unwrap_or_else(|e| panic!("{script}: {e}"))
    }

    async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// The demo catalogue (config/) in a directory of its own, every scripted model turn
/// slowed to `latency_ms`, so a tree runs long enough to be watched.
fn slow_demo(latency_ms: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = repo().join("config");
    let re = regex::Regex::new(r"(?m)^latency_ms: *\d+").expect("regex");
    for sub in ["agents", "scripts"] {
        std::fs::create_dir_all(dir.path().join(sub)).expect("dir");
        for e in std::fs::read_dir(src.join(sub)).expect("read") {
            let p = e.expect("entry").path();
            let text = std::fs::read_to_string(&p).expect("read");
            let text = re.replace_all(&text, format!("latency_ms: {latency_ms}").as_str());
            std::fs::write(
                dir.path().join(sub).join(p.file_name().expect("name")),
                text.as_ref(),
            )
            .expect("write");
        }
    }
    std::fs::write(
        dir.path().join("skein.toml"),
        "agents_dir = \"agents\"\nscripts_dir = \"scripts\"\n[runtime]\nconcurrency = 8\n",
    )
    .expect("config");
    dir
}

fn data_of(dir: &Path) -> PathBuf {
    dir.join("data")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_demo_tree_shows_live_its_children_show_their_logs_and_the_slider_replays_state() {
    let cfg = slow_demo(400);
    let ui = UiServer::start(&cfg.path().join("skein.toml"), &data_of(cfg.path()), &[]);
    let b = Browser::start().await;
    let c = &b.client;
    c.goto(&format!("{}/#/", ui.url)).await.expect("page");
    // Start the demo tree from the page.
    b.until("the start form", "document.getElementById('start-mission')")
        .await;
    b.js("document.querySelector('details.start').open = true")
        .await;
    c.find(Locator::Id("start-mission"))
        .await
        .expect("mission")
        .send_keys("a brief on event sourcing")
        .await
        .expect("type");
    c.find(Locator::Id("start-id"))
        .await
        .expect("id")
        .send_keys("demo")
        .await
        .expect("type");
    c.find(Locator::Id("start"))
        .await
        .expect("start")
        .click()
        .await
        .expect("click");
    b.until("the tree page", "location.hash === '#/tree/demo'")
        .await;
    // A mark that a reload would wipe: everything below arrives live.
    b.js("(window.__same_page = 42)").await;
    b.until(
        "the root while it runs",
        "document.querySelector('#tree .node .badge') && \
         !/completed|failed/.test(document.querySelector('#tree .node .badge').textContent)",
    )
    .await;
    let sessions_while_running = b
        .js("document.querySelectorAll('#tree .node').length")
        .await;
    b.until(
        "the researchers while the root runs",
        "document.querySelectorAll('#tree a.session-link[data-session^=\"demo/researcher\"]').length === 3 && \
         !/completed/.test(document.querySelector('#tree .node .badge').textContent)",
    )
    .await;
    b.until(
        "the finished tree",
        "document.querySelectorAll('#tree .node').length === 5 && \
         document.querySelector('#tree .node .badge').textContent === 'completed' && \
         document.getElementById('answer')",
    )
    .await;
    assert!(
        sessions_while_running.as_u64().is_some_and(|n| n < 5),
        "the tree was shown before all its sessions existed: {sessions_while_running}"
    );
    assert_eq!(
        b.js("window.__same_page").await,
        json!(42),
        "the page was reloaded instead of updated live"
    );
    // The timeline has a lane per session, with model and tool steps.
    b.until(
        "the timeline",
        "document.querySelectorAll('#timeline .gantt-row').length === 5 && \
         document.querySelectorAll('#timeline .lane .step.k-model').length >= 10 && \
         document.querySelectorAll('#timeline .lane .step.k-tool').length === 3",
    )
    .await;

    // Clicking a child shows its log.
    c.find(Locator::Css(
        "a.session-link[data-session='demo/researcher-2']",
    ))
    .await
    .expect("child link")
    .click()
    .await
    .expect("click");
    b.until(
        "the child's log",
        "location.hash === '#/session/demo%2Fresearcher-2' && \
         document.querySelectorAll('#log tr[data-seq]').length >= 4",
    )
    .await;
    let kinds = b
        .js("[...document.querySelectorAll('#log tr[data-seq] td:nth-child(2)')].map(t => t.textContent)")
        .await;
    let kinds: Vec<String> = serde_json::from_value(kinds).expect("kinds");
    assert_eq!(
        kinds.first().map(String::as_str),
        Some("Submitted"),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("Completed"),
        "{kinds:?}"
    );
    assert!(kinds.iter().any(|k| k == "ToolCalled"), "{kinds:?}");
    let heading = b.js("document.querySelector('h1').textContent").await;
    assert_eq!(heading, json!("Session demo/researcher-2"));
    b.until(
        "the verdict",
        "/replay --verify: ok/.test(document.getElementById('verdict').textContent)",
    )
    .await;

    // Moving the slider changes the state shown.
    let last = kinds.len();
    b.until(
        "the state at the last seq",
        &format!("document.getElementById('seq-label').textContent === 'seq {last} of {last}'"),
    )
    .await;
    let at_end = b.js("document.getElementById('state').innerText").await;
    let messages_at_end = b
        .js("document.querySelectorAll('#messages li').length")
        .await;
    assert!(
        at_end.as_str().is_some_and(|s| s.contains("completed")),
        "{at_end}"
    );
    let slider = c.find(Locator::Id("seq")).await.expect("slider");
    slider.click().await.expect("focus");
    slider.send_keys("\u{E011}").await.expect("Home key");
    b.until(
        "the state at seq 1",
        "document.getElementById('seq-label').textContent.startsWith('seq 1 of')",
    )
    .await;
    let at_start = b.js("document.getElementById('state').innerText").await;
    let messages_at_start = b
        .js("document.querySelectorAll('#messages li').length")
        .await;
    assert_ne!(at_start, at_end, "the state did not change with the slider");
    assert!(
        at_start
            .as_str()
            .is_some_and(|s| s.contains("running") && s.contains("at seq 1")),
        "{at_start}"
    );
    assert!(
        messages_at_start.as_u64() < messages_at_end.as_u64(),
        "{messages_at_start} messages at seq 1, {messages_at_end} at the end"
    );
    // One step on with the arrow key: one event more folded.
    slider.send_keys("\u{E014}").await.expect("Right key");
    b.until(
        "the state at seq 2",
        "document.getElementById('seq-label').textContent.startsWith('seq 2 of')",
    )
    .await;
    b.close().await;
}

/// A root that asks a person, then answers with what it was told.
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
          context: "setting up the project"
  - answer: "set up with Python {{ results[0].answers.version }}"
"#,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn answering_a_question_on_the_page_resumes_the_tree_to_completed() {
    let sb = Sandbox::new();
    asking(&sb);
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let b = Browser::start().await;
    let c = &b.client;
    c.goto(&format!("{}/#/", ui.url)).await.expect("page");
    b.until("the start form", "document.getElementById('start-mission')")
        .await;
    b.js("document.querySelector('details.start').open = true")
        .await;
    c.find(Locator::Id("start-mission"))
        .await
        .expect("mission")
        .send_keys("set up the project")
        .await
        .expect("type");
    c.find(Locator::Id("start"))
        .await
        .expect("start")
        .click()
        .await
        .expect("click");
    b.until(
        "the question",
        "document.querySelector('#inbox form.question input[name=version]')",
    )
    .await;
    // The inbox and the tree are fetched apart: the tree may show the pause a moment
    // after the question does.
    b.until(
        "the tree awaiting input",
        "document.querySelector('#tree .node .badge').textContent === 'awaiting input'",
    )
    .await;
    let question = b
        .js("document.querySelector('#inbox form.question').innerText")
        .await;
    assert!(
        question.as_str().is_some_and(
            |q| q.contains("Which Python version?") && q.contains("setting up the project")
        ),
        "{question}"
    );
    c.find(Locator::Css("#inbox form.question input[name=version]"))
        .await
        .expect("input")
        .send_keys("3.13")
        .await
        .expect("type");
    c.find(Locator::Css("#inbox button.answer"))
        .await
        .expect("button")
        .click()
        .await
        .expect("click");
    let answer = b
        .until(
            "the tree completed with the answer given",
            "document.querySelector('#tree .node .badge').textContent === 'completed' && \
             document.getElementById('answer') && document.getElementById('answer').textContent",
        )
        .await;
    assert_eq!(answer, json!("set up with Python 3.13"));
    assert_eq!(
        b.js("document.querySelectorAll('#inbox .card').length")
            .await,
        json!(0),
        "the answered question is still shown"
    );
    b.close().await;
    // The log records who answered, as the command line would.
    let http = reqwest::Client::new();
    let roots: Value = http
        .get(format!("{}/api/sessions", ui.url))
        .send()
        .await
        .expect("sessions")
        .json()
        .await
        .expect("json");
    let root = roots[0]["session"].as_str().expect("root");
    let events: Value = http
        .get(format!("{}/api/sessions/{root}/events", ui.url))
        .send()
        .await
        .expect("events")
        .json()
        .await
        .expect("json");
    let provided = events
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["kind"] == "InputProvided")
        .expect("InputProvided recorded");
    assert_eq!(
        provided["body"]["data"]["answers"],
        json!({"version": "3.13"})
    );
    assert!(
        provided["body"]["data"]["by"]
            .as_str()
            .is_some_and(|b| b.starts_with("ui")),
        "{provided}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_approval_shows_the_full_command_and_approving_runs_it() {
    let sb = Sandbox::new();
    let mut cfg = std::fs::read_to_string(sb.config()).expect("config");
    cfg.push_str("\n[tools.shell]\nenabled = true\n");
    std::fs::write(sb.config(), cfg).expect("config");
    // Far longer than any preview cut: the page must show every byte.
    let long = "x".repeat(900);
    let command = format!("echo {long} > long.txt && echo end-of-command-marker");
    sb.agent(
        "operator",
        "tools: [shell]\n",
        &format!(
            "turns:\n  - tool_calls:\n      - tool: shell\n        args: {{command: \"{command}\"}}\n  - answer: \"ran it\"\n"
        ),
    );
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let http = reqwest::Client::new();
    let csrf = ui.csrf(&http).await;
    let r = http
        .post(format!("{}/api/sessions", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"agent": "operator", "mission": "run it", "id": "op"}))
        .send()
        .await
        .expect("start");
    assert!(r.status().is_success(), "{:?}", r.text().await);
    let b = Browser::start().await;
    let c = &b.client;
    c.goto(&format!("{}/#/tree/op", ui.url))
        .await
        .expect("page");
    let shown = b
        .until(
            "the approval",
            "document.querySelector('#inbox .approval pre.args') && \
             document.querySelector('#inbox .approval pre.args').textContent",
        )
        .await;
    let args: Value =
        serde_json::from_str(shown.as_str().expect("text")).expect("the arguments as JSON");
    assert_eq!(args["command"], json!(command), "not the whole command");
    let tool = b
        .js("document.querySelector('#inbox .approval code.tool').textContent")
        .await;
    assert_eq!(tool, json!("shell"));
    let file = sb.data().join("workspaces/op/long.txt");
    assert!(!file.exists(), "the command ran before it was approved");
    c.find(Locator::Css("#inbox .approval button.approve"))
        .await
        .expect("approve")
        .click()
        .await
        .expect("click");
    b.until(
        "the tree completed",
        "document.querySelector('#tree .node .badge').textContent === 'completed'",
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(&file)
            .expect("the approved command ran")
            .trim(),
        long
    );
    b.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_answer_with_markup_renders_as_text_and_never_runs() {
    let sb = Sandbox::new();
    let hostile = r#"<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold?</b>"#;
    sb.agent(
        "mallory",
        "",
        &format!(
            "turns:\n  - answer: {q}\n",
            q = serde_json::to_string(hostile).expect("quote")
        ),
    );
    let ui = UiServer::start(&sb.config(), &sb.data(), &[]);
    let http = reqwest::Client::new();
    let csrf = ui.csrf(&http).await;
    http.post(format!("{}/api/sessions", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"agent": "mallory", "mission": "say something", "id": "xss"}))
        .send()
        .await
        .expect("start");
    ui.wait_for(&http, "/api/trees/xss", Duration::from_secs(30), |v| {
        v["sessions"][0]["status"] == "completed"
    })
    .await;
    let b = Browser::start().await;
    let c = &b.client;
    for page in ["#/tree/xss", "#/session/xss"] {
        c.goto(&format!("{}/{page}", ui.url)).await.expect("page");
        let (sel, what) = if page.contains("tree") {
            ("#answer", "the answer")
        } else {
            ("#state .answer-text", "the answer in the state")
        };
        let text = b
            .until(what, &format!("document.querySelector('{sel}') && document.querySelector('{sel}').textContent"))
            .await;
        assert_eq!(text, json!(hostile), "{page}: not shown as the text it is");
        assert_eq!(
            b.js(&format!(
                "document.querySelectorAll('{sel} script, {sel} img, {sel} b').length"
            ))
            .await,
            json!(0),
            "{page}: the model's text became markup"
        );
        // Give an injected handler every chance to fire.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            b.js("typeof window.__pwned").await,
            json!("undefined"),
            "{page}: the model's script ran"
        );
    }
    b.close().await;
}

/// Starts `agent` as tree `id` through the API, with `token` when the server wants one.
async fn start_tree(ui: &UiServer, token: Option<&str>, agent: &str, id: &str) {
    let http = reqwest::Client::new();
    let with = |r: reqwest::RequestBuilder| match token {
        Some(t) => r.bearer_auth(t),
        None => r,
    };
    let info: Value = with(http.get(format!("{}/api/info", ui.url)))
        .send()
        .await
        .expect("info")
        .json()
        .await
        .expect("json");
    let r = with(http.post(format!("{}/api/sessions", ui.url)))
        .header("x-skein-csrf", info["csrf"].as_str().expect("csrf"))
        .json(&json!({"agent": agent, "mission": "go", "id": id}))
        .send()
        .await
        .expect("start");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
}

/// On the tree page of `id`, waits for its question, presses "Cancel the tree" (and
/// agrees to the confirmation), and waits until the page shows the tree cancelled.
async fn cancel_from_the_page(b: &Browser, base: &str, id: &str) {
    b.client
        .goto(&format!("{base}/#/tree/{id}"))
        .await
        .expect("page");
    b.until(
        "the question waiting and the cancel button",
        "document.querySelector('#tree .node .badge') && \
         /awaiting/.test(document.querySelector('#tree .node .badge').textContent) && \
         document.getElementById('cancel')",
    )
    .await;
    b.js("(window.confirm = () => true, 1)").await;
    // The page re-renders as the tree's records come in, and a button found just before a
    // re-render is gone by the click: find it again then.
    let mut tries = 0;
    loop {
        let button = b
            .client
            .find(Locator::Id("cancel"))
            .await
            .expect("cancel button");
        match button.click().await {
            Ok(_) => break,
            Err(fantoccini::error::CmdError::Standard(e))
                if e.error == fantoccini::error::ErrorStatus::StaleElementReference
                    && tries < 5 =>
            {
                tries += 1;
            }
            Err(e) => panic!("click: {e:?}"),
        }
    }
    b.until(
        "the tree cancelled",
        "document.querySelector('#tree .node .badge').textContent === 'cancelled' && \
         !document.getElementById('cancel')",
    )
    .await;
}

/// Started without a token, the server makes one and prints it in its URL: the page
/// without it asks for it, the printed URL logs in (and the token leaves the address
/// bar), and a waiting tree is cancelled from its page.
#[tokio::test(flavor = "multi_thread")]
async fn the_printed_url_logs_in_and_a_waiting_tree_is_cancelled_from_its_page() {
    let sb = Sandbox::new();
    asking(&sb);
    let ui = UiServer::start_default(&sb.config(), &sb.data(), &[], &[]);
    let token = ui
        .printed
        .split_once("?token=")
        .map(|(_, t)| t.to_string())
        .expect("a token in the URL");
    start_tree(&ui, Some(&token), "asker", "waits").await;
    let b = Browser::start().await;
    b.client
        .goto(&format!("{}/#/", ui.url))
        .await
        .expect("page");
    b.until("the login form", "document.getElementById('token')")
        .await;
    b.client.goto(&ui.printed).await.expect("page");
    b.until(
        "the trees, logged in",
        "document.getElementById('backend').textContent.startsWith('embedded') && \
         document.querySelector('a[href=\"#/tree/waits\"]')",
    )
    .await;
    assert_eq!(
        b.js("location.search").await,
        json!(""),
        "the token stayed in the address bar"
    );
    cancel_from_the_page(&b, &ui.url, "waits").await;
    b.close().await;
}

/// The page on a cluster (`--nats`, a real nats-server and a worker): a tree the
/// cluster's worker runs shows live, waiting for its question, and is cancelled from
/// its page.
#[tokio::test(flavor = "multi_thread")]
async fn on_a_cluster_the_page_follows_a_tree_and_cancels_it() {
    let sb = Sandbox::new();
    asking(&sb);
    let server = skein_testnats::NatsServer::start();
    let url = server.url();
    let mut w = common::cluster::worker_on(&sb.config(), &url, "ui-browser-w1", 1, None);
    let ui = UiServer::start_env(
        &sb.config(),
        &sb.data(),
        &["--nats", &url],
        &[("SKEIN_TOKEN_SECRET", common::cluster::SECRET)],
    );
    start_tree(&ui, None, "asker", "onnats").await;
    let b = Browser::start().await;
    b.client
        .goto(&format!("{}/#/", ui.url))
        .await
        .expect("page");
    b.until(
        "the cluster's page",
        "document.getElementById('backend').textContent.startsWith('nats')",
    )
    .await;
    cancel_from_the_page(&b, &ui.url, "onnats").await;
    b.close().await;
    let _ = w.kill();
    let _ = w.wait();
}

/// Screenshots for the docs: `cargo test --test ui_browser -- --ignored screenshots`
/// writes docs/ui-tree.png, docs/ui-session.png and docs/ui-phone.png.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "writes the screenshots in docs/; run by hand when the page changes"]
async fn screenshots() {
    let cfg = slow_demo(150);
    let ui = UiServer::start(&cfg.path().join("skein.toml"), &data_of(cfg.path()), &[]);
    let http = reqwest::Client::new();
    let csrf = ui.csrf(&http).await;
    http.post(format!("{}/api/sessions", ui.url))
        .header("x-skein-csrf", &csrf)
        .json(&json!({"agent": "orchestrator", "mission": "a brief on event sourcing for a team new to it", "id": "brief"}))
        .send()
        .await
        .expect("start");
    ui.wait_for(&http, "/api/trees/brief", Duration::from_secs(60), |v| {
        v["sessions"][0]["status"] == "completed"
    })
    .await;
    let b = Browser::start().await;
    let c = &b.client;
    let docs = repo().join("docs");
    c.set_window_size(1280, 1100).await.expect("size");
    c.goto(&format!("{}/#/tree/brief", ui.url))
        .await
        .expect("page");
    b.until(
        "the timeline",
        "document.querySelectorAll('#timeline .gantt-row').length === 5",
    )
    .await;
    std::fs::write(docs.join("ui-tree.png"), c.screenshot().await.expect("png")).expect("write");
    c.goto(&format!("{}/#/session/brief%2Fresearcher-1", ui.url))
        .await
        .expect("page");
    b.until(
        "the verdict",
        "/ok/.test(document.getElementById('verdict').textContent)",
    )
    .await;
    b.js("(() => { const s = document.getElementById('seq'); s.value = 4; s.dispatchEvent(new Event('input')); return 1; })()")
        .await;
    b.until(
        "seq 4",
        "document.getElementById('seq-label').textContent.startsWith('seq 4')",
    )
    .await;
    std::fs::write(
        docs.join("ui-session.png"),
        c.screenshot().await.expect("png"),
    )
    .expect("write");
    c.set_window_size(390, 844).await.expect("size");
    c.goto(&format!("{}/#/tree/brief", ui.url))
        .await
        .expect("page");
    b.until(
        "the timeline",
        "document.querySelectorAll('#timeline .gantt-row').length === 5",
    )
    .await;
    std::fs::write(
        docs.join("ui-phone.png"),
        c.screenshot().await.expect("png"),
    )
    .expect("write");
    b.close().await;
}

/// History tree `k`: a finished one-session tree `hist{k:05}` (a submission of agent
/// `writer`, mission "history tree {k}", and an answer), started `k` seconds after the
/// first, so the higher `k` the newer.
fn history_tree(k: usize) -> (skein_core::SessionId, Vec<skein_core::Record>) {
    use skein_core::event::{genesis_hash, Completed, Submitted};
    use skein_core::{Envelope, Event, Record, SessionId};
    let id = SessionId::root(&format!("hist{k:05}")).expect("id");
    let at = 1_700_000_000_000 + k as u64 * 1000;
    let mut prev = genesis_hash(&id);
    let mut records = vec![];
    let bodies = [
        Event::Submitted(Submitted {
            mission: format!("history tree {k}"),
            ..Submitted::for_test("writer")
        }),
        Event::Completed(Completed {
            answer: format!("answer {k}"),
            usage_total: Default::default(),
            steps: 1,
            partial: false,
        }),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let env = Envelope::new(id.clone(), i as u64 + 1, at + i as u64, prev, body);
        let bytes = env.encode().expect("encode");
        let r = Record { env, bytes };
        prev = r.hash();
        records.push(r);
    }
    (id, records)
}

/// A store of `trees` history trees, written straight into the embedded store's log under
/// `dir`, the newest last.
async fn history(dir: &Path, trees: usize) {
    use skein_runtime::ports::{Durability, EventLog};
    let store = skein_sled::SledStore::open(&data_of(dir), &dir.join("workspaces")).expect("store");
    for k in 0..trees {
        let (id, records) = history_tree(k);
        store
            .append(&id, 0, &records, Durability::Ahead)
            .await
            .expect("append");
    }
    store.flush().await.expect("flush");
}

/// The same trees on the NATS server at `url`, through its event log port (so the index
/// of roots is written as a submission writes it), in start order, a few at a time (as
/// `skein bench --history --nats-local` writes them).
async fn history_on_nats(url: &str, trees: usize) {
    use futures::StreamExt;
    use skein_runtime::ports::Durability;
    let cfg = skein_nats::NatsConfig {
        urls: vec![url.to_string()],
        ..skein_nats::NatsConfig::default()
    };
    let store = skein_nats::NatsStore::connect(&cfg, Duration::from_secs(30))
        .await
        .expect("the store on NATS");
    let b = store.backend();
    let mut writes = futures::stream::iter((0..trees).map(|k| {
        let b = &b;
        async move {
            let (id, records) = history_tree(k);
            b.log.append(&id, 0, &records, Durability::Now).await
        }
    }))
    .buffered(8);
    while let Some(r) = writes.next().await {
        r.expect("append");
    }
}

/// The roots of `/api/sessions` with `query`, and the next page's cursor.
async fn api_page(ui: &UiServer, query: &str) -> (Vec<String>, Option<String>) {
    let r = reqwest::get(format!("{}/api/sessions?{query}", ui.url))
        .await
        .expect("sessions");
    assert_eq!(r.status(), 200, "{query}");
    let next = r
        .headers()
        .get("x-skein-next-cursor")
        .map(|v| v.to_str().expect("cursor").to_string());
    let rows: Value = r.json().await.expect("rows");
    let roots = rows
        .as_array()
        .unwrap_or_else(|| panic!("{query}: {rows}"))
        .iter()
        .map(|row| row["session"].as_str().expect("session").to_string())
        .collect();
    (roots, next)
}

/// `hist{k:05}` for each `k` of `ks`.
fn hist(ks: impl Iterator<Item = usize>) -> Vec<String> {
    ks.map(|k| format!("hist{k:05}")).collect()
}

/// The API's answers on a store of the 10,000 history trees: whole pages, newest first,
/// a cursor's next page, filters, and one tree.
async fn the_api_pages_through_the_history(ui: &UiServer) {
    let (first, next) = api_page(ui, "limit=20").await;
    assert_eq!(first, hist((9980..10_000).rev()), "the newest page");
    let next = next.expect("a cursor after the newest page");
    let (second, _) = api_page(ui, &format!("limit=20&cursor={next}")).await;
    assert_eq!(second, hist((9960..9980).rev()), "the next page");
    let (filtered, more) = api_page(
        ui,
        "limit=20&status=completed&agent=writer&q=HISTORY%20TREE%20123",
    )
    .await;
    // 123 and 1230–1239: eleven of them, newest first, and no page after.
    let mut want = hist(1230..1240);
    want.reverse();
    want.push("hist00123".to_string());
    assert_eq!((filtered, more), (want, None), "the mission filter");
    let range = format!(
        "limit=20&since={}&until={}",
        1_700_000_000_000u64 + 5_000 * 1000,
        1_700_000_000_000u64 + 5_003 * 1000
    );
    let (in_range, _) = api_page(ui, &range).await;
    assert_eq!(in_range, hist((5000..5003).rev()), "the time range");
    let tree: Value = reqwest::get(format!("{}/api/trees/hist04321", ui.url))
        .await
        .expect("tree")
        .json()
        .await
        .expect("JSON");
    assert_eq!(tree["sessions"][0]["status"], "completed", "{tree}");
    assert_eq!(tree["sessions"][0]["answer"], "answer 4321", "{tree}");
}

/// In Chromium on a store of the 10,000 history trees: the newest page, the next one, a
/// filter and one tree opened from the list.
async fn the_page_pages_through_the_history(ui: &UiServer) {
    let b = Browser::start().await;
    let c = &b.client;
    c.goto(&format!("{}/#/?limit=20", ui.url))
        .await
        .expect("page");
    let roots = "[...document.querySelectorAll('#sessions a.root-link')].map(a => a.textContent)";
    b.until(
        "the newest page",
        "document.querySelectorAll('#sessions tbody tr').length === 20 && \
         document.getElementById('next-page') && \
         document.querySelector('#sessions a.root-link').textContent",
    )
    .await;
    let first: Vec<String> = serde_json::from_value(b.js(roots).await).expect("roots");
    assert_eq!(first, hist((9980..10_000).rev()), "the newest page");
    let pager_text = "document.querySelector('.pager').textContent";
    assert_eq!(b.js(pager_text).await, "older »", "the first page's pager");
    b.js("document.getElementById('next-page').click()").await;
    b.until(
        "the next page",
        "document.getElementById('newest-page') && \
         document.querySelector('#sessions a.root-link').textContent !== 'hist09999' && \
         document.querySelectorAll('#sessions tbody tr').length === 20",
    )
    .await;
    let second: Vec<String> = serde_json::from_value(b.js(roots).await).expect("roots");
    assert_eq!(second, hist((9960..9980).rev()), "the next page");
    assert_eq!(
        b.js(pager_text).await,
        "« newest · older »",
        "the pager's links"
    );
    // A filter reads the index too, and starts again from the newest page.
    b.js(
        "(() => { const q = document.querySelector('input[name=q]'); \
         q.value = 'history tree 1234'; \
         return q.dispatchEvent(new Event('input', { bubbles: true })); })()",
    )
    .await;
    b.until(
        "the one match",
        "document.querySelectorAll('#sessions tbody tr').length === 1 && \
         document.querySelector('#sessions a.root-link').textContent === 'hist01234' && \
         !document.getElementById('next-page')",
    )
    .await;
    // One tree of them, from the list.
    b.js("document.querySelector('#sessions a.root-link').click()")
        .await;
    b.until(
        "the tree",
        "location.hash === '#/tree/hist01234' && \
         document.querySelector('#tree .node .badge') && \
         document.querySelector('#tree .node .badge').textContent === 'completed'",
    )
    .await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_list_pages_through_ten_thousand_trees_and_opens_one() {
    let cfg = slow_demo(0);
    history(cfg.path(), 10_000).await;
    let ui = UiServer::start(&cfg.path().join("skein.toml"), &data_of(cfg.path()), &[]);
    the_api_pages_through_the_history(&ui).await;
    the_page_pages_through_the_history(&ui).await;
}

/// The same on NATS: the 10,000 trees written through the event log port to a real
/// nats-server, the page served by `skein ui --nats` (read-only: no worker is needed to
/// read).
#[tokio::test(flavor = "multi_thread")]
async fn on_nats_the_list_pages_through_ten_thousand_trees_and_opens_one() {
    let server = skein_testnats::NatsServer::start();
    let url = server.url();
    history_on_nats(&url, 10_000).await;
    let cfg = slow_demo(0);
    let ui = UiServer::start(
        &cfg.path().join("skein.toml"),
        &data_of(cfg.path()),
        &["--nats", &url],
    );
    let info: Value = reqwest::get(format!("{}/api/info", ui.url))
        .await
        .expect("info")
        .json()
        .await
        .expect("JSON");
    assert_eq!(info["backend"], "nats", "{info}");
    the_api_pages_through_the_history(&ui).await;
    the_page_pages_through_the_history(&ui).await;
}
