//! What a backend of skein implements, and nothing more: the ports (event log, job queue,
//! cache, blobs, notices, announcer, workspaces), the values they carry (`Job`,
//! `CacheEntry`, `RootResult`), their [`Error`], the [`workspace::Workspace`] a tree's
//! files are reached through, and the task's current trace context
//! ([`trace_context`]) a backend sends along with what it publishes. A backend depends on this crate alone, not on the worker
//! (`skein-runtime`) with its model clients and templates; the runtime re-exports all of
//! it (`skein_runtime::ports`, `skein_runtime::Error`).

pub mod error;
pub mod ports;
pub mod quota;
pub mod roots;
pub mod trace_context;
pub mod workspace;

pub use error::{Error, RefusalKind, Result};
pub use ports::{Backend, CacheEntry, Job, RootResult};
pub use roots::{RootFilter, RootSummary, RootsPage};

/// Now, in ms since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
