//! W3C trace context of sessions (`traceparent`: `00-<trace id>-<span id>-<flags>`): a
//! tree is one trace, and every session a span of its own in it.
//!
//! A session's span id is derived from the trace id and the session id
//! ([`session_span`]), so any worker can name any session's span — its own, its
//! parent's — from the log alone. `Submitted.trace` records, for a child, its own span
//! context; for a root, the traceparent it was submitted with (the caller's span, whose
//! child the root's span is), or else a new trace with the root's own span.

use skein_core::SessionId;

/// The parts of a valid traceparent: trace id, span (parent) id, flags.
pub fn parse(tp: &str) -> Option<(u128, u64, u8)> {
    let tp = tp.trim();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = tp.splitn(5, '-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    // Version 00 has exactly four fields; a later version may add more after them.
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    let trace = u128::from_str_radix(trace, 16).ok()?;
    let span = u64::from_str_radix(span, 16).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    (trace != 0 && span != 0).then_some((trace, span, flags))
}

/// `00-<trace>-<span>-<flags>`.
pub fn format(trace: u128, span: u64, flags: u8) -> String {
    format!("00-{trace:032x}-{span:016x}-{flags:02x}")
}

/// The span id of `session` in trace `trace`: the first 8 bytes of a keyed hash of both,
/// never zero.
pub fn session_span(trace: u128, session: &SessionId) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"skein session span");
    h.update(&trace.to_be_bytes());
    h.update(session.as_str().as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_be_bytes(b).max(1)
}

/// What a new root records: the caller's traceparent when it is valid (the root's span
/// continues its trace), else a new sampled trace with the root's own span.
pub fn for_root(root: &SessionId, caller: Option<&str>, clock: &dyn crate::clock::Clock) -> String {
    match caller.map(str::trim).filter(|c| parse(c).is_some()) {
        Some(c) => c.to_string(),
        None => {
            let trace = ((u128::from(clock.draw()) << 64) | u128::from(clock.draw())).max(1);
            format(trace, session_span(trace, root), 1)
        }
    }
}

/// What a child records: its own span context in its parent's trace (`parent_trace`, as
/// the parent recorded it); a new trace if the parent has none that is valid.
pub fn for_child(
    child: &SessionId,
    parent_trace: Option<&str>,
    clock: &dyn crate::clock::Clock,
) -> String {
    match parent_trace.and_then(parse) {
        Some((trace, _, flags)) => format(trace, session_span(trace, child), flags),
        None => for_root(child, None, clock),
    }
}

/// A session's own span context, and the span its span is a child of: for a child, its
/// parent session's span; for a root, the caller's span (none when it started the trace).
pub struct SessionSpan {
    pub trace: u128,
    pub span: u64,
    pub flags: u8,
    pub parent: Option<u64>,
}

impl SessionSpan {
    /// From a session's id, its recorded trace and its parent session, if any.
    pub fn of(id: &SessionId, recorded: &str, parent: Option<&SessionId>) -> Option<Self> {
        let (trace, recorded_span, flags) = parse(recorded)?;
        let span = session_span(trace, id);
        let parent = match parent {
            Some(p) => Some(session_span(trace, p)),
            None => (recorded_span != span).then_some(recorded_span),
        };
        Some(Self {
            trace,
            span,
            flags,
            parent,
        })
    }

    /// This session's own span context as a traceparent.
    pub fn traceparent(&self) -> String {
        format(self.trace, self.span, self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;

    const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn id(s: &str) -> SessionId {
        SessionId::parse(s).unwrap()
    }

    #[test]
    fn a_root_continues_its_callers_trace_and_children_get_spans_of_their_own() {
        let root = id("r1");
        let rec = for_root(&root, Some(CALLER), &SystemClock);
        assert_eq!(rec, CALLER);
        let r = SessionSpan::of(&root, &rec, None).unwrap();
        assert_eq!(
            format!("{:032x}", r.trace),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(r.parent, Some(0x00f0_67aa_0ba9_02b7), "the caller's span");
        assert_ne!(r.span, 0x00f0_67aa_0ba9_02b7);
        let (a, b) = (id("r1/researcher-1"), id("r1/researcher-2"));
        let (ra, rb) = (
            for_child(&a, Some(&rec), &SystemClock),
            for_child(&b, Some(&rec), &SystemClock),
        );
        let sa = SessionSpan::of(&a, &ra, Some(&root)).unwrap();
        let sb = SessionSpan::of(&b, &rb, Some(&root)).unwrap();
        assert_eq!((sa.trace, sb.trace), (r.trace, r.trace));
        assert_ne!(sa.span, sb.span);
        assert_eq!((sa.parent, sb.parent), (Some(r.span), Some(r.span)));
        assert_eq!(sa.traceparent(), ra, "a child records its own span context");
        // A grandchild's parent is the child's span, computed from ids alone.
        let g = id("r1/researcher-1/helper-1");
        let sg = SessionSpan::of(&g, &for_child(&g, Some(&ra), &SystemClock), Some(&a)).unwrap();
        assert_eq!(sg.parent, Some(sa.span));
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(for_child(&a, Some(unsampled), &SystemClock).ends_with("-00"));
    }

    #[test]
    fn a_root_without_a_valid_traceparent_starts_a_trace_with_its_own_span() {
        let root = id("r2");
        for bad in [
            None,
            Some(""),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
            Some("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01"),
        ] {
            let rec = for_root(&root, bad, &SystemClock);
            let s = SessionSpan::of(&root, &rec, None).unwrap();
            assert_eq!(s.parent, None, "{bad:?}");
            assert!(!rec.contains("4bf92f35"), "{bad:?}");
        }
        assert_ne!(
            for_root(&root, None, &SystemClock),
            for_root(&root, None, &SystemClock),
            "a new trace each time"
        );
        // A later version may carry more fields after the four it shares with 00.
        assert!(parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x").is_some());
    }
}
