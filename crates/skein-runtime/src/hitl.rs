//! Human in the loop: resume tokens, answers and approvals from outside, the inbox.
//!
//! A paused session records `InputRequested` / `ApprovalRequested` with a random token id;
//! the token a person (or a parent model) holds is derived from that event and the secret
//! ([`skein_core::token`]), so logs never contain a usable token. Every check is made
//! against the log before anything is written: a forged, malformed, stale (the session
//! moved on), reused, or misdirected token is refused with its reason and changes nothing.

use serde::Serialize;
use serde_json::Value;
use skein_core::decide::{expected_keys, missing_answers};
use skein_core::event::{ApprovalGiven, InputProvided};
use skein_core::state::{PendingApproval, PendingInput};
use skein_core::token::{open, sign, Claims, TokenKind};
use skein_core::{Event, SessionId};

use crate::runtime::Runtime;
pub use crate::secret::{new_token_id, Secret, MIN_SECRET_BYTES};
use crate::session::{Folded, Outside};
use crate::{Error, Result, TokenRefusal};

/// Longest answer (the answers object as JSON) or denial reason a person may give, in
/// bytes. Anything longer is refused before a word of it is written.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Refuses an answer or a reason over [`MAX_ANSWER_BYTES`], naming its size and the limit.
pub fn check_answer_size(what: &str, bytes: usize) -> Result<()> {
    if bytes > MAX_ANSWER_BYTES {
        return Err(Error::invalid(format!(
            "{what} is {bytes} bytes; at most {MAX_ANSWER_BYTES} bytes are accepted"
        )));
    }
    Ok(())
}

pub fn input_token(secret: &Secret, session: &SessionId, p: &PendingInput) -> String {
    token_for(secret, session, p.seq, &p.token_id, TokenKind::Input)
}

pub fn approval_token(secret: &Secret, session: &SessionId, p: &PendingApproval) -> String {
    token_for(secret, session, p.seq, &p.token_id, TokenKind::Approval)
}

fn token_for(
    secret: &Secret,
    session: &SessionId,
    seq: u64,
    nonce: &str,
    kind: TokenKind,
) -> String {
    sign(
        &secret.0,
        &Claims {
            session: session.clone(),
            seq,
            nonce: nonce.to_string(),
            kind,
        },
    )
}

/// Checks a token of `kind` against the log of the session it names. Returns its claims
/// and the session's fold (taken from the runtime's cache; the caller must give it back).
/// A refusal is [`crate::RefusalKind::Token`] with the [`TokenRefusal`] that says why.
pub async fn check_token(rt: &Runtime, token: &str, kind: TokenKind) -> Result<(Claims, Folded)> {
    let claims = open(&rt.cfg.token_secret.0, token)
        .map_err(|e| Error::token(e.refusal(), e.to_string()))?;
    if claims.kind != kind {
        return Err(Error::token(
            TokenRefusal::WrongKind,
            format!(
                "this is an {} token; it cannot be used to {}",
                claims.kind,
                kind.purpose()
            ),
        ));
    }
    let (f, _) = rt.load(&claims.session).await?;
    if f.state.submitted.is_none() {
        return Err(Error::token(
            TokenRefusal::NoSession,
            format!("no session {}", claims.session.display()),
        ));
    }
    // A session that ended (cancelled, failed, completed) takes no answer and no decision,
    // whatever it was waiting for when it ended.
    if f.state.status.is_terminal() {
        let why = match f
            .state
            .admits_from_outside(&Event::InputProvided(InputProvided {
                answers: Value::Null,
                token_id: String::new(),
                by: None,
            })) {
            Err(why) => why,
            Ok(()) => format!("session {} has ended", claims.session.display()),
        };
        let (refusal, why) = if f.state.pauses.used_tokens.contains(&claims.nonce) {
            (
                TokenRefusal::Reused,
                format!("reused token: it was already answered, and {why}"),
            )
        } else {
            (TokenRefusal::Ended, why)
        };
        rt.keep_state(f);
        return Err(Error::token(refusal, why));
    }
    let open_now = match kind {
        TokenKind::Input => f
            .state
            .pauses
            .pending_inputs
            .iter()
            .any(|p| p.token_id == claims.nonce && p.seq == claims.seq),
        TokenKind::Approval => f
            .state
            .pauses
            .pending_approvals
            .iter()
            .any(|p| p.token_id == claims.nonce && p.seq == claims.seq),
    };
    if !open_now {
        let (refusal, why) = if f.state.pauses.used_tokens.contains(&claims.nonce) {
            // The answer is recorded; the wake that followed it may have failed (the
            // backend unreachable just then), and whoever holds the token tries again:
            // wake the session now (if that fails too, the caller is told so, and tries
            // again), and still refuse the token.
            let pool = f.state.pool();
            if let Err(e) = crate::worker::wake(&*rt.backend.jobs, &pool, &claims.session).await {
                rt.keep_state(f);
                return Err(e);
            }
            (
                TokenRefusal::Reused,
                "reused token: it was already answered".to_string(),
            )
        } else {
            (
                TokenRefusal::Stale,
                format!(
                    "stale token: session {} has moved on (it is {} at seq {})",
                    claims.session.display(),
                    f.state.status.as_str(),
                    f.state.last_seq
                ),
            )
        };
        rt.keep_state(f);
        return Err(Error::token(refusal, why));
    }
    Ok((claims, f))
}

