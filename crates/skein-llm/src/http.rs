//! The HTTP client the real providers share: timeouts, error kinds, and a small bounded
//! in-process retry.
//!
//! Every failure becomes a precise [`Error`]: a reqwest timeout is [`Error::Timeout`], a
//! failed connection [`Error::Connect`], a non-2xx answer [`Error::Http`] (with the
//! provider's own message, truncated, and `Retry-After` when sent), a 2xx body that is
//! not JSON [`Error::Malformed`]. No message ever carries the API key.
//!
//! The loop here retries 408/429/5xx answers and connection failures up to
//! `max_retries` times, honouring `Retry-After` (or waiting a jittered exponential
//! backoff). It is written out rather than built on a retry crate because the delay
//! depends on the error itself (`Retry-After`), and a wait longer than
//! `max_retry_after` is not slept through at all but handed back to the runtime, which
//! records the failure and schedules the retry durably.

use std::time::{Duration, SystemTime};

use rand::Rng;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use serde_json::Value;
use skein_core::text::clip_with_ellipsis;

use crate::config::{ApiKey, HttpOptions};
use crate::{Error, Result};

/// Longest provider error message kept in an [`Error::Http`].
const MAX_MESSAGE: usize = 400;

/// A reqwest client with one provider's timeouts and retry policy.
///
/// The client itself (its TLS configuration, its connection pool) is made at the first
/// request: every process builds the configured providers, and most never call them.
#[derive(Debug, Clone)]
pub struct HttpClient {
    provider: String,
    client: std::sync::OnceLock<reqwest::Client>,
    opts: HttpOptions,
}

impl HttpClient {
    pub fn new(provider: &str, opts: HttpOptions) -> Result<Self> {
        Ok(Self {
            provider: provider.to_string(),
            client: std::sync::OnceLock::new(),
            opts,
        })
    }

    /// The client, made on first use.
    fn client(&self) -> Result<&reqwest::Client> {
        if let Some(c) = self.client.get() {
            return Ok(c);
        }
        let made = reqwest::Client::builder()
            .connect_timeout(self.opts.connect_timeout)
            .timeout(self.opts.timeout)
            .build()
            .map_err(|e| {
                Error::Config(format!("provider `{}`: HTTP client: {e}", self.provider))
            })?;
        // Two first requests at once may both build one; the first stored is kept.
        Ok(self.client.get_or_init(|| made))
    }

    pub fn options(&self) -> &HttpOptions {
        &self.opts
    }

    /// POSTs `body` as JSON and returns the JSON answer, retrying as the module says.
    /// `secret` is only used to scrub it from error messages; the caller puts it in
    /// `headers`.
    pub async fn post_json(
        &self,
        url: &str,
        headers: &HeaderMap,
        body: &Value,
        secret: Option<&ApiKey>,
    ) -> Result<Value> {
        self.retrying(|| self.send_once(url, headers, body, secret))
            .await
    }

    /// Runs `try_once` until it succeeds, retrying as the module says.
    async fn retrying<T, F, Fut>(&self, mut try_once: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut attempt = 0u32;
        loop {
            let err = match try_once().await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            if attempt >= self.opts.max_retries || !retry_in_process(&err) {
                return Err(err);
            }
            // With quotas shared across workers, a 429 is the cluster's to wait for.
            if matches!(err, Error::Http { status: 429, .. }) && !crate::ratelimit::may_retry_429()
            {
                return Err(err);
            }
            let delay = match err.retry_after() {
                Some(d) if d > self.opts.max_retry_after => return Err(err),
                Some(d) => d,
                None => backoff_delay(attempt, self.opts.backoff, self.opts.max_backoff),
            };
            attempt += 1;
            tracing::warn!(
                provider = %self.provider,
                attempt,
                delay_ms = delay.as_millis() as u64,
                error = %err,
                "model call failed; retrying"
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// POSTs `body` and reads the answer as server-sent events, handing each
    /// `(event, data)` to `on_event` as it completes. Failures before the first byte of
    /// the answer are retried as [`HttpClient::post_json`] retries them; once the answer
    /// has begun, a failure is returned (text already handed out cannot be taken back).
    /// A server that answers with plain JSON instead of a stream gets that JSON back.
    pub async fn post_stream(
        &self,
        url: &str,
        headers: &HeaderMap,
        body: &Value,
        secret: Option<&ApiKey>,
        on_event: &mut (dyn FnMut(&str, &str) -> Result<()> + Send),
    ) -> Result<Option<Value>> {
        let mut resp = self
            .retrying(|| self.send(url, headers, body, secret))
            .await?;
        let is_stream = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().contains("text/event-stream"));
        if !is_stream {
            return self.read_json(resp, secret).await.map(Some);
        }
        let mut sse = crate::stream::SseParser::default();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| self.transport_error(&e, secret))?
        {
            for (event, data) in sse.feed(&chunk)? {
                on_event(&event, &data)?;
            }
        }
        for (event, data) in sse.finish() {
            on_event(&event, &data)?;
        }
        Ok(None)
    }

    /// Sends `body`; a non-2xx answer is an [`Error::Http`] with the provider's message.
    async fn send(
        &self,
        url: &str,
        headers: &HeaderMap,
        body: &Value,
        secret: Option<&ApiKey>,
    ) -> Result<reqwest::Response> {
        let resp = self
            .client()?
            .post(url)
            .headers(headers.clone())
            .json(body)
            .send()
            .await
            .map_err(|e| self.transport_error(&e, secret))?;
        let status = resp.status();
        crate::ratelimit::heard(status.as_u16(), resp.headers());
        if status.is_success() {
            return Ok(resp);
        }
        let retry_after = parse_retry_after(resp.headers(), SystemTime::now());
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| self.transport_error(&e, secret))?;
        let text = String::from_utf8_lossy(&bytes);
        Err(Error::Http {
            status: status.as_u16(),
            message: scrub(&error_message(&text), secret),
            retry_after,
        })
    }

