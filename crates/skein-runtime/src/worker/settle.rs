//! `Wait`: the children of a turn that have ended (or paused on a question) are recorded
//! as `ChildSettled`, from the notices or, on a cold load, from the children's logs.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use futures::future::join_all;
use futures::StreamExt;
use skein_core::event::{ChildSettled, Outcome};
use skein_core::message::Usage;
use skein_core::state::{usage_since, PatternKind, SlotState};
use skein_core::{AgentDef, Event, SessionId, Status, Step};

use crate::runtime::{Runtime, DEFAULT_POOL};
use crate::session::{Folded, Staged, Written};
use crate::Result;

pub(crate) fn outcome_of(terminal: &Event) -> Option<Outcome> {
    match terminal {
        Event::Completed(c) => Some(Outcome::Completed {
            answer: c.answer.clone(),
            patch: None,
            usage: c.usage_total,
            steps: c.steps,
            partial: c.partial,
        }),
        Event::Failed(f) => Some(Outcome::Failed {
            error: f.error.clone(),
            usage: f.usage_total,
            steps: f.steps,
        }),
        Event::Cancelled(c) => Some(Outcome::Failed {
            error: format!("cancelled: {}", c.reason),
            usage: Default::default(),
            steps: 0,
        }),
        _ => None,
    }
}

impl Runtime {
    /// Records `ChildSettled` for every child of the turn that has ended. A cold load
    /// checks every outstanding child (healing a notice lost in a crash, and re-waking a
    /// child whose job was lost); afterwards the notices are read, and every outstanding
    /// child is checked when a wake brings none. Children whose jobs this drive pushed
    /// (`pushed`) are left to their notices: each will post one when it ends or pauses, so
    /// looking at them now would only read the logs of sessions still running (a parent
    /// that has just delegated 1,024 children would read all 1,024 and push every one again).
    /// A team that is `ending` looks at all its members, which it has just cancelled.
    /// Only the `first` look of a drive checks every outstanding child when no notice
    /// came: a later look of the same drive follows one that read the notices (or checked
    /// every child) a moment ago, and a child that ended since then posted a notice before
    /// waking this session; checking them all again would read every outstanding child's
    /// log once more per wake-up. A look that read
    /// only what the notices named says so ([`Look::partial`]): a session that then waits
    /// with children out is looked at again later ([`Runtime::recheck_later`]).
    pub(crate) async fn collect_settlements(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        cold: bool,
        ending: bool,
        pushed: &BTreeSet<SessionId>,
        first: bool,
    ) -> Result<Look> {
        let any_out = f
            .state
            .turn
            .iter()
            .any(|slot| matches!(slot.state, SlotState::Delegated { .. }));
        if !any_out {
            return Ok(Look::default());
        }
        let choice = self.choose_children(f, cold, ending, pushed, first).await?;
        let seen = self.read_children(&choice).await?;
        self.record_settlements(f, def, &choice, &seen, cold || ending, pushed)
            .await
    }

