//! `Delegate` and `Clarify`: children created (or shared, or answered from the cache),
//! paused children resumed with their parent model's answers, follow-up questions put to
//! finished children.

use std::sync::Arc;

use futures::future::join_all;
use futures::StreamExt;
use skein_core::decide::Delegation;
use skein_core::event::{CacheHit, Delegated, DelegationKind, InputProvided, ParentRef, Submitted};
use skein_core::hash::{mission_hash, MissionKey, RunShape};
use skein_core::{AgentDef, Event, SessionId, Status};

use crate::runtime::Runtime;
use crate::session::{Folded, Outside};
use crate::{Error, Result};

/// The largest batch of one turn's delegations when they are batched (see
/// [`Runtime::delegate`]).
const MAX_DELEGATION_BATCH: usize = 128;

/// What every batch of one turn's delegations shares.
struct TurnOfDelegations {
    parent_sub: Submitted,
    version: Arc<crate::defs::Version>,
    /// A wide turn delegates mostly to a few agents: each definition is copied once.
    named: std::collections::HashMap<String, Arc<AgentDef>>,
    /// Digests of the definitions whose text this turn has stored.
    stored: std::collections::HashSet<String>,
}

impl Runtime {
    pub(crate) async fn delegate(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        ds: Vec<Delegation>,
    ) -> Result<()> {
        let Some(parent_sub) = f.state.submitted.clone() else {
            return Err(Error::NotFound(format!("{} has no Submitted event", f.id)));
        };
        // Children run on their tree's version, whatever is current now.
        let version = self.version_of(&f.state).await?;
        let mut turn = TurnOfDelegations {
            parent_sub,
            version,
            named: Default::default(),
            stored: Default::default(),
        };
        // A wide turn is delegated in batches that grow: each batch's children start
        // while the next batch is made, so a thousand children do not all wait for the
        // last one to be created. A batch is recorded as a whole turn was: its children,
        // then the parent's record of them, then their jobs. A crash between batches
        // leaves the parent with some calls recorded and the rest still to do, which the
        // next attempt of the step delegates (as after a crash within a record on a store
        // that writes a batch in parts).
        //
        // A team's turn is never batched: its participants talk to each other, and a
        // broadcast or a member's last word is delivered only to the peers whose logs
        // exist. A member that ended before its supervisor was created would never be
        // counted as gone, and the supervisor would wait for it for ever. So every seat
        // is created, and the team's calls recorded, before any participant's job is
        // pushed.
        let team = ds.iter().any(|d| d.team.is_some());
        let mut size = match self.cfg.delegation_batch {
            n if n > 0 && !team => n,
            _ => usize::MAX,
        };
        let mut ds = ds.into_iter();
        loop {
            let batch: Vec<Delegation> = ds.by_ref().take(size).collect();
            if batch.is_empty() {
                return Ok(());
            }
            if size < MAX_DELEGATION_BATCH {
                size = (size * 2).min(MAX_DELEGATION_BATCH);
            }
            self.delegate_batch(f, def, &mut turn, batch).await?;
        }
    }

