//! The child process: its loop of mutated inputs, each announced to the parent before it
//! runs, and the watch on its own memory.

use super::*;

/// What a child is told to do.
#[derive(Debug, Clone)]
pub struct ChildOptions {
    pub seconds: f64,
    pub seed: u64,
    pub corpus: PathBuf,
    pub rss_limit_mb: u64,
    /// Also keep the inputs that reach new code (needs a build with coverage counters),
    /// beside those accepted that were not seen before.
    pub coverage: bool,
}

pub(super) struct Wire(Arc<Mutex<File>>);

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

pub(super) fn rss_mb() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096 / (1 << 20))
}

/// Caps the address space well above the RSS limit: a backstop for allocations too fast
/// for the watchdog, so a runaway input fails an allocation instead of exhausting the
/// machine.
pub(super) fn cap_address_space(rss_limit_mb: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let want = (rss_limit_mb * 2 + 4096) << 20;
    let cur = getrlimit(Resource::As);
    let maximum = cur.maximum;
    let current = Some(maximum.map_or(want, |m| m.min(want)));
    let _ = setrlimit(Resource::As, Rlimit { current, maximum });
}

pub(super) fn watch_memory(wire: Arc<Mutex<File>>, limit_mb: u64) {
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
    // A reshaped value may be far longer than an input may be; the byte edits below
    // scan what they edit, so they get the cut input.
    input.truncate(spec.max_len);
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

pub(super) fn child_loop(spec: &Spec, o: &ChildOptions) -> Result<()> {
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
    // Coverage is measured whenever the build has counters, so both ways of choosing
    // inputs can be compared on the same binary; it chooses them only when asked to.
    let mut cov = Coverage::attach();
    if o.coverage && cov.is_none() {
        return Err(Error::setup(
            spec.name,
            "this build has no coverage counters: build it with tests/fuzz_coverage.sh",
        ));
    }
    if let Some(c) = &cov {
        stats.instrumented = c.total() as u64;
        c.clear();
    }
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
    // What the seeds reach is the baseline: new coverage is counted past it.
    if let Some(c) = &mut cov {
        c.take();
        stats.seed_edges = c.edges() as u64;
    }
    while Instant::now() < deadline {
        let input = next_input(&mut rng, spec, &seeds, &found, &dict);
        let accepted = exec(&input, &mut stats);
        let new_coverage = cov.as_mut().map_or(0, |c| c.take());
        // An accepted input reached past the parser: worth mutating further. Guided by
        // coverage, so is one that reached code (or a count of passes through it) that no
        // input reached before. Both count: the accepted ones lead into the code behind
        // the parser (the runtime a submission drives), which refused inputs that only
        // vary the parser's error paths crowd out when coverage alone decides.
        let keep = (accepted && known.insert(*blake3::hash(&input).as_bytes()))
            || (o.coverage && new_coverage > 0);
        if keep {
            if found.len() < 4096 {
                found.push(input);
            } else {
                let i = rng.gen_range(0..found.len());
                found[i] = input;
            }
        }
    }
    if let Some(c) = &cov {
        stats.edges = c.edges() as u64;
        stats.features = c.features() as u64;
    }
    stats.corpus = seeds.len() + found.len();
    wire.send(STATS, &serde_json::to_vec(&stats).unwrap_or_default());
    Ok(())
}
