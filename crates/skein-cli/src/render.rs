//! Human-readable rendering shared by the commands.

use skein_core::event::Outcome;
use skein_core::{Event, Record, Usage};
use skein_runtime::inspect::{SessionRow, TreeSummary};

pub fn ms(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else {
        format!("{:.2}s", ms as f64 / 1000.0)
    }
}

pub fn tokens(u: &Usage) -> String {
    format!("{}/{}", u.input_tokens, u.output_tokens)
}

pub fn cost(u: &Usage) -> String {
    format!("${:.4}", u.cost)
}

fn cut(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        format!("{}…", one_line.chars().take(n).collect::<String>())
    }
}

/// The tree as an indented table; times relative to the root's start.
pub fn tree_table(rows: &[SessionRow]) -> String {
    let t0 = rows.first().map(|r| r.started_at).unwrap_or(0);
    let mut out = format!(
        "{:<44} {:<13} {:<15} {:>5} {:>5} {:>15} {:>9} {:>5} {:>9} {:>9}\n",
        "SESSION",
        "AGENT",
        "STATUS",
        "STEPS",
        "TOOLS",
        "TOKENS in/out",
        "COST",
        "HITS",
        "START",
        "WALL"
    );
    for r in rows {
        let name = if r.depth == 0 {
            r.session.clone()
        } else {
            let last = r.session.rsplit('/').next().unwrap_or(&r.session);
            format!("{}└ {}", "  ".repeat(r.depth as usize - 1), last)
        };
        out.push_str(&format!(
            "{:<44} {:<13} {:<15} {:>5} {:>5} {:>15} {:>9} {:>5} {:>9} {:>9}\n",
            cut(&name, 44),
            cut(&r.agent, 13),
            r.status,
            r.steps,
            r.tool_calls,
            tokens(&r.usage),
            cost(&r.usage),
            r.cache_hits,
            format!("+{}", ms(r.started_at.saturating_sub(t0))),
            ms(r.wall_ms),
        ));
    }
    out
}

pub fn summary_line(s: &TreeSummary) -> String {
    let mut line = format!(
        "sessions {}, model turns {}, tool calls {}, tokens {} in / {} out, cost {}, wall {}",
        s.sessions,
        s.steps,
        s.tool_calls,
        s.usage.input_tokens,
        s.usage.output_tokens,
        cost(&s.usage),
        ms(s.wall_ms)
    );
    if s.cache_hits > 0 {
        line.push_str(&format!(
            ", cache hits {} (saved {} tokens, {})",
            s.cache_hits,
            s.saved.total_tokens(),
            cost(&s.saved)
        ));
    }
    line
}

/// One line describing an event.
fn patch_from(from: &str) -> String {
    skein_core::SessionId::parse(from)
        .map(|s| s.display())
        .unwrap_or_else(|_| from.to_string())
}

pub fn event_line(r: &Record, t0: u64) -> String {
    let body = match &r.env.body {
        Event::Submitted(s) => format!(
            "agent={} depth={} mission={:?}",
            s.agent,
            s.depth,
            cut(&s.mission, 60)
        ),
        Event::ModelCalled(m) => {
            let calls: Vec<String> = m
                .response
                .tool_calls
                .iter()
                .map(|c| format!("{}#{}", c.name, c.id))
                .collect();
            format!(
                "{} {}ms tokens={} {}{}",
                m.model,
                m.latency_ms,
                tokens(&m.usage),
                if calls.is_empty() {
                    String::new()
                } else {
                    format!("calls=[{}] ", calls.join(", "))
                },
                m.response
                    .content
                    .as_deref()
                    .map(|c| format!("text={:?}", cut(c, 50)))
                    .unwrap_or_default()
            )
        }
        Event::ModelFailed(m) => format!("{} attempt {}: {}", m.model, m.attempt, m.error),
        Event::ToolCalled(t) => format!(
            "{}#{} args={}",
            t.tool,
            t.call,
            cut(&t.args.to_string(), 60)
        ),
        Event::ToolReturned(t) => format!(
            "#{} {}{}ms {:?}",
            t.call,
            if t.error { "ERROR " } else { "" },
            t.ms,
            cut(&t.output, 60)
        ),
        Event::Delegated(d) => format!("#{} → {} ({})", d.call, d.child.display(), d.agent),
        Event::CacheHit(h) => format!("#{} answered from cache ({})", h.call, h.source.display()),
        Event::ChildSettled(c) => format!(
            "#{} {} {}",
            c.call,
            c.child.display(),
            match &c.outcome {
                Outcome::Completed { .. } => "completed",
                Outcome::Failed { .. } => "failed",
                Outcome::NeedsInput { .. } => "needs input",
            }
        ),
        Event::Completed(c) => format!("answer={:?}", cut(&c.answer, 70)),
        Event::Failed(f) => format!("error={:?}", f.error),
        Event::Cancelled(c) => format!("reason={:?}", c.reason),
        Event::PatchApplied(p) => format!(
            "v{} by {} ({}) ops=[{}]",
            p.version,
            p.agent,
            patch_from(&p.from),
            p.ops
                .iter()
                .map(|o| o.name())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Event::PatchRejected(p) => {
            format!(
                "by {} ({}): {}",
                p.agent,
                patch_from(&p.from),
                cut(&p.reason.to_string(), 70)
            )
        }
        other => cut(&other.to_json().to_string(), 80),
    };
    format!(
        "{:>4} +{:<8} {:<15} {}",
        r.env.seq,
        ms(r.env.at.saturating_sub(t0)),
        r.env.body.kind(),
        body
    )
}
