//! The event log's own file: `events.log` in the data directory, append-only.
//!
//! Every `append_batch` writes one frame, so a batch is on disk whole or not at all. Blobs
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
//! A blob is made durable by the `fdatasync` of the record that names it, which is
//! written after it: storing one costs neither a sync of its own nor a flush of the sled
//! database (whose first flush in a process also starts sled's pool of I/O threads). A
//! file with blob frames is not read by versions before them: they stop at the first one
//! as at a torn tail.
//!
//! An append checks the session's last seq, writes its frame at the end of the file and
//! indexes it under one lock, then waits for a group commit: one `fdatasync` covers every
//! append written before it started. The index (each session's record offsets) lives in
//! memory and is rebuilt by reading the file when the store opens.
//!
//! The file is kept 64–128 KiB longer than its frames, with zeros: an append writes into
//! that reserve, and writes the reserve anew past itself when it reaches the end, so most
//! syncs do not change the file's length (which would make `fdatasync` write the inode
//! too). Zeros are no frame: reading stops at them, as an older version also does.
//!
//! A crash can leave the end of the file torn: a frame cut short, or pages of unsynced
//! frames never written. Opening stops at the first frame that is cut short or whose crc
//! does not match. If nothing but zeros follows, that is the reserve, kept as it is;
//! otherwise opening keeps what follows in `events.log.torn-<offset>` and truncates the
//! log there, so that no frame written before the crash can turn up behind a later one.
//! No acknowledged record is lost by that: an append is acknowledged only after an
//! `fdatasync` that covered it and everything before it.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use skein_core::{Record, SessionId};
use skein_runtime::{Error, Result};

const MAGIC: &[u8; 4] = b"SKW1";
const BLOB_MAGIC: &[u8; 4] = b"SKB1";
const HEADER: usize = 12;
/// A frame larger than this is not one skein wrote: the tail is torn or the file is not a log.
const MAX_BODY: usize = 1 << 30;
/// Zero bytes kept written past the last frame, at least this many and fewer than twice
/// as many: an `fdatasync` of a file whose length is unchanged writes only its data pages,
/// where one that grew the file writes its inode too.
const RESERVE: u64 = 64 << 10;

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::unavailable(format!("event log: {what} {}", path.display()), e)
}

/// A read takes the bytes between two records along when there are at most this many...
const COALESCE_GAP: u64 = 16 << 10;
/// ...and the whole read stays within this many.
const COALESCE_SPAN: u64 = 4 << 20;

fn end_of(a: At) -> u64 {
    a.offset + u64::from(a.len)
}

/// Where one record's bytes are in the file.
#[derive(Clone, Copy)]
struct At {
    offset: u64,
    len: u32,
}

struct Index {
    /// Where the next frame goes.
    end: u64,
    /// The file's length: zeros from `end` on.
    reserved: u64,
    /// Each session's records in seq order (entry `i` is seq `i + 1`).
    sessions: BTreeMap<String, Vec<At>>,
    /// Each blob's bytes, by its blake3 hash.
    blobs: HashMap<[u8; 32], At>,
}

pub(crate) struct Wal {
    path: PathBuf,
    file: File,
    index: Mutex<Index>,
    /// How much of the file an `fdatasync` has covered in this process (0 until the
    /// first: what was in the file at open may not have reached the disk yet).
    synced: AtomicU64,
    /// `fdatasync` calls made.
    syncs: AtomicU64,
}

/// One frame read back by [`scan`].
enum Frame {
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

impl Wal {
    /// Opens (or creates) the log at `path`, rebuilding the index and cutting a torn tail.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_err("cannot open", path, e))?;
        let (frames, good_end) = scan(&file, path)?;
        let len = file
            .metadata()
            .map_err(|e| io_err("cannot stat", path, e))?
            .len();
        // Past the last whole frame: the zeros of the reserve, or a torn tail.
        let mut reserved = len;
        if good_end < len && !zeros_from(&file, path, good_end, len)? {
            keep_torn_tail(&file, path, good_end, len)?;
            reserved = good_end;
        }
        let mut sessions: BTreeMap<String, Vec<At>> = BTreeMap::new();
        let mut blobs = HashMap::new();
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
            let recs = sessions.entry(session.clone()).or_default();
            if recs.len() as u64 + 1 != first_seq {
                return Err(Error::corrupt_because(format!(
                    "event log {}: a frame of {} starts at seq {} after seq {}",
                    path.display(),
                    session,
                    first_seq,
                    recs.len()
                )));
            }
            recs.extend(records);
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            index: Mutex::new(Index {
                end: good_end,
                reserved,
                sessions,
                blobs,
            }),
            synced: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
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
        let last = ix.sessions.get(sid).map_or(0, |v| v.len() as u64);
        if last != expected_last {
            return Ok(Err(last));
        }
        let start = self.write_frame(&mut ix, &frame)?;
        let recs = ix.sessions.entry(sid.to_string()).or_default();
        recs.extend(at.into_iter().map(|(off, len)| At {
            offset: start + off as u64,
            len,
        }));
        Ok(Ok(()))
    }

