//! The workspace file tools on a real directory: what works, and every way out refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::symlink;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{builtin, ctx_for, err, ok, MemoryWorkspace, Sandbox};
use serde_json::json;
use skein_tools::{FilesConfig, LocalWorkspace, ToolBox, ToolError, ToolsConfig, Workspace};

fn refused(e: &ToolError) -> &str {
    match e {
        ToolError::Refused(m) => m,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn write_read_and_list_round_trip() {
    let s = Sandbox::new();
    let tb = builtin();
    let out = ok(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "notes/a/b.txt", "content": "hello\n"}),
    )
    .await;
    assert_eq!(out, "wrote 6 bytes to notes/a/b.txt");
    assert_eq!(
        std::fs::read_to_string(s.root().join("notes/a/b.txt")).unwrap(),
        "hello\n"
    );
    assert_eq!(
        ok(&tb, &s.ctx, "read_file", json!({"path": "notes/a/b.txt"})).await,
        "hello\n"
    );
    assert_eq!(
        ok(&tb, &s.ctx, "list_dir", json!({"path": "notes"})).await,
        "a/"
    );
    assert_eq!(
        ok(&tb, &s.ctx, "list_dir", json!({"path": "notes/a"})).await,
        "b.txt (6 bytes)"
    );
    // The root, by "." or by leaving the path out.
    assert_eq!(
        ok(&tb, &s.ctx, "list_dir", json!({"path": "."})).await,
        "notes/"
    );
    assert_eq!(ok(&tb, &s.ctx, "list_dir", json!({})).await, "notes/");
}

#[tokio::test]
async fn parent_dir_is_refused_everywhere() {
    let s = Sandbox::new();
    let tb = builtin();
    for (tool, args) in [
        ("read_file", json!({"path": "../outside/secret.txt"})),
        ("read_file", json!({"path": "a/../../outside/secret.txt"})),
        (
            "write_file",
            json!({"path": "../outside/new.txt", "content": "x"}),
        ),
        ("list_dir", json!({"path": ".."})),
    ] {
        let e = err(&tb, &s.ctx, tool, args.clone()).await;
        assert!(
            refused(&e).contains("`..` is refused"),
            "{tool} {args}: {e}"
        );
    }
    assert!(!s.outside().join("new.txt").exists());
}

#[tokio::test]
async fn control_characters_in_paths_are_refused() {
    let s = Sandbox::new();
    let tb = builtin();
    for bad in [
        "nul\0.txt",
        "a/line\nbreak.txt",
        "tab\there",
        "esc\u{1b}[2J",
        "c1\u{9b}x",
    ] {
        for (tool, args) in [
            ("read_file", json!({"path": bad})),
            ("write_file", json!({"path": bad, "content": "x"})),
            ("list_dir", json!({"path": bad})),
        ] {
            let e = err(&tb, &s.ctx, tool, args).await;
            assert!(
                refused(&e).contains("control character"),
                "{tool} {bad:?}: {e}"
            );
        }
    }
    assert_eq!(std::fs::read_dir(s.root()).unwrap().count(), 0);
}

#[tokio::test]
async fn absolute_paths_are_refused() {
    let s = Sandbox::new();
    let tb = builtin();
    let secret = s.outside().join("secret.txt");
    let e = err(
        &tb,
        &s.ctx,
        "read_file",
        json!({"path": secret.to_str().unwrap()}),
    )
    .await;
    assert!(refused(&e).contains("absolute paths are refused"), "{e}");
    let e = err(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "/tmp/skein-abs.txt", "content": "x"}),
    )
    .await;
    assert!(refused(&e).contains("absolute"), "{e}");
    let e = err(&tb, &s.ctx, "list_dir", json!({"path": "/etc"})).await;
    assert!(refused(&e).contains("absolute"), "{e}");
}

