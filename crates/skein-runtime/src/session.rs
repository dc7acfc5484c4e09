//! The session repository: a session's folded state ([`Folded`]), the cache of folds a
//! worker keeps between jobs, and the only ways a log is written — sealed, hash-chained
//! records appended under the log's optimistic concurrency, by the holder of the
//! session's job ([`Runtime::append_all`]) or from outside it
//! ([`Runtime::append_from_outside`]: answers, approvals, cancels, plan verdicts).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use skein_core::event::{genesis_hash, Submitted};
use skein_core::{AgentDef, Envelope, Event, Record, SessionId, SessionState};

use crate::ports::Durability;
use crate::runtime::{lock, Progress, Runtime};
use crate::{Error, Result};

/// When [`Runtime::commit_as`] returns, as the log's port names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// Durable ([`Durability::Now`]).
    Durable,
    /// Made durable by the next append of the store ([`Durability::Ahead`]).
    Ahead,
    /// Made sure of by the session's next append ([`Durability::Pipelined`]).
    Pipelined,
}

/// A session's folded state and what the worker needs to append to it.
#[derive(Debug, Clone)]
pub struct Folded {
    pub id: SessionId,
    pub state: SessionState,
    pub last_hash: String,
    /// Position in the notice inbox already read.
    pub cursor: u64,
    /// The notices after `cursor`, read together with the log's tail when a session
    /// waiting on its children was loaded: its first look at them uses these instead of
    /// a read of its own. Never kept between jobs.
    pub(crate) notes: Option<Vec<(u64, SessionId)>>,
    /// The ends of the children it waits on, read with `notes` when they are few
    /// ([`Runtime::children_ends`]); `Some` for the whole job when this worker had the
    /// fold cached, and then the later looks of the job read them too. Never kept between
    /// jobs.
    pub(crate) ends: Option<HashMap<SessionId, Record>>,
    /// The record that ended the session, when its log is known to end with it durably
    /// (read from the log, or written here and acknowledged): what its parent's notice
    /// may carry ([`crate::ports::Notices::post_end`]).
    pub(crate) end: Option<Box<Record>>,
    /// Records were folded in ([`Runtime::stage`]) that the log does not hold yet: set
    /// until their [`Runtime::commit`] succeeds. Such a fold is never cached.
    ahead: bool,
    /// The last commit was pipelined ([`Written::Pipelined`]), and the session's next
    /// append has not made sure of it yet: the log may not hold those records (another
    /// writer's append, a cancel from outside say, can take their place). Such a fold is
    /// not cached either: another load in this process would take its records for the
    /// log's and read only past them.
    unsure: bool,
    /// What a row of the tree's report needs from the records beyond the state
    /// ([`crate::inspect::SessionRow`]), gathered as they are folded.
    pub(crate) seen: crate::inspect::Seen,
}

impl Folded {
    pub fn new(id: SessionId) -> Self {
        let last_hash = genesis_hash(&id);
        Self {
            id,
            state: SessionState::default(),
            last_hash,
            cursor: 0,
            notes: None,
            ends: None,
            end: None,
            ahead: false,
            unsure: false,
            seen: Default::default(),
        }
    }

    /// Folds records that follow the current state, checking the chain as it goes.
    pub fn absorb(&mut self, records: &[Record]) -> Result<()> {
        for r in records {
            if r.env.seq != self.state.last_seq + 1 || r.env.prev != self.last_hash {
                return Err(Error::corrupt_because(format!(
                    "log of {} breaks at seq {}: expected seq {} chained to the previous record",
                    self.id,
                    r.env.seq,
                    self.state.last_seq + 1
                )));
            }
            self.state.apply(&r.env);
            self.seen.record(&r.env);
            self.last_hash = r.hash();
            self.end = r.env.body.is_terminal().then(|| Box::new(r.clone()));
        }
        Ok(())
    }
}

/// How many children a waiting session may wait on for their last records to be read
/// with its notices ([`Runtime::children_ends`]). A wider turn is woken many times while
/// most of its children still run: those reads would mostly find turns in progress.
const PREFETCH_ENDS: usize = 16;

