//! One conformance suite for the ports, run against every backend. Each check is a
//! function that each backend's tests turn into a test of its own with
//! [`conformance_tests!`](crate::conformance_tests), so a failure names the property and
//! the backend; [`run_all`] runs them in order (for a cluster with a node down). Each check
//! uses fresh session ids, so one backend instance can serve them all.
//!
//! The backend under test is opened with a job lease of about one second (the checks wait
//! for a lease to run out). Compiled with the `conformance` feature only.

use std::time::Duration;

use skein_core::event::{genesis_hash, Cancelled};
use skein_core::{Envelope, Event, Record, SessionId, Usage};

use crate::ports::{Backend, CacheEntry, Durability, RootResult};
use crate::{new_root_id, Error};

/// Why a check failed: the backend broke a property of its port, or a port call failed.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("property broken: {0}")]
    Broken(String),
    #[error("port call failed: {0}")]
    Port(#[from] Error),
    #[error("{check}: {failure}")]
    In {
        check: &'static str,
        #[source]
        failure: Box<Failure>,
    },
}

impl From<skein_core::Error> for Failure {
    fn from(e: skein_core::Error) -> Self {
        Failure::Port(Error::Core(e))
    }
}

pub type Result<T, E = Failure> = std::result::Result<T, E>;

fn ensure(cond: bool, what: impl Into<String>) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Failure::Broken(what.into()))
    }
}

fn record(session: &SessionId, seq: u64, prev: String, reason: &str) -> Result<Record> {
    let env = Envelope::new(
        session.clone(),
        seq,
        1_700_000_000_000 + seq,
        prev,
        Event::Cancelled(Cancelled {
            reason: reason.into(),
        }),
    );
    Ok(Record::decode(env.encode()?)?)
}

/// Appends `n` chained records to a fresh log and returns them.
async fn fill(b: &Backend, s: &SessionId, n: u64) -> Result<Vec<Record>> {
    let mut prev = genesis_hash(s);
    let mut out = vec![];
    for seq in 1..=n {
        let r = record(s, seq, prev, &format!("r{seq}"))?;
        b.log
            .append(s, seq - 1, std::slice::from_ref(&r), Durability::Now)
            .await?;
        prev = r.hash();
        out.push(r);
    }
    Ok(out)
}

pub async fn log_appends_and_reads(b: &Backend) -> Result<()> {
    let s = new_root_id();
    ensure(
        b.log.read(&s, 1).await?.is_empty(),
        "a new session has no records",
    )?;
    ensure(
        b.log.last(&s).await?.is_none(),
        "a new session has no last record",
    )?;
    let written = fill(b, &s, 5).await?;
    let read = b.log.read(&s, 1).await?;
    ensure(
        read.len() == 5,
        format!("read back {} of 5 records", read.len()),
    )?;
    for (w, r) in written.iter().zip(&read) {
        ensure(
            w.bytes == r.bytes,
            format!("record {} differs after a round trip", w.env.seq),
        )?;
    }
    let tail = b.log.read(&s, 4).await?;
    ensure(
        tail.iter().map(|r| r.env.seq).collect::<Vec<_>>() == vec![4, 5],
        "read from seq 4 returns 4 and 5",
    )?;
    let last = b.log.last(&s).await?;
    ensure(last.map(|r| r.env.seq) == Some(5), "last is seq 5")?;
    skein_core::event::verify_chain(&s, &read)
        .map_err(|e| Failure::Broken(format!("chain: {e:?}")))?;
    Ok(())
}

pub async fn log_refuses_a_stale_append(b: &Backend) -> Result<()> {
    let s = new_root_id();
    let written = fill(b, &s, 2).await?;
    let r = record(&s, 2, written[0].hash(), "racer")?;
    match b
        .log
        .append(&s, 1, std::slice::from_ref(&r), Durability::Now)
        .await
    {
        Err(Error::Conflict { actual, .. }) => ensure(actual == 2, "conflict reports seq 2")?,
        other => {
            return Err(Failure::Broken(format!(
                "expected a conflict, got {other:?}"
            )))
        }
    }
    let r = record(&s, 1, genesis_hash(&s), "dup")?;
    ensure(
        matches!(
            b.log
                .append(&s, 0, std::slice::from_ref(&r), Durability::Now)
                .await,
            Err(Error::Conflict { .. })
        ),
        "appending seq 1 again conflicts",
    )?;
    ensure(
        b.log.read(&s, 1).await?.len() == 2,
        "a refused append changes nothing",
    )?;
    Ok(())
}

/// Records chained after `prev`, seqs `first..first + n`.
fn chain(s: &SessionId, first: u64, n: u64, mut prev: String) -> Result<Vec<Record>> {
    let mut out = vec![];
    for seq in first..first + n {
        let r = record(s, seq, prev, &format!("b{seq}"))?;
        prev = r.hash();
        out.push(r);
    }
    Ok(out)
}

/// A batch longer than one NATS atomic batch (1,000 messages) lands whole and in order;
/// a batch after it follows on; a stale batch is refused and changes nothing.
pub async fn log_appends_batches(b: &Backend) -> Result<()> {
    let s = new_root_id();
    let first = fill(b, &s, 1).await?;
    let long = chain(&s, 2, 1_100, first[0].hash())?;
    b.log.append(&s, 1, &long, Durability::Now).await?;
    let next = chain(&s, 1_102, 2, long[long.len() - 1].hash())?;
    b.log.append(&s, 1_101, &next, Durability::Now).await?;
    let read = b.log.read(&s, 1).await?;
    ensure(
        read.len() == 1_103,
        format!("read back {} of 1,103 records", read.len()),
    )?;
    for (w, r) in first.iter().chain(&long).chain(&next).zip(&read) {
        ensure(
            w.bytes == r.bytes,
            format!("record {} differs after a batch", w.env.seq),
        )?;
    }
    skein_core::event::verify_chain(&s, &read)
        .map_err(|e| Failure::Broken(format!("chain: {e:?}")))?;
    let stale = chain(&s, 1_102, 3, long[long.len() - 1].hash())?;
    match b.log.append(&s, 1_101, &stale, Durability::Now).await {
        Err(Error::Conflict { actual, .. }) => ensure(
            actual == 1_103,
            format!("conflict reports seq {actual}, not 1,103"),
        )?,
        other => {
            return Err(Failure::Broken(format!(
                "a stale batch: expected a conflict, got {other:?}"
            )))
        }
    }
    let after = b.log.read(&s, 1_100).await?;
    ensure(
        after.iter().map(|r| r.env.seq).collect::<Vec<_>>() == vec![1_100, 1_101, 1_102, 1_103]
            && after[2].bytes == next[0].bytes
            && after[3].bytes == next[1].bytes,
        "a refused batch changes nothing",
    )?;
    Ok(())
}

