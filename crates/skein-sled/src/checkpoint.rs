//! A checkpoint of the event log's index: `events.idx` beside `events.log`, so that opening
//! the store reads the index of the frames it covers from one small file and scans only the
//! frames written after it, instead of the whole log.
//!
//! ```text
//! "SKX1" | end u64 | crc32 of the log's last (up to) 4 KiB before `end` u32
//!        | sessions u64 | per session: id length u16 | id | records u32 | records × (offset u64 | length u32)
//!        | blobs u64 | per blob: blake3 (32 bytes) | offset u64 | length u32
//!        | crc32 of all of the above u32
//! ```
//!
//! The log stays the one truth. A checkpoint is used only when it is whole (its crc), its
//! `end` lies within the log and the log's bytes just before `end` are the ones it was
//! written after: a log written anew (`skein gc`), cut (`skein store repair`) or replaced
//! fails that check, and a checkpoint that is missing, damaged or does not match is ignored
//! (and replaced at the next close): the whole log is scanned, as without one. Written to a
//! temporary file and renamed into place, not synced: a crash leaves the old one, or one
//! whose crc fails.
//!
//! What opening no longer does for the frames a checkpoint covers is check their crcs:
//! damage there (a bad disk, a stray write) is found by `skein store verify`, which reads
//! every frame, rather than by the open.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::file::{read_exact_at, LogFile};
use crate::wal::At;

const MAGIC: &[u8; 4] = b"SKX1";
/// How much of the log before `end` the checkpoint's check covers.
const TAIL: u64 = 4096;

/// The index as a checkpoint holds it.
pub(crate) struct Checkpoint {
    pub(crate) end: u64,
    pub(crate) sessions: BTreeMap<String, Vec<At>>,
    pub(crate) blobs: HashMap<[u8; 32], At>,
}

/// Where the checkpoint of the log at `log` is kept.
pub(crate) fn path_of(log: &Path) -> PathBuf {
    log.with_extension("idx")
}

/// The crc of the log's bytes in `[max(end - TAIL, 0), end)`.
fn tail_crc(file: &dyn LogFile, end: u64) -> io::Result<u32> {
    let from = end.saturating_sub(TAIL);
    let mut buf = vec![0u8; (end - from) as usize];
    read_exact_at(file, &mut buf, from)?;
    Ok(crc32fast::hash(&buf))
}

/// Writes the checkpoint of `sessions` and `blobs`, covering the log up to `end`.
pub(crate) fn write(
    log: &Path,
    file: &dyn LogFile,
    end: u64,
    sessions: &BTreeMap<String, Vec<At>>,
    blobs: &HashMap<[u8; 32], At>,
) -> io::Result<()> {
    let mut out = Vec::with_capacity(64 + sessions.len() * 64 + blobs.len() * 44);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&end.to_le_bytes());
    out.extend_from_slice(&tail_crc(file, end)?.to_le_bytes());
    out.extend_from_slice(&(sessions.len() as u64).to_le_bytes());
    for (id, recs) in sessions {
        let len = u16::try_from(id.len()).map_err(io::Error::other)?;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&(recs.len() as u32).to_le_bytes());
        for a in recs {
            out.extend_from_slice(&a.offset.to_le_bytes());
            out.extend_from_slice(&a.len.to_le_bytes());
        }
    }
    out.extend_from_slice(&(blobs.len() as u64).to_le_bytes());
    for (hash, a) in blobs {
        out.extend_from_slice(hash);
        out.extend_from_slice(&a.offset.to_le_bytes());
        out.extend_from_slice(&a.len.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    let path = path_of(log);
    let tmp = path.with_extension("idx.part");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&out)?;
    drop(f);
    std::fs::rename(&tmp, &path)
}

/// The checkpoint of the log in `file`, if there is one that is whole and matches it.
pub(crate) fn read(log: &Path, file: &dyn LogFile, log_len: u64) -> Option<Checkpoint> {
    let bytes = std::fs::read(path_of(log)).ok()?;
    let found = parse(&bytes, file, log_len);
    if found.is_none() {
        tracing::warn!(
            checkpoint = %path_of(log).display(),
            "the checkpoint of the event log's index is damaged or does not match the log: \
             reading the whole log instead"
        );
    }
    found
}

fn parse(bytes: &[u8], file: &dyn LogFile, log_len: u64) -> Option<Checkpoint> {
    let (body, crc) = bytes.split_at_checked(bytes.len().checked_sub(4)?)?;
    if crc32fast::hash(body).to_le_bytes() != crc {
        return None;
    }
    let mut p = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let s = body.get(p..p.checked_add(n)?)?;
        p += n;
        Some(s)
    };
    if take(4)? != MAGIC {
        return None;
    }
    let u64_of = |b: &[u8]| -> Option<u64> { Some(u64::from_le_bytes(b.try_into().ok()?)) };
    let u32_of = |b: &[u8]| -> Option<u32> { Some(u32::from_le_bytes(b.try_into().ok()?)) };
    let end = u64_of(take(8)?)?;
    let tail = u32_of(take(4)?)?;
    if end > log_len || tail_crc(file, end).ok()? != tail {
        return None;
    }
    let n = u64_of(take(8)?)?;
    // In id order as written: the map is built from them in bulk, not by one insert each.
    let mut sessions = Vec::with_capacity(n.min(1 << 24) as usize);
    for _ in 0..n {
        let len = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
        let id = std::str::from_utf8(take(len)?).ok()?.to_string();
        let count = u32_of(take(4)?)? as usize;
        let mut recs = Vec::with_capacity(count.min(1 << 20));
        for _ in 0..count {
            let offset = u64_of(take(8)?)?;
            let len = u32_of(take(4)?)?;
            if offset + u64::from(len) > end {
                return None;
            }
            recs.push(At { offset, len });
        }
        sessions.push((id, recs));
    }
    let sessions: BTreeMap<String, Vec<At>> = sessions.into_iter().collect();
    let n = u64_of(take(8)?)?;
    let mut blobs = HashMap::new();
    for _ in 0..n {
        let hash: [u8; 32] = take(32)?.try_into().ok()?;
        let offset = u64_of(take(8)?)?;
        let len = u32_of(take(4)?)?;
        if offset + u64::from(len) > end {
            return None;
        }
        blobs.insert(hash, At { offset, len });
    }
    (p == body.len()).then_some(Checkpoint {
        end,
        sessions,
        blobs,
    })
}
