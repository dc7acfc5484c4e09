//! The event log's own file: `events.log` in the data directory, append-only.
//!
//! Every append writes one frame, so a batch is on disk whole or not at all. Blobs
//! (agent definitions, large tool outputs) are frames of the same file, under a magic of
//! their own:
//!
//! ```text
//! frame  = magic | body length u32 LE | crc32 of body u32 LE | body
//! "SKW1" body = session length u16 LE | session | first seq u64 LE | count u32 LE
//!               | count × (record length u32 LE | record bytes)
//! "SKB1" body = blake3 of the blob (32 bytes) | the blob
//! ```
//!
//! **Format 2** (this version) begins with three frames of sessions no id can name
//! (they start with `!`): the header, whose first seq is the format and which holds no
//! record, then the two slots of the synced mark, each one record of 16 bytes (generation
//! u64 LE, synced u64 LE) of the session `!mark`, rewritten in place. Frames follow them.
//! A version that reads only format 1 reads these as frames and then refuses to open the
//! file, saying (in the header's session name) that a newer skein wrote it, instead of
//! taking the rest for a torn tail; this version refuses a format above its own the same
//! way. A file written before the header (format 1) starts with its first frame and is
//! read as before, without a mark.
//!
//! A blob is made durable by the `fdatasync` of the record that names it, which is
//! written after it: storing one costs neither a sync of its own nor a flush of the sled
//! database (whose first flush in a process also starts sled's pool of I/O threads).
//!
//! An append checks the session's last seq, writes its frame at the end of the file and
//! indexes it under one lock, then waits for a group commit: one `fdatasync` covers every
//! append written before it started. The index (each session's record offsets) is the
//! checkpoint `events.idx` (`checkpoint.rs`), a sorted table read where a session is
//! looked up, and in memory each session's records past it: opening reads the frames past
//! the checkpoint (all of the file without one, when all the index is in memory); a close
//! writes a new checkpoint once 1 MiB of frames lies past the last. A block of the table
//! found damaged when read makes the log drop the checkpoint and index every frame in
//! memory, as without one.
//!
//! The file is kept 64–128 KiB longer than its frames, with zeros: an append writes into
//! that reserve, and writes the reserve anew past itself before it reaches the end, so
//! most syncs do not change the file's length (which would make `fdatasync` write the
//! inode too), and a frame is written only into space the file already has: on a full
//! disk the write of the reserve fails, before any byte of the frame is written. Zeros
//! are no frame: reading stops at them, as an older version also does.
//!
//! **Fail-stop.** The first `fdatasync` that fails stops the log: the append waiting for
//! it and every later one fail with that error, and nothing is acknowledged that a sync
//! did not cover. (After a failed `fdatasync`, Linux may have dropped the dirty pages and
//! a second one may succeed without writing them.) Only reopening the store, which reads
//! the file again, goes on. A write that fails (a full disk) stops nothing: the append
//! fails, nothing of it counts, and the next one writes over what it left.
//!
//! **Tears and damage.** Each sync writes, in the mark slot not written last, how far the
//! sync before it reached; the same `fdatasync` makes it durable. Closing the store moves
//! the mark to everything synced, without a sync of its own (what it names is durable; a
//! crash of the machine that loses it leaves the mark before). A new log's header and its
//! name in the directory are made durable by its first sync, with the first appends.
//! So a crash can tear only the frames past the mark: the
//! last group commit and what was not synced. Opening stops at the first frame that is cut
//! short or whose crc does not match. Past the mark that is a torn tail: if nothing but
//! zeros follows, it is the reserve, kept as it is; otherwise opening keeps what follows
//! in `events.log.torn-<offset>` (synced, and its directory entry too) and then cuts the
//! log there, so that no frame written before the crash can turn up behind a later one.
//! What an open keeps past the mark it writes again and syncs before the log reads any of
//! it (`rewrite_unmarked`): a failed `fdatasync` may have left those pages marked clean
//! and never written, and no later sync would write them.
//! Before the mark it is damage a crash cannot explain (a bad disk, a stray write), and
//! opening refuses, naming the offset: `skein store verify` says what is damaged and
//! `skein store repair` sets it aside. A frame whose crc matches but whose kind this
//! version does not know, or whose body does not parse, is an error wherever it lies.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use skein_core::{Record, SessionId};
use skein_ports::{Error, RefusalKind, Result};

use crate::checkpoint;
use crate::file::{read_exact_at, sync_dir, write_all_at, LogFile, Reader};

const MAGIC: &[u8; 4] = b"SKW1";
const BLOB_MAGIC: &[u8; 4] = b"SKB1";
const HEADER: usize = 12;
/// A frame larger than this is not one skein wrote: the tail is torn or the file is not a log.
const MAX_BODY: usize = 1 << 30;
/// Zero bytes kept written past the last frame, at least this many and fewer than twice
/// as many: an `fdatasync` of a file whose length is unchanged writes only its data pages,
/// where one that grew the file writes its inode too.
const RESERVE: u64 = 64 << 10;
/// Where the reserve written past a frame ending at `end` ends: [`RESERVE`] bytes or more
/// past it, on a multiple of [`RESERVE`].
fn reserve_past(end: u64) -> u64 {
    (end + RESERVE).next_multiple_of(RESERVE)
}
/// The format this version writes, and the newest it reads.
pub(crate) const FORMAT: u64 = 2;
/// The session of the mark's frames.
const MARK_SESSION: &str = "!mark";
/// A mark's frame: one record of 16 bytes.
const MARK_FRAME: usize = HEADER + 2 + MARK_SESSION.len() + 8 + 4 + 4 + 16;
/// A close writes a checkpoint of the index once this many bytes of frames lie past the
/// last one: an open then scans at most about this much of the log.
const CHECKPOINT_EVERY: u64 = 1 << 20;

fn io_err(what: &str, path: &Path, e: io::Error) -> Error {
    if crate::file::is_disk_full(&e) {
        return Error::full(
            format!(
                "event log: the disk holding {} is full: {what} it; nothing of this write \
                 was recorded, and it succeeds once there is room",
                path.display()
            ),
            e,
        );
    }
    Error::unavailable(format!("event log: {what} {}", path.display()), e)
}

/// The session named by the header frame: no session id can start with `!`. An older
/// version reads it as a session whose first frame starts at the format's seq, and stops
/// with an error that quotes it.
fn header_session(format: u64) -> String {
    format!(
        "!format {format} of events.log, written by a newer skein: open this data \
         directory with that version or a later one"
    )
}

/// A reader of `events.log` that is the cause of a refusal names its path.
fn path_err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::corrupt_because(format!("event log {}: {what}", path.display()))
}

/// A read past a failed `fdatasync` reports it.
#[derive(Debug)]
struct SyncFailed(Arc<io::Error>);

impl std::fmt::Display for SyncFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fdatasync failed: {}", self.0)
    }
}

impl std::error::Error for SyncFailed {}

/// A read takes the bytes between two records along when there are at most this many...
const COALESCE_GAP: u64 = 16 << 10;
/// ...and the whole read stays within this many.
const COALESCE_SPAN: u64 = 4 << 20;

fn end_of(a: At) -> u64 {
    a.offset + u64::from(a.len)
}

/// Where one record's bytes are in the file.
#[derive(Clone, Copy)]
pub(crate) struct At {
    pub(crate) offset: u64,
    pub(crate) len: u32,
}

/// A session's records past the checkpoint's table.
pub(crate) struct Tail {
    /// How many records of the session the table holds.
    pub(crate) before: u64,
    /// The records after them, in seq order (entry `i` is seq `before + i + 1`).
    pub(crate) recs: Vec<At>,
}

struct Index {
    /// Where the next frame goes.
    end: u64,
    /// The file's length: zeros from `end` on.
    reserved: u64,
    /// The checkpoint's table of the sessions' records up to where it ends.
    table: Option<checkpoint::Table>,
    /// Each session's records past the table (all of them without one).
    sessions: BTreeMap<String, Tail>,
    /// Each blob's bytes, by its blake3 hash.
    blobs: HashMap<[u8; 32], At>,
}

