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
        return Err(Error::InvalidId(format!(
            "token `{}…` is longer than {MAX_TOKEN_LEN} bytes",
            &token[..16]
        )));
    }
    if let Some(c) = token
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '_'))
    {
        return Err(Error::InvalidId(format!(
            "token `{token}` contains {c:?}; allowed are a-z, 0-9, `-` and `_`"
        )));
    }
    Ok(())
}

impl SessionId {
    /// A root id from a token (a lowercase ULID or an idempotency key).
    pub fn root(token: &str) -> Result<Self> {
        validate_token(token)?;
        Ok(Self(token.to_string()))
    }

    /// Parses the dotted or slashed form.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim().replace('/', ".");
        if s.len() > MAX_ID_LEN {
            return Err(Error::InvalidId(format!(
                "id longer than {MAX_ID_LEN} bytes"
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
        Ok(Self(s))
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
        Self::parse(&s)
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
}
