//! The errors of the ports and of the runtime above them: a kind for every decision a
//! caller makes on them, and the error that caused them kept as a source, never flattened
//! into text.
//!
//! Callers decide by variant and kind: a [`Error::Conflict`] is retried at once after a
//! reread, [`Error::Unavailable`] backs off and tries again, a [`Error::Refused`] is told
//! to whoever asked (its [`RefusalKind`] picks the status code or the tool error), and
//! [`Error::Corrupt`] stops the step. The text is for people only.

use std::fmt;

pub use skein_core::token::TokenRefusal;

/// A cause kept under a runtime error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The log of `session` did not end at `expected`: someone else appended.
    #[error("append conflict on {session}: expected last seq {expected}, found {actual}")]
    Conflict {
        session: String,
        expected: u64,
        actual: u64,
    },
    #[error("not found: {0}")]
    NotFound(String),
    /// Stored data that cannot be decoded.
    #[error("corrupt data: {what}")]
    Corrupt {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// The backend is unreachable or failed (disk, network); trying again may help.
    #[error("unavailable: {what}")]
    Unavailable {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// The store has no room for the write (a full disk, a JetStream store at its
    /// limits). Nothing of the write was stored; the same write succeeds once there is
    /// room again, so the work waits for room rather than failing.
    #[error("no room in the store: {what}")]
    Full {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// The work was given up because the worker is stopping; nothing of it was recorded,
    /// and its job goes back to the queue for another worker.
    #[error("interrupted: {0}")]
    Interrupted(String),
    /// This worker lacks what the work needs (an agent, a model provider) and another
    /// live worker has it: the work is handed back for that one, nothing was recorded.
    #[error("handed back: {0}")]
    Lacking(String),
    /// A request that cannot be accepted; `reason` tells whoever asked why.
    #[error("{reason}")]
    Refused { kind: RefusalKind, reason: String },
    /// A submission under an id that an earlier, different submission already holds.
    /// (The same submission again is a no-op, not this error.)
    #[error(
        "session id `{id}` is already taken by a different submission ({differs}); \
         resubmit exactly the same mission under this id, or choose another id"
    )]
    IdTaken { id: String, differs: String },
    #[error(transparent)]
    Core(#[from] skein_core::Error),
}

/// Why a request was refused. Each kind is the caller's fault and the same request will be
/// refused again; the kind picks what the caller is told (an HTTP or service status, the
/// `kind` of an intake rejection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The request is malformed or out of bounds: a field's shape or size, an id, answers
    /// that miss a question, a fork point outside the log.
    Invalid,
    /// It names an agent the configuration does not define.
    UnknownAgent,
    /// A token that does not open, is of the other kind, was used, or whose session has
    /// moved on: which of these, the [`TokenRefusal`] says.
    Token(TokenRefusal),
    /// The configuration cannot be used: a token secret too short, a URL that does not
    /// parse.
    Config,
    /// The backend does not offer this operation.
    Unsupported,
}

impl RefusalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::Invalid => "invalid",
            RefusalKind::UnknownAgent => "unknown_agent",
            RefusalKind::Token(_) => "token",
            RefusalKind::Config => "config",
            RefusalKind::Unsupported => "unsupported",
        }
    }
}

impl Error {
    /// An unreachable or failing backend, caused by `source`.
    pub fn unavailable(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Unavailable {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// An unreachable or failing backend, with no error beneath (a timeout of our own, a
    /// stopped task).
    pub fn unavailable_because(what: impl Into<String>) -> Self {
        Error::Unavailable {
            what: what.into(),
            source: None,
        }
    }

    /// A write refused for want of room in the store, caused by `source`.
    pub fn full(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Full {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// Stored data that does not decode, caused by `source`.
    pub fn corrupt(what: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Corrupt {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// Stored data that is not what it must be, with no error beneath.
    pub fn corrupt_because(what: impl Into<String>) -> Self {
        Error::Corrupt {
            what: what.into(),
            source: None,
        }
    }

    pub fn refused(kind: RefusalKind, reason: impl Into<String>) -> Self {
        Error::Refused {
            kind,
            reason: reason.into(),
        }
    }

    /// A malformed or out-of-bounds request.
    pub fn invalid(reason: impl Into<String>) -> Self {
        Self::refused(RefusalKind::Invalid, reason)
    }

    /// Whether the same operation may succeed if tried again.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. } | Error::Conflict { .. } | Error::Full { .. }
        )
    }

    /// A refused token.
    pub fn token(why: TokenRefusal, reason: impl Into<String>) -> Self {
        Self::refused(RefusalKind::Token(why), reason)
    }

    /// Why a token was refused, if this is a token's refusal.
    pub fn token_refusal(&self) -> Option<TokenRefusal> {
        match self.refusal() {
            Some(RefusalKind::Token(why)) => Some(why),
            _ => None,
        }
    }

    /// The refusal's kind, if this is a refusal.
    pub fn refusal(&self) -> Option<RefusalKind> {
        match self {
            Error::Refused { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The error and every cause beneath it, on one line: for text that leaves the process
    /// (a service reply, a log line) where no reporter walks the sources.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }
}

/// Displays an error followed by its sources, `: `-separated.
pub struct Report<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_kept_as_the_source_and_shown_once_in_the_report() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused by peer");
        let e = Error::unavailable("nats: publish", io);
        assert_eq!(e.to_string(), "unavailable: nats: publish");
        let src = std::error::Error::source(&e).expect("a source");
        let io = src.downcast_ref::<std::io::Error>().expect("the io error");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            e.report().to_string(),
            "unavailable: nats: publish: refused by peer"
        );
        assert!(e.is_retryable());
    }

    #[test]
    fn refusals_carry_their_kind_and_are_not_retried() {
        let e = Error::token(TokenRefusal::Stale, "stale token");
        assert_eq!(e.refusal(), Some(RefusalKind::Token(TokenRefusal::Stale)));
        assert_eq!(e.token_refusal(), Some(TokenRefusal::Stale));
        assert_eq!(Error::invalid("x").token_refusal(), None);
        assert_eq!(e.to_string(), "stale token");
        assert!(!e.is_retryable());
        assert!(!Error::corrupt_because("x").is_retryable());
        assert_eq!(Error::invalid("x").refusal(), Some(RefusalKind::Invalid));
    }
}
