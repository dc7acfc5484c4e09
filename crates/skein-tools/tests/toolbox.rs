//! The tool box: argument checking against schemas, time limits, and what the config
//! registers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::{builtin, err, Sandbox};
use serde_json::{json, Value};
use skein_tools::schema::{check_schema, validate};
use skein_tools::{Tool, ToolBox, ToolContext, ToolError, ToolSource, ToolsConfig};

fn invalid(e: ToolError) -> String {
    match e {
        ToolError::InvalidArgs(m) => m,
        other => panic!("expected invalid arguments, got {other:?}"),
    }
}

#[tokio::test]
async fn a_missing_required_argument_is_named() {
    let s = Sandbox::new();
    let tb = builtin();
    let m = invalid(err(&tb, &s.ctx, "write_file", json!({"path": "a.txt"})).await);
    assert_eq!(m, "`content` is required but missing");
    // run() shows it to the model as a tool error, tool name first.
    let out = tb
        .run(&s.ctx, "write_file", &json!({"path": "a.txt"}))
        .await;
    assert!(out.error);
    assert_eq!(
        out.output,
        "write_file: invalid arguments: `content` is required but missing"
    );
    assert!(!s.root().join("a.txt").exists());
}

#[tokio::test]
async fn a_wrong_type_is_named_with_what_came() {
    let s = Sandbox::new();
    let m = invalid(err(&builtin(), &s.ctx, "read_file", json!({"path": 42})).await);
    assert_eq!(m, "`path` must be a string, got an integer (42)");
    let m = invalid(
        err(
            &builtin(),
            &s.ctx,
            "search_files",
            json!({"pattern": "x", "regex": "yes"}),
        )
        .await,
    );
    assert_eq!(m, "`regex` must be a boolean, got a string (\"yes\")");
}

#[tokio::test]
async fn an_unknown_property_is_named() {
    let s = Sandbox::new();
    let m = invalid(
        err(
            &builtin(),
            &s.ctx,
            "read_file",
            json!({"path": "a", "mode": "rb"}),
        )
        .await,
    );
    assert_eq!(m, "`mode` is not a known argument (accepted: offset, path)");
}

#[tokio::test]
async fn every_problem_is_reported_at_once() {
    let s = Sandbox::new();
    let m = invalid(
        err(
            &builtin(),
            &s.ctx,
            "write_file",
            json!({"content": 1, "x": true}),
        )
        .await,
    );
    assert!(m.contains("`path` is required but missing"), "{m}");
    assert!(m.contains("`content` must be a string"), "{m}");
    assert!(m.contains("`x` is not a known argument"), "{m}");
}

#[tokio::test]
async fn arguments_must_be_an_object() {
    let s = Sandbox::new();
    let m = invalid(err(&builtin(), &s.ctx, "list_dir", json!(["a"])).await);
    assert!(
        m.starts_with("the arguments must be an object, got an array"),
        "{m}"
    );
    // No arguments at all is an empty object.
    let out = builtin().run(&s.ctx, "list_dir", &Value::Null).await;
    assert!(!out.error, "{}", out.output);
}

