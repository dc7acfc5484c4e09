//! The client against real servers it did not write: the reference filesystem and
//! "everything" servers from npm, and a FastMCP server of the Python SDK, over stdio and
//! Streamable HTTP. About 10 s on two cores once the servers are installed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use skein_core::SessionId;
use skein_mcp::{McpConfig, McpTools, ServerConfig};
use skein_tools::{LocalWorkspace, ToolBox, ToolContext};

#[derive(Default)]
struct MemBlobs(Mutex<HashMap<String, Vec<u8>>>);

#[async_trait]
impl skein_ports::ports::Blobs for MemBlobs {
    async fn put(&self, data: &[u8]) -> skein_ports::Result<String> {
        let h = blake3_like(data);
        self.0.lock().unwrap().insert(h.clone(), data.to_vec());
        Ok(h)
    }
    async fn get(&self, hash: &str) -> skein_ports::Result<Option<Vec<u8>>> {
        Ok(self.0.lock().unwrap().get(hash).cloned())
    }
}

fn blake3_like(data: &[u8]) -> String {
    // A stand-in name: the test only needs the bytes found again under it.
    format!(
        "{:016x}{}",
        data.iter()
            .fold(0u64, |h, b| h.wrapping_mul(31) ^ *b as u64),
        data.len()
    )
}

fn ctx(dir: &std::path::Path, blobs: Arc<MemBlobs>) -> ToolContext {
    ToolContext {
        session: SessionId::root("mcp-test").unwrap(),
        workspace: Arc::new(LocalWorkspace::new(dir.to_path_buf())),
        blobs: Some(blobs),
        progress: None,
    }
}

fn stdio(command: impl Into<String>, args: &[&str]) -> ServerConfig {
    ServerConfig {
        command: Some(command.into()),
        args: args.iter().map(|s| s.to_string()).collect(),
        ..ServerConfig::default()
    }
}

async fn start(servers: Vec<(&str, ServerConfig)>) -> (McpTools, ToolBox) {
    let cfg = McpConfig {
        servers: servers
            .into_iter()
            .map(|(n, c)| (n.to_string(), c))
            .collect(),
    };
    let mcp = McpTools::start(&cfg).await;
    assert!(
        mcp.failed.is_empty(),
        "servers failed to start: {:?}",
        mcp.failed
    );
    let mut tb = ToolBox::new();
    assert!(mcp.add_to(&mut tb).is_empty());
    (mcp, tb)
}

#[tokio::test]
async fn the_filesystem_server_reads_writes_behind_approval_and_refuses_outside_its_root() {
    let bin = common::npm_bin();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello.txt"), "hello from a file\n").unwrap();
    let root = dir.path().to_str().unwrap();
    let (mcp, tb) = start(vec![(
        "fs",
        stdio(bin.join("mcp-server-filesystem").to_str().unwrap(), &[root]),
    )])
    .await;
    let names = tb.names();
    for n in ["fs__read_text_file", "fs__write_file", "fs__list_directory"] {
        assert!(names.contains(&n.to_string()), "{n} in {names:?}");
    }
    // Annotations decide approval: read-only tools run, writers wait for a person.
    assert!(!tb.requires_approval("fs__read_text_file"));
    assert!(tb.requires_approval("fs__write_file"));
    assert!(tb.requires_approval("fs__edit_file"));
    assert!(tb.idempotent("fs__read_text_file") && !tb.idempotent("fs__write_file"));

    let c = ctx(dir.path(), Arc::default());
    let path = dir.path().join("hello.txt");
    let out = tb
        .run(&c, "fs__read_text_file", &json!({"path": path}))
        .await;
    assert!(
        !out.error && out.output.contains("hello from a file"),
        "{out:?}"
    );
    let out = tb
        .run(
            &c,
            "fs__write_file",
            &json!({"path": dir.path().join("new.txt"), "content": "new"}),
        )
        .await;
    assert!(!out.error, "{out:?}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("new.txt")).unwrap(),
        "new"
    );
    // The server's own refusal is a tool error the model reads.
    let out = tb
        .run(&c, "fs__read_text_file", &json!({"path": "/etc/hostname"}))
        .await;
    assert!(out.error, "{out:?}");
    assert!(out.output.starts_with("fs__read_text_file: "), "{out:?}");
    // Arguments are checked against the server's schema before the call.
    let out = tb.run(&c, "fs__read_text_file", &json!({})).await;
    assert!(
        out.error && out.output.contains("invalid arguments"),
        "{out:?}"
    );
    mcp.close().await;
}