/// The mark as last written.
struct Marks {
    generation: u64,
    marked: u64,
}

pub(crate) struct Wal {
    path: PathBuf,
    file: Box<dyn LogFile>,
    index: Mutex<Index>,
    /// Where frames begin: after the header page, or at 0 in a format 1 file.
    base: u64,
    /// 1 or 2: whether the file has a header and a mark.
    format: u64,
    /// Where the two slots of the mark are (format 2).
    slots: [u64; 2],
    /// Held across a sync (so syncs and mark writes are in order).
    marks: Mutex<Marks>,
    /// How much of the file is known to be on the disk: all of it at open in format 2
    /// (see [`rewrite_unmarked`]), then what an `fdatasync` has covered. In format 1 (no
    /// mark) 0 until the first sync: what was in the file at open may not have reached the
    /// disk yet.
    synced: AtomicU64,
    /// `fdatasync` calls made.
    syncs: AtomicU64,
    /// Whether the header was written by this process and the file's directory not yet
    /// synced: the first sync syncs it too.
    name_unsynced: AtomicBool,
    /// The error of the first failed `fdatasync` (or write of the mark): set once, for
    /// good.
    failed: OnceLock<Arc<io::Error>>,
    /// Where the checkpoint of the index (`events.idx`) ends, as last read or written; 0
    /// for none.
    checkpointed: AtomicU64,
}

/// One frame read back by [`scan`].
pub(crate) enum Frame {
    Records {
        session: String,
        first_seq: u64,
        records: Vec<At>,
    },
    Blob {
        hash: [u8; 32],
        data: At,
    },
}

/// Why reading frames stopped before the end of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Why {
    /// Zero bytes where a frame would begin.
    Zeros,
    /// The file ends inside the frame.
    CutShort,
    /// Bytes that are no frame's beginning.
    NotAFrame,
    /// A frame header whose length is past any frame skein writes.
    TooLong,
    /// A frame whose body does not match its crc.
    Crc,
    /// A whole frame (its crc matches) of a kind this version does not know.
    UnknownKind([u8; 4]),
    /// A whole frame (its crc matches) whose body does not parse.
    Unparseable,
    /// Neither slot of the synced mark is whole.
    Mark,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Zeros => write!(f, "zero bytes where a frame should begin"),
            Why::CutShort => write!(f, "a frame cut short by the end of the file"),
            Why::NotAFrame => write!(f, "bytes that are not a frame"),
            Why::TooLong => write!(f, "a frame header with an impossible length"),
            Why::Crc => write!(f, "a frame whose checksum does not match"),
            Why::UnknownKind(k) => write!(
                f,
                "a whole frame of unknown kind {:?} (written by a newer skein?)",
                String::from_utf8_lossy(k)
            ),
            Why::Unparseable => {
                write!(f, "a frame whose checksum matches but which does not parse")
            }
            Why::Mark => write!(f, "both slots of the synced mark damaged"),
        }
    }
}

/// Where and why reading stopped.
#[derive(Debug, Clone)]
pub(crate) struct Stop {
    pub(crate) offset: u64,
    pub(crate) why: Why,
}

/// What reading a log file found, before anything is changed.
pub(crate) struct Examined {
    /// 1 (no header) or 2; 0 for a file without any frame yet (empty, or zeros).
    pub(crate) format: u64,
    pub(crate) base: u64,
    /// How far syncs had reached, by the mark (`base` without one).
    pub(crate) mark: u64,
    pub(crate) generation: u64,
    /// The two slots of the mark (format 2).
    pub(crate) slots: [u64; 2],
    pub(crate) frames: Vec<Frame>,
    /// Where the last whole frame ends.
    pub(crate) good_end: u64,
    pub(crate) len: u64,
    pub(crate) stop: Option<Stop>,
}

/// What to make of an [`Examined`] file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every byte is a whole frame, or the zeros of the reserve.
    Whole,
    /// A torn tail from `offset` on, past the mark: cut at open.
    Torn { offset: u64, why: Why },
    /// Damage a crash cannot explain: opening refuses.
    Damaged { offset: u64, why: Why, mark: u64 },
    /// The file ends before the mark: synced frames are missing.
    Short { len: u64, mark: u64 },
}

impl Verdict {
    /// The text of a refusal to open, for a verdict that refuses.
    pub(crate) fn refusal(&self, path: &Path) -> Option<Error> {
        let advice = "no acknowledged record is dropped without being asked: `skein store \
                      verify` reports what is damaged and what follows it, `skein store \
                      repair` sets it aside";
        match self {
            Verdict::Whole | Verdict::Torn { .. } => None,
            Verdict::Damaged { offset, why, mark } if offset < mark => Some(path_err(
                path,
                format!(
                    "{why} at offset {offset}, before offset {mark}, up to which syncs had \
                     made the log durable: that is damage, not a write torn by a crash; \
                     {advice}"
                ),
            )),
            Verdict::Damaged { offset, why, .. } => Some(path_err(
                path,
                format!("{why} at offset {offset}; {advice}"),
            )),
            Verdict::Short { len, mark } => Some(path_err(
                path,
                format!(
                    "the file ends at {len}, but syncs had made it durable up to {mark}: \
                     synced frames are missing; {advice}"
                ),
            )),
        }
    }
}

/// Reads `file` whole: its format, its mark, its frames and where and why they stop.
/// Changes nothing.
pub(crate) fn examine(file: &dyn LogFile, path: &Path) -> Result<Examined> {
    examine_from(file, path, None)
}

/// As [`examine`], reading the frames from `from` on (where a checkpoint of the index
/// ends: a frame's end) rather than from the first.
fn examine_from(file: &dyn LogFile, path: &Path, from: Option<u64>) -> Result<Examined> {
    let len = file.len().map_err(|e| io_err("cannot stat", path, e))?;
    let mut ex = Examined {
        format: 1,
        base: 0,
        mark: 0,
        generation: 0,
        slots: [0, 0],
        frames: vec![],
        good_end: 0,
        len,
        stop: None,
    };
    if len == 0 || zeros_from(file, path, 0, len)? {
        ex.format = 0;
        return Ok(ex);
    }
    // A header frame first, or a format 1 file's first frame.
    let (_, first_stop) = scan(file, path, 0, Some(1))?;
    if let Some(stop) = first_stop {
        // The first frame is damaged: a format 1 file's first frame, or a format 2 file's
        // header. Either way nothing can be read safely without being asked.
        ex.stop = Some(stop);
        return Ok(ex);
    }
    if let Some((slots, format)) = header_slots(file, path)? {
        if format > FORMAT {
            return Err(Error::refused(
                RefusalKind::Unsupported,
                format!(
                    "event log {} is of format {format}, written by a newer skein; this one \
                     reads formats up to {FORMAT}: open the data directory with that version \
                     or a later one",
                    path.display()
                ),
            ));
        }
        ex.format = format;
        ex.slots = slots;
        ex.base = slots[1] + MARK_FRAME as u64;
        match read_mark(file, path, slots)? {
            Some((generation, synced)) => {
                ex.generation = generation;
                ex.mark = synced;
            }
            None => {
                // A crash tears at most the slot being written, never both: both damaged
                // is damage at rest, and without the mark no tear can be told from it.
                ex.mark = ex.base;
                ex.stop = Some(Stop {
                    offset: slots[0],
                    why: Why::Mark,
                });
                return Ok(ex);
            }
        }
    }
    ex.mark = ex.mark.max(ex.base);
    let from = from
        .filter(|f| *f >= ex.base && *f <= len)
        .unwrap_or(ex.base);
    let (frames, stop) = scan(file, path, from, None)?;
    ex.good_end = stop.as_ref().map_or(len, |s| s.offset);
    ex.frames = frames;
    ex.stop = stop;
    Ok(ex)
}