#[test]
fn the_validator_covers_enum_bounds_items_and_nesting() {
    let schema = json!({
        "type": "object",
        "properties": {
            "method": {"type": "string", "enum": ["GET", "POST"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string"}},
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
            "name": {"type": "string", "minLength": 2, "maxLength": 3}
        },
        "additionalProperties": false
    });
    check_schema(&schema).unwrap();
    let ok = json!({"method": "GET", "n": 5, "tags": ["a"], "headers": {"A": "b"}, "name": "ab"});
    assert_eq!(validate(&schema, &ok), Ok(()));
    let errs = |v: Value| validate(&schema, &v).unwrap_err();
    assert_eq!(
        errs(json!({"method": "PUT"})),
        vec!["`method` must be one of \"GET\", \"POST\", got a string (\"PUT\")"]
    );
    assert_eq!(errs(json!({"n": 0})), vec!["`n` must be at least 1, got 0"]);
    assert_eq!(errs(json!({"n": 6})), vec!["`n` must be at most 5, got 6"]);
    assert_eq!(
        errs(json!({"n": 2.5})),
        vec!["`n` must be an integer, got a number (2.5)"]
    );
    assert_eq!(validate(&schema, &json!({"n": 2.0})), Ok(()));
    assert_eq!(
        errs(json!({"tags": ["a", 3]})),
        vec!["`tags[1]` must be a string, got an integer (3)"]
    );
    assert_eq!(
        errs(json!({"headers": {"Accept": 1}})),
        vec!["`headers.Accept` must be a string, got an integer (1)"]
    );
    assert_eq!(
        errs(json!({"name": "abcd"})),
        vec!["`name` must be at most 3 characters long, got 4"]
    );
}

#[test]
fn every_builtin_schema_uses_only_what_the_validator_enforces() {
    let mut cfg = ToolsConfig::default();
    cfg.shell.enabled = true;
    let tb = ToolBox::builtin(&cfg);
    assert_eq!(tb.specs().len(), 8);
    for spec in tb.specs() {
        check_schema(&spec.parameters).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        assert_eq!(spec.parameters["type"], "object", "{}", spec.name);
        assert_eq!(
            spec.parameters["additionalProperties"], false,
            "{}",
            spec.name
        );
        assert!(!spec.description.is_empty());
    }
    // And the check does catch a keyword nobody enforces.
    let e = check_schema(
        &json!({"type": "object", "properties": {"p": {"type": "string", "pattern": "^a"}}}),
    )
    .unwrap_err();
    assert!(e.contains("`pattern` is not supported"), "{e}");
    let e = check_schema(&json!({"type": "object", "required": ["x"]})).unwrap_err();
    assert!(e.contains("required `x`"), "{e}");
}

/// A tool that sleeps longer than it is allowed to.
struct Sleepy;

#[async_trait]
impl Tool for Sleepy {
    fn name(&self) -> &str {
        "sleepy"
    }
    fn description(&self) -> &str {
        "sleeps"
    }
    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    }
    fn timeout(&self) -> Duration {
        Duration::from_millis(50)
    }
    async fn call(&self, _: &ToolContext, _: Value) -> Result<String, ToolError> {
        tokio::time::sleep(Duration::from_secs(10)).await;
        Ok("woke".into())
    }
}

/// A tool that panics.
struct Broken;

#[async_trait]
impl Tool for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    fn description(&self) -> &str {
        "panics"
    }
    fn parameters(&self) -> Value {
        json!({"type": "object"})
    }
    async fn call(&self, _: &ToolContext, _: Value) -> Result<String, ToolError> {
        panic!("boom")
    }
}

/// A source whose list is what `offered` holds; it knows `broken` without offering it.
struct Changing {
    offered: std::sync::Mutex<Vec<&'static str>>,
    refreshed: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl ToolSource for Changing {
    fn names(&self) -> Vec<String> {
        let offered = self.offered.lock().unwrap();
        offered.iter().map(|n| n.to_string()).collect()
    }
    fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        match name {
            "sleepy" => Some(Arc::new(Sleepy)),
            "broken" => Some(Arc::new(Broken)),
            _ => None,
        }
    }
    async fn refresh(&self) {
        self.refreshed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.offered.lock().unwrap().push("sleepy");
    }
}

