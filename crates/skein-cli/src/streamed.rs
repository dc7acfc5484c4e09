//! Model answers shown while they arrive: the text deltas of many sessions, put back into
//! lines per session.
//!
//! Deltas of one session come in order, but sessions interleave, so a line is shown only
//! when it is complete (or when its answer is recorded). A delta of a new try of the same
//! turn voids the text of the try before it: that try failed, and its text never reaches
//! the log.

use std::collections::HashMap;

use skein_core::SessionId;
use skein_runtime::worker::TextDelta;

/// Longest line kept before it is shown anyway (an answer without newlines).
const MAX_LINE: usize = 400;

#[derive(Debug, Default)]
struct Open {
    seq: u64,
    attempt: u32,
    line: String,
    /// Lines of this try already given out.
    emitted: usize,
}

/// The lines of text of every session's answer in progress.
#[derive(Debug, Default)]
pub struct Lines {
    open: HashMap<SessionId, Open>,
    /// Per session, the seq of the last answer known recorded: later pieces of it (text
    /// and events travel apart, so a piece can come after its event) are dropped.
    closed: HashMap<SessionId, u64>,
}

impl Lines {
    /// Takes one delta; returns the lines of its session it completes.
    pub fn push(&mut self, d: &TextDelta) -> Vec<String> {
        if self.closed.get(&d.session).is_some_and(|s| d.seq <= *s) {
            return vec![];
        }
        let o = self.open.entry(d.session.clone()).or_default();
        if (o.seq, o.attempt) != (d.seq, d.attempt) {
            // Another turn, or another try of this one: what was open is over or void.
            *o = Open {
                seq: d.seq,
                attempt: d.attempt,
                line: String::new(),
                emitted: 0,
            };
        }
        let mut done = vec![];
        for (i, part) in d.text.split('\n').enumerate() {
            if i > 0 {
                done.push(std::mem::take(&mut o.line));
            }
            o.line.push_str(part);
            if o.line.len() > MAX_LINE {
                done.push(std::mem::take(&mut o.line));
            }
        }
        o.emitted += done.len();
        done
    }

    /// The answer of `session` at `seq` was recorded with `content`: returns the lines of
    /// it not given out yet when some of it streamed (pieces still on their way are then
    /// dropped), nothing when none did.
    pub fn recorded_as(&mut self, session: &SessionId, seq: u64, content: &str) -> Vec<String> {
        self.closed.insert(session.clone(), seq);
        let Some(o) = self.open.remove(session).filter(|o| o.seq == seq) else {
            return vec![];
        };
        let mut lines = vec![];
        for l in content.split('\n') {
            let mut rest = l;
            while rest.len() > MAX_LINE {
                let head = skein_core::text::clip(rest, MAX_LINE);
                lines.push(head.to_string());
                rest = &rest[head.len()..];
            }
            lines.push(rest.to_string());
        }
        lines.into_iter().skip(o.emitted).collect()
    }

    /// The part of the current line received so far.
    pub fn partial(&self, session: &SessionId) -> &str {
        self.open
            .get(session)
            .map(|o| o.line.as_str())
            .unwrap_or("")
    }

    /// The answer of `session` was recorded: returns the rest of its last line.
    pub fn recorded(&mut self, session: &SessionId) -> Option<String> {
        let o = self.open.remove(session)?;
        (!o.line.is_empty()).then_some(o.line)
    }

    /// The try in progress of `session` failed: its text is dropped.
    pub fn failed(&mut self, session: &SessionId) {
        self.open.remove(session);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn d(session: &SessionId, seq: u64, attempt: u32, text: &str) -> TextDelta {
        TextDelta {
            session: session.clone(),
            seq,
            attempt,
            text: text.into(),
        }
    }

    #[test]
    fn interleaved_sessions_come_out_as_whole_lines() {
        let a = SessionId::parse("t1").unwrap();
        let b = a.child("worker", 1);
        let mut l = Lines::default();
        assert!(l.push(&d(&a, 3, 1, "Hello, ")).is_empty());
        assert!(l.push(&d(&b, 2, 1, "Other ")).is_empty());
        assert_eq!(
            l.push(&d(&a, 3, 1, "world.\nSecond")),
            vec!["Hello, world."]
        );
        assert_eq!(l.partial(&a), "Second");
        assert_eq!(l.push(&d(&b, 2, 1, "text\n\n")), vec!["Other text", ""]);
        assert_eq!(l.recorded(&a).as_deref(), Some("Second"));
        assert_eq!(l.recorded(&a), None);
    }

    #[test]
    fn a_new_try_voids_the_text_of_the_failed_one() {
        let a = SessionId::parse("t2").unwrap();
        let mut l = Lines::default();
        l.push(&d(&a, 5, 1, "half an ans"));
        l.push(&d(&a, 5, 2, "Whole"));
        assert_eq!(l.partial(&a), "Whole");
        l.failed(&a);
        assert_eq!(l.partial(&a), "");
    }

    #[test]
    fn the_recorded_answer_completes_what_streamed_and_late_pieces_are_dropped() {
        let a = SessionId::parse("t4").unwrap();
        let mut l = Lines::default();
        assert_eq!(
            l.push(&d(&a, 2, 1, "roses are red\nviolets")),
            vec!["roses are red"]
        );
        assert_eq!(
            l.recorded_as(&a, 2, "roses are red\nviolets are blue\nthe end"),
            vec!["violets are blue", "the end"]
        );
        assert!(l.push(&d(&a, 2, 1, " are blue\n")).is_empty());
        // A later turn streams again; an answer that never streamed adds nothing.
        assert_eq!(l.push(&d(&a, 4, 1, "next\n")), vec!["next"]);
        assert!(l.recorded_as(&a, 6, "not streamed").is_empty());
    }

    #[test]
    fn a_line_without_end_is_cut() {
        let a = SessionId::parse("t3").unwrap();
        let mut l = Lines::default();
        let out = l.push(&d(&a, 1, 1, &"x".repeat(MAX_LINE + 1)));
        assert_eq!(out.len(), 1);
    }
}