/// Pipelined appends are read at once, follow on from each other and from durable
/// appends in order, and are numbered as any append: a stale one fails, at once or at the
/// session's next append, and changes nothing.
pub async fn log_pipelines_appends(b: &Backend) -> Result<()> {
    let s = new_root_id();
    let first = fill(b, &s, 1).await?;
    let piped = chain(&s, 2, 2, first[0].hash())?;
    b.log.append(&s, 1, &piped, Durability::Pipelined).await?;
    let read = b.log.read(&s, 1).await?;
    ensure(
        read.len() == 3 && read[1].bytes == piped[0].bytes && read[2].bytes == piped[1].bytes,
        format!(
            "read {} records after a pipelined append, not 3",
            read.len()
        ),
    )?;
    let again = chain(&s, 4, 1, piped[1].hash())?;
    b.log.append(&s, 3, &again, Durability::Pipelined).await?;
    let then = chain(&s, 5, 2, again[0].hash())?;
    b.log
        .append(&s, 4, &then[..1], Durability::Pipelined)
        .await?;
    b.log.append(&s, 5, &then[1..], Durability::Now).await?;
    let read = b.log.read(&s, 1).await?;
    ensure(
        read.len() == 6,
        format!("read {} records, not 6", read.len()),
    )?;
    for (w, r) in first
        .iter()
        .chain(&piped)
        .chain(&again)
        .chain(&then)
        .zip(&read)
    {
        ensure(
            w.bytes == r.bytes,
            format!("record {} differs after pipelined appends", w.env.seq),
        )?;
    }
    skein_core::event::verify_chain(&s, &read)
        .map_err(|e| Failure::Broken(format!("chain: {e:?}")))?;
    // Stale: seq 6 exists.
    let stale = chain(&s, 6, 1, then[0].hash())?;
    let refused = match b.log.append(&s, 5, &stale, Durability::Pipelined).await {
        Err(e) => Err(e),
        Ok(()) => {
            let next = chain(&s, 7, 1, stale[0].hash())?;
            b.log
                .append(&s, 6, std::slice::from_ref(&next[0]), Durability::Now)
                .await
        }
    };
    ensure(
        matches!(refused, Err(Error::Conflict { .. })),
        format!("a stale pipelined append: expected a conflict, got {refused:?}"),
    )?;
    let after = b.log.read(&s, 1).await?;
    ensure(
        after.len() == 6 && after[5].bytes == then[1].bytes,
        "a refused pipelined append changes nothing",
    )?;
    Ok(())
}

