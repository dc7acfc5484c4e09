//! Enabling `shell` makes the process non-dumpable, so a command run as the same user
//! cannot read the worker's environment through /proc. In a binary of its own: the switch
//! holds for the whole process.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use skein_tools::shell::is_non_dumpable;
use skein_tools::{ShellConfig, ToolBox, ToolsConfig};

/// Whether another process of this user can read this process's environment.
fn environ_readable_by_a_child() -> bool {
    Command::new("/bin/cat")
        .arg(format!("/proc/{}/environ", std::process::id()))
        .output()
        .unwrap()
        .status
        .success()
}

#[cfg(target_os = "linux")]
#[test]
fn building_a_toolbox_with_shell_makes_the_process_non_dumpable() {
    assert!(!is_non_dumpable().unwrap(), "dumpable to begin with");
    // Without shell nothing changes.
    let tb = ToolBox::builtin(&ToolsConfig::default());
    assert!(tb.get("shell").is_none());
    assert!(!is_non_dumpable().unwrap());
    let as_root = rustix::process::geteuid().is_root();
    if !as_root {
        assert!(environ_readable_by_a_child(), "readable while dumpable");
    }

    let tb = ToolBox::builtin(&ToolsConfig {
        shell: ShellConfig {
            enabled: true,
            ..ShellConfig::default()
        },
        ..ToolsConfig::default()
    });
    assert!(tb.get("shell").is_some());
    assert!(
        is_non_dumpable().unwrap(),
        "still dumpable with shell enabled"
    );
    // The point of it; root reads every process's /proc whatever the flag says.
    if !as_root {
        assert!(
            !environ_readable_by_a_child(),
            "a same-user process read /proc/PID/environ of a non-dumpable process"
        );
    }
}