impl Examined {
    /// Whether the bytes past the last whole frame are a torn tail, damage, or nothing but
    /// the reserve.
    pub(crate) fn verdict(&self, file: &dyn LogFile, path: &Path) -> Result<Verdict> {
        let Some(stop) = &self.stop else {
            if self.format >= 2 && self.good_end < self.mark {
                return Ok(Verdict::Short {
                    len: self.good_end,
                    mark: self.mark,
                });
            }
            return Ok(Verdict::Whole);
        };
        let (offset, why) = (stop.offset, stop.why.clone());
        match &why {
            Why::UnknownKind(_) | Why::Unparseable | Why::Mark => {
                return Ok(Verdict::Damaged {
                    offset,
                    why,
                    mark: self.mark,
                })
            }
            _ if self.format == 1 && offset == 0 => {
                // A format 1 file whose first frame is damaged, or a format 2 file whose
                // header is: never cut a whole file as a torn tail.
                return Ok(Verdict::Damaged {
                    offset,
                    why,
                    mark: self.mark,
                });
            }
            _ => {}
        }
        if offset < self.mark {
            return Ok(Verdict::Damaged {
                offset,
                why,
                mark: self.mark,
            });
        }
        if why == Why::Zeros && zeros_from(file, path, offset, self.len)? {
            return Ok(Verdict::Whole);
        }
        Ok(Verdict::Torn { offset, why })
    }
}

/// A frame of `session`'s records from `first_seq` on.
fn records_frame(session: &str, first_seq: u64, records: &[&[u8]]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&(session.len() as u16).to_le_bytes());
    body.extend_from_slice(session.as_bytes());
    body.extend_from_slice(&first_seq.to_le_bytes());
    body.extend_from_slice(&(records.len() as u32).to_le_bytes());
    for r in records {
        body.extend_from_slice(&(r.len() as u32).to_le_bytes());
        body.extend_from_slice(r);
    }
    framed(MAGIC, &body)
}

/// The mark's frame: `synced` as of `generation`.
fn mark_frame(generation: u64, synced: u64) -> Vec<u8> {
    let mut rec = [0u8; 16];
    rec[..8].copy_from_slice(&generation.to_le_bytes());
    rec[8..].copy_from_slice(&synced.to_le_bytes());
    records_frame(MARK_SESSION, 1, &[&rec])
}

/// The header of a new format 2 file: the header frame and the two slots of the mark,
/// frames back to back, so that a version before the header reads them all as frames
/// (and refuses the header's session) instead of stopping at a gap and taking the rest
/// for a torn tail.
fn header_page() -> Vec<u8> {
    let mut page = records_frame(&header_session(FORMAT), FORMAT, &[]);
    page.extend_from_slice(&mark_frame(0, 0));
    page.extend_from_slice(&mark_frame(0, 0));
    page
}

/// Where the two slots of the mark are in a file whose first frame, of `len` bytes, is
/// the header.
fn mark_slots(header_len: u64) -> [u64; 2] {
    [header_len, header_len + MARK_FRAME as u64]
}

/// The slots of the mark if the file at `path` begins with a whole header frame.
fn header_slots(file: &dyn LogFile, path: &Path) -> Result<Option<([u64; 2], u64)>> {
    let (first, stop) = scan(file, path, 0, Some(1))?;
    if stop.is_some() {
        return Ok(None);
    }
    let Some(Frame::Records {
        session,
        first_seq,
        records,
    }) = first.first()
    else {
        return Ok(None);
    };
    if !session.starts_with('!') || !records.is_empty() {
        return Ok(None);
    }
    let mut head = [0u8; HEADER];
    read_exact_at(file, &mut head, 0).map_err(|e| io_err("cannot read", path, e))?;
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as u64;
    Ok(Some((mark_slots(HEADER as u64 + len), *first_seq)))
}

/// The mark of the higher generation whose slot is whole: `(generation, synced)`.
fn read_mark(file: &dyn LogFile, path: &Path, slots: [u64; 2]) -> Result<Option<(u64, u64)>> {
    let mut best = None;
    for at in slots {
        let mut buf = [0u8; MARK_FRAME];
        match read_exact_at(file, &mut buf, at) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => continue,
            Err(e) => return Err(io_err("cannot read", path, e)),
        }
        if !crc_ok(&buf) {
            continue;
        }
        let Some(Frame::Records {
            session, records, ..
        }) = parse_body(&buf[HEADER..], HEADER as u64)
        else {
            continue;
        };
        let [rec] = records[..] else { continue };
        if session != MARK_SESSION || rec.len != 16 {
            continue;
        }
        let at = rec.offset as usize;
        let generation = u64::from_le_bytes(buf[at..at + 8].try_into().unwrap_or_default());
        let synced = u64::from_le_bytes(buf[at + 8..at + 16].try_into().unwrap_or_default());
        if best.is_none_or(|(g, _)| generation > g) {
            best = Some((generation, synced));
        }
    }
    Ok(best)
}

