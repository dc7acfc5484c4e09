//! `ProposePatch` and result patches: a sub-agent's changes to its parent's plan, merged
//! into the parent's log with the verdict recorded once.

use skein_core::event::Outcome;
use skein_core::{Event, SessionId};

use crate::runtime::Runtime;
use crate::session::Folded;
use crate::{Error, Result};

impl Runtime {
    /// Takes a sub-agent's proposals to its parent's plan and records each verdict as the
    /// tool's result. The verdict is the parent's `PatchApplied`/`PatchRejected`, written
    /// from here under the log's optimistic concurrency (like a person's answer); after a
    /// crash the verdict already recorded there is reused, so nothing is merged twice.
    pub(crate) async fn propose(
        &self,
        f: &mut Folded,
        ps: Vec<skein_core::decide::Proposal>,
    ) -> Result<()> {
        let sub = f.state.submitted.clone();
        let owner = sub.as_ref().and_then(|s| s.parent.clone());
        let agent = sub.map(|s| s.agent).unwrap_or_default();
        let me = f.id.to_string();
        let mut events = vec![];
        for p in ps {
            let verdict = match &owner {
                Some(o) => {
                    self.merge_proposal(&o.session, &me, &agent, &p.call, &p.patch)
                        .await?
                }
                None => Err(skein_core::plan::Rejection::Invalid {
                    reason: "this session has no parent whose plan it could patch".into(),
                }),
            };
            let (j, error) = skein_core::plan::verdict_json(&verdict);
            events.push(Event::tool_result(p.call, j.to_string(), error));
        }
        self.append_all(f, events).await
    }

    pub(crate) async fn merge_proposal(
        &self,
        owner: &SessionId,
        from: &str,
        agent: &str,
        call: &str,
        patch: &skein_core::plan::Patch,
    ) -> Result<std::result::Result<u64, skein_core::plan::Rejection>> {
        let key = skein_core::state::verdict_key(from, call);
        for _ in 0..8 {
            let (mut pf, _) = self.load(owner).await?;
            if let Some(v) = pf.state.planning.plan_verdicts.get(&key).cloned() {
                self.keep_state(pf);
                return Ok(v);
            }
            if pf.state.status.is_terminal() {
                self.keep_state(pf);
                return Ok(Err(skein_core::plan::Rejection::Invalid {
                    reason: "the plan's owner has finished; its plan no longer changes".into(),
                }));
            }
            let author = skein_core::plan::Author::Delegate {
                session: from,
                agent,
            };
            let verdict = pf
                .state
                .planning
                .plan
                .merge(
                    author,
                    patch,
                    self.version_known(&pf.state).limits.plan_unlink,
                )
                .map(|p| p.version);
            let body =
                Event::patch_verdict(from, agent, Some(call.to_string()), patch.clone(), &verdict);
            match self.append(&mut pf, body).await {
                Ok(()) => {
                    self.keep_state(pf);
                    return Ok(verdict);
                }
                // The owner's log moved on: decide again on the fresh plan.
                Err(Error::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::unavailable_because(format!(
            "{owner}: too many concurrent appends while merging a plan patch"
        )))
    }

    /// A child handed tasks of this session's plan may end its answer with a ```patch
    /// block: it is merged here, before the child's `ChildSettled`, and the verdict joins
    /// the outcome the model is shown (`patch`). Recorded once: a verdict already in the
    /// log is reused.
    pub(crate) fn result_patch(
        &self,
        f: &Folded,
        child: &SessionId,
        outcome: &mut Outcome,
        plan: &mut skein_core::plan::Plan,
        events: &mut Vec<Event>,
    ) {
        use skein_core::plan::{verdict_json, Author, Rejection};
        let Outcome::Completed { answer, patch, .. } = outcome else {
            return;
        };
        let from = child.to_string();
        if plan.owned_by(&from).is_empty() {
            return;
        }
        let Some(read) = skein_core::plan::patch_in_answer(answer) else {
            return;
        };
        let key = skein_core::state::verdict_key(&from, skein_core::state::RESULT_PATCH);
        let verdict = match (f.state.planning.plan_verdicts.get(&key), read) {
            (Some(v), _) => v.clone(),
            (None, Err(reason)) => Err(Rejection::Invalid { reason }),
            (None, Ok(p)) => {
                let agent = f
                    .state
                    .children
                    .values()
                    .find(|c| &c.child == child)
                    .map(|c| c.agent.clone())
                    .unwrap_or_default();
                let author = Author::Delegate {
                    session: &from,
                    agent: &agent,
                };
                let v = plan.merge(author, &p, self.version_known(&f.state).limits.plan_unlink);
                let verdict = v.as_ref().map(|n| n.version).map_err(Clone::clone);
                events.push(Event::patch_verdict(from.clone(), agent, None, p, &verdict));
                if let Ok(next) = v {
                    *plan = next;
                }
                verdict
            }
        };
        *patch = Some(verdict_json(&verdict).0);
    }
}
