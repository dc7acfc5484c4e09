//! Workspaces: the files a tree's agents read and write.
//!
//! A [`LocalWorkspace`] resolves every path inside a capability handle on its root
//! directory (`cap-std`): each component is opened relative to the directory before it,
//! `..` cannot climb above the root, and a symlink is followed only while it stays inside.
//! The check and the open are one system call sequence on the already-open root, so a
//! directory swapped for a symlink between a look and an open is still caught.

use std::collections::VecDeque;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt, OpenOptions, OpenOptionsExt};

pub use skein_ports::workspace::{
    check_path_chars, join, normalize, DirEntry, FilePart, Usage, Walk, Workspace,
};

use crate::ToolError;

/// A local directory.
pub struct LocalWorkspace {
    root: PathBuf,
    inline: bool,
    quick: bool,
}

/// The most a read may ask for and still run on the calling task ([`LocalWorkspace::quick`]).
pub const QUICK_READ_BYTES: usize = 256 * 1024;

/// The largest directory (as its filesystem reports its size) that is listed on the calling
/// task ([`LocalWorkspace::quick`]); a larger one is listed on the blocking pool.
pub const QUICK_DIR_BYTES: u64 = 64 * 1024;

/// Filesystems whose data lies on this machine's own disks or in its memory, by the magic
/// number `statfs` reports: ext2/3/4, xfs, btrfs, tmpfs, ramfs, overlayfs, zfs, f2fs and
/// bcachefs. A network or FUSE filesystem is none of them: a call there can wait on
/// another machine for as long as that takes.
const LOCAL_FILESYSTEMS: [u64; 9] = [
    0xEF53,      // ext2, ext3, ext4
    0x5846_5342, // xfs
    0x9123_683E, // btrfs
    0x0102_1994, // tmpfs
    0x8584_58F6, // ramfs
    0x794C_7630, // overlayfs
    0x2FC1_2FC1, // zfs
    0xF2F5_2010, // f2fs
    0xCA45_1A4E, // bcachefs
];

/// Whether `path` (or, while it does not exist yet, its nearest existing ancestor) lies on
/// a filesystem of this machine's own disks or memory ([`LOCAL_FILESYSTEMS`]).
pub fn on_local_disk(path: &Path) -> bool {
    let mut at = Some(path);
    while let Some(p) = at {
        match rustix::fs::statfs(p) {
            // The magic numbers are 32 bits; the field is signed on some targets.
            #[allow(clippy::unnecessary_cast)]
            Ok(s) => return LOCAL_FILESYSTEMS.contains(&((s.f_type as u64) & 0xFFFF_FFFF)),
            Err(_) => at = p.parent().filter(|q| !q.as_os_str().is_empty()),
        }
    }
    false
}

impl LocalWorkspace {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            inline: false,
            quick: false,
        }
    }

    /// File operations run on the calling task instead of tokio's blocking pool. A
    /// simulation on one thread wants this: a blocking thread finishes in real time, so
    /// the order of events would depend on the machine, not on the seed.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }

    /// With `yes`, small operations run on the calling task: the listing of a directory
    /// of at most [`QUICK_DIR_BYTES`], a read of at most [`QUICK_READ_BYTES`]. For a
    /// workspace on a local disk ([`on_local_disk`]): there such a call takes microseconds,
    /// less than handing it to the blocking pool and back (two thread wake-ups and the
    /// pool's lock; most of the context switches of a run of many `list_dir` calls).
    /// Writes, walks and whole-file reads always go to the pool.
    pub fn quick(mut self, yes: bool) -> Self {
        self.quick = yes;
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Runs `op` with the root opened as a capability and `path` normalized, on a blocking
    /// thread, or on the calling task when the workspace is [`LocalWorkspace::inline`], or
    /// [`LocalWorkspace::quick`] and `small` says the operation is (given the open root and
    /// the path). Maps I/O errors to tool errors that name `path`.
    async fn with_root<T, F, S>(&self, path: &str, small: S, op: F) -> Result<T, ToolError>
    where
        T: Send + 'static,
        F: FnOnce(&Dir, &str) -> io::Result<T> + Send + 'static,
        S: FnOnce(&Dir, &str) -> bool,
    {
        let rel = normalize(path)?;
        let looked = rel.clone();
        self.dispatch(
            path,
            open_root,
            move |dir: &Dir| small(dir, &looked),
            move |dir: Dir| op(&dir, &rel),
        )
        .await
    }

    /// Runs `op` on what `open` makes of the root, where [`LocalWorkspace::with_root`]
    /// says (`small` given what was opened). Maps I/O errors to tool errors that name
    /// `path`.
    async fn dispatch<H, T, O, S, F>(
        &self,
        path: &str,
        open: O,
        small: S,
        op: F,
    ) -> Result<T, ToolError>
    where
        H: Send + 'static,
        T: Send + 'static,
        O: FnOnce(&Path) -> Result<H, ToolError> + Send + 'static,
        S: FnOnce(&H) -> bool,
        F: FnOnce(H) -> io::Result<T> + Send + 'static,
    {
        let shown = path.to_string();
        let pool_failed = |e: tokio::task::JoinError| ToolError::Failed(format!("`{path}`: {e}"));
        if self.inline || self.quick {
            let opened = open(&self.root)?;
            if self.inline || small(&opened) {
                return op(opened).map_err(|e| io_error(&shown, e));
            }
            // Too big to run here: what was opened goes to the pool.
            return tokio::task::spawn_blocking(move || {
                op(opened).map_err(|e| io_error(&shown, e))
            })
            .await
            .map_err(pool_failed)?;
        }
        let root = self.root.clone();
        tokio::task::spawn_blocking(move || {
            let opened = open(&root)?;
            op(opened).map_err(|e| io_error(&shown, e))
        })
        .await
        .map_err(pool_failed)?
    }
}