#[tokio::test]
async fn the_everything_server_gives_images_as_blobs_structured_content_and_times_out() {
    let bin = common::npm_bin();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = stdio(
        bin.join("mcp-server-everything").to_str().unwrap(),
        &["stdio"],
    );
    cfg.timeout = Duration::from_secs(2);
    let (mcp, tb) = start(vec![("every", cfg)]).await;
    let blobs = Arc::new(MemBlobs::default());
    let c = ctx(dir.path(), blobs.clone());

    let out = tb.run(&c, "every__echo", &json!({"message": "ping"})).await;
    assert!(!out.error && out.output.contains("ping"), "{out:?}");

    let out = tb.run(&c, "every__get-tiny-image", &json!({})).await;
    assert!(!out.error, "{out:?}");
    assert!(out.output.contains("[image image/png"), "{}", out.output);
    let stored = blobs
        .0
        .lock()
        .unwrap()
        .values()
        .next()
        .cloned()
        .expect("a blob was kept");
    assert!(stored.starts_with(b"\x89PNG"), "the image's bytes, decoded");
    assert!(
        !out.output.contains("iVBOR"),
        "no base64 for the model: {}",
        out.output
    );

    let out = tb
        .run(
            &c,
            "every__get-structured-content",
            &json!({"location": "Chicago"}),
        )
        .await;
    assert!(!out.error && out.output.contains("temperature"), "{out:?}");

    // Past the server's timeout the call is a tool error, and the server is still used.
    let out = tb
        .run(
            &c,
            "every__trigger-long-running-operation",
            &json!({"duration": 30, "steps": 3}),
        )
        .await;
    assert!(out.error && out.output.contains("timed out"), "{out:?}");
    let out = tb
        .run(&c, "every__echo", &json!({"message": "after"}))
        .await;
    assert!(!out.error && out.output.contains("after"), "{out:?}");
    assert_eq!(mcp.servers[0].restarts(), 0);
    mcp.close().await;
}

async fn wait_for_port(port: u16) {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing listens on port {port} after 10 s");
}

