//! The `scripted` provider: a deterministic model driven by a script file.
//!
//! `scripted:NAME` reads `NAME.yaml` from the scripts directory. The answer to a request
//! is chosen by the request alone — the turn is the number of assistant messages already
//! in it — so a replayed or resumed session sees exactly the same answers. See
//! `docs/scripts.md` for the format.

use std::cell::{Cell, RefCell};
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

use crate::{estimate_tokens, Completion, Error, Provider, Result};

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

/// Scripts loaded from one directory, parsed once.
pub struct ScriptedProvider {
    dir: PathBuf,
    cache: Mutex<BTreeMap<String, Arc<Script>>>,
    limits: TemplateLimits,
}

impl ScriptedProvider {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            cache: Mutex::new(BTreeMap::new()),
            limits: TemplateLimits::default(),
        }
    }

    /// The same provider with other template limits.
    pub fn with_limits(mut self, limits: TemplateLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn load(&self, name: &str) -> Result<Arc<Script>> {
        if let Some(s) = self.cache.lock().ok().and_then(|c| c.get(name).cloned()) {
            return Ok(s);
        }
        if name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(Error::Config(format!(
                "scripted model name `{name}` is not a file name"
            )));
        }
        let path = self.dir.join(format!("{name}.yaml"));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::Config(format!(
                "scripted model `{name}`: cannot read {}: {e}",
                path.display()
            ))
        })?;
        let script = Arc::new(parse_script(&path.display().to_string(), &text)?);
        if let Ok(mut c) = self.cache.lock() {
            c.insert(name.to_string(), script.clone());
        }
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

/// The variables a template sees.
fn template_context(req: &ModelRequest, turn: usize) -> Value {
    let mut all = vec![];
    let mut last_turn = vec![];
    let mut seen_assistant = 0;
    for m in &req.messages {
        match m {
            Message::Assistant { .. } => {
                seen_assistant += 1;
                last_turn.clear();
            }
            Message::Tool { content, .. } => {
                let v = serde_json::from_str::<Value>(content)
                    .ok()
                    .filter(|v| v.is_object() || v.is_array())
                    .unwrap_or_else(|| Value::String(content.clone()));
                all.push(v.clone());
                if seen_assistant == turn {
                    last_turn.push(v);
                }
            }
            _ => {}
        }
    }
    serde_json::json!({
        "mission": req.meta.mission,
        "context": req.meta.context,
        "inputs": req.meta.inputs,
        "plan": req.meta.plan,
        "agent": req.meta.agent,
        "session": req.meta.session,
        "turn": turn,
        "results": last_turn,
        "all_results": all,
    })
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
    env: RefCell<Environment<'static>>,
    limits: TemplateLimits,
    fuel: Cell<u64>,
    room: Cell<usize>,
}