    /// The first step of a look: which children to look at. Reads the notices (and, when
    /// few children are waited on, their ends with them) and picks the children they
    /// name, the shared runs, and every outstanding child when the look must be whole.
    async fn choose_children(
        &self,
        f: &mut Folded,
        cold: bool,
        ending: bool,
        pushed: &BTreeSet<SessionId>,
        first: bool,
    ) -> Result<Choice> {
        // The ends of the children waited on (when few) are read with the notices, where
        // this worker kept the session's fold: on the first look, with the log
        // (`load_for_job`); on a later look of the same job, here. (A session whose job
        // moved here from another worker reads only what its notices name.)
        let (notes, ends) = match f.notes.take() {
            Some(read_with_the_log) => (
                read_with_the_log,
                f.ends.replace(HashMap::new()).unwrap_or_default(),
            ),
            None if f.ends.is_none() => {
                let mut ends = HashMap::new();
                let read = self.backend.notices.read_ends(&f.id, f.cursor).await?;
                (
                    crate::session::carried_ends(&f.state, read, &mut ends),
                    ends,
                )
            }
            None => {
                // Not those whose jobs this drive pushed: they have only just started.
                let mut children = crate::session::few_children_waited_on(&f.state);
                children.retain(|c| !pushed.contains(c));
                let (read, mut ends) = futures::future::join(
                    self.backend.notices.read_ends(&f.id, f.cursor),
                    self.children_ends(&children),
                )
                .await;
                (
                    crate::session::carried_ends(&f.state, read?, &mut ends),
                    ends,
                )
            }
        };
        if let Some((pos, _)) = notes.last() {
            f.cursor = *pos;
        }
        let told: HashSet<SessionId> = notes.into_iter().map(|(_, c)| c).collect();
        // The outstanding calls of the children told of, and of shared runs: a wake of a
        // wide turn usually brings a few notices, and mapping every outstanding child
        // (1,024 of them, on each of some 250 wakes of a 1,024-wide fan-out) cost more
        // than the look itself. Every outstanding child is mapped only when all are
        // looked at.
        let map = |all: bool| {
            let mut out: HashMap<SessionId, Vec<String>> = HashMap::new();
            let mut shared = vec![];
            for slot in &f.state.turn {
                let SlotState::Delegated {
                    child, shared: s, ..
                } = &slot.state
                else {
                    continue;
                };
                if *s {
                    shared.push(child.clone());
                } else if !all && !told.contains(child) {
                    continue;
                }
                out.entry(child.clone())
                    .or_default()
                    .push(slot.call.id.clone());
            }
            (out, shared)
        };
        let (mut outstanding, mut shared) = map(false);
        // Shared runs are few and may have ended before we started watching them: always
        // look at them directly. A wake that brings no notice of an outstanding child
        // (a notice lost, or one not yet readable) looks at every outstanding child too:
        // a child that ended always wakes its parent, so the parent never waits on a
        // notice alone. Not on a backend whose notices are in step with its wake-ups:
        // there such a wake only follows a run that read its notice already (on one
        // process, a 1,000-wide fan-out had 35 of them, 18,000 reads of children's logs).
        let noticed: Vec<SessionId> = told
            .iter()
            .filter(|c| outstanding.contains_key(*c))
            .cloned()
            .collect();
        let every = cold
            || ending
            || (first
                && noticed.is_empty()
                && !self.backend.capabilities().notices_in_step_with_wakes);
        if every {
            (outstanding, shared) = map(true);
        }
        tracing::debug!(
            session = %f.id,
            outstanding = outstanding.len(),
            noticed = noticed.len(),
            every,
            "settle look"
        );
        let mut candidates: Vec<SessionId> = if every {
            outstanding
                .keys()
                .filter(|c| ending || !pushed.contains(*c))
                .cloned()
                .chain(noticed)
                .collect()
        } else {
            noticed
        };
        let shared_runs: HashSet<SessionId> = shared.iter().cloned().collect();
        candidates.extend(shared);
        candidates.sort();
        candidates.dedup();
        Ok(Choice {
            candidates,
            outstanding,
            shared_runs,
            ends,
            every,
        })
    }