#[tokio::test]
async fn a_symlinked_file_pointing_outside_is_refused() {
    let s = Sandbox::new();
    let tb = builtin();
    symlink(s.outside().join("secret.txt"), s.root().join("link.txt")).unwrap();
    let e = err(&tb, &s.ctx, "read_file", json!({"path": "link.txt"})).await;
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
    let e = err(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "link.txt", "content": "overwritten"}),
    )
    .await;
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
    assert_eq!(
        std::fs::read_to_string(s.outside().join("secret.txt")).unwrap(),
        "SECRET"
    );
    // A relative symlink climbing out is refused the same way.
    symlink("../outside/secret.txt", s.root().join("rel.txt")).unwrap();
    let e = err(&tb, &s.ctx, "read_file", json!({"path": "rel.txt"})).await;
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
}

#[tokio::test]
async fn a_symlinked_directory_pointing_outside_is_refused() {
    let s = Sandbox::new();
    let tb = builtin();
    symlink(s.outside(), s.root().join("out")).unwrap();
    let e = err(&tb, &s.ctx, "read_file", json!({"path": "out/secret.txt"})).await;
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
    let e = err(&tb, &s.ctx, "list_dir", json!({"path": "out"})).await;
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
    let e = err(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "out/planted.txt", "content": "x"}),
    )
    .await;
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
    let e = err(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "out/deeper/planted.txt", "content": "x"}),
    )
    .await;
    assert!(matches!(e, ToolError::Refused(_)), "{e:?}");
    assert!(!s.outside().join("planted.txt").exists());
    assert!(!s.outside().join("deeper").exists());
}

#[tokio::test]
async fn symlinks_that_stay_inside_are_followed() {
    let s = Sandbox::new();
    let tb = builtin();
    std::fs::create_dir_all(s.root().join("real")).unwrap();
    std::fs::write(s.root().join("real/data.txt"), "inside").unwrap();
    symlink("real", s.root().join("alias")).unwrap();
    assert_eq!(
        ok(&tb, &s.ctx, "read_file", json!({"path": "alias/data.txt"})).await,
        "inside"
    );
    let listing = ok(&tb, &s.ctx, "list_dir", json!({"path": ""})).await;
    assert_eq!(listing, "alias/\nreal/");
}

/// The hardening against a check-then-open race: a directory that was fine a moment ago
/// is replaced by a symlink to outside; the next open resolves afresh and refuses it.
#[tokio::test]
async fn a_directory_swapped_for_a_symlink_is_refused_at_open_time() {
    let s = Sandbox::new();
    let ws = LocalWorkspace::new(s.root());
    ws.write("sub/secret.txt", b"inside").await.unwrap();
    assert_eq!(ws.read("sub/secret.txt").await.unwrap(), b"inside");
    // Swap: the directory goes, a symlink to outside (holding a file of the same name) comes.
    std::fs::remove_dir_all(s.root().join("sub")).unwrap();
    symlink(s.outside(), s.root().join("sub")).unwrap();
    let e = ws.read("sub/secret.txt").await.unwrap_err();
    assert!(refused(&e).contains("leaves the workspace"), "{e}");
    let e = ws.write("sub/secret.txt", b"clobbered").await.unwrap_err();
    assert!(matches!(e, ToolError::Refused(_)), "{e:?}");
    let e = ws.read_part("sub/secret.txt", 0, 10).await.unwrap_err();
    assert!(matches!(e, ToolError::Refused(_)), "{e:?}");
    assert_eq!(
        std::fs::read_to_string(s.outside().join("secret.txt")).unwrap(),
        "SECRET"
    );
}

