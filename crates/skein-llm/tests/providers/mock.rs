//! A minimal in-process HTTP/1.1 server: it records each request (method, path, headers,
//! JSON body) and answers with the next queued canned response, one request per
//! connection.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One answer the server will give.
#[derive(Debug, Clone)]
pub struct Canned {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay: Duration,
}

impl Canned {
    pub fn json(status: u16, body: &Value) -> Self {
        Self::raw(status, &body.to_string())
    }

    /// A fixture file from `tests/fixtures`, answered with 200.
    pub fn fixture(text: &str) -> Self {
        Self::raw(200, text)
    }

    pub fn raw(status: u16, body: &str) -> Self {
        Self {
            status,
            headers: vec![],
            body: body.to_string(),
            delay: Duration::ZERO,
        }
    }

    /// An event stream of `data` lines (each one event), as `stream: true` answers.
    pub fn sse(events: &[(&str, &str)]) -> Self {
        let mut body = String::new();
        for (event, data) in events {
            if !event.is_empty() {
                body.push_str(&format!("event: {event}\n"));
            }
            body.push_str(&format!("data: {data}\n\n"));
        }
        Self::raw(200, &body).header("content-type", "text/event-stream")
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
}

/// One request as the server saw it. Header names are lower-case.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: BTreeMap<String, String>,
    pub body: Value,
    pub at: Instant,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Canned>,
    seen: Vec<Recorded>,
}

pub struct MockServer {
    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub url: String,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl MockServer {
    pub async fn start(responses: Vec<Canned>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State {
            queue: responses.into(),
            seen: vec![],
        }));
        let st = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(serve(sock, st.clone()));
            }
        });
        Self { url, state, task }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().unwrap().seen.clone()
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut sock: TcpStream, state: Arc<Mutex<State>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_string();
    let path = first.next().unwrap_or("").to_string();
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let body = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).to_string()));
    let canned = {
        let mut s = state.lock().unwrap();
        s.seen.push(Recorded {
            method,
            path,
            headers,
            body,
            at: Instant::now(),
        });
        s.queue.pop_front().unwrap_or_else(|| {
            Canned::raw(500, r#"{"error":{"message":"no canned response left"}}"#)
        })
    };
    if !canned.delay.is_zero() {
        tokio::time::sleep(canned.delay).await;
    }
    let typed = canned
        .headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"));
    let mut out = format!(
        "HTTP/1.1 {} Canned\r\n{}content-length: {}\r\nconnection: close\r\n",
        canned.status,
        if typed {
            ""
        } else {
            "content-type: application/json\r\n"
        },
        canned.body.len()
    );
    for (k, v) in &canned.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&canned.body);
    let _ = sock.write_all(out.as_bytes()).await;
    let _ = sock.shutdown().await;
}
