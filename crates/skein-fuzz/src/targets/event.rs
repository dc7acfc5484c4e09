//! `event`: stored records of a session's log (msgpack envelopes), as a worker, `skein
//! events`, `tree`, `replay` and an audit read them from the store: each decoded, shown
//! as JSON and re-encoded; the log folded with its chain checked; every decision
//! re-derived from its prefix.
//!
//! Input: one or more messages of the event stream, separated by [`SEPARATOR`]: each one
//! record, or several consecutive records in one message (`skein_nats::frame`), which is
//! how the JetStream log and its live readers take them apart.

use rand::seq::SliceRandom;
use rand::Rng as _;
use skein_core::replay::verify;
use skein_core::{AgentSet, Envelope, Event, Limits, SessionState};
use skein_runtime::inspect::{fold_records, row};

use super::{Spec, Target};
use crate::fixtures::catalog;
use crate::mutate::Dict;
use crate::structured::reshape_msgpack;
use crate::{Error, Result, Rng};

pub const SPEC: Spec = Spec {
    name: "event",
    about: "stored event records, msgpack (Envelope::decode, fold with chain check, \
            replay verification)",
    max_len: 256 * 1024,
    make: || Ok(Box::new(Events::new()?)),
    reshape,
    tokens: &[
        "session",
        "seq",
        "at",
        "prev",
        "body",
        "type",
        "data",
        "Submitted",
        "ModelCalled",
        "ModelFailed",
        "ToolCalled",
        "ToolReturned",
        "Delegated",
        "CacheHit",
        "ChildSettled",
        "InputRequested",
        "InputProvided",
        "ApprovalRequested",
        "ApprovalGiven",
        "PatchApplied",
        "PatchRejected",
        "ClarificationRequested",
        "Completed",
        "Failed",
        "Cancelled",
        "usage",
        "input_tokens",
        "output_tokens",
        "tool_calls",
        "outcome",
        "status",
        "needs_input",
    ],
};

/// Between two records of one input.
pub const SEPARATOR: &[u8] = b"\n--- skein record ---\n";
/// Records of one input at most.
const MAX_RECORDS: usize = 256;

/// The records of an input.
pub fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut out = vec![];
    let mut rest = data;
    while out.len() < MAX_RECORDS {
        match rest.windows(SEPARATOR.len()).position(|w| w == SEPARATOR) {
            Some(p) => {
                out.push(&rest[..p]);
                rest = &rest[p + SEPARATOR.len()..];
            }
            None => {
                out.push(rest);
                break;
            }
        }
    }
    out
}

/// The input holding these records.
pub fn join(records: &[Vec<u8>]) -> Vec<u8> {
    records.join(SEPARATOR)
}

pub struct Events {
    catalog: AgentSet,
    limits: Limits,
}

impl Events {
    pub fn new() -> Result<Self> {
        Ok(Self {
            catalog: catalog().map_err(|e| Error::setup(SPEC.name, e))?,
            limits: Limits::default(),
        })
    }
}

impl Target for Events {
    fn run(&mut self, data: &[u8]) -> bool {
        let mut records = vec![];
        let mut all = true;
        let mut decoded = vec![];
        for message in split(data) {
            match skein_nats::frame::decode(message) {
                Ok(rs) => {
                    // What a message held goes back into one the same.
                    let again = skein_nats::frame::decode(&skein_nats::frame::encode(&rs));
                    assert!(
                        again.is_ok_and(|a| a
                            .iter()
                            .map(|r| &r.bytes)
                            .eq(rs.iter().map(|r| &r.bytes))),
                        "a message's records do not survive re-framing"
                    );
                    decoded.extend(rs);
                }
                Err(_) => all = false,
            }
        }
        for r in decoded {
            let _ = r.env.body.to_json();
            // What this build reads, it writes back to the same envelope (an unknown
            // body included). Equal, or where a float is not a number (a NaN equals
            // nothing, itself included), equal to the bit: encoded the same.
            let again = r.env.encode().map(|b| Envelope::decode(&b));
            assert!(
                matches!(&again, Ok(Ok(e)) if *e == r.env
                    || matches!((e.encode(), r.env.encode()), (Ok(a), Ok(b)) if a == b)),
                "record does not survive re-encoding: {again:?}"
            );
            records.push(r);
        }
        let Some(first) = records.first() else {
            return false;
        };
        let id = first.env.session.clone();
        let envs: Vec<Envelope> = records.iter().map(|r| r.env.clone()).collect();
        let state = SessionState::fold(&envs);
        let _ = (
            state.usage_total(),
            state.tokens_free(),
            state.outstanding_children(),
        );
        let _ = row(&id, &records, &state);
        let chained = fold_records(&id, &records).is_ok();
        let def = match &first.env.body {
            Event::Submitted(s) => self.catalog.get(&s.agent).or(self.catalog.get("fuzzer")),
            _ => None,
        };
        if let Some(def) = def {
            let _ = state.model_request(def);
            let _ = state.next(def, &self.limits, &self.catalog);
            all &= verify(&envs, def, &self.limits, &self.catalog).is_ok();
        }
        all && chained
    }
}

fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let mut recs: Vec<Vec<u8>> = split(seed).into_iter().map(<[u8]>::to_vec).collect();
    if recs.is_empty() {
        return None;
    }
    let i = rng.gen_range(0..recs.len());
    match rng.gen_range(0..9) {
        0 if recs.len() > 1 => {
            recs.remove(i);
        }
        // Neighbours into one message, as a turn's records are appended together.
        8 if recs.len() > 1 => {
            let start = i.min(recs.len() - 2);
            let end = rng.gen_range(start + 2..=recs.len());
            let parts: Vec<&[u8]> = recs[start..end].iter().map(Vec::as_slice).collect();
            let framed = skein_nats::frame::encode_parts(&parts);
            recs.splice(start..end, [framed]);
        }
        1 => {
            let r = recs[i].clone();
            recs.insert(rng.gen_range(0..=recs.len()), r);
        }
        2 => recs.shuffle(rng),
        _ => recs[i] = reshape_msgpack(rng, &recs[i], dict)?,
    }
    Some(join(&recs))
}