#[tokio::test]
async fn a_source_s_tools_follow_its_list_and_one_it_does_not_offer_still_answers() {
    let s = Sandbox::new();
    let mut tb = builtin();
    let source = Arc::new(Changing {
        offered: std::sync::Mutex::new(vec![]),
        refreshed: Default::default(),
    });
    tb.add_source(source.clone());
    assert!(!tb.names().iter().any(|n| n == "sleepy"));
    assert!(tb.spec("sleepy").is_none());
    tb.refresh().await;
    assert!(source.refreshed.load(std::sync::atomic::Ordering::SeqCst));
    let names = tb.names();
    assert!(names.iter().any(|n| n == "sleepy"), "{names:?}");
    assert!(names.iter().any(|n| n == "read_file"), "{names:?}");
    assert_eq!(tb.spec("sleepy").unwrap().description, "sleeps");
    assert!(tb.specs().iter().any(|s| s.name == "sleepy"));
    // Known but not offered: not shown to a model, yet a call of it runs (and says why
    // it fails) rather than being an unknown tool.
    assert!(tb.spec("broken").is_none());
    let out = tb.run(&s.ctx, "broken", &json!({})).await;
    assert_eq!(out.output, "broken: the tool crashed");
    let out = tb.run(&s.ctx, "nothing", &json!({})).await;
    assert!(out.output.contains("unknown tool"), "{out:?}");
}