    /// The second step: the last record of each chosen child (taken from the ends read
    /// with the notices where there is one), and whether a child still running is paused
    /// on a question.
    async fn read_children(&self, choice: &Choice) -> Result<Seen> {
        let Choice {
            candidates,
            outstanding,
            ends,
            ..
        } = choice;
        // The ends read with the notices stand for these reads. Nothing follows a session's
        // end but what its parent writes first (a follow-up question's `InputProvided`,
        // written before this wait began), so an end read at any moment of the wait is
        // still the child's end. A child whose last record was not an end is read again:
        // it may have ended since.
        let lasts: Vec<Option<skein_core::Record>> = join_all(candidates.iter().map(|c| {
            let end = ends.get(c).cloned();
            async move {
                match end {
                    Some(r) => Ok(Some(r)),
                    None => self.backend.log.last(c).await,
                }
            }
        }))
        .await
        .into_iter()
        .collect::<Result<_>>()?;
        // A child whose last record is not an end may be paused on a question, which only
        // its whole log tells: those logs are read together too (a look at every child of
        // a wide turn read them one after the other, one round trip or more each on NATS:
        // 64 running children of a 256-wide fan-out held a settlement for 0.6 s).
        let paused: HashMap<SessionId, Outcome> = {
            let running: Vec<SessionId> = candidates
                .iter()
                .zip(&lasts)
                .filter(|(c, last)| {
                    outstanding.contains_key(*c)
                        && last
                            .as_ref()
                            .is_some_and(|r| outcome_of(&r.env.body).is_none())
                })
                .map(|(c, _)| c.clone())
                .collect();
            let asked = futures::stream::iter(running.into_iter().map(|child| async move {
                Ok(self.needs_input(&child).await?.map(|o| (child, o)))
            }))
            .buffer_unordered(32)
            .collect::<Vec<Result<Option<(SessionId, Outcome)>>>>()
            .await;
            asked
                .into_iter()
                .filter_map(Result::transpose)
                .collect::<Result<_>>()?
        };
        Ok(Seen { lasts, paused })
    }