impl Wal {
    /// Opens (or creates) the log at `path`, rebuilding the index and cutting a torn tail;
    /// `wrap` puts a [`LogFile`] of its own around the file (tests inject faults so).
    pub(crate) fn open(
        path: &Path,
        wrap: Option<&dyn Fn(File) -> Box<dyn LogFile>>,
    ) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_err("cannot open", path, e))?;
        let file: Box<dyn LogFile> = match wrap {
            Some(w) => w(file),
            None => Box::new(file),
        };
        Self::open_on(path, file)
    }

    fn open_on(path: &Path, file: Box<dyn LogFile>) -> Result<Self> {
        let len = file.len().map_err(|e| io_err("cannot stat", path, e))?;
        let ck = checkpoint::read(path, &*file, len);
        let mut ex = examine_from(&*file, path, ck.as_ref().map(|c| c.table.end))?;
        // The checkpoint is used only if the scan went on from where it ends.
        let ck = ck.filter(|c| c.table.end >= ex.base && ex.format >= 1);
        let mut reserved = ex.len;
        let new = ex.format == 0;
        if new {
            // No frame yet: the header page and the first reserve behind it (see
            // `write_frame`). They, and the file's name in its directory, are made durable
            // by the first sync, before any append counts as durable: a crash before it
            // leaves an empty file, or one of zeros, or no file, each opened as a new log.
            // That sync grows the file once, so the later ones keep its length.
            let mut page = header_page();
            let base = page.len() as u64;
            let first_reserve = reserve_past(base);
            page.resize(first_reserve as usize, 0);
            write_all_at(&*file, &page, 0)
                .map_err(|e| io_err("cannot write the header of", path, e))?;
            ex.format = FORMAT;
            ex.slots = mark_slots(base - 2 * MARK_FRAME as u64);
            ex.base = base;
            ex.mark = base;
            ex.good_end = base;
            reserved = ex.len.max(first_reserve);
        } else {
            match ex.verdict(&*file, path)? {
                Verdict::Whole => {}
                Verdict::Torn { offset, why } => {
                    keep_torn_tail(&*file, path, offset, ex.len, &why)?;
                    reserved = offset;
                }
                v => {
                    return Err(v
                        .refusal(path)
                        .unwrap_or_else(|| path_err(path, "cannot be read")))
                }
            }
        }
        let good_end = ex.good_end;
        // (how far the file is known durable, the syncs that took)
        let (synced, syncs) = if new || ex.format < 2 {
            (0, 0)
        } else if good_end > ex.mark {
            rewrite_unmarked(&*file, path, ex.base, ex.mark, good_end)?;
            (good_end, 1)
        } else {
            (good_end, 0)
        };
        let mut checkpointed = ck.as_ref().map_or(0, |c| c.table.end);
        let (table, sessions, blobs) = match ck {
            Some(c) => match index_frames(path, ex.frames, Some(&c.table), c.blobs)? {
                Ok((sessions, blobs)) => (Some(c.table), sessions, blobs),
                Err(e) => {
                    tracing::warn!(log = %path.display(), error = %e, "reading the whole log instead");
                    checkpointed = 0;
                    let frames = frames_upto(&*file, path, ex.base, good_end)?;
                    let (s, b) = index_frames(path, frames, None, HashMap::new())?
                        .map_err(|e| path_err(path, e))?;
                    (None, s, b)
                }
            },
            None => {
                let (s, b) = index_frames(path, ex.frames, None, HashMap::new())?
                    .map_err(|e| path_err(path, e))?;
                (None, s, b)
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            file,
            index: Mutex::new(Index {
                end: good_end,
                reserved,
                table,
                sessions,
                blobs,
            }),
            base: ex.base,
            format: ex.format,
            slots: ex.slots,
            marks: Mutex::new(Marks {
                generation: ex.generation,
                marked: ex.mark,
            }),
            synced: AtomicU64::new(synced),
            syncs: AtomicU64::new(syncs),
            name_unsynced: AtomicBool::new(new),
            failed: OnceLock::new(),
            checkpointed: AtomicU64::new(checkpointed),
        })
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `records` as one frame if `session`'s last seq is `expected_last`; returns the
    /// seq actually last when it is not. The caller makes the write durable.
    pub(crate) fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
    ) -> Result<std::result::Result<(), u64>> {
        let sid = session.as_str();
        let slen = u16::try_from(sid.len())
            .map_err(|_| Error::corrupt_because(format!("session id of {} bytes", sid.len())))?;
        let mut body = Vec::with_capacity(
            2 + sid.len() + 12 + records.iter().map(|r| 4 + r.bytes.len()).sum::<usize>(),
        );
        body.extend_from_slice(&slen.to_le_bytes());
        body.extend_from_slice(sid.as_bytes());
        body.extend_from_slice(&(expected_last + 1).to_le_bytes());
        body.extend_from_slice(&(records.len() as u32).to_le_bytes());
        let mut at = Vec::with_capacity(records.len());
        for r in records {
            let len = u32::try_from(r.bytes.len()).map_err(|_| {
                Error::corrupt_because(format!("a record of {} bytes", r.bytes.len()))
            })?;
            body.extend_from_slice(&len.to_le_bytes());
            at.push((HEADER + body.len(), len));
            body.extend_from_slice(&r.bytes);
        }
        if body.len() > MAX_BODY {
            return Err(Error::corrupt_because(format!(
                "a batch of {} bytes (at most {MAX_BODY})",
                body.len()
            )));
        }
        let frame = framed(MAGIC, &body);

        let mut ix = self.lock();
        let last = match ix.sessions.get(sid) {
            Some(t) => t.before + t.recs.len() as u64,
            None => self.records_of(&mut ix, sid)?.map_or(0, |v| v.len() as u64),
        };
        if last != expected_last {
            return Ok(Err(last));
        }
        let start = self.write_frame(&mut ix, &frame)?;
        let tail = ix.sessions.entry(sid.to_string()).or_insert(Tail {
            before: last,
            recs: vec![],
        });
        tail.recs.extend(at.into_iter().map(|(off, len)| At {
            offset: start + off as u64,
            len,
        }));
        Ok(Ok(()))
    }

    /// Writes `frame` at the end of the log; returns where it starts. When the frame would
    /// reach past the reserve, the reserve is written anew first, from where it ends to
    /// [`RESERVE`] bytes or more past the frame: so the frame is written only into space
    /// the file has (a full disk fails the reserve's write, before any byte of the frame),
    /// the sync following this write grows the file, and the syncs of the next [`RESERVE`]
    /// bytes of frames do not. A write that fails leaves `end` where it was: nothing of
    /// the frame counts, and the next frame is written over what it left.
    fn write_frame(&self, ix: &mut Index, frame: &[u8]) -> Result<u64> {
        if let Some(e) = self.stopped() {
            return Err(e);
        }
        let start = ix.end;
        let end = start + frame.len() as u64;
        if end > ix.reserved {
            let to = reserve_past(end);
            let zeros = vec![0u8; (to - ix.reserved) as usize];
            write_all_at(&*self.file, &zeros, ix.reserved)
                .map_err(|e| io_err("cannot write", &self.path, e))?;
            ix.reserved = to;
        }
        write_all_at(&*self.file, frame, start)
            .map_err(|e| io_err("cannot write", &self.path, e))?;
        ix.end = end;
        Ok(start)
    }

    /// The error every append returns once an `fdatasync` has failed.
    pub(crate) fn stopped(&self) -> Option<Error> {
        self.failed.get().map(|e| {
            Error::unavailable(
                format!(
                    "event log {}: an fdatasync failed, so the log takes no more appends and \
                     acknowledges nothing more until the store is opened again (which reads \
                     the file anew)",
                    self.path.display()
                ),
                SyncFailed(e.clone()),
            )
        })
    }

    /// Writes `data` as a blob frame unless the log holds it already. A sync of anything
    /// written later makes it durable.
    pub(crate) fn put_blob(&self, hash: &[u8; 32], data: &[u8]) -> Result<()> {
        if data.len() + 32 > MAX_BODY {
            return Err(Error::corrupt_because(format!(
                "a blob of {} bytes (at most {} in the event log)",
                data.len(),
                MAX_BODY - 32
            )));
        }
        if self.lock().blobs.contains_key(hash) {
            return Ok(());
        }
        let mut body = Vec::with_capacity(32 + data.len());
        body.extend_from_slice(hash);
        body.extend_from_slice(data);
        let frame = framed(BLOB_MAGIC, &body);
        let mut ix = self.lock();
        if ix.blobs.contains_key(hash) {
            return Ok(());
        }
        let start = self.write_frame(&mut ix, &frame)?;
        let len = u32::try_from(data.len())
            .map_err(|_| Error::corrupt_because(format!("a blob of {} bytes", data.len())))?;
        ix.blobs.insert(
            *hash,
            At {
                offset: start + (HEADER + 32) as u64,
                len,
            },
        );
        Ok(())
    }

    /// The blob stored under `hash`, if the log holds it.
    pub(crate) fn blob(&self, hash: &[u8; 32]) -> Result<Option<Vec<u8>>> {
        let Some(a) = self.lock().blobs.get(hash).copied() else {
            return Ok(None);
        };
        let mut buf = vec![0u8; a.len as usize];
        read_exact_at(&*self.file, &mut buf, a.offset)
            .map_err(|e| io_err("cannot read", &self.path, e))?;
        Ok(Some(buf))
    }

    /// Makes every write so far durable.
    ///
    /// A sync with nothing written since the last one returns at once: the end of a run
    /// asked for one after its last group commit, and again when the store closed. The
    /// first sync that fails stops the log for good (see the module's doc): it and every
    /// later one return that error.
    pub(crate) fn sync(&self) -> io::Result<()> {
        let mut marks = self.marks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = self.failed.get() {
            return Err(io::Error::new(e.kind(), SyncFailed(e.clone())));
        }
        // Every write below `end` has completed: a frame is written before `end` moves.
        let end = self.lock().end;
        let synced = self.synced.load(Ordering::Acquire);
        if end <= synced.max(self.base) {
            return Ok(());
        }
        // The mark says how far the previous sync reached; this one makes it durable.
        if self.format >= 2 && synced > marks.marked {
            self.write_mark(&mut marks, synced)
                .map_err(|e| self.fail(e))?;
        }
        self.file.sync_data().map_err(|e| self.fail(e))?;
        if self.name_unsynced.load(Ordering::Acquire) {
            // A new log's name, once its header is durable (the sync just made).
            let dir = self.path.parent().unwrap_or(Path::new("."));
            sync_dir(dir).map_err(|e| self.fail(e))?;
            self.name_unsynced.store(false, Ordering::Release);
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.synced.fetch_max(end, Ordering::AcqRel);
        Ok(())
    }

    /// Syncs, and moves the mark up to all that is synced, so that no frame of the closed
    /// log is taken for a torn one at the next open.
    ///
    /// The mark is written, not synced: everything it names is durable already, so the
    /// next open finds it (a process's end keeps the page cache), and a crash of the
    /// machine that loses it leaves the mark before it, which only takes more of the file
    /// for a possible tear, as after any crash. Its slot is the one not written last, so
    /// a write torn by such a crash spoils neither the other slot nor a frame.
    pub(crate) fn close(&self) -> io::Result<()> {
        self.sync()?;
        let mut marks = self.marks.lock().unwrap_or_else(|p| p.into_inner());
        let synced = self.synced.load(Ordering::Acquire);
        if self.format < 2 || self.failed.get().is_some() {
            return Ok(());
        }
        if synced > marks.marked {
            self.write_mark(&mut marks, synced)
                .map_err(|e| self.fail(e))?;
        }
        drop(marks);
        self.checkpoint_if_due();
        Ok(())
    }

    /// Writes a checkpoint of the index when the frames past the last one reach
    /// [`CHECKPOINT_EVERY`], and every frame written is synced. A checkpoint that cannot be
    /// written is only a slower next open: reported, not an error.
    fn checkpoint_if_due(&self) {
        let ix = self.lock();
        let synced = self.synced.load(Ordering::Acquire);
        let from = self.checkpointed.load(Ordering::Acquire).max(self.base);
        if self.format < 2 || ix.end != synced || ix.end < from + CHECKPOINT_EVERY {
            return;
        }
        let mut entries = checkpoint::merged(ix.table.as_ref(), &ix.sessions);
        match checkpoint::write(&self.path, &*self.file, ix.end, &mut entries, &ix.blobs) {
            Ok(()) => self.checkpointed.store(ix.end, Ordering::Release),
            Err(e) => tracing::warn!(
                log = %self.path.display(),
                error = %e,
                "could not write the checkpoint of the event log's index; the next open reads more of the log"
            ),
        }
    }

    /// Writes `synced` into the mark slot not written last. Not durable until a sync.
    fn write_mark(&self, marks: &mut Marks, synced: u64) -> io::Result<()> {
        let generation = marks.generation + 1;
        let slot = self.slots[(generation % 2) as usize];
        write_all_at(&*self.file, &mark_frame(generation, synced), slot)?;
        marks.generation = generation;
        marks.marked = synced;
        Ok(())
    }

    /// Stops the log for good on a failed sync; returns the error to report.
    fn fail(&self, e: io::Error) -> io::Error {
        tracing::error!(
            log = %self.path.display(),
            error = %e,
            "fdatasync of the event log failed: the log is stopped, every waiting and later \
             append fails; open the store again once the disk is sound"
        );
        let first = self.failed.get_or_init(|| Arc::new(e)).clone();
        io::Error::new(first.kind(), SyncFailed(first))
    }

    /// Whether a sync of this process covers `session`'s last record (so for a session
    /// without records).
    pub(crate) fn last_synced(&self, session: &SessionId) -> bool {
        let synced = self.synced.load(Ordering::Acquire);
        let mut ix = self.lock();
        let last = match ix
            .sessions
            .get(session.as_str())
            .and_then(|t| t.recs.last())
        {
            Some(a) => Ok(Some(*a)),
            None => self
                .records_of(&mut ix, session.as_str())
                .map(|v| v.and_then(|v| v.last().copied())),
        };
        // A session whose records cannot be looked up counts as not synced.
        last.is_ok_and(|l| l.is_none_or(|at| at.offset + u64::from(at.len) <= synced))
    }

    /// All of `sid`'s records: those the checkpoint's table holds, then those past it; none
    /// for a session the log does not hold. A block of the table found damaged drops the
    /// table (see [`Wal::drop_table`]).
    fn records_of(&self, ix: &mut Index, sid: &str) -> Result<Option<Vec<At>>> {
        loop {
            let tail = ix.sessions.get(sid);
            let Some(table) = ix
                .table
                .as_ref()
                .filter(|_| tail.is_none_or(|t| t.before > 0))
            else {
                return Ok(tail.map(|t| t.recs.clone()));
            };
            match table.get(sid) {
                Ok(found) => {
                    let Some(mut recs) = found else {
                        return Ok(tail.map(|t| t.recs.clone()));
                    };
                    if let Some(t) = tail {
                        recs.extend_from_slice(&t.recs);
                    }
                    return Ok(Some(recs));
                }
                Err(e) => self.drop_table(ix, e)?,
            }
        }
    }

    /// Drops the checkpoint's table, found damaged, and indexes every frame of the log in
    /// memory instead, as an open without a checkpoint does; the next close that is due
    /// writes a new one.
    fn drop_table(&self, ix: &mut Index, e: io::Error) -> Result<()> {
        tracing::warn!(
            log = %self.path.display(),
            error = %e,
            "reading the whole event log to index it instead of the checkpoint"
        );
        let frames = frames_upto(&*self.file, &self.path, self.base, ix.end)?;
        let (sessions, blobs) = index_frames(&self.path, frames, None, HashMap::new())?
            .map_err(|e| path_err(&self.path, e))?;
        ix.table = None;
        ix.sessions = sessions;
        ix.blobs = blobs;
        self.checkpointed.store(0, Ordering::Release);
        Ok(())
    }

    /// Where the last frame ends.
    pub(crate) fn end(&self) -> u64 {
        self.lock().end
    }

    /// How many `fdatasync` calls the log has made since it was opened.
    pub(crate) fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// `session`'s records from `from_seq` on.
    pub(crate) fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        let at: Vec<At> = {
            let mut ix = self.lock();
            match self.records_of(&mut ix, session.as_str())? {
                None => return Ok(vec![]),
                Some(v) => {
                    let from = (from_seq.max(1) - 1) as usize;
                    v.get(from..).map(<[At]>::to_vec).unwrap_or_default()
                }
            }
        };
        // Records close together in the file (a batch, or appends near in time) are read
        // with one positioned read and cut apart.
        let mut out = Vec::with_capacity(at.len());
        let mut i = 0;
        while i < at.len() {
            let start = at[i].offset;
            let mut j = i + 1;
            while j < at.len()
                && at[j].offset >= end_of(at[j - 1])
                && at[j].offset - end_of(at[j - 1]) <= COALESCE_GAP
                && end_of(at[j]) - start <= COALESCE_SPAN
            {
                j += 1;
            }
            if j == i + 1 {
                out.push(self.record(session, at[i])?);
            } else {
                let mut buf = vec![0u8; (end_of(at[j - 1]) - start) as usize];
                read_exact_at(&*self.file, &mut buf, start)
                    .map_err(|e| io_err("cannot read", &self.path, e))?;
                for a in &at[i..j] {
                    let from = (a.offset - start) as usize;
                    let bytes = buf[from..from + a.len as usize].to_vec();
                    out.push(
                        Record::decode(bytes)
                            .map_err(|e| Error::corrupt(format!("record of {session}"), e))?,
                    );
                }
            }
            i = j;
        }
        Ok(out)
    }

    /// `session`'s last record.
    pub(crate) fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        let at = {
            let mut ix = self.lock();
            match ix
                .sessions
                .get(session.as_str())
                .and_then(|t| t.recs.last())
            {
                Some(a) => Some(*a),
                None => self
                    .records_of(&mut ix, session.as_str())?
                    .and_then(|v| v.last().copied()),
            }
        };
        at.map(|a| self.record(session, a)).transpose()
    }

    fn record(&self, session: &SessionId, a: At) -> Result<Record> {
        let mut buf = vec![0u8; a.len as usize];
        read_exact_at(&*self.file, &mut buf, a.offset)
            .map_err(|e| io_err("cannot read", &self.path, e))?;
        Record::decode(buf).map_err(|e| Error::corrupt(format!("record of {session}"), e))
    }

    /// The roots whose last record lies at or past `offset` (where a frame begins): from
    /// the records past the checkpoint's table when `offset` lies past its end, else from
    /// the frames from `offset` on (so the cost follows what was written since, not
    /// history), or the table when those frames cannot be read through to the end.
    pub(crate) fn roots_written_since(&self, offset: u64) -> Result<Vec<String>> {
        let is_root = |k: &str| !k.contains('.') && !k.starts_with('!');
        let mut ix = self.lock();
        if ix.table.as_ref().is_some_and(|t| offset < t.end) && offset >= self.base {
            let (frames, stop) = scan(&*self.file, &self.path, offset, None)?;
            if stop.is_none_or(|s| s.offset >= ix.end) {
                let mut out = BTreeSet::new();
                for f in frames {
                    if let Frame::Records {
                        session, records, ..
                    } = f
                    {
                        let before_end = records.last().is_some_and(|a| end_of(*a) <= ix.end);
                        if before_end && is_root(&session) {
                            out.insert(session);
                        }
                    }
                }
                return Ok(out.into_iter().collect());
            }
        }
        loop {
            let mut out: BTreeSet<String> = ix
                .sessions
                .iter()
                .filter(|(k, t)| is_root(k) && t.recs.last().is_some_and(|a| a.offset >= offset))
                .map(|(k, _)| k.clone())
                .collect();
            let Some(table) = ix.table.as_ref().filter(|t| offset < t.end) else {
                return Ok(out.into_iter().collect());
            };
            let found = table.for_each(|(k, v)| {
                if is_root(&k)
                    && !ix.sessions.contains_key(&k)
                    && v.last().is_some_and(|a| a.offset >= offset)
                {
                    out.insert(k);
                }
                Ok(())
            });
            match found {
                Ok(()) => return Ok(out.into_iter().collect()),
                Err(e) => self.drop_table(&mut ix, e)?,
            }
        }
    }

    /// Every session whose id starts with `prefix`, in id order.
    pub(crate) fn sessions_from(&self, prefix: &str) -> Result<Vec<String>> {
        let mut ix = self.lock();
        loop {
            let tails = ix
                .sessions
                .range(prefix.to_string()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, _)| k.clone());
            let Some(table) = ix.table.as_ref() else {
                return Ok(tails.collect());
            };
            match table.ids_from(prefix) {
                Ok(ids) => {
                    let mut all: BTreeSet<String> = ids.into_iter().collect();
                    all.extend(tails);
                    return Ok(all.into_iter().collect());
                }
                Err(e) => self.drop_table(&mut ix, e)?,
            }
        }
    }
}

