//! The record format: an event in its versioned envelope, encoded with named fields and
//! chained to the record before it by hash; and the check of a whole chain.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Event, ENVELOPE_VERSION, KINDS};
use crate::id::SessionId;
use crate::{Error, Result};

#[derive(Serialize)]
#[serde(untagged)]
enum BodyOut<'a> {
    Known(&'a Event),
    Unknown {
        #[serde(rename = "type")]
        kind: &'a str,
        data: &'a Value,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum BodyIn {
    Known(Box<Event>),
    Unknown {
        #[serde(rename = "type")]
        kind: String,
        #[serde(default)]
        data: Value,
    },
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    v: u16,
    session: &'a SessionId,
    seq: u64,
    at: u64,
    prev: &'a str,
    body: BodyOut<'a>,
}

/// A record of a kind this build knows, read in one pass. Most records are; the others
/// (and damaged ones) are read again as [`EnvelopeIn`], whose untagged body has serde
/// buffer the whole body first.
#[derive(Deserialize)]
struct EnvelopeKnown {
    v: u16,
    session: SessionId,
    seq: u64,
    at: u64,
    prev: String,
    body: Event,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    v: u16,
    session: SessionId,
    seq: u64,
    at: u64,
    prev: String,
    body: BodyIn,
}

/// One record of a session's log.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub v: u16,
    pub session: SessionId,
    /// 1-based position in the session's log.
    pub seq: u64,
    /// Milliseconds since the Unix epoch, stamped by the writer.
    pub at: u64,
    /// Hex blake3 of the previous record's bytes (of the session id for seq 1).
    pub prev: String,
    pub body: Event,
}

/// The `prev` of a session's first record.
pub fn genesis_hash(session: &SessionId) -> String {
    blake3::hash(session.as_str().as_bytes())
        .to_hex()
        .to_string()
}

/// Hex blake3 of one record's bytes: the next record's `prev`.
pub fn record_hash(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

impl Envelope {
    pub fn new(session: SessionId, seq: u64, at: u64, prev: String, body: Event) -> Self {
        Self {
            v: ENVELOPE_VERSION,
            session,
            seq,
            at,
            prev,
            body,
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        let body = match &self.body {
            Event::Unknown { kind, data } => BodyOut::Unknown { kind, data },
            e => BodyOut::Known(e),
        };
        let out = EnvelopeOut {
            v: self.v,
            session: &self.session,
            seq: self.seq,
            at: self.at,
            prev: &self.prev,
            body,
        };
        rmp_serde::to_vec_named(&out).map_err(|e| Error::Encode(e.to_string()))
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let env = Self::decode_any(bytes)?;
        env.readable_by(super::read_format())?;
        Ok(env)
    }

    /// Whether a reader of formats up to `reads` reads this record: an error naming the
    /// record and its format when it is newer.
    pub fn readable_by(&self, reads: u16) -> Result<()> {
        if self.v > reads {
            return Err(Error::NewerFormat {
                session: self.session.to_string(),
                seq: self.seq,
                found: self.v,
                reads,
            });
        }
        Ok(())
    }

    fn decode_any(bytes: &[u8]) -> Result<Self> {
        if let Ok(e) = rmp_serde::from_slice::<EnvelopeKnown>(bytes) {
            return Ok(Self {
                v: e.v,
                session: e.session,
                seq: e.seq,
                at: e.at,
                prev: e.prev,
                body: e.body,
            });
        }
        let e: EnvelopeIn =
            rmp_serde::from_slice(bytes).map_err(|e| Error::Decode(e.to_string()))?;
        let body = match e.body {
            BodyIn::Known(ev) => *ev,
            // A kind this build knows that does not read as it (a missing or mistyped
            // field, a field twice) is damage, not a record of a later version: folding
            // on without it would silently show another history.
            BodyIn::Unknown { kind, .. } if KINDS.contains(&kind.as_str()) => {
                #[derive(Deserialize)]
                struct KnownBody {
                    #[allow(dead_code)]
                    body: Event,
                }
                let why = match rmp_serde::from_slice::<KnownBody>(bytes) {
                    Err(err) => err.to_string(),
                    Ok(_) => "its fields do not match".into(),
                };
                return Err(Error::Decode(format!(
                    "the {kind} record at seq {} of {} does not read as a {kind}: {why}",
                    e.seq, e.session
                )));
            }
            BodyIn::Unknown { kind, data } => Event::Unknown { kind, data },
        };
        Ok(Self {
            v: e.v,
            session: e.session,
            seq: e.seq,
            at: e.at,
            prev: e.prev,
            body,
        })
    }
}

/// A record as stored: its bytes and their decoded form.
#[derive(Debug, Clone)]
pub struct Record {
    pub env: Envelope,
    pub bytes: Vec<u8>,
}

impl Record {
    pub fn decode(bytes: Vec<u8>) -> Result<Self> {
        Ok(Self {
            env: Envelope::decode(&bytes)?,
            bytes,
        })
    }

    pub fn hash(&self) -> String {
        record_hash(&self.bytes)
    }
}

/// Where a chain check failed.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainBreak {
    pub seq: u64,
    pub reason: String,
}

/// Checks a whole log: seqs 1..n without gaps, one session, each `prev` the hash of the
/// record before it.
pub fn verify_chain(
    session: &SessionId,
    records: &[Record],
) -> std::result::Result<(), ChainBreak> {
    let mut prev = genesis_hash(session);
    for (i, r) in records.iter().enumerate() {
        let want = i as u64 + 1;
        if r.env.seq != want {
            return Err(ChainBreak {
                seq: want,
                reason: format!("expected seq {want}, found seq {}", r.env.seq),
            });
        }
        if &r.env.session != session {
            return Err(ChainBreak {
                seq: want,
                reason: format!("record belongs to session {}", r.env.session),
            });
        }
        if r.env.prev != prev {
            return Err(ChainBreak {
                seq: want,
                reason: "prev hash does not match the previous record".into(),
            });
        }
        prev = r.hash();
    }
    Ok(())
}
