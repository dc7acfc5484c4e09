//! Audit export: a whole tree as JSON lines an auditor can read without skein, and the
//! check of such a file.
//!
//! Each line is one event: `{session, seq, at, kind, payload, prev, hash, raw}` — `payload`
//! the body as JSON, `raw` the stored record (base64 of its msgpack bytes), `hash` the
//! blake3 of those bytes (the next record's `prev`). A last line `{"manifest": …}` gives,
//! per session, the number of events and the head hash. `verify` checks that every line's
//! fields match its raw record, that every chain is complete, in order and unbroken, and
//! that the manifest matches: an altered, missing or reordered line is reported with its
//! line number.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

use base64::Engine;
use serde::Serialize;
use serde_json::{json, Value};
use skein_core::event::{genesis_hash, record_hash};
use skein_core::{Record, SessionId};

use crate::ports::Backend;
use crate::{Error, Result};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

pub fn line_of(r: &Record) -> Value {
    json!({
        "session": r.env.session.to_string(),
        "seq": r.env.seq,
        "at": r.env.at,
        "kind": r.env.body.kind(),
        "payload": r.env.body.to_json(),
        "prev": r.env.prev,
        "hash": r.hash(),
        "raw": B64.encode(&r.bytes),
    })
}

/// Writes the tree of `root` (or the subtree of any session); returns the event count.
pub async fn export(b: &Backend, id: &SessionId, out: &mut dyn Write) -> Result<u64> {
    let ids = b.subtree(id).await?;
    let io = |e: std::io::Error| Error::unavailable("writing the export", e);
    let mut n = 0;
    let mut manifest = BTreeMap::new();
    for s in ids {
        let records = b.log.read(&s, 1).await?;
        for r in &records {
            writeln!(out, "{}", line_of(r)).map_err(io)?;
            n += 1;
        }
        if let Some(last) = records.last() {
            manifest.insert(
                s.to_string(),
                json!({"events": last.env.seq, "head": last.hash()}),
            );
        }
    }
    writeln!(out, "{}", json!({ "manifest": manifest })).map_err(io)?;
    Ok(n)
}

/// One finding of `verify`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub line: usize,
    pub session: String,
    pub problem: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct AuditReport {
    pub lines: usize,
    pub sessions: usize,
    pub findings: Vec<Finding>,
}

struct Chain {
    /// Wider than a seq: the one after u64::MAX must exist too.
    next_seq: u128,
    prev: String,
}