/// The frames of the log from `from` to `end`.
fn frames_upto(file: &dyn LogFile, path: &Path, from: u64, end: u64) -> Result<Vec<Frame>> {
    let (frames, _) = scan(file, path, from, None)?;
    Ok(frames
        .into_iter()
        .filter(|f| match f {
            Frame::Records { records, .. } => records.last().is_none_or(|a| end_of(*a) <= end),
            Frame::Blob { data, .. } => end_of(*data) <= end,
        })
        .collect())
}

/// What [`compact`] kept and dropped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Compacted {
    pub(crate) sessions: u64,
    pub(crate) records: u64,
    pub(crate) bytes_before: u64,
    pub(crate) bytes_after: u64,
}

/// Writes the log at `path` anew without the records of the sessions `remove` names: its
/// other frames (blobs included) in the same order, behind a new header, with the mark
/// over all of it, synced; then puts it in the old one's place (a rename, its directory
/// synced). A crash before the rename leaves the old log as it was. The store must be
/// closed and the log whole (opening the store cuts a torn tail; damage is refused).
pub(crate) fn compact(path: &Path, remove: &dyn Fn(&str) -> bool) -> Result<Compacted> {
    let file = OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(|e| io_err("cannot open", path, e))?;
    let ex = examine(&file, path)?;
    match ex.verdict(&file, path)? {
        Verdict::Whole => {}
        v => {
            return Err(v.refusal(path).unwrap_or_else(|| {
                path_err(
                    path,
                    "ends in a torn write: open the store once (which sets it aside) first",
                )
            }))
        }
    }
    let tmp = PathBuf::from(format!("{}.compact", path.display()));
    let out = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&tmp)
        .map_err(|e| io_err("cannot create", &tmp, e))?;
    let mut w = io::BufWriter::with_capacity(1 << 20, &out);
    let page = header_page();
    let mut end = page.len() as u64;
    let mut done = Compacted {
        bytes_before: ex.good_end,
        ..Compacted::default()
    };
    let mut dropped_sessions = std::collections::HashSet::new();
    let read = |a: At| -> Result<Vec<u8>> {
        let mut buf = vec![0u8; a.len as usize];
        read_exact_at(&file, &mut buf, a.offset).map_err(|e| io_err("cannot read", path, e))?;
        Ok(buf)
    };
    let write = |w: &mut io::BufWriter<&File>, bytes: &[u8]| {
        io::Write::write_all(w, bytes).map_err(|e| io_err("cannot write", &tmp, e))
    };
    write(&mut w, &page)?;
    for f in ex.frames {
        let frame = match f {
            Frame::Records {
                session, records, ..
            } if remove(&session) => {
                done.records += records.len() as u64;
                dropped_sessions.insert(session);
                continue;
            }
            Frame::Records {
                session,
                first_seq,
                records,
            } => {
                let bytes = records
                    .iter()
                    .map(|a| read(*a))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
                records_frame(&session, first_seq, &refs)
            }
            Frame::Blob { hash, data } => {
                let mut body = hash.to_vec();
                body.extend_from_slice(&read(data)?);
                framed(BLOB_MAGIC, &body)
            }
        };
        write(&mut w, &frame)?;
        end += frame.len() as u64;
    }
    io::Write::flush(&mut w).map_err(|e| io_err("cannot write", &tmp, e))?;
    drop(w);
    // The mark over every frame: nothing of the new log counts as a torn tail.
    let slots = mark_slots((page.len() - 2 * MARK_FRAME) as u64);
    write_all_at(&out, &mark_frame(1, end), slots[1])
        .and_then(|()| out.sync_all())
        .map_err(|e| io_err("cannot sync", &tmp, e))?;
    // The checkpoint of the old log's index would not match the new log: gone first.
    match std::fs::remove_file(checkpoint::path_of(path)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("cannot remove the checkpoint of", path, e))
        }
        _ => {}
    }
    std::fs::rename(&tmp, path).map_err(|e| io_err("cannot rename over", path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
        .map_err(|e| io_err("cannot sync the directory of", path, e))?;
    done.sessions = dropped_sessions.len() as u64;
    done.bytes_after = end;
    Ok(done)
}

/// Each session's records and each blob of `frames`, checking that every session's frames
/// follow on from each other, going on from `table` (the checkpoint's, whose end is where
/// the frames begin) and its `blobs`. `Ok(Err(_))` when a block of the table is damaged.
#[allow(clippy::type_complexity)]
fn index_frames(
    path: &Path,
    frames: Vec<Frame>,
    table: Option<&checkpoint::Table>,
    mut blobs: HashMap<[u8; 32], At>,
) -> Result<io::Result<(BTreeMap<String, Tail>, HashMap<[u8; 32], At>)>> {
    let mut sessions: BTreeMap<String, Tail> = BTreeMap::new();
    for f in frames {
        let (session, first_seq, records) = match f {
            Frame::Blob { hash, data } => {
                blobs.insert(hash, data);
                continue;
            }
            Frame::Records {
                session,
                first_seq,
                records,
            } => (session, first_seq, records),
        };
        let tail = match sessions.entry(session.clone()) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let before = match table.map(|t| t.get(&session)).transpose() {
                    Ok(found) => found.flatten().map_or(0, |r| r.len() as u64),
                    Err(e) => return Ok(Err(e)),
                };
                v.insert(Tail {
                    before,
                    recs: vec![],
                })
            }
        };
        let have = tail.before + tail.recs.len() as u64;
        if have + 1 != first_seq {
            return Err(path_err(
                path,
                format!("a frame of {session} starts at seq {first_seq} after seq {have}"),
            ));
        }
        tail.recs.extend(records);
    }
    Ok(Ok((sessions, blobs)))
}

