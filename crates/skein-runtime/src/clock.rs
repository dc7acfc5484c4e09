//! Time and chance as a port: the wall clock that records carry and deadlines are measured
//! on, and the draws that spread retries and name tokens and traces. A worker reads the
//! system's; a simulation supplies its virtual clock and a seeded generator, so that a
//! seed takes the same path every time.
//!
//! Timers and tasks stay tokio's: under a paused tokio clock (`start_paused`), sleeps,
//! timeouts and `tokio::time::Instant` are virtual already, and a current-thread runtime
//! runs its tasks in a fixed order. What tokio does not virtualise is here.

use rand::Rng as _;

pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// A uniformly drawn number.
    fn draw(&self) -> u64;
}

/// The system's clock and the thread's generator.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        crate::now_ms()
    }

    fn draw(&self) -> u64 {
        rand::thread_rng().gen()
    }
}

/// A number in `0..=max` drawn from `clock`.
pub fn up_to(clock: &dyn Clock, max: u64) -> u64 {
    match max.checked_add(1) {
        Some(n) => clock.draw() % n,
        None => clock.draw(),
    }
}

/// A fresh token id (the nonce recorded in a pausing event): 24 hex digits.
pub fn token_id(clock: &dyn Clock) -> String {
    let (a, b) = (clock.draw(), clock.draw());
    let mut bytes = [0u8; 12];
    bytes[..8].copy_from_slice(&a.to_be_bytes());
    bytes[8..].copy_from_slice(&b.to_be_bytes()[..4]);
    hex::encode(bytes)
}
