//! `token`: resume tokens as `skein answer`, `approve`, `deny`, the API and a parent
//! model's `call_agent {resume_token}` hand them in (`token::open` with the secret,
//! `token::peek` without).

use rand::Rng as _;
use serde_json::Value;
use skein_core::token::{open, peek, sign};

use super::{text, FnTarget, Spec};
use crate::fixtures::{sign_raw, TEST_SECRET};
use crate::mutate::Dict;
use crate::structured::mutate_value;
use crate::Rng;

pub const SPEC: Spec = Spec {
    name: "token",
    about: "resume tokens (token::open with the secret, token::peek)",
    max_len: 16 * 1024,
    make: || Ok(Box::new(FnTarget(run))),
    reshape,
    tokens: &[
        "skt1", "skt2", ".", "\"s\"", "\"q\"", "\"n\"", "\"k\"", "input", "approval",
    ],
};

pub fn run(data: &[u8]) -> bool {
    let t = text(data);
    let opened = open(TEST_SECRET, &t);
    let peeked = peek(&t);
    if let Ok(c) = &opened {
        // What a genuine token says is what anyone reading it sees, and signing those
        // claims again gives a token that opens to them.
        assert!(
            peeked.as_ref().is_ok_and(|p| p == c),
            "open and peek disagree"
        );
        assert!(
            open(TEST_SECRET, &sign(TEST_SECRET, c)).is_ok_and(|again| &again == c),
            "re-signed claims do not open to themselves"
        );
    }
    opened.is_ok()
}

/// Mutated claims under a valid signature (what a holder of the secret could make), or
/// under the old one.
fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let t = std::str::from_utf8(seed).ok()?;
    let mut parts = t.trim().split('.');
    let (_, body, tag) = (parts.next()?, parts.next()?, parts.next()?);
    let body = hex::decode(body).ok()?;
    let mut claims: Value = serde_json::from_slice(&body).ok()?;
    mutate_value(rng, &mut claims, dict);
    let body = serde_json::to_vec(&claims).ok()?;
    if rng.gen_bool(0.7) {
        Some(sign_raw(&body).into_bytes())
    } else {
        Some(format!("skt1.{}.{tag}", hex::encode(body)).into_bytes())
    }
}
