//! One connection to an MCP server, over stdio (a child process) or Streamable HTTP, and
//! the [`Server`] that keeps one: started at worker start, started again when it died,
//! with a bound on the calls in flight.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{oneshot, Semaphore};

use crate::config::ServerConfig;
use crate::protocol::{
    self, codes, CallResult, Incoming, InitializeResult, ProtocolError, RequestId, RpcError,
    ToolDef, ToolsPage,
};

/// Largest message a server may send, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;

/// Pages of `tools/list` read at most.
const MAX_PAGES: usize = 100;

/// Why a request to a server failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum McpError {
    #[error("could not start: {0}")]
    Start(String),
    #[error("the server is gone: {0}")]
    Gone(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the server answered with error {}: {}", .0.code, .0.message)]
    Rpc(RpcError),
    #[error("the server sent something unreadable: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("HTTP: {0}")]
    Http(String),
}

type Pending = Arc<Mutex<HashMap<i64, oneshot::Sender<Result<Value, RpcError>>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a server tells without being asked.
#[derive(Default)]
pub struct Signals {
    /// `notifications/tools/list_changed` arrived since the tools were last listed.
    pub list_changed: AtomicBool,
    /// Progress of calls in flight, by progress token (the request's id).
    pub progress: Mutex<HashMap<i64, protocol::Progress>>,
    /// Who hears a call's progress as it arrives, by progress token.
    listeners: Mutex<HashMap<i64, ProgressListener>>,
}

/// Hears each `notifications/progress` of one call. It runs on the task that reads the
/// server, so it must not block.
pub type ProgressListener = Arc<dyn Fn(&protocol::Progress) + Send + Sync>;

impl Signals {
    fn notified(&self, method: &str, params: &Value) {
        match method {
            "notifications/tools/list_changed" => self.list_changed.store(true, Ordering::SeqCst),
            "notifications/progress" => {
                if let Some(p) = protocol::Progress::from_params(params) {
                    if let Some(t) = p.token.as_i64() {
                        let listener = lock(&self.listeners).get(&t).cloned();
                        if let Some(l) = listener {
                            l(&p);
                        }
                        lock(&self.progress).insert(t, p);
                    }
                }
            }
            // Log messages, resource updates and the rest are not acted on.
            _ => {}
        }
    }
}

/// The answer this client gives a server's own request: `ping` is answered, the rest
/// (roots, sampling, elicitation) are not offered by this client.
fn answer(method: &str) -> Result<Value, RpcError> {
    if method == "ping" {
        Ok(json!({}))
    } else {
        Err(RpcError {
            code: codes::METHOD_NOT_FOUND,
            message: format!("this client does not offer `{method}`"),
            data: None,
        })
    }
}

