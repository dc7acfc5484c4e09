//! Human in the loop: resume tokens, answers and approvals from outside, the inbox.
//!
//! A paused session records `InputRequested` / `ApprovalRequested` with a random token id;
//! the token a person (or a parent model) holds is derived from that event and the secret
//! ([`skein_core::token`]), so logs never contain a usable token. Every check is made
//! against the log before anything is written: a forged, malformed, stale (the session
//! moved on), reused, or misdirected token is refused with its reason and changes nothing.

use std::path::Path;

use rand::RngCore;
use serde::Serialize;
use serde_json::Value;
use skein_core::decide::{expected_keys, missing_answers};
use skein_core::event::{ApprovalGiven, InputProvided};
use skein_core::state::{PendingApproval, PendingInput};
use skein_core::token::{open, sign, Claims};
use skein_core::{Event, SessionId};

use crate::worker::{Folded, Runtime, DEFAULT_POOL};
use crate::{Error, Result};

/// Longest answer (the answers object as JSON) or denial reason a person may give, in
/// bytes. Anything longer is refused before a word of it is written.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Shortest token-signing secret accepted, in bytes (from the environment or a file).
pub const MIN_SECRET_BYTES: usize = 16;

/// Refuses an answer or a reason over [`MAX_ANSWER_BYTES`], naming its size and the limit.
pub fn check_answer_size(what: &str, bytes: usize) -> Result<()> {
    if bytes > MAX_ANSWER_BYTES {
        return Err(Error::Rejected(format!(
            "{what} is {bytes} bytes; at most {MAX_ANSWER_BYTES} bytes are accepted"
        )));
    }
    Ok(())
}

