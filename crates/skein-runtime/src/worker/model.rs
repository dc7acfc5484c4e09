//! `CallModel` and `Summarize`: a model call with heartbeats, streamed text, retries with
//! backoff, resume tokens shown to the model and hidden again, and call ids made unique.

use std::collections::BTreeSet;
use std::time::Duration;
use tokio::time::Instant;

use serde_json::Value;
use skein_core::decide::ToolRun;
use skein_core::event::{ModelCalled, ModelFailed};
use skein_core::{AgentDef, Event, ModelRequest, RuntimeTool, SessionState, Step};

use crate::ports::Job;
use crate::runtime::{Runtime, TextDelta};
use crate::session::{Folded, Staged};
use crate::{runtime_tools, Error, Result};

/// Every string in `v` (keys aside) through `f`.
fn map_strings(v: &mut Value, f: &dyn Fn(&str) -> String) {
    match v {
        Value::String(s) => *s = f(s),
        Value::Array(a) => a.iter_mut().for_each(|x| map_strings(x, f)),
        Value::Object(o) => o.values_mut().for_each(|x| map_strings(x, f)),
        _ => {}
    }
}

/// Replaces, in a model's reply, every resume token it was shown by its reference, so
/// the log records the reference.
fn hide_tokens(shown: &[(String, String)], resp: &mut skein_core::ModelResponse) {
    if shown.is_empty() {
        return;
    }
    let hide = |text: &str| {
        shown.iter().fold(text.to_string(), |t, (token, r)| {
            t.replace(token.as_str(), r)
        })
    };
    if let Some(c) = &mut resp.content {
        *c = hide(c);
    }
    for call in &mut resp.tool_calls {
        map_strings(&mut call.args, &hide);
    }
}

/// What a model turn's append may also hold ([`Runtime::after_turn`]).
enum Then {
    End(Box<Event>),
    Read(Vec<ToolRun>),
}

/// Runs `fut` to its end, calling `beat` every `every` while it runs; the first beat one
/// period after the start. (An interval's immediate first tick is not free: awaiting it
/// registers a timer that fires only on the timer's next whole millisecond, which once put
/// up to a millisecond before every model and tool call.)
async fn beating<T, B: std::future::Future<Output = ()>>(
    fut: impl std::future::Future<Output = T>,
    every: Duration,
    mut beat: impl FnMut() -> B,
) -> T {
    tokio::pin!(fut);
    let mut tick = tokio::time::interval_at(Instant::now() + every, every);
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return out,
            _ = tick.tick() => beat().await,
        }
    }
}

impl Runtime {
    /// Keeps a job's lease alive while `fut` runs.
    pub(crate) async fn with_heartbeat<T>(
        &self,
        job: &Job,
        fut: impl std::future::Future<Output = T>,
    ) -> T {
        let every = (self.cfg.lease / 3).max(Duration::from_millis(200));
        beating(fut, every, || async {
            if let Err(e) = self.backend.jobs.heartbeat(job).await {
                tracing::warn!(session = %job.session, error = %e.report(), "heartbeat failed");
            }
        })
        .await
    }

