//! The `scripted` provider: a deterministic model driven by a script file.
//!
//! `scripted:NAME` reads `NAME.yaml` from the scripts directory. The answer to a request
//! is chosen by the request alone — the turn is the number of assistant messages already
//! in it — so a replayed or resumed session sees exactly the same answers. See
//! `docs/scripts.md` for the format.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use minijinja::{Environment, ErrorKind, UndefinedBehavior};
use serde::Deserialize;
use serde_json::Value;
use skein_core::{Message, ModelRequest, ModelResponse, ToolCall, Usage};

use crate::{estimate_json_tokens, estimate_tokens, Completion, Error, Provider, Result};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub description: String,
    /// Latency of every turn, unless the turn sets its own.
    #[serde(default)]
    pub latency_ms: u64,
    pub turns: Vec<Entry>,
}

/// A turn, or a choice among turns by condition.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Entry {
    Choose { choose: Vec<Turn> },
    Turn(Turn),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// A template expression; within `choose`, the first turn whose `when` is true (or
    /// that has none) is taken.
    #[serde(default)]
    pub when: Option<String>,
    /// Text said along with tool calls.
    #[serde(default)]
    pub say: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ScriptCall>,
    /// The final answer (a turn without tool calls).
    #[serde(default)]
    pub answer: Option<String>,
    #[serde(default)]
    pub latency_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptCall {
    pub tool: String,
    #[serde(default)]
    pub args: Value,
    /// Make this call N times (a number or a template such as `"{{ inputs.n }}"`); `i` is
    /// the 0-based index inside `args`.
    #[serde(default)]
    pub repeat: Option<Value>,
}

/// What the templates of one answer may take together, so a runaway template (an
/// endless loop, a macro calling itself, a string blown up) fails the model call with a
/// clear error instead of holding a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateLimits {
    /// Template steps (minijinja's fuel: about one an instruction), all templates and
    /// conditions of one answer together.
    pub fuel: u64,
    /// How deep templates may nest (macros calling macros, loops in loops).
    pub recursion: usize,
    /// Bytes of everything one answer renders to: its text, each call's name and
    /// arguments.
    pub max_bytes: usize,
}

impl Default for TemplateLimits {
    fn default() -> Self {
        Self {
            fuel: 10_000_000,
            recursion: 100,
            max_bytes: 4 * 1024 * 1024,
        }
    }
}

/// Where a provider's scripts come from: a directory of `NAME.yaml` files, or texts the
/// program carries (the binary's built-in demo), keyed by `NAME`.
#[derive(Debug, Clone)]
pub enum ScriptSource {
    Dir(PathBuf),
    Texts(BTreeMap<String, String>),
}

/// Scripts loaded from one directory (or a set of texts), parsed once.
pub struct ScriptedProvider {
    source: ScriptSource,
    cache: Mutex<BTreeMap<String, Arc<Script>>>,
    limits: TemplateLimits,
    tokio_clock: bool,
}

impl ScriptedProvider {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self::from_source(ScriptSource::Dir(dir.into()))
    }

    /// A provider reading its scripts from `source`.
    pub fn from_source(source: ScriptSource) -> Self {
        Self {
            source,
            cache: Mutex::new(BTreeMap::new()),
            limits: TemplateLimits::default(),
            tokio_clock: false,
        }
    }

    /// The same provider sleeping its latencies on tokio's timer alone, which ends each a
    /// millisecond or more late: what a paused tokio clock (a simulation) needs, where
    /// the precise clock's real-time thread would not follow the paused time.
    pub fn on_tokio_clock(mut self) -> Self {
        self.tokio_clock = true;
        self
    }

    /// Waits until `deadline`: on tokio's timer, or to within a fraction of a millisecond
    /// (see `alarm.rs`).
    async fn sleep_until(&self, deadline: tokio::time::Instant) {
        if self.tokio_clock {
            tokio::time::sleep_until(deadline).await;
        } else {
            crate::alarm::sleep_until(deadline).await;
        }
    }

    /// The same provider with other template limits.
    pub fn with_limits(mut self, limits: TemplateLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn load(&self, name: &str) -> Result<Arc<Script>> {
        // Held while the script is read and parsed: the children of a fan-out ask for the
        // same script at once, and one of them parses it.
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = cache.get(name) {
            return Ok(s.clone());
        }
        if name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(Error::Config(format!(
                "scripted model name `{name}` is not a file name"
            )));
        }
        let (origin, text) = match &self.source {
            ScriptSource::Dir(dir) => {
                let path = dir.join(format!("{name}.yaml"));
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    Error::Config(format!(
                        "scripted model `{name}`: cannot read {}: {e}",
                        path.display()
                    ))
                })?;
                (path.display().to_string(), text)
            }
            ScriptSource::Texts(texts) => {
                let text = texts.get(name).ok_or_else(|| {
                    Error::Config(format!(
                        "scripted model `{name}`: no built-in script of that name (built in: {})",
                        texts.keys().cloned().collect::<Vec<_>>().join(", ")
                    ))
                })?;
                (format!("(built in)/scripts/{name}.yaml"), text.clone())
            }
        };
        let script = Arc::new(parse_script(&origin, &text)?);
        cache.insert(name.to_string(), script.clone());
        Ok(script)
    }
}

