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

use crate::mutate::{mutate_bytes, Dict};
use crate::targets::{Spec, Target};
use crate::{Error, Result, Rng};

// ---- what both sides share ---------------------------------------------------------------

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

// ---- panics ------------------------------------------------------------------------------

#[derive(Default)]
struct HookState {
    panicked: bool,
    first: Option<(String, String)>,
    new_report: Option<PanicReport>,
    seen: HashSet<String>,
}

static HOOK: Mutex<Option<HookState>> = Mutex::new(None);
/// Set while a target runs; a panic outside a run is the fuzzer's own and is printed.
static IN_RUN: AtomicBool = AtomicBool::new(false);
/// Set in a child of the runner, whose stderr the runner reads when it dies.
static IN_CHILD: AtomicBool = AtomicBool::new(false);

fn payload_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".into())
}

/// Frames of a backtrace that belong to the code under test: the panic machinery above
/// and the fuzzer below are left out.
pub fn summarize_backtrace(bt: &str) -> String {
    let mut frames: Vec<Vec<&str>> = vec![];
    for line in bt.lines() {
        let t = line.trim_start();
        let numbered = t
            .split_once(':')
            .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if numbered {
            frames.push(vec![t]);
        } else if let Some(f) = frames.last_mut() {
            f.push(t);
        }
    }
    let boring = |f: &[&str]| {
        let name = f
            .first()
            .and_then(|l| l.split_once(": "))
            .map_or("", |(_, n)| n);
        [
            "std::",
            "core::",
            "rust_begin_unwind",
            "__rust",
            "<alloc::boxed::Box",
            "skein_fuzz::runner",
            "__libc",
            "_start",
            "main",
            "<unknown>",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || name.contains("skein_fuzz::runner::")
    };
    frames
        .iter()
        .filter(|f| !boring(f))
        .take(12)
        .map(|f| f.join("\n      "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Records every panic, wherever it is caught (a tool's task, a library): a panic is a
/// finding even when something above turns it into an error.
fn install_hook() {
    *lock(&HOOK) = Some(HookState::default());
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "unknown".into());
        let message = payload_text(info.payload());
        if !IN_RUN.load(Ordering::SeqCst) {
            if IN_CHILD.load(Ordering::SeqCst) {
                let bt = std::backtrace::Backtrace::force_capture();
                eprintln!("the fuzzer panicked at {location}: {message}\n{bt}");
            } else {
                previous(info);
            }
            return;
        }
        let mut guard = lock(&HOOK);
        let Some(st) = guard.as_mut() else {
            return;
        };
        st.panicked = true;
        if st.first.is_none() {
            st.first = Some((location.clone(), message.clone()));
            if st.seen.insert(location.clone()) {
                let bt = std::backtrace::Backtrace::force_capture().to_string();
                st.new_report = Some(PanicReport {
                    location,
                    message,
                    backtrace: summarize_backtrace(&bt),
                });
            }
        }
    }));
}

/// A panic during one run.
#[derive(Debug, Clone)]
pub struct Caught {
    pub location: String,
    pub message: String,
    /// The full report, when no earlier run of this process panicked at this place.
    pub new: Option<PanicReport>,
}

/// The panic of the last run, if it panicked.
fn take_panic() -> Option<Caught> {
    let mut guard = lock(&HOOK);
    let st = guard.as_mut()?;
    let panicked = std::mem::take(&mut st.panicked);
    let first = st.first.take();
    let new = st.new_report.take();
    panicked.then(|| {
        let (location, message) = first.unwrap_or_else(|| ("unknown".into(), String::new()));
        Caught {
            location,
            message,
            new,
        }
    })
}

/// Runs one input in this process: whether it was accepted, or the panic it caused
/// (wherever the panic was caught).
pub fn run_once(target: &mut dyn Target, data: &[u8]) -> std::result::Result<bool, Caught> {
    if lock(&HOOK).is_none() {
        install_hook();
    }
    let _ = take_panic();
    IN_RUN.store(true, Ordering::SeqCst);
    let r = catch_unwind(AssertUnwindSafe(|| target.run(data)));
    IN_RUN.store(false, Ordering::SeqCst);
    match (r, take_panic()) {
        (Ok(accepted), None) => Ok(accepted),
        (_, Some(c)) => Err(c),
        (Err(p), None) => Err(Caught {
            location: "unknown".into(),
            message: payload_text(p.as_ref()),
            new: None,
        }),
    }
}

/// Shrinks an input that panics, keeping the place of the panic: removes ever smaller
/// chunks while it still panics there.
pub fn minimize(target: &mut dyn Target, data: &[u8]) -> Option<(Vec<u8>, Caught)> {
    let first = run_once(target, data).err()?;
    let mut best = data.to_vec();
    let mut chunk = best.len() / 2;
    let mut tries = 0u32;
    while chunk > 0 && tries < 20_000 {
        let mut i = 0;
        while i < best.len() && tries < 20_000 {
            tries += 1;
            let end = (i + chunk).min(best.len());
            let mut cand = best[..i].to_vec();
            cand.extend_from_slice(&best[end..]);
            match run_once(target, &cand) {
                Err(c) if c.location == first.location => best = cand,
                _ => i += chunk,
            }
        }
        chunk /= 2;
    }
    Some((best, first))
}

// ---- the child ---------------------------------------------------------------------------

/// What a child is told to do.
#[derive(Debug, Clone)]
pub struct ChildOptions {
    pub seconds: f64,
    pub seed: u64,
    pub corpus: PathBuf,
    pub rss_limit_mb: u64,
}

struct Wire(Arc<Mutex<File>>);

impl Wire {
    fn stdout() -> Result<Self> {
        let fd = std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .map_err(Error::io("duplicating stdout"))?;
        Ok(Self(Arc::new(Mutex::new(File::from(fd)))))
    }

    fn send(&self, tag: u8, payload: &[u8]) {
        let mut buf = Vec::with_capacity(payload.len() + 5);
        buf.push(tag);
        buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        buf.extend_from_slice(payload);
        // The parent is gone when this fails: nothing left to report to.
        if lock(&self.0).write_all(&buf).is_err() {
            std::process::exit(2);
        }
    }
}

fn rss_mb() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096 / (1 << 20))
}