#[tokio::test]
async fn a_tool_over_its_time_is_a_tool_error() {
    let s = Sandbox::new();
    let mut tb = ToolBox::new();
    tb.insert(Arc::new(Sleepy));
    let started = Instant::now();
    let e = err(&tb, &s.ctx, "sleepy", json!({})).await;
    assert!(
        matches!(e, ToolError::Timeout(d) if d == Duration::from_millis(50)),
        "{e:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let out = tb.run(&s.ctx, "sleepy", &json!({})).await;
    assert!(out.error);
    assert_eq!(out.output, "sleepy: timed out after 50ms");
}

#[tokio::test]
async fn a_panicking_tool_and_an_unknown_tool_are_tool_errors() {
    let s = Sandbox::new();
    let mut tb = ToolBox::new();
    tb.insert(Arc::new(Broken));
    let out = tb.run(&s.ctx, "broken", &json!({})).await;
    assert!(out.error);
    assert_eq!(out.output, "broken: the tool crashed");
    let out = tb.run(&s.ctx, "nope", &json!({})).await;
    assert!(out.error);
    assert!(out.output.contains("unknown tool `nope`"), "{}", out.output);
}

#[test]
fn the_config_decides_what_is_registered() {
    let tb = ToolBox::builtin(&ToolsConfig::default());
    assert_eq!(
        tb.names(),
        vec![
            "get_file_info",
            "http_fetch",
            "list_dir",
            "list_directory",
            "read_file",
            "search_files",
            "write_file"
        ]
    );
    assert!(tb.get("shell").is_none());
    let cfg: ToolsConfig =
        toml::from_str("[http]\nenabled = false\n[shell]\nenabled = true\n").unwrap();
    let tb = ToolBox::builtin(&cfg);
    assert!(tb.get("http_fetch").is_none());
    assert!(tb.get("shell").is_some());
    assert!(tb.requires_approval("shell"));
    assert!(!tb.parallel("shell"));
    assert!(!tb.requires_approval("read_file"));
    assert!(tb.idempotent("read_file"));
    assert!(!tb.parallel("write_file"));
}

/// The runtime decides approvals from skein-core's list alone (so a log replays the same
/// under any config); a built-in tool asking for approval must be on it.
#[test]
fn every_builtin_tool_asking_for_approval_is_always_approved_by_the_core() {
    let cfg: ToolsConfig =
        toml::from_str("[http]\nenabled = true\n[shell]\nenabled = true\n").unwrap();
    let tb = ToolBox::builtin(&cfg);
    let asking: Vec<String> = tb
        .names()
        .into_iter()
        .filter(|n| tb.requires_approval(n))
        .collect();
    assert!(
        asking.contains(&"shell".to_string()),
        "shell asks for approval: {asking:?}"
    );
    for name in &asking {
        assert!(
            skein_core::agent::ALWAYS_APPROVED.contains(&name.as_str()),
            "`{name}` asks for approval but is not in skein_core::agent::ALWAYS_APPROVED"
        );
    }
    // And the other way: the core does not hold back a built-in tool that never asks.
    for name in skein_core::agent::ALWAYS_APPROVED {
        assert!(
            tb.requires_approval(name),
            "`{name}` is always approved by the core but is not a built-in tool asking for it"
        );
        assert!(skein_core::agent::BUILTIN_TOOLS.contains(name), "{name}");
    }
}

#[test]
fn an_empty_table_is_the_default_and_the_documented_example_parses() {
    let empty: ToolsConfig = toml::from_str("").unwrap();
    assert_eq!(empty, ToolsConfig::default());
    assert!(!empty.shell.enabled);
    assert!(empty.http.enabled);
    let full: ToolsConfig = toml::from_str(
        r#"
        [files]
        max_read_bytes = 1000
        max_write_bytes = 2000
        max_list_entries = 50
        [search]
        max_files = 10
        max_matches = 5
        max_file_bytes = 4096
        [http]
        enabled = true
        timeout = "1500ms"
        max_response_bytes = 100
        max_redirects = 2
        allow_hosts = ["intranet.example"]
        allow_cidrs = ["127.0.0.1/32", "10.1.0.0/16", "::1"]
        [shell]
        enabled = true
        timeout = 5
        max_output_bytes = 10
        "#,
    )
    .unwrap();
    assert_eq!(full.http.timeout, Duration::from_millis(1500));
    assert_eq!(full.shell.timeout, Duration::from_secs(5));
    assert_eq!(full.http.allow_cidrs.len(), 3);
    assert!(full.http.allow_cidrs[2].contains("::1".parse().unwrap()));
    assert_eq!(full.search.max_matches, 5);
    // Round trip (what `--dump-config` prints parses back to the same).
    let dumped = toml::to_string(&full).unwrap();
    assert_eq!(toml::from_str::<ToolsConfig>(&dumped).unwrap(), full);
}

#[test]
fn bad_config_is_refused_with_the_reason() {
    let e = toml::from_str::<ToolsConfig>("[http]\nallow_cidrs = [\"10.0.0.0/33\"]\n").unwrap_err();
    assert!(e.to_string().contains("10.0.0.0/33"), "{e}");
    let e = toml::from_str::<ToolsConfig>("[shell]\ntimeout = \"soon\"\n").unwrap_err();
    assert!(e.to_string().contains("not a duration"), "{e}");
    let e = toml::from_str::<ToolsConfig>("[shell]\nenable = true\n").unwrap_err();
    assert!(e.to_string().contains("enable"), "{e}");
}

/// A tool that counts how often its schema is derived, and refuses a call without `n`.
struct Counted(Arc<std::sync::atomic::AtomicUsize>);

#[async_trait]
impl Tool for Counted {
    fn name(&self) -> &str {
        "counted"
    }
    fn description(&self) -> &str {
        "counts"
    }
    fn parameters(&self) -> Value {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    }
    async fn call(&self, _: &ToolContext, a: Value) -> Result<String, ToolError> {
        Ok(a["n"].to_string())
    }
}

#[tokio::test]
async fn a_fixed_tool_s_schema_is_derived_once_and_still_checks_every_call() {
    let s = Sandbox::new();
    let derived = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tb = ToolBox::new();
    tb.insert(Arc::new(Counted(derived.clone())));
    for n in 0..3 {
        let spec = tb.spec("counted").unwrap();
        assert_eq!(spec.parameters["required"], json!(["n"]));
        assert_eq!(
            tb.try_run(&s.ctx, "counted", &json!({"n": n}))
                .await
                .unwrap(),
            n.to_string()
        );
        let m = invalid(tb.try_run(&s.ctx, "counted", &json!({})).await.unwrap_err());
        assert_eq!(m, "`n` is required but missing");
    }
    assert_eq!(derived.load(std::sync::atomic::Ordering::SeqCst), 1);
}
