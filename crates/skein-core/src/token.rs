//! Resume tokens: opaque, HMAC-signed references to a pause — never state themselves.
//!
//! A token names (session, the seq of the event that paused it, a nonce, the kind of
//! pause) and carries an HMAC-SHA256 over those with a secret only the runtime knows.
//! Events record only the nonce (`token_id`), so reading a log does not give the power to
//! answer; the runtime re-derives a token from the event and the secret when it shows the
//! inbox. Form: `skt1.<hex of the JSON claims>.<hex of the MAC>`.
//!
//! Where a log must name a token it does not hold (a child's question bubbled up to its
//! parent's model, the parent's `call_agent {resume_token}`), it records a *reference*:
//! `skr1.<hex of the JSON claims>`, the claims without the signature. A reference answers
//! nothing by itself; the runtime turns it into the token (signing the claims again) when a
//! model is shown it, and a token the model sends back into its reference before the reply
//! is recorded.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::id::SessionId;

type HmacSha256 = Hmac<Sha256>;

const PREFIX: &str = "skt1";
/// Prefix of a reference to a token (see the module's documentation).
pub const REF_PREFIX: &str = "skr1.";

/// What a token refers to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Session that paused.
    #[serde(rename = "s")]
    pub session: SessionId,
    /// Seq of the `InputRequested` / `ApprovalRequested` event.
    #[serde(rename = "q")]
    pub seq: u64,
    /// The token id recorded in that event.
    #[serde(rename = "n")]
    pub nonce: String,
    /// Whether the token answers a question or decides an approval.
    #[serde(rename = "k")]
    pub kind: TokenKind,
}

/// What a token answers. On the wire (inside the signed claims) it is `input` or
/// `approval`, as it always was, so tokens signed before the kind was typed still open;
/// any other text there makes the token malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenKind {
    /// Answers the questions of an `InputRequested`.
    Input,
    /// Approves or denies the call of an `ApprovalRequested`.
    Approval,
}

impl TokenKind {
    /// The name the claims carry.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenKind::Input => "input",
            TokenKind::Approval => "approval",
        }
    }

    /// What a token of this kind is for, in words ("... cannot be used to <this>").
    pub fn purpose(self) -> &'static str {
        match self {
            TokenKind::Input => "answer a question",
            TokenKind::Approval => "approve or deny",
        }
    }
}

impl std::fmt::Display for TokenKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a token was refused, for callers that act on the reason (a status, a test) rather
/// than show it. The words for a person travel beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenRefusal {
    /// Not a token at all: wrong form, version, encoding or claims.
    Malformed,
    /// Well formed, but its signature is not ours.
    Forged,
    /// A genuine token of the other kind (an input token used to approve, say).
    WrongKind,
    /// It names a session that does not exist.
    NoSession,
    /// The session it names has ended (completed, failed, cancelled).
    Ended,
    /// The session has moved on: the pause it names is no longer open.
    Stale,
    /// The pause it names was already answered with it.
    Reused,
    /// It is not this caller's to use: another session's token, or a reference this
    /// session was never given.
    Misdirected,
}

impl TokenRefusal {
    /// A short, stable name (`stale`, `reused`, ...) for replies and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenRefusal::Malformed => "malformed",
            TokenRefusal::Forged => "forged",
            TokenRefusal::WrongKind => "wrong_kind",
            TokenRefusal::NoSession => "no_session",
            TokenRefusal::Ended => "ended",
            TokenRefusal::Stale => "stale",
            TokenRefusal::Reused => "reused",
            TokenRefusal::Misdirected => "misdirected",
        }
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token: {0}")]
    Malformed(String),
    #[error("forged token: its signature does not match")]
    Forged,
}

impl TokenError {
    /// The refusal this error amounts to.
    pub fn refusal(&self) -> TokenRefusal {
        match self {
            TokenError::Malformed(_) => TokenRefusal::Malformed,
            TokenError::Forged => TokenRefusal::Forged,
        }
    }
}

fn mac(secret: &[u8], claims: &[u8]) -> Option<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret).ok()?;
    m.update(PREFIX.as_bytes());
    m.update(claims);
    Some(m)
}

/// Signs claims into a token.
pub fn sign(secret: &[u8], claims: &Claims) -> String {
    let body = serde_json::to_vec(claims).unwrap_or_default();
    let tag = mac(secret, &body)
        .map(|m| m.finalize().into_bytes().to_vec())
        .unwrap_or_default();
    format!("{PREFIX}.{}.{}", hex::encode(&body), hex::encode(tag))
}

/// The claims bytes and the signature bytes of a token, checked for form only.
fn parts(token: &str) -> Result<(Vec<u8>, Vec<u8>), TokenError> {
    let mut parts = token.trim().split('.');
    let (Some(p), Some(body), Some(tag), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed(
            "expected three dot-separated parts".into(),
        ));
    };
    if p != PREFIX {
        return Err(TokenError::Malformed(format!(
            "unknown token version `{p}`"
        )));
    }
    let body = hex::decode(body).map_err(|_| TokenError::Malformed("claims are not hex".into()))?;
    let tag = hex::decode(tag).map_err(|_| TokenError::Malformed("signature is not hex".into()))?;
    Ok((body, tag))
}

fn claims_of(body: &[u8]) -> Result<Claims, TokenError> {
    serde_json::from_slice(body).map_err(|e| TokenError::Malformed(format!("claims: {e}")))
}

/// Checks a token's form and signature (in constant time) and returns its claims. Whether
/// the pause it names is still open is for the caller to check against the log.
pub fn open(secret: &[u8], token: &str) -> Result<Claims, TokenError> {
    let (body, tag) = parts(token)?;
    let m = mac(secret, &body).ok_or_else(|| TokenError::Malformed("no secret".into()))?;
    m.verify_slice(&tag).map_err(|_| TokenError::Forged)?;
    claims_of(&body)
}

