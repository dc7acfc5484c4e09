//! Session ids: a root token (ULID or a caller-chosen idempotency key) followed by one
//! `AGENT-N` token per delegation level. Stored and used in NATS subjects with `.`,
//! shown to people with `/`.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Longest accepted session id (bytes); NATS subjects stay far below their limits.
pub const MAX_ID_LEN: usize = 512;
/// Longest accepted single token.
pub const MAX_TOKEN_LEN: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(String);

/// Checks one token: lowercase ASCII letters, digits, `-` and `_`, 1..=64 bytes. Such a
/// token is a valid NATS subject token and a valid file name.
pub fn validate_token(token: &str) -> Result<()> {
    if token.is_empty() {
        return Err(Error::InvalidId("empty token".into()));
    }
    if token.len() > MAX_TOKEN_LEN {
        // Shown by characters, never sliced by bytes: the token may be any text.
        return Err(Error::InvalidId(format!(
            "token `{}…` is {} bytes; at most {MAX_TOKEN_LEN} are allowed",
            prefix_chars(token, 16).escape_debug(),
            token.len()
        )));
    }
    if let Some(c) = token
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '_'))
    {
        return Err(Error::InvalidId(format!(
            "token `{}` contains {c:?}; allowed are a-z, 0-9, `-` and `_`",
            token.escape_debug()
        )));
    }
    Ok(())
}