/// The error for a workspace root that cannot be opened or made.
fn unavailable(e: io::Error) -> ToolError {
    ToolError::Failed(format!("the workspace directory is not available: {e}"))
}

/// Opens a workspace's root directory as a capability, making it on first use: opened
/// first, since after that it is there (creating it each time was a failed `mkdir` per
/// tool call).
fn open_root(root: &Path) -> Result<Dir, ToolError> {
    made_on_first_use(root, || Dir::open_ambient_dir(root, ambient_authority()))
}

/// What `open` opens of the root `root`, the root made first if `open` finds it missing.
fn made_on_first_use<H>(root: &Path, open: impl Fn() -> io::Result<H>) -> Result<H, ToolError> {
    match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(root).map_err(unavailable)?;
            open()
        }
        opened => opened,
    }
    .map_err(unavailable)
}

/// A listing's row for `name`, from what it is (or points to, for a symlink): a directory,
/// or a file with its size; `None` where that cannot be had.
fn entry(name: String, md: Option<&cap_std::fs::Metadata>) -> DirEntry {
    DirEntry {
        name,
        is_dir: md.is_some_and(|m| m.is_dir()),
        size: md.filter(|m| m.is_file()).map_or(0, |m| m.len()),
    }
}

/// The entries of the workspace's root, sorted, as [`Workspace::list`] gives them, read
/// from `fd`, the root opened for reading.
///
/// The root is opened once (the capability's handle and a listing through
/// [`Dir::entries`] opened it three times); no path is resolved, so there is nothing for a
/// capability to confine. A directory is told by its entry's type; a file's size is a stat
/// of its name relative to the root that follows no link; a symlink, or an entry whose
/// type the filesystem does not give, goes through a capability on the root (made then)
/// and shows what it points to when that is inside ([`followed`]).
fn root_entries(fd: OwnedFd) -> io::Result<Vec<DirEntry>> {
    use rustix::fs::{AtFlags, FileType};
    let mut listing = rustix::fs::Dir::new(fd)?;
    let mut capability: Option<Dir> = None;
    let mut out = vec![];
    while let Some(e) = listing.read() {
        let e = e?;
        let raw = e.file_name().to_bytes();
        if raw == b"." || raw == b".." {
            continue;
        }
        let name = String::from_utf8_lossy(raw).into_owned();
        out.push(match e.file_type() {
            FileType::Directory => DirEntry {
                name,
                is_dir: true,
                size: 0,
            },
            FileType::RegularFile => {
                let st =
                    rustix::fs::statat(listing.fd()?, e.file_name(), AtFlags::SYMLINK_NOFOLLOW);
                DirEntry {
                    name,
                    is_dir: false,
                    size: st.map_or(0, |st| u64::try_from(st.st_size).unwrap_or(0)),
                }
            }
            FileType::Symlink | FileType::Unknown => {
                if capability.is_none() {
                    let own = rustix::io::dup(listing.fd()?)?;
                    capability = Some(Dir::from_std_file(std::fs::File::from(own)));
                }
                let md = capability.as_ref().and_then(|dir| followed(dir, &name));
                entry(name, md.as_ref())
            }
            _ => entry(name, None),
        });
    }
    out.sort();
    Ok(out)
}

/// Opens a workspace's root directory for reading its entries, making it on first use
/// (as [`open_root`]).
fn open_root_for_reading(root: &Path) -> Result<OwnedFd, ToolError> {
    use rustix::fs::{Mode, OFlags};
    made_on_first_use(root, || {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        Ok(rustix::fs::open(root, flags, Mode::empty())?)
    })
}