/// The token-signing secret. Never printed.
#[derive(Clone)]
pub struct Secret(pub Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// The secret from `env_var` when set; otherwise the one kept in `data_dir`
    /// (`token.secret`, made on first use, readable by the owner only).
    pub fn load_or_create(env_var: &str, data_dir: &Path) -> Result<Self> {
        if let Ok(v) = std::env::var(env_var) {
            if v.len() < MIN_SECRET_BYTES {
                return Err(Error::Rejected(format!(
                    "{env_var} must be at least {MIN_SECRET_BYTES} characters"
                )));
            }
            return Ok(Self(v.into_bytes()));
        }
        let path = data_dir.join("token.secret");
        match std::fs::read(&path) {
            Ok(v) => {
                let v = v.trim_ascii();
                if v.len() < MIN_SECRET_BYTES {
                    return Err(Error::Rejected(format!(
                        "the token secret in {} holds {} bytes; at least {MIN_SECRET_BYTES} \
                         are needed (remove the file to have a new one made, which makes \
                         the tokens handed out so far invalid, or set {env_var})",
                        path.display(),
                        v.len()
                    )));
                }
                return Ok(Self(v.to_vec()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::Backend(format!(
                    "cannot read the token secret {}: {e}",
                    path.display()
                )))
            }
        }
        std::fs::create_dir_all(data_dir).map_err(|e| Error::Backend(e.to_string()))?;
        let mut b = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut b);
        let hexed = hex::encode(b);
        write_private(&path, hexed.as_bytes())?;
        Ok(Self(hexed.into_bytes()))
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts
        .open(path)
        .map_err(|e| Error::Backend(format!("cannot create {}: {e}", path.display())))?;
    f.write_all(data).map_err(|e| Error::Backend(e.to_string()))
}

/// A fresh token id (the nonce recorded in the pausing event).
pub fn new_token_id() -> String {
    let mut b = [0u8; 12];
    rand::thread_rng().fill_bytes(&mut b);
    hex::encode(b)
}

pub fn input_token(secret: &Secret, session: &SessionId, p: &PendingInput) -> String {
    sign(
        &secret.0,
        &Claims {
            session: session.clone(),
            seq: p.seq,
            nonce: p.token_id.clone(),
            kind: "input".into(),
        },
    )
}

pub fn approval_token(secret: &Secret, session: &SessionId, p: &PendingApproval) -> String {
    sign(
        &secret.0,
        &Claims {
            session: session.clone(),
            seq: p.seq,
            nonce: p.token_id.clone(),
            kind: "approval".into(),
        },
    )
}

/// Checks a token against the log of the session it names. Returns its claims and the
/// session's fold (taken from the runtime's cache; the caller must give it back).
pub async fn check_token(rt: &Runtime, token: &str, kind: &str) -> Result<(Claims, Folded)> {
    let claims = open(&rt.cfg.token_secret.0, token).map_err(|e| Error::Rejected(e.to_string()))?;
    if claims.kind != kind {
        return Err(Error::Rejected(format!(
            "this is an {} token; it cannot be used to {}",
            claims.kind,
            if kind == "input" {
                "answer a question"
            } else {
                "approve or deny"
            }
        )));
    }
    let (f, _) = rt.load(&claims.session).await?;
    if f.state.submitted.is_none() {
        return Err(Error::Rejected(format!(
            "no session {}",
            claims.session.display()
        )));
    }
    let open_now = match kind {
        "input" => f
            .state
            .pending_inputs
            .iter()
            .any(|p| p.token_id == claims.nonce && p.seq == claims.seq),
        _ => f
            .state
            .pending_approvals
            .iter()
            .any(|p| p.token_id == claims.nonce && p.seq == claims.seq),
    };
    if !open_now {
        let why = if f.state.used_tokens.contains(&claims.nonce) {
            "reused token: it was already answered".to_string()
        } else {
            format!(
                "stale token: session {} has moved on (it is {} at seq {})",
                claims.session.display(),
                f.state.status.as_str(),
                f.state.last_seq
            )
        };
        rt.keep_state(f);
        return Err(Error::Rejected(why));
    }
    Ok((claims, f))
}

/// Missing keys as a readable refusal.
pub fn check_answers(questions: &Value, answers: &Value) -> Result<()> {
    if !answers.is_object() {
        return Err(Error::Rejected("answers must be a JSON object".into()));
    }
    let missing = missing_answers(questions, answers);
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Rejected(format!(
        "missing answers: {}",
        missing
            .iter()
            .map(|(k, q)| format!("`{k}` ({q})"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// Appends to a session whose job someone else may hold: on a conflict, reloads and
/// retries while `still_valid` holds for the fresh fold.
pub async fn append_from_outside(
    rt: &Runtime,
    mut f: Folded,
    body: Event,
    still_valid: impl Fn(&Folded) -> bool,
) -> Result<Folded> {
    for _ in 0..5 {
        match rt.append(&mut f, body.clone()).await {
            Ok(()) => return Ok(f),
            Err(Error::Conflict { .. }) => {
                let (fresh, _) = rt.load(&f.id).await?;
                if !still_valid(&fresh) {
                    rt.keep_state(fresh);
                    return Err(Error::Rejected("stale token: the session moved on".into()));
                }
                f = fresh;
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::Backend(format!(
        "{}: too many concurrent appends",
        f.id
    )))
}

fn pool_of(f: &Folded) -> String {
    f.state
        .submitted
        .as_ref()
        .and_then(|s| s.pool.clone())
        .unwrap_or_else(|| DEFAULT_POOL.into())
}

/// A person's answer to a root's question. Child questions go to their parent's model
/// (which resumes the child with `call_agent {resume_token, answers}`), never to a person.
pub async fn answer(
    rt: &Runtime,
    token: &str,
    answers: Value,
    by: Option<String>,
) -> Result<SessionId> {
    check_answer_size("the answer", answers.to_string().len())?;
    let (claims, f) = check_token(rt, token, "input").await?;
    if !claims.session.is_root() {
        rt.keep_state(f);
        return Err(Error::Rejected(format!(
            "this token belongs to sub-agent {}: its question goes to its parent agent, which \
             answers it or asks you itself; answer the root's question instead",
            claims.session.display()
        )));
    }
    let Some(p) = f
        .state
        .pending_inputs
        .iter()
        .find(|p| p.token_id == claims.nonce)
        .cloned()
    else {
        rt.keep_state(f);
        return Err(Error::Rejected("stale token".into()));
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
    let f = append_from_outside(rt, f, body, |g| {
        g.state.pending_inputs.iter().any(|p| p.token_id == nonce)
    })
    .await?;
    let pool = pool_of(&f);
    rt.keep_state(f);
    rt.backend.jobs.push(&pool, &claims.session).await?;
    Ok(claims.session)
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
    let (claims, f) = check_token(rt, token, "approval").await?;
    let Some(p) = f
        .state
        .pending_approvals
        .iter()
        .find(|p| p.token_id == claims.nonce)
        .cloned()
    else {
        rt.keep_state(f);
        return Err(Error::Rejected("stale token".into()));
    };
    let nonce = claims.nonce.clone();
    let body = Event::ApprovalGiven(ApprovalGiven {
        call: p.call,
        approved,
        by,
        reason,
        token_id: nonce.clone(),
    });
    let f = append_from_outside(rt, f, body, |g| {
        g.state
            .pending_approvals
            .iter()
            .any(|p| p.token_id == nonce)
    })
    .await?;
    let pool = pool_of(&f);
    rt.keep_state(f);
    rt.backend.jobs.push(&pool, &claims.session).await?;
    Ok(claims.session)
}

/// One pending question or approval.
#[derive(Debug, Clone, Serialize)]
pub struct InboxItem {
    pub session: String,
    pub agent: String,
    /// `question` or `approval`.
    pub kind: String,
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

/// Every question for a person (the roots') and every approval in the trees of `roots`.
pub async fn inbox(rt: &Runtime, roots: &[SessionId]) -> Result<Vec<InboxItem>> {
    let mut out = vec![];
    for root in roots {
        for id in rt.backend.log.tree(root).await? {
            let records = rt.backend.log.read(&id, 1).await?;
            let mut f = Folded::new(id.clone());
            f.absorb(&records)?;
            // A session that ended (cancelled, say) waits for no one.
            if f.state.status.is_terminal() {
                continue;
            }
            let agent = f
                .state
                .submitted
                .as_ref()
                .map(|s| s.agent.clone())
                .unwrap_or_default();
            if id.is_root() {
                for p in &f.state.pending_inputs {
                    out.push(InboxItem {
                        session: id.display(),
                        agent: agent.clone(),
                        kind: "question".into(),
                        token: input_token(&rt.cfg.token_secret, &id, p),
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
            for p in &f.state.pending_approvals {
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
                    kind: "approval".into(),
                    token: approval_token(&rt.cfg.token_secret, &id, p),
                    questions: vec![],
                    context: None,
                    proposed_defaults: Value::Null,
                    tool: Some(p.tool.clone()),
                    preview: Some(args),
                });
            }
        }
    }
    Ok(out)
}
