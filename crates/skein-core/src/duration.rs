//! Durations as people write them in config and agent files: `30s`, `500ms`, `2m`, `1h`,
//! `1d`, compounds such as `1h30m` or `1m 30s`, and a bare number of seconds (`90`, `0`).
//!
//! The one grammar every part of skein reads durations with; the units and compounds are
//! those of the `humantime` crate. Values are checked where a file is loaded, and a bad
//! one is an error naming the key and the value, never a default or "forever".

use std::time::Duration;

use ::serde::{Deserialize, Deserializer, Serializer};

/// A text that is not a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{value}` is not a duration ({reason}); write e.g. \"30s\", \"500ms\", \"2m\", \"1h30m\", \
     \"1d\" or a number of seconds"
)]
pub struct DurationError {
    /// The text as it was given.
    pub value: String,
    /// What was wrong with it.
    pub reason: String,
}

/// Parses a duration: humantime's units and compounds, or a bare number of seconds.
/// Surrounding whitespace is ignored.
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let t = text.trim();
    let bad = |reason: String| DurationError {
        value: text.to_string(),
        reason,
    };
    if t.is_empty() {
        return Err(bad("it is empty".into()));
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| bad("too many seconds".into()));
    }
    humantime::parse_duration(t).map_err(|e| bad(e.to_string()))
}

/// [`parse`], with the error naming the setting it came from: `key: `…` is not a duration`.
pub fn parse_key(key: &str, text: &str) -> Result<Duration, String> {
    parse(text).map_err(|e| format!("{key}: {e}"))
}

/// The shortest text [`parse`] reads back as `d`: `90s` → `1m 30s`, `0` → `0s`.
pub fn format(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// `#[serde(with = "skein_core::duration::serde")]` for a [`Duration`] field: a string
/// [`parse`] accepts, or an integer number of seconds; written back as a string.
pub mod serde {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Secs(n) => Ok(Duration::from_secs(n)),
            Raw::Text(t) => parse(&t).map_err(::serde::de::Error::custom),
        }
    }

    /// `#[serde(deserialize_with = "skein_core::duration::serde::text")]` for a field kept
    /// as the text that was written: checked like a duration, stored as given (a number
    /// as its digits).
    pub fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Secs(n) => Ok(n.to_string()),
            Raw::Text(t) => parse(&t).map(|_| t).map_err(::serde::de::Error::custom),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Secs(u64),
        Text(String),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn the_old_forms_and_compounds_parse() {
        for (text, want) in [
            ("30s", secs(30)),
            ("500ms", Duration::from_millis(500)),
            ("2m", secs(120)),
            ("15m", secs(900)),
            ("1h", secs(3600)),
            ("24h", secs(86_400)),
            ("1d", secs(86_400)),
            ("7d", secs(7 * 86_400)),
            ("90", secs(90)),
            (" 7 ", secs(7)),
            ("0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("1h30m", secs(5400)),
            ("1m30s", secs(90)),
            ("1h 30m", secs(5400)),
            ("2h15m30s", secs(2 * 3600 + 15 * 60 + 30)),
            ("1s500ms", Duration::from_millis(1500)),
        ] {
            assert_eq!(parse(text), Ok(want), "{text:?}");
        }
    }

    #[test]
    fn garbage_is_refused_with_the_value_named() {
        for bad in [
            "",
            " ",
            "s",
            "10x",
            "-1s",
            "ms10",
            "forever",
            "1h30",
            "1 hour and a bit",
            "1e3s",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.value, bad);
            let shown = e.to_string();
            assert!(
                shown.contains(&format!("`{bad}` is not a duration")),
                "{shown}"
            );
        }
        assert_eq!(
            parse_key("cache.ttl", "soon").unwrap_err(),
            format!("cache.ttl: {}", parse("soon").unwrap_err())
        );
        assert!(parse("99999999999999999999999").is_err());
    }

    #[test]
    fn what_is_written_reads_back() {
        for d in [
            secs(0),
            secs(90),
            secs(5400),
            Duration::from_millis(1500),
            secs(86_400),
        ] {
            assert_eq!(parse(&format(d)), Ok(d), "{}", format(d));
        }
    }

    #[derive(Debug, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
    struct Cfg {
        #[serde(with = "super::serde")]
        d: Duration,
    }

    #[derive(Debug, PartialEq, ::serde::Deserialize)]
    struct Kept {
        #[serde(deserialize_with = "super::serde::text")]
        d: String,
    }

    #[test]
    fn serde_takes_strings_and_seconds() {
        let c: Cfg = serde_json::from_str(r#"{"d": "1h30m"}"#).unwrap();
        assert_eq!(c.d, secs(5400));
        let c: Cfg = serde_json::from_str(r#"{"d": 45}"#).unwrap();
        assert_eq!(c.d, secs(45));
        let back: Cfg = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        let e = serde_json::from_str::<Cfg>(r#"{"d": "1x"}"#).unwrap_err();
        assert!(e.to_string().contains("`1x` is not a duration"), "{e}");

        let k: Kept = serde_json::from_str(r#"{"d": "1m30s"}"#).unwrap();
        assert_eq!(k.d, "1m30s");
        let k: Kept = serde_json::from_str(r#"{"d": 0}"#).unwrap();
        assert_eq!(k.d, "0");
        let e = serde_json::from_str::<Kept>(r#"{"d": "later"}"#).unwrap_err();
        assert!(e.to_string().contains("`later` is not a duration"), "{e}");
    }
}