#[tokio::test]
async fn the_everything_server_over_streamable_http() {
    let bin = common::npm_bin();
    let port = skein_testnats::free_port();
    let _server = common::Reaper(
        std::process::Command::new(bin.join("mcp-server-everything"))
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_port(port).await;
    std::env::set_var("SKEIN_TEST_MCP_TOKEN", "Bearer not-a-real-token");
    let cfg = ServerConfig {
        url: Some(format!("http://127.0.0.1:{port}/mcp")),
        headers_env: [(
            "Authorization".to_string(),
            "SKEIN_TEST_MCP_TOKEN".to_string(),
        )]
        .into(),
        ..ServerConfig::default()
    };
    let (mcp, tb) = start(vec![("web", cfg)]).await;
    let dir = tempfile::tempdir().unwrap();
    let c = ctx(dir.path(), Arc::default());
    let out = tb
        .run(&c, "web__echo", &json!({"message": "over http"}))
        .await;
    assert!(!out.error && out.output.contains("over http"), "{out:?}");
    let out = tb.run(&c, "web__get-sum", &json!({"a": 2, "b": 40})).await;
    assert!(!out.error && out.output.contains("42"), "{out:?}");
    mcp.close().await;
}

#[tokio::test]
async fn a_fastmcp_server_over_stdio_is_started_again_when_it_dies() {
    let py = common::python();
    let dir = tempfile::tempdir().unwrap();
    let script = common::write_fastmcp(dir.path());
    let mut cfg = stdio(py.to_str().unwrap(), &[script.to_str().unwrap(), "stdio"]);
    cfg.timeout = Duration::from_secs(2);
    let slow_start = dir.path().join("slow-start");
    cfg.env.insert(
        "SKEIN_TEST_SLOW_START".into(),
        slow_start.display().to_string(),
    );
    let (mcp, tb) = start(vec![("py", cfg)]).await;
    assert!(!tb.requires_approval("py__add"), "marked read-only");
    assert!(tb.requires_approval("py__slow"), "no annotations: approval");
    let c = ctx(dir.path(), Arc::default());

    let out = tb.run(&c, "py__add", &json!({"a": 2, "b": 3})).await;
    assert!(
        !out.error && out.output.contains("\"total\"") && out.output.contains('5'),
        "{out:?}"
    );
    let out = tb
        .run(&c, "py__fail", &json!({"why": "the disk is on fire"}))
        .await;
    assert!(
        out.error && out.output.contains("the disk is on fire"),
        "{out:?}"
    );

    // A tool added while it runs is listed again after `tools/list_changed`.
    let srv = &mcp.servers[0];
    assert!(srv.tool("extra").is_none());
    let out = tb.run(&c, "py__grow", &json!({})).await;
    assert!(!out.error, "{out:?}");
    tb.refresh().await;
    assert!(srv.tool("extra").is_some(), "{:?}", srv.tools());
    // It is offered at once, and runs; one that would need approval is neither offered
    // nor run, since the approval rules were fixed at start.
    let names = tb.names();
    assert!(names.iter().any(|n| n == "py__extra"), "{names:?}");
    assert!(!names.iter().any(|n| n == "py__risky"), "{names:?}");
    assert!(tb.spec("py__extra").is_some());
    assert!(
        tb.spec("py__risky").is_none(),
        "named in `tools:`, it is still not shown"
    );
    assert!(!tb.requires_approval("py__extra"));
    let out = tb.run(&c, "py__extra", &json!({})).await;
    assert!(!out.error && out.output == "extra", "{out:?}");
    let out = tb.run(&c, "py__risky", &json!({})).await;
    assert!(
        out.error && out.output.contains("after the worker started"),
        "{out:?}"
    );
    // A tool the server lists no more is not offered, and a call of it is a tool error.
    let out = tb.run(&c, "py__shrink", &json!({})).await;
    assert!(!out.error, "{out:?}");
    tb.refresh().await;
    assert!(!tb.names().iter().any(|n| n == "py__extra"));
    let out = tb.run(&c, "py__extra", &json!({})).await;
    assert!(
        out.error && out.output.contains("no longer lists"),
        "{out:?}"
    );

    // A call past its timeout is cancelled at the server, which stops the tool.
    let naps = dir.path().join("naps.txt");
    let out = tb
        .run(&c, "py__nap", &json!({"path": naps, "seconds": 30}))
        .await;
    assert!(out.error && out.output.contains("timed out"), "{out:?}");
    let mut heard = false;
    for _ in 0..100 {
        if std::fs::read_to_string(&naps)
            .unwrap_or_default()
            .contains("cancelled")
        {
            heard = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(heard, "{:?}", std::fs::read_to_string(&naps));

    let first = tb.run(&c, "py__pid", &json!({})).await.output;
    let pid: i32 = first
        .trim()
        .parse()
        .expect("the text alone: the structured copy is not repeated");
    // Started again, it takes longer to come up than a call may take: the start has its
    // own limit (`startup_timeout`), and the call its whole `timeout` after it.
    std::fs::write(&slow_start, "").unwrap();
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    // Its death is noticed when its output closes; the next call starts it again.
    for _ in 0..100 {
        if !srv.current().await.is_some_and(|c| c.alive()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = tb.run(&c, "py__pid", &json!({})).await;
    assert!(!second.error, "{second:?}");
    assert_ne!(second.output.trim(), first.trim());
    assert_eq!(srv.restarts(), 1);
    mcp.close().await;
}

#[tokio::test]
async fn a_fastmcp_server_over_streamable_http_and_one_that_will_not_start() {
    let py = common::python();
    let dir = tempfile::tempdir().unwrap();
    let script = common::write_fastmcp(dir.path());
    let port = skein_testnats::free_port();
    let _server = common::Reaper(
        std::process::Command::new(&py)
            .arg(&script)
            .args(["http", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_port(port).await;
    let mut cfg = ServerConfig {
        url: Some(format!("http://127.0.0.1:{port}/mcp")),
        ..ServerConfig::default()
    };
    cfg.timeout = Duration::from_secs(1);
    let broken = stdio("/nonexistent/mcp-server", &[]);
    let mcp = McpTools::start(&McpConfig {
        servers: [("py".to_string(), cfg), ("broken".to_string(), broken)].into(),
    })
    .await;
    assert_eq!(mcp.failed.len(), 1, "{:?}", mcp.failed);
    assert_eq!(mcp.failed[0].0, "broken");
    assert!(
        mcp.failed[0].1.contains("could not start"),
        "{:?}",
        mcp.failed
    );
    let mut tb = ToolBox::new();
    mcp.add_to(&mut tb);
    let c = ctx(dir.path(), Arc::default());
    let out = tb.run(&c, "py__add", &json!({"a": 20, "b": 22})).await;
    assert!(!out.error && out.output.contains("42"), "{out:?}");
    let out = tb.run(&c, "py__slow", &json!({"seconds": 2})).await;
    assert!(out.error && out.output.contains("timed out"), "{out:?}");
    mcp.close().await;
}
