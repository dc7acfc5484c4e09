//! How records travel in the messages of `SKEIN_EVENTS`.
//!
//! A message holds one record, or several consecutive records of one session. One record
//! is its envelope's bytes as they are (a MessagePack map), so a log written one record
//! per message reads as it always did. Several are a MessagePack array of binaries, each
//! one record's bytes: a turn whose records are appended together (the model's answer,
//! the read-only tool calls it asked for and their results; a turn's `Delegated`
//! records) is one publish, stored or refused as a whole under the one
//! `Nats-Expected-Last-Subject-Sequence` it carries, rather than one publish and ack per
//! record.
//!
//! An envelope never starts with an array marker, so the first byte tells the two apart.
//! A reader of an earlier version refuses a message of several records rather than misread
//! it (an array does not decode as an envelope).

use skein_core::{Record, SessionId};

/// Why a message of `SKEIN_EVENTS` does not read as records.
#[derive(Debug, thiserror::Error)]
#[error("{msg}")]
pub struct FrameError {
    msg: String,
    /// The record is whole but of a format newer than this process reads.
    newer: Option<skein_core::Error>,
}

impl FrameError {
    fn new(msg: String) -> Self {
        Self { msg, newer: None }
    }

    /// A record that does not decode: `e` says why.
    fn record(msg: String, e: skein_core::Error) -> Self {
        let newer = matches!(e, skein_core::Error::NewerFormat { .. });
        Self {
            msg: format!("{msg}: {e}"),
            newer: newer.then_some(e),
        }
    }

    /// The error of a record of a newer format, which is no damage (another worker
    /// reads it); none for any other.
    pub fn into_newer(self) -> std::result::Result<skein_core::Error, Self> {
        match self.newer {
            Some(e) => Ok(e),
            None => Err(self),
        }
    }
}

/// Whether `payload` is a message of several records.
fn is_frame(payload: &[u8]) -> bool {
    matches!(payload.first(), Some(0x90..=0x9f | 0xdc | 0xdd))
}

/// The message for `records`: the record's own bytes when there is one, else the array of
/// their bytes.
pub fn encode(records: &[Record]) -> Vec<u8> {
    if let [one] = records {
        return one.bytes.clone();
    }
    let parts: Vec<&[u8]> = records.iter().map(|r| r.bytes.as_slice()).collect();
    encode_parts(&parts)
}

/// The array of these byte strings, as a message of several records holds them (what
/// they are is not checked: a fuzzer makes damaged messages with it).
pub fn encode_parts(parts: &[&[u8]]) -> Vec<u8> {
    let len = parts.iter().map(|p| p.len() + 5).sum::<usize>() + 5;
    let mut out = Vec::with_capacity(len);
    // Writing into a Vec cannot fail; lengths above u32 are refused by the server's
    // payload limit long before.
    let n = u32::try_from(parts.len()).unwrap_or(u32::MAX);
    let _ = rmp::encode::write_array_len(&mut out, n);
    for p in parts {
        let _ = rmp::encode::write_bin(&mut out, p);
    }
    out
}

/// The records of one message, in order. A message of several must hold consecutive
/// records of one session, each a whole envelope, and nothing after the last.
pub fn decode(payload: &[u8]) -> Result<Vec<Record>, FrameError> {
    if !is_frame(payload) {
        return Record::decode(payload.to_vec())
            .map(|r| vec![r])
            .map_err(|e| FrameError::record("a record that does not decode".into(), e));
    }
    let mut rest = payload;
    let n = rmp::decode::read_array_len(&mut rest)
        .map_err(|e| FrameError::new(format!("a message of records without its length: {e}")))?;
    if n < 2 {
        return Err(FrameError::new(format!(
            "a message of {n} records in an array (one record is sent as it is)"
        )));
    }
    // Each element takes at least two bytes: a count the payload cannot hold is damage,
    // and is not allocated for.
    if n as usize > rest.len() / 2 {
        return Err(FrameError::new(format!(
            "a message of {n} records in {} bytes",
            payload.len()
        )));
    }
    let mut out: Vec<Record> = Vec::with_capacity(n as usize);
    for i in 0..n {
        let len = rmp::decode::read_bin_len(&mut rest).map_err(|e| {
            FrameError::new(format!(
                "record {} of {n} in a message is not bytes: {e}",
                i + 1
            ))
        })? as usize;
        if len > rest.len() {
            return Err(FrameError::new(format!(
                "record {} of {n} in a message is cut short ({len} bytes named, {} there)",
                i + 1,
                rest.len()
            )));
        }
        let (bytes, after) = rest.split_at(len);
        rest = after;
        let r = Record::decode(bytes.to_vec())
            .map_err(|e| FrameError::record(format!("record {} of {n} in a message", i + 1), e))?;
        if let Some(prev) = out.last() {
            if !follows(&prev.env.session, prev.env.seq, &r) {
                return Err(FrameError::new(format!(
                    "record {} of {n} in a message is {}#{}, not the record after {}#{}",
                    i + 1,
                    r.env.session,
                    r.env.seq,
                    prev.env.session,
                    prev.env.seq
                )));
            }
        }
        out.push(r);
    }
    if !rest.is_empty() {
        return Err(FrameError::new(format!(
            "{} bytes after the last of {n} records in a message",
            rest.len()
        )));
    }
    Ok(out)
}

