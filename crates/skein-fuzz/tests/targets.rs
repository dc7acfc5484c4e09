//! Every fuzz target on arbitrary bytes, on the fuzzer's own variants of its seeds, and
//! on each committed seed, so `cargo test` covers them in seconds. The proptest seeds are
//! fixed: these tests are a quick, repeatable check; the fuzzer is what explores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::cell::RefCell;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use rand::SeedableRng;
use skein_fuzz::mutate::Dict;
use skein_fuzz::runner::{load_corpus, next_input, run_once};
use skein_fuzz::targets::{find, Spec, Target};

fn spec(name: &str) -> &'static Spec {
    find(name).unwrap()
}

fn seeds(spec: &Spec) -> Vec<Vec<u8>> {
    load_corpus(&skein_fuzz::default_corpus().join(spec.name))
        .unwrap()
        .into_iter()
        .map(|(_, d)| d)
        .collect()
}

/// Runs `f` on a thread with room for the deep inputs the fuzzer makes: a debug build
/// needs far more stack for them than the release build the fuzzer runs.
fn with_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x5ee1),
        ..Config::default()
    })
}

/// Arbitrary bytes, up to 4 KiB (or the target's limit).
fn arbitrary_bytes(name: &str, cases: u32) {
    let spec = spec(name);
    let target: RefCell<Box<dyn Target>> = RefCell::new((spec.make)().unwrap());
    runner(cases)
        .run(&vec(any::<u8>(), 0..spec.max_len.min(4096)), |data| {
            target.borrow_mut().run(&data);
            Ok(())
        })
        .unwrap();
}

/// Inputs made the way the fuzzer makes them, from the committed seeds.
fn variants(name: &str, cases: u32) {
    let spec = spec(name);
    let seeds = seeds(spec);
    let dict = Dict::new(&seeds, spec.tokens);
    let target: RefCell<Box<dyn Target>> = RefCell::new((spec.make)().unwrap());
    runner(cases)
        .run(&any::<u64>(), |s| {
            let mut rng = skein_fuzz::Rng::seed_from_u64(s);
            let input = next_input(&mut rng, spec, &seeds, &[], &dict);
            target.borrow_mut().run(&input);
            Ok(())
        })
        .unwrap();
}

/// Every committed seed runs without a panic, and some are accepted: the corpus reaches
/// past the first parse.
fn corpus(name: &str) {
    let spec = spec(name);
    let seeds = load_corpus(&skein_fuzz::default_corpus().join(spec.name)).unwrap();
    assert!(seeds.len() >= 3, "{name}: only {} seeds", seeds.len());
    let mut target = (spec.make)().unwrap();
    let mut accepted = 0;
    for (file, data) in &seeds {
        match run_once(target.as_mut(), data) {
            Ok(a) => accepted += usize::from(a),
            Err(c) => panic!("{name}/{file} panics at {}: {}", c.location, c.message),
        }
    }
    assert!(accepted > 0, "{name}: no seed is accepted");
    assert!(
        accepted < seeds.len(),
        "{name}: every seed is accepted; the corpus needs refused inputs too"
    );
}

macro_rules! target_tests {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn arbitrary_bytes() {
                super::with_stack(|| super::arbitrary_bytes(stringify!($name), 256));
            }

            #[test]
            fn variants_of_the_seeds() {
                super::with_stack(|| super::variants(stringify!($name), 256));
            }

            #[test]
            fn every_seed() {
                super::with_stack(|| super::corpus(stringify!($name)));
            }
        }
    )*};
}

target_tests!(
    id,
    submission,
    agent,
    script,
    answers,
    token,
    tool_args,
    event,
    audit,
    model_response,
    model_stream,
    mcp_message
);

#[test]
fn every_target_is_tested_here() {
    let here = [
        "id",
        "submission",
        "agent",
        "script",
        "answers",
        "token",
        "tool_args",
        "event",
        "audit",
        "model_response",
        "model_stream",
        "mcp_message",
    ];
    for t in skein_fuzz::targets::ALL {
        assert!(here.contains(&t.name), "target {} has no tests", t.name);
    }
}
