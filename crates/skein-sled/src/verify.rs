//! `skein store verify` and `skein store repair`: what is wrong with a data directory's
//! `events.log`, and setting the damaged part aside when asked.
//!
//! [`verify`] reads the file and changes nothing. It reports the file's format, its frames
//! and how far syncs had made it durable (the mark), and the first place where reading
//! stops: nothing (the file is whole), a torn tail past the mark (which opening cuts, as
//! after a crash), or damage (which opening refuses). For the last two it lists what the
//! bytes from there on still hold: the frames found whole past the damage, by tree and
//! session, with their seqs. [`repair`] takes the data directory's lock, copies those
//! bytes into `events.log.damaged-<offset>` (synced, with its directory entry), and only
//! then cuts the log there and lowers the mark, so the store opens again; what it cut is
//! what the report listed.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use serde::Serialize;
use skein_ports::{Error, Result};

use crate::file::{read_exact_at, LogFile};
use crate::wal::{self, Frame, Verdict};

/// What [`verify`] found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub log: PathBuf,
    /// 1: written before the header and the mark; 2: with them.
    pub format: u64,
    /// The file's length.
    pub len: u64,
    /// Where the last whole frame ends.
    pub frames_end: u64,
    /// How far syncs had made the log durable, by its mark (where frames begin, without
    /// one).
    pub mark: u64,
    /// Whole frames read before the first problem (records and blobs).
    pub frames: usize,
    pub sessions: usize,
    pub records: u64,
    pub blobs: usize,
    pub finding: Finding,
    /// What the bytes from the problem on hold, when there is one: each session's frames
    /// found there, whole or (the first one) damaged.
    pub beyond: Vec<Lost>,
    /// Blobs found whole past the problem.
    pub beyond_blobs: usize,
}

/// The first problem of the file, if any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// Every byte is a whole frame or the zeros of the reserve.
    Whole,
    /// A torn tail past the mark, as a crash leaves: opening cuts it and keeps it aside.
    Torn { offset: u64, what: String },
    /// Damage a crash cannot explain: opening refuses until it is repaired.
    Damaged { offset: u64, what: String },
    /// The file ends before the mark: synced frames are missing.
    Short { len: u64, mark: u64 },
}

impl Finding {
    /// Whether opening the store refuses with this.
    pub fn refuses(&self) -> bool {
        matches!(self, Finding::Damaged { .. } | Finding::Short { .. })
    }

    /// Where the log would be cut.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Finding::Whole => None,
            Finding::Torn { offset, .. } | Finding::Damaged { offset, .. } => Some(*offset),
            Finding::Short { len, .. } => Some(*len),
        }
    }
}

/// Records of one session found from the problem on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Lost {
    /// The root of the session's tree.
    pub tree: String,
    pub session: String,
    pub first_seq: u64,
    pub last_seq: u64,
    pub records: u64,
    /// Whether these include the damaged frame itself (read despite its checksum).
    pub damaged: bool,
}

/// What [`repair`] did.
#[derive(Debug, Clone, Serialize)]
pub struct Repaired {
    /// What was found before anything changed.
    pub report: Report,
    /// Where the bytes cut from the log were kept.
    pub aside: Option<PathBuf>,
    /// Whether the header frame, or both slots of the mark, were damaged and written
    /// anew (nothing else was lost by that).
    pub header_rewritten: bool,
}

/// Reads `dir`'s `events.log` and reports on it; changes nothing.
pub fn verify(dir: &Path) -> Result<Report> {
    let log = dir.join("events.log");
    let file = File::open(&log)
        .map_err(|e| Error::unavailable(format!("event log: cannot open {}", log.display()), e))?;
    report(&file, &log)
}

fn report(file: &dyn LogFile, log: &Path) -> Result<Report> {
    let ex = wal::examine(file, log)?;
    let verdict = if ex.format == 0 {
        Verdict::Whole
    } else {
        ex.verdict(file, log)?
    };
    let finding = match &verdict {
        Verdict::Whole => Finding::Whole,
        Verdict::Torn { offset, why } => Finding::Torn {
            offset: *offset,
            what: why.to_string(),
        },
        Verdict::Damaged { offset: 0, why, .. } if wal::header_only_damaged(file, log)? => {
            Finding::Damaged {
                offset: 0,
                what: format!(
                    "the header frame is damaged ({why}); the mark behind it is whole, and \
                     `skein store repair` writes the header anew"
                ),
            }
        }
        Verdict::Damaged { offset, why, mark } => Finding::Damaged {
            offset: *offset,
            what: if offset < mark {
                format!("{why}, before the mark at {mark}")
            } else {
                why.to_string()
            },
        },
        Verdict::Short { len, mark } => Finding::Short {
            len: *len,
            mark: *mark,
        },
    };
    let mut sessions = std::collections::BTreeSet::new();
    let (mut records, mut blobs) = (0u64, 0usize);
    for f in &ex.frames {
        match f {
            Frame::Records {
                session,
                records: r,
                ..
            } => {
                sessions.insert(session.clone());
                records += r.len() as u64;
            }
            Frame::Blob { .. } => blobs += 1,
        }
    }
    let (beyond, beyond_blobs) = match finding.offset() {
        Some(at) if at < ex.len => beyond(file, log, at, ex.len)?,
        _ => (vec![], 0),
    };
    Ok(Report {
        log: log.to_path_buf(),
        format: if ex.format == 0 {
            wal::FORMAT
        } else {
            ex.format
        },
        len: ex.len,
        frames_end: ex.good_end,
        mark: ex.mark,
        frames: ex.frames.len(),
        sessions: sessions.len(),
        records,
        blobs,
        finding,
        beyond,
        beyond_blobs,
    })
}

