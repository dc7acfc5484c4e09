//! What an operator does to a tree from outside, on any backend: read a session's status,
//! cancel a session and everything under it. The `skein.api` service and `skein cancel`
//! both call these.

use serde_json::{json, Value};
use skein_core::event::Cancelled;
use skein_core::{Event, SessionId};

use crate::worker::Runtime;
use crate::{Error, Result};

/// The status of a session, as JSON: `session`, `status`, `answer`, `error`, `steps`,
/// `usage`.
pub async fn status(rt: &Runtime, id: &SessionId) -> Result<Value> {
    let records = rt.backend.log.read(id, 1).await?;
    if records.is_empty() {
        return Err(Error::NotFound(format!("no session {id}")));
    }
    let f = crate::inspect::fold_records(id, &records)?;
    Ok(json!({
        "session": id.to_string(),
        "status": f.state.status.as_str(),
        "answer": f.state.ending.answer,
        "error": f.state.ending.error,
        "steps": f.state.steps,
        "usage": f.state.usage_total(),
    }))
}

/// Cancels every unfinished session of the tree under `id` (`id` itself included), the
/// deepest first: each gets a `Cancelled` event and a job, so that its worker tells its
/// parent (or announces the tree's end). Returns how many were cancelled; sessions that
/// had ended are left as they are, but one cancelled already gets its job again (a cancel
/// tried again after a failure may find its own earlier work).
pub async fn cancel(rt: &Runtime, id: &SessionId, reason: &str) -> Result<usize> {
    let mut n = 0;
    // The deepest first (the subtree is sorted, so every session comes after its
    // ancestors): a session ends only once everything under it has, so a cancel cut
    // short (the backend unreachable, no room) leaves the session open for its retry,
    // never ended above descendants that still run and spend what its total missed.
    let sessions = rt.backend.subtree(id).await?;
    rt.keep_tree(&id.root_id(), &sessions).await?;
    for s in sessions.into_iter().rev() {
        let (f, _) = rt.load(&s).await?;
        // A session named in the tree whose first record was never written (see
        // `EventLog::tree`) has nothing to cancel.
        if f.state.last_seq == 0 || f.state.status.is_terminal() {
            // One cancelled already may be an earlier try's, whose wake-up that try never
            // sent (the backend failed right after the append): without its job nobody
            // tells its parent, or announces the tree's end. Woken again; a job of an
            // ended session does only that.
            let woken = (f.state.status == skein_core::Status::Cancelled).then(|| f.state.pool());
            rt.keep_state(f);
            if let Some(pool) = woken {
                crate::worker::wake(&*rt.backend.jobs, &pool, &s).await?;
            }
            continue;
        }
        let body = Event::Cancelled(Cancelled {
            reason: reason.to_string(),
        });
        let f = match rt
            .append_from_outside(f, body, |g| !g.state.status.is_terminal())
            .await?
        {
            crate::session::Outside::Appended(f) => f,
            crate::session::Outside::Moot(m) => return Err(m.refusal()),
        };
        let pool = f.state.pool();
        rt.keep_state(f);
        crate::worker::wake(&*rt.backend.jobs, &pool, &s).await?;
        n += 1;
    }
    Ok(n)
}