/// Caps the address space well above the RSS limit: a backstop for allocations too fast
/// for the watchdog, so a runaway input fails an allocation instead of exhausting the
/// machine.
fn cap_address_space(rss_limit_mb: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let want = (rss_limit_mb * 2 + 4096) << 20;
    let cur = getrlimit(Resource::As);
    let maximum = cur.maximum;
    let current = Some(maximum.map_or(want, |m| m.min(want)));
    let _ = setrlimit(Resource::As, Rlimit { current, maximum });
}

fn watch_memory(wire: Arc<Mutex<File>>, limit_mb: u64) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(10));
        if let Some(rss) = rss_mb().filter(|r| *r > limit_mb) {
            let body = serde_json::to_vec(&MemoryReport {
                rss_mb: rss,
                limit_mb,
            })
            .unwrap_or_default();
            let mut buf = vec![MEMORY];
            buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
            buf.extend_from_slice(&body);
            let mut w = lock(&wire);
            let _ = w.write_all(&buf);
            // Hold the lock: nothing may follow this frame.
            std::process::exit(3);
        }
    });
}

/// The next input: a seed or an accepted input found earlier, changed in its structure
/// (when the target knows how), its bytes, or both.
pub fn next_input(
    rng: &mut Rng,
    spec: &Spec,
    seeds: &[Vec<u8>],
    found: &[Vec<u8>],
    dict: &Dict,
) -> Vec<u8> {
    let empty = vec![];
    let base = if !found.is_empty() && rng.gen_bool(0.5) {
        &found[rng.gen_range(0..found.len())]
    } else if seeds.is_empty() {
        &empty
    } else {
        &seeds[rng.gen_range(0..seeds.len())]
    };
    let mut input = if rng.gen_bool(0.35) {
        (spec.reshape)(rng, base, dict).unwrap_or_else(|| base.clone())
    } else {
        base.clone()
    };
    if input == *base || rng.gen_bool(0.4) {
        mutate_bytes(rng, &mut input, seeds, dict, spec.max_len);
    }
    input.truncate(spec.max_len);
    input
}

