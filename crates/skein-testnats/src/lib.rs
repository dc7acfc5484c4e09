//! skein-testnats: starts real `nats-server` processes for tests.
//!
//! Each server gets free loopback ports, its own JetStream store directory and a config
//! file; it is killed by pid on drop. [`NatsServer::restart`] keeps its ports and store
//! (file storage survives), [`Cluster`] runs three routed JetStream nodes. Readiness is
//! polled on the monitoring endpoint (`/healthz`), never assumed after a sleep. A missing
//! `nats-server` fails loudly with how to install it: a test never passes without one.
//! [`NatsServer::start_with_auth`] starts one that refuses clients without credentials,
//! [`NatsServer::start_with_config`] one with any extra configuration.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `nats-server` binary: `$NATS_SERVER`, then `PATH`, then `/usr/sbin`.
pub fn nats_server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER") {
        return PathBuf::from(p);
    }
    let path = std::env::var("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")])
    {
        let p = dir.join("nats-server");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "nats-server is not installed, and the NATS tests need a real server. Install it with \
         `apt-get install nats-server` (Debian/Ubuntu), or put a nats-server 2.9+ binary on \
         PATH or in $NATS_SERVER. `bash tests/run.sh` installs it when run as root."
    );
}

/// What `nats-server --version` prints for the binary the tests use, e.g. `nats-server: v2.9.10`.
pub fn nats_server_version() -> String {
    let bin = nats_server_bin();
    match Command::new(&bin).arg("--version").output() {
        Ok(o) => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        Err(e) => panic!("cannot run {}: {e}", bin.display()),
    }
}

/// A free TCP port on 127.0.0.1.
///
/// Taken at random below the kernel's ephemeral range where it can: a port from that range
/// (what a bind to port 0 returns) may be taken, between the check and the server's bind
/// or while a node is down for a restart, by any process's outgoing connection; a port
/// below it only by another listener.
pub fn free_port() -> u16 {
    // The kernel may hand the same free port to two binds made one after the other (the
    // first listener is gone by then): never give out a port twice in this process, so a
    // node's client, monitoring and route ports, and those of its peers, all differ.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let below = ephemeral_low().filter(|low| *low > LOWEST_PORT + 1000);
    for tried in 0u32..1000 {
        let port = match below {
            Some(low) => LOWEST_PORT + (random(tried) % u64::from(low - LOWEST_PORT)) as u16,
            None => 0,
        };
        let Ok(l) = TcpListener::bind(("127.0.0.1", port)) else {
            continue;
        };
        let port = l
            .local_addr()
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("no local addr: {e}"));
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
    panic!("no free port that was not given out before")
}

/// The lowest port `free_port` gives out below the ephemeral range: clear of the usual
/// fixed service ports (NATS's own 4222, 6222 and 8222 among them).
const LOWEST_PORT: u16 = 20_000;

/// The first port of the kernel's ephemeral range, where the system says.
fn ephemeral_low() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// A number that differs between calls and between processes.
fn random(salt: u32) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(salt);
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish()
}

fn healthy(http_port: u16, path: &str) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], http_port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.starts_with("HTTP/1.1 200") || body.starts_with("HTTP/1.0 200")
}

/// One node's fixed identity: ports and directories survive restarts.
struct Node {
    name: String,
    port: u16,
    http_port: u16,
    cluster_port: Option<u16>,
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    fn new(name: &str, root: &Path, clustered: bool) -> Self {
        let dir = root.join(name);
        std::fs::create_dir_all(dir.join("store")).unwrap_or_else(|e| panic!("store dir: {e}"));
        Self {
            name: name.into(),
            port: free_port(),
            http_port: free_port(),
            cluster_port: clustered.then(free_port),
            dir,
            child: None,
        }
    }

    fn write_config(&self, routes: &[u16], sync: Option<&str>, extra: &str) {
        self.write_config_js(routes, sync, "", extra)
    }

