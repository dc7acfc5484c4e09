//! What follows the end of a session: its answer cached, its parent and watchers woken,
//! a root's result announced.

use crate::ports::{CacheEntry, RootResult};
use crate::runtime::Runtime;
use crate::session::Folded;
use crate::Result;
use skein_core::Status;

impl Runtime {
    /// What happens once a session has ended: cache its answer, wake its parent, announce
    /// a root. Idempotent: a redelivered job does it again harmlessly.
    pub(crate) async fn on_terminal(&self, f: &Folded) -> Result<()> {
        let Some(sub) = &f.state.submitted else {
            return Ok(());
        };
        // Only the answer to the mission that was hashed is cached: never one to a
        // follow-up question (`chat: true`), nor one that used answers it was given (a
        // person's, or its parent's on resuming it), nor one made without some child's
        // answer (a child failed or was cancelled, here or further down), which a fresh
        // run would not have, or might.
        if f.state.status == Status::Completed
            && !sub.no_cache
            && f.state.follow_ups == 0
            && f.state.pauses.answers_received == 0
            && !f.state.accounting.partial
        {
            let def = self.def_for(&f.state).await?;
            if self.agents_of(&f.state).await?.caching(&def).cached {
                let ttl = match &def.front.cache {
                    Some(skein_core::agent::CacheSetting::Ttl { ttl }) => {
                        // Checked when the definition was parsed.
                        skein_core::duration::parse(ttl).ok().or(self.cfg.cache_ttl)
                    }
                    _ => self.cfg.cache_ttl,
                };
                let now = self.cfg.clock.now_ms();
                let entry = CacheEntry {
                    answer: f.state.ending.answer.clone().unwrap_or_default(),
                    usage: f.state.usage_total(),
                    source: f.id.clone(),
                    steps: f.state.steps,
                    created: now,
                    expires: ttl.map(|t| now + t.as_millis() as u64),
                };
                self.backend.cache.put(&sub.mission_hash, &entry).await?;
            }
        }
        // Only a session created to be shared claims its mission's run, and only the
        // holder of such a claim is ever watched. One that cannot have been shared has
        // neither a claim to release nor watchers to tell: on NATS that saves two round
        // trips on the way to its parent.
        let shared = self.may_be_shared(f).await;
        if shared {
            self.backend
                .cache
                .release_inflight(&sub.mission_hash, &f.id)
                .await?;
        }
        self.member_exit(f).await?;
        // Children nobody will read any more (a question the model left unanswered, a run
        // its failed or cancelled parent no longer waits for) would wait for ever: they
        // end with their parent.
        for child in f.state.abandoned_children() {
            let (cf, _) = self.load(&child).await?;
            let open = cf.state.submitted.is_some() && !cf.state.status.is_terminal();
            self.keep_state(cf);
            if open {
                let reason = format!(
                    "its parent {} ended ({}) without waiting for it",
                    f.id.display(),
                    f.state.status.as_str()
                );
                Box::pin(crate::control::cancel(self, &child, &reason)).await?;
            }
        }
        let watchers = if shared {
            self.backend.notices.watchers(&f.id).await?
        } else {
            vec![]
        };
        for (w, pool) in watchers {
            self.backend.notices.post(&w, &f.id).await?;
            self.backend.jobs.push(&pool, &w).await?;
        }
        match &sub.parent {
            Some(p) => {
                match self.end_to_carry(f).await {
                    Some(end) => {
                        self.backend
                            .notices
                            .post_end(&p.session, &f.id, end)
                            .await?
                    }
                    None => self.backend.notices.post(&p.session, &f.id).await?,
                }
                let pool = p.pool();
                self.backend.jobs.push(&pool, &p.session).await?;
            }
            None => {
                if let Some(a) = &self.backend.announcer {
                    let r = RootResult {
                        session: f.id.to_string(),
                        seq: f.state.last_seq,
                        status: f.state.status,
                        answer: f.state.ending.answer.clone(),
                        error: f.state.ending.error.clone(),
                        usage: f.state.usage_total(),
                    };
                    a.root_finished(&r).await?;
                }
            }
        }
        // What this job's ack may go by: the end it has told of, and where the log stood.
        self.sessions.told(&f.id, f.state.last_seq);
        Ok(())
    }

    /// The record that ended `f`, for its parent's notice to carry: only when the log is
    /// known to end with it durably, and only when nothing can follow it (an agent that
    /// takes follow-up questions, `chat: true`, may be woken again, and an old notice would
    /// then carry an end that is no longer the last). The parent checks the same from its
    /// side (no follow-up outstanding), and reads the log where either says no.
    async fn end_to_carry<'a>(&self, f: &'a Folded) -> Option<&'a skein_core::Record> {
        let end = f.end.as_deref().filter(|r| r.env.seq == f.state.last_seq)?;
        let def = self.def_for(&f.state).await.ok()?;
        (!def.front.chat).then_some(end)
    }

    /// Whether `f` may hold its mission's single-flight claim, and so have watchers.
    /// `delegate` claims only for a child it creates with caching on: not `no_cache`
    /// (which plan tasks and teams imply) and its agent cached. Whether an agent is cached
    /// by default depends on what it and the agents it may start can do, which a rolling
    /// change of definitions or binaries may judge differently; `cache: false` in its own
    /// file cannot be judged otherwise, so only that, and `no_cache`, say no. A root is
    /// never created by a delegation, but is taken as shared, as before; so is a session
    /// whose definition cannot be read now (it may have ended for that very reason, and
    /// its parent must still hear of it).
    async fn may_be_shared(&self, f: &Folded) -> bool {
        let Some(sub) = &f.state.submitted else {
            return false;
        };
        if sub.no_cache {
            return false;
        }
        if sub.parent.is_none() {
            return true;
        }
        match self.def_for(&f.state).await {
            Ok(def) => !matches!(
                def.front.cache,
                Some(skein_core::agent::CacheSetting::Enabled(false))
            ),
            Err(_) => true,
        }
    }
}
