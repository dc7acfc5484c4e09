//! The scripted model's clock: it answers when its latency has passed, to within a small
//! fraction of a millisecond.
//!
//! tokio's timer counts whole milliseconds and rounds a deadline up to the next one, and
//! the runtime notices it only when it next parks, so a 50 ms sleep ends 1–3 ms late. A
//! real model server's answer wakes its reader as it arrives, so that lateness is the
//! scripted model's own, and a benchmark would charge it to the runtime. So the scripted
//! model sleeps on tokio until a little before its deadline and waits out the rest on one
//! thread kept for that, whose condition-variable timeout is precise to tens of
//! microseconds. That thread keeps real time: under a paused tokio clock (a simulation)
//! the provider is made with [`crate::scripted::ScriptedProvider::on_tokio_clock`] and does
//! not use it.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// What is left to tokio's timer: all but this much of a wait.
const FINE: Duration = Duration::from_millis(3);

/// Waits until `deadline` (tokio's clock), ending within a fraction of a millisecond after
/// it rather than tokio's 1–3 ms.
pub(crate) async fn sleep_until(deadline: tokio::time::Instant) {
    if let Some(coarse) = deadline.checked_sub(FINE) {
        tokio::time::sleep_until(coarse).await;
    }
    let rest = deadline.saturating_duration_since(tokio::time::Instant::now());
    if rest.is_zero() {
        return;
    }
    let (tx, rx) = oneshot::channel();
    alarms().set(Instant::now() + rest, tx);
    // The alarm thread lives as long as the process; should it ever be gone, fall back
    // to tokio's timer rather than wait forever.
    if rx.await.is_err() {
        tokio::time::sleep(rest).await;
    }
}

/// One alarm: wake `tx` at `at`.
struct Due {
    at: Instant,
    tx: oneshot::Sender<()>,
}

// Ordered by time alone, reversed, so that the heap's top is the earliest alarm.
impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.cmp(&self.at)
    }
}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Due {}

/// The alarms set and not yet rung; None when the clock thread could not start.
struct Alarms {
    due: Mutex<Option<BinaryHeap<Due>>>,
    changed: Condvar,
}

fn alarms() -> &'static Alarms {
    static ALARMS: OnceLock<&'static Alarms> = OnceLock::new();
    ALARMS.get_or_init(|| {
        let a: &'static Alarms = Box::leak(Box::new(Alarms {
            due: Mutex::new(Some(BinaryHeap::new())),
            changed: Condvar::new(),
        }));
        let spawned = std::thread::Builder::new()
            .name("scripted-model-clock".into())
            .spawn(move || a.run());
        if let Err(e) = spawned {
            // Without the thread every alarm's sender is dropped at once: `sleep_until`
            // then falls back to tokio's timer.
            tracing::warn!(error = %e, "the scripted model's clock thread did not start");
            *a.due.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        a
    })
}

impl Alarms {
    fn set(&self, at: Instant, tx: oneshot::Sender<()>) {
        let mut g = self.due.lock().unwrap_or_else(|p| p.into_inner());
        // No clock thread: `tx` is dropped, and the caller falls back.
        if let Some(heap) = g.as_mut() {
            // The clock thread sleeps until the earliest alarm: only one due before that
            // needs it woken. (Waking it for every alarm set was a context switch per
            // model turn in a wide fan-out, where each new alarm is due after the others.)
            let sooner = heap.peek().is_none_or(|d| at < d.at);
            heap.push(Due { at, tx });
            drop(g);
            if sooner {
                self.changed.notify_one();
            }
        }
    }

    /// The clock thread: wakes every alarm that is due, then sleeps until the next one or
    /// until a new one is set.
    fn run(&self) {
        let mut g = self.due.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let now = Instant::now();
            let Some(heap) = g.as_mut() else { return };
            while heap.peek().is_some_and(|d| d.at <= now) {
                if let Some(d) = heap.pop() {
                    // A waiter that gave up (its call was abandoned) is not there to hear.
                    let _ = d.tx.send(());
                }
            }
            g = match heap.peek().map(|d| d.at - now) {
                Some(left) => {
                    self.changed
                        .wait_timeout(g, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
                None => self.changed.wait(g).unwrap_or_else(|p| p.into_inner()),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sleep_until;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_wait_ends_before_its_deadline() {
        // Many waits at once, due in an order unlike the order they were set in.
        let start = tokio::time::Instant::now();
        let mut tasks = vec![];
        for i in 0..40u64 {
            let due = start + Duration::from_millis(5 + (i * 7) % 23);
            tasks.push(tokio::spawn(async move {
                sleep_until(due).await;
                (due, tokio::time::Instant::now())
            }));
        }
        for t in tasks {
            let (due, woke) = t.await.expect("the wait ran");
            assert!(woke >= due, "woke {:?} before its deadline", due - woke);
        }
    }
}