    /// As `write_config`, with `js` (lines of the `jetstream` block) added to JetStream's
    /// settings.
    fn write_config_js(&self, routes: &[u16], sync: Option<&str>, js: &str, extra: &str) {
        let mut cfg = format!(
            "server_name: {}\nlisten: 127.0.0.1:{}\nhttp: 127.0.0.1:{}\n\
             jetstream {{\n  store_dir: \"{}\"\n{}{js}\n}}\n",
            self.name,
            self.port,
            self.http_port,
            self.dir.join("store").display(),
            sync.map(|s| format!("  sync_interval: {s}\n"))
                .unwrap_or_default()
        );
        if let Some(cp) = self.cluster_port {
            let routes: Vec<String> = routes
                .iter()
                .filter(|r| **r != cp)
                .map(|r| format!("nats-route://127.0.0.1:{r}"))
                .collect();
            cfg.push_str(&format!(
                "cluster {{\n  name: skein-test\n  listen: 127.0.0.1:{cp}\n  routes: [{}]\n}}\n",
                routes.join(", ")
            ));
        }
        cfg.push_str(extra);
        if !extra.ends_with('\n') {
            cfg.push('\n');
        }
        std::fs::write(self.dir.join("nats.conf"), cfg).unwrap_or_else(|e| panic!("config: {e}"));
    }

    fn spawn(&mut self) {
        // Appended to, so a restarted node's log keeps what it said before.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap_or_else(|e| panic!("log: {e}"));
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(self.dir.join("nats.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start nats-server: {e}"));
        self.child = Some(child);
    }

    fn wait_ready(&self, path: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if healthy(self.http_port, path) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{}", self.not_ready(within));
    }

    /// Like `wait_ready`, but notices a server that exited instead: `Err` with its log.
    fn try_ready(&mut self, path: &str, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if healthy(self.http_port, path) {
                return Ok(());
            }
            self.exited()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(self.not_ready(within))
    }

    /// What a server that did not become ready in time is reported with.
    fn not_ready(&self, within: Duration) -> String {
        format!(
            "nats-server {} not ready within {within:?}; its log:\n{}",
            self.name,
            self.log()
        )
    }

