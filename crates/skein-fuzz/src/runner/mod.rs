//! The fuzzer: a parent that runs one child process per target and watches it, and the
//! child's loop that mutates inputs and runs them.
//!
//! The child tells the parent, over its stdout, every input before running it (frame
//! `R`), every panic at a new place (`P`), memory over the limit (`M`) and its counts at
//! the end (`S`). So when the child aborts (a stack overflow, a failed allocation), or
//! stops answering (a hang), the parent still holds the input that did it, writes it to
//! `crashes/<target>/<hash>` and starts a new child for the time that is left.

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::{Rng as _, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::coverage::Coverage;
use crate::mutate::{mutate_bytes, Dict};
use crate::targets::{Spec, Target};
use crate::{Error, Result, Rng};

mod child;
mod panics;
mod parent;

pub use child::*;
pub use panics::*;
pub use parent::*;

// What both sides share.

const RUN: u8 = b'R';
const PANIC: u8 = b'P';
const MEMORY: u8 = b'M';
const STATS: u8 = b'S';

/// A panic at a place not seen before in this child.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PanicReport {
    pub location: String,
    pub message: String,
    pub backtrace: String,
}

/// The child's counts at the end of its run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ChildStats {
    pub execs: u64,
    pub accepted: u64,
    pub panics: u64,
    pub seeds: usize,
    pub corpus: usize,
    /// The longest run, in microseconds, and the size of its input.
    pub slowest_us: u64,
    pub slowest_len: usize,
    /// Coverage, in a build with counters: edges instrumented, reached by the seeds,
    /// reached in all, and (edge, hit-count class) pairs seen.
    pub instrumented: u64,
    pub seed_edges: u64,
    pub edges: u64,
    pub features: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct MemoryReport {
    rss_mb: u64,
    limit_mb: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The corpus entries of `dir`, by file name; none when it does not exist.
pub fn load_corpus(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::io(format!("reading {}", dir.display()))(e)),
    };
    let mut out = vec![];
    for e in entries {
        let e = e.map_err(Error::io(format!("reading {}", dir.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !e.path().is_file() {
            continue;
        }
        let data = std::fs::read(e.path()).map_err(Error::io(format!("reading {name}")))?;
        out.push((name, data));
    }
    out.sort();
    Ok(out)
}

/// Hex of the first 16 bytes of the input's blake3: the name of its crash file.
pub fn input_hash(data: &[u8]) -> String {
    hex::encode(&blake3::hash(data).as_bytes()[..16])
}

/// A derived seed: one per target and restart, all from the run's seed.
pub fn derive_seed(seed: u64, target: &str, restart: u32) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.update(target.as_bytes());
    h.update(&restart.to_le_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_death_is_named_without_its_thread_id() {
        let err = "\nthread 'fuzz' (8015) has overflowed its stack\nfatal runtime error: stack overflow\n";
        assert_eq!(death_note(err), "thread 'fuzz' has overflowed its stack");
        assert_eq!(without_thread_ids("a (b) (12) c (3x)"), "a (b) c (3x)");
    }

    #[test]
    fn backtraces_keep_the_frames_of_the_code_under_test() {
        let bt = "   0: std::backtrace::Backtrace::force_capture\n             at /rustc/x/std.rs:1:1\n   1: skein_core::id::validate_token\n             at ./crates/skein-core/src/id.rs:29:19\n   2: skein_fuzz::runner::run_once\n             at ./crates/skein-fuzz/src/runner.rs:1:1\n";
        let s = summarize_backtrace(bt);
        assert!(s.contains("skein_core::id::validate_token"), "{s}");
        assert!(s.contains("id.rs:29:19"), "{s}");
        assert!(
            !s.contains("force_capture") && !s.contains("run_once"),
            "{s}"
        );
    }
}