pub async fn log_lists_trees_and_roots(b: &Backend) -> Result<()> {
    let root = new_root_id();
    let a = root.child("researcher", 1);
    let a1 = a.child("critic", 1);
    let other = new_root_id();
    for s in [&root, &a, &a1, &other] {
        fill(b, s, 1).await?;
    }
    let tree = b.log.tree(&root).await?;
    ensure(
        tree == vec![root.clone(), a.clone(), a1.clone()],
        format!("tree of root: {tree:?}"),
    )?;
    let sub = b.subtree(&a).await?;
    ensure(
        sub == vec![a.clone(), a1.clone()],
        format!("subtree of a child: {sub:?}"),
    )?;
    let unknown = root.child("nobody", 9);
    ensure(
        matches!(b.subtree(&unknown).await, Err(Error::NotFound(_))),
        "the subtree of an unknown session is not found",
    )?;
    let roots = b.log.roots().await?;
    ensure(
        roots.contains(&root) && roots.contains(&other),
        "both roots listed",
    )?;
    ensure(roots.iter().all(|r| r.is_root()), "roots lists only roots")?;
    // Both roots ended (their records are cancellations): not open, and each in the pages
    // of cancelled roots once.
    let open = b.log.open_roots().await?;
    ensure(
        !open.contains(&root) && !open.contains(&other),
        "ended roots are not open",
    )?;
    let filter = crate::ports::roots::RootFilter {
        status: Some("cancelled".into()),
        ..Default::default()
    };
    let (mut seen, mut cursor) = (vec![], None);
    loop {
        let page = b.log.roots_page(&filter, 100, cursor.as_deref()).await?;
        seen.extend(page.roots.into_iter().map(|s| s.root));
        match page.next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    for r in [&root, &other] {
        let n = seen.iter().filter(|s| **s == r.to_string()).count();
        ensure(n == 1, format!("{r} listed {n} times in the pages"))?;
    }
    Ok(())
}

/// A record of `session` at `seq` and time `at`: a cancellation when `ends`, else a tool
/// result (which leaves the session open).
fn record_at(session: &SessionId, seq: u64, at: u64, prev: String, ends: bool) -> Result<Record> {
    let body = if ends {
        Event::Cancelled(Cancelled {
            reason: "done".into(),
        })
    } else {
        Event::tool_result("call", "output", false)
    };
    let env = Envelope::new(session.clone(), seq, at, prev, body);
    Ok(Record::decode(env.encode()?)?)
}

/// Pages of roots follow their start order across pages and filters, and the open roots
/// follow each root's last record, including a root that ended after it was submitted.
/// A tree read together ([`EventLog::read_tree`](crate::ports::EventLog::read_tree)), by a
/// backend that does, gives each session's log as a read of it from seq 1 does: for the
/// whole tree, for a part of it in another order, and for a subtree; a session named but
/// never written reads as empty. Wide enough (300 sessions) for any backend's one pass.
pub async fn log_reads_a_tree_together(b: &Backend) -> Result<()> {
    let root = new_root_id();
    let mut ids = vec![root.clone()];
    let a = root.child("lead", 1);
    ids.push(a.clone());
    for n in 1..=150 {
        ids.push(root.child("part", n));
        ids.push(a.child("sub", n));
    }
    // Written in rounds, so that the sessions' records interleave.
    let mut heads: Vec<(u64, String)> = ids.iter().map(|s| (0, genesis_hash(s))).collect();
    for round in 0..3u64 {
        for (s, (seq, prev)) in ids.iter().zip(heads.iter_mut()) {
            if round > 0 && s.as_str().len() % 2 == 0 {
                continue;
            }
            let r = record(s, *seq + 1, prev.clone(), &format!("{s} {round}"))?;
            b.log
                .append(s, *seq, std::slice::from_ref(&r), Durability::Now)
                .await?;
            *seq += 1;
            *prev = r.hash();
        }
    }
    let never = root.child("never", 1);
    ids.push(never.clone());
    ids.sort();
    let whole = b.log.read_tree(&root, &ids).await?;
    if let Some(logs) = &whole {
        let at = ids.iter().position(|s| *s == never).unwrap_or(0);
        ensure(
            logs.get(at).is_some_and(|l| l.is_empty()),
            "a session never written reads as empty",
        )?;
    }
    read_as_alone(b, &ids, whole).await?;
    let part: Vec<SessionId> = ids.iter().rev().step_by(2).cloned().collect();
    read_as_alone(b, &part, b.log.read_tree(&root, &part).await?).await?;
    let sub: Vec<SessionId> = ids.iter().filter(|s| a.contains(s)).cloned().collect();
    read_as_alone(b, &sub, b.log.read_tree(&root, &sub).await?).await?;
    Ok(())
}

/// Whether `got`, logs read together for `asked` (if the backend read them so), are each
/// what a read of that log alone gives.
async fn read_as_alone(
    b: &Backend,
    asked: &[SessionId],
    got: Option<Vec<Vec<Record>>>,
) -> Result<()> {
    let Some(logs) = got else { return Ok(()) };
    ensure(logs.len() == asked.len(), "a log for each session asked")?;
    let hashes = |v: &[Record]| v.iter().map(|r| r.hash()).collect::<Vec<_>>();
    for (s, log) in asked.iter().zip(&logs) {
        let one = b.log.read(s, 1).await?;
        ensure(
            hashes(log) == hashes(&one),
            format!("{s}: read together, not as read alone"),
        )?;
    }
    Ok(())
}

pub async fn log_pages_roots_and_lists_open_ones(b: &Backend) -> Result<()> {
    // Start times of their own (far from the other checks'), one second apart.
    let salt = new_root_id()
        .as_str()
        .bytes()
        .fold(0u64, |h, c| h.wrapping_mul(31).wrapping_add(u64::from(c)));
    let t0 = 1_800_000_000_000 + (salt % 1_000_000_000) * 16;
    let roots: Vec<SessionId> = (0..5).map(|_| new_root_id()).collect();
    let mut firsts = vec![];
    for (i, r) in roots.iter().enumerate() {
        // Roots 2 and 4 start open; the others end with their first record.
        let ends = i != 2 && i != 4;
        let rec = record_at(r, 1, t0 + i as u64 * 1000, genesis_hash(r), ends)?;
        b.log
            .append(r, 0, std::slice::from_ref(&rec), Durability::Now)
            .await?;
        firsts.push(rec);
    }
    // Root 4 ends later.
    let end = record_at(&roots[4], 2, t0 + 9000, firsts[4].hash(), true)?;
    b.log
        .append(&roots[4], 1, std::slice::from_ref(&end), Durability::Now)
        .await?;

    let mine = crate::ports::roots::RootFilter {
        since: Some(t0),
        until: Some(t0 + 5000),
        ..Default::default()
    };
    let ids = |p: &crate::ports::roots::RootsPage| {
        p.roots.iter().map(|s| s.root.clone()).collect::<Vec<_>>()
    };
    let name = |i: usize| roots[i].to_string();
    let one = b.log.roots_page(&mine, 2, None).await?;
    ensure(
        ids(&one) == [name(4), name(3)],
        format!("first page: {:?}", ids(&one)),
    )?;
    let two = b.log.roots_page(&mine, 2, one.next.as_deref()).await?;
    ensure(
        ids(&two) == [name(2), name(1)],
        format!("second page: {:?}", ids(&two)),
    )?;
    let three = b.log.roots_page(&mine, 2, two.next.as_deref()).await?;
    ensure(
        ids(&three) == [name(0)] && three.next.is_none(),
        format!("last page: {:?} then {:?}", ids(&three), three.next),
    )?;
    // A range's start is in it, its end is not.
    let inner = crate::ports::roots::RootFilter {
        since: Some(t0 + 1000),
        until: Some(t0 + 3000),
        ..Default::default()
    };
    let middle = b.log.roots_page(&inner, 10, None).await?;
    ensure(
        ids(&middle) == [name(2), name(1)] && middle.next.is_none(),
        format!("roots started in [t0+1s, t0+3s): {:?}", ids(&middle)),
    )?;
    let ended = b
        .log
        .roots_page(
            &crate::ports::roots::RootFilter {
                status: Some("cancelled".into()),
                ..mine.clone()
            },
            10,
            None,
        )
        .await?;
    ensure(
        ids(&ended) == [name(4), name(3), name(1), name(0)],
        format!("cancelled roots: {:?}", ids(&ended)),
    )?;
    let four = &one.roots[0];
    ensure(
        four.last_seq == 2 && four.updated_at == t0 + 9000 && four.started_at == t0 + 4000,
        format!("the summary of a root that ended later: {four:?}"),
    )?;
    let open = b.log.open_roots().await?;
    ensure(
        open.contains(&roots[2]) && !open.contains(&roots[4]) && !open.contains(&roots[0]),
        format!("open roots: {open:?}"),
    )?;
    Ok(())
}

pub async fn jobs_claim_ack_and_coalesce(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let s = new_root_id();
    b.jobs.push(&pool, &s).await?;
    b.jobs.push(&pool, &s).await?;
    let wait = Duration::from_millis(500);
    let j = b.jobs.claim(&pool, wait).await?;
    let j = j.ok_or_else(|| Failure::Broken("no job claimed".into()))?;
    ensure(j.session == s && j.attempt == 1, format!("claimed {j:?}"))?;
    ensure(
        b.jobs
            .claim(&pool, Duration::from_millis(200))
            .await?
            .is_none(),
        "two pushes of a waiting session make one job",
    )?;
    // A push while held: the session runs again after the ack.
    b.jobs.push(&pool, &s).await?;
    b.jobs.heartbeat(&j).await?;
    b.jobs.ack(&j).await?;
    let again = b.jobs.claim(&pool, Duration::from_secs(3)).await?;
    ensure(
        again.as_ref().map(|j| &j.session) == Some(&s),
        "a push while held is delivered after the ack",
    )?;
    if let Some(j) = again {
        b.jobs.ack(&j).await?;
    }
    ensure(
        b.jobs
            .claim(&pool, Duration::from_millis(200))
            .await?
            .is_none(),
        "nothing left after the acks",
    )?;
    Ok(())
}

/// The job of an ended session, acked as such, is acked as any other: a push made right
/// after runs the session again, and so does one made while it was held.
pub async fn jobs_of_ended_sessions_are_acked_and_woken_again(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let s = new_root_id();
    let claim = |what: &'static str| {
        let pool = pool.clone();
        let s = s.clone();
        async move {
            let j = b.jobs.claim(&pool, Duration::from_secs(5)).await?;
            match j {
                Some(j) if j.session == s => Ok(j),
                other => Err(Failure::Broken(format!("{what}: claimed {other:?}"))),
            }
        }
    };
    b.jobs.push(&pool, &s).await?;
    let j = claim("the first push").await?;
    b.jobs.ack_ended(&j).await?;
    b.jobs.push(&pool, &s).await?;
    let j = claim("a push right after the ack of an ended session").await?;
    b.jobs.push(&pool, &s).await?;
    b.jobs.ack_ended(&j).await?;
    let j = claim("a push while an ended session's job was held").await?;
    b.jobs.ack_ended(&j).await?;
    ensure(
        b.jobs
            .claim(&pool, Duration::from_millis(300))
            .await?
            .is_none(),
        "nothing left after the acks",
    )?;
    depth_comes_to(b, &pool, 0, "an ended session's acked job is not counted").await?;
    Ok(())
}