    pub(crate) async fn call_model(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        mut request: ModelRequest,
        tool_names: &[String],
        job: &Job,
    ) -> Result<()> {
        // The tree's version: its agents, and the models its scripts drive.
        let version = self.version_of(&f.state).await?;
        let (agents, models) = (&version.agents, &version.models);
        // An MCP server that said its tools changed is listed again first, so this turn
        // is offered what it lists now.
        if tool_names
            .iter()
            .any(|t| skein_core::agent::mcp_server_of(t).is_some())
        {
            self.tools.refresh().await;
        }
        // A server's tools had whole (`SERVER__*`) are the tools of it this worker has.
        let (whole, named): (Vec<&String>, Vec<&String>) = tool_names
            .iter()
            .partition(|n| n.ends_with(skein_core::agent::MCP_ALL));
        let served: Vec<String> = if whole.is_empty() {
            vec![]
        } else {
            self.tools.names()
        }
        .into_iter()
        .filter(|t| {
            !named.contains(&t)
                && whole
                    .iter()
                    .any(|w| skein_core::agent::wildcard_covers(w, t))
        })
        .collect();
        request.tools = named
            .into_iter()
            .chain(served.iter())
            .filter_map(|n| match RuntimeTool::parse(n) {
                Some(RuntimeTool::CallAgent) => Some(runtime_tools::call_agent_spec(def)),
                Some(RuntimeTool::AskClarification) => {
                    let open: Vec<String> = f
                        .state
                        .children
                        .values()
                        .filter(|c| {
                            !c.cached
                                && !c.shared
                                && c.outcome == Some(skein_core::state::ChildOutcome::Completed)
                        })
                        .filter(|c| agents.get(&c.agent).is_some_and(|d| d.front.chat))
                        .map(|c| c.child.display())
                        .collect::<std::collections::BTreeSet<_>>()
                        .into_iter()
                        .collect();
                    Some(runtime_tools::ask_clarification_spec(&open))
                }
                Some(RuntimeTool::AskUser) => Some(runtime_tools::ask_user_spec()),
                Some(RuntimeTool::UpdatePlan) => Some(runtime_tools::update_plan_spec()),
                Some(RuntimeTool::ProposePatch) => Some(runtime_tools::propose_patch_spec()),
                Some(RuntimeTool::HandoffTo) => runtime_tools::handoff_to_spec(def),
                Some(RuntimeTool::TeamBroadcast) => Some(runtime_tools::team_broadcast_spec()),
                None => self.tools.spec(n),
            })
            .collect();
        expand_tool_descriptions(&mut request);
        // The model is shown the resume tokens its log holds references to; a token it
        // sends back is recorded as its reference again.
        let shown = self.reveal_tokens(&f.state, &mut request);
        // The model's quota first: told to wait, the session's job goes back until then.
        // Its priority: its tree's (given at submission) plus its agent's.
        let priority = f
            .state
            .submitted
            .as_ref()
            .and_then(|s| s.priority)
            .unwrap_or(0)
            .saturating_add(def.front.priority.unwrap_or(0));
        let mut held = match self.ask_quota(&f.id, &request, priority).await? {
            crate::quota::Asked::Wait => return Ok(()),
            crate::quota::Asked::Go(h) => Some(h),
            crate::quota::Asked::Free => None,
        };
        // Where the quota is declared, or shared by a cluster, a 429 is the quota's to
        // wait for (every worker's), not this call's to retry in process.
        let shared = self.backend.quota.is_some()
            || held
                .as_ref()
                .is_some_and(|h| h.limits != skein_ports::quota::QuotaLimits::default());
        let started = Instant::now();
        // The answer's text goes out while it arrives, to whoever listens; the log gets it
        // whole below. A session that was shown resume tokens does not stream: a token
        // the model repeats could be cut across two pieces, where hiding it again fails.
        let (session, seq, attempt) = (
            f.id.clone(),
            f.state.last_seq + 1,
            f.state.failures.model_failures + 1,
        );
        let on_text = |piece: &str| {
            if !shown.is_empty() || self.text.receiver_count() == 0 {
                return;
            }
            // A secret cut across two pieces passes here; the answer recorded is whole
            // and scrubbed below.
            self.text.send(TextDelta {
                session: session.clone(),
                seq,
                attempt,
                text: self
                    .scrubber
                    .scrubbed(piece)
                    .unwrap_or_else(|| piece.to_string()),
            });
        };
        // A worker that drains abandons the call: nothing of it is recorded yet, and the
        // job goes back for another worker to make it.
        let call =
            skein_llm::ratelimit::watching(shared, models.complete_streaming(&request, &on_text));
        // Under a concurrency limit the permit's place is renewed while the call runs: a
        // call may outlast the lease, and a worker that dies stops renewing, so its place
        // lapses a lease after.
        let renewal = held.as_ref().and_then(crate::quota::Held::renewal);
        let call = async {
            let Some((quota, permit, limits)) = &renewal else {
                return call.await;
            };
            beating(call, skein_ports::quota::PERMIT_RENEW, || async {
                if let Err(e) = quota.renew(permit, limits).await {
                    tracing::warn!(key = %permit.key, error = %e.report(), "cannot renew a quota permit; it lapses unless a later renewal lands");
                }
            })
            .await
        };
        let (result, heard) = tokio::select! {
            biased;
            _ = self.draining() => {
                self.after_call(held.as_mut(), &request.model, &[], None).await;
                return Err(Error::Interrupted(format!(
                    "the call to {} was abandoned", request.model)))
            }
            r = self.with_heartbeat(job, call) => r,
        };
        let used = result
            .as_ref()
            .ok()
            .map(|c| (c.usage.input_tokens, c.usage.output_tokens));
        self.after_call(held.as_mut(), &request.model, &heard, used)
            .await;
        let latency_ms = started.elapsed().as_millis() as u64;
        crate::metrics::model_call(
            &request.model,
            started.elapsed(),
            result.as_ref().ok().map(|c| &c.usage),
        );
        let outcome = match &result {
            Ok(c) => crate::spans::ModelOutcome::Answered {
                usage: &c.usage,
                finish_reason: c.response.finish_reason.as_deref(),
            },
            Err(e) => crate::spans::ModelOutcome::Failed(e.to_string()),
        };
        let began = std::time::SystemTime::now() - started.elapsed();
        crate::spans::model_call(&f.id, &f.state, &request.model, began, outcome);
        match result {
            Ok(mut c) => {
                hide_tokens(&shown, &mut c.response);
                self.scrubber.response(&mut c.response);
                fix_call_ids(&f.state.transcript, f.state.steps, &mut c.response);
                let ev = ModelCalled {
                    model: request.model.clone(),
                    request_digest: request.digest(),
                    response: c.response,
                    usage: c.usage,
                    latency_ms,
                    worker: self.cfg.worker_id.clone(),
                };
                let answers = ev.response.tool_calls.is_empty();
                // Reads can share the turn's append only when every call of the turn is
                // one; any other turn (one that delegates, say) is decided once, by the
                // drive, not here as well (for a turn of 1,000 delegations that took
                // longer than recording it).
                let may_read = !answers
                    && ev
                        .response
                        .tool_calls
                        .iter()
                        .all(|c| self.is_read(def, &c.name));
                // The turn is folded in before it is written, to decide what follows it;
                // a failed write fails the step, and its fold is dropped.
                let mut staged = Staged::default();
                self.stage(f, Event::ModelCalled(ev), &mut staged)?;
                let then = if answers || may_read {
                    self.after_turn(f, def, answers)
                } else {
                    None
                };
                match then {
                    // A turn that answers usually ends the session. When the rules end it
                    // at once (nothing else to run first), the end is recorded with the
                    // turn, in one append, so it costs one durable write, not two.
                    // It is still a step of its own to logs and metrics.
                    Some(Then::End(end)) => {
                        let kind = if matches!(*end, Event::Completed(_)) {
                            "complete"
                        } else {
                            "fail"
                        };
                        tracing::debug!(session = %f.id, step = kind, "step");
                        let _timer = crate::metrics::StepTimer::start(kind);
                        self.stage(f, *end, &mut staged)?;
                        return self.commit(f, staged).await;
                    }
                    // A turn that only reads the workspace: the reads run now and the
                    // turn is recorded with their calls and results, in one append. A
                    // crash before it leaves the turn unrecorded, so the model is asked
                    // again; the window is that of a local read.
                    Some(Then::Read(runs)) => {
                        tracing::debug!(session = %f.id, step = "run_tools", "step");
                        let _timer = crate::metrics::StepTimer::start("run_tools");
                        return self.run_tools_after(f, def, runs, job, staged).await;
                    }
                    None => {}
                }
                self.commit(f, staged).await
            }
            Err(e) => {
                let retryable = e.is_retryable();
                let attempt = f.state.failures.model_failures + 1;
                tracing::warn!(session = %f.id, attempt, retryable, error = %e, "model call failed");
                let ev = ModelFailed {
                    model: request.model.clone(),
                    error: {
                        let mut text = e.to_string();
                        self.scrubber.text(&mut text);
                        text
                    },
                    retryable,
                    attempt,
                    worker: self.cfg.worker_id.clone(),
                };
                self.append(f, Event::ModelFailed(ev)).await?;
                // A 429 under a shared quota was heard by the quota, which holds the next
                // call back (and every other worker's): no sleep here.
                let learned = shared && matches!(e, skein_llm::Error::Http { status: 429, .. });
                if retryable && !learned {
                    let base = Duration::from_millis(250 * (1u64 << attempt.min(6)));
                    let jitter = crate::clock::up_to(&*self.cfg.clock, base.as_millis() as u64 / 2);
                    let wait = e
                        .retry_after()
                        .unwrap_or(base + Duration::from_millis(jitter))
                        .min(Duration::from_secs(60));
                    tokio::select! {
                        biased;
                        _ = self.draining() => {}
                        _ = self.with_heartbeat(job, tokio::time::sleep(wait)) => {}
                    }
                }
                Ok(())
            }
        }
    }

