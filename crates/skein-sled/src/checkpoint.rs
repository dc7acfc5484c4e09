//! A checkpoint of the event log's index: `events.idx` beside `events.log`, a table of each
//! session's record offsets sorted by session id, read where a session is looked up rather
//! than loaded whole. Opening the store reads only its header, its fences (the first id of
//! each block of the table) and its blobs, and scans the frames written after it; the
//! index in memory then holds only what was written past the checkpoint. So opening and
//! the memory of a process grow with the frames past the checkpoint and what the process
//! touches, not with history (the fences are about one id per 4 KiB of table).
//!
//! ```text
//! header = "SKX2" | end u64 | crc32 of the log's last (up to) 4 KiB before `end` u32
//!          | sessions u64 | fences_at u64 | crc32 of the header before it u32
//! block  = length u32 | crc32 of the entries u32 | entries, in id order
//! entry  = id length u16 | id | records u32 | records × (offset u64 | length u32)
//! at fences_at: blocks u64 | per block: at u64 | length u32 | first id length u16 | first id
//!          | blobs u64 | per blob: blake3 (32 bytes) | offset u64 | length u32
//!          | crc32 of all of it u32 (the file's last 4 bytes)
//! ```
//!
//! The log stays the one truth. A checkpoint is used only when its header and fences are
//! whole (their crcs), its `end` lies within the log and the log's bytes just before `end`
//! are the ones it was written after: a log written anew (`skein gc`), cut (`skein store
//! repair`) or replaced fails that check, and a checkpoint that is missing, damaged, of an
//! older format or does not match is ignored (and replaced at the next close once enough
//! is written): the whole log is scanned, as without one. A block read later whose crc
//! does not match makes the store drop the checkpoint and index the whole log in memory
//! (see `wal.rs`). Written to a temporary file and renamed into place, not synced: a crash
//! leaves the old one, or one whose crcs fail. A process keeps the file it opened, so a
//! checkpoint written by its own close does not change what it reads.
//!
//! What opening no longer does for the frames a checkpoint covers is check their crcs:
//! damage there (a bad disk, a stray write) is found by `skein store verify`, which reads
//! every frame, rather than by the open.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::file::{read_exact_at, LogFile};
use crate::wal::At;

const MAGIC: &[u8; 4] = b"SKX2";
/// The format before this one, which held the whole index in one piece.
const OLD_MAGIC: &[u8; 4] = b"SKX1";
/// How much of the log before `end` the checkpoint's check covers.
const TAIL: u64 = 4096;
const HEADER: usize = 4 + 8 + 4 + 8 + 8 + 4;
/// A block is closed once its entries reach this many bytes.
const BLOCK: usize = 4096;
/// One record's place in an entry.
const AT_LEN: usize = 12;

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

fn damaged(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("the checkpoint of the event log's index is damaged: {what}"),
    )
}

/// The first id of one block, and where the block is.
struct Fence {
    first: Box<str>,
    at: u64,
    len: u32,
}

/// The sorted table of a checkpoint, read where it is looked up.
pub(crate) struct Table {
    file: File,
    /// Where the log ends that the table covers.
    pub(crate) end: u64,
    fences: Vec<Fence>,
}

/// A checkpoint as opening reads it: its table, and every blob it knew.
pub(crate) struct Checkpoint {
    pub(crate) table: Table,
    pub(crate) blobs: HashMap<[u8; 32], At>,
}

/// Each blob's bytes in the log, by its blake3 hash.
type Blobs = HashMap<[u8; 32], At>;

/// One entry of a block: a session's id and records.
pub(crate) type Entry = (String, Vec<At>);

impl Table {
    /// The entries of block `i`, checked against its crc.
    fn block(&self, i: usize) -> io::Result<Vec<Entry>> {
        let f = &self.fences[i];
        let mut buf = vec![0u8; f.len as usize + 8];
        self.file.read_exact_at(&mut buf, f.at)?;
        let len = u32::from_le_bytes(buf[..4].try_into().map_err(io::Error::other)?);
        let crc = u32::from_le_bytes(buf[4..8].try_into().map_err(io::Error::other)?);
        let body = &buf[8..];
        if len != f.len || crc32fast::hash(body) != crc {
            return Err(damaged(&format!("block at offset {}", f.at)));
        }
        let entries = parse_entries(body, self.end)
            .ok_or_else(|| damaged(&format!("block at offset {}", f.at)))?;
        if entries.first().map(|e| e.0.as_str()) != Some(&*f.first) {
            return Err(damaged(&format!("block at offset {}", f.at)));
        }
        Ok(entries)
    }