fn follows(session: &SessionId, seq: u64, r: &Record) -> bool {
    r.env.session == *session && seq.checked_add(1) == Some(r.env.seq)
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::{decode, encode};
    use skein_core::event::{genesis_hash, Cancelled};
    use skein_core::{Envelope, Event, Record, SessionId};

    /// A chain of `Cancelled` records of `s`, whose reasons are `reason_len(seq)` bytes long.
    pub(crate) fn chain(
        s: &SessionId,
        seqs: std::ops::RangeInclusive<u64>,
        reason_len: impl Fn(u64) -> usize,
    ) -> Vec<Record> {
        let mut prev = genesis_hash(s);
        let mut out = vec![];
        for seq in seqs {
            let env = Envelope::new(
                s.clone(),
                seq,
                seq,
                prev,
                Event::Cancelled(Cancelled {
                    reason: "r".repeat(reason_len(seq)),
                }),
            );
            let r = Record::decode(env.encode().unwrap()).unwrap();
            prev = r.hash();
            out.push(r);
        }
        out
    }

    fn records(s: &SessionId, seqs: std::ops::RangeInclusive<u64>) -> Vec<Record> {
        chain(s, seqs, |seq| seq as usize * 40)
    }

    fn bytes(rs: &[Record]) -> Vec<Vec<u8>> {
        rs.iter().map(|r| r.bytes.clone()).collect()
    }

    #[test]
    fn one_record_is_its_own_bytes_and_several_read_back_in_order() {
        let s = SessionId::parse("01jd0000000000000000000000").unwrap();
        let rs = records(&s, 1..=20);
        assert_eq!(encode(&rs[..1]), rs[0].bytes, "one record goes as it is");
        assert_eq!(bytes(&decode(&rs[0].bytes).unwrap()), bytes(&rs[..1]));
        for n in [2, 3, 16, 20] {
            let msg = encode(&rs[..n]);
            assert_eq!(
                bytes(&decode(&msg).unwrap()),
                bytes(&rs[..n]),
                "{n} records"
            );
        }
    }

    #[test]
    fn a_damaged_or_forged_message_is_refused_with_what_is_wrong() {
        let s = SessionId::parse("01jd0000000000000000000000").unwrap();
        let t = SessionId::parse("01jd0000000000000000000001").unwrap();
        let rs = records(&s, 1..=3);
        let msg = encode(&rs);
        let refused = |payload: &[u8], why: &str| {
            let e = decode(payload).expect_err(why).to_string();
            assert!(e.contains(why), "`{e}` does not say `{why}`");
        };
        refused(&msg[..msg.len() - 1], "cut short");
        let mut longer = msg.clone();
        longer.push(0xc0);
        refused(&longer, "after the last of 3 records");
        refused(&[0x90], "a message of 0 records");
        let mut single = vec![0x91];
        single.extend_from_slice(&encode(&rs[..2])[1..]);
        refused(&single, "a message of 1 records");
        refused(
            &[0xdd, 0xff, 0xff, 0xff, 0xff, 0xc4, 0x00],
            "a message of 4294967295 records in 7 bytes",
        );
        refused(
            &[0x92, 0x01, 0x02, 0x03, 0x04],
            "record 1 of 2 in a message is not bytes",
        );
        let gap = encode(&[rs[0].clone(), rs[2].clone()]);
        refused(&gap, "not the record after");
        let other = records(&t, 2..=2);
        refused(
            &encode(&[rs[0].clone(), other[0].clone()]),
            "not the record after",
        );
        let mut garbage = encode(&rs[..2]);
        let last = garbage.len() - 3;
        garbage[last] ^= 0xff;
        assert!(decode(&garbage).is_err(), "a damaged record");
        refused(&[0x01], "a record that does not decode");
    }
}