    /// What follows a model turn at once, when it can share the turn's append: the
    /// session's end, or reads of the workspace (fresh calls of tools that are side-effect
    /// free and idempotent). Decided on the state with the turn folded in (staged).
    fn after_turn(&self, f: &Folded, def: &AgentDef, answers: bool) -> Option<Then> {
        let st = &f.state;
        let reads = |r: &ToolRun| !r.resumed && self.is_read(def, &r.tool);
        let version = self.version_known(st);
        match st.next(def, &version.limits, &*version.agents) {
            Step::Complete { answer } if answers => {
                Some(Then::End(Box::new(st.completion(answer))))
            }
            Step::Fail { error } if answers => Some(Then::End(Box::new(Event::failed(
                error,
                st.usage_total(),
                st.steps,
            )))),
            Step::RunTools(runs) if !answers && runs.iter().all(reads) => Some(Then::Read(runs)),
            _ => None,
        }
    }

    /// Whether a call of `tool` only reads the workspace, and may run again: such calls
    /// are run and recorded with the turn that asked for them.
    fn is_read(&self, def: &AgentDef, tool: &str) -> bool {
        skein_core::agent::SIDE_EFFECT_FREE_TOOLS.contains(&tool)
            && self.tools.get(tool).is_some()
            && self.may_run_again(def, tool)
    }

