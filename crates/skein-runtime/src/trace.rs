//! W3C trace context of sessions (`traceparent`: `00-<trace id>-<span id>-<flags>`): a
//! tree is one trace, and every session a span of its own in it. A submission that
//! carries a traceparent continues the caller's trace; one without starts a new trace.

use rand::Rng;

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

fn span_id() -> u64 {
    rand::thread_rng().gen::<u64>().max(1)
}

/// A traceparent with fresh ids (a new trace, sampled).
pub fn new_traceparent() -> String {
    let trace: u128 = rand::thread_rng().gen::<u128>().max(1);
    format!("00-{trace:032x}-{:016x}-01", span_id())
}

/// A span under `parent`: its trace id and flags, a span id of its own. None when
/// `parent` is not a valid traceparent.
pub fn child_of(parent: &str) -> Option<String> {
    let (trace, _, flags) = parse(parent)?;
    Some(format!("00-{trace:032x}-{:016x}-{flags:02x}", span_id()))
}

/// [`child_of`] `parent`, or a new trace when there is none or it is not valid.
pub fn continue_or_start(parent: Option<&str>) -> String {
    parent.and_then(child_of).unwrap_or_else(new_traceparent)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_child_keeps_the_trace_and_flags_with_a_span_of_its_own() {
        let c = child_of(CALLER).unwrap();
        let (t, s, f) = parse(&c).unwrap();
        assert_eq!(format!("{t:032x}"), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(s, 0x00f0_67aa_0ba9_02b7);
        assert_eq!(f, 1);
        assert_ne!(child_of(CALLER), child_of(CALLER));
        let unsampled = child_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
        assert!(unsampled.unwrap().ends_with("-00"));
    }

    #[test]
    fn invalid_traceparents_start_a_new_trace() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(child_of(bad).is_none(), "{bad}");
            let fresh = continue_or_start(Some(bad));
            assert!(parse(&fresh).is_some());
            assert!(!fresh.contains("4bf92f35"), "{bad}");
        }
        // A later version may carry more fields after the four it shares with 00.
        assert!(child_of("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x").is_some());
    }
}