/// The first `n` characters of `s` (all of it when shorter): a prefix that never splits a
/// character, whatever the text.
pub fn prefix_chars(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl SessionId {
    /// A root id from a token (a lowercase ULID or an idempotency key).
    pub fn root(token: &str) -> Result<Self> {
        validate_token(token)?;
        Ok(Self(token.to_string()))
    }

    /// Parses the dotted or slashed form.
    pub fn parse(s: &str) -> Result<Self> {
        Self::from_text(std::borrow::Cow::Borrowed(s))
    }

    /// Parses `s`, keeping its string when it is already in the dotted form (as every
    /// stored id is): the session of every decoded record is read here.
    fn from_text(s: std::borrow::Cow<'_, str>) -> Result<Self> {
        let s = if s.trim().len() == s.len() && !s.contains('/') {
            s.into_owned()
        } else {
            s.trim().replace('/', ".")
        };
        Self::check(&s)?;
        Ok(Self(s))
    }

    /// Checks the dotted form: its length, every token, and the `AGENT-N` shape of every
    /// child token.
    fn check(s: &str) -> Result<()> {
        if s.len() > MAX_ID_LEN {
            return Err(Error::InvalidId(format!(
                "id `{}…` is {} bytes; at most {MAX_ID_LEN} are allowed",
                prefix_chars(s, 16).escape_debug(),
                s.len()
            )));
        }
        for (i, tok) in s.split('.').enumerate() {
            validate_token(tok)?;
            if i > 0 && child_parts(tok).is_none() {
                return Err(Error::InvalidId(format!(
                    "child token `{tok}` is not of the form AGENT-N"
                )));
            }
        }
        Ok(())
    }

    /// The child this session creates for its `n`-th delegation (1-based) to `agent`.
    pub fn child(&self, agent: &str, n: u32) -> Self {
        Self(format!("{}.{}-{}", self.0, agent, n))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as a person reads it: tokens joined by `/`.
    pub fn display(&self) -> String {
        self.0.replace('.', "/")
    }

    pub fn is_root(&self) -> bool {
        !self.0.contains('.')
    }

    pub fn root_id(&self) -> SessionId {
        Self(self.0.split('.').next().unwrap_or_default().to_string())
    }

    pub fn parent(&self) -> Option<SessionId> {
        self.0.rfind('.').map(|i| Self(self.0[..i].to_string()))
    }

    /// 0 for a root, 1 for its children, …
    pub fn depth(&self) -> u32 {
        self.0.matches('.').count() as u32
    }

    /// The agents named by the child tokens, outermost first (the root's agent is not in
    /// the id; it is recorded in the root's `Submitted`).
    pub fn path_agents(&self) -> Vec<&str> {
        self.0
            .split('.')
            .skip(1)
            .filter_map(|t| child_parts(t).map(|(a, _)| a))
            .collect()
    }

    /// Whether `other` is this session or one of its descendants.
    pub fn contains(&self, other: &SessionId) -> bool {
        other.0 == self.0
            || (other.0.starts_with(&self.0) && other.0.as_bytes().get(self.0.len()) == Some(&b'.'))
    }
}

fn child_parts(token: &str) -> Option<(&str, u32)> {
    let (agent, n) = token.rsplit_once('-')?;
    if agent.is_empty() {
        return None;
    }
    n.parse().ok().map(|n| (agent, n))
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for SessionId {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        Self::from_text(std::borrow::Cow::Owned(s))
    }
}

impl From<SessionId> for String {
    fn from(id: SessionId) -> String {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ids_nest_and_parse_back() {
        let root = SessionId::root("01jd8x").unwrap();
        let c = root.child("researcher", 2).child("writer", 1);
        assert_eq!(c.as_str(), "01jd8x.researcher-2.writer-1");
        assert_eq!(c.display(), "01jd8x/researcher-2/writer-1");
        assert_eq!(c.depth(), 2);
        assert_eq!(c.path_agents(), vec!["researcher", "writer"]);
        assert_eq!(c.parent().unwrap().as_str(), "01jd8x.researcher-2");
        assert_eq!(c.root_id(), root);
        assert_eq!(SessionId::parse("01jd8x/researcher-2/writer-1").unwrap(), c);
        assert!(root.contains(&c));
        assert!(!SessionId::root("01jd8").unwrap().contains(&c));
    }

    #[test]
    fn bad_tokens_are_named() {
        let e = SessionId::root("Has Space").unwrap_err().to_string();
        assert!(e.contains("Has Space"), "{e}");
        assert!(SessionId::parse("abc.notachild").is_err());
        assert!(SessionId::parse("abc..x-1").is_err());
        assert!(SessionId::root(&"a".repeat(65)).is_err());
        assert!(SessionId::root("a>b").is_err());
    }

    #[test]
    fn an_over_long_token_with_multibyte_text_is_refused_not_panicked_on() {
        // 15 ASCII bytes, then a 3-byte character across byte 16, then more: 70+ bytes.
        let token = format!("{}€{}", "a".repeat(15), "b".repeat(60));
        assert!(!token.is_char_boundary(16));
        let e = SessionId::root(&token).unwrap_err().to_string();
        assert!(e.contains("at most 64"), "{e}");
        assert!(
            e.contains("aaaaaaaaaaaaaaa€"),
            "the prefix is shown by characters: {e}"
        );
        let e = SessionId::parse(&format!("{token}.writer-1"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 64"), "{e}");
        // Every cut of a long multi-byte id is refused with an error, never a panic.
        let long = "é".repeat(300);
        for n in 0..long.len() {
            if long.is_char_boundary(n) {
                assert!(SessionId::parse(&long[..n]).is_err());
                assert!(validate_token(&long[..n]).is_err());
            }
        }
        let e = SessionId::parse(&"€".repeat(200)).unwrap_err().to_string();
        assert!(e.contains("at most 512"), "{e}");
    }

    #[test]
    fn an_owned_string_reads_as_the_same_id_or_error_as_parsing_it() {
        let long = format!("{}.w-1", "a".repeat(64));
        let deep = format!("r{}", ".w-1".repeat(200));
        for s in [
            "01jd8x.researcher-2.writer-1",
            "01jd8x/researcher-2/writer-1",
            " 01jd8x.researcher-2 ",
            "01jd8x\t",
            "01jd8x.",
            ".w-1",
            "abc.notachild",
            "abc..x-1",
            "ABC",
            "",
            " ",
            long.as_str(),
            deep.as_str(),
        ] {
            let owned = SessionId::try_from(s.to_string()).map_err(|e| e.to_string());
            let parsed = SessionId::parse(s).map_err(|e| e.to_string());
            assert_eq!(owned, parsed, "{s:?}");
        }
        // And through a decode, as every stored record's session is read.
        let id: SessionId = serde_json::from_str("\"r.w-1\"").unwrap();
        assert_eq!(id.as_str(), "r.w-1");
        let e = serde_json::from_str::<SessionId>("\"r.w\"").unwrap_err();
        assert!(e.to_string().contains("AGENT-N"), "{e}");
    }

    #[test]
    fn errors_do_not_carry_raw_control_characters() {
        let e = SessionId::root("a\u{1b}]0;pwned\u{7}")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\u{1b}') && !e.contains('\u{7}'), "{e:?}");
        assert!(e.contains("pwned"), "{e}");
        let long = format!("\u{1b}[2K{}", "x".repeat(80));
        let e = SessionId::root(&long).unwrap_err().to_string();
        assert!(!e.contains('\u{1b}'), "{e:?}");
    }

    #[test]
    fn prefix_chars_never_splits_a_character() {
        assert_eq!(prefix_chars("€€€", 2), "€€");
        assert_eq!(prefix_chars("ab", 5), "ab");
        assert_eq!(prefix_chars("", 3), "");
    }
}
