//! The fuzzer itself, run as a process: it must catch each kind of failure (with the
//! targets that fail on purpose), write the input that did it, exit non-zero, repeat a
//! run from its seed, and pass a clean target.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fuzzer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skein-fuzz"))
}

fn run(args: &[&str], crashes: &Path) -> Output {
    fuzzer()
        .args(args)
        .arg("--crashes")
        .arg(crashes)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The crash inputs written for `target` (not their notes).
fn inputs(crashes: &Path, target: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(crashes.join(target)) else {
        return vec![];
    };
    let mut v: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_none())
        .collect();
    v.sort();
    v
}

fn caught(target: &str, kind: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["--target", target, "--seconds", "3", "--seed", "11"];
    args.extend_from_slice(extra);
    let out = run(&args, dir.path());
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("{kind} at")), "{text}");
    let files = inputs(dir.path(), target);
    assert_eq!(
        files.len(),
        1,
        "one distinct failure, one file: {files:?}\n{text}"
    );
    let input = std::fs::read(&files[0]).unwrap();
    assert_eq!(input.first(), Some(&b'!'), "the input that did it was kept");
    let note = std::fs::read_to_string(files[0].with_extension("txt")).unwrap();
    assert!(note.contains(&format!("kind: {kind}")), "{note}");
}

#[test]
fn a_panic_is_caught_and_its_input_written() {
    caught("selftest-panic", "panic", &[]);
}

#[test]
fn an_abort_is_caught_and_its_input_written() {
    caught("selftest-abort", "abort", &[]);
}

#[test]
fn a_hang_is_caught_and_its_input_written() {
    caught("selftest-hang", "timeout", &["--timeout-ms", "500"]);
}

#[test]
fn an_input_that_blocks_without_using_cpu_is_caught_on_the_clock() {
    // Twelve times the limit on the clock: 2.4 s here.
    caught("selftest-block", "timeout", &["--timeout-ms", "200"]);
}

#[test]
fn unbounded_memory_is_caught_and_its_input_written() {
    caught("selftest-memory", "memory", &["--rss-limit-mb", "300"]);
}

#[test]
fn the_same_seed_makes_the_same_run() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let args = [
        "--target",
        "selftest-panic",
        "--seconds",
        "1",
        "--seed",
        "42",
    ];
    let (ra, rb) = (stdout(&run(&args, a.path())), stdout(&run(&args, b.path())));
    let after = |t: &str| {
        t.lines()
            .find(|l| l.contains("panic at"))
            .and_then(|l| l.split(" after ").nth(1))
            .and_then(|l| l.split(' ').next())
            .map(str::to_string)
    };
    assert!(after(&ra).is_some(), "{ra}");
    assert_eq!(after(&ra), after(&rb), "{ra}\n{rb}");
    let names = |d: &Path| -> Vec<_> {
        inputs(d, "selftest-panic")
            .iter()
            .map(|p| p.file_name().unwrap().to_owned())
            .collect()
    };
    assert_eq!(names(a.path()), names(b.path()));
}

#[test]
fn a_clean_target_passes_and_reports_its_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        &["--target", "token", "--seconds", "2", "--seed", "5"],
        dir.path(),
    );
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    let line = text.lines().find(|l| l.starts_with("token")).unwrap();
    let runs: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(runs > 100, "{line}");
    assert!(line.contains("0 crashes"), "{line}");
    assert!(inputs(dir.path(), "token").is_empty());
}

#[test]
fn a_written_crash_reproduces_with_run() {
    let dir = tempfile::tempdir().unwrap();
    run(
        &[
            "--target",
            "selftest-panic",
            "--seconds",
            "1",
            "--seed",
            "3",
        ],
        dir.path(),
    );
    let file = inputs(dir.path(), "selftest-panic").remove(0);
    let out = fuzzer()
        .args(["--target", "selftest-panic", "--run"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("PANIC at"), "{}", stdout(&out));
}

#[test]
fn an_unknown_target_is_named() {
    let out = fuzzer().args(["--target", "nope"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown target `nope`"), "{err}");
}

#[test]
fn coverage_guidance_without_counters_is_refused_by_name() {
    // The test build has no coverage counters: asking to be guided by them must fail
    // and say how to get them, not fuzz without guidance.
    let dir = tempfile::tempdir().unwrap();
    for mode in ["--coverage", "--compare"] {
        let out = run(&[mode, "--target", "id", "--seconds", "1"], dir.path());
        assert_eq!(out.status.code(), Some(2), "{mode}: {}", stdout(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no coverage counters") && err.contains("tests/fuzz_coverage.sh"),
            "{mode}: {err}"
        );
    }
}