/// The same swap done over and over while reads run: no read may ever return the
/// outside file, whatever the interleaving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_racing_a_symlink_swap_never_see_outside() {
    let s = Sandbox::new();
    let root = s.root();
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/secret.txt"), "inside").unwrap();
    let stash = s.dir.path().join("stash");
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (root, outside, stop) = (root.clone(), s.outside(), stop.clone());
        std::thread::spawn(move || {
            let mut swaps = 0u32;
            while !stop.load(Ordering::Relaxed) {
                std::fs::rename(root.join("sub"), &stash).unwrap();
                symlink(&outside, root.join("sub")).unwrap();
                std::thread::yield_now();
                std::fs::remove_file(root.join("sub")).unwrap();
                std::fs::rename(&stash, root.join("sub")).unwrap();
                swaps += 1;
                // Let the real directory be seen too.
                std::thread::yield_now();
            }
            swaps
        })
    };
    let ws = LocalWorkspace::new(root.clone());
    // At least MIN_READS reads, and on until the race has been met both ways: some reads
    // saw the real file, some the swapped state (the symlink leading out, refused, or no
    // `sub` at all), among them some that met the symlink itself.
    const MIN_READS: u32 = 1500;
    const MAX_READS: u32 = 200_000;
    const SEEN: u32 = 20;
    let (mut inside, mut refused, mut missing, mut reads) = (0u32, 0u32, 0u32, 0u32);
    let met = |inside: u32, refused: u32, missing: u32| {
        inside >= SEEN && refused + missing >= SEEN && refused > 0
    };
    while reads < MIN_READS || (reads < MAX_READS && !met(inside, refused, missing)) {
        reads += 1;
        match ws.read("sub/secret.txt").await {
            Ok(data) => {
                assert_eq!(data, b"inside", "a read escaped the workspace");
                inside += 1;
            }
            Err(ToolError::Refused(m)) => {
                assert!(m.contains("leaves the workspace"), "{m}");
                refused += 1;
            }
            Err(ToolError::Failed(m)) if m.contains("no such file") => missing += 1,
            Err(other) => panic!("a read failed another way: {other:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert!(swaps > 0, "the swapper never ran");
    assert!(
        met(inside, refused, missing),
        "the race was not exercised in {reads} reads: {inside} saw the real file, \
         {refused} met the symlink and were refused, {missing} found nothing (wanted \
         {SEEN} of the real file, {SEEN} of the swapped state, one refusal)"
    );
    assert_eq!(inside + refused + missing, reads);
    assert_eq!(
        std::fs::read_to_string(s.outside().join("secret.txt")).unwrap(),
        "SECRET"
    );
}

#[tokio::test]
async fn a_long_file_is_cut_with_a_note_and_read_on_by_offset() {
    let s = Sandbox::new();
    let cfg = ToolsConfig {
        files: FilesConfig {
            max_read_bytes: 10,
            ..FilesConfig::default()
        },
        ..ToolsConfig::default()
    };
    let tb = ToolBox::builtin(&cfg);
    std::fs::write(s.root().join("long.txt"), "0123456789abcdefghij-end").unwrap();
    let first = ok(&tb, &s.ctx, "read_file", json!({"path": "long.txt"})).await;
    assert!(first.starts_with("0123456789\n… [truncated"), "{first}");
    assert!(first.contains("bytes 0..10 of 24"), "{first}");
    assert!(first.contains("offset 10"), "{first}");
    let second = ok(
        &tb,
        &s.ctx,
        "read_file",
        json!({"path": "long.txt", "offset": 10}),
    )
    .await;
    assert!(second.starts_with("abcdefghij\n"), "{second}");
    let last = ok(
        &tb,
        &s.ctx,
        "read_file",
        json!({"path": "long.txt", "offset": 20}),
    )
    .await;
    assert_eq!(last, "-end");
    let e = err(
        &tb,
        &s.ctx,
        "read_file",
        json!({"path": "long.txt", "offset": 99}),
    )
    .await;
    assert!(e.to_string().contains("past the end"), "{e}");
}

#[tokio::test]
async fn a_cut_never_splits_a_character() {
    let s = Sandbox::new();
    let cfg = ToolsConfig {
        files: FilesConfig {
            max_read_bytes: 4,
            ..FilesConfig::default()
        },
        ..ToolsConfig::default()
    };
    let tb = ToolBox::builtin(&cfg);
    std::fs::write(s.root().join("u.txt"), "abcé and more").unwrap(); // é is bytes 3..5
    let out = ok(&tb, &s.ctx, "read_file", json!({"path": "u.txt"})).await;
    assert!(out.starts_with("abc\n"), "{out:?}");
    assert!(out.contains("offset 3"), "{out}");
}

#[tokio::test]
async fn writes_over_the_cap_are_refused() {
    let s = Sandbox::new();
    let cfg = ToolsConfig {
        files: FilesConfig {
            max_write_bytes: 5,
            ..FilesConfig::default()
        },
        ..ToolsConfig::default()
    };
    let tb = ToolBox::builtin(&cfg);
    let e = err(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "big.txt", "content": "123456"}),
    )
    .await;
    assert!(refused(&e).contains("at most 5"), "{e}");
    assert!(!s.root().join("big.txt").exists());
    ok(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "small.txt", "content": "12345"}),
    )
    .await;
}

