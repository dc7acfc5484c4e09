//! OpenTelemetry spans of a tree, through the `opentelemetry` API: nothing is exported
//! unless the process installs a tracer provider (`skein` does when the `OTEL_*`
//! variables name an endpoint).
//!
//! One trace per tree ([`crate::trace`]). A session's span is recorded when the session
//! ends, by whichever worker ends it, with the span id derived from its id, the start time
//! of its first event, and its parent session's span (a root: the caller's) as parent —
//! so the spans of a tree join up whichever workers ran it. Model calls, tool calls and
//! delegations are spans under their session's span. Model calls follow the gen_ai
//! semantic conventions (provider, model, tokens in and out, finish reasons) and carry the
//! cost as `skein.cost_usd`.
//!
//! The session being advanced is also the task's *current* trace context: the backend
//! sends it as the `traceparent` header of the jobs, notices and results it publishes.

use std::cell::Cell;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    Link, Span, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags,
    TraceId, TraceState, Tracer,
};
use opentelemetry::{global, Context, KeyValue};
use skein_core::{Event, SessionId, SessionState, Status as SessionStatus, Usage};

use crate::trace::{session_span, SessionSpan};

thread_local! {
    /// Ids the next span built on this thread must have (see [`planned_trace_id`]).
    static PLANNED: Cell<(Option<u128>, Option<u64>)> = const { Cell::new((None, None)) };
}

/// Whether spans are built at all: only once the process installed a tracer provider
/// ([`record_spans`]). Without one the API's tracer drops every span, and building them
/// (ids hashed, attributes formatted) was a few per cent of a step's CPU for nothing.
static RECORDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says that a tracer provider is installed (or no longer is): session, model, tool and
/// delegation spans are built from now on. The current trace context ([`set_current`])
/// is kept either way: it travels with the jobs and notices a worker publishes.
pub fn record_spans(on: bool) {
    RECORDING.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn recording() -> bool {
    RECORDING.load(std::sync::atomic::Ordering::Relaxed)
}

/// For the id generator of the installed tracer provider: the trace id a session span
/// being built must have, if one is (taken once).
pub fn planned_trace_id() -> Option<u128> {
    PLANNED.with(|p| {
        let (t, s) = p.get();
        p.set((None, s));
        t
    })
}

/// For the id generator: the span id a session span being built must have (taken once).
pub fn planned_span_id() -> Option<u64> {
    PLANNED.with(|p| {
        let (t, s) = p.get();
        p.set((t, None));
        s
    })
}

// The task's current trace context lives in the ports, where a backend reads it: `scoped`
// gives a future a context of its own, `current` reads it, [`set_current`] sets it.
pub use skein_ports::trace_context::{current, scoped};

/// Makes `session`'s span the current trace context of this task's scope.
pub fn set_current(id: &SessionId, state: &SessionState) {
    let tp = own(id, state).map(|s| s.traceparent());
    skein_ports::trace_context::set(tp);
}

fn own(id: &SessionId, state: &SessionState) -> Option<SessionSpan> {
    let sub = state.submitted.as_ref()?;
    SessionSpan::of(
        id,
        sub.trace.as_deref()?,
        sub.parent.as_ref().map(|p| &p.session),
    )
}

fn span_context(trace: u128, span: u64, flags: u8) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(trace.to_be_bytes()),
        SpanId::from_bytes(span.to_be_bytes()),
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    )
}

fn under(trace: u128, span: u64, flags: u8) -> Context {
    Context::new().with_remote_span_context(span_context(trace, span, flags))
}

fn at_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn usage_attrs(u: &Usage, out: &mut Vec<KeyValue>) {
    out.push(KeyValue::new(
        "gen_ai.usage.input_tokens",
        u.input_tokens as i64,
    ));
    out.push(KeyValue::new(
        "gen_ai.usage.output_tokens",
        u.output_tokens as i64,
    ));
    out.push(KeyValue::new("skein.cost_usd", u.cost));
}

/// Records the span of a session that has just ended (at `ended_at`, ms since the epoch).
pub fn session_ended(id: &SessionId, state: &SessionState, ended_at: u64) {
    if !recording() {
        return;
    }
    let (Some(s), Some(sub)) = (own(id, state), state.submitted.as_ref()) else {
        return;
    };
    let cx = match s.parent {
        Some(p) => under(s.trace, p, s.flags),
        None => Context::new(),
    };
    let mut attrs = vec![
        KeyValue::new("gen_ai.operation.name", "invoke_agent"),
        KeyValue::new("gen_ai.agent.name", sub.agent.clone()),
        KeyValue::new("skein.session", id.to_string()),
        KeyValue::new("skein.status", state.status.as_str()),
        KeyValue::new("skein.steps", i64::from(state.steps)),
    ];
    usage_attrs(&state.accounting.usage_own, &mut attrs);
    let builder = SpanBuilder::from_name(format!("invoke_agent {}", sub.agent))
        .with_kind(SpanKind::Internal)
        .with_start_time(at_ms(state.started_at))
        .with_attributes(attrs);
    PLANNED.with(|p| p.set((Some(s.trace), Some(s.span))));
    let mut span = global::tracer("skein").build_with_context(builder, &cx);
    PLANNED.with(|p| p.set((None, None)));
    if state.status != SessionStatus::Completed {
        let why = state
            .ending
            .error
            .clone()
            .unwrap_or_else(|| state.status.as_str().into());
        span.set_status(Status::error(why));
    }
    span.end_with_timestamp(at_ms(ended_at));
}

