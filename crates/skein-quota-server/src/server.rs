//! The server: OpenAI chat completions on `POST /v1/chat/completions`, a sliding window
//! of `limit` requests per `window` for each API key (the `Authorization` header; no
//! header is one key too), and `GET /stats` with what it counted.
//!
//! Over its window a key is answered 429 with `Retry-After` (whole seconds, rounded up)
//! and `retry-after-ms`, as OpenAI-compatible servers do; every answer carries
//! `x-ratelimit-limit-requests` (the limit stated per minute, as OpenAI states it),
//! `x-ratelimit-remaining-requests` and `x-ratelimit-reset-requests` (when the next place
//! frees, written `120ms`).
//!
//! The answers are scripted: an agent whose system prompt says "You delegate" delegates
//! `fanout=N` sub-missions (N read from the first user message) with `call_agent` and,
//! once it has their results, answers; any other answers at once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

/// The quota the server enforces.
#[derive(Debug, Clone, Copy)]
pub struct Quota {
    pub limit: usize,
    pub window: Duration,
    /// How long an admitted request takes to be answered (a 429 is answered at once).
    pub latency: Duration,
}

#[derive(Default)]
struct Counts {
    requests: u64,
    ok: u64,
    rate_limited: u64,
    /// The most requests admitted within one window.
    max_in_window: u64,
    /// The models asked, in the order the requests came (admitted ones).
    by_model: HashMap<String, u64>,
}

struct Shared {
    quota: Quota,
    windows: Mutex<HashMap<String, VecDeque<Instant>>>,
    counts: Mutex<Counts>,
    calls: std::sync::atomic::AtomicU64,
}

/// The router of a server enforcing `quota`.
pub fn router(quota: Quota) -> Router {
    let shared = Arc::new(Shared {
        quota,
        windows: Mutex::default(),
        counts: Mutex::default(),
        calls: Default::default(),
    });
    Router::new()
        .route("/v1/chat/completions", post(complete))
        .route("/stats", get(stats))
        .with_state(shared)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn stats(State(s): State<Arc<Shared>>) -> Response {
    let c = lock(&s.counts);
    let body = json!({
        "requests": c.requests,
        "ok": c.ok,
        "rate_limited": c.rate_limited,
        "max_in_window": c.max_in_window,
        "by_model": c.by_model,
    });
    ([("content-type", "application/json")], body.to_string()).into_response()
}

fn header(h: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        h.insert(name, v);
    }
}

async fn complete(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let key = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let now = Instant::now();
    let q = s.quota;
    let (admitted, in_window, reset) = {
        let mut w = lock(&s.windows);
        let times = w.entry(key).or_default();
        while times
            .front()
            .is_some_and(|t| now.duration_since(*t) >= q.window)
        {
            times.pop_front();
        }
        let admitted = times.len() < q.limit;
        if admitted {
            times.push_back(now);
        }
        let reset = times
            .front()
            .map(|t| q.window.saturating_sub(now.duration_since(*t)))
            .unwrap_or_default();
        (admitted, times.len(), reset)
    };
    let mut h = HeaderMap::new();
    let per_minute = q.limit as f64 * 60.0 / q.window.as_secs_f64();
    header(
        &mut h,
        "x-ratelimit-limit-requests",
        format!("{}", per_minute.round() as u64),
    );
    header(
        &mut h,
        "x-ratelimit-remaining-requests",
        q.limit.saturating_sub(in_window).to_string(),
    );
    header(
        &mut h,
        "x-ratelimit-reset-requests",
        format!("{}ms", reset.as_millis()),
    );
    h.insert("content-type", HeaderValue::from_static("application/json"));
    {
        let mut c = lock(&s.counts);
        c.requests += 1;
        if admitted {
            c.ok += 1;
            c.max_in_window = c.max_in_window.max(in_window as u64);
        } else {
            c.rate_limited += 1;
        }
    }
    if !admitted {
        header(&mut h, "retry-after-ms", reset.as_millis().to_string());
        header(
            &mut h,
            "retry-after",
            reset.as_secs_f64().ceil().max(1.0).to_string(),
        );
        let body = json!({"error": {
            "message": "Rate limit reached for requests",
            "type": "requests",
            "code": "rate_limit_exceeded"
        }});
        return (StatusCode::TOO_MANY_REQUESTS, h, body.to_string()).into_response();
    }
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            let body = json!({"error": {"message": format!("the body is not JSON: {e}")}});
            return (StatusCode::BAD_REQUEST, h, body.to_string()).into_response();
        }
    };
    if !q.latency.is_zero() {
        tokio::time::sleep(q.latency).await;
    }
    let model = req["model"].as_str().unwrap_or("").to_string();
    *lock(&s.counts).by_model.entry(model.clone()).or_default() += 1;
    let n = s.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let message = answer(&req, n);
    let body = json!({
        "id": format!("chatcmpl-{n}"),
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason":
            if message.get("tool_calls").is_some() { "tool_calls" } else { "stop" }}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
    });
    (StatusCode::OK, h, body.to_string()).into_response()
}

/// The scripted answer of `model` to `req`.
fn answer(req: &Value, n: u64) -> Value {
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let mission = messages
        .iter()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string();
    let has_results = messages.iter().any(|m| m["role"] == "tool");
    let delegates = messages.iter().any(|m| {
        m["role"] == "system"
            && m["content"]
                .as_str()
                .is_some_and(|c| c.contains("You delegate"))
    });
    if !delegates || has_results {
        return json!({"role": "assistant", "content": format!("done: {mission}")});
    }
    let fanout: usize = mission
        .split_whitespace()
        .find_map(|w| w.strip_prefix("fanout="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let calls: Vec<Value> = (0..fanout)
        .map(|i| {
            json!({
                "id": format!("call_{n}_{i}"),
                "type": "function",
                "function": {
                    "name": "call_agent",
                    "arguments": json!({
                        "agent": "worker",
                        "mission": format!("part {i} of {mission}"),
                    }).to_string(),
                }
            })
        })
        .collect();
    json!({"role": "assistant", "content": "", "tool_calls": calls})
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_orchestrator_fans_out_then_answers() {
        let req = json!({"model": "m", "messages": [
            {"role": "system", "content": "You delegate."},
            {"role": "user", "content": "go fanout=3 run=a"}]});
        let a = answer(&req, 7);
        let calls = a["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 3);
        let args: Value =
            serde_json::from_str(calls[2]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args["mission"], "part 2 of go fanout=3 run=a");
        let done = json!({"model": "m", "messages": [
            {"role": "system", "content": "You delegate."},
            {"role": "user", "content": "go fanout=3"},
            {"role": "tool", "tool_call_id": "x", "content": "r"}]});
        assert!(answer(&done, 8)["content"]
            .as_str()
            .unwrap()
            .starts_with("done"));
        let worker = json!({"model": "m", "messages": [
            {"role": "system", "content": "You do one part."},
            {"role": "user", "content": "part 1"}]});
        assert!(answer(&worker, 9).get("tool_calls").is_none());
    }
}