/// Reads frames from `from` on, at most `limit` of them; returns them, and where and why
/// reading stopped if that was before the end of the file.
pub(crate) fn scan(
    file: &dyn LogFile,
    path: &Path,
    from: u64,
    limit: Option<usize>,
) -> Result<(Vec<Frame>, Option<Stop>)> {
    let len = file.len().map_err(|e| io_err("cannot stat", path, e))?;
    // A read of a frame or two (the header, at every open) takes a small buffer: one of
    // 1 MiB made each open copy megabytes for a few hundred bytes.
    let cap = if limit.is_some_and(|l| l <= 2) {
        16 << 10
    } else {
        1 << 20
    };
    let mut r = BufReader::with_capacity(cap, Reader { file, pos: from });
    let mut frames = vec![];
    let mut pos = from;
    let stopped = loop {
        if limit.is_some_and(|l| frames.len() >= l) {
            break None;
        }
        let mut head = [0u8; HEADER];
        match read_full(&mut r, &mut head) {
            Ok(true) => {}
            Ok(false) if pos == len => break None,
            Ok(false) if head.iter().all(|&b| b == 0) => {
                break Some(Stop {
                    offset: pos,
                    why: Why::Zeros,
                })
            }
            Ok(false) => {
                break Some(Stop {
                    offset: pos,
                    why: Why::CutShort,
                })
            }
            Err(e) => return Err(io_err("cannot read", path, e)),
        }
        let magic: [u8; 4] = [head[0], head[1], head[2], head[3]];
        let blob = &magic == BLOB_MAGIC;
        if !blob && &magic != MAGIC && !magic.starts_with(b"SK") {
            if head.iter().all(|&b| b == 0) {
                break Some(Stop {
                    offset: pos,
                    why: Why::Zeros,
                });
            }
            break Some(Stop {
                offset: pos,
                why: Why::NotAFrame,
            });
        }
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let crc = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if len > MAX_BODY {
            break Some(Stop {
                offset: pos,
                why: Why::TooLong,
            });
        }
        let mut body = vec![0u8; len];
        match read_full(&mut r, &mut body) {
            Ok(true) => {}
            Ok(false) => {
                break Some(Stop {
                    offset: pos,
                    why: Why::CutShort,
                })
            }
            Err(e) => return Err(io_err("cannot read", path, e)),
        }
        if crc32fast::hash(&body) != crc {
            break Some(Stop {
                offset: pos,
                why: Why::Crc,
            });
        }
        let parsed = if blob {
            parse_blob(&body, pos + HEADER as u64)
        } else if &magic == MAGIC {
            parse_body(&body, pos + HEADER as u64)
        } else {
            break Some(Stop {
                offset: pos,
                why: Why::UnknownKind(magic),
            });
        };
        let Some(f) = parsed else {
            break Some(Stop {
                offset: pos,
                why: Why::Unparseable,
            });
        };
        frames.push(f);
        pos += (HEADER + len) as u64;
    };
    Ok((frames, stopped))
}