/// A job acked as its session's last (`ack_final`) is not delivered again, nor counted;
/// a backend may drop the session's later pushes, but the push of an ended session that a
/// sweep makes (`push_ended`) always runs it once more.
pub async fn jobs_of_sessions_ended_for_good_run_again_only_when_swept(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let s = new_root_id();
    let claimed = |what: &'static str, j: Option<crate::ports::Job>| match j {
        Some(j) if j.session == s => Ok(j),
        other => Err(Failure::Broken(format!("{what}: claimed {other:?}"))),
    };
    b.jobs.push(&pool, &s).await?;
    let j = claimed(
        "the first push",
        b.jobs.claim(&pool, Duration::from_secs(5)).await?,
    )?;
    b.jobs.ack_final(&j).await?;
    // A gauge (see `depth_comes_to`): NATS counts an ack when its consumer has taken it,
    // a moment after the ack is sent.
    depth_comes_to(
        b,
        &pool,
        0,
        "a job acked as its session's last is not counted",
    )
    .await?;
    b.jobs.push_ended(&pool, &s).await?;
    let j = claimed(
        "a sweep's push after the last ack",
        b.jobs.claim(&pool, Duration::from_secs(5)).await?,
    )?;
    b.jobs.ack_final(&j).await?;
    ensure(
        b.jobs
            .claim(&pool, Duration::from_millis(300))
            .await?
            .is_none(),
        "a job acked as its session's last is not delivered again",
    )?;
    Ok(())
}

pub async fn jobs_redeliver_after_lease_and_retry(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let s = new_root_id();
    b.jobs.push(&pool, &s).await?;
    let j = b.jobs.claim(&pool, Duration::from_secs(1)).await?;
    ensure(j.is_some(), "claimed")?;
    // Not acked: after the lease the job is delivered again, as a later attempt. (The
    // suite's backends are opened with a lease of about a second.)
    let j2 = b.jobs.claim(&pool, Duration::from_secs(5)).await?;
    let j2 = j2.ok_or_else(|| Failure::Broken("no redelivery after lease".into()))?;
    ensure(
        j2.session == s && j2.attempt == 2,
        format!("redelivered as {j2:?}"),
    )?;
    b.jobs.retry(&j2, Duration::from_millis(100)).await?;
    let j3 = b.jobs.claim(&pool, Duration::from_secs(5)).await?;
    let j3 = j3.ok_or_else(|| Failure::Broken("no delivery after retry".into()))?;
    ensure(
        j3.attempt == 3,
        format!("retry counts as attempt 3: {j3:?}"),
    )?;
    b.jobs.ack(&j3).await?;
    Ok(())
}

