//! `audit`: an audit export (JSON lines of records plus a manifest) handed to `skein
//! audit verify`, which must report every problem and never give up on a file.

use base64::Engine;
use rand::Rng as _;
use serde_json::Value;
use skein_runtime::audit::verify;

use super::{FnTarget, Spec};
use crate::mutate::Dict;
use crate::structured::{mutate_value, reshape_msgpack};
use crate::Rng;

pub const SPEC: Spec = Spec {
    name: "audit",
    about: "audit exports, JSON lines (audit::verify)",
    max_len: 256 * 1024,
    make: || Ok(Box::new(FnTarget(run))),
    reshape,
    tokens: &[
        "manifest", "events", "head", "session", "seq", "at", "kind", "payload", "prev", "hash",
        "raw", "\n",
    ],
};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

pub fn run(data: &[u8]) -> bool {
    let mut input = data;
    match verify(&mut input) {
        Ok(report) => {
            assert!(
                report.findings.iter().all(|f| f.line <= report.lines + 1),
                "a finding names a line past the end of the file"
            );
            report.findings.is_empty()
        }
        Err(_) => false,
    }
}

/// Edits one line of an export: its JSON, or the record inside its `raw` field (decoded,
/// changed, encoded again), or the order of lines.
fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(seed).ok()?;
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        return None;
    }
    let i = rng.gen_range(0..lines.len());
    match rng.gen_range(0..8) {
        0 if lines.len() > 1 => {
            lines.remove(i);
        }
        1 => {
            let l = lines[i].clone();
            lines.insert(rng.gen_range(0..=lines.len()), l);
        }
        2 if lines.len() > 1 => {
            let j = rng.gen_range(0..lines.len());
            lines.swap(i, j);
        }
        3 | 4 => {
            let mut v: Value = serde_json::from_str(&lines[i]).ok()?;
            mutate_value(rng, &mut v, dict);
            lines[i] = serde_json::to_string(&v).ok()?;
        }
        _ => {
            let mut v: Value = serde_json::from_str(&lines[i]).ok()?;
            let raw = B64.decode(v.get("raw")?.as_str()?).ok()?;
            let raw = reshape_msgpack(rng, &raw, dict)?;
            v["raw"] = Value::String(B64.encode(&raw));
            if rng.gen_bool(0.5) {
                // Keep the line consistent with its new record, so the chain checks run.
                v["hash"] = Value::String(blake3::hash(&raw).to_hex().to_string());
            }
            lines[i] = serde_json::to_string(&v).ok()?;
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    Some(out.into_bytes())
}