/// An operation that never runs on the calling task of a quick workspace.
fn never(_: &Dir, _: &str) -> bool {
    false
}

/// A regular file with more than one name: another name may lie outside the workspace
/// (a hard link made there, or brought in by a checkout or an archive), so reading or
/// writing it would reach a file the tree must not touch.
#[derive(Debug)]
struct HardLinked(u64);

impl std::fmt::Display for HardLinked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "has {} hard links", self.0)
    }
}

impl std::error::Error for HardLinked {}

/// Refuses a regular file with more than one hard link (see [`HardLinked`]).
fn single_link(md: &cap_std::fs::Metadata) -> io::Result<()> {
    match md.nlink() {
        n if n > 1 && md.is_file() => Err(io::Error::other(HardLinked(n))),
        _ => Ok(()),
    }
}

/// The tool error for an I/O error on `path`.
fn io_error(path: &str, e: io::Error) -> ToolError {
    if let Some(HardLinked(n)) = e.get_ref().and_then(|x| x.downcast_ref::<HardLinked>()) {
        return ToolError::Refused(format!(
            "`{path}` has {n} hard links; a file with more than one name may also be a \
             file outside the workspace, so it is neither read nor written"
        ));
    }
    match e.kind() {
        // cap-std reports an attempt to resolve outside the root as PermissionDenied
        // without an OS error code; a real EACCES carries one.
        io::ErrorKind::PermissionDenied if e.raw_os_error().is_none() => ToolError::Refused(
            format!("`{path}` leaves the workspace (through a symlink pointing outside it)"),
        ),
        io::ErrorKind::NotFound => {
            ToolError::Failed(format!("`{path}`: no such file or directory"))
        }
        _ => ToolError::Failed(format!("`{path}`: {e}")),
    }
}

fn not_a_file(is_dir: bool) -> io::Error {
    io::Error::other(if is_dir {
        "is a directory"
    } else {
        "is not a regular file"
    })
}

/// Opens a regular file for reading inside `dir`. Non-blocking, so a FIFO cannot hang
/// the call; anything but a regular file is refused after the open.
fn open_for_read(dir: &Dir, rel: &str) -> io::Result<cap_std::fs::File> {
    if rel.is_empty() {
        return Err(not_a_file(true));
    }
    let mut opts = OpenOptions::new();
    opts.read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32);
    let f = dir.open_with(rel, &opts)?;
    let md = f.metadata()?;
    if !md.is_file() {
        return Err(not_a_file(md.is_dir()));
    }
    single_link(&md)?;
    Ok(f)
}

fn read_range(dir: &Dir, rel: &str, offset: u64, max: u64) -> io::Result<FilePart> {
    let mut f = open_for_read(dir, rel)?;
    let size = f.metadata()?.len();
    f.seek(SeekFrom::Start(offset))?;
    let mut data = vec![];
    f.take(max).read_to_end(&mut data)?;
    Ok(FilePart { data, size })
}

/// Stat of `rel` following symlinks that stay inside; `None` when it cannot be had.
fn followed(dir: &Dir, rel: &str) -> Option<cap_std::fs::Metadata> {
    dir.metadata(rel).ok()
}

#[async_trait]
impl Workspace for LocalWorkspace {
    async fn read(&self, path: &str) -> Result<Vec<u8>, ToolError> {
        self.with_root(path, never, |dir, rel| {
            read_range(dir, rel, 0, u64::MAX).map(|p| p.data)
        })
        .await
    }

    async fn read_part(&self, path: &str, offset: u64, max: usize) -> Result<FilePart, ToolError> {
        let small = |_: &Dir, _: &str| max <= QUICK_READ_BYTES;
        let max = u64::try_from(max).unwrap_or(u64::MAX);
        self.with_root(path, small, move |dir, rel| {
            read_range(dir, rel, offset, max)
        })
        .await
    }