/// Stack of the thread the inputs run on: a tokio worker's (2 MiB), where production
/// parses. A debug build's frames are several times larger, so it gets 16 MiB.
pub const TARGET_STACK: usize = if cfg!(debug_assertions) {
    16 << 20
} else {
    2 << 20
};

/// The child: fuzzes `spec` until the time is up, reporting over stdout. Inputs run on a
/// thread with [`TARGET_STACK`], so recursion a worker could not afford is found.
pub fn child(spec: &'static Spec, o: &ChildOptions) -> Result<()> {
    let o = o.clone();
    std::thread::Builder::new()
        .name("fuzz".into())
        .stack_size(TARGET_STACK)
        .spawn(move || child_loop(spec, &o))
        .map_err(Error::io("starting the fuzzing thread"))?
        .join()
        .unwrap_or_else(|p| Err(Error::Other(payload_text(p.as_ref()))))
}

fn child_loop(spec: &Spec, o: &ChildOptions) -> Result<()> {
    IN_CHILD.store(true, Ordering::SeqCst);
    let wire = Wire::stdout()?;
    cap_address_space(o.rss_limit_mb);
    watch_memory(wire.0.clone(), o.rss_limit_mb);
    install_hook();
    let mut target = (spec.make)()?;
    let named = load_corpus(&o.corpus.join(spec.name))?;
    let seeds: Vec<Vec<u8>> = if named.is_empty() {
        vec![vec![]]
    } else {
        named.into_iter().map(|(_, d)| d).collect()
    };
    let dict = Dict::new(&seeds, spec.tokens);
    let mut rng = Rng::seed_from_u64(o.seed);
    let mut stats = ChildStats {
        seeds: seeds.len(),
        ..Default::default()
    };
    let mut found: Vec<Vec<u8>> = vec![];
    let mut known: HashSet<[u8; 32]> = seeds.iter().map(|s| *blake3::hash(s).as_bytes()).collect();
    let deadline = Instant::now() + Duration::from_secs_f64(o.seconds.max(0.0));

    let mut exec = |input: &[u8], stats: &mut ChildStats| -> bool {
        wire.send(RUN, input);
        stats.execs += 1;
        let started = Instant::now();
        let outcome = run_once(target.as_mut(), input);
        let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        if us > stats.slowest_us {
            stats.slowest_us = us;
            stats.slowest_len = input.len();
        }
        match outcome {
            Ok(accepted) => {
                stats.accepted += u64::from(accepted);
                accepted
            }
            Err(caught) => {
                stats.panics += 1;
                if let Some(report) = caught.new {
                    wire.send(PANIC, &serde_json::to_vec(&report).unwrap_or_default());
                }
                false
            }
        }
    };

    for s in &seeds {
        exec(s, &mut stats);
    }
    while Instant::now() < deadline {
        let input = next_input(&mut rng, spec, &seeds, &found, &dict);
        if exec(&input, &mut stats) && known.insert(*blake3::hash(&input).as_bytes()) {
            // An accepted input reached past the parser: worth mutating further.
            if found.len() < 4096 {
                found.push(input);
            } else {
                let i = rng.gen_range(0..found.len());
                found[i] = input;
            }
        }
    }
    stats.corpus = seeds.len() + found.len();
    wire.send(STATS, &serde_json::to_vec(&stats).unwrap_or_default());
    Ok(())
}

// ---- the parent --------------------------------------------------------------------------

