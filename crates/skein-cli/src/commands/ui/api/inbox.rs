//! The inbox: open questions and approvals, and the answers and decisions given to them.

use super::*;

#[derive(Deserialize, IntoParams)]
pub struct InboxQuery {
    /// Only this tree (any session id of it).
    pub root: Option<String>,
}

/// Every pending question (of a root) and approval, with its token (as
/// `skein inbox --json`), of the trees not yet ended (read through the index of open
/// roots, so the cost follows the open trees, not the history). An approval's `preview` is the call's whole arguments.
#[utoipa::path(get, path = "/api/inbox", tag = "inbox", params(InboxQuery),
    responses((status = 200, description = "InboxItem objects, as `skein inbox --json`",
        body = Vec<Object>), (status = 503, body = ErrorBody)))]
pub(super) async fn inbox(
    State(ui): State<Arc<Ui>>,
    Query(q): Query<InboxQuery>,
) -> ApiResult<Value> {
    let rt = ui.runtime()?;
    let roots = match &q.root {
        Some(r) => vec![session_id(r)?.root_id()],
        // The open roots only: an ended tree waits for nobody.
        None => ui.backend.log.open_roots().await?,
    };
    Ok(Json(json(&hitl::inbox(rt, &roots).await?)?))
}

#[derive(Deserialize, ToSchema)]
pub struct Answer {
    /// The question's token, from the inbox.
    pub token: String,
    /// One answer per question key.
    #[schema(value_type = Object)]
    pub answers: Value,
}

/// Answers a root's question (the same token checks as `skein answer`); the tree runs on.
#[utoipa::path(post, path = "/api/answer", tag = "inbox", request_body = Answer,
    responses((status = 200, body = Started, description = "the session that was answered"),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub(super) async fn answer(State(ui): State<Arc<Ui>>, Json(a): Json<Answer>) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    let session = hitl::answer(rt, a.token.trim(), a.answers, who()).await?;
    Ok(Json(Started {
        session: session.display(),
    }))
}

#[derive(Deserialize, ToSchema)]
pub struct Decision {
    /// The approval's token, from the inbox.
    pub token: String,
    /// true to approve, false to deny.
    pub approved: bool,
    /// Why (recorded; shown to the model on a denial).
    pub reason: Option<String>,
}

/// Approves or denies a tool call (the same token checks as `skein approve` / `deny`);
/// the tree runs on.
#[utoipa::path(post, path = "/api/approve", tag = "inbox", request_body = Decision,
    responses((status = 200, body = Started, description = "the session decided on"),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub(super) async fn approve(
    State(ui): State<Arc<Ui>>,
    Json(d): Json<Decision>,
) -> ApiResult<Started> {
    let rt = ui.runtime()?;
    let reason = d.reason.filter(|r| !r.trim().is_empty());
    let session = hitl::decide_approval(rt, d.token.trim(), d.approved, reason, who()).await?;
    Ok(Json(Started {
        session: session.display(),
    }))
}