/// The length of a frame's header.
pub(crate) const HEADER_LEN: usize = HEADER;
/// The longest body of a frame.
pub(crate) const MAX_BODY_LEN: u64 = MAX_BODY as u64;

/// Whether `m` is the magic of a record or a blob frame.
pub(crate) fn is_frame_magic(m: &[u8]) -> bool {
    m == MAGIC || m == BLOB_MAGIC
}

/// What a frame found by [`frame_at`] holds.
pub(crate) enum Peek {
    Records {
        session: String,
        first_seq: u64,
        count: u64,
    },
    Blob,
}

/// Whether the frame at the start of `bytes` matches its checksum.
pub(crate) fn crc_ok(bytes: &[u8]) -> bool {
    let Some(len) = bytes
        .get(4..8)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    else {
        return false;
    };
    let Some(body) = bytes.get(HEADER..HEADER + len as usize) else {
        return false;
    };
    bytes[8..12] == crc32fast::hash(body).to_le_bytes()
}

/// A record or blob frame at the start of `bytes`: its length and, when it parses, what it
/// holds. With `whole`, only a frame that matches its checksum.
pub(crate) fn frame_at(bytes: &[u8], whole: bool) -> Option<(usize, Option<Peek>)> {
    let magic = bytes.get(..4)?;
    if magic != MAGIC && magic != BLOB_MAGIC {
        return None;
    }
    let len = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?) as usize;
    if len > MAX_BODY {
        return None;
    }
    let body = bytes.get(HEADER..HEADER + len)?;
    let crc = crc_ok(bytes);
    if whole && !crc {
        return None;
    }
    let peek = if magic == BLOB_MAGIC {
        parse_blob(body, 0).map(|_| Peek::Blob)
    } else {
        match parse_body(body, 0) {
            Some(Frame::Records {
                session,
                first_seq,
                records,
            }) => Some(Peek::Records {
                session,
                first_seq,
                count: records.len() as u64,
            }),
            _ => None,
        }
    };
    if peek.is_none() && !crc {
        return None;
    }
    Some((HEADER + len, peek))
}

/// Whether the file's header frame is damaged while the mark's slots behind it (where this
/// version puts them) are whole: then the header can be written anew.
pub(crate) fn header_only_damaged(file: &dyn LogFile, path: &Path) -> Result<bool> {
    let header_len = header_page().len() - 2 * MARK_FRAME;
    if header_slots(file, path)?.is_some() {
        return Ok(false);
    }
    Ok(read_mark(file, path, mark_slots(header_len as u64))?.is_some())
}

/// Writes the header frame anew over a damaged one, durably.
pub(crate) fn rewrite_header(file: &dyn LogFile, path: &Path) -> Result<()> {
    let page = header_page();
    let header = &page[..page.len() - 2 * MARK_FRAME];
    write_all_at(file, header, 0)
        .and_then(|()| file.sync_data())
        .map_err(|e| io_err("cannot write the header of", path, e))
}

/// If the file has a whole header and neither mark slot is whole, writes both anew with
/// a mark at the first frame (so that a later bad frame counts as a torn tail, as in a
/// log without a mark), durably; whether it did.
pub(crate) fn rewrite_damaged_marks(file: &dyn LogFile, path: &Path) -> Result<bool> {
    let Some((slots, _)) = header_slots(file, path)? else {
        return Ok(false);
    };
    if read_mark(file, path, slots)?.is_some() {
        return Ok(false);
    }
    let base = slots[1] + MARK_FRAME as u64;
    write_all_at(file, &mark_frame(1, base), slots[1])
        .and_then(|()| write_all_at(file, &mark_frame(2, base), slots[0]))
        .and_then(|()| file.sync_data())
        .map_err(|e| io_err("cannot write the mark of", path, e))?;
    Ok(true)
}

/// Cuts the log at `at` and lowers its mark to it if it is past it, durably.
pub(crate) fn cut(file: &dyn LogFile, path: &Path, at: u64) -> Result<()> {
    let slots = header_slots(file, path)?.map(|(slots, _)| slots);
    file.set_len(at)
        .map_err(|e| io_err("cannot truncate", path, e))?;
    if let Some(slots) = slots.filter(|s| at >= s[1] + MARK_FRAME as u64) {
        if let Some((generation, synced)) = read_mark(file, path, slots)? {
            if synced > at {
                let slot = slots[((generation + 1) % 2) as usize];
                write_all_at(file, &mark_frame(generation + 1, at), slot)
                    .map_err(|e| io_err("cannot write the mark of", path, e))?;
            }
        }
    }
    file.sync_data().map_err(|e| io_err("cannot sync", path, e))
}

/// Fills `buf`; `Ok(false)` when the file ends first.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => return Ok(false),
            k => n += k,
        }
    }
    Ok(true)
}

fn parse_body(body: &[u8], body_offset: u64) -> Option<Frame> {
    let mut p = 0usize;
    let take = |p: &mut usize, n: usize| -> Option<&[u8]> {
        let s = body.get(*p..p.checked_add(n)?)?;
        *p += n;
        Some(s)
    };
    let slen = u16::from_le_bytes(take(&mut p, 2)?.try_into().ok()?) as usize;
    let session = std::str::from_utf8(take(&mut p, slen)?).ok()?.to_string();
    let first_seq = u64::from_le_bytes(take(&mut p, 8)?.try_into().ok()?);
    let count = u32::from_le_bytes(take(&mut p, 4)?.try_into().ok()?);
    let mut records = Vec::with_capacity(count.min(1 << 16) as usize);
    for _ in 0..count {
        let len = u32::from_le_bytes(take(&mut p, 4)?.try_into().ok()?);
        let offset = body_offset + p as u64;
        take(&mut p, len as usize)?;
        records.push(At { offset, len });
    }
    (p == body.len() && first_seq >= 1).then_some(Frame::Records {
        session,
        first_seq,
        records,
    })
}