/// How the run is set up.
#[derive(Debug, Clone)]
pub struct Options {
    pub seconds: f64,
    pub seed: u64,
    pub corpus: PathBuf,
    pub crashes: PathBuf,
    /// An input running longer than this is a hang.
    pub timeout: Duration,
    pub rss_limit_mb: u64,
    /// Print each crash as it is found.
    pub verbose: bool,
}

/// What kind of failure a crash is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Panic,
    Abort,
    Timeout,
    Memory,
    /// The fuzzer's own code failed (a bug of the harness, not of the target).
    Fuzzer,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Panic => "panic",
            Kind::Abort => "abort",
            Kind::Timeout => "timeout",
            Kind::Memory => "memory",
            Kind::Fuzzer => "fuzzer bug",
        }
    }
}

/// One distinct failure of a target.
#[derive(Debug, Clone, Serialize)]
pub struct Crash {
    pub kind: Kind,
    /// Where: the panic's place, or what the process said when it died.
    pub place: String,
    pub message: String,
    pub backtrace: String,
    /// Runs of the target before the first input that did it.
    pub after_execs: u64,
    pub input_len: usize,
    pub file: PathBuf,
}

/// One target's run.
#[derive(Debug, Clone, Serialize)]
pub struct TargetReport {
    pub target: String,
    pub execs: u64,
    pub seconds: f64,
    pub accepted: u64,
    /// Runs that failed, the same failure counted each time.
    pub failures: u64,
    pub seeds: usize,
    pub crashes: Vec<Crash>,
    /// The longest single run (microseconds) and its input's size: a parser that is
    /// slow on some inputs shows here long before it hangs.
    pub slowest_us: u64,
    pub slowest_len: usize,
}

impl TargetReport {
    pub fn execs_per_sec(&self) -> f64 {
        if self.seconds > 0.0 {
            self.execs as f64 / self.seconds
        } else {
            0.0
        }
    }
}

#[derive(Default)]
struct Shared {
    last_input: Vec<u8>,
    last_at: Option<Instant>,
    execs: u64,
}

enum Msg {
    Panic(PanicReport, Vec<u8>, u64),
    Memory(MemoryReport, Vec<u8>, u64),
    Stats(ChildStats),
    End,
}

fn read_frames(mut out: impl Read, shared: Arc<Mutex<Shared>>, tx: mpsc::Sender<Msg>) {
    let mut head = [0u8; 5];
    loop {
        if out.read_exact(&mut head).is_err() {
            break;
        }
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut body = vec![0u8; len];
        if out.read_exact(&mut body).is_err() {
            break;
        }
        match head[0] {
            RUN => {
                let mut s = lock(&shared);
                s.last_input = body;
                s.last_at = Some(Instant::now());
                s.execs += 1;
            }
            tag => {
                let (input, execs) = {
                    let mut s = lock(&shared);
                    s.last_at = Some(Instant::now());
                    (s.last_input.clone(), s.execs.saturating_sub(1))
                };
                let msg = match tag {
                    PANIC => serde_json::from_slice(&body)
                        .ok()
                        .map(|r| Msg::Panic(r, input, execs)),
                    MEMORY => serde_json::from_slice(&body)
                        .ok()
                        .map(|r| Msg::Memory(r, input, execs)),
                    STATS => serde_json::from_slice(&body).ok().map(Msg::Stats),
                    _ => None,
                };
                if let Some(m) = msg {
                    if tx.send(m).is_err() {
                        break;
                    }
                }
            }
        }
    }
    let _ = tx.send(Msg::End);
}

/// Keeps the last 16 KiB of the child's stderr.
fn keep_tail(mut err: impl Read, tail: Arc<Mutex<VecDeque<u8>>>) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = err.read(&mut buf) {
        if n == 0 {
            break;
        }
        let mut t = lock(&tail);
        t.extend(&buf[..n]);
        while t.len() > 16 * 1024 {
            t.pop_front();
        }
    }
}