    /// The last step: `ChildSettled` for every chosen child that ended or paused, jobs
    /// pushed again for children still running after a cold load (or at a team's end),
    /// and the records appended.
    async fn record_settlements(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        choice: &Choice,
        seen: &Seen,
        whole: bool,
        pushed: &BTreeSet<SessionId>,
    ) -> Result<Look> {
        let Choice {
            candidates,
            outstanding,
            shared_runs,
            every,
            ..
        } = choice;
        let Seen { lasts, paused } = seen;
        let mut events = vec![];
        let mut repush = vec![];
        // A shared run waited on that has not started yet.
        let mut unstarted = false;
        // Result patches of this batch merge one after the other.
        let mut plan = f.state.planning.plan.clone();
        // Calls whose shared run was cancelled by its starter delegate again (below, once
        // the other settlements are folded in). Only the calls that shared the run: a call
        // whose own child it is (another call of this session shares it) settles with its
        // child's cancel, which was its own.
        let cancelled_shared: Vec<String> = candidates
            .iter()
            .zip(lasts.iter())
            .filter(|(child, last)| {
                shared_runs.contains(*child)
                    && last
                        .as_ref()
                        .is_some_and(|r| matches!(r.env.body, Event::Cancelled(_)))
            })
            .filter_map(|(child, _)| Some((child, outstanding.get(child)?)))
            .flat_map(|(child, calls)| {
                calls.iter().filter(|call| {
                    f.state
                        .children
                        .get(*call)
                        .is_some_and(|c| c.shared && c.child == *child)
                })
            })
            .cloned()
            .collect();
        // Their settlements, made only if they do not delegate again.
        let mut deferred: Vec<ChildSettled> = vec![];
        for (child, last) in candidates.iter().zip(lasts.iter()) {
            let Some(calls) = outstanding.get(child) else {
                continue;
            };
            match last {
                Some(rec) => match match outcome_of(&rec.env.body) {
                    // A cancelled child (a team's member at the team's end, a timeout)
                    // may have spent tokens: its whole usage rolls up as any child's.
                    Some(Outcome::Failed { error, .. })
                        if matches!(rec.env.body, Event::Cancelled(_)) =>
                    {
                        let (usage, steps) = self.spent_under(child).await?;
                        Some(Outcome::Failed {
                            error,
                            usage,
                            steps,
                        })
                    }
                    Some(o) => Some(o),
                    None => paused.get(child).cloned(),
                } {
                    // A handoff target or a route's destination paused on a question
                    // keeps this session waiting until it is answered and ends.
                    Some(Outcome::NeedsInput { .. })
                        if matches!(
                            f.state.pattern.kind,
                            Some(PatternKind::Handoff | PatternKind::Route)
                        ) => {}
                    Some(mut outcome) => {
                        self.result_patch(f, child, &mut outcome, &mut plan, &mut events);
                        for call in calls {
                            let settled = ChildSettled {
                                call: call.clone(),
                                child: child.clone(),
                                outcome: outcome.clone(),
                            };
                            if cancelled_shared.contains(call) {
                                deferred.push(settled);
                            } else {
                                events.push(Event::ChildSettled(settled));
                            }
                        }
                    }
                    None if whole && !pushed.contains(child) => repush.push(child.clone()),
                    None => {}
                },
                // A shared run with no log yet: its caller claimed the mission and has not
                // created it, or never will (it ended first: cancelled, say). Until one or
                // the other shows, look again later; once its caller has ended, the run
                // will never start, so the call fails with why (and the claim goes, so
                // that the next identical delegation runs its own).
                None if shared_runs.contains(child) => match self.never_started(child).await? {
                    Some(why) => {
                        for call in calls {
                            if let Some(info) = f.state.children.get(call) {
                                self.backend
                                    .cache
                                    .release_inflight(&info.mission_hash, child)
                                    .await?;
                            }
                            events.push(Event::ChildSettled(ChildSettled {
                                call: call.clone(),
                                child: child.clone(),
                                outcome: Outcome::Failed {
                                    error: why.clone(),
                                    usage: Default::default(),
                                    steps: 0,
                                },
                            }));
                        }
                    }
                    None => unstarted = true,
                },
                None => tracing::warn!(session = %f.id, %child, "delegated child has no log"),
            }
        }
        // A cold load cannot know whether the jobs of children still running were ever
        // published (a crash may have come between `Delegated` and the push): push them
        // again, many at a time. A push of a job that exists only leaves a wake marker.
        let pushes = futures::stream::iter(repush.into_iter().map(|child| async move {
            let first = self.backend.log.read(&child, 1).await?;
            let pool = match first.first().map(|r| &r.env.body) {
                Some(Event::Submitted(s)) => s.pool(),
                _ => DEFAULT_POOL.into(),
            };
            self.backend.jobs.push(&pool, &child).await
        }))
        .buffer_unordered(32)
        .collect::<Vec<Result<()>>>()
        .await;
        for p in pushes {
            p?;
        }
        let mut n = events.len();
        let mut staged = Staged::default();
        for e in events {
            self.stage(f, e, &mut staged)?;
        }
        // The calls whose shared run was cancelled delegate again, decided on the fold
        // with this look's settlements in it (what they spent is no longer free); a call
        // refused now settles with the cancel.
        let again = self.delegations_again(f, def, &cancelled_shared).await?;
        for settled in deferred {
            if !again.iter().any(|d| d.call == settled.call) {
                self.stage(f, Event::ChildSettled(settled), &mut staged)?;
                n += 1;
            }
        }
        // When the turn is settled and the model is called next, nothing acts on these
        // records before that call's own, whose append makes sure of them first (see
        // `Durability::Pipelined`: the embedded store writes them without a
        // sync, NATS leaves their ack to that append). A crash in between repeats the
        // model call, as any crash before its record is durable does, and a cold load
        // settles the children again. (A turn with children still out waits: the step
        // need not be worked out, which for a wide turn costs more than a look at its
        // slots.)
        let pipelined = n > 0
            && !f
                .state
                .turn
                .iter()
                .any(|slot| matches!(slot.state, SlotState::Delegated { .. }))
            && matches!(
                f.state.next(
                    def,
                    &self.version_known(&f.state).limits,
                    &*self.version_known(&f.state).agents
                ),
                Step::CallModel { .. }
            );
        let how = if pipelined {
            Written::Pipelined
        } else {
            Written::Durable
        };
        self.commit_as(f, staged, how).await?;
        let redone = again.len();
        if !again.is_empty() {
            tracing::info!(session = %f.id, calls = again.len(),
                "a shared run was cancelled by its starter: its calls delegate again");
            // Boxed: seldom taken, and a delegation's future would make every job's larger.
            Box::pin(self.delegate(f, def, again)).await?;
        }
        Ok(Look {
            // A call delegated again counts as moved on: the cache may have answered it
            // at once, and then no child's end will wake this session to go on.
            settled: n + redone,
            partial: unstarted
                || (!*every && !self.backend.capabilities().notices_in_step_with_wakes),
        })
    }

