//! A real `skein ui` process on a free loopback port, for the web suites.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// `skein ui` on 127.0.0.1 with a port of its own; killed when dropped.
pub struct UiServer {
    pub child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// The whole URL printed, with its `?token=…` when the server made one.
    pub printed: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl UiServer {
    /// Starts `skein --config <config> --data <data> ui --addr 127.0.0.1:0 <extra…>` and
    /// waits for the address it prints. Without `--auth-token` in `extra` it is started
    /// with `--no-auth`, so that the suites' clients need no token; [`UiServer::start_default`]
    /// starts it as a person would.
    pub fn start(config: &Path, data: &Path, extra: &[&str]) -> Self {
        Self::start_env(config, data, extra, &[])
    }

    /// [`UiServer::start`] with these environment variables set.
    pub fn start_env(config: &Path, data: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Self {
        let given =
            extra.contains(&"--auth-token") || envs.iter().any(|(k, _)| *k == "SKEIN_UI_TOKEN");
        let mut all: Vec<&str> = extra.to_vec();
        if !given {
            all.push("--no-auth");
        }
        Self::launch(config, data, &all, envs)
    }

    /// `skein ui` with neither a token nor `--no-auth`: it makes a token and prints it in
    /// its URL.
    pub fn start_default(
        config: &Path,
        data: &Path,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Self {
        Self::launch(config, data, extra, envs)
    }

    fn launch(config: &Path, data: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut c = super::skein(config, data);
        c.env_remove("SKEIN_TOKEN_SECRET")
            .envs(envs.iter().copied());
        c.args(["ui", "--addr", "127.0.0.1:0"])
            .args(extra)
            .env_remove("SKEIN_UI_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("skein ui starts");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let keep = seen.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("skein ui on ") {
                    let printed = rest.split(' ').next().unwrap_or(rest).to_string();
                    let url = rest.split('/').take(3).collect::<Vec<_>>().join("/");
                    let _ = tx.send((url, printed));
                }
                let mut s = keep.lock().unwrap_or_else(|p| p.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
        let (url, printed) = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(u) => u,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "skein ui did not print its address; stderr:\n{}",
                    seen.lock().unwrap_or_else(|p| p.into_inner())
                );
            }
        };
        Self {
            child,
            url,
            printed,
            stderr: seen,
        }
    }

    /// What the server wrote on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The per-process CSRF token of `/api/info`.
    pub async fn csrf(&self, http: &reqwest::Client) -> String {
        let info: serde_json::Value = http
            .get(format!("{}/api/info", self.url))
            .send()
            .await
            .expect("info")
            .json()
            .await
            .expect("info is JSON");
        info["csrf"].as_str().expect("csrf").to_string()
    }

    /// The JSON `path` of the API answers with.
    pub async fn get_json(&self, http: &reqwest::Client, path: &str) -> serde_json::Value {
        http.get(format!("{}{path}", self.url))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: not JSON: {e}"))
    }

    /// Polls `path` of the API until `done` holds for its JSON, for at most `limit`.
    pub async fn wait_for(
        &self,
        http: &reqwest::Client,
        path: &str,
        limit: Duration,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let r = http.get(format!("{}{path}", self.url)).send().await;
            if let Ok(r) = r {
                if let Ok(v) = r.json::<serde_json::Value>().await {
                    if done(&v) {
                        return v;
                    }
                    if start.elapsed() > limit {
                        panic!("{path} never reached the state waited for; last: {v}");
                    }
                }
            }
            if start.elapsed() > limit {
                panic!("{path} did not answer");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for UiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
