//! `search_files` on a real directory and on a backend that is not one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::symlink;
use std::sync::Arc;

use common::{builtin, ctx_for, err, ok, MemoryWorkspace, Sandbox};
use serde_json::json;
use skein_tools::{SearchConfig, ToolBox, ToolError, ToolsConfig, Workspace};

fn with_search(search: SearchConfig) -> ToolBox {
    ToolBox::builtin(&ToolsConfig {
        search,
        ..ToolsConfig::default()
    })
}

fn tree(s: &Sandbox) {
    let r = s.root();
    std::fs::create_dir_all(r.join("src/deep")).unwrap();
    std::fs::write(r.join("README.md"), "# Title\nfn is not here\n").unwrap();
    std::fs::write(r.join("src/main.rs"), "fn main() {\n    helper();\n}\n").unwrap();
    std::fs::write(
        r.join("src/deep/util.rs"),
        "pub fn helper() {}\n// TODO: more\n",
    )
    .unwrap();
}

#[tokio::test]
async fn substring_matches_are_printed_as_path_line_text() {
    let s = Sandbox::new();
    tree(&s);
    let out = ok(
        &builtin(),
        &s.ctx,
        "search_files",
        json!({"pattern": "helper"}),
    )
    .await;
    assert_eq!(
        out,
        "src/deep/util.rs:1: pub fn helper() {}\nsrc/main.rs:2:     helper();"
    );
}

#[tokio::test]
async fn a_substring_is_literal_and_a_regex_is_not() {
    let s = Sandbox::new();
    tree(&s);
    let tb = builtin();
    // `fn \w+\(` as text appears nowhere…
    let out = ok(&tb, &s.ctx, "search_files", json!({"pattern": r"fn \w+\("})).await;
    assert!(out.starts_with("no matches (3 files searched)"), "{out}");
    // …as a regex it finds both function definitions, not the README's prose.
    let out = ok(
        &tb,
        &s.ctx,
        "search_files",
        json!({"pattern": r"fn \w+\(", "regex": true}),
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        vec![
            "src/deep/util.rs:1: pub fn helper() {}",
            "src/main.rs:1: fn main() {"
        ]
    );
}

#[tokio::test]
async fn case_insensitive_and_under_a_path() {
    let s = Sandbox::new();
    tree(&s);
    let tb = builtin();
    let out = ok(
        &tb,
        &s.ctx,
        "search_files",
        json!({"pattern": "todo", "case_sensitive": false}),
    )
    .await;
    assert_eq!(out, "src/deep/util.rs:2: // TODO: more");
    let out = ok(&tb, &s.ctx, "search_files", json!({"pattern": "todo"})).await;
    assert!(out.starts_with("no matches"), "{out}");
    let out = ok(
        &tb,
        &s.ctx,
        "search_files",
        json!({"pattern": "fn", "path": "src/deep"}),
    )
    .await;
    assert_eq!(out, "src/deep/util.rs:1: pub fn helper() {}");
}

#[tokio::test]
async fn matches_stop_at_the_limit() {
    let s = Sandbox::new();
    let body: String = (0..50).map(|i| format!("hit {i}\n")).collect();
    std::fs::write(s.root().join("many.txt"), body).unwrap();
    let tb = with_search(SearchConfig {
        max_matches: 10,
        ..SearchConfig::default()
    });
    let out = ok(&tb, &s.ctx, "search_files", json!({"pattern": "hit"})).await;
    assert_eq!(
        out.lines().filter(|l| l.starts_with("many.txt:")).count(),
        10
    );
    assert!(out.contains("stopped at 10 matches"), "{out}");
    // A call may ask for fewer, not for more than the config allows.
    let out = ok(
        &tb,
        &s.ctx,
        "search_files",
        json!({"pattern": "hit", "max_matches": 3}),
    )
    .await;
    assert_eq!(
        out.lines().filter(|l| l.starts_with("many.txt:")).count(),
        3
    );
    let e = err(
        &tb,
        &s.ctx,
        "search_files",
        json!({"pattern": "hit", "max_matches": 11}),
    )
    .await;
    assert!(
        e.to_string().contains("`max_matches` must be at most 10"),
        "{e}"
    );
}