/// `text` without thread ids (` (12345)`), so one failure has one name in every process.
fn without_thread_ids(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(" (") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) if j > 0 && after[..j].chars().all(|c| c.is_ascii_digit()) => {
                rest = &after[j + 1..];
            }
            _ => {
                out.push_str(" (");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// What a dead child's stderr says about why it died.
fn death_note(stderr: &str) -> String {
    without_thread_ids(&death_line(stderr))
}

fn death_line(stderr: &str) -> String {
    for needle in [
        "the fuzzer panicked",
        "has overflowed its stack",
        "memory allocation of",
        "fatal runtime error",
        "panicked",
        "Aborted",
    ] {
        if let Some(line) = stderr.lines().find(|l| l.contains(needle)) {
            return line.trim().to_string();
        }
    }
    stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_string()
}

struct Collector<'a> {
    spec: &'a Spec,
    o: &'a Options,
    report: TargetReport,
    seen: HashSet<String>,
}

impl Collector<'_> {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        kind: Kind,
        place: String,
        message: String,
        backtrace: String,
        input: &[u8],
        after_execs: u64,
    ) -> Result<()> {
        if kind != Kind::Panic {
            // A panic is counted by the child, which sees every one.
            self.report.failures += 1;
        }
        let key = format!("{}:{place}", kind.as_str());
        if !self.seen.insert(key) {
            return Ok(());
        }
        let dir = self.o.crashes.join(self.spec.name);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("creating {}", dir.display())))?;
        let hash = input_hash(input);
        let file = dir.join(&hash);
        std::fs::write(&file, input).map_err(Error::io(format!("writing {}", file.display())))?;
        let note = format!(
            "target: {}\nkind: {}\nplace: {place}\nmessage: {message}\nafter: {after_execs} runs\n\
             reproduce: cargo run --release -p skein-fuzz -- --target {} --run {}\n\nbacktrace:\n{backtrace}\n",
            self.spec.name,
            kind.as_str(),
            self.spec.name,
            file.display()
        );
        let note_file = dir.join(format!("{hash}.txt"));
        std::fs::write(&note_file, note)
            .map_err(Error::io(format!("writing {}", note_file.display())))?;
        let crash = Crash {
            kind,
            place,
            message,
            backtrace,
            after_execs,
            input_len: input.len(),
            file,
        };
        if self.o.verbose {
            println!("  {}", describe(&crash));
        }
        self.report.crashes.push(crash);
        Ok(())
    }
}

/// A crash in a line.
pub fn describe(c: &Crash) -> String {
    format!(
        "{} at {} after {} runs: {} ({} byte input in {})",
        c.kind.as_str(),
        c.place,
        c.after_execs,
        c.message.lines().next().unwrap_or(""),
        c.input_len,
        c.file.display()
    )
}

