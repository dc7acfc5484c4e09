//! The faults a seed chooses, and a small seeded generator. Every decision the
//! simulation makes at random is drawn here, in the order the single-threaded run asks,
//! so a seed replays the same schedule.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// splitmix64: small, fast, and the same on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5eed_5eed_5eed_5eed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// True with probability `p` (0 ≤ p ≤ 1).
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }
}

/// How often each fault strikes, per opportunity.
#[derive(Debug, Clone, Copy)]
pub struct Rates {
    /// An append meets a (simulated) concurrent writer.
    pub conflict: f64,
    /// A backend call finds the backend unreachable.
    pub unreachable: f64,
    /// A notice is lost; or posted twice.
    pub notice_lost: f64,
    pub notice_twice: f64,
    /// A model call fails with a retryable error.
    pub model_fails: f64,
    /// A worker process is killed, per scheduler tick (every 50 to 450 virtual ms).
    pub crash: f64,
    /// A notice arrives late (up to 2 virtual s), after notices posted after it.
    pub notice_late: f64,
    /// A model call takes long: up to twice the lease.
    pub slow: f64,
    /// A heartbeat is lost: the job's lease may run out while its worker holds it.
    pub heartbeat_lost: f64,
    /// An operator cancels an unfinished tree, per scheduler tick.
    pub cancel: f64,
    /// A person looks at the inbox and acts on one item, per scheduler tick.
    pub person: f64,
    /// A job push takes a while (up to 40 virtual ms, a round trip to a busy server), so
    /// a step that pushes jobs can be killed, or overtaken by the jobs it pushed, midway:
    /// between two batches of a turn's delegations, for one.
    pub slow_push: f64,
    /// An append (durable at once, or written ahead) takes a while, up to 40 virtual ms
    /// split around the write: the records may land before the writer hears so, and a
    /// kill between a step's append and what it does next (push a job, post a notice,
    /// ack) can strike there.
    pub slow_append: f64,
    /// A read (a log, its last record, a tree's logs, a parent's notices, a target's
    /// watchers, a cache entry, a root's announced ending) takes a while, up to 40 virtual
    /// ms split around the moment it is served: what it returns may be older, by then,
    /// than what others have written since, as a reply on its way back is.
    pub slow_read: f64,
}

impl Rates {
    /// No fault, and a person at the inbox on every tick: a reference run.
    pub const NONE: Rates = Rates {
        conflict: 0.0,
        unreachable: 0.0,
        notice_lost: 0.0,
        notice_twice: 0.0,
        model_fails: 0.0,
        crash: 0.0,
        notice_late: 0.0,
        slow: 0.0,
        heartbeat_lost: 0.0,
        cancel: 0.0,
        person: 1.0,
        slow_push: 0.0,
        slow_append: 0.0,
        slow_read: 0.0,
    };

    /// The rates of a plain run: every fault possible, none frequent.
    pub const DEFAULT: Rates = Rates {
        conflict: 0.02,
        unreachable: 0.01,
        notice_lost: 0.05,
        notice_twice: 0.05,
        model_fails: 0.05,
        crash: 0.03,
        notice_late: 0.05,
        slow: 0.02,
        heartbeat_lost: 0.1,
        cancel: 0.002,
        person: 0.3,
        slow_push: 0.05,
        slow_append: 0.05,
        // Reads are about four times as many as appends: about as many slow ones.
        slow_read: 0.015,
    };

    /// One swarm rate: off in three seeds of ten, else anywhere up to `max`.
    fn swarm_rate(rng: &mut Rng, max: f64) -> f64 {
        if rng.chance(0.3) {
            0.0
        } else {
            max * (rng.below(1000) as f64 / 1000.0)
        }
    }

    /// Swarm testing: each seed draws its own rates, some faults off entirely and others
    /// far more frequent, so that rare combinations get their turn.
    pub fn swarm(rng: &mut Rng) -> Rates {
        // Drawn from a stream of its own, so that the other rates of a seed are the ones
        // it drew before slow pushes were simulated.
        let slow_push = Self::swarm_rate(&mut Rng(rng.0 ^ 0x736c_6f77_7075_7368), 0.3);
        let slow_append = Self::swarm_rate(&mut Rng(rng.0 ^ 0x736c_6f77_6170_7064), 0.3);
        let slow_read = Self::swarm_rate(&mut Rng(rng.0 ^ 0x736c_6f77_7265_6164), 0.1);
        let mut pick = |max: f64| Self::swarm_rate(rng, max);
        Rates {
            conflict: pick(0.2),
            unreachable: pick(0.05),
            notice_lost: pick(0.5),
            notice_twice: pick(0.5),
            model_fails: pick(0.2),
            crash: pick(0.1),
            notice_late: pick(0.5),
            slow: pick(0.2),
            heartbeat_lost: pick(0.8),
            cancel: pick(0.01),
            // Never no one: a question nobody answers is a pause, not a run that ends.
            person: 0.02 + pick(0.9),
            slow_push,
            slow_append,
            slow_read,
        }
    }
}

