//! Teams: a member's or the supervisor's `team_broadcast` recorded in every teammate's
//! log, a member's last word when it ends, and the members still running cancelled once
//! the supervisor has answered.

use skein_core::decide::Broadcast;
use skein_core::event::{BroadcastKind, TeamBroadcast, TeamRole};
use skein_core::{Event, SessionId, Status};

use crate::runtime::Runtime;
use crate::session::{Folded, Outside};
use crate::{Error, Result};

use skein_core::event::EXIT_CALL;

impl Runtime {
    /// `Broadcast`: each message goes into every teammate's log that is still open, then
    /// the calls' results are recorded here. A broadcast delivered before a crash is not
    /// delivered twice: a teammate keeps the sender and call of every one it received.
    pub(crate) async fn broadcast(&self, f: &mut Folded, bs: Vec<Broadcast>) -> Result<()> {
        let Some(sub) = f.state.submitted.clone() else {
            return Err(Error::NotFound(format!("{} has no Submitted event", f.id)));
        };
        let peers = sub
            .team
            .as_ref()
            .map(|t| t.peers.clone())
            .unwrap_or_default();
        let mut events = vec![];
        for b in bs {
            let msg = TeamBroadcast {
                from: f.id.clone(),
                agent: sub.agent.clone(),
                call: b.call.clone(),
                kind: b.kind,
                message: b.message,
                turns: Some(f.state.steps),
            };
            let reached = self.deliver(&peers, &msg).await?;
            let left = peers.len() - reached;
            let mut out = format!("broadcast to {reached} teammates");
            if left > 0 {
                out.push_str(&format!(" ({left} had left the team)"));
            }
            events.push(Event::tool_result(b.call, out, false));
        }
        self.append_all(f, events).await
    }

    /// A member has ended: its answer (or why it ended) goes to its teammates as its last
    /// word, so the supervisor knows it has left. Idempotent, like every end step.
    pub(crate) async fn member_exit(&self, f: &Folded) -> Result<()> {
        let Some(sub) = &f.state.submitted else {
            return Ok(());
        };
        let Some(seat) = sub.team.as_ref().filter(|t| t.role == TeamRole::Member) else {
            return Ok(());
        };
        // A member that failed is announced as a failure, apart from a member's own exit
        // (reference 001); either way it has left, and the supervisor counts it gone.
        let (kind, message) = match f.state.status {
            Status::Completed => (
                BroadcastKind::Exit,
                f.state.ending.answer.clone().unwrap_or_default(),
            ),
            Status::Failed => (
                BroadcastKind::Failure,
                format!(
                    "member `{}` failed and is no longer in the team. Reason: {}",
                    sub.agent,
                    f.state.ending.error.as_deref().unwrap_or("unknown")
                ),
            ),
            _ => (
                BroadcastKind::Exit,
                format!(
                    "`{}` left the team: {}",
                    sub.agent,
                    f.state.ending.error.as_deref().unwrap_or("it ended")
                ),
            ),
        };
        let msg = TeamBroadcast {
            from: f.id.clone(),
            agent: sub.agent.clone(),
            call: EXIT_CALL.into(),
            kind,
            message,
            turns: Some(f.state.steps),
        };
        // Boxed: every session's end awaits this step, which a team member alone takes.
        Box::pin(self.deliver(&seat.peers, &msg)).await?;
        Ok(())
    }

    /// Records `msg` in the log of every peer still open that has not received it, and
    /// wakes each. Returns how many peers hold it.
    async fn deliver(&self, peers: &[SessionId], msg: &TeamBroadcast) -> Result<usize> {
        let key = msg.key();
        let open = |g: &Folded| !g.state.status.is_terminal() && !g.state.team.seen.contains(&key);
        let mut reached = 0;
        for p in peers {
            let (pf, _) = self.load(p).await?;
            if pf.state.submitted.is_none() || pf.state.status.is_terminal() {
                self.keep_state(pf);
                continue;
            }
            if pf.state.team.seen.contains(&key) {
                reached += 1;
                self.keep_state(pf);
                continue;
            }
            let pool = pf.state.pool();
            match self
                .append_from_outside(pf, Event::TeamBroadcast(msg.clone()), open)
                .await
            {
                Ok(Outside::Appended(pf)) => {
                    self.keep_state(pf);
                    self.backend.jobs.push(&pool, p).await?;
                    reached += 1;
                }
                // It ended (or received it) meanwhile.
                Ok(Outside::Moot(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(reached)
    }

    /// The supervisor of this session's team has answered: the members still running are
    /// cancelled, and settle as any child does.
    pub(crate) async fn end_team(&self, f: &Folded) -> Result<()> {
        let supervisor = f
            .state
            .turn
            .iter()
            .find(|s| s.call.name == skein_core::state::SUPERVISOR)
            .and_then(|s| s.call.args.get("agent").and_then(|a| a.as_str()))
            .unwrap_or("supervisor")
            .to_string();
        // The supervisor's slot says how it ended: an answer, or a failure.
        let failed = f.state.turn.iter().find_map(|s| match &s.state {
            skein_core::state::SlotState::Done {
                output,
                error: true,
            } if s.call.name == skein_core::state::SUPERVISOR => Some(output.clone()),
            _ => None,
        });
        let reason = match failed {
            Some(why) => {
                format!("the team's supervisor `{supervisor}` failed ({why}); the team is over")
            }
            None => format!("the team's supervisor `{supervisor}` has answered"),
        };
        for member in f.state.team_leftovers() {
            crate::control::cancel(self, &member, &reason).await?;
        }
        Ok(())
    }
}