/// How a model call ended, for its span.
pub enum ModelOutcome<'a> {
    Answered {
        usage: &'a Usage,
        finish_reason: Option<&'a str>,
    },
    Failed(String),
}

/// Records a model call of `model` (`provider:model`) made for `id`, from `started` to now.
pub fn model_call(
    id: &SessionId,
    state: &SessionState,
    model: &str,
    started: SystemTime,
    outcome: ModelOutcome<'_>,
) {
    if !recording() {
        return;
    }
    let Some(s) = own(id, state) else {
        return;
    };
    let (provider, name) = model.split_once(':').unwrap_or(("", model));
    let mut attrs = vec![
        KeyValue::new("gen_ai.operation.name", "chat"),
        KeyValue::new("gen_ai.provider.name", provider.to_string()),
        KeyValue::new("gen_ai.request.model", name.to_string()),
        KeyValue::new("skein.session", id.to_string()),
    ];
    let error = match outcome {
        ModelOutcome::Answered {
            usage,
            finish_reason,
        } => {
            usage_attrs(usage, &mut attrs);
            if let Some(r) = finish_reason {
                attrs.push(KeyValue::new(
                    "gen_ai.response.finish_reasons",
                    opentelemetry::Value::Array(
                        vec![opentelemetry::StringValue::from(r.to_string())].into(),
                    ),
                ));
            }
            None
        }
        ModelOutcome::Failed(e) => {
            attrs.push(KeyValue::new("error.type", "model_error"));
            Some(e)
        }
    };
    let builder = SpanBuilder::from_name(format!("chat {name}"))
        .with_kind(SpanKind::Client)
        .with_start_time(started)
        .with_attributes(attrs);
    let mut span =
        global::tracer("skein").build_with_context(builder, &under(s.trace, s.span, s.flags));
    if let Some(e) = error {
        span.set_status(Status::error(e));
    }
    span.end();
}

/// Records a tool call that took `ms` and ended now.
pub fn tool_call(
    id: &SessionId,
    state: &SessionState,
    tool: &str,
    call: &str,
    ms: u64,
    error: bool,
) {
    if !recording() {
        return;
    }
    let Some(s) = own(id, state) else {
        return;
    };
    let end = SystemTime::now();
    let attrs = vec![
        KeyValue::new("gen_ai.operation.name", "execute_tool"),
        KeyValue::new("gen_ai.tool.name", tool.to_string()),
        KeyValue::new("gen_ai.tool.call.id", call.to_string()),
        KeyValue::new("skein.session", id.to_string()),
    ];
    let builder = SpanBuilder::from_name(format!("execute_tool {tool}"))
        .with_kind(SpanKind::Internal)
        .with_start_time(end - Duration::from_millis(ms))
        .with_attributes(attrs);
    let mut span =
        global::tracer("skein").build_with_context(builder, &under(s.trace, s.span, s.flags));
    if error {
        span.set_status(Status::error("the tool returned an error"));
    }
    span.end_with_timestamp(end);
}

/// The delegations among `events`: (child, agent, resumed).
pub fn delegated(events: &[Event]) -> Vec<(SessionId, String, bool)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Delegated(d) => Some((
                d.child.clone(),
                d.agent.clone(),
                d.kind == skein_core::event::DelegationKind::Resumed,
            )),
            _ => None,
        })
        .collect()
}

/// Records `id`'s delegations (from [`delegated`]), from `started` to now; each span
/// links to the child's session span.
pub fn delegations(
    id: &SessionId,
    state: &SessionState,
    started: SystemTime,
    delegated: &[(SessionId, String, bool)],
) {
    if !recording() {
        return;
    }
    for (child, agent, resumed) in delegated {
        delegation(id, state, started, child, agent, *resumed);
    }
}

fn delegation(
    id: &SessionId,
    state: &SessionState,
    started: SystemTime,
    child: &SessionId,
    agent: &str,
    resumed: bool,
) {
    let Some(s) = own(id, state) else {
        return;
    };
    let attrs = vec![
        KeyValue::new("gen_ai.operation.name", "invoke_agent"),
        KeyValue::new("gen_ai.agent.name", agent.to_string()),
        KeyValue::new("skein.session", id.to_string()),
        KeyValue::new("skein.child", child.to_string()),
        KeyValue::new("skein.resumed", resumed),
    ];
    let link = Link::with_context(span_context(s.trace, session_span(s.trace, child), s.flags));
    let builder = SpanBuilder::from_name(format!("delegate {agent}"))
        .with_kind(SpanKind::Internal)
        .with_start_time(started)
        .with_attributes(attrs)
        .with_links(vec![link]);
    global::tracer("skein")
        .build_with_context(builder, &under(s.trace, s.span, s.flags))
        .end();
}