    async fn write(&self, path: &str, data: &[u8]) -> Result<(), ToolError> {
        if normalize(path)?.is_empty() {
            return Err(ToolError::Refused("a file needs a name".into()));
        }
        let data = data.to_vec();
        self.with_root(path, never, move |dir, rel| {
            if let Some((parent, _)) = rel.rsplit_once('/') {
                // Opening first tells "leaves the workspace" apart from "missing".
                match dir.open_dir(parent) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => dir.create_dir_all(parent)?,
                    Err(e) => return Err(e),
                }
            }
            // Not truncated on open: a file is looked at before anything of it changes.
            let mut opts = OpenOptions::new();
            opts.write(true)
                .create(true)
                .truncate(false)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32);
            let mut f = dir.open_with(rel, &opts)?;
            let md = f.metadata()?;
            if !md.is_file() {
                return Err(not_a_file(false));
            }
            single_link(&md)?;
            f.set_len(0)?;
            f.write_all(&data)?;
            f.flush()
        })
        .await
    }

    async fn list(&self, path: &str) -> Result<Vec<DirEntry>, ToolError> {
        // A directory that cannot be looked at fails on its listing, here as well.
        let small = |size: Option<u64>| size.is_none_or(|n| n <= QUICK_DIR_BYTES);
        if normalize(path)?.is_empty() {
            // The root: opened once, for reading; its size is a stat of that handle.
            let root_small = |fd: &OwnedFd| {
                let st = rustix::fs::fstat(fd).ok();
                small(st.map(|st| u64::try_from(st.st_size).unwrap_or(u64::MAX)))
            };
            return self
                .dispatch(path, open_root_for_reading, root_small, root_entries)
                .await;
        }
        let small = |dir: &Dir, rel: &str| small(dir.metadata(rel).ok().map(|m| m.len()));
        self.with_root(path, small, |dir, rel| {
            let entries = dir.read_dir(rel)?;
            let mut out = vec![];
            for e in entries {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                let ft = e.file_type()?;
                // A symlink is shown as what it points to when that is inside.
                let md = if ft.is_symlink() {
                    followed(dir, &join(rel, &name))
                } else {
                    e.metadata().ok()
                };
                out.push(entry(name, md.as_ref()));
            }
            out.sort();
            Ok(out)
        })
        .await
    }

    /// Like the default walk, but directories reached through symlinks are not entered
    /// (no loops), and symlinked files count only when they resolve inside.
    async fn walk(&self, path: &str, max_files: usize) -> Result<Walk, ToolError> {
        self.with_root(path, never, move |dir, rel| {
            let mut out = Walk::default();
            let mut dirs = VecDeque::from([rel.to_string()]);
            let mut first = true;
            let mut budget = max_files.saturating_mul(2).max(1);
            'dirs: while let Some(d) = dirs.pop_front() {
                let entries = match if d.is_empty() {
                    dir.entries()
                } else {
                    dir.read_dir(&d)
                } {
                    Ok(e) => e,
                    Err(e) if first => return Err(e),
                    Err(_) => continue,
                };
                first = false;
                let mut names = vec![];
                for e in entries.flatten() {
                    if let Ok(ft) = e.file_type() {
                        names.push((e.file_name().to_string_lossy().into_owned(), ft));
                    }
                }
                names.sort_by(|a, b| a.0.cmp(&b.0));
                for (name, ft) in names {
                    if out.files.len() >= max_files || budget == 0 {
                        out.truncated = true;
                        break 'dirs;
                    }
                    budget -= 1;
                    let full = join(&d, &name);
                    if ft.is_dir() {
                        dirs.push_back(full);
                    } else if let Some(md) = followed(dir, &full).filter(|m| m.is_file()) {
                        out.files.push(DirEntry {
                            name: full,
                            is_dir: false,
                            size: md.len(),
                        });
                    }
                }
            }
            out.files.sort();
            Ok(out)
        })
        .await
    }

    /// Sums the regular files under the root without following symlinks (a link to a
    /// file inside is not counted twice).
    async fn usage(&self, path: &str) -> Result<Usage, ToolError> {
        self.with_root(path, never, |dir, rel| {
            let mut total = 0u64;
            let mut dirs = vec![String::new()];
            while let Some(d) = dirs.pop() {
                let entries = match if d.is_empty() {
                    dir.entries()
                } else {
                    dir.read_dir(&d)
                } {
                    Ok(e) => e,
                    Err(e) if d.is_empty() => return Err(e),
                    Err(_) => continue,
                };
                for e in entries.flatten() {
                    let Ok(ft) = e.file_type() else { continue };
                    if ft.is_dir() {
                        dirs.push(join(&d, &e.file_name().to_string_lossy()));
                    } else if ft.is_file() {
                        total = total.saturating_add(e.metadata().map_or(0, |m| m.len()));
                    }
                }
            }
            let of_path = followed(dir, rel)
                .filter(|m| m.is_file())
                .map_or(0, |m| m.len());
            Ok(Usage { total, of_path })
        })
        .await
    }

    fn local_root(&self) -> Option<&Path> {
        Some(&self.root)
    }

    async fn modified(&self, path: &str) -> Result<Option<u64>, ToolError> {
        self.with_root(
            path,
            |_: &Dir, _: &str| true,
            |dir, rel| {
                let md = if rel.is_empty() {
                    dir.dir_metadata()?
                } else {
                    followed(dir, rel).ok_or_else(|| {
                        io::Error::new(io::ErrorKind::NotFound, "no such file or directory")
                    })?
                };
                Ok(md
                    .modified()
                    .ok()
                    .map(|t| t.into_std())
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_millis() as u64))
            },
        )
        .await
    }
}