    /// `Err` with the log if the server has exited.
    fn exited(&mut self) -> Result<(), String> {
        if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
            self.child = None;
            return Err(format!(
                "nats-server {} exited ({status}) before it was ready; its log:\n{}",
                self.name,
                self.log()
            ));
        }
        Ok(())
    }

    /// What the server has written to its log so far (over all its starts).
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// After a start that found a port taken: stops the server, drops what it wrote to the
    /// log (so the next start's log is its own) and takes other ports.
    fn move_ports(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(self.dir.join("server.log"));
        self.port = free_port();
        self.http_port = free_port();
        if self.cluster_port.is_some() {
            self.cluster_port = Some(free_port());
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

/// Waits until every node of a starting cluster reports healthy JetStream, or one of them
/// exits (`Err` with its log: a node waits for its peers, so one that is gone would only
/// be seen as the others' time running out).
fn all_ready(nodes: &mut [Node], within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    let mut ready = vec![false; nodes.len()];
    while Instant::now() < deadline {
        for (n, ok) in nodes.iter_mut().zip(ready.iter_mut()) {
            if !*ok {
                n.exited()?;
                *ok = healthy(n.http_port, "/healthz");
            }
        }
        if ready.iter().all(|ok| *ok) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let late = nodes
        .iter()
        .zip(&ready)
        .find(|(_, ok)| !**ok)
        .map(|(n, _)| n);
    Err(late.map_or_else(String::new, |n| n.not_ready(within)))
}

/// Credentials a server started by [`NatsServer::start_with_auth`] requires.
#[derive(Clone)]
pub enum Auth {
    /// `authorization { token }`: clients must present this token.
    Token(String),
    /// `authorization { user, password }`: clients must log in as this user.
    UserPassword { user: String, password: String },
}

impl Auth {
    /// The server configuration block.
    pub fn config(&self) -> String {
        match self {
            Auth::Token(t) => format!("authorization {{\n  token: {}\n}}\n", quoted(t)),
            Auth::UserPassword { user, password } => format!(
                "authorization {{\n  user: {}\n  password: {}\n}}\n",
                quoted(user),
                quoted(password)
            ),
        }
    }
}

/// A double-quoted string of the server's configuration syntax.
fn quoted(s: &str) -> String {
    assert!(
        !s.contains(['"', '\\', '\n', '\r']),
        "test credentials must not contain quotes, backslashes or line breaks: {s:?}"
    );
    format!("\"{s}\"")
}

/// Health of a single server with JetStream up.
const READY: &str = "/healthz?js-enabled-only=true";

/// One JetStream-enabled `nats-server`.
pub struct NatsServer {
    node: Node,
    _root: tempfile::TempDir,
}

impl NatsServer {
    /// Starts a server with the default fsync policy.
    pub fn start() -> Self {
        Self::start_with_sync(None)
    }

    /// Starts a server with a JetStream `sync_interval` (`always` for the strictest).
    pub fn start_with_sync(sync: Option<&str>) -> Self {
        Self::start_with(sync, "")
    }

    /// Starts a server that accepts only clients with these credentials.
    pub fn start_with_auth(auth: &Auth) -> Self {
        Self::start_with_config(&auth.config())
    }

    /// Starts a server whose configuration file ends with `extra` (server configuration
    /// syntax, e.g. `max_payload: 65536` or an `authorization { … }` block).
    pub fn start_with_config(extra: &str) -> Self {
        Self::start_with(None, extra)
    }

    /// Starts a server whose `jetstream` block holds `js` too (e.g. `max_file_store: 4MB`).
    pub fn start_with_jetstream(js: &str) -> Self {
        Self::start_js(None, js, "")
    }

    fn start_with(sync: Option<&str>, extra: &str) -> Self {
        Self::start_js(sync, "", extra)
    }

    fn start_js(sync: Option<&str>, js: &str, extra: &str) -> Self {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut node = Node::new("n1", root.path(), false);
        // A free port may be taken by another process before the server binds it: then
        // the server exits, and it is started again on other ports.
        for attempt in 1.. {
            node.write_config_js(&[], sync, js, extra);
            node.spawn();
            match node.try_ready(READY, Duration::from_secs(60)) {
                Ok(()) => break,
                Err(e) if attempt < 3 && e.contains("address already in use") => node.move_ports(),
                Err(e) => {
                    node.kill();
                    panic!("{e}");
                }
            }
        }
        Self { node, _root: root }
    }

    pub fn url(&self) -> String {
        self.node.url()
    }

    pub fn pid(&self) -> Option<u32> {
        self.node.child.as_ref().map(Child::id)
    }

    /// SIGKILL; the store stays.
    pub fn kill9(&mut self) {
        self.node.kill();
    }

    /// Starts again on the same port with the same store.
    pub fn restart(&mut self) {
        self.node.kill();
        self.node.spawn();
        if let Err(e) = self.node.try_ready(READY, Duration::from_secs(60)) {
            self.node.kill();
            panic!("{e}");
        }
    }

    /// Starts again on the same port with the same store, its `jetstream` block holding
    /// `js` now (a larger `max_file_store`, say).
    pub fn restart_with_jetstream(&mut self, js: &str) {
        self.node.write_config_js(&[], None, js, "");
        self.restart();
    }

    pub fn store_dir(&self) -> PathBuf {
        self.node.dir.join("store")
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.node.kill();
    }
}

/// Three routed JetStream nodes.
pub struct Cluster {
    nodes: Vec<Node>,
    _root: tempfile::TempDir,
}

impl Cluster {
    pub fn start() -> Self {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut nodes: Vec<Node> = (1..=3)
            .map(|i| Node::new(&format!("n{i}"), root.path(), true))
            .collect();
        // As for a single server: a node that finds one of its ports taken exits, and then
        // the whole cluster starts again on other ports (the routes name them all).
        for attempt in 1.. {
            let routes: Vec<u16> = nodes.iter().filter_map(|n| n.cluster_port).collect();
            for n in &mut nodes {
                n.write_config(&routes, None, "");
                n.spawn();
            }
            match all_ready(&mut nodes, Duration::from_secs(30)) {
                Ok(()) => break,
                Err(e) if attempt < 3 && e.contains("address already in use") => {
                    nodes.iter_mut().for_each(Node::move_ports);
                }
                Err(e) => {
                    for n in &mut nodes {
                        n.kill();
                    }
                    panic!("{e}");
                }
            }
        }
        Self { nodes, _root: root }
    }

    /// Waits until every running node reports healthy JetStream (a meta leader exists).
    pub fn wait_ready(&self) {
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            n.wait_ready("/healthz", Duration::from_secs(30));
        }
    }

    /// `nats://…` of every node, comma-separated (what `--nats` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(Node::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn url(&self, i: usize) -> String {
        self.nodes[i].url()
    }

    pub fn kill9(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    pub fn restart(&mut self, i: usize) {
        self.nodes[i].kill();
        self.nodes[i].spawn();
        self.nodes[i].wait_ready("/healthz", Duration::from_secs(30));
    }

    /// Starts node `i` again on its store and waits only until it serves clients with
    /// JetStream enabled, not until its streams have caught up: what an operator's restart
    /// does, and what a test of catch-up needs.
    pub fn revive(&mut self, i: usize) {
        self.nodes[i].kill();
        self.nodes[i].spawn();
        self.nodes[i].wait_ready(READY, Duration::from_secs(30));
    }

    /// The `server_name` of node `i` (what stream and consumer info call a leader).
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// The index of the node called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The server log of node `i` so far.
    pub fn log(&self, i: usize) -> String {
        self.nodes[i].log()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_starts_restarts_and_dies_with_its_handle() {
        let mut s = NatsServer::start();
        let url = s.url();
        let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        let pid = s.pid().unwrap();
        s.restart();
        assert_ne!(s.pid().unwrap(), pid);
        assert!(
            TcpStream::connect(("127.0.0.1", port)).is_ok(),
            "same port after restart"
        );
        drop(s);
        // Dropping waits for the process to exit, and its listener dies with it.
        assert!(
            TcpStream::connect(("127.0.0.1", port)).is_err(),
            "killed on drop"
        );
    }

    #[test]
    fn ports_given_out_differ_and_stay_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..64).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            ports.len(),
            "a port given out twice: {ports:?}"
        );
        let low = ephemeral_low().expect("this system names its ephemeral port range");
        assert!(low > LOWEST_PORT + 1000, "ephemeral range starts at {low}");
        for p in ports {
            assert!(
                (LOWEST_PORT..low).contains(&p),
                "{p} is not in {LOWEST_PORT}..{low}"
            );
            // Free when given out: a listener can take it.
            assert!(TcpListener::bind(("127.0.0.1", p)).is_ok(), "{p} is taken");
        }
    }

    #[test]
    fn a_starting_cluster_node_whose_port_is_taken_is_seen_to_exit() {
        let root = tempfile::tempdir().unwrap();
        let mut nodes: Vec<Node> = (1..=3)
            .map(|i| Node::new(&format!("n{i}"), root.path(), true))
            .collect();
        // Another process's listener on the second node's monitoring port.
        let _squatter = TcpListener::bind(("127.0.0.1", nodes[1].http_port)).unwrap();
        let routes: Vec<u16> = nodes.iter().filter_map(|n| n.cluster_port).collect();
        for n in &mut nodes {
            n.write_config(&routes, None, "");
            n.spawn();
        }
        let e = all_ready(&mut nodes, Duration::from_secs(60)).unwrap_err();
        for n in &mut nodes {
            n.kill();
        }
        assert!(e.contains("nats-server n2 exited"), "{e}");
        assert!(e.contains("address already in use"), "{e}");
    }

    fn info_line(url: &str) -> String {
        let mut s = TcpStream::connect(url.trim_start_matches("nats://")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn servers_with_auth_say_so_and_plain_ones_do_not() {
        let plain = NatsServer::start();
        assert!(!info_line(&plain.url()).contains("\"auth_required\":true"));
        for auth in [
            Auth::Token("tok-123".into()),
            Auth::UserPassword {
                user: "alice".into(),
                password: "pw-456".into(),
            },
        ] {
            let s = NatsServer::start_with_auth(&auth);
            let info = info_line(&s.url());
            assert!(info.contains("\"auth_required\":true"), "{info}");
        }
    }

    #[test]
    fn a_three_node_cluster_forms() {
        let mut c = Cluster::start();
        assert_eq!(c.urls().split(',').count(), 3);
        c.kill9(2);
        c.restart(2);
        c.wait_ready();
    }
}
