//! skein-runtime: the imperative shell around `skein-core`.
//!
//! The ports a backend implements ([`ports`]) and the worker that claims jobs, folds a
//! session's log, asks the core for the next step and performs it ([`worker`], with
//! [`session`] and [`work_loop`]). It must never depend on a particular store or broker:
//! the embedded backend is the crate `skein-sled`, the JetStream backend `skein-nats`, and
//! both plug into the same ports and pass the same conformance suite.

pub mod audit;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod control;
pub mod hitl;
pub mod inspect;
pub mod metrics;
pub mod ports;
pub mod replay;
pub mod runtime;
pub mod runtime_tools;
pub mod secret;
pub mod session;
pub mod spans;
pub mod trace;
pub mod work_loop;
pub mod worker;

pub use ports::{Backend, CacheEntry, Job, RootResult};

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
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// The backend is unreachable or failed (disk, network); trying again may help.
    #[error("backend: {0}")]
    Backend(String),
    /// The work was given up because the worker is stopping; nothing of it was recorded,
    /// and its job goes back to the queue for another worker.
    #[error("interrupted: {0}")]
    Interrupted(String),
    /// A request a user made that cannot be accepted.
    #[error("{0}")]
    Rejected(String),
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

impl Error {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Backend(_) | Error::Conflict { .. })
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A fresh root id: a lowercase ULID.
pub fn new_root_id() -> skein_core::SessionId {
    let u = ulid::Ulid::new().to_string().to_lowercase();
    skein_core::SessionId::root(&u).unwrap_or_else(|_| unreachable!("a ULID is a valid token"))
}
