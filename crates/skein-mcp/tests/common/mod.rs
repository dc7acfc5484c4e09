//! Real MCP servers from the registries, installed once into the test cache
//! (`$SKEIN_TEST_CACHE`, else `~/.cache/skein-tests`), as tests/run.sh does ahead of the
//! suite: the npm packages with `npm install --prefix`, the Python SDK into a venv. A
//! missing `npm` or `python3` fails the test with what to install; nothing is skipped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Versions pinned here and in tests/run.sh.
pub const NPM_SERVERS: &str = "2026.8.31";
pub const PY_MCP: &str = "1.26.0";

static INSTALL: Mutex<()> = Mutex::new(());

pub fn cache() -> PathBuf {
    if let Ok(c) = std::env::var("SKEIN_TEST_CACHE") {
        return PathBuf::from(c);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache"));
    base.join("skein-tests")
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!(
            "{what}: could not run {:?} ({e}); the MCP suites need node/npm and python3 with \
             venv (Debian: apt-get install nodejs npm python3-venv)",
            cmd.get_program()
        )
    });
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `bin` directory of the npm servers, installed when missing.
pub fn npm_bin() -> PathBuf {
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    let prefix = cache().join(format!("mcp-npm-{NPM_SERVERS}"));
    let bin = prefix.join("node_modules/.bin");
    if !bin.join("mcp-server-filesystem").exists() || !bin.join("mcp-server-everything").exists() {
        run(
            Command::new("npm")
                .arg("install")
                .arg("--prefix")
                .arg(&prefix)
                .args([
                    "--no-audit",
                    "--no-fund",
                    &format!("@modelcontextprotocol/server-filesystem@{NPM_SERVERS}"),
                    &format!("@modelcontextprotocol/server-everything@{NPM_SERVERS}"),
                ]),
            "installing the npm MCP servers",
        );
    }
    bin
}

/// The venv's python with the `mcp` SDK, installed when missing.
pub fn python() -> PathBuf {
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    let venv = cache().join(format!("mcp-py-{PY_MCP}"));
    let py = venv.join("bin/python");
    let ok = py.exists()
        && Command::new(&py)
            .args(["-c", "import mcp.server.fastmcp"])
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        run(
            Command::new("python3").arg("-m").arg("venv").arg(&venv),
            "making the venv for the Python MCP SDK",
        );
        run(
            Command::new(&py).args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &format!("mcp=={PY_MCP}"),
            ]),
            "installing the Python MCP SDK",
        );
    }
    py
}

/// A FastMCP server written for the tests: `python server.py stdio` or
/// `python server.py http PORT`.
pub const FASTMCP_SERVER: &str = r#"
import os, sys, time
from mcp.server.fastmcp import Context, FastMCP
from pydantic import BaseModel

# A start made slow on purpose: while the file named here exists, the server takes three
# seconds more to come up.
if os.path.exists(os.environ.get("SKEIN_TEST_SLOW_START", "/nonexistent")):
    time.sleep(3)

mode = sys.argv[1]
port = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
mcp = FastMCP("skein-test", host="127.0.0.1", port=port)

class Sum(BaseModel):
    total: int

@mcp.tool(annotations={"readOnlyHint": True})
def add(a: int, b: int) -> Sum:
    """Adds two numbers."""
    return Sum(total=a + b)

@mcp.tool()
def slow(seconds: float) -> str:
    """Sleeps, then says so."""
    time.sleep(seconds)
    return f"slept {seconds}"

@mcp.tool(annotations={"readOnlyHint": True})
def fail(why: str) -> str:
    """Always fails."""
    raise ValueError(why)

@mcp.tool(annotations={"readOnlyHint": True})
def pid() -> str:
    """The server's process id."""
    import os
    return str(os.getpid())

def extra() -> str:
    """A tool added while the server runs."""
    return "extra"

def risky() -> str:
    """A tool added while the server runs that may change things."""
    return "risky"

@mcp.tool(annotations={"readOnlyHint": True})
async def grow(ctx: Context) -> str:
    """Adds the tools `extra` and `risky` and says the list changed."""
    mcp.add_tool(extra, annotations={"readOnlyHint": True})
    mcp.add_tool(risky)
    await ctx.session.send_tool_list_changed()
    return "grown"

@mcp.tool(annotations={"readOnlyHint": True})
async def shrink(ctx: Context) -> str:
    """Removes the tool `extra` and says the list changed."""
    mcp.remove_tool("extra")
    await ctx.session.send_tool_list_changed()
    return "shrunk"

@mcp.tool()
def mark(path: str, seconds: float) -> str:
    """Appends this server's process id to a file, then sleeps."""
    import os
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return "marked"

@mcp.tool()
async def nap(path: str, seconds: float) -> str:
    """Notes that it started, sleeps, and notes it if it is cancelled."""
    import anyio, os
    with open(path, "a") as f:
        f.write(f"started {os.getpid()}\n")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        with open(path, "a") as f:
            f.write("cancelled\n")
        raise
    return "rested"

if mode == "stdio":
    mcp.run("stdio")
else:
    mcp.run("streamable-http")
"#;

pub fn write_fastmcp(dir: &Path) -> PathBuf {
    let p = dir.join("server.py");
    std::fs::write(&p, FASTMCP_SERVER).unwrap();
    p
}

/// Kills a child and waits for it when dropped.
pub struct Reaper(pub std::process::Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
