//! Built-in tools end to end through the real binary on the embedded backend: `shell`
//! waits for approval whatever the config says, a tool that times out is an error the
//! model reads and the session goes on, and a large output is kept whole in the blob store
//! while the model sees a long preview and a note.

mod common;

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use serde_json::Value;
use skein_core::SessionId;
use skein_sled::SledStore;

/// A field of an event body as `skein events --json` prints it (`{type, data}`).
fn field<'a>(body: &'a Value, name: &str) -> &'a Value {
    &body["data"][name]
}

fn audit(sb: &Sandbox, root: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = rt.block_on(audit_tree(
        &sb.data(),
        &SessionId::parse(root).unwrap(),
        &sb.dir.path().join("agents"),
    ));
    assert_eq!(n, 1, "one session in the tree");
}

const SHELL_CONFIG: &str = "\n[limits]\napproval_required = []\n\n[tools.shell]\nenabled = true\n";

#[test]
fn shell_waits_for_approval_even_when_the_config_requires_none() {
    let sb = Sandbox::new();
    configure(&sb, SHELL_CONFIG);
    sb.agent(
        "operator",
        "tools: [shell]\n",
        r#"
turns:
  - tool_calls:
      - tool: shell
        args: {command: "echo ran > ran.txt"}
  - answer: "{{ results[0] }}"
"#,
    );
    let out = run(
        &sb,
        &[
            "run",
            "--agent",
            "operator",
            "--id",
            "shellwait",
            "--json",
            "go",
        ],
    );
    assert_eq!(out.status.code(), Some(3), "paused: {}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "awaiting_approval", "{v}");

    let out = run(&sb, &["inbox", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let items: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!(items[0]["kind"], "approval");
    assert_eq!(items[0]["tool"], "shell");
    assert!(
        items[0]["preview"].as_str().unwrap().contains("ran.txt"),
        "{items:?}"
    );
    let file = sb.data().join("workspaces/shellwait/ran.txt");
    assert!(!file.exists(), "the command ran before anyone approved it");
    let log = events(&sb, "shellwait");
    assert_eq!(of_kind(&log, "ApprovalRequested").len(), 1);
    assert!(of_kind(&log, "ToolCalled").is_empty(), "{log:?}");

    // Approval is what it was waiting for: once given, the command runs.
    let token = items[0]["token"].as_str().unwrap().to_string();
    let out = run(&sb, &["approve", &token]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "ran\n");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exit code: 0"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    audit(&sb, "shellwait");
}

#[test]
fn a_tool_that_times_out_is_an_error_the_model_reads_and_the_session_goes_on() {
    // A server that accepts and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    {
        let accepted = accepted.clone();
        std::thread::spawn(move || {
            let mut held = vec![];
            for sock in listener.incoming() {
                accepted.fetch_add(1, Ordering::SeqCst);
                held.push(sock);
            }
        });
    }
    let sb = Sandbox::new();
    configure(
        &sb,
        "\n[tools.http]\nallow_cidrs = [\"127.0.0.1\"]\ntimeout = \"300ms\"\n",
    );
    sb.agent(
        "fetcher",
        "tools: [http_fetch]\n",
        &format!(
            r#"
turns:
  - tool_calls:
      - tool: http_fetch
        args: {{url: "http://127.0.0.1:{port}/slow"}}
  - answer: "the fetch said: {{{{ results[0] }}}}"
"#
        ),
    );
    let out = run(
        &sb,
        &[
            "run",
            "--agent",
            "fetcher",
            "--id",
            "slowfetch",
            "--json",
            "fetch",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(
        v["answer"], "the fetch said: http_fetch: timed out after 300ms",
        "{v}"
    );
    assert!(
        accepted.load(Ordering::SeqCst) >= 1,
        "the fetch never reached the silent server"
    );
    let log = events(&sb, "slowfetch");
    let returned = of_kind(&log, "ToolReturned");
    assert_eq!(returned.len(), 1, "{log:?}");
    assert_eq!(field(&returned[0]["body"], "error"), &Value::Bool(true));
    assert_eq!(of_kind(&log, "ModelCalled").len(), 2, "{log:?}");
    audit(&sb, "slowfetch");
}

#[test]
fn a_large_output_is_kept_whole_as_a_blob_and_the_model_sees_a_preview_and_a_note() {
    let sb = Sandbox::new();
    configure(&sb, "\n[runtime]\nblob_threshold = 2000\n");
    sb.agent(
        "reader",
        "tools: [read_file]\n",
        r#"
turns:
  - tool_calls:
      - tool: read_file
        args: {path: "big.txt"}
  - answer: "{{ results[0] }}"
"#,
    );
    // 10,000 bytes, every 100-byte line numbered so a cut shows where it fell.
    let content: String = (0..100)
        .map(|i| format!("line {i:03} {}\n", "x".repeat(90)))
        .collect();
    assert_eq!(content.len(), 10_000);
    let ws = sb.data().join("workspaces/bigread");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("big.txt"), &content).unwrap();

    let out = run(
        &sb,
        &[
            "run", "--agent", "reader", "--id", "bigread", "--json", "read it",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "completed", "{v}");

    let log = events(&sb, "bigread");
    let returned = of_kind(&log, "ToolReturned");
    assert_eq!(returned.len(), 1, "{log:?}");
    let body = &returned[0]["body"];
    let blob = field(body, "blob");
    let hash = blob["hash"].as_str().unwrap_or_else(|| panic!("{body}"));
    assert_eq!(blob["size"], 10_000, "{body}");
    let output = field(body, "output").as_str().unwrap().to_string();

    // What the model saw: the first 2,000 bytes, then the note.
    let answer = v["answer"].as_str().unwrap();
    assert_eq!(answer, output, "the model sees the recorded output");
    assert!(answer.starts_with(&content[..2000]), "{answer}");
    let note = &answer[2000..];
    assert!(
        !note.contains("line 020"),
        "more than the preview shown: {note}"
    );
    for part in [
        "10000 bytes in all",
        "only the first 2000 shown here; the rest is not shown",
        hash,
        "read on with offset 2000",
    ] {
        assert!(
            note.contains(part),
            "`{part}` missing from the note: {note}"
        );
    }

    // The blob holds the whole output.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let stored = rt.block_on(async {
        let store = SledStore::open(&sb.data(), &sb.data().join("workspaces")).unwrap();
        store.backend().blobs.get(hash).await.unwrap()
    });
    drop(rt);
    assert_eq!(stored.as_deref(), Some(content.as_bytes()));
    audit(&sb, "bigread");
}
