//! One target per parser of outside input. Each feeds bytes to the entry point production
//! uses, then to the checks production runs on what it parsed.

use crate::mutate::Dict;
use crate::{Result, Rng};

pub mod agent;
pub mod answers;
pub mod audit;
pub mod event;
pub mod id;
pub mod mcp_message;
pub mod model_response;
pub mod model_stream;
pub mod script;
pub mod selftest;
pub mod submission;
pub mod token;
pub mod tool_args;

/// One parser under test, with whatever it needs around it (a store, a workspace).
pub trait Target {
    /// Feeds one input. Returns whether it was accepted; a refusal is as correct an
    /// outcome as an acceptance. Panicking, aborting, hanging or allocating without bound
    /// is what the fuzzer looks for.
    fn run(&mut self, data: &[u8]) -> bool;
}

/// A target as the fuzzer sees it.
pub struct Spec {
    pub name: &'static str,
    /// What it parses, in a line.
    pub about: &'static str,
    /// Longest input the fuzzer makes for it.
    pub max_len: usize,
    /// Sets the target up (a store, a workspace, …).
    pub make: fn() -> Result<Box<dyn Target>>,
    /// A structure-aware variant of a corpus entry; none when the entry does not have the
    /// expected structure (the fuzzer then edits bytes).
    pub reshape: fn(&mut Rng, &[u8], &Dict) -> Option<Vec<u8>>,
    /// Dictionary tokens besides the words of the seeds.
    pub tokens: &'static [&'static str],
}

/// A plain function as a target.
pub struct FnTarget(pub fn(&[u8]) -> bool);

impl Target for FnTarget {
    fn run(&mut self, data: &[u8]) -> bool {
        (self.0)(data)
    }
}

/// Every target the fuzzer runs by default, in the order it runs them.
pub const ALL: &[Spec] = &[
    id::SPEC,
    submission::SPEC,
    agent::SPEC,
    script::SPEC,
    answers::SPEC,
    token::SPEC,
    tool_args::SPEC,
    event::SPEC,
    audit::SPEC,
    model_response::SPEC,
    model_stream::SPEC,
    mcp_message::SPEC,
];

/// Targets that misbehave on purpose, to check that the fuzzer catches each kind of
/// failure. Run only when named.
pub const SELFTESTS: &[Spec] = selftest::SPECS;

/// The target called `name` (self tests included).
pub fn find(name: &str) -> Result<&'static Spec> {
    ALL.iter()
        .chain(SELFTESTS)
        .find(|s| s.name == name)
        .ok_or_else(|| crate::Error::UnknownTarget(name.to_string()))
}

/// Text of an input as production reads it from a file or a message: invalid UTF-8 is
/// replaced, so the parser still sees everything else.
pub(crate) fn text(data: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(data)
}

/// A single-threaded tokio runtime for targets whose entry points are async.
pub(crate) fn tokio_runtime(target: &str) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| crate::Error::setup(target, e))
}
