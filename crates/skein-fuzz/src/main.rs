//! `skein-fuzz`: fuzzes every parser of outside input for a bounded time. See the
//! README's "Fuzzing" section.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use skein_fuzz::runner::{self, ChildOptions, Options, TargetReport};
use skein_fuzz::targets::{self, Spec};

#[derive(Parser, Debug)]
#[command(
    name = "skein-fuzz",
    about = "Fuzzes every parser of outside input: mutates the seed corpus, runs each target \
             in a watched process, writes crashing inputs to crates/skein-fuzz/crashes/"
)]
struct Args {
    /// Seconds to fuzz each target.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Targets to run (repeat the flag or separate with commas); all by default.
    #[arg(long = "target", value_delimiter = ',')]
    targets: Vec<String>,
    /// Seed corpus: a directory per target.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Where crashing inputs are written, a directory per target.
    #[arg(long)]
    crashes: Option<PathBuf>,
    /// Seed of the random choices; a run with the same seed makes the same inputs.
    #[arg(long)]
    seed: Option<u64>,
    /// An input running longer than this many milliseconds is a hang.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Resident memory (MB) a target process may use.
    #[arg(long, default_value_t = 2048)]
    rss_limit_mb: u64,
    /// Also keep the inputs that reach new code, read from the compiler's coverage
    /// counters; the binary must be built with them (tests/fuzz_coverage.sh builds and
    /// runs it).
    #[arg(long)]
    coverage: bool,
    /// Run every chosen target twice on the same time budget and seed, first keeping the
    /// accepted inputs not seen before, then also those that reach new code, and compare
    /// runs and coverage (a build with coverage counters).
    #[arg(long, conflicts_with = "coverage")]
    compare: bool,
    /// List the targets and exit.
    #[arg(long)]
    list: bool,
    /// Run these inputs through the target once, in this process, and say what happened.
    #[arg(long, num_args = 1.., value_name = "FILE")]
    run: Vec<PathBuf>,
    /// Shrink this panicking input (written next to it as FILE.min).
    #[arg(long, value_name = "FILE")]
    minimize: Option<PathBuf>,
    /// Rewrite the seed corpus from real runs and examples.
    #[arg(long)]
    write_seeds: bool,
    /// Internal: fuzz this target as a child of the runner.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn chosen(a: &Args) -> Result<Vec<&'static Spec>> {
    if a.targets.is_empty() {
        return Ok(targets::ALL.iter().collect());
    }
    a.targets
        .iter()
        .map(|t| targets::find(t).map_err(anyhow::Error::from))
        .collect()
}

fn one_target(a: &Args) -> Result<&'static Spec> {
    match chosen(a)?.as_slice() {
        [one] if !a.targets.is_empty() => Ok(one),
        _ => bail!("name one target with --target"),
    }
}