#[tokio::test]
async fn reading_a_directory_or_a_missing_file_is_a_clear_error() {
    let s = Sandbox::new();
    let tb = builtin();
    std::fs::create_dir_all(s.root().join("d")).unwrap();
    let e = err(&tb, &s.ctx, "read_file", json!({"path": "d"})).await;
    assert!(e.to_string().contains("is a directory"), "{e}");
    let e = err(&tb, &s.ctx, "read_file", json!({"path": "nope.txt"})).await;
    assert!(e.to_string().contains("no such file"), "{e}");
}

#[tokio::test]
async fn long_listings_are_capped() {
    let s = Sandbox::new();
    for i in 0..5 {
        std::fs::write(s.root().join(format!("f{i}")), "x").unwrap();
    }
    let cfg = ToolsConfig {
        files: FilesConfig {
            max_list_entries: 3,
            ..FilesConfig::default()
        },
        ..ToolsConfig::default()
    };
    let out = ok(
        &ToolBox::builtin(&cfg),
        &s.ctx,
        "list_dir",
        json!({"path": ""}),
    )
    .await;
    assert_eq!(out.lines().count(), 4, "{out}");
    assert!(
        out.ends_with("… [2 more entries not shown; 5 in all]"),
        "{out}"
    );
}

#[tokio::test]
async fn the_file_tools_work_on_any_workspace_backend() {
    let mem = Arc::new(MemoryWorkspace::default());
    let ctx = ctx_for(mem.clone());
    let tb = builtin();
    ok(
        &tb,
        &ctx,
        "write_file",
        json!({"path": "a/b.txt", "content": "from memory"}),
    )
    .await;
    assert_eq!(
        ok(&tb, &ctx, "read_file", json!({"path": "a/b.txt"})).await,
        "from memory"
    );
    assert_eq!(
        ok(&tb, &ctx, "list_dir", json!({"path": "a"})).await,
        "b.txt (11 bytes)"
    );
    let e = err(&tb, &ctx, "read_file", json!({"path": "../x"})).await;
    assert!(matches!(e, ToolError::Refused(_)), "{e:?}");
    assert!(mem.local_root().is_none());
}