    /// The block that would hold `id`, if any could.
    fn block_of(&self, id: &str) -> Option<usize> {
        self.fences
            .partition_point(|f| &*f.first <= id)
            .checked_sub(1)
    }

    /// `id`'s records, if the table has the session.
    pub(crate) fn get(&self, id: &str) -> io::Result<Option<Vec<At>>> {
        let Some(i) = self.block_of(id) else {
            return Ok(None);
        };
        Ok(self
            .block(i)?
            .into_iter()
            .find(|(k, _)| k == id)
            .map(|(_, v)| v))
    }

    /// Every session whose id starts with `prefix`, in id order.
    pub(crate) fn ids_from(&self, prefix: &str) -> io::Result<Vec<String>> {
        let mut out = vec![];
        let start = self.block_of(prefix).unwrap_or(0);
        for i in start..self.fences.len() {
            if i > start && !self.fences[i].first.starts_with(prefix) {
                break;
            }
            for (k, _) in self.block(i)? {
                if k.starts_with(prefix) {
                    out.push(k);
                } else if k.as_str() > prefix {
                    return Ok(out);
                }
            }
        }
        Ok(out)
    }

    /// Calls `f` with every entry, in id order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(Entry) -> io::Result<()>) -> io::Result<()> {
        for i in 0..self.fences.len() {
            for e in self.block(i)? {
                f(e)?;
            }
        }
        Ok(())
    }
}

fn parse_entries(body: &[u8], end: u64) -> Option<Vec<Entry>> {
    let mut out: Vec<Entry> = vec![];
    let mut p = 0usize;
    let take = |p: &mut usize, n: usize| -> Option<&[u8]> {
        let s = body.get(*p..p.checked_add(n)?)?;
        *p += n;
        Some(s)
    };
    while p < body.len() {
        let len = u16::from_le_bytes(take(&mut p, 2)?.try_into().ok()?) as usize;
        let id = std::str::from_utf8(take(&mut p, len)?).ok()?.to_string();
        let count = u32::from_le_bytes(take(&mut p, 4)?.try_into().ok()?) as usize;
        let raw = take(&mut p, count.checked_mul(AT_LEN)?)?;
        let mut recs = Vec::with_capacity(count);
        for a in raw.chunks_exact(AT_LEN) {
            let offset = u64::from_le_bytes(a[..8].try_into().ok()?);
            let len = u32::from_le_bytes(a[8..].try_into().ok()?);
            if offset.checked_add(u64::from(len))? > end {
                return None;
            }
            recs.push(At { offset, len });
        }
        if out.last().is_some_and(|(k, _)| *k >= id) {
            return None;
        }
        out.push((id, recs));
    }
    Some(out)
}