    async fn send_once(
        &self,
        url: &str,
        headers: &HeaderMap,
        body: &Value,
        secret: Option<&ApiKey>,
    ) -> Result<Value> {
        let resp = self.send(url, headers, body, secret).await?;
        self.read_json(resp, secret).await
    }

    async fn read_json(&self, resp: reqwest::Response, secret: Option<&ApiKey>) -> Result<Value> {
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| self.transport_error(&e, secret))?;
        serde_json::from_slice(&bytes).map_err(|e| {
            let text = String::from_utf8_lossy(&bytes);
            Error::Malformed(scrub(
                &format!(
                    "{}: the response body is not JSON ({e}); it starts with: {}",
                    self.provider,
                    clip_with_ellipsis(text.trim(), 200)
                ),
                secret,
            ))
        })
    }

    fn transport_error(&self, e: &reqwest::Error, secret: Option<&ApiKey>) -> Error {
        let chain = scrub(&error_chain(e), secret);
        if e.is_connect() {
            Error::Connect(format!("{}: {chain}", self.provider))
        } else if e.is_timeout() {
            Error::Timeout(self.opts.timeout)
        } else {
            // A connection dropped mid-answer and the like: a transport failure.
            Error::Connect(format!("{}: {chain}", self.provider))
        }
    }
}

/// `headers` as a header map; a name or value HTTP cannot carry is a config error.
pub fn header_map(
    provider: &str,
    headers: &std::collections::BTreeMap<String, String>,
) -> Result<HeaderMap> {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        let name = reqwest::header::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
            Error::Config(format!(
                "provider `{provider}`: `{k}` is not a valid header name"
            ))
        })?;
        let value = reqwest::header::HeaderValue::from_str(v).map_err(|_| {
            Error::Config(format!(
                "provider `{provider}`: the value of header `{k}` is not valid"
            ))
        })?;
        map.insert(name, value);
    }
    Ok(map)
}

/// A header value holding a secret, marked sensitive so it is never printed.
pub fn secret_header(provider: &str, value: &str) -> Result<reqwest::header::HeaderValue> {
    let mut v = reqwest::header::HeaderValue::from_str(value).map_err(|_| {
        Error::Config(format!(
            "provider `{provider}`: the API key holds characters a header cannot carry"
        ))
    })?;
    v.set_sensitive(true);
    Ok(v)
}

/// Whether the loop in [`HttpClient::post_json`] tries again. Timeouts are not retried
/// here (one already took the whole timeout), nor malformed answers; the runtime may.
fn retry_in_process(e: &Error) -> bool {
    match e {
        Error::Http { status, .. } => *status == 408 || *status == 429 || *status >= 500,
        Error::Connect(_) => true,
        _ => false,
    }
}

/// `base · 2^attempt`, capped at `max`, then jittered down by up to half.
pub fn backoff_delay(attempt: u32, base: Duration, max: Duration) -> Duration {
    let full = base.saturating_mul(1u32 << attempt.min(16)).min(max);
    let factor: f64 = rand::thread_rng().gen_range(0.5..=1.0);
    full.mul_f64(factor)
}

/// Every message in a reqwest error's source chain, joined.
fn error_chain(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let m = s.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        src = s.source();
    }
    out
}

/// How long the answer asks us to wait: `retry-after-ms` (sent by some OpenAI-compatible
/// servers), else `Retry-After` as seconds or as an HTTP date.
pub fn parse_retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let v = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let at = parse_http_date(v)?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Parses an HTTP date in any of the three forms RFC 9110 (section 5.6.7) tells a recipient
/// to accept: IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the obsolete RFC 850 form
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and C's asctime form (`Sun Nov  6 08:49:37 1994`).
pub fn parse_http_date(s: &str) -> Option<SystemTime> {
    httpdate::parse_http_date(s.trim()).ok()
}