/// Reads one line of at most [`MAX_MESSAGE_BYTES`]; `None` at the end of the stream.
async fn read_line<R: AsyncBufRead + Unpin>(r: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = vec![];
    loop {
        let buf = r.fill_buf().await?;
        if buf.is_empty() {
            return Ok((!line.is_empty()).then_some(line));
        }
        let (take, done) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > MAX_MESSAGE_BYTES {
            return Err(std::io::Error::other(format!(
                "a message longer than {MAX_MESSAGE_BYTES} bytes"
            )));
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if done {
            return Ok(Some(line));
        }
    }
}

/// A stdio server's input; `None` once closed (the server's sign to exit).
type Stdin = Arc<tokio::sync::Mutex<Option<ChildStdin>>>;

struct StdioConn {
    stdin: Stdin,
    pending: Pending,
    alive: Arc<AtomicBool>,
    /// Why it died, once it has.
    died: Arc<Mutex<Option<String>>>,
    child: Mutex<Option<Child>>,
}

async fn write_line(
    stdin: &tokio::sync::Mutex<Option<ChildStdin>>,
    msg: &Value,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let mut w = stdin.lock().await;
    let Some(w) = w.as_mut() else {
        return Err(std::io::Error::other("its input is closed"));
    };
    w.write_all(&line).await?;
    w.flush().await
}

impl StdioConn {
    fn spawn(name: &str, cfg: &ServerConfig, signals: Arc<Signals>) -> Result<Self, McpError> {
        let program = cfg.command.as_deref().unwrap_or_default();
        let mut cmd = Command::new(program);
        cmd.args(&cfg.args)
            .envs(&cfg.env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(dir) = &cfg.cwd {
            cmd.current_dir(dir);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| McpError::Start(format!("`{program}`: {e}")))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(McpError::Start("the child's pipes were not made".into()));
        };
        let stdin: Stdin = Arc::new(tokio::sync::Mutex::new(Some(stdin)));
        let pending: Pending = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let died: Arc<Mutex<Option<String>>> = Arc::default();
        // What the server writes on stderr is its own log: kept at debug level, a line cut
        // at 500 bytes.
        let server = name.to_string();
        tokio::spawn(async move {
            let mut r = BufReader::new(stderr);
            while let Ok(Some(line)) = read_line(&mut r).await {
                let text = String::from_utf8_lossy(&line);
                let text = skein_core::text::clip(text.trim_end(), 500);
                tracing::debug!(server = %server, "mcp server stderr: {text}");
            }
        });
        let (p, a, d, w) = (pending.clone(), alive.clone(), died.clone(), stdin.clone());
        let server = name.to_string();
        tokio::spawn(async move {
            let mut r = BufReader::new(stdout);
            let why = loop {
                let line = match read_line(&mut r).await {
                    Ok(Some(l)) => l,
                    Ok(None) => break "it closed its output (exited)".to_string(),
                    Err(e) => break format!("reading its output: {e}"),
                };
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let msgs = match protocol::parse_messages(&line) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(server = %server, error = %e, "mcp server sent an unreadable message");
                        continue;
                    }
                };
                for m in msgs {
                    match m {
                        Incoming::Response { id, result } => {
                            let RequestId::Num(n) = id else { continue };
                            if let Some(tx) = lock(&p).remove(&n) {
                                let _ = tx.send(result);
                            }
                        }
                        Incoming::Notification { method, params } => {
                            signals.notified(&method, &params)
                        }
                        Incoming::Request { id, method, .. } => {
                            let reply = protocol::response(&id, answer(&method));
                            let _ = write_line(&w, &reply).await;
                        }
                    }
                }
            };
            a.store(false, Ordering::SeqCst);
            *lock(&d) = Some(why);
            // Every call waiting on this server hears it is gone.
            lock(&p).clear();
        });
        Ok(Self {
            stdin,
            pending,
            alive,
            died,
            child: Mutex::new(Some(child)),
        })
    }

    fn gone(&self) -> McpError {
        McpError::Gone(
            lock(&self.died)
                .clone()
                .unwrap_or_else(|| "it stopped".into()),
        )
    }

    async fn request(&self, id: i64, msg: &Value) -> Result<Value, McpError> {
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        if !self.alive.load(Ordering::SeqCst) {
            lock(&self.pending).remove(&id);
            return Err(self.gone());
        }
        if let Err(e) = write_line(&self.stdin, msg).await {
            lock(&self.pending).remove(&id);
            return Err(McpError::Gone(format!("writing to it: {e}")));
        }
        match rx.await {
            Ok(r) => r.map_err(McpError::Rpc),
            Err(_) => Err(self.gone()),
        }
    }

    async fn notify(&self, msg: &Value) -> Result<(), McpError> {
        write_line(&self.stdin, msg)
            .await
            .map_err(|e| McpError::Gone(format!("writing to it: {e}")))
    }
}

