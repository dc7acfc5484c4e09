//! skein-fuzz: fuzz targets for every parser that reads outside input, and a mutational
//! fuzzer that runs them on the stable toolchain.
//!
//! A target ([`targets::Spec`]) feeds bytes to the same entry point production uses:
//! session ids and idempotency keys, submissions (JSON and msgpack, with NATS headers),
//! agent files, model scripts, answers, resume tokens, tool arguments, stored event
//! records, audit exports, and model responses. A target passes an input when the parser
//! returns — accepted or refused — without panicking, aborting, hanging or allocating
//! without bound.
//!
//! The fuzzer ([`runner`]) mutates the seeds of `corpus/<target>/` (byte edits, splices,
//! dictionary tokens, and structure-aware edits of the JSON, msgpack and YAML inside them)
//! from a seeded RNG, runs each target in a child process that is watched for hangs,
//! aborts and memory growth, and writes every crashing input to `crashes/<target>/`. The
//! inputs it mutates further are the accepted ones not seen before and, guided by
//! coverage, those that reached new code, read from the compiler's coverage counters
//! ([`coverage`], in a build made by `tests/fuzz_coverage.sh`).
//!
//! This crate is a test tool: nothing in skein may depend on it.

pub mod coverage;
pub mod fixtures;
pub mod mutate;
pub mod runner;
pub mod seeds;
pub mod structured;
pub mod targets;

/// Why the fuzzer itself could not do its work (never a finding about a target).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("setting up target `{target}`: {reason}")]
    Setup { target: String, reason: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("unknown target `{0}`; run with --list to see them")]
    UnknownTarget(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }

    pub(crate) fn setup(target: &str, reason: impl std::fmt::Display) -> Error {
        Error::Setup {
            target: target.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// The random source of every fuzzing decision; seeded, so a run can be repeated.
pub type Rng = rand::rngs::StdRng;

/// The committed seed corpus: a directory per target.
pub fn default_corpus() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

/// Where crashing inputs go by default (ignored by git): a directory per target.
pub fn default_crashes() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crashes")
}
