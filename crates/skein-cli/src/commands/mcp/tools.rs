//! The tools `skein mcp` offers: start a tree, read a tree, the inbox, and answers and
//! decisions to what waits in it. Each is one of the runtime's own operations, with the
//! same checks as the command that does it (`skein run` / `submit`, `tree`, `inbox`,
//! `answer`, `approve`, `deny`).

use std::sync::Arc;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use skein_core::SessionId;
use skein_runtime::hitl;
use skein_runtime::inspect::{rows_of, summarize, tree_folds};
use skein_runtime::worker::Submission;
use skein_tools::schema::{derived, validate};
use tokio::sync::mpsc::UnboundedSender;

use super::wire::{self, code, RpcError, Tool, ToolAnnotations};
use super::Host;

/// How often a waited-for tree is read again when no event of this process's runtime
/// says it moved (on a cluster, the workers' events are not seen here).
const POLL: Duration = Duration::from_millis(200);
/// How long a waiter gathers the runtime's events before it reads the tree again.
const BATCH: Duration = Duration::from_millis(25);

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct StartArgs {
    /// The agent that takes the mission (its name in the catalogue).
    pub(crate) agent: String,
    /// What the agent must do.
    pub(crate) mission: String,
    /// Root session id (a-z, 0-9, `-`, `_`); starting the same id again is a no-op
    /// that returns that tree. Made up when left out.
    pub(crate) id: Option<String>,
    /// Background for the agent.
    pub(crate) context: Option<String>,
    /// Structured inputs for the agent.
    pub(crate) inputs: Option<Map<String, Value>>,
    /// Do not answer delegations from the cache, nor cache this tree's answers.
    #[serde(default)]
    pub(crate) no_cache: bool,
    /// The tree's priority for model quotas, -100 to 100 (default 0): where a model's
    /// limits make calls wait, a higher priority goes first.
    pub(crate) priority: Option<i32>,
    /// Wait until the tree ends or waits for a person, and return its status and answer
    /// (default); false returns the tree's id at once.
    pub(crate) wait: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct StatusArgs {
    /// The tree's root session id (or any session id of it).
    pub(crate) root: String,
    /// Wait until the tree ends or waits for a person, as `start_tree` does.
    #[serde(default)]
    pub(crate) wait: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct InboxArgs {
    /// Only this tree (any session id of it); every tree not yet ended when left out.
    pub(crate) root: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AnswerArgs {
    /// The question's token, from the inbox.
    pub(crate) token: String,
    /// One answer per question key.
    pub(crate) answers: Map<String, Value>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DecideArgs {
    /// The approval's token, from the inbox.
    pub(crate) token: String,
    /// Why (recorded in the log; a denial's reason is shown to the model).
    pub(crate) reason: Option<String>,
}

fn annotations(read_only: bool, idempotent: bool) -> ToolAnnotations {
    ToolAnnotations {
        read_only_hint: read_only,
        destructive_hint: false,
        idempotent_hint: idempotent,
        open_world_hint: false,
    }
}

/// Every tool, as `tools/list` shows them.
pub fn list() -> Vec<Tool> {
    let tool = |name: &str, title: &str, description: &str, schema: Value, a| Tool {
        name: name.into(),
        title: title.into(),
        description: description.into(),
        input_schema: schema,
        annotations: a,
    };
    vec![
        tool(
            "start_tree",
            "Start a tree",
            "Start a tree of agents on a mission, with `agent` as its root. By default waits \
             until the tree ends (returning its answer) or waits for a person (returning what \
             waits in the inbox, with the tokens that answer it); with `wait: false` returns \
             the tree's id at once. Sends progress notifications while it waits, when asked.",
            derived::<StartArgs>(),
            annotations(false, true),
        ),
        tool(
            "tree_status",
            "A tree's status",
            "A tree's status, answer or error, usage summary, and what in it waits for a \
             person.",
            derived::<StatusArgs>(),
            annotations(true, true),
        ),
        tool(
            "list_inbox",
            "List the inbox",
            "Every question and approval that waits for a person, with the token that \
             answers it (an approval shows the call's whole arguments).",
            derived::<InboxArgs>(),
            annotations(true, true),
        ),
        tool(
            "answer_question",
            "Answer a question",
            "Answer a question of the inbox by its token, one answer per question key; the \
             tree runs on.",
            derived::<AnswerArgs>(),
            annotations(false, false),
        ),
        tool(
            "approve",
            "Approve a tool call",
            "Approve a tool call that waits for approval, by its token from the inbox; the \
             call runs and the tree goes on.",
            derived::<DecideArgs>(),
            annotations(false, false),
        ),
        tool(
            "deny",
            "Deny a tool call",
            "Deny a tool call that waits for approval, by its token from the inbox; the \
             model reads the denial and the reason.",
            derived::<DecideArgs>(),
            annotations(false, false),
        ),
    ]
}

/// Where progress notifications of one call go: the token its request sent, and the
/// stream back to that client.
pub struct ProgressSink {
    pub token: Value,
    pub out: UnboundedSender<Value>,
    sent: u64,
}

impl ProgressSink {
    pub fn new(token: Value, out: UnboundedSender<Value>) -> Self {
        ProgressSink {
            token,
            out,
            sent: 0,
        }
    }

    fn send(&mut self, message: &str) {
        self.sent += 1;
        let _ = self
            .out
            .send(wire::progress(&self.token, self.sent, message));
    }
}

/// A tool's failure, as the model reads it (`isError: true`), scrubbed of secrets.
fn failed(text: impl std::fmt::Display) -> Value {
    let text = crate::config::scrub(&text.to_string());
    wire::tool_result(text, None, true)
}

fn ok(v: Value) -> Value {
    let text = serde_json::to_string_pretty(&v).unwrap_or_default();
    wire::tool_result(text, Some(v), false)
}

/// Reads arguments checked against the tool's schema; a problem is named in the result.
fn args<T: JsonSchema + serde::de::DeserializeOwned>(tool: &str, a: Value) -> Result<T, Value> {
    let a = if a.is_null() { json!({}) } else { a };
    if let Err(problems) = validate(&derived::<T>(), &a) {
        return Err(failed(format!(
            "bad arguments for `{tool}`: {}",
            problems.join("; ")
        )));
    }
    serde_json::from_value(a).map_err(|e| failed(format!("bad arguments for `{tool}`: {e}")))
}

fn root_of(id: &str) -> Result<SessionId, Value> {
    SessionId::parse(id.trim())
        .map(|s| s.root_id())
        .map_err(|e| failed(format!("`{id}` is not a session id: {e}")))
}

/// Calls tool `name`. An unknown tool is a protocol error; everything that goes wrong in
/// a known tool is a result with `isError: true` that names it.
pub async fn call(
    host: &Arc<Host>,
    name: &str,
    a: Value,
    by: Option<String>,
    progress: Option<ProgressSink>,
) -> Result<Value, RpcError> {
    let r = match name {
        "start_tree" => start(host, a, progress).await,
        "tree_status" => match args::<StatusArgs>(name, a) {
            Ok(s) => match root_of(&s.root) {
                Ok(root) if s.wait => wait(host, &root, progress).await,
                Ok(root) => status(host, &root).await.map(|(v, _)| ok(v)),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        },
        "list_inbox" => inbox(host, a).await,
        "answer_question" => answer(host, a, by).await,
        "approve" | "deny" => decide(host, name, a, by).await,
        other => {
            let known: Vec<String> = list().into_iter().map(|t| t.name).collect();
            return Err(RpcError::new(
                code::INVALID_PARAMS,
                format!(
                    "unknown tool `{}`; this server has: {}",
                    crate::render::safe_line(other),
                    known.join(", ")
                ),
            ));
        }
    };
    Ok(r.unwrap_or_else(|e| e))
}

async fn start(host: &Arc<Host>, a: Value, progress: Option<ProgressSink>) -> Result<Value, Value> {
    let s: StartArgs = args("start_tree", a)?;
    if s.mission.trim().is_empty() {
        return Err(failed("the mission is empty"));
    }
    let id = host
        .rt
        .submit(Submission {
            agent: s.agent,
            mission: s.mission,
            id: s.id.filter(|i| !i.is_empty()),
            context: s.context.filter(|c| !c.is_empty()),
            inputs: s.inputs.map(Value::Object).unwrap_or(Value::Null),
            budget: None,
            no_cache: s.no_cache,
            priority: s.priority,
            ..Default::default()
        })
        .await
        .map_err(failed)?;
    if s.wait == Some(false) {
        return Ok(ok(json!({"session": id.display(), "status": "submitted"})));
    }
    wait(host, &id, progress).await
}

/// A tree's status, and whether a waiter is done with it (it ended, or waits for a
/// person).
async fn status(host: &Host, root: &SessionId) -> Result<(Value, bool), Value> {
    let read = tree_folds(&host.backend, root).await.map_err(failed)?;
    let Some((_, f)) = read.iter().find(|(_, f)| &f.id == root) else {
        return Err(failed(format!("no tree {} in this store", root.display())));
    };
    let rows = rows_of(&read);
    let waiting: Vec<_> = read
        .iter()
        .flat_map(|(_, f)| hitl::waiting_in(&host.rt.cfg.token_secret, f))
        .collect();
    let st = &f.state;
    let terminal = st.status.is_terminal();
    let v = json!({
        "session": root.display(),
        "status": st.status.as_str(),
        "answer": st.ending.answer,
        "error": st.ending.error,
        "summary": summarize(&rows),
        "waiting": waiting,
    });
    Ok((v, terminal || !waiting.is_empty()))
}

/// Waits until the tree ends or waits for a person; sends a progress notification each
/// time it is seen to have moved.
async fn wait(
    host: &Arc<Host>,
    root: &SessionId,
    mut progress: Option<ProgressSink>,
) -> Result<Value, Value> {
    let mut events = host.rt.subscribe();
    let mut last = String::new();
    loop {
        let (v, done) = status(host, root).await?;
        if let Some(p) = &mut progress {
            let sessions = v["summary"]["sessions"].as_u64().unwrap_or(0);
            let steps = v["summary"]["steps"].as_u64().unwrap_or(0);
            let now = format!(
                "{}: {sessions} session(s), {steps} step(s)",
                v["status"].as_str().unwrap_or("")
            );
            if now != last {
                p.send(&now);
                last = now;
            }
        }
        if done {
            return Ok(ok(v));
        }
        if progress.as_ref().is_some_and(|p| p.out.is_closed()) {
            // No one reads the answer any more (the client went away).
            return Err(failed("the client stopped listening"));
        }
        // An event of this process's runtime (embedded) wakes the waiter at once.
        tokio::select! {
            _ = events.recv() => {
                // One read of the tree for the events of a short while: a busy tree
                // sends many, and each read folds every log of it.
                tokio::time::sleep(BATCH).await;
                while events.try_recv().is_ok() {}
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

async fn inbox(host: &Arc<Host>, a: Value) -> Result<Value, Value> {
    let q: InboxArgs = args("list_inbox", a)?;
    let roots = match q.root.as_deref().filter(|r| !r.trim().is_empty()) {
        Some(r) => vec![root_of(r)?],
        // Only a tree not yet ended can wait for a person: the open roots, so the call
        // costs what is open, not the whole history.
        None => host.backend.log.open_roots().await.map_err(failed)?,
    };
    let items = hitl::inbox(&host.rt, &roots).await.map_err(failed)?;
    let v = serde_json::to_value(items).map_err(failed)?;
    Ok(ok(json!({ "items": v })))
}

async fn answer(host: &Arc<Host>, a: Value, by: Option<String>) -> Result<Value, Value> {
    let q: AnswerArgs = args("answer_question", a)?;
    let session = hitl::answer(&host.rt, q.token.trim(), Value::Object(q.answers), by)
        .await
        .map_err(failed)?;
    Ok(ok(json!({
        "session": session.display(),
        "root": session.root_id().display(),
        "recorded": "answer",
    })))
}

async fn decide(
    host: &Arc<Host>,
    name: &str,
    a: Value,
    by: Option<String>,
) -> Result<Value, Value> {
    let q: DecideArgs = args(name, a)?;
    let approved = name == "approve";
    let reason = q.reason.filter(|r| !r.trim().is_empty());
    let session = hitl::decide_approval(&host.rt, q.token.trim(), approved, reason, by)
        .await
        .map_err(failed)?;
    Ok(ok(json!({
        "session": session.display(),
        "root": session.root_id().display(),
        "recorded": if approved { "approved" } else { "denied" },
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schema_is_one_the_checker_enforces() {
        for t in list() {
            assert_eq!(
                skein_tools::schema::check_schema(&t.input_schema),
                Ok(()),
                "{}",
                t.name
            );
            assert_eq!(t.input_schema["type"], "object", "{}", t.name);
        }
    }

    #[test]
    fn bad_arguments_are_named() {
        let e = args::<StartArgs>("start_tree", json!({"agent": "a"})).err();
        let text = e
            .map(|v| v["content"][0]["text"].to_string())
            .unwrap_or_default();
        assert!(text.contains("mission"), "{text}");
        let e = args::<DecideArgs>("approve", json!({"token": "t", "extra": 1})).err();
        let text = e
            .map(|v| v["content"][0]["text"].to_string())
            .unwrap_or_default();
        assert!(text.contains("extra"), "{text}");
    }
}