    /// One batch of a turn's delegations (see [`Runtime::delegate`]).
    async fn delegate_batch(
        &self,
        f: &mut Folded,
        def: &AgentDef,
        turn: &mut TurnOfDelegations,
        ds: Vec<Delegation>,
    ) -> Result<()> {
        let started = std::time::SystemTime::now();
        let TurnOfDelegations {
            parent_sub,
            version,
            named,
            stored,
        } = turn;
        let mut parent_events = Vec::with_capacity(ds.len());
        let mut creations = vec![];
        let mut jobs = vec![];
        for d in ds {
            if let Some(resume) = &d.resume {
                parent_events.push(self.resume_child(f, &d, resume).await?);
                if let Some(Event::Delegated(_)) = parent_events.last() {
                    let (cf, _) = self.load(&d.child).await?;
                    let pool = cf.state.pool();
                    self.keep_state(cf);
                    jobs.push((pool, d.child.clone()));
                }
                continue;
            }
            let child_def: Arc<AgentDef> = match &d.custom {
                Some(c) => Arc::new(AgentDef::custom(def, &c.system_prompt, &c.tools)?),
                None => match named.get(&d.agent).cloned().or_else(|| {
                    let x = Arc::new(version.agents.get(&d.agent)?.clone());
                    named.insert(d.agent.clone(), x.clone());
                    Some(x)
                }) {
                    Some(x) => x,
                    None => {
                        parent_events.push(Event::tool_error(
                            d.call.clone(),
                            format!("call_agent: unknown agent `{}`", d.agent),
                        ));
                        continue;
                    }
                },
            };
            let def_digest = child_def.digest.clone();
            let shape = self.run_shape(version, &child_def, &d);
            let key = MissionKey {
                def_digest: &def_digest,
                model: &child_def.front.model,
                mission: &d.mission,
                context: d.context.as_deref(),
                inputs: &d.inputs,
                strategy: child_def.front.strategy.as_deref(),
                shape: Some(&shape),
            };
            let hash = mission_hash(&key);
            // A child handed tasks of the plan writes to it: its run is never shared.
            // An agent that may have side effects is neither answered from the cache nor
            // shared: its effects must happen in this tree.
            // A team's participant talks with its teammates: its answer depends on more
            // than its mission, so it is neither answered from the cache nor cached.
            let caching = !parent_sub.no_cache
                && version.agents.caching(&child_def).cached
                && d.grant.is_none()
                && d.team.is_none();
            // This call's own child, created by an earlier attempt of this step.
            let mut adopt = false;
            if caching {
                // The entry an earlier attempt's own child made (this step created the
                // child, then stopped before recording it) is that child's run, not a
                // saving: adopt the child below, so its usage rolls up.
                let hit = self
                    .backend
                    .cache
                    .get(&hash, self.cfg.clock.now_ms())
                    .await?;
                // Nor is a hit taken for a child an earlier attempt of this step already
                // created (its `Submitted` is written, its job may run): that child is this
                // call's run, adopted below, or its usage would never roll up. Read only
                // when there is a hit, so a miss costs nothing more.
                let hit = match hit.filter(|h| h.source != d.child) {
                    Some(_) if self.backend.log.last(&d.child).await?.is_some() => {
                        adopt = true;
                        None
                    }
                    other => other,
                };
                if let Some(hit) = hit {
                    parent_events.push(Event::CacheHit(CacheHit {
                        call: d.call.clone(),
                        mission_hash: hash,
                        source: hit.source,
                        answer: hit.answer,
                        saved: hit.usage,
                        steps: hit.steps,
                        key: Some(Box::new(key.parts())),
                    }));
                    continue;
                }
            }
            // Joining an identical run under way can never close a circle of waits: the
            // key holds the depth left, so a run only joins one at its own depth, never an
            // ancestor; a child is one level down, and the steps that keep the depth (a
            // handoff, a route) follow the pattern graph, which has no cycles. The check
            // below says the first half of that outright. A run of an agent that may ask
            // a question is never shared (whatever its `cache:` says): its question would
            // reach another tree, whose answer would shape this one's.
            let asks = child_def
                .allowed_tools()
                .contains(skein_core::RuntimeTool::AskUser.as_str());
            if caching && !asks && !adopt {
                let running = self
                    .single_flight(&hash, &d.child)
                    .await?
                    .filter(|r| !r.contains(&f.id));
                // Nor is another run shared by a call whose own child an earlier attempt
                // of this step created (its log is written, a resume may have run it, and
                // it may have ended and left the mission's claim to another tree): that
                // child is this call's run, or it would run unrecorded and its usage
                // would count in no total. Read only when another run holds the claim.
                let running = match running {
                    Some(_) if self.backend.log.last(&d.child).await?.is_some() => None,
                    other => other,
                };
                if let Some(running) = running {
                    // An identical mission is running: wait for it instead of a new run.
                    // Watch before recording, so its end cannot slip past unheard.
                    let my_pool = parent_sub.pool();
                    self.backend
                        .notices
                        .watch(&running, &f.id, &my_pool)
                        .await?;
                    parent_events.push(Event::Delegated(Delegated {
                        call: d.call,
                        child: running,
                        agent: d.agent,
                        mission_hash: hash,
                        allotted_tokens: None,
                        kind: DelegationKind::Shared,
                        owns_tasks: vec![],
                        max_steps: None,
                    }));
                    continue;
                }
            }
            let pool = child_def.front.pool.clone();
            let submitted = Submitted {
                agent: d.agent.clone(),
                def_digest,
                mission: d.mission.clone(),
                context: d.context.clone(),
                inputs: d.inputs.clone(),
                mission_hash: hash.clone(),
                parent: Some(ParentRef {
                    session: f.id.clone(),
                    call: d.call.clone(),
                    pool: parent_sub.pool.clone(),
                }),
                depth: d.depth,
                budget: d.budget,
                trace: Some(crate::trace::for_child(
                    &d.child,
                    parent_sub.trace.as_deref(),
                    &*self.cfg.clock,
                )),
                ancestry: d.ancestry.clone(),
                no_cache: parent_sub.no_cache || d.grant.is_some() || d.team.is_some(),
                forked_from: None,
                pool: pool.clone(),
                plan: d.grant.clone().map(Box::new),
                request: d.request.clone(),
                allowed_tools: d.allowed_tools.clone(),
                team: d.team.clone().map(Box::new),
                defs: parent_sub.defs.clone(),
                priority: parent_sub.priority,
            };
            jobs.push((submitted.pool(), d.child.clone()));
            creations.push((d.child.clone(), child_def, submitted));
            parent_events.push(Event::Delegated(Delegated {
                call: d.call,
                child: d.child,
                agent: d.agent,
                mission_hash: hash,
                allotted_tokens: d.budget.tokens,
                kind: DelegationKind::Started,
                owns_tasks: d
                    .grant
                    .as_ref()
                    .map(|g| g.tasks.iter().map(|t| t.id.clone()).collect())
                    .unwrap_or_default(),
                max_steps: None,
            }));
        }
        // Children first, then the parent's record of them, then the jobs: a crash
        // anywhere leaves nothing dangling. The children are appended ahead of the
        // parent's record, whose durability covers theirs where the log is written in
        // order (one sync for the delegation); elsewhere in parallel, so that their flushes
        // are shared.
        // Each definition's text is stored once (a wide turn's children mostly share
        // one), before any child that names it exists.
        let mut defs: Vec<&AgentDef> = vec![];
        for (_, def, _) in &creations {
            if !stored.contains(&def.digest) && !defs.iter().any(|d| d.digest == def.digest) {
                defs.push(def);
            }
        }
        for put in join_all(
            defs.iter()
                .map(|d| self.backend.blobs.put(d.text.as_bytes())),
        )
        .await
        {
            put?;
        }
        stored.extend(defs.iter().map(|d| d.digest.clone()));
        let created = self
            .create_many_ahead(
                creations
                    .into_iter()
                    .map(|(id, _, sub)| (id, sub))
                    .collect(),
            )
            .await?;
        // The children's folds are kept: the job that runs a child here reads only what
        // follows its `Submitted` (one round trip on NATS rather than two).
        for child in created.into_iter().flatten() {
            self.keep_state(child);
        }
        let delegated = crate::spans::delegated(&parent_events);
        self.append_all(f, parent_events).await?;
        crate::spans::delegations(&f.id, &f.state, started, &delegated);
        self.push_jobs(jobs).await
    }