impl StdioConn {
    /// Stops the server as the protocol asks: its input closed, then, if it has not
    /// exited within two seconds, killed.
    async fn close(&self) {
        // Calls still in flight are cancelled first, so the server stops them rather
        // than losing them with its input.
        let open: Vec<i64> = lock(&self.pending).keys().copied().collect();
        for id in open {
            let msg = protocol::notification(
                "notifications/cancelled",
                json!({"requestId": id, "reason": "the client is stopping"}),
            );
            let _ = write_line(&self.stdin, &msg).await;
        }
        drop(self.stdin.lock().await.take());
        let child = lock(&self.child).take();
        if let Some(mut c) = child {
            if tokio::time::timeout(Duration::from_secs(2), c.wait())
                .await
                .is_err()
            {
                let _ = c.kill().await;
            }
        }
    }
}

impl Drop for StdioConn {
    fn drop(&mut self) {
        if let Some(mut c) = lock(&self.child).take() {
            let _ = c.start_kill();
        }
    }
}

struct HttpConn {
    client: reqwest::Client,
    url: String,
    headers: reqwest::header::HeaderMap,
    session: Mutex<Option<String>>,
    version: Mutex<Option<String>>,
    signals: Arc<Signals>,
    /// A 404 for our session: the server forgot it and a new one must be made.
    expired: AtomicBool,
}

impl HttpConn {
    fn new(cfg: &ServerConfig, signals: Arc<Signals>) -> Result<Self, McpError> {
        use reqwest::header::{HeaderName, HeaderValue};
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, var) in &cfg.headers_env {
            let value = std::env::var(var).map_err(|_| {
                McpError::Start(format!(
                    "header `{name}` is taken from the environment variable `{var}`, which is \
                     not set"
                ))
            })?;
            let n = HeaderName::try_from(name.as_str())
                .map_err(|_| McpError::Start(format!("`{name}` is not a header name")))?;
            let mut v = HeaderValue::try_from(value).map_err(|_| {
                McpError::Start(format!("the value of `{var}` is not a valid header value"))
            })?;
            v.set_sensitive(true);
            headers.insert(n, v);
        }
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| McpError::Start(e.to_string()))?;
        Ok(Self {
            client,
            url: cfg.url.clone().unwrap_or_default(),
            headers,
            session: Mutex::new(None),
            version: Mutex::new(None),
            signals,
            expired: AtomicBool::new(false),
        })
    }

    fn post(&self, msg: &Value) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .header("Accept", "application/json, text/event-stream")
            .json(msg);
        if let Some(s) = lock(&self.session).clone() {
            req = req.header("Mcp-Session-Id", s);
        }
        if let Some(v) = lock(&self.version).clone() {
            req = req.header("MCP-Protocol-Version", v);
        }
        req
    }

    async fn send(&self, msg: &Value) -> Result<reqwest::Response, McpError> {
        let resp = self
            .post(msg)
            .send()
            .await
            .map_err(|e| McpError::Http(e.without_url().to_string()))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND && lock(&self.session).is_some() {
            self.expired.store(true, Ordering::SeqCst);
            return Err(McpError::Gone("the server ended our session (404)".into()));
        }
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(McpError::Http(format!(
                "{status}: {}",
                skein_core::text::clip(body.trim(), 300)
            )));
        }
        if let Some(s) = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
        {
            if lock(&self.session).is_none() {
                *lock(&self.session) = Some(s.to_string());
            }
        }
        Ok(resp)
    }

    /// Acts on what came with an answer; the response to `id` when it is among them.
    async fn take(&self, id: i64, msgs: Vec<Incoming>) -> Option<Result<Value, RpcError>> {
        let mut found = None;
        for m in msgs {
            match m {
                Incoming::Response {
                    id: RequestId::Num(n),
                    result,
                } if n == id => found = Some(result),
                Incoming::Response { .. } => {}
                Incoming::Notification { method, params } => {
                    self.signals.notified(&method, &params)
                }
                Incoming::Request { id, method, .. } => {
                    let reply = protocol::response(&id, answer(&method));
                    let _ = self.send(&reply).await;
                }
            }
        }
        found
    }

    async fn request(&self, id: i64, msg: &Value) -> Result<Value, McpError> {
        let mut resp = self.send(msg).await?;
        let kind = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        if kind.starts_with("text/event-stream") {
            let mut sse = SseReader::default();
            loop {
                let chunk = resp
                    .chunk()
                    .await
                    .map_err(|e| McpError::Http(e.without_url().to_string()))?;
                let Some(chunk) = chunk else {
                    return Err(McpError::Gone(
                        "the event stream ended before the answer".into(),
                    ));
                };
                for data in sse.push(&chunk)? {
                    let msgs = protocol::parse_messages(data.as_bytes())?;
                    if let Some(r) = self.take(id, msgs).await {
                        return r.map_err(McpError::Rpc);
                    }
                }
            }
        }
        let mut body = vec![];
        while let Some(c) = resp
            .chunk()
            .await
            .map_err(|e| McpError::Http(e.without_url().to_string()))?
        {
            if body.len() + c.len() > MAX_MESSAGE_BYTES {
                return Err(McpError::Http(format!(
                    "an answer longer than {MAX_MESSAGE_BYTES} bytes"
                )));
            }
            body.extend_from_slice(&c);
        }
        let msgs = protocol::parse_messages(&body)?;
        match self.take(id, msgs).await {
            Some(r) => r.map_err(McpError::Rpc),
            None => Err(McpError::Protocol(ProtocolError(format!(
                "the answer did not hold the response to request {id}"
            )))),
        }
    }

    async fn notify(&self, msg: &Value) -> Result<(), McpError> {
        self.send(msg).await.map(drop)
    }

    /// Ends the session (DELETE), where the server keeps one.
    async fn close(&self) {
        let Some(s) = lock(&self.session).clone() else {
            return;
        };
        let _ = self
            .client
            .delete(&self.url)
            .headers(self.headers.clone())
            .header("Mcp-Session-Id", s)
            .timeout(Duration::from_secs(2))
            .send()
            .await;
    }
}

