//! Human-readable rendering shared by the commands.
//!
//! Text a model or a submitter wrote (answers, questions, tool arguments, errors, plan
//! titles, missions) reaches a person's terminal only through [`safe`] or [`safe_line`]:
//! escape sequences in it could otherwise erase lines, hide text or retitle the window.

use std::borrow::Cow;

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

/// Characters a terminal acts on rather than shows: C0 and C1 controls and DEL, and the
/// bidirectional formatting marks that reorder what is displayed.
fn acts_on_terminal(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

fn escape_into(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
        c => out.push_str(&format!("\\u{{{:04x}}}", c as u32)),
    }
}

fn escape(text: &str, keep: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !text.chars().any(|c| acts_on_terminal(c) && !keep(c)) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if acts_on_terminal(c) && !keep(c) {
            escape_into(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `text` fit for a terminal, lines kept: every control character but `\n` and `\t`
/// (ESC, BEL, CR, backspace, C1 controls, bidirectional marks) is shown escaped, as
/// `\x1b` or `\u{202e}`, so every character stays visible and none acts.
pub fn safe(text: &str) -> Cow<'_, str> {
    escape(text, |c| c == '\n' || c == '\t')
}

/// [`safe`] for a one-line display: newlines and tabs are escaped too.
pub fn safe_line(text: &str) -> Cow<'_, str> {
    escape(text, |_| false)
}

/// One line of at most `n` characters (then `…`), newlines shown as spaces. Not yet
/// escaped: the line it goes into is.
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
            let via = r
                .via
                .as_deref()
                .map(|v| format!(" ({v})"))
                .unwrap_or_default();
            format!("{}└ {}{via}", "  ".repeat(r.depth as usize - 1), last)
        };
        let line = format!(
            "{:<44} {:<13} {:<15} {:>5} {:>5} {:>15} {:>9} {:>5} {:>9} {:>9}",
            cut(&name, 44),
            cut(&r.agent, 13),
            if r.partial {
                format!("{}*", r.status)
            } else {
                r.status.clone()
            },
            r.steps,
            r.tool_calls,
            tokens(&r.usage),
            cost(&r.usage),
            r.cache_hits,
            format!("+{}", ms(r.started_at.saturating_sub(t0))),
            ms(r.wall_ms),
        );
        out.push_str(&safe_line(&line));
        out.push('\n');
    }
    if rows.iter().any(|r| r.partial) {
        out.push_str("* a partial answer: made without some child's answer (not cached)\n");
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
    if let Some(d) = &s.defs {
        line.push_str(&format!(
            ", definitions {}",
            skein_core::definitions::short(d)
        ));
    }
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
        Event::HandedOff(h) => format!("#{} answer of {} → {}", h.next.call, h.from, h.next.agent),
        Event::Routed(r) => format!(
            "#{} → {} (#{}){}",
            r.next.call,
            r.next.agent,
            r.call,
            r.message
                .as_deref()
                .map(|m| format!(" message={:?}", cut(m, 50)))
                .unwrap_or_default()
        ),
        Event::AdvisorsConsulted(a) => a
            .advisors
            .iter()
            .map(|c| format!("#{} {}", c.call, c.agent))
            .collect::<Vec<_>>()
            .join(", "),
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
    let line = format!(
        "{:>4} +{:<8} {:<15} {}",
        r.env.seq,
        ms(r.env.at.saturating_sub(t0)),
        r.env.body.kind(),
        body
    );
    safe_line(&line).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_answer_is_marked_in_the_tree_and_explained_once() {
        use skein_core::{SessionId, SessionState, Status};
        let id = SessionId::root("t").unwrap();
        let mut st = SessionState::default();
        st.status = Status::Completed;
        let whole = skein_runtime::inspect::row(&id, &[], &st);
        st.accounting.partial = true;
        let partial = skein_runtime::inspect::row(&id, &[], &st);
        let table = tree_table(std::slice::from_ref(&whole));
        assert!(
            !table.contains("completed*") && !table.contains("partial"),
            "{table}"
        );
        let table = tree_table(&[partial.clone(), partial]);
        assert_eq!(table.matches("completed*").count(), 2, "{table}");
        assert_eq!(table.matches("* a partial answer").count(), 1, "{table}");
    }

    #[test]
    fn safe_escapes_every_control_but_newline_and_tab() {
        let hostile = "a\x1b]0;pwned\x07b\x1b[2Kc\r\x08d\u{9b}e\u{202e}f\x7f\n\tg";
        let shown = safe(hostile);
        assert_eq!(
            shown,
            "a\\x1b]0;pwned\\x07b\\x1b[2Kc\\r\\x08d\\x9be\\u{202e}f\\x7f\n\tg"
        );
        assert!(!shown
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t'));
        let line = safe_line(hostile);
        assert!(line.ends_with("\\x7f\\n\\tg"), "{line}");
        assert!(!line.chars().any(char::is_control));
        // Plain text, unicode included, is passed through untouched (and not copied).
        let plain = "Grüße, 世界 — a\\b \"q\"";
        assert!(matches!(safe(plain), Cow::Borrowed(_)));
        assert_eq!(safe_line(plain), plain);
    }

    #[test]
    fn event_lines_carry_no_raw_control_characters() {
        use skein_core::event::{Completed, Envelope, Failed};
        use skein_core::SessionId;
        let id = SessionId::root("x").unwrap();
        for body in [
            Event::Completed(Completed {
                answer: "ok\x1b]0;pwned\x07\u{202e}".into(),
                usage_total: Usage::default(),
                steps: 1,
                partial: false,
            }),
            Event::Failed(Failed {
                error: "bad\x1b[2K".into(),
                usage_total: Usage::default(),
                steps: 1,
                dead_letter: false,
            }),
        ] {
            let env = Envelope::new(id.clone(), 2, 10, "p".into(), body);
            let r = Record {
                bytes: env.encode().unwrap(),
                env,
            };
            let line = event_line(&r, 0);
            assert!(!line.contains(['\x1b', '\x07', '\u{202e}']), "{line:?}");
        }
    }
}