pub fn parse_script(origin: &str, text: &str) -> Result<Script> {
    let s: Script =
        serde_norway::from_str(text).map_err(|e| Error::Config(format!("script {origin}: {e}")))?;
    if s.turns.is_empty() {
        return Err(Error::Config(format!("script {origin}: no turns")));
    }
    Ok(s)
}

/// The tool results of a conversation as templates see them: every one (`all_results`),
/// or only those of the last assistant turn (`results`). A result that is JSON (an object
/// or an array) is seen as that value, any other as its text.
fn tool_results(req: &ModelRequest, turn: usize, every: bool) -> Vec<Value> {
    let mut out = vec![];
    let mut seen_assistant = 0;
    for m in &req.messages {
        match m {
            Message::Assistant { .. } => seen_assistant += 1,
            Message::Tool { content, .. } if every || seen_assistant == turn => {
                let v = serde_json::from_str::<Value>(content)
                    .ok()
                    .filter(|v| v.is_object() || v.is_array())
                    .unwrap_or_else(|| Value::String(content.clone()));
                out.push(v);
            }
            _ => {}
        }
    }
    out
}

/// The variable `name` of the template context, if there is one by that name.
fn variable(req: &ModelRequest, turn: usize, name: &str) -> Option<Value> {
    // The request as the model first read it: the mission with whatever the runtime put
    // around it (the advisors' notes, a handoff's blocks, handed plan tasks); every later
    // user message: teammates' broadcasts, follow-up questions.
    let mut users = req.messages.iter().filter_map(|m| match m {
        Message::User { content } => Some(content),
        _ => None,
    });
    Some(match name {
        "mission" => Value::from(req.meta.mission.as_str()),
        "prompt" => users
            .next()
            .map_or(Value::Null, |u| Value::from(u.as_str())),
        "user_messages" => users.skip(1).map(|u| Value::from(u.as_str())).collect(),
        "context" => req.meta.context.as_deref().map_or(Value::Null, Value::from),
        "inputs" => req.meta.inputs.clone(),
        "plan" => req.meta.plan.clone(),
        "agent" => Value::from(req.meta.agent.as_str()),
        "session" => Value::from(req.meta.session.as_str()),
        "turn" => Value::from(turn),
        "results" => Value::Array(tool_results(req, turn, false)),
        "all_results" => Value::Array(tool_results(req, turn, true)),
        _ => return None,
    })
}

/// The variables a template sees (see `docs/scripts.md`), each worked out only for a
/// template that reads it: a turn of literal text needs none, and the tool results of the
/// whole conversation are parsed only for a template that reads `results` or
/// `all_results`. Inside a `repeat`, `i` is the call's index.
struct Ctx<'a> {
    req: &'a ModelRequest,
    turn: usize,
    /// Variables worked out so far, as the template engine holds them.
    known: RefCell<BTreeMap<String, Option<minijinja::Value>>>,
}

impl<'a> Ctx<'a> {
    fn new(req: &'a ModelRequest, turn: usize) -> Self {
        Self {
            req,
            turn,
            known: RefCell::new(BTreeMap::new()),
        }
    }

    /// The context holding `names` (those that exist), and `i` when given.
    fn with(&self, names: &[String], i: Option<u64>) -> minijinja::Value {
        let mut known = self.known.borrow_mut();
        let mut vars: BTreeMap<String, minijinja::Value> = BTreeMap::new();
        for name in names {
            if name == "i" {
                continue;
            }
            let v = known.entry(name.clone()).or_insert_with(|| {
                variable(self.req, self.turn, name).map(|v| minijinja::Value::from_serialize(&v))
            });
            if let Some(v) = v {
                vars.insert(name.clone(), v.clone());
            }
        }
        if let Some(i) = i {
            vars.insert("i".into(), minijinja::Value::from(i));
        }
        minijinja::Value::from(vars)
    }
}

