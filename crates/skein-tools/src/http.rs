//! `http_fetch`: one GET or POST, with a time limit and a size cap, to public addresses
//! only (see [`crate::net`]). Redirects are followed by hand so that each target is
//! resolved and checked like the first; the client connects only to checked addresses.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode, Url};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use crate::config::HttpConfig;
use crate::files::args;
use crate::net::{Guard, GuardError};
use crate::text::decode_prefix;
use crate::{Tool, ToolContext, ToolError};

/// Response headers shown to the model.
const SHOWN_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "last-modified",
    "location",
];
/// Request headers a model may not set: they would change where or how the request goes.
const FORBIDDEN_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "proxy-authorization",
    "te",
];
/// Request headers dropped when a redirect leaves the origin.
const CREDENTIAL_HEADERS: &[&str] = &["authorization", "cookie"];

/// `http_fetch`.
pub struct HttpFetch {
    cfg: HttpConfig,
    guard: Guard,
}

impl HttpFetch {
    pub fn new(cfg: HttpConfig) -> Self {
        let guard = Guard::new(&cfg);
        Self { cfg, guard }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FetchArgs {
    /// An http:// or https:// URL.
    #[schemars(length(min = 1))]
    pub(crate) url: String,
    /// Default GET.
    #[serde(default)]
    pub(crate) method: Option<FetchMethod>,
    /// Request headers, name to value.
    #[serde(default)]
    pub(crate) headers: BTreeMap<String, String>,
    /// Request body (POST only).
    #[serde(default)]
    pub(crate) body: Option<String>,
}

// The methods `http_fetch` sends.
#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FetchMethod {
    #[serde(rename = "GET")]
    Get,
    #[serde(rename = "POST")]
    Post,
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        src = s.source();
    }
    out
}

fn parse_url(raw: &str, what: &str) -> Result<Url, ToolError> {
    let url = Url::parse(raw)
        .map_err(|e| ToolError::InvalidArgs(format!("{what} `{raw}` is not a valid URL: {e}")))?;
    match url.scheme() {
        "http" | "https" => Ok(url),
        s => Err(ToolError::Refused(format!(
            "{what} `{raw}`: scheme `{s}` is refused; only http and https are fetched"
        ))),
    }
}

fn request_headers(given: &BTreeMap<String, String>) -> Result<HeaderMap, ToolError> {
    let mut out = HeaderMap::new();
    for (k, v) in given {
        let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
            ToolError::InvalidArgs(format!("`headers.{k}` is not a valid header name"))
        })?;
        if FORBIDDEN_HEADERS.contains(&name.as_str()) {
            return Err(ToolError::InvalidArgs(format!(
                "`headers.{k}` may not be set by a tool call"
            )));
        }
        let value = HeaderValue::from_str(v).map_err(|_| {
            ToolError::InvalidArgs(format!("`headers.{k}` is not a valid header value"))
        })?;
        out.insert(name, value);
    }
    Ok(out)
}

impl HttpFetch {
    /// A client that goes nowhere but the checked addresses: no proxy, no redirects,
    /// the host's DNS answer pinned to `addrs`.
    fn client(
        &self,
        url: &Url,
        addrs: &[std::net::SocketAddr],
    ) -> Result<reqwest::Client, ToolError> {
        let mut b = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(self.cfg.timeout)
            .connect_timeout(self.cfg.timeout)
            .user_agent(concat!("skein-http-fetch/", env!("CARGO_PKG_VERSION")));
        if let Some(host) = url.host_str() {
            if !host.starts_with('[') && host.parse::<std::net::IpAddr>().is_err() {
                b = b.resolve_to_addrs(host, addrs);
            }
        }
        b.build()
            .map_err(|e| ToolError::Failed(format!("cannot build an HTTP client: {e}")))
    }