/// Missing keys, and keys no question asked for, as a readable refusal.
pub fn check_answers(questions: &Value, answers: &Value) -> Result<()> {
    let Some(given) = answers.as_object() else {
        return Err(Error::invalid("answers must be a JSON object"));
    };
    let expected = expected_keys(questions);
    let unasked: Vec<String> = given
        .keys()
        .filter(|k| !expected.iter().any(|(e, _)| e == *k))
        .map(|k| format!("`{}`", k.escape_debug()))
        .collect();
    if !unasked.is_empty() {
        return Err(Error::invalid(format!(
            "answers for questions that were not asked: {}; the questions expect {}",
            unasked.join(", "),
            expected
                .iter()
                .map(|(k, _)| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let missing = missing_answers(questions, answers);
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "missing answers: {}",
        missing
            .iter()
            .map(|(k, q)| format!("`{k}` ({q})"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// A person's answer to a question of the inbox: a root's, or one of a session a pattern
/// started (a handoff's target, a route's destination, a team's member), at any depth.
/// Questions of a `call_agent` child go to its parent's model (which resumes the child
/// with `call_agent {resume_token, answers}`), never to a person.
pub async fn answer(
    rt: &Runtime,
    token: &str,
    answers: Value,
    by: Option<String>,
) -> Result<SessionId> {
    check_answer_size("the answer", answers.to_string().len())?;
    let (claims, f) = check_token(rt, token, TokenKind::Input).await?;
    if !f.state.asks_a_person() {
        rt.keep_state(f);
        return Err(Error::token(
            TokenRefusal::Misdirected,
            format!(
                "this token belongs to sub-agent {}: its question goes to its parent agent, which \
             answers it or asks you itself; answer the question in your inbox instead",
                claims.session.display()
            ),
        ));
    }
    let Some(p) = f
        .state
        .pauses
        .pending_inputs
        .iter()
        .find(|p| p.token_id == claims.nonce)
        .cloned()
    else {
        rt.keep_state(f);
        return Err(Error::token(TokenRefusal::Stale, "stale token"));
    };
    if let Err(e) = check_answers(&p.questions, &answers) {
        rt.keep_state(f);
        return Err(e);
    }
    let nonce = claims.nonce.clone();
    let body = Event::InputProvided(InputProvided {
        answers,
        token_id: nonce.clone(),
        by,
    });
    record_and_wake(rt, f, body, &claims.session, |g| {
        g.state
            .pauses
            .pending_inputs
            .iter()
            .any(|p| p.token_id == nonce)
    })
    .await
}

/// A person's decision on an approval, for any session of a tree.
pub async fn decide_approval(
    rt: &Runtime,
    token: &str,
    approved: bool,
    reason: Option<String>,
    by: Option<String>,
) -> Result<SessionId> {
    if let Some(r) = &reason {
        check_answer_size("the reason", r.len())?;
    }
    let (claims, f) = check_token(rt, token, TokenKind::Approval).await?;
    let Some(p) = f
        .state
        .pauses
        .pending_approvals
        .iter()
        .find(|p| p.token_id == claims.nonce)
        .cloned()
    else {
        rt.keep_state(f);
        return Err(Error::token(TokenRefusal::Stale, "stale token"));
    };
    let nonce = claims.nonce.clone();
    let body = Event::ApprovalGiven(ApprovalGiven {
        call: p.call,
        approved,
        by,
        reason,
        token_id: nonce.clone(),
    });
    record_and_wake(rt, f, body, &claims.session, |g| {
        g.state
            .pauses
            .pending_approvals
            .iter()
            .any(|p| p.token_id == nonce)
    })
    .await?;
    Ok(claims.session)
}

/// What an inbox item waits for: `question` or `approval` in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InboxKind {
    /// A question for a person, answered with `skein answer`.
    Question,
    /// A tool call waiting for approval, decided with `skein approve` or `skein deny`.
    Approval,
}

impl InboxKind {
    pub fn as_str(self) -> &'static str {
        match self {
            InboxKind::Question => "question",
            InboxKind::Approval => "approval",
        }
    }
}

impl std::fmt::Display for InboxKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One pending question or approval.
#[derive(Debug, Clone, Serialize)]
pub struct InboxItem {
    pub session: String,
    pub agent: String,
    pub kind: InboxKind,
    pub token: String,
    /// For questions: `[{key, question}]`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub questions: Vec<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub proposed_defaults: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// For approvals: the call's whole arguments as JSON, every byte that would run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preview: Option<String>,
}

/// Every question for a person (see [`SessionState::asks_a_person`]) and every approval
/// in the trees of `roots`, and in the runs of other trees they wait on: a child shared
/// by single-flight lives in the tree that started it, and a person asked there holds up
/// every tree that joined it. Each item is listed once.
///
/// [`SessionState::asks_a_person`]: skein_core::state::SessionState::asks_a_person
pub async fn inbox(rt: &Runtime, roots: &[SessionId]) -> Result<Vec<InboxItem>> {
    let mut out = vec![];
    let mut seen = std::collections::HashSet::new();
    for root in roots {
        let mut todo = rt.backend.log.tree(root).await?;
        // The tree's own logs read together; those of trees it waits on, one by one.
        let logs = crate::inspect::tree_logs(&rt.backend, root, &todo).await?;
        let mut read: std::collections::HashMap<SessionId, Vec<skein_core::Record>> =
            todo.iter().cloned().zip(logs).collect();
        while let Some(id) = todo.pop() {
            if !seen.insert(id.clone()) {
                continue;
            }
            let records = match read.remove(&id) {
                Some(records) => records,
                None => rt.backend.log.read(&id, 1).await?,
            };
            let mut f = Folded::new(id.clone());
            f.absorb(&records)?;
            out.extend(waiting_in(&rt.cfg.token_secret, &f));
            if f.state.status.is_terminal() {
                continue;
            }
            for c in f.state.children.values() {
                if c.outcome.is_none() && !id.root_id().contains(&c.child) {
                    match rt.backend.subtree(&c.child).await {
                        Ok(ids) => todo.extend(ids),
                        Err(crate::Error::NotFound(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }
    Ok(out)
}

/// What one folded session waits for from a person: its questions, if a person answers
/// them (a root's, a pattern child's), and its approvals. Nothing for a session that
/// ended (cancelled, say).
pub fn waiting_in(secret: &Secret, f: &Folded) -> Vec<InboxItem> {
    let mut out = vec![];
    let id = &f.id;
    if f.state.status.is_terminal() {
        return out;
    }
    let agent = f
        .state
        .submitted
        .as_ref()
        .map(|s| s.agent.clone())
        .unwrap_or_default();
    if f.state.asks_a_person() {
        for p in &f.state.pauses.pending_inputs {
            out.push(InboxItem {
                session: id.display(),
                agent: agent.clone(),
                kind: InboxKind::Question,
                token: input_token(secret, id, p),
                questions: expected_keys(&p.questions)
                    .into_iter()
                    .map(|(k, q)| serde_json::json!({"key": k, "question": q}))
                    .collect(),
                context: p.context.clone(),
                proposed_defaults: p.defaults.clone(),
                tool: None,
                preview: None,
            });
        }
    }
    for p in &f.state.pauses.pending_approvals {
        // The arguments that will run if approved, whole: the call's own, not the
        // preview recorded with the request (older logs cut it at 500 bytes).
        let args = f
            .state
            .turn
            .iter()
            .find(|s| s.call.id == p.call)
            .map(|s| s.call.args.to_string())
            .unwrap_or_else(|| p.preview.clone());
        out.push(InboxItem {
            session: id.display(),
            agent: agent.clone(),
            kind: InboxKind::Approval,
            token: approval_token(secret, id, p),
            questions: vec![],
            context: None,
            proposed_defaults: Value::Null,
            tool: Some(p.tool.clone()),
            preview: Some(args),
        });
    }
    out
}

/// Records a person's answer or decision in the session's log, while `still_pending` holds
/// for its fold, and wakes the session.
async fn record_and_wake(
    rt: &Runtime,
    f: Folded,
    body: Event,
    session: &SessionId,
    still_pending: impl Fn(&Folded) -> bool,
) -> Result<SessionId> {
    let f = match rt.append_from_outside(f, body, still_pending).await? {
        Outside::Appended(f) => f,
        Outside::Moot(m) => return Err(m.refusal()),
    };
    let pool = f.state.pool();
    rt.keep_state(f);
    crate::worker::wake(&*rt.backend.jobs, &pool, session).await?;
    Ok(session.clone())
}