/// Checks an export. Never stops at the first problem: every finding is reported.
pub fn verify(input: &mut dyn BufRead) -> Result<AuditReport> {
    let mut rep = AuditReport::default();
    let mut chains: BTreeMap<String, Chain> = BTreeMap::new();
    let mut manifest: Option<(usize, Value)> = None;
    let find = |rep: &mut AuditReport, line: usize, session: &str, problem: String| {
        rep.findings.push(Finding {
            line,
            session: session.to_string(),
            problem,
        });
    };
    for (i, line) in input.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| Error::unavailable("reading the export", e))?;
        if line.trim().is_empty() {
            continue;
        }
        rep.lines = n;
        let v: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                find(&mut rep, n, "", format!("not JSON: {e}"));
                continue;
            }
        };
        if let Some(m) = v.get("manifest") {
            manifest = Some((n, m.clone()));
            continue;
        }
        let session = v["session"].as_str().unwrap_or("").to_string();
        let Some(raw) = v["raw"].as_str().and_then(|r| B64.decode(r).ok()) else {
            find(&mut rep, n, &session, "no readable `raw` record".into());
            continue;
        };
        let rec = match Record::decode(raw.clone()) {
            Ok(r) => r,
            Err(e) => {
                find(
                    &mut rep,
                    n,
                    &session,
                    format!("raw record does not decode: {e}"),
                );
                continue;
            }
        };
        let expect = super::audit::line_of(&rec);
        for field in ["session", "seq", "at", "kind", "payload", "prev", "hash"] {
            if v[field] != expect[field] {
                find(
                    &mut rep,
                    n,
                    &session,
                    format!("altered: `{field}` does not match the raw record"),
                );
            }
        }
        let sid = rec.env.session.to_string();
        let chain = chains.entry(sid.clone()).or_insert_with(|| Chain {
            next_seq: 1,
            prev: SessionId::parse(&sid)
                .map(|s| genesis_hash(&s))
                .unwrap_or_default(),
        });
        let seq = u128::from(rec.env.seq);
        if seq < chain.next_seq {
            find(
                &mut rep,
                n,
                &sid,
                format!(
                    "reordered or repeated: seq {seq} after seq {}",
                    chain.next_seq - 1
                ),
            );
        } else if seq > chain.next_seq {
            find(
                &mut rep,
                n,
                &sid,
                format!(
                    "missing: seq {} to {} are not in the file",
                    chain.next_seq,
                    seq - 1
                ),
            );
        }
        if seq >= chain.next_seq && rec.env.prev != chain.prev {
            find(
                &mut rep,
                n,
                &sid,
                format!("broken chain at seq {seq}: prev is not the hash of the record before it"),
            );
        }
        if seq >= chain.next_seq {
            chain.next_seq = seq + 1;
            chain.prev = record_hash(&rec.bytes);
        }
    }
    rep.sessions = chains.len();
    match manifest {
        None => {
            let at = rep.lines + 1;
            find(&mut rep, at, "", "missing: the manifest line".into())
        }
        Some((n, m)) => {
            let listed = m.as_object().cloned().unwrap_or_default();
            for (sid, c) in &chains {
                match listed.get(sid) {
                    None => find(&mut rep, n, sid, "session not in the manifest".into()),
                    Some(e) => {
                        if e["events"].as_u64().map(u128::from) != Some(c.next_seq - 1) {
                            find(
                                &mut rep,
                                n,
                                sid,
                                format!(
                                    "missing: the manifest lists {} events, the file has {}",
                                    e["events"],
                                    c.next_seq - 1
                                ),
                            );
                        } else if e["head"].as_str() != Some(c.prev.as_str()) {
                            find(
                                &mut rep,
                                n,
                                sid,
                                "altered: head hash differs from the manifest".into(),
                            );
                        }
                    }
                }
            }
            for sid in listed.keys().filter(|k| !chains.contains_key(*k)) {
                find(
                    &mut rep,
                    n,
                    sid,
                    "missing: every event of this session".into(),
                );
            }
        }
    }
    Ok(rep)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use skein_core::event::{genesis_hash, Cancelled};
    use skein_core::{Envelope, Event};

    use super::*;

    fn line(seq: u64, prev: String) -> (Value, Record) {
        let id = SessionId::root("audited").unwrap();
        let env = Envelope::new(
            id,
            seq,
            1,
            prev,
            Event::Cancelled(Cancelled { reason: "r".into() }),
        );
        let bytes = env.encode().unwrap();
        let rec = Record::decode(bytes).unwrap();
        (line_of(&rec), rec)
    }

    #[test]
    fn the_largest_seq_is_reported_not_a_crash() {
        let id = SessionId::root("audited").unwrap();
        let (first, rec) = line(u64::MAX, genesis_hash(&id));
        let (second, _) = line(u64::MAX, rec.hash());
        let manifest = json!({"manifest": {"audited": {"events": u64::MAX, "head": "x"}}});
        let file = format!("{first}\n{second}\n{manifest}\n");
        let rep = verify(&mut file.as_bytes()).unwrap();
        let problems: Vec<&str> = rep.findings.iter().map(|f| f.problem.as_str()).collect();
        assert!(
            problems.iter().any(|p| p.starts_with("missing: seq 1 to")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("reordered or repeated")),
            "{problems:?}"
        );
    }
}