fn run_files(spec: &Spec, files: &[PathBuf]) -> Result<ExitCode> {
    let mut target = (spec.make)()?;
    let mut failed = false;
    let mut out = std::io::stdout().lock();
    for f in files {
        let data = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
        // A closed stdout (`| head`) must not end the run: the exit code still tells.
        let _ = match runner::run_once(target.as_mut(), &data) {
            Ok(true) => writeln!(out, "{}: accepted", f.display()),
            Ok(false) => writeln!(out, "{}: refused", f.display()),
            Err(c) => {
                failed = true;
                let backtrace = c.new.map(|r| r.backtrace).unwrap_or_default();
                writeln!(
                    out,
                    "{}: PANIC at {}: {}\n{backtrace}",
                    f.display(),
                    c.location,
                    c.message
                )
            }
        };
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn minimize(spec: &Spec, file: &Path) -> Result<ExitCode> {
    let mut target = (spec.make)()?;
    let data = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let Some((small, caught)) = runner::minimize(target.as_mut(), &data) else {
        bail!("{} does not panic in target {}", file.display(), spec.name);
    };
    let out = PathBuf::from(format!("{}.min", file.display()));
    std::fs::write(&out, &small).with_context(|| format!("writing {}", out.display()))?;
    println!(
        "{} bytes → {} bytes, still panicking at {}: {}\nwritten to {}",
        data.len(),
        small.len(),
        caught.location,
        caught.message,
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn print_report(r: &TargetReport) {
    let rate = if r.execs > 0 {
        100.0 * r.accepted as f64 / r.execs as f64
    } else {
        0.0
    };
    println!(
        "{:<15} {:>10} runs {:>9.0}/s  {:>5.1}% accepted  {:>3} seeds  slowest {:>7.1} ms ({} B)  \
         {} crash{} ({} failing runs)",
        r.target,
        r.execs,
        r.execs_per_sec(),
        rate,
        r.seeds,
        r.slowest_us as f64 / 1000.0,
        r.slowest_len,
        r.crashes.len(),
        if r.crashes.len() == 1 { "" } else { "es" },
        r.failures
    );
    if r.instrumented > 0 {
        println!(
            "{:<15} coverage: {} of {} edges ({} by the seeds, {} new), {} features",
            "",
            r.edges,
            r.instrumented,
            r.seed_edges,
            r.edges.saturating_sub(r.seed_edges),
            r.features
        );
    }
}

/// Both ways of choosing inputs, target by target, on the same budget and seed.
fn compare(specs: &[&'static Spec], o: &Options) -> Result<ExitCode> {
    println!(
        "{:<15} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "target", "runs: kept", "runs: cov", "new: kept", "new: cov", "feat: kept", "feat: cov"
    );
    let mut crashes = 0;
    let mut sums = [0u64; 6];
    for spec in specs {
        let plain = runner::fuzz_target(
            spec,
            &Options {
                coverage: false,
                ..o.clone()
            },
        )?;
        let guided = runner::fuzz_target(
            spec,
            &Options {
                coverage: true,
                ..o.clone()
            },
        )?;
        crashes += plain.crashes.len() + guided.crashes.len();
        let row = [
            plain.execs,
            guided.execs,
            plain.edges.saturating_sub(plain.seed_edges),
            guided.edges.saturating_sub(guided.seed_edges),
            plain.features,
            guided.features,
        ];
        for (s, v) in sums.iter_mut().zip(row) {
            *s += v;
        }
        println!(
            "{:<15} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10}",
            spec.name, row[0], row[1], row[2], row[3], row[4], row[5]
        );
    }
    println!(
        "{:<15} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "total", sums[0], sums[1], sums[2], sums[3], sums[4], sums[5]
    );
    println!(
        "(kept: accepted inputs not seen before are mutated further; cov: so are inputs that \
         reach new edges or hit counts. new: edges reached beyond the seeds')"
    );
    Ok(if crashes == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn fuzz(a: &Args) -> Result<ExitCode> {
    let specs = chosen(a)?;
    if (a.coverage || a.compare) && skein_fuzz::coverage::Coverage::attach().is_none() {
        bail!("this build has no coverage counters: build it with tests/fuzz_coverage.sh");
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let o = Options {
        seconds: a.seconds,
        seed,
        corpus: a.corpus.clone().unwrap_or_else(skein_fuzz::default_corpus),
        crashes: a
            .crashes
            .clone()
            .unwrap_or_else(skein_fuzz::default_crashes),
        timeout: Duration::from_millis(a.timeout_ms),
        rss_limit_mb: a.rss_limit_mb,
        verbose: true,
        coverage: a.coverage,
    };
    println!(
        "fuzzing {} target(s), {}s each{}, seed {seed} (repeat with --seed {seed})",
        specs.len(),
        a.seconds,
        if a.compare {
            " in each mode"
        } else if a.coverage {
            ", guided by coverage"
        } else {
            ""
        }
    );
    if a.compare {
        return compare(&specs, &o);
    }
    let mut reports = vec![];
    for spec in specs {
        let r = runner::fuzz_target(spec, &o)?;
        print_report(&r);
        reports.push(r);
    }
    let crashes: usize = reports.iter().map(|r| r.crashes.len()).sum();
    let execs: u64 = reports.iter().map(|r| r.execs).sum();
    println!("total: {execs} runs, {crashes} distinct crash(es)");
    if crashes == 0 {
        return Ok(ExitCode::SUCCESS);
    }
    println!("\ncrashes (inputs in {}):", o.crashes.display());
    for r in &reports {
        for c in &r.crashes {
            println!("{}: {}", r.target, runner::describe(c));
            if !c.backtrace.is_empty() && c.kind == runner::Kind::Panic {
                for l in c.backtrace.lines().take(8) {
                    println!("    {l}");
                }
            }
        }
    }
    Ok(ExitCode::FAILURE)
}

fn main() -> ExitCode {
    let a = Args::parse();
    let result = (|| -> Result<ExitCode> {
        if let Some(name) = &a.child {
            let spec = targets::find(name)?;
            runner::child(
                spec,
                &ChildOptions {
                    seconds: a.seconds,
                    seed: a.seed.unwrap_or(0),
                    corpus: a.corpus.clone().unwrap_or_else(skein_fuzz::default_corpus),
                    rss_limit_mb: a.rss_limit_mb,
                    coverage: a.coverage,
                },
            )?;
            return Ok(ExitCode::SUCCESS);
        }
        if a.list {
            for t in targets::ALL {
                println!("{:<15} {}", t.name, t.about);
            }
            return Ok(ExitCode::SUCCESS);
        }
        if a.write_seeds {
            let dir = a.corpus.clone().unwrap_or_else(skein_fuzz::default_corpus);
            skein_fuzz::seeds::write_all(&dir)?;
            println!("seeds written to {}", dir.display());
            return Ok(ExitCode::SUCCESS);
        }
        if !a.run.is_empty() {
            return run_files(one_target(&a)?, &a.run);
        }
        if let Some(f) = &a.minimize {
            return minimize(one_target(&a)?, f);
        }
        fuzz(&a)
    })();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