pub async fn cache_gets_puts_and_expires(b: &Backend) -> Result<()> {
    let h = blake3::hash(new_root_id().as_str().as_bytes())
        .to_hex()
        .to_string();
    ensure(b.cache.get(&h, 1000).await?.is_none(), "miss on a new hash")?;
    let e = CacheEntry {
        answer: "42".into(),
        usage: Usage {
            input_tokens: 3,
            output_tokens: 4,
            cost: 0.5,
            estimated: false,
            ..Default::default()
        },
        source: new_root_id(),
        steps: 2,
        created: 1000,
        expires: Some(2000),
    };
    b.cache.put(&h, &e).await?;
    ensure(
        b.cache.get(&h, 1500).await?.as_ref() == Some(&e),
        "hit before expiry",
    )?;
    ensure(b.cache.get(&h, 2500).await?.is_none(), "miss after expiry")?;
    Ok(())
}

pub async fn blobs_are_content_addressed(b: &Backend) -> Result<()> {
    let data = format!("blob {}", new_root_id()).into_bytes();
    let h = b.blobs.put(&data).await?;
    ensure(
        h == blake3::hash(&data).to_hex().to_string(),
        "hash is blake3 of the data",
    )?;
    ensure(b.blobs.put(&data).await? == h, "putting twice is harmless")?;
    ensure(
        b.blobs.get(&h).await?.as_deref() == Some(&data[..]),
        "get returns the data",
    )?;
    let missing = blake3::hash(b"never stored").to_hex().to_string();
    ensure(
        b.blobs.get(&missing).await?.is_none(),
        "unknown hash is none",
    )?;
    let big = vec![7u8; 3 * 1024 * 1024];
    let hb = b.blobs.put(&big).await?;
    ensure(
        b.blobs.get(&hb).await?.map(|v| v.len()) == Some(big.len()),
        "3 MiB blob",
    )?;
    Ok(())
}

pub async fn notices_read_after_a_cursor(b: &Backend) -> Result<()> {
    let p = new_root_id();
    let c1 = p.child("a", 1);
    let c2 = p.child("b", 2);
    ensure(b.notices.read(&p, 0).await?.is_empty(), "no notices yet")?;
    b.notices.post(&p, &c1).await?;
    b.notices.post(&p, &c2).await?;
    let all = b.notices.read(&p, 0).await?;
    ensure(
        all.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>() == vec![c1, c2.clone()],
        format!("both notices in order: {all:?}"),
    )?;
    let after = b.notices.read(&p, all[0].0).await?;
    ensure(
        after.len() == 1 && after[0].1 == c2,
        "read after the first cursor",
    )?;
    ensure(
        b.notices.read(&p, all[1].0).await?.is_empty(),
        "nothing after the last cursor",
    )?;
    ensure(
        b.notices.read(&new_root_id(), 0).await?.is_empty(),
        "notices are per parent",
    )?;
    Ok(())
}

/// A notice posted before a wake-up is read by whoever claims that wake-up: what a parent
/// relies on when it settles the children named by its notices (and, on a backend whose
/// notices are in step with its wake-ups, on them alone).
pub async fn a_notice_is_read_by_the_claimer_of_its_wake(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let p = new_root_id();
    let c = p.child("a", 1);
    b.notices.post(&p, &c).await?;
    b.jobs.push(&pool, &p).await?;
    let j = b
        .jobs
        .claim(&pool, Duration::from_secs(3))
        .await?
        .ok_or_else(|| Failure::Broken("no job claimed".into()))?;
    ensure(j.session == p, format!("claimed {j:?}"))?;
    let read = b.notices.read(&p, 0).await?;
    ensure(
        read.iter().map(|(_, x)| x).eq([&c]),
        format!("the notice read by the claimer: {read:?}"),
    )?;
    b.jobs.ack(&j).await?;
    Ok(())
}

/// Long logs and many notices read whole and in order, from the start or from the middle
/// (a backend may read a long tail differently from a short one).
pub async fn long_reads_are_whole_and_ordered(b: &Backend) -> Result<()> {
    let s = new_root_id();
    let written = fill(b, &s, 300).await?;
    let read = b.log.read(&s, 1).await?;
    ensure(
        read.len() == 300,
        format!("read back {} of 300 records", read.len()),
    )?;
    ensure(
        read.iter().zip(&written).all(|(r, w)| r.bytes == w.bytes),
        "every record as written, in order",
    )?;
    let tail = b.log.read(&s, 251).await?;
    ensure(
        tail.iter().map(|r| r.env.seq).collect::<Vec<_>>() == (251..=300).collect::<Vec<_>>(),
        "read from seq 251 returns 251..=300",
    )?;
    ensure(
        b.log.read(&s, 301).await?.is_empty(),
        "nothing after the last",
    )?;
    let p = new_root_id();
    let children: Vec<SessionId> = (1..=200).map(|i| p.child("c", i)).collect();
    for c in &children {
        b.notices.post(&p, c).await?;
    }
    let all = b.notices.read(&p, 0).await?;
    ensure(
        all.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>() == children,
        format!("200 notices in order, read {}", all.len()),
    )?;
    let after = b.notices.read(&p, all[149].0).await?;
    ensure(
        after.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>() == children[150..],
        format!("50 notices after the 150th cursor, read {}", after.len()),
    )?;
    Ok(())
}

