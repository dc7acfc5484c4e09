//! Targets that fail on purpose, one per kind of failure the fuzzer must catch: a
//! panic, an abort, a hang (busy, and blocked without using CPU) and unbounded memory.
//! Each fails only on inputs that start with `!`, which the mutations reach from the
//! empty seed within a few hundred runs.
//! Run only when named (`--target selftest-panic`); the tests of the fuzzer use them.

use super::{FnTarget, Spec};

fn armed(data: &[u8]) -> bool {
    data.first() == Some(&b'!')
}

fn panics(data: &[u8]) -> bool {
    if armed(data) {
        panic!("selftest: armed input");
    }
    true
}

fn aborts(data: &[u8]) -> bool {
    if armed(data) {
        std::process::abort();
    }
    true
}

fn hangs(data: &[u8]) -> bool {
    if armed(data) {
        // Busy, as a parser caught in a loop is.
        let mut n = 0u64;
        loop {
            n = std::hint::black_box(n.wrapping_add(1));
        }
    }
    true
}

fn blocks(data: &[u8]) -> bool {
    if armed(data) {
        // Never returns, and uses no CPU while it waits.
        loop {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    true
}

fn grows(data: &[u8]) -> bool {
    if armed(data) {
        // Touch every page, so the memory is really taken.
        let mut hog: Vec<Vec<u8>> = vec![];
        loop {
            hog.push(vec![1u8; 64 << 20]);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    true
}

const ABOUT: &str = "fails on purpose on inputs that start with `!`";

pub const SPECS: &[Spec] = &[
    Spec {
        name: "selftest-panic",
        about: ABOUT,
        max_len: 64,
        make: || Ok(Box::new(FnTarget(panics))),
        reshape: |_, _, _| None,
        tokens: &["!"],
    },
    Spec {
        name: "selftest-abort",
        about: ABOUT,
        max_len: 64,
        make: || Ok(Box::new(FnTarget(aborts))),
        reshape: |_, _, _| None,
        tokens: &["!"],
    },
    Spec {
        name: "selftest-hang",
        about: ABOUT,
        max_len: 64,
        make: || Ok(Box::new(FnTarget(hangs))),
        reshape: |_, _, _| None,
        tokens: &["!"],
    },
    Spec {
        name: "selftest-block",
        about: ABOUT,
        max_len: 64,
        make: || Ok(Box::new(FnTarget(blocks))),
        reshape: |_, _, _| None,
        tokens: &["!"],
    },
    Spec {
        name: "selftest-memory",
        about: ABOUT,
        max_len: 64,
        make: || Ok(Box::new(FnTarget(grows))),
        reshape: |_, _, _| None,
        tokens: &["!"],
    },
];