/// Reads server-sent events: the `data` of each event, lines joined.
#[derive(Default)]
pub struct SseReader {
    buf: Vec<u8>,
    data: Vec<String>,
}

impl SseReader {
    /// Takes the next bytes of the stream; returns the data of every event they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, ProtocolError> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() > MAX_MESSAGE_BYTES {
            return Err(ProtocolError(format!(
                "an event longer than {MAX_MESSAGE_BYTES} bytes"
            )));
        }
        let mut out = vec![];
        while let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if !self.data.is_empty() {
                    out.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                self.data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
            }
            // `event:`, `id:`, `retry:` and comments are not needed here.
        }
        Ok(out)
    }
}

enum Transport {
    Stdio(StdioConn),
    Http(HttpConn),
}

/// One initialized connection.
pub struct Connection {
    transport: Transport,
    next_id: AtomicI64,
    pub init: InitializeResult,
    pub signals: Arc<Signals>,
}

/// Sends `notifications/cancelled` for a request whose caller stopped waiting.
struct CancelOnDrop {
    conn: Option<Arc<Connection>>,
    id: i64,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            let id = self.id;
            tracing::debug!(request = id, "mcp call abandoned: telling the server");
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let msg = protocol::notification(
                        "notifications/cancelled",
                        json!({"requestId": id, "reason": "the caller stopped waiting"}),
                    );
                    let _ = conn.notify_raw(&msg).await;
                    lock(&conn.signals.progress).remove(&id);
                    lock(&conn.signals.listeners).remove(&id);
                });
            }
        }
    }
}

