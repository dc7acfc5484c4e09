//! The jobs this process holds, so that a push for a session whose job is held here is a
//! note to that holder rather than two round trips to the server.
//!
//! A push for a session whose job exists is refused by the jobs stream and then reads
//! (and may write) the session's wake marker (see `jobs.rs`). In a wide tree that is what
//! every child does at its end for its parent, whose job is held or pending while they
//! end: a thousand refused publishes and a thousand marker reads, in the very burst the
//! parent's own reads wait behind. When the parent's job is held by this process, the
//! push instead marks its hold here as woken, under one lock with the holder's release:
//! - a push that finds the hold marks it; the holder, releasing it after its job's
//!   message is deleted, finds the mark and pushes, as it does for a wake marker;
//! - a push that does not find it (released already, or never held here) goes to the
//!   server as before, where the job's message is deleted already or belongs to a holder
//!   whose ack reads the wake marker.
//!
//! A hold ends in its job's ack (which reads the mark), or in a retry (the job stays and
//! runs again: the mark is not needed), or by being dropped without either (a lease that
//! ran out, a job handed back): then a marked hold pushes as it goes. A hold is taken for
//! a push only while less than half its lease has passed since its delivery or last
//! heartbeat, so no other worker can hold the same delivery by then: the server gives
//! it out again only once a whole lease has passed without a heartbeat, and a run that
//! starts then reads what the pusher wrote before it pushed. A process that dies with a
//! marked hold loses nothing either: its job's delivery comes back after its lease, and
//! that run reads the notices and answers written before the push.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use skein_core::SessionId;
use skein_ports::ports::JobQueue;

use super::NatsStore;

/// Every hold of this process, by session.
pub(crate) struct Holds {
    held: Mutex<HashMap<SessionId, Entry>>,
    next: AtomicU64,
    /// The lease of every delivery this process takes (its pools' ack wait).
    lease: Duration,
    /// The store a marked hold dropped without its ack pushes through.
    store: OnceLock<Weak<NatsStore>>,
}

struct Entry {
    token: u64,
    woken: bool,
    since: Arc<Mutex<Instant>>,
}

/// How a hold stands.
const HELD: u8 = 0;
const RELEASED: u8 = 1;
const RELEASED_WOKEN: u8 = 2;

/// One delivery's hold, kept in its job's lease.
pub(crate) struct Hold {
    holds: Arc<Holds>,
    session: SessionId,
    pool: String,
    token: u64,
    state: AtomicU8,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Holds {
    pub(crate) fn new(lease: Duration) -> Self {
        Holds {
            held: Mutex::default(),
            next: AtomicU64::new(0),
            lease,
            store: OnceLock::new(),
        }
    }

    pub(crate) fn set_store(&self, store: Weak<NatsStore>) {
        let _ = self.store.set(store);
    }

    /// Records the hold of a delivery of `session`'s job, whose lease is counted from
    /// `since`. A hold of the same session held here before (a delivery given out again
    /// while its old holder still runs) is replaced, and its mark carried over.
    pub(crate) fn hold(
        self: &Arc<Self>,
        pool: &str,
        session: &SessionId,
        since: Arc<Mutex<Instant>>,
    ) -> Hold {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let mut held = lock(&self.held);
        let woken = held.get(session).is_some_and(|e| e.woken);
        held.insert(
            session.clone(),
            Entry {
                token,
                woken,
                since,
            },
        );
        Hold {
            holds: self.clone(),
            session: session.clone(),
            pool: pool.to_string(),
            token,
            state: AtomicU8::new(HELD),
        }
    }

    /// Marks the hold of `session` as woken, if its job is held here and well within its
    /// lease; false when the push must go to the server.
    pub(crate) fn wake(&self, session: &SessionId) -> bool {
        let mut held = lock(&self.held);
        match held.get_mut(session) {
            Some(e) if lock(&e.since).elapsed() < self.lease / 2 => {
                e.woken = true;
                true
            }
            _ => false,
        }
    }

    /// How many holds there are (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.held).len()
    }
}