    /// What shapes the run of a child besides its mission (see [`RunShape`]).
    pub(crate) fn run_shape(
        &self,
        version: &crate::defs::Version,
        child_def: &AgentDef,
        d: &Delegation,
    ) -> RunShape {
        let mut extra = vec![];
        if d.grant.is_some() {
            extra.push(skein_core::RuntimeTool::ProposePatch.as_str());
        }
        if d.team.is_some() {
            extra.push(skein_core::RuntimeTool::TeamBroadcast.as_str());
        }
        self.shape_of(
            version,
            child_def,
            &d.agent,
            d.allowed_tools.as_deref(),
            &extra,
            &d.ancestry,
            d.depth,
            d.budget,
            d.request.as_deref(),
        )
    }

    /// What shapes a run of `def` (as agent `agent`) besides its mission: its tools after
    /// `narrowed` (plus `extra`), the depth and budget it runs with, the agents of its
    /// path it could start and may not, the request a pattern passed on.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn shape_of(
        &self,
        version: &crate::defs::Version,
        def: &AgentDef,
        agent: &str,
        narrowed: Option<&[String]>,
        extra: &[&str],
        ancestry: &[String],
        depth: u32,
        budget: skein_core::limits::Budget,
        request: Option<&str>,
    ) -> RunShape {
        let mut tools = def.allowed_tools();
        tools.retain(|t| version.limits.sub_agent_may_use(depth, t));
        if let Some(only) = narrowed {
            tools.retain(|t| only.contains(t));
        }
        tools.extend(extra.iter().map(|t| t.to_string()));
        let reach = {
            let mut memo = crate::runtime::lock(&self.shape_memo.reachable);
            let key = format!("{}/{agent}", version.digest.as_deref().unwrap_or_default());
            memo.entry(key)
                .or_insert_with(|| {
                    let agents = version.agents.reachable(agent);
                    let digest =
                        RunShape::reach_digest(agents.iter().map(|a| {
                            (a.as_str(), version.agents.get(a).map(|d| d.digest.as_str()))
                        }));
                    Arc::new(crate::runtime::Reach { agents, digest })
                })
                .clone()
        };
        let on_path: std::collections::BTreeSet<String> = ancestry
            .iter()
            .map(String::as_str)
            .chain(std::iter::once(agent))
            .filter(|a| reach.agents.contains(*a))
            .filter(|a| !version.agents.get(a).is_some_and(|x| x.front.recursive))
            .map(str::to_string)
            .collect();
        RunShape {
            tools: tools.into_iter().collect(),
            depth_left: version.limits.max_depth.saturating_sub(depth),
            budget,
            limits: version.limits_digest.clone(),
            on_path: on_path.into_iter().collect(),
            request: request.map(RunShape::request_digest),
            reach: reach.digest.clone(),
        }
    }

    /// Publishes the jobs of children whose `Delegated` is recorded, many at a time: one
    /// after another, a wide fan-out waited a round trip per child before its last child
    /// could start. Their order does not matter (each is a session of its own), and a
    /// crash among them is repaired as any crash after `Delegated` is: a cold load of the
    /// parent pushes again every child still running.
    pub(crate) async fn push_jobs(&self, jobs: Vec<(String, SessionId)>) -> Result<()> {
        let backend = &self.backend;
        let pushed = futures::stream::iter(
            jobs.into_iter()
                .map(|(pool, child)| async move { backend.jobs.push_new(&pool, &child).await }),
        )
        .buffer_unordered(64)
        .collect::<Vec<Result<()>>>()
        .await;
        pushed.into_iter().collect()
    }

    /// Continues a paused child with the parent model's answers: checks the token against
    /// the child's log, records the answers there, and returns the parent's event — a
    /// `Delegated {resumed}` or, when the token does not hold, a tool error.
    pub(crate) async fn resume_child(
        &self,
        f: &Folded,
        d: &Delegation,
        resume: &skein_core::decide::Resume,
    ) -> Result<Event> {
        let refuse = |why: String| {
            Event::tool_error(
                d.call.clone(),
                format!("call_agent: resume_token refused: {why}"),
            )
        };
        if let Err(Error::Refused { reason: why, .. }) =
            crate::hitl::check_answer_size("the answers", resume.answers.to_string().len())
        {
            return Ok(refuse(why));
        }
        let by = format!("{}#{}", f.id, d.call);
        // A crash after the answers were recorded but before `Delegated`: finish the job.
        let (cf, _) = self.load(&d.child).await?;
        let ours =
            !cf.state.pauses.used_tokens.is_empty() && self.answered_by(&d.child, &by).await?;
        let mission_hash = cf
            .state
            .submitted
            .as_ref()
            .map(|s| s.mission_hash.clone())
            .unwrap_or_default();
        self.keep_state(cf);
        if !ours {
            if let Some(refused) = self.answer_paused_child(f, d, resume, &by).await? {
                // Another run of this very step (two holders of this session's job, after
                // a lease ran out) may have answered the child between this run's look
                // and its answer: that answer is this call's, and the token is spent on
                // it. Taken as refused, the child would run on unrecorded, what it spent
                // in no total.
                if !self.answered_by(&d.child, &by).await? {
                    return Ok(refused);
                }
            }
        }
        Ok(Event::Delegated(Delegated {
            call: d.call.clone(),
            child: d.child.clone(),
            agent: d.agent.clone(),
            mission_hash,
            allotted_tokens: None,
            kind: DelegationKind::Resumed,
            owns_tasks: vec![],
            max_steps: None,
        }))
    }

    /// Answers the question `d.child` paused on with `resume`'s answers, recorded as given
    /// `by` this call; the refusal the model is shown when the token or the answers do not
    /// stand, none when the answers are recorded.
    async fn answer_paused_child(
        &self,
        f: &Folded,
        d: &Delegation,
        resume: &skein_core::decide::Resume,
        by: &str,
    ) -> Result<Option<Event>> {
        let refuse = |why: String| {
            Event::tool_error(
                d.call.clone(),
                format!("call_agent: resume_token refused: {why}"),
            )
        };
        // The model's token was recorded as its reference: only one this session was
        // given stands for a token.
        let token = if resume
            .token
            .trim()
            .starts_with(skein_core::token::REF_PREFIX)
        {
            let r = resume.token.trim();
            match f
                .state
                .pauses
                .resume_refs
                .contains(r)
                .then(|| skein_core::token::from_reference(&self.cfg.token_secret.0, r))
                .flatten()
            {
                Some(t) => t,
                None => {
                    return Ok(Some(refuse(
                        "it is not a token this session was given".into(),
                    )))
                }
            }
        } else {
            resume.token.clone()
        };
        let (claims, cf) =
            match crate::hitl::check_token(self, &token, skein_core::token::TokenKind::Input).await
            {
                Ok(x) => x,
                Err(Error::Refused { reason: why, .. }) => return Ok(Some(refuse(why))),
                Err(e) => return Err(e),
            };
        if claims.session != d.child {
            self.keep_state(cf);
            return Ok(Some(refuse(format!(
                "it belongs to session {}",
                claims.session.display()
            ))));
        }
        let questions = cf
            .state
            .pauses
            .pending_inputs
            .iter()
            .find(|p| p.token_id == claims.nonce)
            .map(|p| p.questions.clone())
            .unwrap_or_default();
        if let Err(Error::Refused { reason: why, .. }) =
            crate::hitl::check_answers(&questions, &resume.answers)
        {
            self.keep_state(cf);
            return Ok(Some(refuse(why)));
        }
        let nonce = claims.nonce.clone();
        let body = Event::InputProvided(InputProvided {
            answers: resume.answers.clone(),
            token_id: nonce.clone(),
            by: Some(by.to_string()),
        });
        let valid = |g: &Folded| {
            g.state
                .pauses
                .pending_inputs
                .iter()
                .any(|p| p.token_id == nonce)
        };
        match self.append_from_outside(cf, body, valid).await? {
            Outside::Appended(cf) => self.keep_state(cf),
            Outside::Moot(m) => return Ok(Some(refuse(m.to_string()))),
        }
        Ok(None)
    }

    /// Whether `child`'s log holds answers given `by` a call (`<session>#<call>`).
    async fn answered_by(&self, child: &SessionId, by: &str) -> Result<bool> {
        Ok(self
            .backend
            .log
            .read(child, 1)
            .await?
            .iter()
            .any(|r| matches!(&r.env.body, Event::InputProvided(p) if p.by.as_deref() == Some(by))))
    }

    /// Puts follow-up questions to finished `chat: true` children: each child's log
    /// continues with the question, and this session waits for its new answer.
    pub(crate) async fn clarify(
        &self,
        f: &mut Folded,
        v: Vec<skein_core::decide::Clarify>,
    ) -> Result<()> {
        let mut events = vec![];
        let mut jobs = vec![];
        for c in v {
            let (cf, _) = self.load(&c.child).await?;
            let records = self.backend.log.read(&c.child, 1).await?;
            // After a crash the question may already be in the child's log.
            let asked = records.iter().any(|r| {
                matches!(&r.env.body, Event::ClarificationRequested(q) if q.from == f.id && q.call == c.call)
            });
            let mission_hash = cf
                .state
                .submitted
                .as_ref()
                .map(|s| s.mission_hash.clone())
                .unwrap_or_default();
            let pool = cf.state.pool();
            if !asked {
                if cf.state.status != Status::Completed {
                    self.keep_state(cf);
                    events.push(Event::tool_error(
                        c.call,
                        format!(
                            "ask_clarification: {} is busy; ask again once it has answered",
                            c.child.display()
                        ),
                    ));
                    continue;
                }
                let body =
                    Event::ClarificationRequested(skein_core::event::ClarificationRequested {
                        from: f.id.clone(),
                        call: c.call.clone(),
                        question: c.question.clone(),
                    });
                match self
                    .append_from_outside(cf, body, |g| g.state.status == Status::Completed)
                    .await?
                {
                    Outside::Appended(cf) => self.keep_state(cf),
                    Outside::Moot(m) => return Err(m.refusal()),
                }
            } else {
                self.keep_state(cf);
            }
            // The child's end read with this session's notices when its job was loaded
            // (for the first look at its children) is the end of its earlier answer, no
            // longer its end now that the question follows it.
            if let Some(ends) = f.ends.as_mut() {
                ends.remove(&c.child);
            }
            jobs.push((pool, c.child.clone()));
            events.push(Event::Delegated(Delegated {
                call: c.call,
                child: c.child,
                agent: c.agent,
                mission_hash,
                allotted_tokens: None,
                kind: DelegationKind::Resumed,
                owns_tasks: vec![],
                max_steps: Some(c.max_steps),
            }));
        }
        self.append_all(f, events).await?;
        self.push_jobs(jobs).await
    }

    /// Claims the run of `hash` for `child`; returns the session to share instead when an
    /// identical run is under way. A holder that ended without an answer to share (failed,
    /// cancelled) is replaced.
    pub(crate) async fn single_flight(
        &self,
        hash: &str,
        child: &SessionId,
    ) -> Result<Option<SessionId>> {
        for _ in 0..3 {
            let Some(holder) = self.backend.cache.claim_inflight(hash, child).await? else {
                return Ok(None);
            };
            match self.backend.log.last(&holder).await? {
                Some(r)
                    if r.env.body.is_terminal() && !matches!(r.env.body, Event::Completed(_)) =>
                {
                    self.backend.cache.release_inflight(hash, &holder).await?;
                }
                // Running, or completed (its notices may still be on their way).
                Some(_) => return Ok(Some(holder)),
                // Claimed but not yet created: the creator is between claim and append.
                None => return Ok(Some(holder)),
            }
        }
        Ok(None)
    }
}