fn parse_blob(body: &[u8], body_offset: u64) -> Option<Frame> {
    let hash: [u8; 32] = body.get(..32)?.try_into().ok()?;
    let len = u32::try_from(body.len() - 32).ok()?;
    Some(Frame::Blob {
        hash,
        data: At {
            offset: body_offset + 32,
            len,
        },
    })
}

/// `body` behind a frame header with `magic`.
fn framed(magic: &[u8; 4], body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER + body.len());
    frame.extend_from_slice(magic);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

/// Whether the file holds only zero bytes from `from` to `to`.
fn zeros_from(file: &dyn LogFile, path: &Path, from: u64, to: u64) -> Result<bool> {
    let mut buf = vec![0u8; (to.saturating_sub(from)).min(1 << 20) as usize];
    let mut at = from;
    while at < to {
        let n = buf.len().min((to - at) as usize);
        read_exact_at(file, &mut buf[..n], at).map_err(|e| io_err("cannot read", path, e))?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// Copies the bytes of `file` from `from` on into `aside`, and makes the copy and its
/// name durable, before anything is cut.
pub(crate) fn copy_aside(
    file: &dyn LogFile,
    path: &Path,
    from: u64,
    len: u64,
    aside: &Path,
) -> Result<()> {
    let mut tail = vec![0u8; (len - from) as usize];
    read_exact_at(file, &mut tail, from).map_err(|e| io_err("cannot read", path, e))?;
    let write = || -> io::Result<()> {
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(aside)?;
        io::Write::write_all(&mut f, &tail)?;
        f.sync_all()?;
        sync_dir(aside.parent().unwrap_or(Path::new(".")))
    };
    write().map_err(|e| io_err("cannot write", aside, e))
}

/// Writes again, and syncs, the bytes an open found past the mark (`mark..end`) and the
/// header page before `base`, so that everything the opened log holds is on the disk
/// before the log reads or acknowledges any of it.
///
/// The frames past the mark were written but are not known to be durable: a process that
/// died left its last group commit and its appends ahead there, and one whose
/// `fdatasync` failed left what that sync was to cover. After a failed `fdatasync`, Linux
/// may have marked the dirty pages clean without writing them: they read back until the
/// page cache drops them, no later `fdatasync` writes them, and a power loss, or only the
/// cache's eviction, takes them. A log that read them would then answer from records that
/// can vanish (a submission found present and taken as made, then gone), and a sync for a
/// frame appended behind them would leave a hole before it, which the next open cuts with
/// the acknowledged frame. Writing the bytes makes their pages dirty again, so this sync
/// writes them; bytes the cache had already dropped read back as the disk holds them, and
/// the scan before this one has cut them as a torn tail. The header page is written too: a
/// new log whose first sync failed has it only in the cache. A clean close leaves nothing
/// past the mark, so this costs an open only after a crash or a failed sync.
fn rewrite_unmarked(file: &dyn LogFile, path: &Path, base: u64, mark: u64, end: u64) -> Result<()> {
    const CHUNK: u64 = 1 << 20;
    let mut buf = Vec::new();
    for (from, to) in [(0, base), (mark.max(base), end)] {
        let mut at = from;
        while at < to {
            let n = (to - at).min(CHUNK) as usize;
            buf.resize(n, 0);
            read_exact_at(file, &mut buf, at).map_err(|e| io_err("cannot read", path, e))?;
            write_all_at(file, &buf, at).map_err(|e| io_err("cannot write", path, e))?;
            at += n as u64;
        }
    }
    file.sync_data()
        .map_err(|e| io_err("cannot sync what a crash left in", path, e))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    sync_dir(dir).map_err(|e| io_err("cannot sync the directory of", path, e))
}

/// Copies the bytes past the last whole frame aside and cuts the log there.
fn keep_torn_tail(
    file: &dyn LogFile,
    path: &Path,
    good_end: u64,
    len: u64,
    why: &Why,
) -> Result<()> {
    let aside = PathBuf::from(format!("{}.torn-{good_end}", path.display()));
    copy_aside(file, path, good_end, len, &aside)?;
    file.set_len(good_end)
        .and_then(|()| file.sync_data())
        .map_err(|e| io_err("cannot truncate", path, e))?;
    tracing::warn!(
        log = %path.display(),
        kept = good_end,
        cut = len - good_end,
        aside = %aside.display(),
        found = %why,
        "the event log ended in a torn write, past what syncs had covered; the bytes after \
         the last whole frame are kept aside"
    );
    Ok(())
}
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use skein_core::event::{genesis_hash, Completed};
    use skein_core::{Envelope, Event, Record, SessionId};

    use super::Wal;

    fn record(id: &SessionId, seq: u64) -> Record {
        let env = Envelope::new(
            id.clone(),
            seq,
            1_700_000_000_000,
            genesis_hash(id),
            Event::Completed(Completed {
                answer: format!("answer {seq}"),
                usage_total: Default::default(),
                steps: 1,
                partial: false,
            }),
        );
        let bytes = env.encode().unwrap();
        Record { env, bytes }
    }

    #[test]
    fn the_header_is_a_frame_an_older_version_reads_and_refuses_to_go_on_from() {
        // A version before the header reads its frames like any other: a session's
        // frame whose first seq is the format, above 1, with no record before it, which
        // such a version reports as an error quoting the session's name, rather than
        // taking the file for a torn tail.
        let page = super::header_page();
        let len = u32::from_le_bytes(page[4..8].try_into().unwrap()) as usize;
        // What follows the header are whole frames too: an older version reads through
        // to the end of the file before it refuses.
        let mut at = 12 + len;
        for _ in 0..2 {
            let (n, _) = super::frame_at(&page[at..], true).unwrap();
            at += n;
        }
        assert_eq!(at, page.len());
        assert_eq!(&page[..4], super::MAGIC);
        let body = &page[12..12 + len];
        assert_eq!(
            u32::from_le_bytes(page[8..12].try_into().unwrap()),
            crc32fast::hash(body)
        );
        let Some(super::Frame::Records {
            session,
            first_seq,
            records,
        }) = super::parse_body(body, 12)
        else {
            panic!("the header does not parse as a frame of records");
        };
        assert!(first_seq >= 2 && records.is_empty());
        assert!(session.contains("written by a newer skein"), "{session}");
        assert!(
            SessionId::parse(&session).is_err(),
            "a session could be named so"
        );
    }

    #[test]
    fn a_sync_with_nothing_new_written_makes_no_fdatasync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.log");
        let id = SessionId::root("walsync").unwrap();
        let w = Wal::open(&path, None).unwrap();
        w.sync().unwrap();
        assert_eq!(w.syncs(), 0, "an empty log has nothing to sync");
        w.append(&id, 0, &[record(&id, 1)]).unwrap().unwrap();
        w.sync().unwrap();
        w.sync().unwrap();
        assert_eq!(w.syncs(), 1);
        w.append(&id, 1, &[record(&id, 2)]).unwrap().unwrap();
        w.sync().unwrap();
        assert_eq!(w.syncs(), 2);
        drop(w);
        // Reopened without a close: the open writes again and syncs what lies past the
        // mark, once, and a sync then has nothing to do.
        let w = Wal::open(&path, None).unwrap();
        assert_eq!(w.syncs(), 1);
        w.sync().unwrap();
        assert_eq!(w.syncs(), 1);
        assert_eq!(w.read(&id, 1).unwrap().len(), 2);
        w.close().unwrap();
        drop(w);
        // Reopened after a close: nothing lies past the mark, and the open makes no sync.
        let w = Wal::open(&path, None).unwrap();
        w.sync().unwrap();
        assert_eq!(w.syncs(), 0);
        assert_eq!(w.read(&id, 1).unwrap().len(), 2);
    }
}