impl Connection {
    /// Starts (stdio) or reaches (HTTP) the server and initializes it.
    pub async fn open(name: &str, cfg: &ServerConfig) -> Result<Arc<Self>, McpError> {
        let signals = Arc::new(Signals::default());
        let transport = if cfg.url.is_some() {
            Transport::Http(HttpConn::new(cfg, signals.clone())?)
        } else {
            Transport::Stdio(StdioConn::spawn(name, cfg, signals.clone())?)
        };
        let mut conn = Self {
            transport,
            next_id: AtomicI64::new(1),
            init: InitializeResult {
                protocol_version: String::new(),
                tools: false,
                tools_list_changed: false,
                server_info: Default::default(),
                instructions: None,
            },
            signals,
        };
        let init = tokio::time::timeout(cfg.startup_timeout, async {
            let r = conn
                .raw_request("initialize", protocol::initialize_params())
                .await?;
            let init = InitializeResult::from_value(&r)?;
            if let Transport::Http(h) = &conn.transport {
                *lock(&h.version) = Some(init.protocol_version.clone());
            }
            conn.notify_raw(&protocol::notification(
                "notifications/initialized",
                json!({}),
            ))
            .await?;
            Ok::<_, McpError>(init)
        })
        .await
        .map_err(|_| {
            McpError::Start(format!(
                "no answer to `initialize` within {:?}",
                cfg.startup_timeout
            ))
        })?
        .map_err(|e| match e {
            McpError::Start(s) => McpError::Start(s),
            e => McpError::Start(e.to_string()),
        })?;
        conn.init = init;
        Ok(Arc::new(conn))
    }

    /// Whether requests may still be sent.
    pub fn alive(&self) -> bool {
        match &self.transport {
            Transport::Stdio(s) => s.alive.load(Ordering::SeqCst),
            Transport::Http(h) => !h.expired.load(Ordering::SeqCst),
        }
    }

    async fn raw_request(&self, method: &str, params: Value) -> Result<Value, McpError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        self.send_request(id, method, params).await
    }

    async fn send_request(&self, id: i64, method: &str, params: Value) -> Result<Value, McpError> {
        let msg = protocol::request(id, method, params);
        match &self.transport {
            Transport::Stdio(s) => s.request(id, &msg).await,
            Transport::Http(h) => h.request(id, &msg).await,
        }
    }

    async fn notify_raw(&self, msg: &Value) -> Result<(), McpError> {
        match &self.transport {
            Transport::Stdio(s) => s.notify(msg).await,
            Transport::Http(h) => h.notify(msg).await,
        }
    }

    /// Sends a request and waits for its answer. Dropped before the answer (a timeout, a
    /// cancelled step), it tells the server with `notifications/cancelled`.
    pub async fn request(self: &Arc<Self>, method: &str, params: Value) -> Result<Value, McpError> {
        self.request_heard(method, params, None).await
    }

    /// [`Connection::request`], with `listener` hearing the call's progress.
    async fn request_heard(
        self: &Arc<Self>,
        method: &str,
        mut params: Value,
        listener: Option<ProgressListener>,
    ) -> Result<Value, McpError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        if method == "tools/call" {
            if let Value::Object(p) = &mut params {
                p.insert("_meta".into(), json!({"progressToken": id}));
            }
        }
        if let Some(l) = listener {
            lock(&self.signals.listeners).insert(id, l);
        }
        let mut guard = CancelOnDrop {
            conn: Some(self.clone()),
            id,
        };
        let r = self.send_request(id, method, params).await;
        guard.conn = None;
        lock(&self.signals.progress).remove(&id);
        lock(&self.signals.listeners).remove(&id);
        r
    }

    /// Every tool, page after page.
    pub async fn list_tools(self: &Arc<Self>) -> Result<Vec<ToolDef>, McpError> {
        // Cleared first: a change announced while the pages are read is read next time.
        self.signals.list_changed.store(false, Ordering::SeqCst);
        let mut tools = vec![];
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let params = match &cursor {
                Some(c) => json!({"cursor": c}),
                None => json!({}),
            };
            let page = ToolsPage::from_value(&self.request("tools/list", params).await?)?;
            tools.extend(page.tools);
            match page.next_cursor {
                Some(c) if Some(&c) != cursor.as_ref() => cursor = Some(c),
                _ => return Ok(tools),
            }
        }
        Err(McpError::Protocol(ProtocolError(format!(
            "tools/list went on for more than {MAX_PAGES} pages"
        ))))
    }

    pub async fn call_tool(
        self: &Arc<Self>,
        name: &str,
        args: Value,
    ) -> Result<CallResult, McpError> {
        self.call_tool_heard(name, args, None).await
    }

    /// [`Connection::call_tool`], with `listener` hearing the call's progress.
    pub async fn call_tool_heard(
        self: &Arc<Self>,
        name: &str,
        args: Value,
        listener: Option<ProgressListener>,
    ) -> Result<CallResult, McpError> {
        let r = self
            .request_heard(
                "tools/call",
                json!({"name": name, "arguments": args}),
                listener,
            )
            .await?;
        Ok(CallResult::from_value(&r)?)
    }

    /// Stops the server (stdio) or ends the session (HTTP).
    pub async fn close(&self) {
        match &self.transport {
            Transport::Stdio(s) => s.close().await,
            Transport::Http(h) => h.close().await,
        }
    }

    /// The process id of a stdio server.
    pub fn pid(&self) -> Option<u32> {
        match &self.transport {
            Transport::Stdio(s) => lock(&s.child).as_ref().and_then(Child::id),
            Transport::Http(_) => None,
        }
    }
}