    async fn fetch(&self, a: FetchArgs) -> Result<String, ToolError> {
        let mut method = match a.method.unwrap_or(FetchMethod::Get) {
            FetchMethod::Get => Method::GET,
            FetchMethod::Post => Method::POST,
        };
        let mut body = a.body;
        if method == Method::GET && body.is_some() {
            return Err(ToolError::InvalidArgs(
                "`body` is sent only with method POST".into(),
            ));
        }
        let mut headers = request_headers(&a.headers)?;
        let mut url = parse_url(&a.url, "url")?;
        let mut hops = 0usize;
        loop {
            let addrs = self.guard.resolve(&url).await.map_err(|e| {
                let msg = match &e {
                    GuardError::Refused(m) => format!("refused: {m}"),
                    GuardError::Unresolved(m) | GuardError::Invalid(m) => m.clone(),
                };
                let msg = if hops > 0 {
                    format!("redirect to `{url}` {msg}")
                } else {
                    msg
                };
                match e {
                    GuardError::Refused(_) => ToolError::Refused(msg),
                    _ => ToolError::Failed(msg),
                }
            })?;
            let client = self.client(&url, &addrs)?;
            let mut req = client
                .request(method.clone(), url.clone())
                .headers(headers.clone());
            if let Some(b) = &body {
                req = req.body(b.clone());
            }
            let resp = req.send().await.map_err(|e| {
                if e.is_timeout() {
                    ToolError::Timeout(self.cfg.timeout)
                } else {
                    ToolError::Failed(format!("`{url}`: {}", error_chain(&e)))
                }
            })?;
            let status = resp.status();
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let Some(location) = location.filter(|_| status.is_redirection()) else {
                return self.render(resp, &url, hops).await;
            };
            if hops >= self.cfg.max_redirects {
                return Err(ToolError::Failed(format!(
                    "`{}`: more than {} redirects",
                    a.url, self.cfg.max_redirects
                )));
            }
            let next = url.join(&location).map_err(|e| {
                ToolError::Failed(format!(
                    "`{url}` redirects to an invalid URL `{location}`: {e}"
                ))
            })?;
            let next = parse_url(next.as_str(), "redirect to")?;
            if status == StatusCode::SEE_OTHER
                || (method == Method::POST
                    && matches!(status, StatusCode::MOVED_PERMANENTLY | StatusCode::FOUND))
            {
                method = Method::GET;
                body = None;
            }
            if next.origin() != url.origin() {
                for h in CREDENTIAL_HEADERS {
                    headers.remove(*h);
                }
            }
            url = next;
            hops += 1;
        }
    }

    async fn render(
        &self,
        mut resp: reqwest::Response,
        url: &Url,
        hops: usize,
    ) -> Result<String, ToolError> {
        let status = resp.status();
        let mut out = format!(
            "HTTP {} {}\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        );
        if hops > 0 {
            out.push_str(&format!("url: {url}\n"));
        }
        for name in SHOWN_HEADERS {
            if let Some(v) = resp.headers().get(*name).and_then(|v| v.to_str().ok()) {
                out.push_str(&format!("{name}: {v}\n"));
            }
        }
        out.push('\n');
        let cap = self.cfg.max_response_bytes;
        let mut data: Vec<u8> = vec![];
        let mut truncated = false;
        while let Some(chunk) = resp.chunk().await.map_err(|e| {
            if e.is_timeout() {
                ToolError::Timeout(self.cfg.timeout)
            } else {
                ToolError::Failed(format!("`{url}`: reading the body: {}", error_chain(&e)))
            }
        })? {
            let room = cap.saturating_sub(data.len());
            if chunk.len() > room {
                data.extend_from_slice(&chunk[..room]);
                truncated = true;
                break;
            }
            data.extend_from_slice(&chunk);
        }
        if truncated {
            let (text, used) = decode_prefix(&data);
            out.push_str(&text);
            out.push_str(&format!(
                "\n… [truncated: the first {used} bytes of the body shown]"
            ));
        } else {
            out.push_str(&String::from_utf8_lossy(&data));
        }
        Ok(out)
    }
}

#[async_trait]
impl Tool for HttpFetch {
    fn name(&self) -> &str {
        "http_fetch"
    }
    fn description(&self) -> &str {
        "Fetch a URL over HTTP(S) with GET or POST. Returns the status, a few headers and \
         the body as text (cut at a size limit). Private and internal addresses are refused."
    }
    fn parameters(&self) -> Value {
        crate::schema::derived::<FetchArgs>()
    }
    fn timeout(&self) -> Duration {
        // The fetch keeps its own deadline; this is the backstop.
        self.cfg.timeout + Duration::from_secs(1)
    }
    async fn call(&self, _ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: FetchArgs = args(a)?;
        tokio::time::timeout(self.cfg.timeout, self.fetch(a))
            .await
            .map_err(|_| ToolError::Timeout(self.cfg.timeout))?
    }
}