/// A template as an error message shows it: at most 80 characters.
fn shown(template: &str) -> String {
    match template.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &template[..i]),
        None => template.to_string(),
    }
}

/// A writer that takes at most `room` bytes and says so when more come.
struct Capped {
    buf: Vec<u8>,
    room: usize,
    over: bool,
}

impl io::Write for Capped {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.room {
            self.over = true;
            return Err(io::Error::other("template output over its cap"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Renders the templates of one answer within one [`TemplateLimits`] budget.
struct Renderer {
    /// Made at the first template: most turns of a script are literal text.
    env: OnceCell<RefCell<Environment<'static>>>,
    /// Templates compiled into `env` so far, by their text, with the variables each
    /// reads: a `repeat` renders the same argument templates once per call.
    compiled: RefCell<std::collections::HashMap<String, (String, Vec<String>)>>,
    limits: TemplateLimits,
    fuel: Cell<u64>,
    room: Cell<usize>,
}

impl Renderer {
    fn new(limits: TemplateLimits) -> Self {
        Self {
            env: OnceCell::new(),
            compiled: RefCell::new(std::collections::HashMap::new()),
            limits,
            fuel: Cell::new(limits.fuel),
            room: Cell::new(limits.max_bytes),
        }
    }

    fn over_bytes(&self) -> Error {
        Error::Config(format!(
            "the answer renders to more than {} bytes, the most one answer may hold",
            self.limits.max_bytes
        ))
    }

    /// Takes `n` bytes of the answer's room.
    fn spend(&self, n: usize) -> Result<()> {
        let left = self
            .room
            .get()
            .checked_sub(n)
            .ok_or_else(|| self.over_bytes())?;
        self.room.set(left);
        Ok(())
    }

    /// The template engine, armed with the fuel the answer has left.
    fn armed(&self) -> std::cell::Ref<'_, Environment<'static>> {
        let env = self.env();
        env.borrow_mut().set_fuel(Some(self.fuel.get()));
        env.borrow()
    }

    /// A template error, with the budget that stopped it named.
    fn failed(&self, what: &str, e: minijinja::Error) -> Error {
        let why = match e.kind() {
            ErrorKind::OutOfFuel => format!(
                "took more than {} steps, the most the templates of one answer may take",
                self.limits.fuel
            ),
            // Nesting too deep is one of these kinds (when parsing, or while rendering a
            // macro that calls itself): the limit is named with them.
            ErrorKind::InvalidOperation | ErrorKind::SyntaxError => format!(
                "{e} (a template may nest at most {} levels)",
                self.limits.recursion
            ),
            _ => e.to_string(),
        };
        Error::Config(format!("{what}: {why}"))
    }

    /// The engine, made on first use.
    fn env(&self) -> &RefCell<Environment<'static>> {
        self.env.get_or_init(|| {
            let mut env = Environment::new();
            env.set_undefined_behavior(UndefinedBehavior::Lenient);
            env.set_recursion_limit(self.limits.recursion);
            RefCell::new(env)
        })
    }

    /// The name `template` is compiled under in the engine, and the variables it reads;
    /// compiled at its first use in this answer.
    fn compile(&self, template: &str, what: &str) -> Result<(String, Vec<String>)> {
        if let Some(c) = self.compiled.borrow().get(template) {
            return Ok(c.clone());
        }
        let name = format!("template {}", self.compiled.borrow().len() + 1);
        let mut env = self.env().borrow_mut();
        env.add_template_owned(name.clone(), template.to_string())
            .map_err(|e| self.failed(what, e))?;
        let tmpl = env.get_template(&name).map_err(|e| self.failed(what, e))?;
        let names: Vec<String> = tmpl.undeclared_variables(false).into_iter().collect();
        let c = (name, names);
        self.compiled
            .borrow_mut()
            .insert(template.to_string(), c.clone());
        Ok(c)
    }

    fn render(&self, template: &str, ctx: &Ctx<'_>, i: Option<u64>) -> Result<String> {
        if !template.contains("{{") && !template.contains("{%") {
            self.spend(template.len())?;
            return Ok(template.to_string());
        }
        let what = format!("template `{}`", shown(template));
        let (name, names) = self.compile(template, &what)?;
        let vars = ctx.with(&names, i);
        let env = self.armed();
        let tmpl = env.get_template(&name).map_err(|e| self.failed(&what, e))?;
        let mut out = Capped {
            buf: vec![],
            room: self.room.get(),
            over: false,
        };
        let done = tmpl.render_captured_to(vars, &mut out);
        if out.over {
            return Err(self.over_bytes());
        }
        let done = done.map_err(|e| self.failed(&what, e))?;
        if let Some((used, _)) = done.state().fuel_levels() {
            self.fuel.set(self.fuel.get().saturating_sub(used));
        }
        self.spend(out.buf.len())?;
        String::from_utf8(out.buf).map_err(|e| Error::Config(format!("{what}: {e}")))
    }

    fn eval_bool(&self, expr: &str, ctx: &Ctx<'_>) -> Result<bool> {
        let what = format!("condition `{}`", shown(expr));
        // minijinja's expression lexer panics on `}}` followed by more text ("empty lexer
        // stack"), so a condition may not hold it at all.
        if expr.contains("}}") {
            return Err(Error::Config(format!(
                "{what}: a condition is an expression, without `{{{{ }}}}`; write nested \
                 braces as `}} }}`"
            )));
        }
        let env = self.armed();
        let e = env
            .compile_expression(expr)
            .map_err(|e| self.failed(&what, e))?;
        let names: Vec<String> = e.undeclared_variables(false).into_iter().collect();
        let v = e
            .eval(ctx.with(&names, None))
            .map_err(|e| self.failed(&what, e))?;
        Ok(v.is_true())
    }

    fn render_value(&self, v: &Value, ctx: &Ctx<'_>, i: Option<u64>) -> Result<Value> {
        Ok(match v {
            Value::String(s) => Value::String(self.render(s, ctx, i)?),
            Value::Array(a) => Value::Array(
                a.iter()
                    .map(|x| self.render_value(x, ctx, i))
                    .collect::<Result<_>>()?,
            ),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| {
                        self.spend(k.len())?;
                        Ok((k.clone(), self.render_value(x, ctx, i)?))
                    })
                    .collect::<Result<_>>()?,
            ),
            other => {
                self.spend(other.to_string().len())?;
                other.clone()
            }
        })
    }
}

/// The answer a script gives to a request, and the latency it asks for.
pub fn answer(script: &Script, req: &ModelRequest) -> Result<(ModelResponse, u64)> {
    answer_within(script, req, TemplateLimits::default())
}

/// [`answer`] with the templates held to `limits`.
pub fn answer_within(
    script: &Script,
    req: &ModelRequest,
    limits: TemplateLimits,
) -> Result<(ModelResponse, u64)> {
    let turn_no = req
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Assistant { .. }))
        .count();
    let entry = script.turns.get(turn_no).ok_or_else(|| {
        Error::Config(format!(
            "script has {} turns; turn {} was asked for",
            script.turns.len(),
            turn_no + 1
        ))
    })?;
    let r = Renderer::new(limits);
    let ctx = Ctx::new(req, turn_no);
    let turn = match entry {
        Entry::Turn(t) => t,
        Entry::Choose { choose } => {
            let mut picked = None;
            for t in choose {
                match &t.when {
                    None => {
                        picked = Some(t);
                        break;
                    }
                    Some(w) if r.eval_bool(w, &ctx)? => {
                        picked = Some(t);
                        break;
                    }
                    Some(_) => {}
                }
            }
            picked.ok_or_else(|| {
                Error::Config(format!("turn {}: no `choose` case matched", turn_no + 1))
            })?
        }
    };
    let latency = turn.latency_ms.unwrap_or(script.latency_ms);
    if let Some(a) = &turn.answer {
        let content = r.render(a, &ctx, None)?;
        return Ok((
            ModelResponse {
                content: Some(content),
                tool_calls: vec![],
                finish_reason: Some("stop".into()),
            },
            latency,
        ));
    }
    let mut calls = vec![];
    for c in &turn.tool_calls {
        let n = match &c.repeat {
            None => 1,
            Some(Value::Number(n)) => n.as_u64().unwrap_or(1),
            Some(Value::String(s)) => r
                .render(s, &ctx, None)?
                .trim()
                .parse::<u64>()
                .map_err(|_| Error::Config(format!("repeat `{s}` did not render to a number")))?,
            Some(other) => return Err(Error::Config(format!("repeat: {other} is not a number"))),
        };
        // Every call takes at least its name and id of the answer's room: refuse a count
        // that cannot fit before making any of it.
        let least = (c.tool.len() + 8) as u128;
        if u128::from(n) * least > r.room.get() as u128 {
            return Err(r.over_bytes());
        }
        for i in 0..n {
            let id = format!("call_{}_{}", turn_no + 1, calls.len() + 1);
            r.spend(id.len() + c.tool.len())?;
            calls.push(ToolCall {
                id,
                name: c.tool.clone(),
                args: r.render_value(&c.args, &ctx, Some(i))?,
            });
        }
    }
    let say = turn
        .say
        .as_ref()
        .map(|s| r.render(s, &ctx, None))
        .transpose()?;
    Ok((
        ModelResponse {
            content: say,
            tool_calls: calls,
            finish_reason: Some("tool_calls".into()),
        },
        latency,
    ))
}