    /// The delegations `calls` make again, their shared run cancelled by its starter
    /// (`SessionState::delegations_again`). A child of the id one names, written already,
    /// is an earlier attempt's for the same call (a crash came before its record), which
    /// the delegation takes as the call's own; one written for another call would be no
    /// run of this call's, and the call settles with the cancel instead.
    async fn delegations_again(
        &self,
        f: &Folded,
        def: &AgentDef,
        calls: &[String],
    ) -> Result<Vec<skein_core::decide::Delegation>> {
        if calls.is_empty() {
            return Ok(vec![]);
        }
        let version = self.version_known(&f.state);
        let mut out = vec![];
        for d in f
            .state
            .delegations_again(def, &version.limits, &*version.agents, calls)
        {
            let first = self.backend.log.read(&d.child, 1).await?;
            let ours = match first.first().map(|r| &r.env.body) {
                None => true,
                Some(Event::Submitted(s)) => s
                    .parent
                    .as_ref()
                    .is_some_and(|p| p.session == f.id && p.call == d.call),
                Some(_) => false,
            };
            if ours {
                out.push(d);
            }
        }
        Ok(out)
    }

    /// Why a shared run that has no log will never have one, if its caller (the session
    /// that claimed the mission for it) has ended, or has no log either.
    async fn never_started(&self, child: &SessionId) -> Result<Option<String>> {
        let Some(caller) = child.parent() else {
            return Ok(None);
        };
        Ok(match self.backend.log.last(&caller).await? {
            Some(r) if r.env.body.is_terminal() => Some(format!(
                "the shared run `{}` of this mission never started: `{}`, which was to run \
                 it, ended first ({})",
                child.display(),
                caller.display(),
                r.env.body.kind()
            )),
            Some(_) => None,
            None => Some(format!(
                "the shared run `{}` of this mission never started: `{}`, which was to run \
                 it, has no log",
                child.display(),
                caller.display()
            )),
        })
    }

    /// Wakes `f` again in a lease's time, if it still waits then, so that it looks at every
    /// outstanding child once more. Called when the session goes to wait after a look
    /// that did not check every child (see [`Look::partial`]): where notices and wake-ups
    /// are not in step, two children that end close together wake their parent once
    /// (wake-ups coalesce), and the notice of one may not be readable yet (late, or
    /// lost). The look saw the other's notice, so it did not check every child, and no
    /// wake-up is left to come for the first one. The wake is cheap where nothing was
    /// missed: one read of the session's last record, then (a notice waiting) the usual
    /// look, or (none) one look at every outstanding child, as any wake without a
    /// notice. One timer a session at a time, in this process: a wide parent woken a
    /// thousand times in a lease is looked at again once, not a thousand times.
    pub(crate) fn recheck_later(&self, f: &Folded) {
        {
            let mut armed = self
                .rechecks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !armed.insert(f.id.clone()) {
                return;
            }
        }
        let (log, jobs, armed) = (
            self.backend.log.clone(),
            self.backend.jobs.clone(),
            self.rechecks.clone(),
        );
        let id = f.id.clone();
        let pool = f.state.pool();
        let lease = self.cfg.lease;
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            armed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
            // An ended session's job would only tell its parent again.
            let ended = match log.last(&id).await {
                Ok(last) => last.is_some_and(|r| r.env.body.is_terminal()),
                Err(_) => false,
            };
            if ended {
                return;
            }
            if let Err(e) = jobs.push(&pool, &id).await {
                tracing::warn!(session = %id, error = %e.report(), "re-check wake-up failed");
            }
        });
    }

    /// The outcome a parent is shown for a child paused on a question: the questions and a
    /// token to resume it with.
    pub(crate) async fn needs_input(&self, child: &SessionId) -> Result<Option<Outcome>> {
        let (cf, _) = self.load(child).await?;
        let out = (cf.state.status == Status::AwaitingInput)
            .then(|| cf.state.pauses.pending_inputs.first().cloned())
            .flatten()
            .map(|p| Outcome::NeedsInput {
                questions: p.questions.clone(),
                context: p.context.clone(),
                defaults: p.defaults.clone(),
                // The log keeps the token's id; the parent's model is shown the token.
                token: String::new(),
                token_id: p.token_id.clone(),
                seq: p.seq,
                usage: cf.state.usage_total(),
            });
        self.keep_state(cf);
        Ok(out)
    }
}