/// Notices of one parent posted among another's, in runs of different lengths, read whole
/// and in order from every cursor: a backend may read the notices between the first new
/// one and the last differently when few stream positions lie between them (children that
/// ended together) than when many do.
pub async fn notices_among_others_read_whole_from_every_cursor(b: &Backend) -> Result<()> {
    let (p, q) = (new_root_id(), new_root_id());
    let mut mine = vec![];
    for i in 1..=40u32 {
        let c = p.child("c", i);
        b.notices.post(&p, &c).await?;
        mine.push(c);
        // Between two of the parent's notices: none, one, or a run long enough that the
        // gap alone is wider than a read that gets each position at once would take.
        let others = match i % 7 {
            0 => 20,
            k => k % 3,
        };
        for j in 0..others {
            b.notices.post(&q, &q.child("o", i * 100 + j)).await?;
        }
    }
    let all = b.notices.read(&p, 0).await?;
    ensure(
        all.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>() == mine,
        format!("40 notices in order among others, read {}", all.len()),
    )?;
    for (k, (cursor, _)) in all.iter().enumerate() {
        let after = b.notices.read(&p, *cursor).await?;
        ensure(
            after == all[k + 1..],
            format!(
                "after the notice at {cursor} (the {}th): {} of {} read, in order and once each",
                k + 1,
                after.len(),
                all.len() - k - 1
            ),
        )?;
    }
    Ok(())
}

pub async fn inflight_is_single_flight(b: &Backend) -> Result<()> {
    let h = blake3::hash(new_root_id().as_str().as_bytes())
        .to_hex()
        .to_string();
    let (a, c) = (new_root_id(), new_root_id());
    ensure(
        b.cache.claim_inflight(&h, &a).await?.is_none(),
        "first claim wins",
    )?;
    ensure(
        b.cache.claim_inflight(&h, &a).await?.is_none(),
        "the holder claims again",
    )?;
    ensure(
        b.cache.claim_inflight(&h, &c).await? == Some(a.clone()),
        "second sees the first",
    )?;
    b.cache.release_inflight(&h, &c).await?;
    ensure(
        b.cache.claim_inflight(&h, &c).await? == Some(a.clone()),
        "only the holder releases",
    )?;
    b.cache.release_inflight(&h, &a).await?;
    ensure(
        b.cache.claim_inflight(&h, &c).await?.is_none(),
        "free after release",
    )?;
    Ok(())
}

pub async fn watchers_are_listed(b: &Backend) -> Result<()> {
    let t = new_root_id();
    let (w1, w2) = (new_root_id(), new_root_id().child("x", 1));
    ensure(b.notices.watchers(&t).await?.is_empty(), "no watchers yet")?;
    b.notices.watch(&t, &w1, "default").await?;
    b.notices.watch(&t, &w2, "gpu").await?;
    b.notices.watch(&t, &w1, "default").await?;
    let mut got = b.notices.watchers(&t).await?;
    got.sort();
    let mut want = vec![(w1, "default".to_string()), (w2, "gpu".to_string())];
    want.sort();
    ensure(got == want, format!("watchers: {got:?}"))?;
    Ok(())
}

/// Records appended ahead are read at once and numbered as any append; a durable append
/// after them follows on; a stale one is refused and changes nothing. An append of no
/// records does nothing, whatever its durability.
pub async fn log_appends_ahead(b: &Backend) -> Result<()> {
    let s = new_root_id();
    let first = fill(b, &s, 1).await?;
    let ahead = chain(&s, 2, 2, first[0].hash())?;
    b.log.append(&s, 1, &ahead, Durability::Ahead).await?;
    let read = b.log.read(&s, 1).await?;
    ensure(
        read.len() == 3 && read[1].bytes == ahead[0].bytes && read[2].bytes == ahead[1].bytes,
        format!("read {} records after an append ahead, not 3", read.len()),
    )?;
    let next = chain(&s, 4, 1, ahead[1].hash())?;
    b.log.append(&s, 3, &next, Durability::Now).await?;
    let stale = chain(&s, 4, 1, ahead[1].hash())?;
    match b.log.append(&s, 3, &stale, Durability::Ahead).await {
        Err(Error::Conflict { actual, .. }) => {
            ensure(actual == 4, format!("conflict reports seq {actual}, not 4"))?
        }
        other => {
            return Err(Failure::Broken(format!(
                "a stale append ahead: expected a conflict, got {other:?}"
            )))
        }
    }
    for d in [Durability::Now, Durability::Ahead, Durability::Pipelined] {
        b.log.append(&s, 4, &[], d).await?;
    }
    let after = b.log.read(&s, 1).await?;
    ensure(
        after.len() == 4 && after[3].bytes == next[0].bytes,
        format!(
            "a refused or empty append changes nothing: read {} records",
            after.len()
        ),
    )?;
    skein_core::event::verify_chain(&s, &after)
        .map_err(|e| Failure::Broken(format!("chain: {e:?}")))?;
    Ok(())
}

/// `depth` counts a pool's jobs waiting or held, and no other pool's.
pub async fn jobs_are_counted(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let other = format!("{pool}x");
    depth_comes_to(b, &pool, 0, "a new pool is empty").await?;
    let (s, t) = (new_root_id(), new_root_id());
    b.jobs.push(&pool, &s).await?;
    b.jobs.push(&pool, &t).await?;
    b.jobs.push(&other, &t).await?;
    depth_comes_to(b, &pool, 2, "two sessions pushed").await?;
    let j = b
        .jobs
        .claim(&pool, Duration::from_secs(3))
        .await?
        .ok_or_else(|| Failure::Broken("no job claimed".into()))?;
    depth_comes_to(b, &pool, 2, "a held job still counts").await?;
    b.jobs.ack(&j).await?;
    depth_comes_to(b, &pool, 1, "one acked").await?;
    depth_comes_to(b, &other, 1, "the other pool").await?;
    Ok(())
}

/// A pool's depth is a gauge, and a backend may count a push or an ack a moment after
/// it returns (a NATS consumer's pending count follows the stream as the server signals
/// it, not within the publish's ack). So the depth must come to `want` within five
/// seconds, and stay there once it has.
async fn depth_comes_to(b: &Backend, pool: &str, want: u64, what: &str) -> Result<()> {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut depth = b.jobs.depth(pool).await?;
    while depth != want && tokio::time::Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
        depth = b.jobs.depth(pool).await?;
    }
    ensure(depth == want, format!("{what}: depth {depth}, not {want}"))?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let later = b.jobs.depth(pool).await?;
    ensure(
        later == want,
        format!("{what}: depth came to {want}, then went to {later}"),
    )
}