impl Renderer {
    fn new(limits: TemplateLimits) -> Self {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_recursion_limit(limits.recursion);
        Self {
            env: RefCell::new(env),
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

    /// Arms the engine with the fuel the answer has left.
    fn arm(&self) {
        self.env.borrow_mut().set_fuel(Some(self.fuel.get()));
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

    fn render(&self, template: &str, ctx: &Value) -> Result<String> {
        if !template.contains("{{") && !template.contains("{%") {
            self.spend(template.len())?;
            return Ok(template.to_string());
        }
        let what = format!("template `{}`", shown(template));
        self.arm();
        let env = self.env.borrow();
        let tmpl = env
            .template_from_str(template)
            .map_err(|e| self.failed(&what, e))?;
        let mut out = Capped {
            buf: vec![],
            room: self.room.get(),
            over: false,
        };
        let done = tmpl.render_captured_to(ctx, &mut out);
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

    fn eval_bool(&self, expr: &str, ctx: &Value) -> Result<bool> {
        let what = format!("condition `{}`", shown(expr));
        // minijinja's expression lexer panics on `}}` followed by more text ("empty lexer
        // stack"), so a condition may not hold it at all.
        if expr.contains("}}") {
            return Err(Error::Config(format!(
                "{what}: a condition is an expression, without `{{{{ }}}}`; write nested \
                 braces as `}} }}`"
            )));
        }
        self.arm();
        let env = self.env.borrow();
        let e = env
            .compile_expression(expr)
            .map_err(|e| self.failed(&what, e))?;
        let v = e.eval(ctx).map_err(|e| self.failed(&what, e))?;
        Ok(v.is_true())
    }

    fn render_value(&self, v: &Value, ctx: &Value) -> Result<Value> {
        Ok(match v {
            Value::String(s) => Value::String(self.render(s, ctx)?),
            Value::Array(a) => Value::Array(
                a.iter()
                    .map(|x| self.render_value(x, ctx))
                    .collect::<Result<_>>()?,
            ),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| {
                        self.spend(k.len())?;
                        Ok((k.clone(), self.render_value(x, ctx)?))
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
    let ctx = template_context(req, turn_no);
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
        let content = r.render(a, &ctx)?;
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
            Some(Value::String(s)) => {
                r.render(s, &ctx)?.trim().parse::<u64>().map_err(|_| {
                    Error::Config(format!("repeat `{s}` did not render to a number"))
                })?
            }
            Some(other) => return Err(Error::Config(format!("repeat: {other} is not a number"))),
        };
        // Every call takes at least its name and id of the answer's room: refuse a count
        // that cannot fit before making any of it.
        let least = (c.tool.len() + 8) as u128;
        if u128::from(n) * least > r.room.get() as u128 {
            return Err(r.over_bytes());
        }
        for i in 0..n {
            let mut ctx = ctx.clone();
            ctx["i"] = Value::from(i);
            let id = format!("call_{}_{}", turn_no + 1, calls.len() + 1);
            r.spend(id.len() + c.tool.len())?;
            calls.push(ToolCall {
                id,
                name: c.tool.clone(),
                args: r.render_value(&c.args, &ctx)?,
            });
        }
    }
    let say = turn.say.as_ref().map(|s| r.render(s, &ctx)).transpose()?;
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
                        .map(|c| estimate_tokens(&c.args.to_string()))
                        .sum::<u64>()
            }
            Message::Tool { content, .. } => estimate_tokens(content),
        })
        .sum();
    let output = estimate_tokens(resp.content.as_deref().unwrap_or(""))
        + resp
            .tool_calls
            .iter()
            .map(|c| estimate_tokens(&c.args.to_string()))
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
        let script = self.load(model)?;
        let (response, latency) = answer_within(&script, req, self.limits)
            .map_err(|e| Error::Config(format!("scripted:{model}: {e}")))?;
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
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
        let script = self.load(model)?;
        let (response, latency) = answer_within(&script, req, self.limits)
            .map_err(|e| Error::Config(format!("scripted:{model}: {e}")))?;
        let pieces = stream_pieces(response.content.as_deref().unwrap_or(""));
        // Each piece is due at its share of the latency, counted from the start, so the
        // whole answer takes the script's latency however many pieces it has.
        let start = tokio::time::Instant::now();
        let latency = Duration::from_millis(latency);
        let n = pieces.len().max(1) as u32;
        if pieces.is_empty() && !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        for (i, p) in pieces.iter().enumerate() {
            if !latency.is_zero() {
                tokio::time::sleep_until(start + latency * (i as u32 + 1) / n).await;
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
mod tests {
    use super::*;

    #[test]
    fn stream_pieces_rejoin_to_the_text() {
        for text in ["", "one", "a b", &"word ".repeat(100), "tail space "] {
            let p = stream_pieces(text);
            assert_eq!(p.concat(), text);
            assert!(p.len() <= 16, "{} pieces", p.len());
        }
        assert_eq!(stream_pieces("a b c").len(), 3);
    }
    use skein_core::message::RequestMeta;

    fn req(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            model: "scripted:t".into(),
            messages,
            tools: vec![],
            temperature: None,
            max_tokens: None,
            prompt_cache: false,
            meta: RequestMeta {
                session: "s".into(),
                agent: "a".into(),
                mission: "Brief on X".into(),
                context: None,
                inputs: serde_json::json!({"n": 3}),
                ..Default::default()
            },
        }
    }

    const SCRIPT: &str = r#"
latency_ms: 0
turns:
  - tool_calls:
      - tool: call_agent
        repeat: "{{ inputs.n }}"
        args: {agent: researcher, mission: "Research {{ mission }} part {{ i + 1 }}"}
  - choose:
      - when: "results | length == 0"
        answer: "nothing"
      - answer: "got {{ results | length }}: {{ results[0].result }}"
"#;

    #[test]
    fn repeats_and_templates_calls_then_answers_from_results() {
        let s = parse_script("t", SCRIPT).unwrap();
        let r0 = req(vec![Message::System {
            content: "p".into(),
        }]);
        let (resp, _) = answer(&s, &r0).unwrap();
        assert_eq!(resp.tool_calls.len(), 3);
        assert_eq!(resp.tool_calls[2].id, "call_1_3");
        assert_eq!(
            resp.tool_calls[2].args["mission"],
            "Research Brief on X part 3"
        );

        let mut msgs = r0.messages.clone();
        msgs.push(Message::Assistant {
            content: None,
            tool_calls: resp.tool_calls.clone(),
        });
        for c in &resp.tool_calls {
            msgs.push(Message::Tool {
                call_id: c.id.clone(),
                name: c.name.clone(),
                content: serde_json::json!({"success": true, "result": format!("r-{}", c.id)})
                    .to_string(),
                is_error: false,
            });
        }
        let (resp, _) = answer(&s, &req(msgs.clone())).unwrap();
        assert_eq!(resp.content.as_deref(), Some("got 3: r-call_1_1"));
        assert!(resp.tool_calls.is_empty());

        msgs.push(Message::Assistant {
            content: Some("x".into()),
            tool_calls: vec![],
        });
        let e = answer(&s, &req(msgs)).unwrap_err().to_string();
        assert!(e.contains("2 turns; turn 3"), "{e}");
    }

    fn answer_of(turn: &str, limits: TemplateLimits) -> Result<(ModelResponse, u64)> {
        let s = parse_script("t", &format!("turns:\n  - {turn}\n")).unwrap();
        let r0 = req(vec![Message::System {
            content: "p".into(),
        }]);
        answer_within(&s, &r0, limits)
    }

    fn refusal(turn: &str, limits: TemplateLimits) -> String {
        let started = std::time::Instant::now();
        let e = answer_of(turn, limits).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e:?}");
        assert!(!e.is_retryable(), "{e:?}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
        e.to_string()
    }

    #[test]
    fn a_condition_with_closing_braces_is_refused_not_a_panic() {
        for when in ["x }} y", "s}}t", "results }} | length"] {
            let e = refusal(
                &format!("choose:\n      - when: \"{when}\"\n        answer: a"),
                TemplateLimits::default(),
            );
            assert!(e.contains("without `{{ }}`"), "{e}");
        }
    }

    #[test]
    fn an_endless_template_runs_out_of_steps() {
        // 10^8 loop rounds: far past the default budget of an answer.
        let e = refusal(
            r#"answer: "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}done""#,
            TemplateLimits::default(),
        );
        assert!(
            e.contains("took more than 10000000 steps") && e.contains("template `{% for i"),
            "{e}"
        );
    }

    #[test]
    fn the_steps_are_counted_for_the_whole_answer() {
        // Each call's template alone is cheap; a hundred of them are not.
        let turn = r#"tool_calls:
      - tool: t
        repeat: 100
        args: {x: "{% for k in range(50) %}{{ k }}{% endfor %}"}"#;
        let cheap = TemplateLimits {
            fuel: 2_000,
            ..TemplateLimits::default()
        };
        let e = answer_of(turn, cheap).unwrap_err().to_string();
        assert!(e.contains("more than 2000 steps"), "{e}");
        let (resp, _) = answer_of(turn, TemplateLimits::default()).unwrap();
        assert_eq!(resp.tool_calls.len(), 100);
    }

    #[test]
    fn a_template_calling_itself_is_stopped_at_the_depth_limit() {
        let e = refusal(
            r#"answer: "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}""#,
            TemplateLimits::default(),
        );
        assert!(
            e.contains("recursion limit exceeded") && e.contains("at most 100 levels"),
            "{e}"
        );
    }

    #[test]
    fn an_answer_is_capped_in_size() {
        // 100 MB of text asked for; the answer stops at 4 MiB.
        let e = refusal(
            r#"answer: "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}""#,
            TemplateLimits::default(),
        );
        assert!(e.contains("renders to more than 4194304 bytes"), "{e}");
        let small = TemplateLimits {
            max_bytes: 1000,
            ..TemplateLimits::default()
        };
        // Every part of the answer counts: plain text, names, ids and arguments.
        assert!(answer_of(&format!("answer: \"{}\"", "z".repeat(999)), small).is_ok());
        let e = answer_of(&format!("answer: \"{}\"", "z".repeat(1001)), small)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 1000 bytes"), "{e}");
        let e = answer_of(
            "tool_calls:\n      - tool: t\n        repeat: 30\n        args: {x: \"{{ 'q' * 30 }}\"}",
            small,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("more than 1000 bytes"), "{e}");
        // A repeat count no answer could hold is refused before any call is made.
        let e = refusal(
            "tool_calls:\n      - tool: t\n        repeat: \"{{ 10 ** 12 }}\"\n        args: {}",
            TemplateLimits::default(),
        );
        assert!(e.contains("renders to more than"), "{e}");
    }

    #[tokio::test]
    async fn a_runaway_template_fails_the_model_call() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("loop.yaml"),
            "turns:\n  - answer: \"{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}\"\n",
        )
        .unwrap();
        let p = ScriptedProvider::new(dir.path()).with_limits(TemplateLimits {
            fuel: 50_000,
            ..TemplateLimits::default()
        });
        let e = p
            .complete("loop", &req(vec![]))
            .await
            .expect_err("the call fails");
        let shown = e.to_string();
        assert!(
            shown.contains("scripted:loop") && shown.contains("more than 50000 steps"),
            "{shown}"
        );
        assert!(!e.is_retryable());
    }

    #[test]
    fn bad_script_is_named() {
        let e = parse_script("x.yaml", "turns: [{tool_calls: [{tol: 1}]}]").unwrap_err();
        assert!(e.to_string().contains("x.yaml"), "{e}");
        assert!(parse_script("y.yaml", "turns: []")
            .unwrap_err()
            .to_string()
            .contains("no turns"));
    }
}
