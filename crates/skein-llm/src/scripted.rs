//! The `scripted` provider: a deterministic model driven by a script file.
//!
//! `scripted:NAME` reads `NAME.yaml` from the scripts directory. The answer to a request
//! is chosen by the request alone — the turn is the number of assistant messages already
//! in it — so a replayed or resumed session sees exactly the same answers. See
//! `docs/scripts.md` for the format.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use minijinja::{Environment, UndefinedBehavior};
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

/// Scripts loaded from one directory, parsed once.
pub struct ScriptedProvider {
    dir: PathBuf,
    cache: Mutex<BTreeMap<String, Arc<Script>>>,
}

impl ScriptedProvider {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            cache: Mutex::new(BTreeMap::new()),
        }
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

struct Renderer {
    env: Environment<'static>,
}

impl Renderer {
    fn new() -> Self {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        Self { env }
    }

    fn render(&self, template: &str, ctx: &Value) -> Result<String> {
        if !template.contains("{{") && !template.contains("{%") {
            return Ok(template.to_string());
        }
        self.env
            .render_str(template, ctx)
            .map_err(|e| Error::Config(format!("template `{template}`: {e}")))
    }

    fn eval_bool(&self, expr: &str, ctx: &Value) -> Result<bool> {
        let e = self
            .env
            .compile_expression(expr)
            .map_err(|e| Error::Config(format!("condition `{expr}`: {e}")))?;
        let v = e
            .eval(ctx)
            .map_err(|e| Error::Config(format!("condition `{expr}`: {e}")))?;
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
                    .map(|(k, x)| Ok((k.clone(), self.render_value(x, ctx)?)))
                    .collect::<Result<_>>()?,
            ),
            other => other.clone(),
        })
    }
}

/// The answer a script gives to a request, and the latency it asks for.
pub fn answer(script: &Script, req: &ModelRequest) -> Result<(ModelResponse, u64)> {
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
    let r = Renderer::new();
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
        for i in 0..n {
            let mut ctx = ctx.clone();
            ctx["i"] = Value::from(i);
            calls.push(ToolCall {
                id: format!("call_{}_{}", turn_no + 1, calls.len() + 1),
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
    }
}

#[async_trait]
impl Provider for ScriptedProvider {
    async fn complete(&self, model: &str, req: &ModelRequest) -> Result<Completion> {
        let script = self.load(model)?;
        let (response, latency) =
            answer(&script, req).map_err(|e| Error::Config(format!("scripted:{model}: {e}")))?;
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        let usage = usage(req, &response);
        Ok(Completion { response, usage })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use skein_core::message::RequestMeta;

    fn req(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            model: "scripted:t".into(),
            messages,
            tools: vec![],
            temperature: None,
            max_tokens: None,
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