/// Where claimed ([`Capabilities::claim_matching`](crate::ports::Capabilities)), a
/// matching claim takes only a chosen session's job and leaves the others as they were,
/// and the matching depth counts only theirs; elsewhere both are refused as unsupported.
pub async fn jobs_claim_matching(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let (s, t) = (new_root_id(), new_root_id());
    let only_t = {
        let t = t.clone();
        move |x: &SessionId| *x == t
    };
    if !b.capabilities().claim_matching {
        let claimed = b
            .jobs
            .claim_matching(&pool, Duration::from_millis(100), &only_t)
            .await;
        let counted = b.jobs.depth_matching(&pool, &only_t).await;
        let unsupported = |r: std::result::Result<(), Error>| {
            matches!(
                r,
                Err(Error::Refused {
                    kind: crate::RefusalKind::Unsupported,
                    ..
                })
            )
        };
        ensure(
            unsupported(claimed.map(drop)) && unsupported(counted.map(drop)),
            "a backend that does not claim claim_matching refuses it as unsupported",
        )?;
        return Ok(());
    }
    b.jobs.push(&pool, &s).await?;
    b.jobs.push(&pool, &t).await?;
    let depth = b.jobs.depth_matching(&pool, &only_t).await?;
    ensure(depth == 1, format!("one job matches, depth {depth}"))?;
    let none = |_: &SessionId| false;
    ensure(
        b.jobs
            .claim_matching(&pool, Duration::from_millis(200), &none)
            .await?
            .is_none(),
        "a filter that accepts nothing claims nothing",
    )?;
    let j = b
        .jobs
        .claim_matching(&pool, Duration::from_secs(3), &only_t)
        .await?
        .ok_or_else(|| Failure::Broken("the matching job was not claimed".into()))?;
    ensure(
        j.session == t && j.attempt == 1,
        format!("claimed {j:?}, not {t}'s first attempt"),
    )?;
    b.jobs.ack(&j).await?;
    let j = b
        .jobs
        .claim(&pool, Duration::from_secs(3))
        .await?
        .ok_or_else(|| Failure::Broken("the other job is gone".into()))?;
    ensure(
        j.session == s && j.attempt == 1,
        format!("the job passed over was touched: {j:?}"),
    )?;
    b.jobs.ack(&j).await?;
    Ok(())
}

/// Where claimed ([`Capabilities::notices_in_step_with_wakes`](crate::ports::Capabilities)),
/// every notice posted before a wake-up is there for the wake-up's claimer, round after
/// round with no pause between them.
pub async fn notices_in_step_with_wakes(b: &Backend) -> Result<()> {
    if !b.capabilities().notices_in_step_with_wakes {
        return Ok(());
    }
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let p = new_root_id();
    let mut cursor = 0;
    for i in 1..=20 {
        let c = p.child("a", i);
        b.notices.post(&p, &c).await?;
        b.jobs.push(&pool, &p).await?;
        let j = b
            .jobs
            .claim(&pool, Duration::from_secs(3))
            .await?
            .ok_or_else(|| Failure::Broken(format!("round {i}: no job claimed")))?;
        let read = b.notices.read(&p, cursor).await?;
        ensure(
            read.iter().map(|(_, x)| x).eq([&c]),
            format!("round {i}: the claimer read {read:?}"),
        )?;
        cursor = read[0].0;
        b.jobs.ack(&j).await?;
    }
    Ok(())
}

/// Where claimed ([`Capabilities::notices_outlive_workers`](crate::ports::Capabilities)),
/// notices and watchers posted through one worker's backend are read whole through another
/// opened after the first is gone. `reopen` opens that other one on the same store.
pub async fn notices_outlive_workers<F>(first: Backend, reopen: F) -> Result<()>
where
    F: std::future::Future<Output = Backend>,
{
    if !first.capabilities().notices_outlive_workers {
        return Ok(());
    }
    let p = new_root_id();
    let (c1, c2) = (p.child("a", 1), p.child("b", 2));
    first.notices.post(&p, &c1).await?;
    first.notices.post(&p, &c2).await?;
    first.notices.watch(&c1, &p, "default").await?;
    drop(first);
    let second = reopen.await;
    let read = second.notices.read(&p, 0).await?;
    ensure(
        read.iter().map(|(_, c)| c).eq([&c1, &c2]),
        format!("another worker read {read:?}"),
    )?;
    let watchers = second.notices.watchers(&c1).await?;
    ensure(
        watchers == vec![(p, "default".to_string())],
        format!("another worker listed watchers {watchers:?}"),
    )?;
    Ok(())
}

/// Each tree has a workspace of its own, the same one each time it is asked for.
pub async fn workspaces_are_per_tree(b: &Backend) -> Result<()> {
    let (r1, r2) = (new_root_id(), new_root_id());
    let w1 = b.workspaces.for_tree(&r1);
    let data = format!("written in {r1}").into_bytes();
    w1.write("notes/a.txt", &data)
        .await
        .map_err(|e| Failure::Broken(format!("write to a tree's workspace: {e}")))?;
    let again = b.workspaces.for_tree(&r1);
    let read = again
        .read("notes/a.txt")
        .await
        .map_err(|e| Failure::Broken(format!("read back from the tree's workspace: {e}")))?;
    ensure(
        read == data,
        "the tree's workspace returns what was written",
    )?;
    let listed = again
        .list("notes")
        .await
        .map_err(|e| Failure::Broken(format!("list the tree's workspace: {e}")))?;
    ensure(
        listed.len() == 1,
        format!("the tree's workspace lists {} entries, not 1", listed.len()),
    )?;
    ensure(
        b.workspaces
            .for_tree(&r2)
            .read("notes/a.txt")
            .await
            .is_err(),
        "another tree's workspace does not have the file",
    )?;
    Ok(())
}