/// The children (not shared runs) `state`'s turn waits on, when there are at most
/// [`PREFETCH_ENDS`] of them; none otherwise.
pub(crate) fn few_children_waited_on(state: &SessionState) -> Vec<SessionId> {
    let mut children: Vec<SessionId> = vec![];
    for slot in &state.turn {
        if let skein_core::state::SlotState::Delegated {
            child,
            shared: false,
            ..
        } = &slot.state
        {
            if !children.contains(child) {
                if children.len() == PREFETCH_ENDS {
                    return vec![];
                }
                children.push(child.clone());
            }
        }
    }
    children
}

/// The notices read, as (position, child), with the ends they carry
/// ([`crate::ports::Notices::post_end`]) put in `ends`, where they stand for a read of
/// the child's log: not for a child with a follow-up question outstanding, whose earlier
/// end an old notice may still carry (a notice carries an end only when nothing can
/// follow it; this is the parent's own check of the same). An end read from the log is
/// kept over a carried one.
pub(crate) fn carried_ends(
    state: &skein_core::SessionState,
    read: Vec<crate::ports::NoticeRead>,
    ends: &mut HashMap<SessionId, skein_core::Record>,
) -> Vec<(u64, SessionId)> {
    let followed_up: std::collections::HashSet<&SessionId> = state
        .children
        .values()
        .filter(|c| c.max_steps.is_some())
        .map(|c| &c.child)
        .collect();
    read.into_iter()
        .map(|(pos, child, end)| {
            if let Some(end) = end.filter(|_| !followed_up.contains(&child)) {
                ends.entry(child.clone()).or_insert(end);
            }
            (pos, child)
        })
        .collect()
}

/// Records sealed and folded by [`Runtime::stage`], not yet written, with the status and
/// step count after each (what its progress notice tells).
#[derive(Default)]
pub(crate) struct Staged {
    records: Vec<Record>,
    marks: Vec<(skein_core::Status, u32)>,
}

/// How a session ended, for the ack of its job ([`FoldCache::ending`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Nothing can follow its end.
    ForGood,
    /// A later run of it may have work to do: a follow-up question may reopen it, a team
    /// peer may still have to hear of its end, or no job has told of this end yet.
    MayRunAgain,
}

/// The folds and agent definitions a runtime keeps in memory between jobs.
#[derive(Default)]
pub(crate) struct FoldCache {
    /// Behind a pointer: a fold is some 1.5 KB, and a wide fan-out keeps a thousand of
    /// them, which the map's growth and every insert and removal would otherwise copy.
    /// Shared, so that a reader of a finished tree ([`Runtime::tree_folds_held`]) holds
    /// the folds without copying each one's conversation; a load takes its fold back
    /// whole, copying it only if such a reader still holds it.
    states: Mutex<HashMap<SessionId, Arc<Folded>>>,
    defs: Mutex<HashMap<String, Arc<AgentDef>>>,
    /// Sessions whose end a job of this process has told of (its parent, watchers and
    /// announcement, `on_terminal`), with the seq their log ended at then; taken by the
    /// job's ack ([`FoldCache::ending`]).
    told: Mutex<HashMap<SessionId, u64>>,
}

impl FoldCache {
    /// Drops the session's fold, if one is kept: its next load reads the log.
    pub(crate) fn forget(&self, id: &SessionId) {
        lock(&self.states).remove(id);
    }

    /// Records that a job of this process told of the session's end, its log at `seq`.
    pub(crate) fn told(&self, id: &SessionId, seq: u64) {
        lock(&self.told).insert(id.clone(), seq);
    }

    /// How the session's kept fold shows it ended, for the ack of the job that ran it;
    /// none when it has not, or no fold is kept. A kept fold is the log's own (one ahead
    /// of its log, or unsure of it, is not kept), so its end is durable. For good only
    /// when the job told of that very end: a fold kept by a record written from outside
    /// in this process (a cancel) shows an end no job has told of yet, and the push that
    /// came with it must not be dropped. Nor is a team's seat's, whose end may have to be
    /// told again. Only a follow-up question reopens an ended session, and only a
    /// completed one of a `chat: true` agent (its own definition says, where this process
    /// has it; where not, it may).
    pub(crate) fn ending(&self, id: &SessionId) -> Option<Ending> {
        let told = lock(&self.told).remove(id);
        let (digest, completed) = {
            let states = lock(&self.states);
            let state = &states.get(id)?.state;
            if !state.status.is_terminal() {
                return None;
            }
            // A seat of a team tells its peers of its end, but only those started by
            // then: a peer its team's delegation creates later (that step tried again)
            // hears of it when the retried delegation pushes it again.
            let seated = state.submitted.as_ref().is_some_and(|s| s.team.is_some());
            if told != Some(state.last_seq) || seated {
                return Some(Ending::MayRunAgain);
            }
            (
                state.submitted.as_ref().map(|s| s.def_digest.clone()),
                state.status == skein_core::Status::Completed,
            )
        };
        if !completed {
            return Some(Ending::ForGood);
        }
        let chat = digest.and_then(|d| lock(&self.defs).get(&d).map(|d| d.front.chat));
        Some(match chat {
            Some(false) => Ending::ForGood,
            _ => Ending::MayRunAgain,
        })
    }

