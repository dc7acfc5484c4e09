//! Coverage feedback from the compiler's SanitizerCoverage counters, on the stable
//! toolchain.
//!
//! Built with `-C passes=sancov-module` and the inline 8-bit counters
//! (`tests/fuzz_coverage.sh` sets the flags), every edge of the instrumented code bumps a
//! byte of one array, and each object's constructor hands that array's bounds to
//! [`__sanitizer_cov_8bit_counters_init`] before `main`. [`Coverage`] reads those bytes
//! after each input: an input that reached an edge not reached before, or an edge a number
//! of times in a range not seen before (1, 2, 3, 4–7, 8–15, 16–31, 32–127, 128+, as AFL
//! counts them), has found something new and joins the inputs mutated further.
//!
//! In a build without the flags nobody calls the hook, [`Coverage::attach`] finds no
//! counters, and the fuzzer says so rather than fuzzing blind.
//!
//! The only unsafe code of the crate is here: the counters are memory the compiler laid
//! out, reached through the raw bounds it passes. They are read and cleared as atomics,
//! since code under test on other threads (a tokio runtime) bumps them too.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

/// The counter arrays handed over so far, as (address, length).
static REGIONS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Called by the instrumented code's constructors, before `main`, with the bounds of its
/// counters (every object of the binary may pass the same bounds: they are kept once).
///
/// # Safety
/// `start..stop` must be the counter array the compiler made, alive for the whole run.
#[no_mangle]
pub unsafe extern "C" fn __sanitizer_cov_8bit_counters_init(start: *mut u8, stop: *mut u8) {
    let (start, stop) = (start as usize, stop as usize);
    if stop <= start {
        return;
    }
    let mut regions = REGIONS.lock().unwrap_or_else(|p| p.into_inner());
    if !regions.iter().any(|&(s, _)| s == start) {
        regions.push((start, stop - start));
    }
}

/// The hit-count class of a counter, one bit each.
fn class(hits: u8) -> u8 {
    match hits {
        0 => 0,
        1 => 1,
        2 => 2,
        3 => 4,
        4..=7 => 8,
        8..=15 => 16,
        16..=31 => 32,
        32..=127 => 64,
        _ => 128,
    }
}

/// The counters of this process and what has been seen of them.
pub struct Coverage {
    regions: Vec<&'static [AtomicU8]>,
    /// Per counter, the hit-count classes seen so far.
    seen: Vec<u8>,
    edges: usize,
    features: usize,
}

impl Coverage {
    /// The process's counters; `None` when the binary was built without them.
    pub fn attach() -> Option<Self> {
        let regions: Vec<&'static [AtomicU8]> = REGIONS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            // SAFETY: the bounds come from the compiler's constructor, for a static array
            // that lives as long as the process; AtomicU8 has u8's size and alignment.
            .map(|&(start, len)| unsafe {
                std::slice::from_raw_parts(start as *const AtomicU8, len)
            })
            .collect();
        let total = regions.iter().map(|r| r.len()).sum();
        (total > 0).then(|| Coverage {
            regions,
            seen: vec![0; total],
            edges: 0,
            features: 0,
        })
    }

    /// How many edges are instrumented.
    pub fn total(&self) -> usize {
        self.seen.len()
    }

    /// Edges reached so far.
    pub fn edges(&self) -> usize {
        self.edges
    }

    /// (edge, hit-count class) pairs seen so far.
    pub fn features(&self) -> usize {
        self.features
    }

    /// Clears the counters without looking at them (what ran before the first input).
    pub fn clear(&self) {
        for r in &self.regions {
            for c in r.iter() {
                c.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Takes the counters of what ran since the last call, clearing them, and returns how
    /// many new features they showed (0: nothing new).
    pub fn take(&mut self) -> usize {
        let mut new = 0;
        let mut base = 0;
        let regions = std::mem::take(&mut self.regions);
        for r in &regions {
            // SAFETY: AtomicU64 over the aligned middle of the same memory, read and
            // written only atomically, like the bytes around it.
            let (head, words, tail) = unsafe { r.align_to::<AtomicU64>() };
            for (i, c) in head.iter().enumerate() {
                new += self.note(base + i, c.swap(0, Ordering::Relaxed));
            }
            let mut at = base + head.len();
            // Most counters stay 0: a block of eight words is skipped with one test.
            for block in words.chunks(8) {
                if block
                    .iter()
                    .fold(0, |any, w| any | w.load(Ordering::Relaxed))
                    != 0
                {
                    for (k, w) in block.iter().enumerate() {
                        if w.load(Ordering::Relaxed) == 0 {
                            continue;
                        }
                        let bytes = w.swap(0, Ordering::Relaxed).to_le_bytes();
                        for (j, b) in bytes.into_iter().enumerate() {
                            new += self.note(at + 8 * k + j, b);
                        }
                    }
                }
                at += 8 * block.len();
            }
            for (i, c) in tail.iter().enumerate() {
                new += self.note(at + i, c.swap(0, Ordering::Relaxed));
            }
            base += r.len();
        }
        self.regions = regions;
        new
    }

    fn note(&mut self, index: usize, hits: u8) -> usize {
        let bit = class(hits);
        let seen = &mut self.seen[index];
        if bit == 0 || *seen & bit != 0 {
            return 0;
        }
        if *seen == 0 {
            self.edges += 1;
        }
        *seen |= bit;
        self.features += 1;
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_counts_fall_into_the_eight_classes() {
        let classes: Vec<u8> = [0u8, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 127, 128, 255]
            .into_iter()
            .map(class)
            .collect();
        assert_eq!(
            classes,
            [0, 1, 2, 4, 8, 8, 16, 16, 32, 32, 64, 64, 128, 128]
        );
    }

    #[test]
    fn a_feature_is_new_once() {
        let mut c = Coverage {
            regions: vec![],
            seen: vec![0; 3],
            edges: 0,
            features: 0,
        };
        assert_eq!(c.note(1, 1), 1);
        assert_eq!(c.note(1, 1), 0, "the same class again is nothing new");
        assert_eq!(c.note(1, 5), 1, "a new class of the same edge is");
        assert_eq!(c.note(2, 0), 0);
        assert_eq!((c.edges(), c.features()), (1, 2));
    }
}
