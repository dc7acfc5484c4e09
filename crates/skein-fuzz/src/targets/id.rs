//! `id`: session ids and idempotency keys, as `skein run --id`, the `id` of a submission,
//! a `Nats-Msg-Id` header and every command that names a session read them.

use rand::Rng as _;
use skein_core::SessionId;

use super::{text, FnTarget, Spec};
use crate::mutate::{multibyte_char, Dict};
use crate::Rng;

pub const SPEC: Spec = Spec {
    name: "id",
    about: "session ids and idempotency keys (SessionId::parse, SessionId::root)",
    max_len: 4096,
    make: || Ok(Box::new(FnTarget(run))),
    reshape,
    tokens: &["/", ".", "-1", "-2", "researcher-1", "writer-2", "_", " "],
};

pub fn run(data: &[u8]) -> bool {
    let s = text(data);
    let root = SessionId::root(&s);
    let parsed = SessionId::parse(&s);
    if let Ok(id) = &parsed {
        // What a parsed id is used for must not fail, and its shown form must read back.
        let shown = id.display();
        let again = SessionId::parse(&shown);
        assert!(
            again.as_ref().is_ok_and(|a| a == id),
            "`{shown}` does not parse back to {id}: {again:?}"
        );
        let _ = (id.depth(), id.path_agents(), id.root_id(), id.is_root());
        if let Some(p) = id.parent() {
            assert!(p.contains(id), "{p} does not contain its child {id}");
        }
        let json = serde_json::to_string(id).unwrap_or_default();
        let back: Result<SessionId, _> = serde_json::from_str(&json);
        assert!(back.is_ok_and(|b| &b == id), "{id} does not survive JSON");
    }
    if let Ok(r) = &root {
        assert!(r.is_root(), "root `{r}` has a parent");
    }
    root.is_ok() || parsed.is_ok()
}

/// Ids built from tokens of chosen lengths (around the 64-byte token and 512-byte id
/// limits), with multi-byte characters near the byte offsets error messages cut at.
fn reshape(rng: &mut Rng, _seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let tokens = rng.gen_range(1..=4);
    let mut out = String::new();
    for i in 0..tokens {
        if i > 0 {
            out.push(if rng.gen_bool(0.5) { '.' } else { '/' });
        }
        let mut tok = match rng.gen_range(0..3) {
            0 => dict.pick_str(rng),
            1 => {
                let n = [1, 15, 16, 17, 26, 63, 64, 65, 100, 300][rng.gen_range(0..10)];
                (0..n)
                    .map(|_| {
                        let c = rng.gen_range(0..38u8);
                        match c {
                            0..=25 => (b'a' + c) as char,
                            26..=35 => (b'0' + c - 26) as char,
                            36 => '-',
                            _ => '_',
                        }
                    })
                    .collect()
            }
            _ => format!("{}-{}", dict.pick_str(rng), rng.gen_range(0..100u32)),
        };
        if rng.gen_bool(0.4) {
            let at = [0, 14, 15, 16, 17, 63, 64][rng.gen_range(0..7)];
            let at = (0..=at.min(tok.len()))
                .rev()
                .find(|i| tok.is_char_boundary(*i))
                .unwrap_or(0);
            tok.insert(at, multibyte_char(rng));
        }
        out.push_str(&tok);
    }
    if rng.gen_bool(0.1) {
        out = format!(" {out}\n");
    }
    Some(out.into_bytes())
}