    /// The session's fold, if one is kept (shared with the cache, not copied).
    pub(crate) fn kept(&self, id: &SessionId) -> Option<Arc<Folded>> {
        lock(&self.states).get(id).cloned()
    }

    /// Whether a fold of `id` is kept.
    pub(crate) fn keeps(&self, id: &SessionId) -> bool {
        lock(&self.states).contains_key(id)
    }
}

impl Runtime {
    /// Appends `Submitted` as the first record of `id`; none if the session existed.
    pub(crate) async fn create(
        &self,
        id: &SessionId,
        submitted: Submitted,
    ) -> Result<Option<Folded>> {
        let mut f = Folded::new(id.clone());
        let mut staged = Staged::default();
        self.stage(&mut f, Event::Submitted(submitted), &mut staged)?;
        match self.commit(&mut f, staged).await {
            Ok(()) => Ok(Some(f)),
            Err(Error::Conflict { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// [`Runtime::create`] for the children a parent records next, many at once. Each
    /// child's `Submitted` is appended ahead ([`Durability::Ahead`]); the parent's append,
    /// which must return before the children's jobs are pushed, makes them durable.
    /// Every `Submitted` is sealed first, and then all are written together, each write
    /// holding no more than its session's id and records. (A future per child that sealed
    /// and wrote its own moved a whole fold into each of a thousand boxes, which cost a
    /// wide turn more than its writes.) Returns the folds in the order given; `None` where
    /// the session existed.
    pub(crate) async fn create_many_ahead(
        &self,
        children: Vec<(SessionId, Submitted)>,
    ) -> Result<Vec<Option<Folded>>> {
        let mut born = Vec::with_capacity(children.len());
        for (id, submitted) in children {
            let mut f = Folded::new(id);
            let mut staged = Staged::default();
            self.stage(&mut f, Event::Submitted(submitted), &mut staged)?;
            born.push((f, staged));
        }
        let log = &self.backend.log;
        let written = futures::future::join_all(
            born.iter()
                .map(|(f, staged)| log.append(&f.id, 0, &staged.records, Durability::Ahead)),
        )
        .await;
        let mut out = Vec::with_capacity(born.len());
        for ((mut f, staged), w) in born.into_iter().zip(written) {
            match w {
                Ok(()) => {
                    self.committed(&mut f, staged, Written::Ahead);
                    out.push(Some(f));
                }
                Err(Error::Conflict { .. }) => {
                    self.sessions.forget(&f.id);
                    out.push(None);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    pub(crate) fn seal(&self, f: &Folded, seq: u64, prev: String, body: Event) -> Result<Record> {
        let mut env = Envelope::new(f.id.clone(), seq, self.cfg.clock.now_ms(), prev, body);
        env.v = self.write_format();
        let bytes = env.encode()?;
        Ok(Record { env, bytes })
    }

    /// Appends one event to a session this worker holds, and folds it.
    pub async fn append(&self, f: &mut Folded, body: Event) -> Result<()> {
        self.append_all(f, vec![body]).await
    }

    /// Appends events in order (one durable batch where the backend can), and folds them.
    /// On an error the fold is ahead of the log: the caller drops it (a failed step's fold
    /// is never kept) or replaces it with a fresh load.
    pub async fn append_all(&self, f: &mut Folded, bodies: Vec<Event>) -> Result<()> {
        let mut staged = Staged::default();
        for body in bodies {
            self.stage(f, body, &mut staged)?;
        }
        self.commit(f, staged).await
    }

    /// Seals `body` as the next record of `f` and folds it in at once, ahead of the log;
    /// [`Runtime::commit`] writes it. A step that decides on the state with its own record
    /// folded in (what follows a model turn) stages the record rather than folding a copy
    /// of the whole state.
    pub(crate) fn stage(&self, f: &mut Folded, body: Event, staged: &mut Staged) -> Result<()> {
        let r = self.seal(f, f.state.last_seq + 1, f.last_hash.clone(), body)?;
        f.ahead = true;
        f.state.apply(&r.env);
        f.seen.record(&r.env);
        f.last_hash = r.hash();
        staged.marks.push((f.state.status, f.state.steps));
        staged.records.push(r);
        Ok(())
    }

    /// Writes the records staged on `f` (one durable batch where the backend can), and
    /// tells the listeners of each.
    pub(crate) async fn commit(&self, f: &mut Folded, staged: Staged) -> Result<()> {
        self.commit_as(f, staged, Written::Durable).await
    }

    /// [`Runtime::commit`], returning when the records are durable, or written ahead of a
    /// later append, or pipelined ahead of the session's next append (see [`Written`]).
    pub(crate) async fn commit_as(
        &self,
        f: &mut Folded,
        staged: Staged,
        how: Written,
    ) -> Result<()> {
        let Some(first) = staged.records.first().map(|r| r.env.seq - 1) else {
            return Ok(());
        };
        let log = &self.backend.log;
        let durability = match how {
            Written::Durable => Durability::Now,
            Written::Ahead => Durability::Ahead,
            Written::Pipelined => Durability::Pipelined,
        };
        let written = log.append(&f.id, first, &staged.records, durability).await;
        if let Err(e) = written {
            if matches!(e, Error::Conflict { .. }) {
                // Someone else wrote: forget the cached fold so the next load rereads.
                self.sessions.forget(&f.id);
            }
            return Err(e);
        }
        self.committed(f, staged, how);
        Ok(())
    }

    /// What follows a successful write of the records staged on `f`: the fold is the
    /// log's again, and the listeners of each record are told.
    fn committed(&self, f: &mut Folded, staged: Staged, how: Written) {
        f.ahead = false;
        f.unsure = how == Written::Pipelined;
        f.end = staged
            .records
            .last()
            .filter(|r| how == Written::Durable && r.env.body.is_terminal())
            .map(|r| Box::new(r.clone()));
        self.appended.fetch_add(
            staged.records.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        // Nobody may listen (a worker, a bench): then no notice is made.
        let told = self.progress.receiver_count() > 0;
        for (r, (status, steps)) in staged.records.iter().zip(staged.marks) {
            if r.env.body.is_terminal() {
                crate::spans::session_ended(&f.id, &f.state, r.env.at);
                self.ends.send(f.id.clone());
            }
            if !told {
                continue;
            }
            self.progress.send(Progress {
                session: f.id.clone(),
                seq: r.env.seq,
                kind: r.env.body.kind().to_string(),
                status,
                steps,
                detail: None,
            });
        }
    }

    /// A line of progress for `id` that is no record: `kind` says what happened to it
    /// (waiting for room in the store, running on); its seq and status are the ones last
    /// folded here.
    pub(crate) fn progress_note(&self, id: &SessionId, kind: &str) {
        if self.progress.receiver_count() == 0 {
            return;
        }
        let (seq, status, steps) = lock(&self.sessions.states)
            .get(id)
            .map(|f| (f.state.last_seq, f.state.status, f.state.steps))
            .unwrap_or((0, skein_core::Status::Running, 0));
        self.progress.send(Progress {
            session: id.clone(),
            seq,
            kind: kind.to_string(),
            status,
            steps,
            detail: None,
        });
    }

    /// The folded state of a session: the cached fold plus whatever is new in the log.
    /// Returns whether it was loaded cold (not cached).
    pub async fn load(&self, id: &SessionId) -> Result<(Folded, bool)> {
        let cached = lock(&self.sessions.states).remove(id);
        let cold = cached.is_none();
        let mut f = cached.map_or_else(|| Folded::new(id.clone()), Arc::unwrap_or_clone);
        let new = self.backend.log.read(id, f.state.last_seq + 1).await?;
        f.absorb(&new)?;
        Ok((f, cold))
    }

    /// [`Runtime::load`], for the holder of the session's job: a cached fold that waits
    /// on children has its notices read at the same time as its log's tail (on NATS, the
    /// round trips of the two reads overlap rather than follow each other), and the last
    /// records of the children it waits on too ([`Runtime::children_ends`]).
    pub(crate) async fn load_for_job(&self, id: &SessionId) -> Result<(Folded, bool)> {
        let waiting = lock(&self.sessions.states).get(id).map(|f| {
            let delegated = f
                .state
                .turn
                .iter()
                .any(|s| matches!(s.state, skein_core::state::SlotState::Delegated { .. }));
            (delegated, f.cursor, few_children_waited_on(&f.state))
        });
        let Some((true, cursor, children)) = waiting else {
            return self.load(id).await;
        };
        let (loaded, notes, mut ends) = futures::future::join3(
            self.load(id),
            self.backend.notices.read_ends(id, cursor),
            self.children_ends(&children),
        )
        .await;
        let (mut f, cold) = loaded?;
        // Read from where this fold's own cursor stands (a fold loaded cold has none).
        if !cold && f.cursor == cursor {
            f.notes = Some(carried_ends(&f.state, notes?, &mut ends));
            f.ends = Some(ends);
        }
        Ok((f, cold))
    }

    /// The last records of `children` that are ends (a read that fails is left out, and
    /// made again where it is needed). Read with a waiting session's notices: a child that
    /// woke it has ended, and its settlement needs its end, which would otherwise be read
    /// only after the notices (one more round trip on NATS).
    pub(crate) async fn children_ends(&self, children: &[SessionId]) -> HashMap<SessionId, Record> {
        let lasts = futures::future::join_all(children.iter().map(|c| self.backend.log.last(c)));
        children
            .iter()
            .zip(lasts.await)
            .filter_map(|(c, last)| match last {
                Ok(Some(r)) if r.env.body.is_terminal() => Some((c.clone(), r)),
                _ => None,
            })
            .collect()
    }

    /// Gives a fold back to the cache (after `load`).
    pub fn keep_state(&self, mut f: Folded) {
        if f.ahead || f.unsure {
            // Folded records its log does not hold, or may not: the next load reads the
            // log afresh.
            tracing::debug!(session = %f.id, "a fold ahead of its log is not kept");
            return;
        }
        f.notes = None;
        f.ends = None;
        // Its copy of the last record was for the notice this job posted: a kept fold
        // would hold the answer twice. A job run again reposts the notice bare.
        f.end = None;
        let mut states = lock(&self.sessions.states);
        if states.len() >= self.cfg.state_cache {
            // Drop finished sessions first; then anything.
            let victim = states
                .iter()
                .find(|(_, v)| v.state.status.is_terminal())
                .or_else(|| states.iter().next())
                .map(|(k, _)| k.clone());
            if let Some(v) = victim {
                states.remove(&v);
            }
        }
        states.insert(f.id.clone(), Arc::new(f));
    }

    /// The definition a session was submitted with.
    pub async fn def_for(&self, state: &SessionState) -> Result<Arc<AgentDef>> {
        let Some(sub) = &state.submitted else {
            return Err(Error::NotFound("session has no Submitted event".into()));
        };
        if let Some(d) = lock(&self.sessions.defs).get(&sub.def_digest) {
            return Ok(d.clone());
        }
        // A definition of this worker's own catalogue with the same digest has the same
        // text byte for byte (the digest is the text's blake3), and a definition is what
        // its text parses to: the catalogue's copy is taken as it is, without a read of
        // the blob store or a second parse.
        let local = self
            .agents
            .agents
            .values()
            .find(|d| d.digest == sub.def_digest);
        let def = match local {
            Some(d) => Arc::new(d.clone()),
            // The session's own `Submitted` names the definition, and it was stored before
            // that was appended: a store that answers "not there" is one that cannot
            // answer yet (a cluster still settling after a node loss), so the step is
            // retried rather than counted as a failure of the session.
            None => {
                let text = match self.backend.def_text(&sub.def_digest).await {
                    Err(Error::NotFound(what)) => {
                        return Err(Error::unavailable_because(format!(
                            "{what}, though the session's Submitted names it"
                        )))
                    }
                    other => other?,
                };
                Arc::new(AgentDef::parse(
                    &format!("stored definition {}", sub.def_digest),
                    &text,
                )?)
            }
        };
        lock(&self.sessions.defs).insert(sub.def_digest.clone(), def.clone());
        Ok(def)
    }

    /// Appends to a session whose job someone else may hold: on a conflict, reloads and
    /// retries while `still_valid` holds for the fresh fold. A conflict whose log ends with
    /// this very event is the append's own lost acknowledgement, and succeeds. When the
    /// session ended, or `still_valid` no longer holds, nothing is written and the answer
    /// is [`Outside::Moot`] (the fold is back in the cache); errors are failures only.
    pub async fn append_from_outside(
        &self,
        mut f: Folded,
        body: Event,
        still_valid: impl Fn(&Folded) -> bool,
    ) -> Result<Outside> {
        for _ in 0..5 {
            if let Err(why) = f.state.admits_from_outside(&body) {
                self.keep_state(f);
                return Ok(Outside::Moot(Moot::Ended(why)));
            }
            match self.append(&mut f, body.clone()).await {
                Ok(()) => return Ok(Outside::Appended(f)),
                Err(Error::Conflict { .. }) => {
                    let (fresh, _) = self.load(&f.id).await?;
                    // The write may have landed with its acknowledgement lost (a retried
                    // publish meets its own record): then it is done.
                    let last = self.backend.log.last(&f.id).await?;
                    if last.is_some_and(|r| r.env.body == body) {
                        return Ok(Outside::Appended(fresh));
                    }
                    if !still_valid(&fresh) {
                        self.keep_state(fresh);
                        return Ok(Outside::Moot(Moot::MovedOn));
                    }
                    f = fresh;
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::unavailable_because(format!(
            "{}: too many concurrent appends",
            f.id
        )))
    }
}

/// What [`Runtime::append_from_outside`] did.
// Returned once and taken apart at once, as `Result<Folded>` was: not worth a box.
#[allow(clippy::large_enum_variant)]
#[must_use]
pub enum Outside {
    /// The event is recorded; the session's fold after it.
    Appended(Folded),
    /// Nothing was recorded: what the event answered no longer holds.
    Moot(Moot),
}

/// Why an event from outside was not recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moot {
    /// The session has ended; the words say how.
    Ended(String),
    /// The session moved on meanwhile (the question was answered, the turn is over).
    MovedOn,
}

impl Moot {
    /// The refusal a token's holder is given for it.
    pub fn refusal(self) -> Error {
        match self {
            Moot::Ended(why) => Error::token(crate::TokenRefusal::Ended, why),
            Moot::MovedOn => Error::token(
                crate::TokenRefusal::Stale,
                "stale token: the session moved on",
            ),
        }
    }
}

impl std::fmt::Display for Moot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Moot::Ended(why) => f.write_str(why),
            Moot::MovedOn => f.write_str("stale token: the session moved on"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use skein_core::event::Cancelled;
    use skein_core::state::ChildInfo;
    use skein_core::testing::first_record;
    use skein_core::Event;

    fn end_of(child: &SessionId) -> Record {
        first_record(
            child,
            Event::Cancelled(Cancelled {
                reason: "done".into(),
            }),
        )
    }

    fn info(call: &str, child: &SessionId, max_steps: Option<u32>) -> ChildInfo {
        ChildInfo {
            call: call.into(),
            child: child.clone(),
            agent: "leaf".into(),
            mission_hash: "h".into(),
            outcome: None,
            cached: false,
            shared: false,
            steps: 0,
            max_steps,
            number: 1,
        }
    }

    /// A carried end stands for a read of the child's log, except for a child with a
    /// follow-up question outstanding: an old notice of its first end may still be read
    /// (a cold load reads notices from the start), and that end is no longer its last. An
    /// end read from the log is kept over a carried one.
    #[test]
    fn carried_ends_are_taken_unless_the_child_was_asked_a_follow_up() {
        let root = crate::new_root_id();
        let (a, b, c) = (root.child("w", 1), root.child("w", 2), root.child("w", 3));
        let mut state = SessionState::default();
        state
            .children
            .insert("call-a".into(), info("call-a", &a, None));
        // `b` answered once and was asked again: a follow-up call names it.
        state
            .children
            .insert("call-b".into(), info("call-b", &b, None));
        state
            .children
            .insert("call-b2".into(), info("call-b2", &b, Some(4)));
        state
            .children
            .insert("call-c".into(), info("call-c", &c, None));
        let from_log = end_of(&c);
        let mut ends = HashMap::from([(c.clone(), from_log.clone())]);
        let read = vec![
            (1, a.clone(), Some(end_of(&a))),
            (2, b.clone(), Some(end_of(&b))),
            (3, c.clone(), Some(end_of(&a))),
        ];
        let notes = carried_ends(&state, read, &mut ends);
        assert_eq!(notes, vec![(1, a.clone()), (2, b.clone()), (3, c.clone())]);
        assert_eq!(ends.get(&a).map(Record::hash), Some(end_of(&a).hash()));
        assert!(
            !ends.contains_key(&b),
            "a followed-up child's carried end was taken"
        );
        assert_eq!(ends.get(&c).map(Record::hash), Some(from_log.hash()));
    }

    /// The ack of a session's job goes by how its kept fold ended: for good only where the
    /// job told of that very end, nothing can follow it, and the session holds no seat in
    /// a team; a `chat: true` agent's completed session, or one whose definition this
    /// process does not have, may be asked again.
    #[test]
    fn a_session_ends_for_good_only_where_its_job_told_of_that_end_and_nothing_follows() {
        let cache = FoldCache::default();
        let agents = skein_core::testing::agents(&[("plain", ""), ("talker", "chat: true\n")]);
        for name in ["plain", "talker"] {
            let def = agents.get(name).unwrap().clone();
            lock(&cache.defs).insert(def.digest.clone(), Arc::new(def));
        }
        let digest = |name: &str| agents.get(name).unwrap().digest.clone();
        let keep = |agent: &str, seated: bool, end: Event| {
            let id = crate::new_root_id().child(agent, 1);
            let mut sub = skein_core::event::Submitted::for_test(agent);
            sub.def_digest = digest(agent);
            if seated {
                sub.team = Some(Box::new(skein_core::event::TeamSeat {
                    host: id.parent().unwrap(),
                    role: skein_core::event::TeamRole::Member,
                    peers: vec![],
                    members: 1,
                }));
            }
            let envs: Vec<Envelope> = [Event::Submitted(sub), end]
                .into_iter()
                .enumerate()
                .map(|(i, e)| Envelope::new(id.clone(), i as u64 + 1, 1, String::new(), e))
                .collect();
            let mut f = Folded::new(id.clone());
            f.state = SessionState::fold(&envs);
            lock(&cache.states).insert(id.clone(), Arc::new(f));
            id
        };
        let completed = || {
            Event::Completed(skein_core::event::Completed {
                answer: "done".into(),
                usage_total: Default::default(),
                steps: 1,
                partial: false,
            })
        };
        let cancelled = || {
            Event::Cancelled(Cancelled {
                reason: "stop".into(),
            })
        };

        let plain = keep("plain", false, completed());
        // Kept with its end, but no job told of it (a cancel made in this process while
        // the session's job ran): that job's ack must not drop the push that came with it.
        assert_eq!(cache.ending(&plain), Some(Ending::MayRunAgain));
        cache.told(&plain, 2);
        assert_eq!(cache.ending(&plain), Some(Ending::ForGood));
        // Taken by that ack: the next one goes by what its own job tells.
        assert_eq!(cache.ending(&plain), Some(Ending::MayRunAgain));
        // Told of at another seq (an end since replaced): not this end.
        cache.told(&plain, 1);
        assert_eq!(cache.ending(&plain), Some(Ending::MayRunAgain));

        let talker = keep("talker", false, completed());
        cache.told(&talker, 2);
        assert_eq!(
            cache.ending(&talker),
            Some(Ending::MayRunAgain),
            "a chat agent"
        );
        let stopped = keep("talker", false, cancelled());
        cache.told(&stopped, 2);
        assert_eq!(
            cache.ending(&stopped),
            Some(Ending::ForGood),
            "a cancelled session is never asked again"
        );
        let member = keep("plain", true, completed());
        cache.told(&member, 2);
        assert_eq!(
            cache.ending(&member),
            Some(Ending::MayRunAgain),
            "a team's seat"
        );

        let unknown = keep("plain", false, completed());
        lock(&cache.defs).clear();
        cache.told(&unknown, 2);
        assert_eq!(
            cache.ending(&unknown),
            Some(Ending::MayRunAgain),
            "no definition"
        );
        assert_eq!(cache.ending(&crate::new_root_id()), None, "no fold kept");
    }
}