/// Starts, watches and restarts the children of one target until its time is up.
pub fn fuzz_target(spec: &Spec, o: &Options) -> Result<TargetReport> {
    let exe = std::env::current_exe().map_err(Error::io("finding the fuzzer's executable"))?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(o.seconds.max(0.0));
    let mut c = Collector {
        spec,
        o,
        report: TargetReport {
            target: spec.name.into(),
            execs: 0,
            seconds: 0.0,
            accepted: 0,
            failures: 0,
            seeds: 0,
            crashes: vec![],
            slowest_us: 0,
            slowest_len: 0,
        },
        seen: HashSet::new(),
    };
    let mut restart = 0u32;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if restart > 0 && left < Duration::from_millis(300) {
            break;
        }
        let mut child: Child = Command::new(&exe)
            .arg("--child")
            .arg(spec.name)
            .arg("--seconds")
            .arg(format!("{:.3}", left.as_secs_f64()))
            .arg("--seed")
            .arg(derive_seed(o.seed, spec.name, restart).to_string())
            .arg("--corpus")
            .arg(&o.corpus)
            .arg("--rss-limit-mb")
            .arg(o.rss_limit_mb.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(Error::io("starting a fuzzing process"))?;
        let spawned = Instant::now();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = mpsc::channel();
        let reader = child.stdout.take().map(|out| {
            let shared = shared.clone();
            std::thread::spawn(move || read_frames(out, shared, tx))
        });
        let err_reader = child.stderr.take().map(|err| {
            let tail = tail.clone();
            std::thread::spawn(move || keep_tail(err, tail))
        });
        let mut stats: Option<ChildStats> = None;
        let mut ended_by_us = false;
        let mut panic_frames = 0u64;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Msg::Panic(r, input, n)) => {
                    panic_frames += 1;
                    let n = c.report.execs + n;
                    c.add(Kind::Panic, r.location, r.message, r.backtrace, &input, n)?;
                }
                Ok(Msg::Memory(m, input, n)) => {
                    let n = c.report.execs + n;
                    let msg = format!(
                        "resident memory {} MB over the {} MB limit",
                        m.rss_mb, m.limit_mb
                    );
                    c.add(
                        Kind::Memory,
                        "rss limit".into(),
                        msg,
                        String::new(),
                        &input,
                        n,
                    )?;
                    ended_by_us = true;
                }
                Ok(Msg::Stats(s)) => stats = Some(s),
                Ok(Msg::End) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            let (last_at, input, n) = {
                let s = lock(&shared);
                (s.last_at, s.last_input.clone(), s.execs)
            };
            let hung = match last_at {
                Some(t) => t.elapsed() > o.timeout,
                // Setting up (a store, a workspace) may take a while, but not forever.
                None => spawned.elapsed() > o.timeout.max(Duration::from_secs(60)),
            };
            if hung && stats.is_none() && !ended_by_us {
                let _ = child.kill();
                ended_by_us = true;
                let msg = format!("an input ran longer than {:?}", o.timeout);
                let n = c.report.execs + n.saturating_sub(1);
                c.add(
                    Kind::Timeout,
                    "time limit".into(),
                    msg,
                    String::new(),
                    &input,
                    n,
                )?;
            }
        }
        let status = child
            .wait()
            .map_err(Error::io("waiting for a fuzzing process"))?;
        if let Some(h) = reader {
            let _ = h.join();
        }
        if let Some(h) = err_reader {
            let _ = h.join();
        }
        let (execs, input) = {
            let s = lock(&shared);
            (s.execs, s.last_input.clone())
        };
        let stderr =
            String::from_utf8_lossy(&lock(&tail).iter().copied().collect::<Vec<u8>>()).into_owned();
        if execs == 0 && stats.is_none() && !ended_by_us && !status.success() {
            // It died before its first input: its setup failed, which is no finding.
            return Err(Error::setup(spec.name, death_note(&stderr)));
        }
        if !status.success() && !ended_by_us {
            let note = death_note(&stderr);
            let place = if note.is_empty() {
                format!("process ended: {status}")
            } else {
                note
            };
            let n = c.report.execs + execs.saturating_sub(1);
            let kind = if stderr.contains("the fuzzer panicked") {
                Kind::Fuzzer
            } else {
                Kind::Abort
            };
            c.add(
                kind,
                place,
                format!("the process died ({status})"),
                stderr.clone(),
                &input,
                n,
            )?;
        }
        c.report.execs += execs;
        match &stats {
            Some(s) => {
                c.report.accepted += s.accepted;
                c.report.seeds = s.seeds;
                c.report.failures += s.panics;
                if s.slowest_us > c.report.slowest_us {
                    c.report.slowest_us = s.slowest_us;
                    c.report.slowest_len = s.slowest_len;
                }
            }
            None => c.report.failures += panic_frames,
        }
        if stats.is_some() && status.success() {
            break;
        }
        restart += 1;
        if restart > 20 {
            break;
        }
    }
    c.report.seconds = started.elapsed().as_secs_f64();
    Ok(c.report)
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