/// Writes a checkpoint covering the log up to `end`: the sessions `entries` yields, in id
/// order, and `blobs`.
pub(crate) fn write(
    log: &Path,
    file: &dyn LogFile,
    end: u64,
    entries: &mut dyn Iterator<Item = io::Result<Entry>>,
    blobs: &HashMap<[u8; 32], At>,
) -> io::Result<()> {
    let path = path_of(log);
    let tmp = path.with_extension("idx.part");
    let out = File::create(&tmp)?;
    let mut w = BufWriter::with_capacity(1 << 20, &out);
    w.write_all(&[0u8; HEADER])?;
    let mut at = HEADER as u64;
    let mut fences: Vec<(String, u64, u32)> = vec![];
    let mut block: Vec<u8> = Vec::with_capacity(2 * BLOCK);
    let mut first: Option<String> = None;
    let mut sessions = 0u64;
    let mut last: Option<String> = None;
    let mut flush = |block: &mut Vec<u8>,
                     first: &mut Option<String>,
                     w: &mut BufWriter<&File>,
                     at: &mut u64|
     -> io::Result<()> {
        let Some(id) = first.take() else {
            return Ok(());
        };
        let len = u32::try_from(block.len()).map_err(io::Error::other)?;
        w.write_all(&len.to_le_bytes())?;
        w.write_all(&crc32fast::hash(block).to_le_bytes())?;
        w.write_all(block)?;
        fences.push((id, *at, len));
        *at += 8 + u64::from(len);
        block.clear();
        Ok(())
    };
    for e in entries {
        let (id, recs) = e?;
        if last.as_ref().is_some_and(|l| *l >= id) {
            return Err(io::Error::other("checkpoint entries out of order"));
        }
        let len = u16::try_from(id.len()).map_err(io::Error::other)?;
        block.extend_from_slice(&len.to_le_bytes());
        block.extend_from_slice(id.as_bytes());
        block.extend_from_slice(&(recs.len() as u32).to_le_bytes());
        for a in &recs {
            block.extend_from_slice(&a.offset.to_le_bytes());
            block.extend_from_slice(&a.len.to_le_bytes());
        }
        if first.is_none() {
            first = Some(id.clone());
        }
        sessions += 1;
        last = Some(id);
        if block.len() >= BLOCK {
            flush(&mut block, &mut first, &mut w, &mut at)?;
        }
    }
    flush(&mut block, &mut first, &mut w, &mut at)?;
    let fences_at = at;
    let mut tail = Vec::with_capacity(16 + fences.len() * 32 + blobs.len() * 44);
    tail.extend_from_slice(&(fences.len() as u64).to_le_bytes());
    for (id, at, len) in &fences {
        tail.extend_from_slice(&at.to_le_bytes());
        tail.extend_from_slice(&len.to_le_bytes());
        tail.extend_from_slice(&(id.len() as u16).to_le_bytes());
        tail.extend_from_slice(id.as_bytes());
    }
    tail.extend_from_slice(&(blobs.len() as u64).to_le_bytes());
    for (hash, a) in blobs {
        tail.extend_from_slice(hash);
        tail.extend_from_slice(&a.offset.to_le_bytes());
        tail.extend_from_slice(&a.len.to_le_bytes());
    }
    let crc = crc32fast::hash(&tail);
    tail.extend_from_slice(&crc.to_le_bytes());
    w.write_all(&tail)?;
    w.flush()?;
    drop(w);
    let mut head = Vec::with_capacity(HEADER);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&end.to_le_bytes());
    head.extend_from_slice(&tail_crc(file, end)?.to_le_bytes());
    head.extend_from_slice(&sessions.to_le_bytes());
    head.extend_from_slice(&fences_at.to_le_bytes());
    let crc = crc32fast::hash(&head);
    head.extend_from_slice(&crc.to_le_bytes());
    out.write_all_at(&head, 0)?;
    drop(out);
    std::fs::rename(&tmp, &path)
}

/// The checkpoint of the log in `file`, if there is one that is whole and matches it.
pub(crate) fn read(log: &Path, file: &dyn LogFile, log_len: u64) -> Option<Checkpoint> {
    let f = File::open(path_of(log)).ok()?;
    let found = parse(f, file, log_len);
    match &found {
        Ok(_) => {}
        Err(true) => tracing::debug!(
            checkpoint = %path_of(log).display(),
            "the checkpoint of the event log's index is of an older format: reading the whole log"
        ),
        Err(false) => tracing::warn!(
            checkpoint = %path_of(log).display(),
            "the checkpoint of the event log's index is damaged or does not match the log: \
             reading the whole log instead"
        ),
    }
    found.ok()
}

