//! What providers' answers say of their rate limits, heard by whoever calls a model
//! within [`watching`].
//!
//! Every answer's headers are read (success or not): a 429's `Retry-After`, OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets written `1s`, `6m0s`,
//! `20ms`) and Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens}-{limit,
//! remaining,reset}` (resets written as RFC 3339 times). The caller of [`watching`] gets
//! them, to share with every worker (the runtime's model quotas), and may ask that a 429
//! not be retried in process: with quotas shared, the wait is the cluster's, not one
//! worker's sleep.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;

/// What one answer said. Counts are per minute where the provider states a limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimitInfo {
    /// HTTP status of the answer.
    pub status: u16,
    pub retry_after: Option<Duration>,
    pub requests_limit: Option<u64>,
    pub requests_remaining: Option<u64>,
    pub requests_reset: Option<Duration>,
    pub tokens_limit: Option<u64>,
    pub tokens_remaining: Option<u64>,
    pub tokens_reset: Option<Duration>,
}

impl RateLimitInfo {
    /// Whether the answer said nothing of limits and was no 429.
    pub fn is_empty(&self) -> bool {
        self.status != 429
            && self.retry_after.is_none()
            && self.requests_limit.is_none()
            && self.requests_remaining.is_none()
            && self.tokens_limit.is_none()
            && self.tokens_remaining.is_none()
    }

    /// Reads `headers` of an answer with `status`, at `now`.
    pub fn from_headers(status: u16, headers: &HeaderMap, now: SystemTime) -> Self {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let count = |name: &str| text(name).and_then(|v| v.trim().parse::<u64>().ok());
        let reset =
            |name: &str| text(name).and_then(|v| parse_reset(v).or_else(|| rfc3339_from(v, now)));
        let first = |a: Option<u64>, b: Option<u64>| a.or(b);
        Self {
            status,
            retry_after: if status == 429 {
                crate::http::parse_retry_after(headers, now)
            } else {
                None
            },
            requests_limit: first(
                count("x-ratelimit-limit-requests"),
                count("anthropic-ratelimit-requests-limit"),
            ),
            requests_remaining: first(
                count("x-ratelimit-remaining-requests"),
                count("anthropic-ratelimit-requests-remaining"),
            ),
            requests_reset: reset("x-ratelimit-reset-requests")
                .or_else(|| reset("anthropic-ratelimit-requests-reset")),
            tokens_limit: first(
                count("x-ratelimit-limit-tokens"),
                first(
                    count("anthropic-ratelimit-input-tokens-limit"),
                    count("anthropic-ratelimit-tokens-limit"),
                ),
            ),
            tokens_remaining: first(
                count("x-ratelimit-remaining-tokens"),
                first(
                    count("anthropic-ratelimit-input-tokens-remaining"),
                    count("anthropic-ratelimit-tokens-remaining"),
                ),
            ),
            tokens_reset: reset("x-ratelimit-reset-tokens")
                .or_else(|| reset("anthropic-ratelimit-input-tokens-reset"))
                .or_else(|| reset("anthropic-ratelimit-tokens-reset")),
        }
    }
}

/// A reset written as a duration: `1s`, `6m0s`, `1m30.5s`, `20ms`, `2h`, or a number of
/// seconds.
pub fn parse_reset(v: &str) -> Option<Duration> {
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let mut total = 0f64;
    let mut rest = v;
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|e| *e > 0)?;
        let n: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += n * scale;
        rest = &rest[unit_end..];
    }
    total.is_finite().then(|| Duration::from_secs_f64(total))
}

/// A reset written as an RFC 3339 time, as a wait from `now`.
fn rfc3339_from(v: &str, now: SystemTime) -> Option<Duration> {
    let at = humantime::parse_rfc3339_weak(v.trim().trim_end_matches('Z')).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

struct Watch {
    heard: Mutex<Vec<RateLimitInfo>>,
    no_429_retries: bool,
}

tokio::task_local! {
    static WATCH: Watch;
}

/// Runs `fut`, returning what the answers it got said of their limits. With
/// `no_429_retries`, a 429 is handed back at once instead of being retried in process.
pub async fn watching<F: std::future::Future>(
    no_429_retries: bool,
    fut: F,
) -> (F::Output, Vec<RateLimitInfo>) {
    let watch = Watch {
        heard: Mutex::new(vec![]),
        no_429_retries,
    };
    WATCH
        .scope(watch, async {
            let out = fut.await;
            let heard = WATCH
                .try_with(|w| {
                    std::mem::take(&mut *w.heard.lock().unwrap_or_else(|p| p.into_inner()))
                })
                .unwrap_or_default();
            (out, heard)
        })
        .await
}

/// Called with every answer's status and headers.
pub(crate) fn heard(status: u16, headers: &HeaderMap) {
    let _ = WATCH.try_with(|w| {
        let info = RateLimitInfo::from_headers(status, headers, SystemTime::now());
        if !info.is_empty() {
            w.heard.lock().unwrap_or_else(|p| p.into_inner()).push(info);
        }
    });
}

/// Whether a 429 may be retried in process here.
pub(crate) fn may_retry_429() -> bool {
    WATCH.try_with(|w| !w.no_429_retries).unwrap_or(true)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn resets_as_durations() {
        assert_eq!(parse_reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_reset("1m30.5s"), Some(Duration::from_millis(90_500)));
        assert_eq!(parse_reset("2.5"), Some(Duration::from_millis(2_500)));
        assert_eq!(parse_reset("soon"), None);
        assert_eq!(parse_reset("5x"), None);
        assert_eq!(parse_reset(""), None);
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn openai_and_anthropic_headers() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let h = headers(&[
            ("x-ratelimit-limit-requests", "500"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "120ms"),
            ("x-ratelimit-limit-tokens", "200000"),
            ("retry-after", "2"),
        ]);
        let i = RateLimitInfo::from_headers(429, &h, now);
        assert_eq!(i.requests_limit, Some(500));
        assert_eq!(i.requests_remaining, Some(0));
        assert_eq!(i.requests_reset, Some(Duration::from_millis(120)));
        assert_eq!(i.tokens_limit, Some(200_000));
        assert_eq!(i.retry_after, Some(Duration::from_secs(2)));
        // A Retry-After counts on a 429 only.
        assert_eq!(RateLimitInfo::from_headers(200, &h, now).retry_after, None);

        let a = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            // 1_700_000_000 is 2023-11-14T22:13:20Z.
            ("anthropic-ratelimit-requests-reset", "2023-11-14T22:13:23Z"),
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
        ]);
        let i = RateLimitInfo::from_headers(200, &a, now);
        assert_eq!(i.requests_limit, Some(50));
        assert_eq!(i.requests_remaining, Some(0));
        assert_eq!(i.requests_reset, Some(Duration::from_secs(3)));
        assert_eq!(i.tokens_limit, Some(40_000));
        assert!(RateLimitInfo::from_headers(200, &HeaderMap::new(), now).is_empty());
    }

    #[tokio::test]
    async fn heard_only_inside_a_watch() {
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-limit-requests", HeaderValue::from_static("9"));
        heard(200, &h);
        assert!(may_retry_429());
        let ((), got) = watching(true, async {
            assert!(!may_retry_429());
            heard(200, &h);
            heard(200, &HeaderMap::new());
        })
        .await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].requests_limit, Some(9));
    }
}
