//! One session: its events, its state at any seq, the verdict of replay verification, its
//! plan, and a fork from a prefix of its log.

use super::*;

#[derive(Serialize, ToSchema)]
pub struct EventView {
    pub seq: u64,
    /// ms since the Unix epoch.
    pub at: u64,
    pub kind: String,
    /// One readable line, as `skein events` prints it.
    pub line: String,
    pub hash: String,
    /// The whole event.
    #[schema(value_type = Object)]
    pub body: Value,
}

/// A session's log, readable and whole.
#[utoipa::path(get, path = "/api/sessions/{id}/events", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded")),
    responses((status = 200, body = Vec<EventView>), (status = 404, body = ErrorBody)))]
pub(super) async fn events(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
) -> ApiResult<Vec<EventView>> {
    let id = session_id(&id)?;
    let records = ui.records(&id).await?;
    let t0 = records.first().map(|r| r.env.at).unwrap_or(0);
    Ok(Json(
        records
            .iter()
            .map(|r| EventView {
                seq: r.env.seq,
                at: r.env.at,
                kind: r.env.body.kind().to_string(),
                line: render::event_line(r, t0),
                hash: r.hash(),
                body: r.env.body.to_json(),
            })
            .collect(),
    ))
}

#[derive(Deserialize, IntoParams)]
pub struct AtQuery {
    /// The seq to fold up to (default: the last).
    pub at: Option<u64>,
}

#[derive(Serialize, ToSchema)]
pub struct StateView {
    pub session: String,
    pub at: u64,
    pub last_seq: u64,
    /// The folded SessionState (as `skein replay --at N --json`): `transcript`
    /// (messages), `plan`, `turn` (the current turn's calls and where each stands),
    /// `children`, `pending_inputs`, `pending_approvals`, `status`, `usage_own`, …
    #[schema(value_type = Object)]
    pub state: Value,
}

/// The folded state of a session at any seq (as `skein replay --at`).
#[utoipa::path(get, path = "/api/sessions/{id}/state", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded"), AtQuery),
    responses((status = 200, body = StateView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub(super) async fn state(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Query(q): Query<AtQuery>,
) -> ApiResult<StateView> {
    let id = session_id(&id)?;
    let records = ui.records(&id).await?;
    let last = records.len() as u64;
    let at = q.at.unwrap_or(last);
    if at < 1 || at > last {
        return Err(bad(format!(
            "at={at}: the log of {} has seqs 1..={last}",
            id.display()
        )));
    }
    let f = fold_records(&id, &records[..at as usize])?;
    Ok(Json(StateView {
        session: id.display(),
        at,
        last_seq: last,
        state: json(&f.state)?,
    }))
}

#[derive(Deserialize, IntoParams)]
pub struct VerifyQuery {
    /// Every session under this one too.
    #[serde(default)]
    pub tree: bool,
}

#[derive(Serialize, ToSchema)]
pub struct Verdicts {
    pub ok: bool,
    /// SessionVerdict objects: `session`, `events`, `ok`, `problem`, `seq`.
    #[schema(value_type = Vec<Object>)]
    pub sessions: Value,
}

/// The verdict of `skein replay --verify`: every hash chain checked, every decision
/// re-derived from the recorded outputs.
#[utoipa::path(get, path = "/api/sessions/{id}/verify", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded"), VerifyQuery),
    responses((status = 200, body = Verdicts), (status = 404, body = ErrorBody)))]
pub(super) async fn verify(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Query(q): Query<VerifyQuery>,
) -> ApiResult<Verdicts> {
    let id = session_id(&id)?;
    ui.records(&id).await?;
    let verdicts = verify_tree(&ui.backend, &id, &ui.agents, &ui.limits).await?;
    let verdicts: Vec<_> = verdicts
        .into_iter()
        .filter(|v| q.tree || v.session == id.display())
        .collect();
    Ok(Json(Verdicts {
        ok: verdicts.iter().all(|v| v.ok),
        sessions: json(&verdicts)?,
    }))
}

#[derive(Serialize, ToSchema)]
pub struct PlanChange {
    pub seq: u64,
    pub at: u64,
    /// `PatchApplied` or `PatchRejected`.
    pub kind: String,
    /// The agent that proposed it, and its session.
    pub agent: String,
    pub from: String,
    /// The plan's version after it (applied patches).
    pub version: Option<u64>,
    /// Why it was refused (rejected patches).
    pub reason: Option<String>,
    /// The patch's operations (applied patches).
    #[schema(value_type = Vec<Object>)]
    pub ops: Value,
}

#[derive(Serialize, ToSchema)]
pub struct PlanView {
    pub session: String,
    /// The plan now (or at `at`).
    #[schema(value_type = Object)]
    pub plan: Value,
    pub markdown: String,
    pub changes: Vec<PlanChange>,
}

/// The plan a session owns and how it changed: every patch applied or rejected.
#[utoipa::path(get, path = "/api/sessions/{id}/plan", tag = "sessions",
    params(("id" = String, Path, description = "session id, percent-encoded"), AtQuery),
    responses((status = 200, body = PlanView), (status = 404, body = ErrorBody)))]
pub(super) async fn plan(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Query(q): Query<AtQuery>,
) -> ApiResult<PlanView> {
    let id = session_id(&id)?;
    let records = ui.records(&id).await?;
    let state = SessionState::fold(
        records
            .iter()
            .map(|r| &r.env)
            .take_while(|e| q.at.is_none_or(|a| e.seq <= a)),
    );
    let mut changes = vec![];
    for r in &records {
        let (agent, from, version, reason, ops) = match &r.env.body {
            Event::PatchApplied(p) => (&p.agent, &p.from, Some(p.version), None, json(&p.ops)?),
            Event::PatchRejected(p) => (
                &p.agent,
                &p.from,
                None,
                Some(p.reason.to_string()),
                Value::Array(vec![]),
            ),
            _ => continue,
        };
        changes.push(PlanChange {
            seq: r.env.seq,
            at: r.env.at,
            kind: r.env.body.kind().to_string(),
            agent: agent.clone(),
            from: SessionId::parse(from)
                .map(|s| s.display())
                .unwrap_or_else(|_| from.clone()),
            version,
            reason,
            ops,
        });
    }
    Ok(Json(PlanView {
        session: id.display(),
        markdown: state.planning.plan.render_markdown(),
        plan: json(&state.planning.plan)?,
        changes,
    }))
}

#[derive(Deserialize, ToSchema)]
pub struct Fork {
    /// The last event of the source kept in the fork.
    pub at: u64,
    /// Id of the new root session.
    pub new_id: Option<String>,
    /// Continue on another model (`provider:model`).
    pub model: Option<String>,
}

/// A new root session from a prefix of this one, continued live (as `skein fork`).
#[utoipa::path(post, path = "/api/sessions/{id}/fork", tag = "actions",
    params(("id" = String, Path, description = "session id, percent-encoded")),
    request_body = Fork,
    responses((status = 200, body = Started), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub(super) async fn fork_session(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    Json(f): Json<Fork>,
) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    let source = session_id(&id)?;
    let id = fork(
        rt,
        &source,
        f.at,
        ForkSpec {
            model: f.model.filter(|m| !m.is_empty()),
            agent_text: None,
            id: f.new_id.filter(|i| !i.is_empty()),
            current: false,
        },
    )
    .await?;
    Ok(Json(Started {
        session: id.display(),
    }))
}