/// Token counts the scripted model reports: 4 bytes a token of everything sent, and of
/// everything answered.
fn usage(req: &ModelRequest, resp: &ModelResponse) -> Usage {
    let input: u64 = req
        .messages
        .iter()
        .map(|m| match m {
            Message::System { content } | Message::User { content } => estimate_tokens(content),
            Message::Assistant {
                content,
                tool_calls,
            } => {
                estimate_tokens(content.as_deref().unwrap_or(""))
                    + tool_calls
                        .iter()
                        .map(|c| estimate_json_tokens(&c.args))
                        .sum::<u64>()
            }
            Message::Tool { content, .. } => estimate_tokens(content),
        })
        .sum();
    let output = estimate_tokens(resp.content.as_deref().unwrap_or(""))
        + resp
            .tool_calls
            .iter()
            .map(|c| estimate_json_tokens(&c.args))
            .sum::<u64>();
    Usage {
        input_tokens: input,
        output_tokens: output,
        cost: 0.0,
        estimated: false,
        ..Default::default()
    }
}

#[async_trait]
impl Provider for ScriptedProvider {
    async fn complete(&self, model: &str, req: &ModelRequest) -> Result<Completion> {
        let start = tokio::time::Instant::now();
        let script = self.load(model)?;
        let (response, latency) = answer_within(&script, req, self.limits)
            .map_err(|e| Error::Config(format!("scripted:{model}: {e}")))?;
        if latency > 0 {
            self.sleep_until(start + Duration::from_millis(latency))
                .await;
        }
        let usage = usage(req, &response);
        Ok(Completion { response, usage })
    }

