//! Submission: a root session made from a person's or a program's request.

use serde::Serialize;
use serde_json::Value;
use skein_core::event::{CacheHit, Submitted};
use skein_core::hash::{mission_hash, MissionKey};
use skein_core::{Budget, Event, SessionId};

use crate::runtime::Runtime;
use crate::{new_root_id, Error, Result};

/// A submission from a person or a program.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submission {
    pub agent: String,
    pub mission: String,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub inputs: Value,
    #[serde(default)]
    pub budget: Option<Budget>,
    #[serde(default)]
    pub no_cache: bool,
    /// The caller's W3C traceparent: the tree continues its trace (else a new one starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The tree's priority for model quotas (-100 to 100; higher goes first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// What differs between the submission that holds a root id and another one made under
/// the same id: none when they ask for the same thing (agent, mission, context, inputs and,
/// when the new one names them, the budget and the priority).
pub fn resubmission_differs(
    existing: &Submitted,
    asked: &Submitted,
    named: Named,
) -> Option<String> {
    let empty = |v: &Value| v.is_null() || v.as_object().is_some_and(|o| o.is_empty());
    let mut diffs = vec![];
    if existing.agent != asked.agent {
        diffs.push(format!("agent `{}`, not `{}`", existing.agent, asked.agent));
    }
    if existing.mission != asked.mission {
        diffs.push("another mission".to_string());
    }
    if existing.context != asked.context {
        diffs.push("another context".to_string());
    }
    if existing.inputs != asked.inputs && !(empty(&existing.inputs) && empty(&asked.inputs)) {
        diffs.push("other inputs".to_string());
    }
    if named.budget && existing.budget != asked.budget {
        diffs.push(format!(
            "budget {:?} tokens, not {:?}",
            existing.budget.tokens, asked.budget.tokens
        ));
    }
    // No priority and priority 0 are the same (the log keeps only one that is not 0).
    let (had, wants) = (existing.priority.unwrap_or(0), asked.priority.unwrap_or(0));
    if named.priority && had != wants {
        diffs.push(format!("priority {had}, not {wants}"));
    }
    (!diffs.is_empty()).then(|| format!("it has {}", diffs.join(", ")))
}

/// Which of the fields a resubmission may leave out it names: those it leaves out are
/// not compared.
#[derive(Debug, Clone, Copy, Default)]
pub struct Named {
    pub budget: bool,
    pub priority: bool,
}

impl Runtime {
    /// Validates a submission, creates the root session and enqueues it. Submitting the
    /// same `id` again is a no-op that returns the id.
    pub async fn submit(&self, sub: Submission) -> Result<SessionId> {
        // The tree is pinned to the version current now.
        let version = self.current_version();
        let def = version.agents.get(&sub.agent).ok_or_else(|| {
            Error::refused(
                crate::RefusalKind::UnknownAgent,
                format!(
                    "unknown agent `{}`; known agents: {}",
                    sub.agent,
                    version
                        .agents
                        .agents
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
        skein_core::limits::check_mission(&sub.mission, sub.context.as_deref(), &sub.inputs)
            .map_err(Error::invalid)?;
        if !(sub.inputs.is_null() || sub.inputs.is_object()) {
            return Err(Error::invalid("inputs must be a JSON object"));
        }
        if let Some(p) = sub.priority {
            skein_core::agent::validate_priority(p).map_err(Error::invalid)?;
        }
        let id = match &sub.id {
            Some(t) => SessionId::root(t).map_err(|e| Error::invalid(format!("id: {e}")))?,
            None => new_root_id(),
        };
        let def_digest = self.backend.blobs.put(def.text.as_bytes()).await?;
        let asked_budget = sub.budget;
        let asked_priority = sub.priority;
        let budget = Budget {
            tokens: sub
                .budget
                .and_then(|b| b.tokens)
                .or(def.front.limits.max_tokens)
                .or(version.limits.max_tokens),
            max_steps: sub.budget.and_then(|b| b.max_steps),
        };
        let shape = self.shape_of(&version, def, def.name(), None, &[], &[], 0, budget, None);
        let key = MissionKey {
            def_digest: &def_digest,
            model: &def.front.model,
            mission: &sub.mission,
            context: sub.context.as_deref(),
            inputs: &sub.inputs,
            strategy: def.front.strategy.as_deref(),
            shape: Some(&shape),
        };
        let hash = mission_hash(&key);
        let key = key.parts();
        let submitted = Submitted {
            agent: def.name().to_string(),
            def_digest,
            mission: sub.mission,
            context: sub.context,
            inputs: sub.inputs,
            mission_hash: hash,
            parent: None,
            depth: 0,
            budget,
            trace: Some(crate::trace::for_root(
                &id,
                sub.traceparent.as_deref(),
                &*self.cfg.clock,
            )),
            ancestry: vec![],
            no_cache: sub.no_cache,
            forked_from: None,
            pool: def.front.pool.clone(),
            plan: None,
            request: None,
            allowed_tools: None,
            team: None,
            defs: version.digest.clone(),
            priority: sub.priority.filter(|p| *p != 0),
        };
        let pool = submitted.pool();
        let hash = submitted.mission_hash.clone();
        let cacheable = !submitted.no_cache && version.agents.caching(def).cached;
        let asked = submitted.clone();
        let Some(mut f) = self.create(&id, submitted).await? else {
            // The id is taken: the same submission again is a no-op; another is refused.
            let first = self.backend.log.read(&id, 1).await?;
            let existing = match first.first().map(|r| &r.env.body) {
                Some(Event::Submitted(s)) => s,
                _ => {
                    return Err(Error::corrupt_because(format!(
                        "{id}: log does not start with Submitted"
                    )))
                }
            };
            let named = Named {
                budget: asked_budget.is_some(),
                priority: asked_priority.is_some(),
            };
            if let Some(differs) = resubmission_differs(existing, &asked, named) {
                return Err(Error::IdTaken {
                    id: id.to_string(),
                    differs,
                });
            }
            super::wake(&*self.backend.jobs, &pool, &id).await?;
            return Ok(id);
        };
        // A root mission answered before: record the hit; the worker completes it.
        if cacheable {
            if let Some(hit) = self
                .backend
                .cache
                .get(&hash, self.cfg.clock.now_ms())
                .await?
            {
                let ev = CacheHit {
                    call: String::new(),
                    mission_hash: hash,
                    source: hit.source,
                    answer: hit.answer,
                    saved: hit.usage,
                    steps: hit.steps,
                    key: Some(Box::new(key)),
                };
                self.append(&mut f, Event::CacheHit(ev)).await?;
            }
        }
        crate::spans::set_current(&f.id, &f.state);
        super::wake(&*self.backend.jobs, &pool, &id).await?;
        Ok(id)
    }
}