/// A server as a worker keeps it: one connection, opened again when it died, and the
/// tools it listed.
pub struct Server {
    pub name: String,
    pub cfg: ServerConfig,
    conn: tokio::sync::Mutex<Option<Arc<Connection>>>,
    permits: Semaphore,
    tools: Mutex<Vec<ToolDef>>,
    /// Times the connection was opened again after it died.
    restarts: AtomicI64,
    last_error: Mutex<Option<String>>,
}

impl Server {
    /// Starts the server and lists its tools: a server that will not start is an error
    /// here, at worker start, not at its first call.
    pub async fn start(name: &str, cfg: ServerConfig) -> Result<Arc<Self>, McpError> {
        cfg.check(name).map_err(McpError::Start)?;
        let s = Arc::new(Self {
            name: name.to_string(),
            permits: Semaphore::new(cfg.max_concurrency),
            cfg,
            conn: tokio::sync::Mutex::new(None),
            tools: Mutex::new(vec![]),
            restarts: AtomicI64::new(0),
            last_error: Mutex::new(None),
        });
        s.connection().await?;
        Ok(s)
    }

    /// The live connection, opened (and the tools listed) when there is none or it died.
    async fn connection(&self) -> Result<Arc<Connection>, McpError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.alive() {
                if c.signals.list_changed.load(Ordering::SeqCst) {
                    match c.list_tools().await {
                        Ok(t) => *lock(&self.tools) = t,
                        Err(e) => {
                            tracing::warn!(server = %self.name, error = %e, "re-listing tools failed")
                        }
                    }
                }
                return Ok(c.clone());
            }
            self.restarts.fetch_add(1, Ordering::SeqCst);
            tracing::warn!(server = %self.name, "mcp server died; starting it again");
        }
        *slot = None;
        let opened = async {
            let c = Connection::open(&self.name, &self.cfg).await?;
            let tools = if c.init.tools {
                tokio::time::timeout(self.cfg.startup_timeout, c.list_tools())
                    .await
                    .map_err(|_| McpError::Start("no answer to `tools/list`".into()))??
            } else {
                vec![]
            };
            Ok::<_, McpError>((c, tools))
        }
        .await;
        match opened {
            Ok((c, tools)) => {
                *lock(&self.tools) = tools;
                *lock(&self.last_error) = None;
                *slot = Some(c.clone());
                Ok(c)
            }
            Err(e) => {
                *lock(&self.last_error) = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// The tools as last listed.
    pub fn tools(&self) -> Vec<ToolDef> {
        lock(&self.tools).clone()
    }

    pub fn tool(&self, name: &str) -> Option<ToolDef> {
        lock(&self.tools).iter().find(|t| t.name == name).cloned()
    }

    /// The input schema of the listed tool `name`, shared.
    pub fn tool_schema(&self, name: &str) -> Option<std::sync::Arc<serde_json::Value>> {
        lock(&self.tools)
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.input_schema.clone())
    }

    pub fn restarts(&self) -> i64 {
        self.restarts.load(Ordering::SeqCst)
    }

    /// Why the server is not usable, if it is not: it died and could not be started
    /// again.
    pub fn problem(&self) -> Option<String> {
        lock(&self.last_error).clone()
    }

    /// The connection in use, if any (for tests and diagnostics).
    pub async fn current(&self) -> Option<Arc<Connection>> {
        self.conn.lock().await.clone()
    }

    /// Re-lists the tools if the server said they changed since they were last listed
    /// (a dead server is left for its next call to start again). Never waits for a
    /// server being started again: its tools are listed when it is up.
    pub async fn relist_if_changed(&self) {
        let Some(c) = self.conn.try_lock().ok().and_then(|slot| slot.clone()) else {
            return;
        };
        if !c.alive() || !c.signals.list_changed.load(Ordering::SeqCst) {
            return;
        }
        match tokio::time::timeout(self.cfg.startup_timeout, c.list_tools()).await {
            Ok(Ok(t)) => *lock(&self.tools) = t,
            Ok(Err(e)) => {
                tracing::warn!(server = %self.name, error = %e, "re-listing tools failed")
            }
            Err(_) => tracing::warn!(server = %self.name, "no answer to `tools/list`"),
        }
    }

    /// Re-lists the tools now.
    pub async fn refresh(&self) -> Result<Vec<ToolDef>, McpError> {
        let c = self.connection().await?;
        let t = c.list_tools().await?;
        *lock(&self.tools) = t.clone();
        Ok(t)
    }

    /// Calls a tool, waiting for a free slot first, within the server's timeout (the
    /// wait for a slot included). Past the timeout the call is cancelled at the server.
    pub async fn call(&self, tool: &str, args: Value) -> Result<CallResult, McpError> {
        self.call_heard(tool, args, None).await
    }

    /// [`Server::call`], with `listener` hearing the call's progress.
    pub async fn call_heard(
        &self,
        tool: &str,
        args: Value,
        listener: Option<ProgressListener>,
    ) -> Result<CallResult, McpError> {
        // `timeout` is the call's, the wait for a free slot included; starting again a
        // server that died is not part of it (a cold start of a Python server can take
        // seconds on a busy machine) and has `startup_timeout` of its own.
        let limit = self.cfg.timeout;
        let asked = tokio::time::Instant::now();
        let _permit = tokio::time::timeout(limit, self.permits.acquire())
            .await
            .map_err(|_| McpError::Timeout(limit))?
            .map_err(|_| McpError::Gone("the server is closed".into()))?;
        let waited = asked.elapsed();
        let c = self.connection().await?;
        tokio::time::timeout(
            limit.saturating_sub(waited),
            c.call_tool_heard(tool, args, listener),
        )
        .await
        .map_err(|_| McpError::Timeout(limit))?
    }

    pub async fn close(&self) {
        if let Some(c) = self.conn.lock().await.take() {
            c.close().await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_read_across_chunks() {
        let mut r = SseReader::default();
        assert!(r.push(b"event: message\ndata: {\"a\"").unwrap().is_empty());
        let out = r
            .push(b":1}\r\n\r\n: comment\ndata: x\ndata: y\n\n")
            .unwrap();
        assert_eq!(out, vec!["{\"a\"".to_string() + ":1}", "x\ny".to_string()]);
    }

    #[tokio::test]
    async fn a_line_longer_than_the_cap_is_refused() {
        let big = vec![b'x'; MAX_MESSAGE_BYTES + 10];
        let mut r = BufReader::new(&big[..]);
        assert!(read_line(&mut r).await.is_err());
        let mut r = BufReader::new(&b"ab\ncd"[..]);
        assert_eq!(read_line(&mut r).await.unwrap().unwrap(), b"ab\n");
        assert_eq!(read_line(&mut r).await.unwrap().unwrap(), b"cd");
        assert!(read_line(&mut r).await.unwrap().is_none());
    }
}