    /// Replaces, in every message of `request`, the references to resume tokens this
    /// session was given by the tokens themselves. Returns (token, reference) pairs.
    pub(crate) fn reveal_tokens(
        &self,
        state: &SessionState,
        request: &mut ModelRequest,
    ) -> Vec<(String, String)> {
        if state.pauses.resume_refs.is_empty() {
            return vec![];
        }
        let secret = &self.cfg.token_secret.0;
        let shown: Vec<(String, String)> = state
            .pauses
            .resume_refs
            .iter()
            .filter_map(|r| Some((skein_core::token::from_reference(secret, r)?, r.clone())))
            .collect();
        let reveal = |text: &str| {
            skein_core::token::replace_references(text, &state.pauses.resume_refs, |r| {
                skein_core::token::from_reference(secret, r)
            })
        };
        for m in &mut request.messages {
            match m {
                skein_core::Message::System { content }
                | skein_core::Message::User { content }
                | skein_core::Message::Tool { content, .. } => *content = reveal(content),
                skein_core::Message::Assistant {
                    content,
                    tool_calls,
                } => {
                    if let Some(c) = content {
                        *c = reveal(c);
                    }
                    for call in tool_calls {
                        map_strings(&mut call.args, &reveal);
                    }
                }
            }
        }
        shown
    }
}

/// Gives every tool call of `resp` a non-empty id not used before in the session (its
/// `transcript`, `steps` turns so far), so events can name calls without ambiguity.
fn fix_call_ids(
    transcript: &[skein_core::Message],
    steps: u32,
    resp: &mut skein_core::ModelResponse,
) {
    // The ids of the transcript are borrowed, not copied: this runs at every turn.
    let earlier: BTreeSet<&str> = transcript
        .iter()
        .filter_map(|m| match m {
            skein_core::Message::Assistant { tool_calls, .. } => Some(tool_calls),
            _ => None,
        })
        .flatten()
        .map(|c| c.id.as_str())
        .collect();
    let mut now: BTreeSet<String> = BTreeSet::new();
    for (k, c) in resp.tool_calls.iter_mut().enumerate() {
        if c.id.is_empty() || earlier.contains(c.id.as_str()) || now.contains(&c.id) {
            c.id = format!("t{}_{}", steps + 1, k + 1);
        }
        now.insert(c.id.clone());
    }
}

/// The placeholder a system prompt may hold for the tools it can call (the planner
/// reference's `{{tool_descriptions}}`).
pub const TOOL_DESCRIPTIONS: &str = "{{tool_descriptions}}";

