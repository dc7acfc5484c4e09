//! Panics caught where they happen: the hook that records the place and the backtrace, one
//! input run under it, and the smallest input that still panics at the same place.

use super::*;

#[derive(Default)]
pub(super) struct HookState {
    panicked: bool,
    first: Option<(String, String)>,
    new_report: Option<PanicReport>,
    seen: HashSet<String>,
}

pub(super) static HOOK: Mutex<Option<HookState>> = Mutex::new(None);
/// Set while a target runs; a panic outside a run is the fuzzer's own and is printed.
pub(super) static IN_RUN: AtomicBool = AtomicBool::new(false);
/// Set in a child of the runner, whose stderr the runner reads when it dies.
pub(super) static IN_CHILD: AtomicBool = AtomicBool::new(false);

pub(super) fn payload_text(p: &(dyn std::any::Any + Send)) -> String {
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
pub(super) fn install_hook() {
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
pub(super) fn take_panic() -> Option<Caught> {
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