/// The provider's own words from an error body: `error.message` (OpenAI, Anthropic),
/// `error` as a string (Ollama), `message` or `detail` (vLLM and others), else the text.
pub fn error_message(body: &str) -> String {
    let msg = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            let pick = |v: &Value| v.as_str().map(str::to_string);
            v.pointer("/error/message")
                .and_then(pick)
                .or_else(|| v.get("error").and_then(pick))
                .or_else(|| v.get("message").and_then(pick))
                .or_else(|| match v.get("detail") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(d) if !d.is_null() => Some(d.to_string()),
                    _ => None,
                })
        })
        .unwrap_or_else(|| body.trim().to_string());
    let msg = if msg.is_empty() {
        "(empty body)".to_string()
    } else {
        msg
    };
    clip_with_ellipsis(&msg, MAX_MESSAGE)
}

/// `text` with every occurrence of the key replaced by `***`.
pub fn scrub(text: &str, secret: Option<&ApiKey>) -> String {
    match secret {
        Some(k) if !k.expose().is_empty() => text.replace(k.expose(), "***"),
        _ => text.to_string(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;
    use std::time::UNIX_EPOCH;

    #[test]
    fn retry_after_seconds_ms_and_dates() {
        let now = UNIX_EPOCH + Duration::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
        let mut h = HeaderMap::new();
        assert_eq!(parse_retry_after(&h, now), None);
        h.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(3)));
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Sun, 06 Nov 1994 08:49:47 GMT"),
        );
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(10)));
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Sun, 06 Nov 1994 08:40:00 GMT"),
        );
        assert_eq!(parse_retry_after(&h, now), Some(Duration::ZERO));
        // The two obsolete forms a recipient must also accept (RFC 9110, 5.6.7).
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Sunday, 06-Nov-94 08:49:57 GMT"),
        );
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(20)));
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Sun Nov  6 08:50:07 1994"),
        );
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(30)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(parse_retry_after(&h, now), None);
        h.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_millis(250)));
    }

    #[test]
    fn http_dates() {
        assert_eq!(
            parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"),
            Some(UNIX_EPOCH)
        );
        assert_eq!(
            parse_http_date("Tue, 29 Feb 2000 12:00:00 GMT"),
            Some(UNIX_EPOCH + Duration::from_secs(951_825_600))
        );
        assert_eq!(parse_http_date("29 Feb 2000"), None);
        assert_eq!(parse_http_date("Tue, 29 Feb 2000 12:00:00 XYZ"), None);
        assert_eq!(parse_http_date("Tue, 29 Foo 2000 12:00:00 GMT"), None);
    }

    #[test]
    fn the_three_date_forms_name_one_instant() {
        let at = Some(UNIX_EPOCH + Duration::from_secs(784_111_777));
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"), at);
        assert_eq!(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT"), at);
        assert_eq!(parse_http_date("Sun Nov  6 08:49:37 1994"), at);
        assert_eq!(parse_http_date(" Sun Nov  6 08:49:37 1994 "), at);
        // A two-digit year of the RFC 850 form.
        assert_eq!(
            parse_http_date("Thursday, 01-Jan-70 00:00:00 GMT"),
            Some(UNIX_EPOCH)
        );
        assert_eq!(parse_http_date("Sun Nov 31 08:49:37 1994"), None);
    }

    #[test]
    fn error_messages_from_known_shapes() {
        assert_eq!(
            error_message(r#"{"error":{"message":"bad model","type":"invalid_request_error"}}"#),
            "bad model"
        );
        assert_eq!(
            error_message(
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            "Overloaded"
        );
        assert_eq!(
            error_message(r#"{"error":"model not found"}"#),
            "model not found"
        );
        assert_eq!(error_message(r#"{"detail":"nope"}"#), "nope");
        assert_eq!(
            error_message("  <html>gateway</html> "),
            "<html>gateway</html>"
        );
        assert_eq!(error_message(""), "(empty body)");
        let long = "é".repeat(1000);
        let m = error_message(&long);
        assert!(m.len() <= MAX_MESSAGE + "…".len() && m.ends_with('…'));
    }

    #[test]
    fn scrub_hides_the_key() {
        let k = ApiKey::new("test-key-not-secret");
        assert_eq!(
            scrub("Incorrect API key provided: test-key-not-secret.", Some(&k)),
            "Incorrect API key provided: ***."
        );
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let base = Duration::from_millis(100);
        let max = Duration::from_millis(1000);
        for _ in 0..50 {
            let d0 = backoff_delay(0, base, max);
            assert!(d0 >= Duration::from_millis(50) && d0 <= base, "{d0:?}");
            let d2 = backoff_delay(2, base, max);
            assert!(d2 >= Duration::from_millis(200) && d2 <= Duration::from_millis(400));
            let d9 = backoff_delay(9, base, max);
            assert!(d9 <= max && d9 >= max / 2);
        }
    }

    #[test]
    fn only_transient_failures_retry_in_process() {
        let http = |status| Error::Http {
            status,
            message: String::new(),
            retry_after: None,
        };
        assert!(retry_in_process(&http(429)));
        assert!(retry_in_process(&http(503)));
        assert!(!retry_in_process(&http(400)));
        assert!(!retry_in_process(&http(401)));
        assert!(retry_in_process(&Error::Connect("x".into())));
        assert!(!retry_in_process(&Error::Timeout(Duration::from_secs(1))));
        assert!(!retry_in_process(&Error::Malformed("x".into())));
    }
}