/// Reads the claims of a token, or of a reference to one, without checking anything else
/// (the pure core may look at whom a token names; only [`open`] says it is genuine).
pub fn peek(token: &str) -> Result<Claims, TokenError> {
    match token.trim().strip_prefix(REF_PREFIX) {
        Some(hexed) => claims_of(
            &hex::decode(hexed).map_err(|_| TokenError::Malformed("claims are not hex".into()))?,
        ),
        None => claims_of(&parts(token)?.0),
    }
}

/// The reference a log records in place of the token for `claims`.
pub fn reference(claims: &Claims) -> String {
    format!(
        "{REF_PREFIX}{}",
        hex::encode(serde_json::to_vec(claims).unwrap_or_default())
    )
}

/// The token a reference stands for, signed with `secret`; none for anything else.
pub fn from_reference(secret: &[u8], reference: &str) -> Option<String> {
    reference
        .starts_with(REF_PREFIX)
        .then(|| peek(reference).ok())
        .flatten()
        .map(|c| sign(secret, &c))
}

/// Replaces every reference in `text` that `known` holds by what `reveal` makes of it.
/// A reference runs from its prefix to the end of the hex digits that follow it.
pub fn replace_references(
    text: &str,
    known: &std::collections::BTreeSet<String>,
    reveal: impl Fn(&str) -> Option<String>,
) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(REF_PREFIX) {
        out.push_str(&rest[..at]);
        let tail = &rest[at + REF_PREFIX.len()..];
        let hex_len = tail
            .find(|c: char| !c.is_ascii_hexdigit())
            .unwrap_or(tail.len());
        let whole = &rest[at..at + REF_PREFIX.len() + hex_len];
        match known.contains(whole).then(|| reveal(whole)).flatten() {
            Some(t) => out.push_str(&t),
            None => out.push_str(whole),
        }
        rest = &rest[at + whole.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            session: SessionId::parse("01abc.researcher-1").unwrap(),
            seq: 7,
            nonce: "n1".into(),
            kind: TokenKind::Input,
        }
    }

    #[test]
    fn round_trip() {
        let t = sign(b"secret", &claims());
        assert!(t.starts_with("skt1."));
        assert_eq!(open(b"secret", &t).unwrap(), claims());
    }

    #[test]
    fn a_reference_names_the_claims_but_answers_nothing() {
        let r = reference(&claims());
        assert!(r.starts_with(REF_PREFIX));
        assert_eq!(peek(&r).unwrap(), claims());
        assert!(matches!(open(b"secret", &r), Err(TokenError::Malformed(_))));
        let t = from_reference(b"secret", &r).unwrap();
        assert_eq!(t, sign(b"secret", &claims()));
        assert_eq!(from_reference(b"secret", "skt1.00.00"), None);

        // Only known references are replaced, wherever they stand in a text.
        let mut other = claims();
        other.nonce = "n2".into();
        let unknown = reference(&other);
        let known = std::collections::BTreeSet::from([r.clone()]);
        let text = format!("{{\"resume_token\":\"{r}\"}} and {unknown}.");
        let shown = replace_references(&text, &known, |x| from_reference(b"secret", x));
        assert_eq!(
            shown,
            format!("{{\"resume_token\":\"{t}\"}} and {unknown}.")
        );
    }

    #[test]
    fn forged_and_malformed_are_refused() {
        let t = sign(b"secret", &claims());
        assert_eq!(open(b"other", &t), Err(TokenError::Forged));
        // Claims changed (another session), signature kept.
        let mut c = claims();
        c.session = SessionId::parse("01abc.writer-2").unwrap();
        let other = sign(b"secret", &c);
        let spliced = format!(
            "skt1.{}.{}",
            other.split('.').nth(1).unwrap(),
            t.split('.').nth(2).unwrap()
        );
        assert_eq!(open(b"secret", &spliced), Err(TokenError::Forged));
        for bad in ["", "skt1", "skt1.zz.yy", "skt2.00.00", "a.b.c.d"] {
            assert_eq!(
                open(b"secret", bad).map_err(|e| e.refusal()),
                Err(TokenRefusal::Malformed),
                "{bad}"
            );
            assert!(
                matches!(open(b"secret", bad), Err(TokenError::Malformed(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_kind_keeps_its_wire_name_and_an_unknown_kind_is_malformed() {
        // Claims as tokens were signed before the kind was typed.
        for (k, kind) in [
            ("input", TokenKind::Input),
            ("approval", TokenKind::Approval),
        ] {
            let body = format!(r#"{{"s":"01abc.researcher-1","q":7,"n":"n1","k":"{k}"}}"#);
            let tag = mac(b"secret", body.as_bytes())
                .unwrap()
                .finalize()
                .into_bytes();
            let old = format!("skt1.{}.{}", hex::encode(&body), hex::encode(tag));
            let c = open(b"secret", &old).unwrap();
            assert_eq!(c.kind, kind);
            assert_eq!(
                sign(b"secret", &c),
                old,
                "signing again gives the same token"
            );
        }
        let body = r#"{"s":"01abc.researcher-1","q":7,"n":"n1","k":"aproval"}"#;
        let tag = mac(b"secret", body.as_bytes())
            .unwrap()
            .finalize()
            .into_bytes();
        let typo = format!("skt1.{}.{}", hex::encode(body), hex::encode(tag));
        assert_eq!(
            open(b"secret", &typo).map_err(|e| e.refusal()),
            Err(TokenRefusal::Malformed)
        );
    }
}