/// Puts the request's tools, a line each (name and description), where the system prompt
/// says `{{tool_descriptions}}`.
fn expand_tool_descriptions(request: &mut ModelRequest) {
    let Some(skein_core::Message::System { content }) = request.messages.first_mut() else {
        return;
    };
    if !content.contains(TOOL_DESCRIPTIONS) {
        return;
    }
    let list = if request.tools.is_empty() {
        "(no tools)".to_string()
    } else {
        request
            .tools
            .iter()
            .map(|t| format!("- `{}`: {}", t.name, t.description))
            .collect::<Vec<_>>()
            .join("\n")
    };
    *content = content.replace(TOOL_DESCRIPTIONS, &list);
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::time::Duration;

    use futures::FutureExt;
    use tokio::time::Instant;

    use super::beating;

    #[test]
    fn the_system_prompt_s_tool_descriptions_become_the_agent_s_tools() {
        let spec = |name: &str, d: &str| skein_core::ToolSpec {
            name: name.into(),
            description: d.into(),
            parameters: serde_json::json!({}).into(),
        };
        let mut req = skein_core::ModelRequest {
            model: "scripted:planner".into(),
            messages: vec![skein_core::Message::System {
                content: "Plan.\n\n## Available Tools\n\n{{tool_descriptions}}\n\nUse them.".into(),
            }],
            tools: vec![
                spec("read_file", "Read a file."),
                spec("get_file_info", "Facts."),
            ],
            temperature: None,
            max_tokens: None,
            top_p: None,
            top_k: None,
            prompt_cache: false,
            meta: Default::default(),
        };
        super::expand_tool_descriptions(&mut req);
        let skein_core::Message::System { content } = &req.messages[0] else {
            panic!("system prompt")
        };
        assert_eq!(
            content,
            "Plan.\n\n## Available Tools\n\n- `read_file`: Read a file.\n- `get_file_info`: Facts.\n\nUse them."
        );
    }

    #[test]
    fn call_ids_that_are_missing_or_taken_are_replaced() {
        let call = |id: &str| skein_core::ToolCall {
            id: id.into(),
            name: "list_dir".into(),
            args: serde_json::json!({}),
        };
        let transcript = vec![
            skein_core::Message::User {
                content: "go".into(),
            },
            skein_core::Message::Assistant {
                content: None,
                tool_calls: vec![call("a"), call("t3_4")],
            },
        ];
        let mut resp = skein_core::ModelResponse {
            tool_calls: vec![
                call("a"),
                call(""),
                call("b"),
                call("b"),
                call("t3_1"),
                call("t3_4"),
            ],
            ..Default::default()
        };
        super::fix_call_ids(&transcript, 2, &mut resp);
        let ids: Vec<&str> = resp.tool_calls.iter().map(|c| c.id.as_str()).collect();
        // Taken by an earlier turn, empty, or taken earlier in this answer (even by an id
        // given here): renumbered by turn and place; the rest kept.
        assert_eq!(ids, ["t3_1", "t3_2", "b", "t3_4", "t3_5", "t3_6"]);
    }

    #[tokio::test]
    async fn work_that_is_ready_is_not_held_back_by_the_first_beat() {
        // Polled once: no timer stands before the work.
        let out = beating(async { 7 }, Duration::from_secs(10), || async {
            panic!("no beat is due")
        })
        .now_or_never();
        assert_eq!(out, Some(7));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn beats_come_one_period_apart_from_one_period_after_the_start() {
        tokio::time::pause();
        let start = Instant::now();
        let every = Duration::from_millis(200);
        let beats = RefCell::new(vec![]);
        beating(tokio::time::sleep(every * 5 / 2), every, || {
            beats.borrow_mut().push(start.elapsed());
            async {}
        })
        .await;
        assert!(start.elapsed() >= every * 5 / 2);
        // tokio's timer ends a wait on a whole millisecond, so a beat may come up to one
        // late.
        let beats = beats.into_inner();
        assert_eq!(beats.len(), 2, "{beats:?}");
        for (k, at) in beats.into_iter().enumerate() {
            let due = every * (k as u32 + 1);
            assert!(
                at >= due && at <= due + Duration::from_millis(1),
                "beat {k} at {at:?}"
            );
        }
    }
}