/// The checkpoint in `f`; `Err(true)` for one of the older format, `Err(false)` for one
/// that is damaged or does not match the log.
fn parse(f: File, log: &dyn LogFile, log_len: u64) -> Result<Checkpoint, bool> {
    let mut head = [0u8; HEADER];
    if f.read_exact_at(&mut head, 0).is_err() {
        let mut magic = [0u8; 4];
        let old = f.read_exact_at(&mut magic, 0).is_ok() && &magic == OLD_MAGIC;
        return Err(old);
    }
    if &head[..4] == OLD_MAGIC {
        return Err(true);
    }
    let u64_at = |b: &[u8], at: usize| -> u64 {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(x)
    };
    let u32_at = |b: &[u8], at: usize| -> u32 {
        let mut x = [0u8; 4];
        x.copy_from_slice(&b[at..at + 4]);
        u32::from_le_bytes(x)
    };
    if &head[..4] != MAGIC || crc32fast::hash(&head[..HEADER - 4]) != u32_at(&head, HEADER - 4) {
        return Err(false);
    }
    let end = u64_at(&head, 4);
    let tail = u32_at(&head, 12);
    let fences_at = u64_at(&head, 24);
    if end > log_len || tail_crc(log, end).ok() != Some(tail) {
        return Err(false);
    }
    let len = f.metadata().map_err(|_| false)?.len();
    if fences_at < HEADER as u64 || fences_at + 4 > len || len - fences_at > 1 << 32 {
        return Err(false);
    }
    let mut sec = vec![0u8; (len - fences_at) as usize];
    f.read_exact_at(&mut sec, fences_at).map_err(|_| false)?;
    let (body, crc) = sec.split_at(sec.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(false);
    }
    let parsed = (|| -> Option<(Vec<Fence>, Blobs)> {
        let mut p = 0usize;
        let mut take = |n: usize| -> Option<&[u8]> {
            let s = body.get(p..p.checked_add(n)?)?;
            p += n;
            Some(s)
        };
        let n = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let mut fences: Vec<Fence> = Vec::with_capacity(n.min(1 << 20) as usize);
        let mut next = HEADER as u64;
        for _ in 0..n {
            let at = u64::from_le_bytes(take(8)?.try_into().ok()?);
            let len = u32::from_le_bytes(take(4)?.try_into().ok()?);
            let idlen = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
            let first: Box<str> = std::str::from_utf8(take(idlen)?).ok()?.into();
            // Blocks back to back from the header to the fences, in id order.
            if at != next || fences.last().is_some_and(|f| f.first >= first) {
                return None;
            }
            next = at + 8 + u64::from(len);
            fences.push(Fence { first, at, len });
        }
        if next != fences_at {
            return None;
        }
        let n = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let mut blobs = HashMap::with_capacity(n.min(1 << 20) as usize);
        for _ in 0..n {
            let hash: [u8; 32] = take(32)?.try_into().ok()?;
            let offset = u64::from_le_bytes(take(8)?.try_into().ok()?);
            let len = u32::from_le_bytes(take(4)?.try_into().ok()?);
            if offset + u64::from(len) > end {
                return None;
            }
            blobs.insert(hash, At { offset, len });
        }
        (p == body.len()).then_some((fences, blobs))
    })();
    let (fences, blobs) = parsed.ok_or(false)?;
    Ok(Checkpoint {
        table: Table {
            file: f,
            end,
            fences,
        },
        blobs,
    })
}

/// The entries of a table, block by block.
struct Entries<'a> {
    table: &'a Table,
    next: usize,
    ready: std::vec::IntoIter<Entry>,
}

impl Iterator for Entries<'_> {
    type Item = io::Result<Entry>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(e) = self.ready.next() {
                return Some(Ok(e));
            }
            if self.next >= self.table.fences.len() {
                return None;
            }
            match self.table.block(self.next) {
                Ok(b) => self.ready = b.into_iter(),
                Err(e) => {
                    self.next = self.table.fences.len();
                    return Some(Err(e));
                }
            }
            self.next += 1;
        }
    }
}

/// The entries of `table` (if any) and of `tails` (each session's records past it),
/// merged in id order, a block of the table at a time: what the index holds as a whole.
pub(crate) fn merged<'a>(
    table: Option<&'a Table>,
    tails: &'a BTreeMap<String, crate::wal::Tail>,
) -> impl Iterator<Item = io::Result<Entry>> + 'a {
    let mut old = table
        .map(|table| Entries {
            table,
            next: 0,
            ready: Vec::new().into_iter(),
        })
        .into_iter()
        .flatten()
        .peekable();
    let mut new = tails.iter().peekable();
    std::iter::from_fn(move || {
        let take_new = match (old.peek(), new.peek()) {
            (None, None) => return None,
            (Some(Err(_)), _) => return old.next(),
            (None, Some(_)) => true,
            (Some(_), None) => false,
            (Some(Ok((a, _))), Some((b, _))) => b.as_str() < a.as_str(),
        };
        if take_new {
            let (k, t) = new.next()?;
            return Some(Ok((k.clone(), t.recs.clone())));
        }
        let (id, mut recs) = match old.next()? {
            Ok(e) => e,
            Err(e) => return Some(Err(e)),
        };
        if let Some((_, t)) = new.next_if(|(k, _)| **k == id) {
            recs.extend_from_slice(&t.recs);
        }
        Some(Ok((id, recs)))
    })
}
