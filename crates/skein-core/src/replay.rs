//! Replay verification: re-derive every decision of a log from its prefix and check that
//! the recorded event is one the decision admits.

use serde::Serialize;

use crate::agent::AgentDef;
use crate::decide::Catalog;
use crate::event::{Envelope, Event};
use crate::limits::Limits;
use crate::state::SessionState;

/// The first place where a log and the decisions re-derived from it disagree.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    pub seq: u64,
    pub expected: String,
    pub found: String,
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seq {}: expected {}, found {}",
            self.seq, self.expected, self.found
        )
    }
}

/// Folds `log` event by event; before each event after the first, decides the next step
/// from the prefix and checks the event fits it. `decide` is the decision function, so a
/// caller can verify with a variant of it (the test of the verifier does).
pub fn verify_with<F>(log: &[Envelope], mut decide: F) -> Result<SessionState, Divergence>
where
    F: FnMut(&SessionState) -> crate::decide::Step,
{
    let mut state = SessionState::default();
    for (i, env) in log.iter().enumerate() {
        if i == 0 {
            if !matches!(env.body, Event::Submitted(_)) {
                return Err(Divergence {
                    seq: env.seq,
                    expected: "Submitted".into(),
                    found: env.body.kind().into(),
                });
            }
        } else {
            let step = decide(&state);
            if let Err(msg) = step.admits(&env.body) {
                return Err(Divergence {
                    seq: env.seq,
                    expected: step.name().into(),
                    found: msg,
                });
            }
        }
        state.apply(env);
    }
    Ok(state)
}

/// [`verify_with`] using [`SessionState::next`].
pub fn verify(
    log: &[Envelope],
    def: &AgentDef,
    limits: &Limits,
    catalog: &dyn Catalog,
) -> Result<SessionState, Divergence> {
    verify_with(log, |s| s.next(def, limits, catalog))
}