/// What one look for settled children did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Look {
    /// `ChildSettled` records written.
    pub settled: usize,
    /// The look read the notices and the children they named, not every outstanding
    /// child, on a backend whose notices may be missing when a wake-up comes: a child
    /// whose wake-up was coalesced into this one may have ended unseen.
    pub partial: bool,
}

/// The children a look reads (see [`Runtime::collect_settlements`]).
struct Choice {
    /// The children to read, sorted, each once.
    candidates: Vec<SessionId>,
    /// The outstanding calls of each child looked at, by child.
    outstanding: HashMap<SessionId, Vec<String>>,
    /// Runs shared with another caller (single-flight).
    shared_runs: HashSet<SessionId>,
    /// Ends of children already read with the notices.
    ends: HashMap<SessionId, skein_core::Record>,
    /// Every outstanding child is looked at, not only those the notices named.
    every: bool,
}

/// What a look read of the children it chose.
struct Seen {
    /// The last record of each candidate, in the order of [`Choice::candidates`].
    lasts: Vec<Option<skein_core::Record>>,
    /// Candidates still running that are paused on a question.
    paused: HashMap<SessionId, Outcome>,
}

impl Runtime {
    /// What `id` spent with everything it started, and its model turns: its own total,
    /// plus what each child it started itself spent beyond what `id` had already counted
    /// of it (a child still running or paused; or one settled and then asked a follow-up
    /// whose answer `id` never settled), and all that the children it started but never
    /// recorded spent. A session cancelled while children run (a timeout cancels its
    /// whole subtree) settles none of them, and one cancelled in the middle of a step
    /// that delegated (the children's logs are written before the parent's record of
    /// them) never records them, so without this their tokens would reach no total.
    pub(crate) fn spent_under<'a>(
        &'a self,
        id: &'a SessionId,
    ) -> futures::future::BoxFuture<'a, Result<(Usage, u32)>> {
        Box::pin(async move {
            let (f, _) = self.load(id).await?;
            let mut total = f.state.usage_total();
            let steps = f.state.steps;
            // Each child once: one that asked a question and was answered (or asked a
            // follow-up) is named by two calls, and what it spent since it was last counted
            // is spent once.
            let unsettled: BTreeMap<SessionId, Usage> = f
                .state
                .children
                .values()
                .filter(|c| !c.cached && !c.shared && id.contains(&c.child) && c.child != *id)
                .map(|c| {
                    let counted = f.state.accounting.child_usage.get(&c.child);
                    (c.child.clone(), counted.copied().unwrap_or_default())
                })
                .collect();
            let unrecorded = self.unrecorded_children(&f).await;
            self.keep_state(f);
            for child in unrecorded? {
                let (whole, _) = self.spent_under(&child).await?;
                total.add(&whole);
            }
            for (child, counted) in unsettled {
                let (whole, _) = self.spent_under(&child).await?;
                total.add(&usage_since(&whole, &counted));
            }
            Ok((total, steps))
        })
    }

    /// Children of `f` that have a log but that `f`'s log never recorded: a step that
    /// delegated writes its children before its own record of them, and a session that
    /// ends before that record (dead-lettered) leaves them.
    pub(crate) async fn unrecorded_children(&self, f: &Folded) -> Result<Vec<SessionId>> {
        let mut out = vec![];
        for s in self.backend.subtree(&f.id).await? {
            if s.parent().as_ref() == Some(&f.id)
                && !f.state.children.values().any(|c| c.child == s)
            {
                out.push(s);
            }
        }
        Ok(out)
    }
}
