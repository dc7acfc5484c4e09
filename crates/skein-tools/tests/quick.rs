//! A workspace on a local disk runs its small operations on the calling task
//! (`LocalWorkspace::quick`): the same answers and the same refusals as on the blocking
//! pool, and what is too big for the calling task still goes to the pool.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::Arc;

use common::{builtin, ctx_for, err, ok, Sandbox};
use serde_json::json;
use skein_tools::workspace::{on_local_disk, QUICK_DIR_BYTES, QUICK_READ_BYTES};
use skein_tools::{LocalWorkspace, ToolError, Workspace};

/// The filesystem type of `path` as coreutils' `stat -f` names it.
fn fs_name(path: &Path) -> String {
    let out = std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(path)
        .output()
        .expect("stat from coreutils");
    assert!(out.status.success(), "stat -f {}", path.display());
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_local_disk_is_told_from_proc_and_sys() {
    let dir = tempfile::tempdir().unwrap();
    // The names coreutils gives the filesystems counted as local.
    let local = [
        "ext2/ext3",
        "xfs",
        "btrfs",
        "tmpfs",
        "ramfs",
        "overlayfs",
        "zfs",
        "f2fs",
        "bcachefs",
    ];
    let name = fs_name(dir.path());
    assert_eq!(
        on_local_disk(dir.path()),
        local.contains(&name.as_str()),
        "the temporary directory is on {name}"
    );
    // A path not made yet is judged by the directory it would be made in.
    assert_eq!(
        on_local_disk(&dir.path().join("not/made/yet")),
        on_local_disk(dir.path())
    );
    // Kernel filesystems are not disks: nothing of theirs runs on the calling task.
    assert_eq!(fs_name(Path::new("/proc")), "proc");
    assert!(!on_local_disk(Path::new("/proc")));
    assert!(!on_local_disk(Path::new("/proc/self/fd")));
    assert!(!on_local_disk(Path::new("/sys")));
}

fn quick(s: &Sandbox) -> Arc<LocalWorkspace> {
    Arc::new(LocalWorkspace::new(s.root()).quick(true))
}

#[tokio::test]
async fn symlinks_out_of_a_quick_workspace_are_refused() {
    let s = Sandbox::new();
    let ctx = ctx_for(quick(&s));
    let tb = builtin();
    symlink(s.outside().join("secret.txt"), s.root().join("link.txt")).unwrap();
    symlink(s.outside(), s.root().join("out")).unwrap();
    for args in [
        json!({"path": "link.txt"}),
        json!({"path": "out/secret.txt"}),
    ] {
        let e = err(&tb, &ctx, "read_file", args).await;
        assert!(
            matches!(&e, ToolError::Refused(m) if m.contains("leaves the workspace")),
            "{e:?}"
        );
    }
    let e = err(&tb, &ctx, "list_dir", json!({"path": "out"})).await;
    assert!(
        matches!(&e, ToolError::Refused(m) if m.contains("leaves the workspace")),
        "{e:?}"
    );
    let e = err(&tb, &ctx, "list_dir", json!({"path": "../outside"})).await;
    assert!(matches!(e, ToolError::Refused(_)), "{e:?}");
    // Inside, symlinks are followed as on the pool.
    std::fs::create_dir_all(s.root().join("real")).unwrap();
    std::fs::write(s.root().join("real/data.txt"), "inside").unwrap();
    symlink("real", s.root().join("alias")).unwrap();
    assert_eq!(
        ok(&tb, &ctx, "read_file", json!({"path": "alias/data.txt"})).await,
        "inside"
    );
}

#[tokio::test]
async fn a_quick_workspace_answers_as_the_pool_does_for_small_and_big() {
    let s = Sandbox::new();
    let pool = LocalWorkspace::new(s.root());
    let fast = quick(&s);
    // A small directory, and one over the size listed on the calling task.
    std::fs::create_dir_all(s.root().join("small")).unwrap();
    std::fs::write(s.root().join("small/a.txt"), "a").unwrap();
    let big = s.root().join("big");
    std::fs::create_dir_all(&big).unwrap();
    let mut n = 0;
    while std::fs::metadata(&big).unwrap().len() <= QUICK_DIR_BYTES {
        for _ in 0..500 {
            std::fs::write(big.join(format!("a-file-with-a-long-name-{n:06}")), "x").unwrap();
            n += 1;
        }
        assert!(
            n < 100_000,
            "the directory's size does not grow with entries"
        );
    }
    for dir in ["small", "big", ""] {
        let (a, b) = (pool.list(dir).await.unwrap(), fast.list(dir).await.unwrap());
        assert_eq!(a, b, "listing of `{dir}`");
    }
    assert_eq!(fast.list("big").await.unwrap().len(), n);
    // A workspace whose root itself is big: its size is read from the open root.
    let (pool_big, fast_big) = (
        LocalWorkspace::new(&big),
        LocalWorkspace::new(&big).quick(true),
    );
    assert_eq!(
        pool_big.list("").await.unwrap(),
        fast_big.list("").await.unwrap()
    );
    // A read within the quick size, and one over it.
    let data: Vec<u8> = (0..QUICK_READ_BYTES * 2).map(|i| (i % 251) as u8).collect();
    std::fs::write(s.root().join("data.bin"), &data).unwrap();
    for (offset, max) in [(0, 100), (7, QUICK_READ_BYTES), (3, QUICK_READ_BYTES + 1)] {
        let a = pool.read_part("data.bin", offset, max).await.unwrap();
        let b = fast.read_part("data.bin", offset, max).await.unwrap();
        assert_eq!(a, b);
        assert_eq!(b.data, data[offset as usize..offset as usize + max]);
    }
    // Missing paths fail the same way.
    let a = pool.list("nope").await.unwrap_err().to_string();
    let b = fast.list("nope").await.unwrap_err().to_string();
    assert_eq!(a, b);
    // The root is made on first use here too.
    let fresh = LocalWorkspace::new(s.dir.path().join("made/on/use")).quick(true);
    assert_eq!(fresh.list("").await.unwrap(), vec![]);
    assert!(s.dir.path().join("made/on/use").is_dir());
}