#[tokio::test]
async fn files_scanned_are_limited() {
    let s = Sandbox::new();
    for i in 0..10 {
        std::fs::write(s.root().join(format!("f{i:02}.txt")), "needle\n").unwrap();
    }
    let tb = with_search(SearchConfig {
        max_files: 4,
        ..SearchConfig::default()
    });
    let out = ok(&tb, &s.ctx, "search_files", json!({"pattern": "needle"})).await;
    assert_eq!(
        out.lines().filter(|l| l.contains(":1: needle")).count(),
        4,
        "{out}"
    );
    assert!(
        out.contains("only the first 4 files were searched"),
        "{out}"
    );
}

#[tokio::test]
async fn only_the_first_bytes_of_a_big_file_are_searched() {
    let s = Sandbox::new();
    let mut big = "early\n".to_string();
    big.push_str(&"x".repeat(100));
    big.push_str("\nlate\n");
    std::fs::write(s.root().join("big.txt"), big).unwrap();
    let tb = with_search(SearchConfig {
        max_file_bytes: 50,
        ..SearchConfig::default()
    });
    let out = ok(&tb, &s.ctx, "search_files", json!({"pattern": "early"})).await;
    assert!(out.starts_with("big.txt:1: early"), "{out}");
    assert!(
        out.contains("only the first 50 bytes of 1 large file(s)"),
        "{out}"
    );
    let out = ok(&tb, &s.ctx, "search_files", json!({"pattern": "late"})).await;
    assert!(out.starts_with("no matches"), "{out}");
}

#[tokio::test]
async fn binary_files_and_escaping_symlinks_are_skipped() {
    let s = Sandbox::new();
    std::fs::write(s.root().join("bin.dat"), b"needle\0\x01\x02").unwrap();
    std::fs::write(s.root().join("text.txt"), "needle\n").unwrap();
    std::fs::write(s.outside().join("secret.txt"), "needle SECRET\n").unwrap();
    symlink(s.outside(), s.root().join("out")).unwrap();
    symlink(s.outside().join("secret.txt"), s.root().join("leak.txt")).unwrap();
    let out = ok(
        &builtin(),
        &s.ctx,
        "search_files",
        json!({"pattern": "needle"}),
    )
    .await;
    assert_eq!(out, "text.txt:1: needle");
}

#[tokio::test]
async fn a_bad_regex_is_an_argument_error() {
    let s = Sandbox::new();
    let e = err(
        &builtin(),
        &s.ctx,
        "search_files",
        json!({"pattern": "(unclosed", "regex": true}),
    )
    .await;
    match e {
        ToolError::InvalidArgs(m) => assert!(m.contains("`pattern` is not a valid regex"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn search_works_over_the_trait_alone() {
    let mem = Arc::new(MemoryWorkspace::default());
    mem.write("docs/a.md", b"alpha\nbeta\n").await.unwrap();
    mem.write("docs/sub/b.md", b"gamma beta\n").await.unwrap();
    mem.write("top.txt", b"beta top\n").await.unwrap();
    let ctx = ctx_for(mem.clone());
    let out = ok(&builtin(), &ctx, "search_files", json!({"pattern": "beta"})).await;
    assert_eq!(
        out,
        "docs/a.md:2: beta\ndocs/sub/b.md:1: gamma beta\ntop.txt:1: beta top"
    );
    let walk = mem.walk("docs", 10).await.unwrap();
    let names: Vec<&str> = walk.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, vec!["docs/a.md", "docs/sub/b.md"]);
    assert!(!walk.truncated);
    let walk = mem.walk("", 1).await.unwrap();
    assert_eq!(walk.files.len(), 1);
    assert!(walk.truncated);
}
