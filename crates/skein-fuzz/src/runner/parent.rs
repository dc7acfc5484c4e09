//! The parent process: one child per target, its frames read and its death explained, and
//! the crashes and counts of the run collected.

use super::*;

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
    /// Choose inputs by the coverage they reach (see [`ChildOptions::coverage`]).
    pub coverage: bool,
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
    /// Coverage of the last process, in a build with counters (else all 0): edges
    /// instrumented, reached by the seeds, reached in all, and features seen.
    pub instrumented: u64,
    pub seed_edges: u64,
    pub edges: u64,
    pub features: u64,
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
pub(super) struct Shared {
    last_input: Vec<u8>,
    last_at: Option<Instant>,
    execs: u64,
}

pub(super) enum Msg {
    Panic(PanicReport, Vec<u8>, u64),
    Memory(MemoryReport, Vec<u8>, u64),
    Stats(ChildStats),
    End,
}

pub(super) fn read_frames(mut out: impl Read, shared: Arc<Mutex<Shared>>, tx: mpsc::Sender<Msg>) {
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
pub(super) fn keep_tail(mut err: impl Read, tail: Arc<Mutex<VecDeque<u8>>>) {
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
pub(super) fn without_thread_ids(text: &str) -> String {
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
pub(super) fn death_note(stderr: &str) -> String {
    without_thread_ids(&death_line(stderr))
}

pub(super) fn death_line(stderr: &str) -> String {
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

pub(super) struct Collector<'a> {
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

/// The CPU time (user and system) process `pid` has used, from `/proc`; None where that
/// cannot be read.
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (field 2) may hold spaces and parentheses: count from the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11); // fields 14 and 15: utime, stime
    let ticks: u64 = fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
    // /proc counts in USER_HZ, which Linux fixes at 100 for this interface.
    Some(Duration::from_millis(ticks * 10))
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
            instrumented: 0,
            seed_edges: 0,
            edges: 0,
            features: 0,
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
            .args(o.coverage.then_some("--coverage"))
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
        // The input under way (by its number) and the child's CPU time when it was seen.
        let mut running: (u64, Option<Duration>) = (u64::MAX, None);
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
            if n != running.0 {
                running = (n, cpu_time(child.id()));
            }
            let hung = match last_at {
                // A hang is an input that kept the child busy for the limit. One that did
                // not, but has not returned either, is one after twelve times the limit
                // on the clock: a loaded machine can stall a process for seconds without
                // it using any CPU, and that is no hang of the code.
                Some(t) => {
                    let busy = running
                        .1
                        .zip(cpu_time(child.id()))
                        .map(|(then, now)| now.saturating_sub(then));
                    if busy.map_or(t.elapsed() > o.timeout, |b| b > o.timeout) {
                        Some(format!("an input ran longer than {:?}", o.timeout))
                    } else if t.elapsed() > o.timeout * 12 {
                        Some(format!(
                            "an input did not return within {:?}",
                            o.timeout * 12
                        ))
                    } else {
                        None
                    }
                }
                // Setting up (a store, a workspace) may take a while, but not forever.
                None => (spawned.elapsed() > o.timeout.max(Duration::from_secs(60)))
                    .then(|| "the target did not start its first input".to_string()),
            };
            if let Some(msg) = hung.filter(|_| stats.is_none() && !ended_by_us) {
                let _ = child.kill();
                ended_by_us = true;
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
                c.report.instrumented = s.instrumented;
                c.report.seed_edges = s.seed_edges;
                c.report.edges = s.edges;
                c.report.features = s.features;
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
