//! One suite's checks on both backends: a world is a sandbox of agents and scripts with
//! the embedded store, or with a real nats-server and two worker processes; its commands
//! are the real binary's.

use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::Value;
use skein_testnats::NatsServer;

use super::*;

/// Resume tokens are signed with a secret every process of a world shares.
const SECRET: &str = "world-secret-for-tests-only";

/// Where the commands run: the embedded store, or a real nats-server with two workers.
pub enum Mode {
    Embedded,
    Nats { url: String, _workers: Workers },
}

pub struct World {
    pub sb: Sandbox,
    pub mode: Mode,
    _server: Option<NatsServer>,
}

impl World {
    pub fn embedded(sb: Sandbox) -> Self {
        World {
            sb,
            mode: Mode::Embedded,
            _server: None,
        }
    }

    pub fn nats(sb: Sandbox) -> Self {
        let server = NatsServer::start();
        let url = server.url();
        let workers = Workers(
            ["w1", "w2"]
                .iter()
                .map(|name| {
                    let mut c = skein(&sb.config(), &sb.data());
                    c.args(["--nats", &url, "worker", "--concurrency", "8"])
                        .env("SKEIN_TOKEN_SECRET", SECRET)
                        .env("SKEIN__RUNTIME__WORKER_ID", name);
                    start_worker(c, name)
                })
                .collect(),
        );
        World {
            sb,
            mode: Mode::Nats {
                url,
                _workers: workers,
            },
            _server: Some(server),
        }
    }

    pub fn name(&self) -> &'static str {
        match self.mode {
            Mode::Embedded => "embedded",
            Mode::Nats { .. } => "nats",
        }
    }

    /// `skein ARGS…` against this world's backend.
    pub fn cli(&self, args: &[&str]) -> Output {
        let mut c = skein(&self.sb.config(), &self.sb.data());
        if let Mode::Nats { url, .. } = &self.mode {
            c.args(["--nats", url]);
        }
        c.args(args).env("SKEIN_TOKEN_SECRET", SECRET);
        c.output().expect("skein runs")
    }

    /// Starts a tree of `agent` under the root id `id` and returns once it has ended or
    /// paused (a person must act), with the root's status.
    pub fn start(&self, agent: &str, id: &str, mission: &str) -> String {
        match &self.mode {
            Mode::Embedded => {
                let out = self.cli(&["run", "--agent", agent, "--id", id, "--json", mission]);
                let v = json_of(&out);
                assert_ne!(
                    v["stalled"],
                    Value::Bool(true),
                    "{id} stalled: {}",
                    String::from_utf8_lossy(&out.stdout)
                );
                v["status"].as_str().unwrap_or_default().to_string()
            }
            Mode::Nats { .. } => {
                let out = self.cli(&["submit", "--agent", agent, "--id", id, mission]);
                assert!(
                    out.status.success(),
                    "submit: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                self.settle(id)
            }
        }
    }

    /// The root's status once the tree has ended or waits for a person (NATS: polled).
    /// A tree waits for a person once something in it asks and its root has taken that
    /// in: a child's question is in the inbox the moment the child records it, while its
    /// root still runs until it reads the child's notice.
    pub fn settle(&self, id: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let status = self.status(id);
            let ended = matches!(status.as_str(), "completed" | "failed" | "cancelled");
            let paused = matches!(
                status.as_str(),
                "waiting" | "awaiting_input" | "awaiting_approval"
            );
            if ended || (paused && !self.inbox(id).is_empty()) {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {id} neither ended nor asked anything within 60 s (status {status}): {}",
                self.name(),
                self.tree(id)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn tree(&self, id: &str) -> Value {
        let out = self.cli(&["tree", id, "--json"]);
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    pub fn status(&self, id: &str) -> String {
        self.tree(id)["sessions"][0]["status"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn inbox(&self, id: &str) -> Vec<Value> {
        let out = self.cli(&["inbox", id, "--json"]);
        match serde_json::from_slice(&out.stdout) {
            Ok(Value::Array(items)) => items,
            _ => vec![],
        }
    }

    /// Answers a question (or decides an approval) and returns once the tree has ended
    /// or paused again, with the root's status. The command's own output is returned too.
    pub fn act(&self, id: &str, args: &[&str]) -> (Output, String) {
        let mut all = args.to_vec();
        if matches!(self.mode, Mode::Embedded) {
            all.push("--no-run");
        }
        let out = self.cli(&all);
        if !out.status.success() {
            return (out, self.status(id));
        }
        if matches!(self.mode, Mode::Embedded) {
            let resumed = self.cli(&["resume", id, "--json"]);
            assert_ne!(
                json_of(&resumed)["stalled"],
                Value::Bool(true),
                "{id} stalled"
            );
        }
        (out, self.settle(id))
    }

    pub fn verify(&self, id: &str) {
        let out = self.cli(&["replay", id, "--tree", "--verify"]);
        assert!(
            out.status.success(),
            "{}: replay --verify of {id}: {}{}",
            self.name(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn answer_of(&self, id: &str) -> String {
        self.tree(id)["sessions"][0]["answer"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

pub fn both(sandbox: impl Fn() -> Sandbox, check: impl Fn(&World)) {
    check(&World::embedded(sandbox()));
    check(&World::nats(sandbox()));
}