/// The frames found in the bytes from `from` to `len`: the first one read despite its
/// checksum when it parses, then every whole frame found further on (looked for a window
/// at a time, so a large log is not read into memory whole).
fn beyond(file: &dyn LogFile, log: &Path, from: u64, len: u64) -> Result<(Vec<Lost>, usize)> {
    let mut by_session: BTreeMap<String, Lost> = BTreeMap::new();
    let mut blobs = 0usize;
    let mut add = |session: String, first: u64, count: u64, damaged: bool| {
        if count == 0 || session.starts_with('!') {
            return;
        }
        let tree = session.split('.').next().unwrap_or(&session).to_string();
        let last = first + count - 1;
        let e = by_session.entry(session.clone()).or_insert(Lost {
            tree,
            session,
            first_seq: first,
            last_seq: last,
            records: 0,
            damaged: false,
        });
        e.first_seq = e.first_seq.min(first);
        e.last_seq = e.last_seq.max(last);
        e.records += count;
        e.damaged |= damaged;
    };
    let mut pos = from;
    let mut first = true;
    while pos + wal::HEADER_LEN as u64 <= len {
        match frame_in_file(file, log, pos, len, !first)? {
            Some((n, peek, whole)) => {
                match peek {
                    Some(wal::Peek::Records {
                        session,
                        first_seq,
                        count,
                    }) => add(session, first_seq, count, !whole),
                    Some(wal::Peek::Blob) => blobs += 1,
                    None => {}
                }
                pos += n as u64;
            }
            None => pos = next_magic(file, log, pos + 1, len)?,
        }
        first = false;
    }
    Ok((by_session.into_values().collect(), blobs))
}

fn read_err(log: &Path, e: std::io::Error) -> Error {
    Error::unavailable(format!("event log: cannot read {}", log.display()), e)
}

/// The frame at `pos`, if one is there (with `whole`, one that matches its checksum): its
/// length, what it holds, and whether it matches its checksum.
fn frame_in_file(
    file: &dyn LogFile,
    log: &Path,
    pos: u64,
    len: u64,
    whole: bool,
) -> Result<Option<(usize, Option<wal::Peek>, bool)>> {
    let mut head = [0u8; wal::HEADER_LEN];
    read_exact_at(file, &mut head, pos).map_err(|e| read_err(log, e))?;
    if !wal::is_frame_magic(&head[..4]) {
        return Ok(None);
    }
    let body = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as u64;
    if pos + wal::HEADER_LEN as u64 + body > len || body > wal::MAX_BODY_LEN {
        return Ok(None);
    }
    let mut frame = vec![0u8; wal::HEADER_LEN + body as usize];
    read_exact_at(file, &mut frame, pos).map_err(|e| read_err(log, e))?;
    Ok(wal::frame_at(&frame, whole).map(|(n, peek)| (n, peek, wal::crc_ok(&frame))))
}

/// Where the next frame magic lies at or after `from` (`len` when none does).
fn next_magic(file: &dyn LogFile, log: &Path, from: u64, len: u64) -> Result<u64> {
    const WINDOW: u64 = 1 << 20;
    let mut at = from;
    let mut buf = vec![0u8; WINDOW as usize];
    while at + 4 <= len {
        let n = WINDOW.min(len - at) as usize;
        read_exact_at(file, &mut buf[..n], at).map_err(|e| read_err(log, e))?;
        if let Some(k) = buf[..n].windows(4).position(wal::is_frame_magic) {
            return Ok(at + k as u64);
        }
        // The last three bytes may begin a magic that the next window ends.
        at += (n as u64).saturating_sub(3).max(1);
    }
    Ok(len)
}

/// Sets the damaged or torn part of `dir`'s `events.log` aside and cuts the log there, so
/// that the store opens again. Takes the data directory's lock: no skein process may have
/// it open. Changes nothing when the log is whole.
pub fn repair(dir: &Path) -> Result<Repaired> {
    let _lock = crate::lock_dir(dir)?;
    let log = dir.join("events.log");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&log)
        .map_err(|e| Error::unavailable(format!("event log: cannot open {}", log.display()), e))?;
    let mut report = report(&file, &log)?;
    let mut header_rewritten = false;
    if report.finding.offset() == Some(0) && wal::header_only_damaged(&file, &log)? {
        wal::rewrite_header(&file, &log)?;
        tracing::warn!(log = %log.display(), "the event log's header was damaged; it is written anew");
        header_rewritten = true;
        report = self::report(&file, &log)?;
    }
    if report.finding.refuses() && wal::rewrite_damaged_marks(&file, &log)? {
        tracing::warn!(log = %log.display(),
            "both slots of the event log's synced mark were damaged; they are written anew");
        header_rewritten = true;
        report = self::report(&file, &log)?;
    }
    let Some(at) = report.finding.offset() else {
        return Ok(Repaired {
            report,
            aside: None,
            header_rewritten,
        });
    };
    let aside = if at < report.len {
        let aside = PathBuf::from(format!("{}.damaged-{at}", log.display()));
        wal::copy_aside(&file, &log, at, report.len, &aside)?;
        Some(aside)
    } else {
        None
    };
    wal::cut(&file, &log, at)?;
    tracing::warn!(
        log = %log.display(),
        cut_at = at,
        aside = ?aside,
        "the event log was cut where it is damaged; the bytes from there on are kept aside"
    );
    Ok(Repaired {
        report,
        aside,
        header_rewritten,
    })
}