    /// The scripted answer's text, sent a few words at a time spread over its latency, as
    /// a real server streams it.
    async fn complete_streaming(
        &self,
        model: &str,
        req: &ModelRequest,
        on_text: crate::TextSink<'_>,
    ) -> Result<Completion> {
        // Each piece is due at its share of the latency, counted from the start, so the
        // whole answer takes the script's latency however many pieces it has.
        let start = tokio::time::Instant::now();
        let script = self.load(model)?;
        let (response, latency) = answer_within(&script, req, self.limits)
            .map_err(|e| Error::Config(format!("scripted:{model}: {e}")))?;
        let pieces = stream_pieces(response.content.as_deref().unwrap_or(""));
        let latency = Duration::from_millis(latency);
        let n = pieces.len().max(1) as u32;
        if pieces.is_empty() && !latency.is_zero() {
            self.sleep_until(start + latency).await;
        }
        for (i, p) in pieces.iter().enumerate() {
            if !latency.is_zero() {
                self.sleep_until(start + latency * (i as u32 + 1) / n).await;
            }
            on_text(p);
        }
        let usage = usage(req, &response);
        Ok(Completion { response, usage })
    }
}

/// `text` cut into at most 16 pieces at word boundaries; joined, they are `text`.
fn stream_pieces(text: &str) -> Vec<&str> {
    if text.is_empty() {
        return vec![];
    }
    let words = text.split_inclusive(' ').count();
    let per = words.div_ceil(16).max(1);
    let mut out = vec![];
    let mut start = 0;
    let mut n = 0;
    for (i, _) in text.match_indices(' ') {
        n += 1;
        if n % per == 0 {
            out.push(&text[start..=i]);
            start = i + 1;
        }
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