    /// Writes `frame` at the end of the log; returns where it starts. When the frame
    /// reaches past the reserve, the reserve is written anew behind it, so that the sync
    /// following this write grows the file, and the syncs of the next [`RESERVE`] bytes
    /// of frames do not.
    fn write_frame(&self, ix: &mut Index, frame: &[u8]) -> Result<u64> {
        let start = ix.end;
        let end = start + frame.len() as u64;
        self.file
            .write_all_at(frame, start)
            .map_err(|e| io_err("cannot write", &self.path, e))?;
        if end > ix.reserved {
            let to = (end + RESERVE).next_multiple_of(RESERVE);
            let zeros = vec![0u8; (to - end) as usize];
            self.file
                .write_all_at(&zeros, end)
                .map_err(|e| io_err("cannot write", &self.path, e))?;
            ix.reserved = to;
        }
        ix.end = end;
        Ok(start)
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
        self.file
            .read_exact_at(&mut buf, a.offset)
            .map_err(|e| io_err("cannot read", &self.path, e))?;
        Ok(Some(buf))
    }

    /// Makes every write so far durable.
    ///
    /// A sync with nothing written since the last one returns at once: the end of a run
    /// asked for one after its last group commit, and again when the store closed.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        // Every write below `end` has completed: a frame is written before `end` moves.
        let end = self.lock().end;
        if end == 0 || end <= self.synced.load(Ordering::Acquire) {
            return Ok(());
        }
        self.file.sync_data()?;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.synced.fetch_max(end, Ordering::AcqRel);
        Ok(())
    }

    /// Whether a sync of this process covers `session`'s last record (so for a session
    /// without records).
    pub(crate) fn last_synced(&self, session: &SessionId) -> bool {
        let synced = self.synced.load(Ordering::Acquire);
        self.lock()
            .sessions
            .get(session.as_str())
            .and_then(|v| v.last())
            .is_none_or(|at| at.offset + u64::from(at.len) <= synced)
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
            let ix = self.lock();
            match ix.sessions.get(session.as_str()) {
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
                self.file
                    .read_exact_at(&mut buf, start)
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
        let at = self
            .lock()
            .sessions
            .get(session.as_str())
            .and_then(|v| v.last().copied());
        at.map(|a| self.record(session, a)).transpose()
    }

    fn record(&self, session: &SessionId, a: At) -> Result<Record> {
        let mut buf = vec![0u8; a.len as usize];
        self.file
            .read_exact_at(&mut buf, a.offset)
            .map_err(|e| io_err("cannot read", &self.path, e))?;
        Record::decode(buf).map_err(|e| Error::corrupt(format!("record of {session}"), e))
    }

    /// Every session whose id starts with `prefix`, in id order.
    pub(crate) fn sessions_from(&self, prefix: &str) -> Vec<String> {
        self.lock()
            .sessions
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// Reads frames from the start; returns them and where the last whole one ends.
fn scan(file: &File, path: &Path) -> Result<(Vec<Frame>, u64)> {
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut frames = vec![];
    let mut pos = 0u64;
    loop {
        let mut head = [0u8; HEADER];
        match read_full(&mut r, &mut head) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => return Err(io_err("cannot read", path, e)),
        }
        let blob = &head[..4] == BLOB_MAGIC;
        if !blob && &head[..4] != MAGIC {
            break;
        }
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let crc = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if len > MAX_BODY {
            break;
        }
        let mut body = vec![0u8; len];
        match read_full(&mut r, &mut body) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => return Err(io_err("cannot read", path, e)),
        }
        if crc32fast::hash(&body) != crc {
            break;
        }
        let parsed = if blob {
            parse_blob(&body, pos + HEADER as u64)
        } else {
            parse_body(&body, pos + HEADER as u64)
        };
        let Some(f) = parsed else {
            break;
        };
        frames.push(f);
        pos += (HEADER + len) as u64;
    }
    Ok((frames, pos))
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
fn zeros_from(file: &File, path: &Path, from: u64, to: u64) -> Result<bool> {
    let mut buf = vec![0u8; (to - from).min(1 << 20) as usize];
    let mut at = from;
    while at < to {
        let n = buf.len().min((to - at) as usize);
        file.read_exact_at(&mut buf[..n], at)
            .map_err(|e| io_err("cannot read", path, e))?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// Copies the bytes past the last whole frame aside and cuts the log there.
fn keep_torn_tail(file: &File, path: &Path, good_end: u64, len: u64) -> Result<()> {
    let mut tail = vec![0u8; (len - good_end) as usize];
    file.read_exact_at(&mut tail, good_end)
        .map_err(|e| io_err("cannot read", path, e))?;
    let aside = PathBuf::from(format!("{}.torn-{good_end}", path.display()));
    std::fs::write(&aside, &tail).map_err(|e| io_err("cannot write", &aside, e))?;
    file.set_len(good_end)
        .and_then(|()| file.sync_all())
        .map_err(|e| io_err("cannot truncate", path, e))?;
    tracing::warn!(
        log = %path.display(),
        kept = good_end,
        cut = len - good_end,
        aside = %aside.display(),
        "the event log ended in a torn write; the bytes after the last whole frame are kept aside"
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
            }),
        );
        let bytes = env.encode().unwrap();
        Record { env, bytes }
    }

    #[test]
    fn a_sync_with_nothing_new_written_makes_no_fdatasync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.log");
        let id = SessionId::root("walsync").unwrap();
        let w = Wal::open(&path).unwrap();
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
        // Reopened: what the file holds is synced once more before it counts as durable.
        let w = Wal::open(&path).unwrap();
        w.sync().unwrap();
        w.sync().unwrap();
        assert_eq!(w.syncs(), 1);
        assert_eq!(w.read(&id, 1).unwrap().len(), 2);
    }
}