/// A hard link already in the workspace is a second name of a file outside it: reading
/// it would leak that file, writing it would change it.
#[tokio::test]
async fn a_hard_link_to_a_file_outside_is_neither_read_nor_written() {
    let s = Sandbox::new();
    let tb = builtin();
    let secret = s.outside().join("secret.txt");
    std::fs::create_dir_all(s.root().join("docs")).unwrap();
    std::fs::hard_link(&secret, s.root().join("notes.txt")).unwrap();
    std::fs::hard_link(&secret, s.root().join("docs/copy.txt")).unwrap();

    for path in ["notes.txt", "docs/copy.txt"] {
        let e = err(&tb, &s.ctx, "read_file", json!({ "path": path })).await;
        let m = refused(&e);
        assert!(
            m.contains(&format!("`{path}` has 3 hard links")) && !m.contains("SECRET"),
            "{m}"
        );
        let e = err(
            &tb,
            &s.ctx,
            "write_file",
            json!({"path": path, "content": "clobbered"}),
        )
        .await;
        assert!(refused(&e).contains("hard links"), "{e}");
    }
    let ws = LocalWorkspace::new(s.root());
    assert!(matches!(
        ws.read_part("notes.txt", 0, 3).await,
        Err(ToolError::Refused(_))
    ));
    assert!(matches!(
        ws.write("notes.txt", b"x").await,
        Err(ToolError::Refused(_))
    ));
    let found = ok(&tb, &s.ctx, "search_files", json!({"pattern": "SECRET"})).await;
    assert!(!found.contains("SECRET"), "{found}");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "SECRET");

    // Once the other names are gone, the file is the workspace's own again.
    std::fs::remove_file(&secret).unwrap();
    std::fs::remove_file(s.root().join("docs/copy.txt")).unwrap();
    ok(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "notes.txt", "content": "mine"}),
    )
    .await;
    assert_eq!(
        ok(&tb, &s.ctx, "read_file", json!({"path": "notes.txt"})).await,
        "mine"
    );
}

#[tokio::test]
async fn the_files_of_a_workspace_are_capped_together() {
    assert_eq!(
        FilesConfig::default().max_workspace_bytes,
        256 * 1024 * 1024
    );
    let tb = ToolBox::builtin(&ToolsConfig {
        files: FilesConfig {
            max_workspace_bytes: 100,
            ..FilesConfig::default()
        },
        ..ToolsConfig::default()
    });
    let s = Sandbox::new();
    let memory = ctx_for(Arc::new(MemoryWorkspace::default()));
    for ctx in [&s.ctx, &memory] {
        let write = |path: &str, n: usize| json!({"path": path, "content": "x".repeat(n)});
        ok(&tb, ctx, "write_file", write("a.txt", 60)).await;
        let e = err(&tb, ctx, "write_file", write("sub/b.txt", 50)).await;
        assert!(
            refused(&e).contains("would bring the workspace to 110 bytes")
                && refused(&e).contains("at most 100 bytes")
                && refused(&e).contains("tools.files.max_workspace_bytes"),
            "{e}"
        );
        assert!(ctx.workspace.read("sub/b.txt").await.is_err());
        // Replacing a file counts its new size, not both.
        ok(&tb, ctx, "write_file", write("a.txt", 90)).await;
        ok(&tb, ctx, "write_file", write("sub/b.txt", 10)).await;
        let e = err(&tb, ctx, "write_file", write("c.txt", 1)).await;
        assert!(refused(&e).contains("101 bytes"), "{e}");
        assert_eq!(ctx.workspace.usage("a.txt").await.unwrap().total, 100);
    }
    // Files that came in another way (here: by hand, like a `shell` command) count too.
    std::fs::write(s.root().join("sub/b.txt"), "x".repeat(40)).unwrap();
    let e = err(
        &tb,
        &s.ctx,
        "write_file",
        json!({"path": "d.txt", "content": "y"}),
    )
    .await;
    assert!(refused(&e).contains("131 bytes"), "{e}");
}