/// Where there is an announcer, each ending of a root is announced once, and the last
/// announced is the latest ending: announcing one again, or an earlier one, changes
/// nothing.
pub async fn announcer_announces_each_ending_once(b: &Backend) -> Result<()> {
    let Some(a) = &b.announcer else {
        return Ok(());
    };
    let root = new_root_id();
    ensure(
        a.last_announced(&root).await?.is_none(),
        "a root that never ended has no result",
    )?;
    let ending = |seq: u64, answer: &str| RootResult {
        session: root.to_string(),
        seq,
        status: skein_core::Status::Completed,
        answer: Some(answer.into()),
        error: None,
        usage: Usage::default(),
    };
    let (first, later) = (ending(5, "first"), ending(9, "later"));
    a.root_finished(&first).await?;
    a.root_finished(&first).await?;
    ensure(
        a.last_announced(&root).await?.as_ref() == Some(&first),
        "the first ending is announced",
    )?;
    a.root_finished(&later).await?;
    a.root_finished(&first).await?;
    let last = a.last_announced(&root).await?;
    ensure(
        last.as_ref() == Some(&later),
        format!("the latest ending is the last announced: {last:?}"),
    )?;
    Ok(())
}

/// A heartbeat, ack or retry of a job the queue does not hold (never claimed, or acked
/// already) is an error, never a silent success.
pub async fn jobs_refuse_what_they_do_not_hold(b: &Backend) -> Result<()> {
    let pool = format!("conf{}", &new_root_id().as_str()[20..]);
    let s = new_root_id();
    b.jobs.push(&pool, &s).await?;
    let j = b
        .jobs
        .claim(&pool, Duration::from_secs(3))
        .await?
        .ok_or_else(|| Failure::Broken("no job claimed".into()))?;
    let forged = crate::ports::Job {
        pool: pool.clone(),
        session: new_root_id(),
        attempt: 1,
        handle: j.handle.clone(),
        lease: None,
    };
    ensure(
        b.jobs.heartbeat(&forged).await.is_err(),
        "a heartbeat of a job never claimed is an error",
    )?;
    ensure(
        b.jobs.retry(&forged, Duration::ZERO).await.is_err(),
        "a retry of a job never claimed is an error",
    )?;
    b.jobs.heartbeat(&j).await?;
    b.jobs.ack(&j).await?;
    ensure(
        b.jobs.heartbeat(&j).await.is_err(),
        "a heartbeat of an acked job is an error",
    )?;
    ensure(
        b.jobs.ack(&j).await.is_err(),
        "a second ack of a job is an error",
    )?;
    Ok(())
}

/// Every check, in order; the first failure is returned with its name.
pub async fn run_all(b: &Backend) -> Result<()> {
    macro_rules! check {
        ($f:ident) => {
            $f(b).await.map_err(|e| Failure::In {
                check: stringify!($f),
                failure: Box::new(e),
            })?
        };
    }
    check!(log_appends_and_reads);
    check!(log_refuses_a_stale_append);
    check!(log_appends_batches);
    check!(log_pipelines_appends);
    check!(log_lists_trees_and_roots);
    check!(log_reads_a_tree_together);
    check!(log_pages_roots_and_lists_open_ones);
    check!(jobs_claim_ack_and_coalesce);
    check!(jobs_of_ended_sessions_are_acked_and_woken_again);
    check!(jobs_of_sessions_ended_for_good_run_again_only_when_swept);
    check!(jobs_redeliver_after_lease_and_retry);
    check!(cache_gets_puts_and_expires);
    check!(blobs_are_content_addressed);
    check!(notices_read_after_a_cursor);
    check!(a_notice_is_read_by_the_claimer_of_its_wake);
    check!(long_reads_are_whole_and_ordered);
    check!(notices_among_others_read_whole_from_every_cursor);
    check!(inflight_is_single_flight);
    check!(watchers_are_listed);
    check!(log_appends_ahead);
    check!(jobs_are_counted);
    check!(jobs_claim_matching);
    check!(notices_in_step_with_wakes);
    check!(workspaces_are_per_tree);
    check!(announcer_announces_each_ending_once);
    check!(jobs_refuse_what_they_do_not_hold);
    Ok(())
}

/// One `#[tokio::test]` per check of the suite, in the calling module. `$setup` is an
/// async fn returning `(guard, Backend)`: the guard (a server, a temporary directory) is
/// kept alive while the check runs.
#[macro_export]
macro_rules! conformance_tests {
    ($setup:path) => {
        $crate::conformance_tests!(@each $setup; log_appends_and_reads, log_refuses_a_stale_append, log_appends_batches, log_pipelines_appends, log_lists_trees_and_roots, log_reads_a_tree_together, log_pages_roots_and_lists_open_ones, jobs_claim_ack_and_coalesce, jobs_of_ended_sessions_are_acked_and_woken_again, jobs_of_sessions_ended_for_good_run_again_only_when_swept, jobs_redeliver_after_lease_and_retry, cache_gets_puts_and_expires, blobs_are_content_addressed, notices_read_after_a_cursor, a_notice_is_read_by_the_claimer_of_its_wake, long_reads_are_whole_and_ordered, notices_among_others_read_whole_from_every_cursor, inflight_is_single_flight, watchers_are_listed, log_appends_ahead, jobs_are_counted, jobs_claim_matching, notices_in_step_with_wakes, workspaces_are_per_tree, announcer_announces_each_ending_once, jobs_refuse_what_they_do_not_hold);
    };
    (@each $setup:path; $($check:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let (_guard, backend) = $setup().await;
                if let Err(e) = $crate::conformance::$check(&backend).await {
                    panic!("{}: {e}", stringify!($check));
                }
            }
        )*
    };
}