/// Faults of one run: the rates, the generator, and how many of each struck.
pub struct Faults {
    pub rates: Rates,
    rng: Mutex<Rng>,
    /// The draws of [`Faults::pipelined_refused`].
    refusals: Mutex<Rng>,
    /// The draws of [`Faults::push_delay`].
    pushes: Mutex<Rng>,
    /// The draws of [`Faults::append_delay`].
    appends: Mutex<Rng>,
    /// The draws of [`Faults::read_delay`].
    reads: Mutex<Rng>,
    pub conflicts: AtomicU64,
    pub unreachable: AtomicU64,
    pub notices_lost: AtomicU64,
    pub notices_twice: AtomicU64,
    pub model_failures: AtomicU64,
    pub notices_late: AtomicU64,
    pub slow_calls: AtomicU64,
    pub heartbeats_lost: AtomicU64,
    pub cancels: AtomicU64,
    pub slow_pushes: AtomicU64,
    pub slow_appends: AtomicU64,
    pub slow_reads: AtomicU64,
    /// Off while the invariants are checked: the checks read the store too.
    on: std::sync::atomic::AtomicBool,
}

impl Faults {
    pub fn new(rates: Rates, rng: Rng) -> Self {
        // Its own stream, so that the other faults of a seed fall where they did before
        // pipelined appends were drawn.
        let refusals = Rng(rng.0 ^ 0x7069_7065_6c69_6e65);
        let pushes = Rng(rng.0 ^ 0x7075_7368_6573_6c6f);
        let appends = Rng(rng.0 ^ 0x6170_7065_6e64_736c);
        let reads = Rng(rng.0 ^ 0x7265_6164_736c_6f77);
        Faults {
            rates,
            rng: Mutex::new(rng),
            refusals: Mutex::new(refusals),
            pushes: Mutex::new(pushes),
            appends: Mutex::new(appends),
            reads: Mutex::new(reads),
            conflicts: AtomicU64::new(0),
            unreachable: AtomicU64::new(0),
            notices_lost: AtomicU64::new(0),
            notices_twice: AtomicU64::new(0),
            model_failures: AtomicU64::new(0),
            notices_late: AtomicU64::new(0),
            slow_calls: AtomicU64::new(0),
            heartbeats_lost: AtomicU64::new(0),
            cancels: AtomicU64::new(0),
            slow_pushes: AtomicU64::new(0),
            slow_appends: AtomicU64::new(0),
            slow_reads: AtomicU64::new(0),
            on: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Whether faults strike: not once the run's time is up.
    pub fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.on.store(false, Ordering::Relaxed);
    }

    fn roll(&self, p: f64, count: &AtomicU64) -> bool {
        self.roll_on(&self.rng, p, count)
    }

    fn roll_on(&self, rng: &Mutex<Rng>, p: f64, count: &AtomicU64) -> bool {
        if !self.on.load(Ordering::Relaxed) || p <= 0.0 {
            return false;
        }
        let hit = rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .chance(p);
        if hit {
            count.fetch_add(1, Ordering::Relaxed);
        }
        hit
    }

    pub fn conflict(&self) -> bool {
        self.roll(self.rates.conflict, &self.conflicts)
    }

    /// A pipelined append is refused (as often as an append meets a concurrent writer),
    /// drawn from a stream of its own.
    pub fn pipelined_refused(&self) -> bool {
        self.roll_on(&self.refusals, self.rates.conflict, &self.conflicts)
    }

    pub fn unreachable(&self) -> bool {
        self.roll(self.rates.unreachable, &self.unreachable)
    }

    /// How many copies of a notice arrive: 0, 1 or 2.
    pub fn notice_copies(&self) -> usize {
        if self.roll(self.rates.notice_lost, &self.notices_lost) {
            0
        } else if self.roll(self.rates.notice_twice, &self.notices_twice) {
            2
        } else {
            1
        }
    }

    /// How long a job push takes, if this one is slow; drawn from a stream of its own.
    pub fn push_delay(&self) -> Option<std::time::Duration> {
        self.roll_on(&self.pushes, self.rates.slow_push, &self.slow_pushes)
            .then(|| std::time::Duration::from_millis(1 + Self::draw_on(&self.pushes, 40)))
    }

    /// How long an append takes, if this one is slow: the wait before its write lands
    /// and the wait after, before the writer hears of it (a request's way there and its
    /// ack's way back), together 1 to 40 ms; drawn from a stream of its own.
    pub fn append_delay(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        self.split_delay(&self.appends, self.rates.slow_append, &self.slow_appends)
    }

    /// How long a read takes, if this one is slow: the wait before it is served and the
    /// wait after, before the reader has its answer, together 1 to 40 ms; drawn from a
    /// stream of its own.
    pub fn read_delay(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        self.split_delay(&self.reads, self.rates.slow_read, &self.slow_reads)
    }

    /// With chance `p`, 1 to 40 ms split in two at random, drawn from `rng`.
    fn split_delay(
        &self,
        rng: &Mutex<Rng>,
        p: f64,
        count: &AtomicU64,
    ) -> Option<(std::time::Duration, std::time::Duration)> {
        if !self.roll_on(rng, p, count) {
            return None;
        }
        let total = 1 + Self::draw_on(rng, 40);
        let before = Self::draw_on(rng, total + 1);
        let ms = std::time::Duration::from_millis;
        Some((ms(before), ms(total - before)))
    }

    fn draw_on(rng: &Mutex<Rng>, n: u64) -> u64 {
        rng.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .below(n)
    }

    /// How late a notice arrives, if it does not arrive at once.
    pub fn notice_delay(&self) -> Option<std::time::Duration> {
        self.roll(self.rates.notice_late, &self.notices_late)
            .then(|| std::time::Duration::from_millis(1 + self.draw(2000)))
    }

    /// How long a slow model call takes, if this one is slow (`lease` is the jobs').
    pub fn slow_call(&self, lease: std::time::Duration) -> Option<std::time::Duration> {
        self.roll(self.rates.slow, &self.slow_calls)
            .then(|| std::time::Duration::from_millis(1 + self.draw(2 * lease.as_millis() as u64)))
    }

    pub fn heartbeat_lost(&self) -> bool {
        self.roll(self.rates.heartbeat_lost, &self.heartbeats_lost)
    }

    pub fn person(&self) -> bool {
        self.on.load(Ordering::Relaxed) && self.chance(self.rates.person)
    }

    fn chance(&self, p: f64) -> bool {
        self.rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .chance(p)
    }

    pub fn cancel(&self) -> bool {
        self.roll(self.rates.cancel, &self.cancels)
    }

    pub fn model_fails(&self) -> bool {
        self.roll(self.rates.model_fails, &self.model_failures)
    }

    /// A draw for the scheduler (crash times, which worker).
    pub fn draw(&self, n: u64) -> u64 {
        self.rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .below(n)
    }

    pub fn crash(&self) -> bool {
        self.on.load(Ordering::Relaxed)
            && self
                .rng
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .chance(self.rates.crash)
    }
}

/// The runtime's clock in a simulation: wall time is a fixed epoch plus the virtual time
/// elapsed, and draws come from the seed (a stream of their own, so that adding a draw in
/// the runtime does not move the faults).
#[derive(Debug)]
pub struct SimClock {
    epoch_ms: u64,
    t0: tokio::time::Instant,
    rng: Mutex<Rng>,
}

impl SimClock {
    /// 2023-11-14T22:13:20Z: any fixed moment will do.
    pub const EPOCH_MS: u64 = 1_700_000_000_000;

    pub fn new(seed: u64) -> Self {
        SimClock {
            epoch_ms: Self::EPOCH_MS,
            t0: tokio::time::Instant::now(),
            rng: Mutex::new(Rng::new(seed.rotate_left(32) ^ 0xc10c)),
        }
    }
}

impl skein_runtime::clock::Clock for SimClock {
    fn now_ms(&self) -> u64 {
        self.epoch_ms + self.t0.elapsed().as_millis() as u64
    }

    fn draw(&self) -> u64 {
        self.rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .next_u64()
    }
}
