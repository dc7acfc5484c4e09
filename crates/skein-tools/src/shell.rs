//! `shell`: `sh -c COMMAND` in the tree's local workspace directory. Off unless configured,
//! every call approved by a person, a clean environment (no variable of the worker's is
//! passed on), a time limit that kills the command's whole process group, and capped
//! output. It is not a sandbox: the command runs as the worker's user (see docs/tools.md).

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::task::JoinHandle;

use crate::config::ShellConfig;
use crate::files::args;
use crate::text::decode_prefix;
use crate::{Tool, ToolContext, ToolError};

/// The only `PATH` a command gets.
pub const SHELL_PATH: &str = "/usr/bin:/bin";

/// How long the output pipes are drained after the process group is gone.
const DRAIN: Duration = Duration::from_secs(2);

/// Makes this process non-dumpable: another process of the same user (a `shell` command
/// among them) can then no longer open its `/proc/PID/environ`, `mem` or `fd`, nor attach
/// to it. No help against root or holders of `CAP_SYS_PTRACE`. Commands start dumpable
/// again (`execve` resets the flag), which does not matter: they hold no secrets.
#[cfg(target_os = "linux")]
pub fn forbid_same_user_inspection() -> std::io::Result<()> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(std::io::Error::from)
}

/// Elsewhere there is no such switch; the process stays as it is.
#[cfg(not(target_os = "linux"))]
pub fn forbid_same_user_inspection() -> std::io::Result<()> {
    Ok(())
}

/// Whether this process is non-dumpable (always false where the switch does not exist).
#[cfg(target_os = "linux")]
pub fn is_non_dumpable() -> std::io::Result<bool> {
    rustix::process::dumpable_behavior()
        .map(|b| b == rustix::process::DumpableBehavior::NotDumpable)
        .map_err(std::io::Error::from)
}

/// Whether this process is non-dumpable (always false where the switch does not exist).
#[cfg(not(target_os = "linux"))]
pub fn is_non_dumpable() -> std::io::Result<bool> {
    Ok(false)
}

/// `shell`.
pub struct Shell {
    cfg: ShellConfig,
}

impl Shell {
    pub fn new(cfg: ShellConfig) -> Self {
        Self { cfg }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShellArgs {
    /// The command line for sh -c.
    #[schemars(length(min = 1))]
    pub(crate) command: String,
}

/// Kills a process group when dropped, so a cancelled call leaves nothing running.
struct GroupGuard(Option<rustix::process::Pid>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            // ESRCH (already gone) is fine.
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What was read of one output stream.
struct Captured {
    data: Vec<u8>,
    total: u64,
}

/// Reads a stream to its end, keeping at most `cap` bytes and counting the rest.
fn capture<R: AsyncRead + Unpin + Send + 'static>(mut r: R, cap: usize) -> JoinHandle<Captured> {
    tokio::spawn(async move {
        let mut out = Captured {
            data: vec![],
            total: 0,
        };
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    out.total += n as u64;
                    let room = cap.saturating_sub(out.data.len());
                    out.data.extend_from_slice(&buf[..n.min(room)]);
                }
            }
        }
        out
    })
}

async fn collect(h: Option<JoinHandle<Captured>>) -> Captured {
    let empty = || Captured {
        data: vec![],
        total: 0,
    };
    let Some(mut h) = h else {
        return empty();
    };
    match tokio::time::timeout(DRAIN, &mut h).await {
        Ok(Ok(c)) => c,
        _ => {
            h.abort();
            empty()
        }
    }
}

fn section(out: &mut String, name: &str, c: &Captured) {
    out.push_str(&format!("--- {name} ---\n"));
    if c.total == 0 {
        out.push_str("(empty)\n");
        return;
    }
    if (c.data.len() as u64) < c.total {
        let (text, used) = decode_prefix(&c.data);
        out.push_str(&text);
        out.push_str(&format!(
            "\n… [truncated: the first {used} of {} bytes shown]\n",
            c.total
        ));
    } else {
        out.push_str(&String::from_utf8_lossy(&c.data));
        if !c.data.ends_with(b"\n") {
            out.push('\n');
        }
    }
}

fn describe_status(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(code), _) => format!("exit code: {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "exit status unknown".into(),
    }
}

impl Shell {
    async fn run(&self, dir: &Path, command: &str) -> Result<String, ToolError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            ToolError::Failed(format!("the workspace directory is not available: {e}"))
        })?;
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(command)
            .current_dir(dir)
            .env_clear()
            .env("PATH", SHELL_PATH)
            .env("HOME", dir)
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| ToolError::Failed(format!("cannot start /bin/sh: {e}")))?;
        // The child leads its own group: its pid is the group id.
        let mut group = GroupGuard(
            child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .and_then(rustix::process::Pid::from_raw),
        );
        let cap = self.cfg.max_output_bytes;
        let stdout = child.stdout.take().map(|s| capture(s, cap));
        let stderr = child.stderr.take().map(|s| capture(s, cap));
        let status = tokio::time::timeout(self.cfg.timeout, child.wait()).await;
        // Whatever the command left behind in its group goes with it.
        group.kill();
        let status = match status {
            Ok(s) => s.map_err(|e| ToolError::Failed(format!("waiting for the command: {e}")))?,
            Err(_) => {
                let _ = child.kill().await;
                return Err(ToolError::Timeout(self.cfg.timeout));
            }
        };
        let (out, err) = (collect(stdout).await, collect(stderr).await);
        let mut text = describe_status(status);
        text.push('\n');
        section(&mut text, "stdout", &out);
        section(&mut text, "stderr", &err);
        Ok(text)
    }
}

#[async_trait]
impl Tool for Shell {
    fn name(&self) -> &str {
        "shell"
    }
    fn description(&self) -> &str {
        "Run a command with `sh -c` in the workspace directory (needs a person's approval). \
         The environment is empty but for PATH=/usr/bin:/bin, HOME and LANG. Returns the exit \
         code, stdout and stderr."
    }
    fn parameters(&self) -> Value {
        crate::schema::derived::<ShellArgs>()
    }
    fn parallel(&self) -> bool {
        false
    }
    fn requires_approval(&self) -> bool {
        true
    }
    fn timeout(&self) -> Duration {
        // The command keeps its own deadline and kills its group; this is the backstop.
        self.cfg.timeout + DRAIN + Duration::from_secs(3)
    }
    async fn call(&self, ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: ShellArgs = args(a)?;
        let Some(dir) = ctx.workspace.local_root() else {
            return Err(ToolError::Refused(
                "shell needs a workspace that is a local directory; this tree's workspace \
                 is not (it is kept in the cluster's object store)"
                    .into(),
            ));
        };
        let dir = dir.to_path_buf();
        self.run(&dir, &a.command).await
    }
}