impl Hold {
    /// Ends the hold; whether it was marked. Only the first call reads the mark.
    pub(crate) fn release(&self) -> bool {
        let mut held = lock(&self.holds.held);
        if self.state.load(Ordering::SeqCst) != HELD {
            return false;
        }
        let woken = match held.get(&self.session) {
            Some(e) if e.token == self.token => held.remove(&self.session).is_some_and(|e| e.woken),
            // Replaced by a newer delivery's hold, which carries the mark on.
            _ => false,
        };
        let state = if woken { RELEASED_WOKEN } else { RELEASED };
        self.state.store(state, Ordering::SeqCst);
        woken
    }

    /// Whether the release found the hold marked.
    pub(crate) fn was_woken(&self) -> bool {
        self.state.load(Ordering::SeqCst) == RELEASED_WOKEN
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if !self.release() {
            return;
        }
        // Marked, and neither acked nor retried: the push it stood for goes out now.
        let store = self.holds.store.get().and_then(Weak::upgrade);
        let (Some(store), Ok(rt)) = (store, tokio::runtime::Handle::try_current()) else {
            tracing::debug!(session = %self.session,
                "a woken hold ended with its process's store; its delivery comes back after its lease");
            return;
        };
        let (pool, session) = (self.pool.clone(), self.session.clone());
        // The push is of the job's trace, as an ack's push is: the task that drops the
        // hold is the one that ran the job, and the spawned push takes its context along.
        let traceparent = skein_ports::trace_context::current();
        // Nobody waits for this push to fail, so it keeps trying a while on its own: the
        // session's job may be gone (another holder acked it after this lease ran out).
        rt.spawn(skein_ports::trace_context::scoped(async move {
            skein_ports::trace_context::set(traceparent);
            let mut delay = Duration::from_millis(200);
            loop {
                match store.push(&pool, &session).await {
                    Ok(()) => return,
                    Err(e) if delay < Duration::from_secs(30) => {
                        tracing::debug!(%session, error = %e, "push for a woken hold failed; trying again");
                        tokio::time::sleep(delay).await;
                        delay *= 2;
                    }
                    Err(e) => {
                        tracing::warn!(%session, error = %e,
                            "push for a woken hold failed; the next sweep of open trees wakes it");
                        return;
                    }
                }
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// A push that marks a hold does so before the holder's release reads it, or finds
    /// no hold: racing the two on two threads, the release reports the mark exactly when
    /// the push took it.
    #[test]
    fn a_mark_taken_is_one_the_release_finds() {
        let holds = Arc::new(Holds::new(Duration::from_secs(60)));
        let s = SessionId::parse("race").unwrap();
        for _ in 0..2_000 {
            let since = Arc::new(Mutex::new(Instant::now()));
            let hold = holds.hold("p", &s, since);
            let start = Arc::new(std::sync::Barrier::new(2));
            let pusher = {
                let (holds, s, start) = (holds.clone(), s.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    holds.wake(&s)
                })
            };
            start.wait();
            let woken = hold.release();
            let marked = pusher.join().unwrap();
            assert_eq!(marked, woken, "a mark was lost or invented");
            assert!(!hold.release(), "a second release reads nothing");
        }
        assert_eq!(holds.len(), 0);
    }

    /// A newer delivery's hold of the same session carries the older one's mark, and the
    /// older one's release no longer ends it.
    #[test]
    fn a_newer_hold_carries_the_mark_of_the_one_it_replaces() {
        let holds = Arc::new(Holds::new(Duration::from_secs(60)));
        let s = SessionId::parse("again").unwrap();
        let since = || Arc::new(Mutex::new(Instant::now()));
        let old = holds.hold("p", &s, since());
        assert!(holds.wake(&s));
        let new = holds.hold("p", &s, since());
        assert!(!old.release(), "the old hold no longer holds");
        assert!(holds.wake(&s), "the new hold is still there to mark");
        assert!(new.release(), "the mark was carried over");
        assert!(!holds.wake(&s), "nothing is held any more");
    }
}
