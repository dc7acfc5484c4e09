//! Answers' text on `skein.stream.<session>` while it arrives, read by a raw NATS client
//! (the text protocol over a TCP socket, as any client in any language speaks it), and
//! shown by `skein watch`.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use skein_testnats::NatsServer;

const SECRET: &str = "stream-test-secret-not-for-production";

/// `skein --nats URL …` with the cluster's token secret.
fn on_nats(sb: &Sandbox, url: &str) -> std::process::Command {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["--nats", url]).env("SKEIN_TOKEN_SECRET", SECRET);
    c
}

fn worker(sb: &Sandbox, url: &str) -> Child {
    let mut c = on_nats(sb, url);
    c.args(["worker", "--concurrency", "8"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("worker starts");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(err.read_line(&mut line).expect("read") > 0, "worker exited");
        if line.contains("ready") {
            break;
        }
    }
    std::thread::spawn(move || for _ in err.lines() {});
    child
}

/// A raw client: connected, subscribed to `subjects`, PONG seen (so the subscriptions
/// are in place on the server).
struct Raw {
    sock: TcpStream,
    r: BufReader<TcpStream>,
}

impl Raw {
    fn connect(url: &str, subjects: &[&str]) -> Self {
        let sock = TcpStream::connect(url.trim_start_matches("nats://")).expect("connect");
        let mut r = BufReader::new(sock.try_clone().expect("clone"));
        let mut info = String::new();
        r.read_line(&mut info).expect("INFO");
        let mut raw = Self { sock, r };
        raw.send("CONNECT {\"verbose\":false}\r\n");
        for (i, s) in subjects.iter().enumerate() {
            raw.send(&format!("SUB {s} {}\r\n", i + 1));
        }
        raw.send("PING\r\n");
        while raw.line() != "PONG" {}
        raw
    }

    fn send(&mut self, text: &str) {
        self.sock.write_all(text.as_bytes()).expect("write");
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        assert!(self.r.read_line(&mut l).expect("read") > 0, "server closed");
        l.trim_end().to_string()
    }

    /// The next message as (subject, payload), answering the server's PINGs.
    fn next(&mut self) -> (String, Vec<u8>) {
        loop {
            let l = self.line();
            if l == "PING" {
                self.send("PONG\r\n");
                continue;
            }
            let Some(rest) = l.strip_prefix("MSG ") else {
                continue;
            };
            let parts: Vec<&str> = rest.split(' ').collect();
            let len: usize = parts.last().expect("size").parse().expect("size");
            let mut payload = vec![0; len + 2];
            self.r.read_exact(&mut payload).expect("payload");
            payload.truncate(len);
            return (parts[0].to_string(), payload);
        }
    }
}

#[test]
fn a_raw_nats_client_reads_every_answer_as_it_streams() {
    let sb = Sandbox::new();
    sb.agent(
        "boss",
        "agents: [helper]\n",
        "latency_ms: 200\nturns:\n  - say: \"Asking the helper.\"\n    tool_calls:\n      - tool: call_agent\n        args: {agent: helper, mission: \"write three lines\"}\n  - answer: \"The helper wrote:\\n{{ results[0].result }}\"\n",
    )
    .agent(
        "helper",
        "",
        "latency_ms: 300\nturns:\n  - answer: \"first line of the helper\\nsecond line, a little longer than the first\\nthird and last line\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![worker(&sb, &url)]);
    let mut raw = Raw::connect(&url, &["skein.stream.>", "skein.results.streamed"]);
    // Submitted by `nats pub` as a user would, on the same raw connection.
    let mission = r#"{"agent":"boss","mission":"stream it","id":"streamed"}"#;
    raw.send(&format!(
        "PUB skein.missions.submit {}\r\n{mission}\r\n",
        mission.len()
    ));
    // Text by (session, seq, attempt), until the root's result arrives.
    let mut text: BTreeMap<(String, u64, u64), String> = BTreeMap::new();
    let mut pieces = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let result: Value = loop {
        assert!(Instant::now() < deadline, "no result in 60 s");
        let (subject, payload) = raw.next();
        let v: Value = serde_json::from_slice(&payload).expect("JSON payload");
        if subject == "skein.results.streamed" {
            break v;
        }
        let session = v["session"].as_str().expect("session").to_string();
        assert_eq!(subject, format!("skein.stream.{session}"));
        pieces += 1;
        *text
            .entry((
                session,
                v["seq"].as_u64().expect("seq"),
                v["attempt"].as_u64().expect("attempt"),
            ))
            .or_default() += v["text"].as_str().expect("text");
    };
    assert_eq!(result["status"], "completed", "{result}");
    // Every model turn with text streamed it, in several pieces, and what streamed is
    // exactly what the log recorded for that turn.
    assert!(pieces > 6, "{pieces} pieces");
    let events = |session: &str| -> Vec<Value> {
        let out = run_ok({
            let mut c = on_nats(&sb, &url);
            c.args(["events", session, "--json"]);
            c
        });
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("event line"))
            .collect()
    };
    let mut checked = 0;
    for session in ["streamed", "streamed.helper-1"] {
        for e in events(session) {
            if e["kind"] != "ModelCalled" {
                continue;
            }
            let seq = e["seq"].as_u64().expect("seq");
            let content = e["body"]["data"]["response"]["content"]
                .as_str()
                .unwrap_or("");
            let streamed = text
                .get(&(session.to_string(), seq, 1))
                .map(String::as_str)
                .unwrap_or("");
            assert_eq!(streamed, content, "{session} seq {seq}");
            checked += 1;
        }
    }
    assert_eq!(checked, 3, "three model turns: {text:?}");
    assert_eq!(
        result["answer"].as_str().expect("answer"),
        text[&("streamed".to_string(), 5, 1)]
    );
}

#[test]
fn skein_watch_shows_the_text_as_lines() {
    let sb = Sandbox::new();
    sb.agent(
        "poet",
        "",
        "latency_ms: 1500\nturns:\n  - answer: \"roses are red\\nviolets are blue\\nlogs are folded\\nand replayed too\"\n",
    );
    let server = NatsServer::start();
    let url = server.url();
    let _w = Workers(vec![worker(&sb, &url)]);
    let watch = {
        let mut c = on_nats(&sb, &url);
        c.args(["watch", "poem"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        c.spawn().expect("watch starts")
    };
    // The watcher subscribes before the tree starts: give it a moment, then submit.
    std::thread::sleep(Duration::from_millis(500));
    run_ok({
        let mut c = on_nats(&sb, &url);
        c.args(["submit", "--agent", "poet", "--id", "poem", "a poem"]);
        c
    });
    let out = watch.wait_with_output().expect("watch ends with the tree");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let shown: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split_once(" │ ").map(|(_, t)| t))
        .collect();
    assert_eq!(
        shown,
        [
            "roses are red",
            "violets are blue",
            "logs are folded",
            "and replayed too"
        ],
        "{stdout}"
    );
}
