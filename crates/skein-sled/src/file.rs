//! The few operations the event log makes on its file, behind a trait: the store runs on a
//! plain [`std::fs::File`], and tests put a file in between that fails a write or a sync,
//! writes short, or reports a full disk, to check what the log promises when the disk
//! misbehaves.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Positioned reads and writes, `fdatasync`, length: what [`crate::SledStore`] needs of
/// `events.log`.
pub trait LogFile: Send + Sync {
    /// Reads at `offset`; may read fewer bytes than asked, 0 at the end of the file.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes at `offset`; may write fewer bytes than given.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// `fdatasync`: every write so far is on the disk when it returns `Ok`.
    fn sync_data(&self) -> io::Result<()>;
    /// The file's length.
    fn len(&self) -> io::Result<u64>;
    /// Whether the file is empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Cuts (or extends with zeros) the file to `len`.
    fn set_len(&self, len: u64) -> io::Result<()>;
}

impl LogFile for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        FileExt::write_at(self, buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }
}

/// Writes all of `buf` at `offset`, going on after a short write.
pub(crate) fn write_all_at(f: &dyn LogFile, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match f.write_at(buf, offset) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf` from `offset`; an error of kind `UnexpectedEof` when the file ends first.
pub(crate) fn read_exact_at(
    f: &dyn LogFile,
    mut buf: &mut [u8],
    mut offset: u64,
) -> io::Result<()> {
    while !buf.is_empty() {
        match f.read_at(buf, offset) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A [`std::io::Read`] over a [`LogFile`] from an offset on.
pub(crate) struct Reader<'a> {
    pub(crate) file: &'a dyn LogFile,
    pub(crate) pos: u64,
}

impl io::Read for Reader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// Makes the directory entries in `dir` durable (a file created or renamed there).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Whether `e` says the disk (or the user's quota) is full.
pub(crate) fn is_disk_full(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    ) || matches!(e.raw_os_error(), Some(28 /* ENOSPC */ | 122 /* EDQUOT */))
}