#[tokio::test]
async fn get_file_info_tells_kind_size_time_and_lines_and_list_directory_is_list_dir() {
    let s = Sandbox::new();
    let tb = builtin();
    std::fs::create_dir_all(s.root().join("src")).unwrap();
    std::fs::write(s.root().join("src/main.rs"), "fn main() {\n    run();\n}").unwrap();
    let info: serde_json::Value = serde_json::from_str(
        &ok(&tb, &s.ctx, "get_file_info", json!({"path": "src/main.rs"})).await,
    )
    .unwrap();
    assert_eq!(info["kind"], "file");
    assert_eq!(info["size"], 24);
    assert_eq!(
        info["lines"], 3,
        "the last line has no newline and still counts"
    );
    let modified = info["modified"].as_str().unwrap();
    assert!(
        modified.starts_with("20") && modified.ends_with('Z'),
        "{modified}"
    );
    let dir: serde_json::Value =
        serde_json::from_str(&ok(&tb, &s.ctx, "get_file_info", json!({"path": "src"})).await)
            .unwrap();
    assert_eq!(dir["kind"], "directory");
    assert!(dir.get("lines").is_none());
    let missing = err(&tb, &s.ctx, "get_file_info", json!({"path": "src/nope.rs"})).await;
    assert!(
        format!("{missing:?}").contains("no such file"),
        "{missing:?}"
    );
    // Sandboxed like every file tool.
    let out = err(
        &tb,
        &s.ctx,
        "get_file_info",
        json!({"path": "../etc/passwd"}),
    )
    .await;
    assert!(refused(&out).contains("`..` is refused"));
    let out = err(&tb, &s.ctx, "get_file_info", json!({"path": "/etc/passwd"})).await;
    assert!(refused(&out).contains("absolute paths are refused"));
    assert_eq!(
        ok(&tb, &s.ctx, "list_directory", json!({"path": "src"})).await,
        ok(&tb, &s.ctx, "list_dir", json!({"path": "src"})).await
    );
}

#[tokio::test]
async fn the_root_is_listed_as_any_directory_of_the_same_content_is() {
    // Given the same entries at the root and in a directory `same`: a file, a directory,
    // a symlink to each that stays inside, a symlink out, a dangling one and a FIFO.
    let s = Sandbox::new();
    let ws = LocalWorkspace::new(s.root());
    let fill = |dir: &std::path::Path| {
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("a.txt"), "hello").unwrap();
        std::fs::write(dir.join("sub/b.txt"), "inner").unwrap();
        symlink("a.txt", dir.join("to-file")).unwrap();
        symlink("sub", dir.join("to-dir")).unwrap();
        symlink(s.outside().join("secret.txt"), dir.join("out")).unwrap();
        symlink("missing", dir.join("dangling")).unwrap();
        rustix::fs::mkfifoat(rustix::fs::CWD, dir.join("pipe"), rustix::fs::Mode::RUSR).unwrap();
    };
    fill(&s.root());
    let same = s.root().join("same");
    std::fs::create_dir_all(&same).unwrap();
    fill(&same);

    // When both are listed, then they are listed alike: names sorted, what a symlink
    // inside points to, sizes of files only; the root shows `same` besides.
    let mut root = ws.list(".").await.unwrap();
    let inner = ws.list("same").await.unwrap();
    let at = root.iter().position(|e| e.name == "same").unwrap();
    assert!(root.remove(at).is_dir);
    assert_eq!(root, inner);
    let shown: Vec<(&str, bool, u64)> = root
        .iter()
        .map(|e| (e.name.as_str(), e.is_dir, e.size))
        .collect();
    assert_eq!(
        shown,
        [
            ("a.txt", false, 5),
            ("dangling", false, 0),
            ("out", false, 0),
            ("pipe", false, 0),
            ("sub", true, 0),
            ("to-dir", true, 0),
            ("to-file", false, 5),
        ]
    );

    // And a quick workspace (listing on the calling task) lists the root alike.
    let quick = LocalWorkspace::new(s.root()).quick(true);
    let mut listed = quick.list("").await.unwrap();
    listed.retain(|e| e.name != "same");
    assert_eq!(listed, inner);

    // And a root not made yet is made by its first listing, and is empty.
    let fresh = s.root().join("same/sub/fresh");
    for ws in [
        LocalWorkspace::new(&fresh),
        LocalWorkspace::new(&fresh).quick(true),
    ] {
        assert_eq!(ws.list(".").await.unwrap(), vec![]);
        assert!(fresh.is_dir());
        std::fs::remove_dir(&fresh).unwrap();
    }
}
