//! `shell`: off by default, then confined to the workspace, a clean environment, a time
//! limit that takes the whole process group down, and capped output.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{builtin, ctx_for, err, ok, MemoryWorkspace, Sandbox};
use serde_json::json;
use skein_tools::{ShellConfig, ToolBox, ToolError, ToolsConfig};

fn shell(cfg: ShellConfig) -> ToolBox {
    ToolBox::builtin(&ToolsConfig {
        shell: ShellConfig {
            enabled: true,
            ..cfg
        },
        ..ToolsConfig::default()
    })
}

fn enabled() -> ToolBox {
    shell(ShellConfig::default())
}

#[tokio::test]
async fn shell_is_off_by_default() {
    let s = Sandbox::new();
    let tb = builtin();
    assert!(tb.get("shell").is_none());
    assert!(!tb.names().contains(&"shell".to_string()));
    let out = tb
        .run(&s.ctx, "shell", &json!({"command": "echo hi"}))
        .await;
    assert!(out.error);
    assert!(
        out.output.contains("unknown tool `shell`"),
        "{}",
        out.output
    );
}

#[tokio::test]
async fn shell_needs_approval() {
    let tb = enabled();
    assert!(tb.requires_approval("shell"));
    assert!(tb.get("shell").unwrap().requires_approval());
}

#[tokio::test]
async fn commands_run_in_the_workspace_directory() {
    let s = Sandbox::new();
    std::fs::write(s.root().join("here.txt"), "x").unwrap();
    let out = ok(
        &enabled(),
        &s.ctx,
        "shell",
        json!({"command": "pwd; ls; echo \"home=$HOME\""}),
    )
    .await;
    let root = s.root().canonicalize().unwrap();
    let root = root.to_str().unwrap();
    assert!(out.starts_with("exit code: 0\n--- stdout ---\n"), "{out}");
    assert!(out.contains(&format!("{root}\nhere.txt\n")), "{out}");
    assert!(
        out.contains(&format!("home={}", s.root().to_str().unwrap())),
        "{out}"
    );
    assert!(out.ends_with("--- stderr ---\n(empty)\n"), "{out}");
}

#[tokio::test]
async fn exit_code_and_stderr_are_reported() {
    let s = Sandbox::new();
    let out = ok(
        &enabled(),
        &s.ctx,
        "shell",
        json!({"command": "echo oops >&2; exit 3"}),
    )
    .await;
    assert_eq!(
        out,
        "exit code: 3\n--- stdout ---\n(empty)\n--- stderr ---\noops\n"
    );
}

#[tokio::test]
async fn the_environment_is_clean() {
    // Set in this process; a leak would show it in `env`.
    std::env::set_var("SKEIN_TEST_SECRET", "hunter2");
    let s = Sandbox::new();
    let out = ok(&enabled(), &s.ctx, "shell", json!({"command": "env"})).await;
    assert!(!out.contains("SKEIN_TEST_SECRET"), "{out}");
    assert!(!out.contains("hunter2"), "{out}");
    assert!(out.contains("PATH=/usr/bin:/bin\n"), "{out}");
    assert!(out.contains("LANG=C.UTF-8\n"), "{out}");
    assert!(
        out.contains(&format!("HOME={}\n", s.root().to_str().unwrap())),
        "{out}"
    );
    // Nothing but these three (and what sh itself sets: PWD, SHLVL, `_`).
    for line in out.lines().skip(2).take_while(|l| !l.starts_with("--- ")) {
        let key = line.split('=').next().unwrap();
        assert!(
            ["PATH", "HOME", "LANG", "PWD", "SHLVL", "_", "OLDPWD"].contains(&key),
            "unexpected variable {line}"
        );
    }
}

#[tokio::test]
async fn a_slow_command_times_out_and_its_group_is_killed() {
    let s = Sandbox::new();
    let tb = shell(ShellConfig {
        timeout: Duration::from_millis(500),
        ..ShellConfig::default()
    });
    let started = Instant::now();
    let e = err(
        &tb,
        &s.ctx,
        "shell",
        json!({"command": "sleep 30 & echo $! > bg.pid; sleep 30"}),
    )
    .await;
    assert!(
        matches!(e, ToolError::Timeout(d) if d == Duration::from_millis(500)),
        "{e:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // The background sleep went down with the group (gone, or a zombie awaiting its reaper).
    let pid = std::fs::read_to_string(s.root().join("bg.pid")).unwrap();
    let pid = pid.trim();
    let mut alive = true;
    for _ in 0..50 {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => alive = false,
            Ok(stat) => alive = !stat.contains(") Z "),
        }
        if !alive {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!alive, "background process {pid} survived the timeout");
}

#[tokio::test]
async fn output_is_capped() {
    let s = Sandbox::new();
    let tb = shell(ShellConfig {
        max_output_bytes: 100,
        ..ShellConfig::default()
    });
    let out = ok(
        &tb,
        &s.ctx,
        "shell",
        json!({"command": "head -c 5000 /dev/zero | tr '\\0' 'y'"}),
    )
    .await;
    let stdout = out
        .split("--- stdout ---\n")
        .nth(1)
        .unwrap()
        .split("--- stderr ---")
        .next()
        .unwrap();
    assert!(stdout.starts_with(&"y".repeat(100)), "{out}");
    assert!(!stdout.starts_with(&"y".repeat(101)), "{out}");
    assert!(
        stdout.contains("[truncated: the first 100 of 5000 bytes shown]"),
        "{out}"
    );
}

#[tokio::test]
async fn a_workspace_that_is_not_local_gets_a_clear_error() {
    let ctx = ctx_for(Arc::new(MemoryWorkspace::default()));
    let e = err(&enabled(), &ctx, "shell", json!({"command": "ls"})).await;
    match e {
        ToolError::Refused(m) => assert!(
            m.contains("needs a workspace that is a local directory"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
}
