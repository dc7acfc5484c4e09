//! skein-runtime: the imperative shell around `skein-core`.
//!
//! The ports a backend implements ([`ports`]) and the worker that claims jobs, folds a
//! session's log, asks the core for the next step and performs it ([`worker`], with
//! [`session`] and [`work_loop`]). It must never depend on a particular store or broker:
//! the embedded backend is the crate `skein-sled`, the JetStream backend `skein-nats`, and
//! both plug into the same ports and pass the same conformance suite.

pub mod audit;
pub mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod control;
pub mod defs;
pub mod error;
pub mod hitl;
pub mod inspect;
pub mod metrics;
pub mod ports;
pub mod quota;
pub mod replay;
pub mod runtime;
pub mod runtime_tools;
pub mod scrub;
pub mod secret;
pub mod session;
pub mod spans;
pub mod trace;
pub mod work_loop;
pub mod worker;

pub use ports::{Backend, CacheEntry, Job, RootResult};

pub use error::{Error, RefusalKind, Result, TokenRefusal};

/// Milliseconds since the Unix epoch.
pub use skein_ports::now_ms;

/// A fresh root id: a lowercase ULID.
pub fn new_root_id() -> skein_core::SessionId {
    let u = ulid::Ulid::new().to_string().to_lowercase();
    skein_core::SessionId::root(&u).unwrap_or_else(|_| unreachable!("a ULID is a valid token"))
}
