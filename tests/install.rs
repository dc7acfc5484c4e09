//! The installed binary on its own: copied into a prefix of its own and run from an empty
//! directory with no repository around it and no skein variables in its environment, it
//! runs the built-in demo offline, writes a project with `init`, checks it and runs it.
//!
//! The binary is copied rather than built by `cargo install --path . --profile dist --root
//! PREFIX`: that builds the `dist` profile from scratch, about nine minutes on two cores,
//! for the same code this test has already built. What is checked is that nothing outside the binary is read.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

struct Installed {
    _tmp: tempfile::TempDir,
    bin: PathBuf,
    home: PathBuf,
    work: PathBuf,
}

fn install() -> Installed {
    let tmp = tempfile::tempdir().unwrap();
    let bin_dir = tmp.path().join("prefix/bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let bin = bin_dir.join("skein");
    std::fs::copy(env!("CARGO_BIN_EXE_skein"), &bin).unwrap();
    let home = tmp.path().join("home");
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    Installed {
        _tmp: tmp,
        bin,
        home,
        work,
    }
}

impl Installed {
    /// `skein ARGS` in `dir`, with an environment of PATH and HOME alone.
    fn run(&self, dir: &Path, args: &[&str]) -> Output {
        Command::new(&self.bin)
            .args(args)
            .current_dir(dir)
            .env_clear()
            .env("PATH", self.bin.parent().unwrap())
            .env("HOME", &self.home)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn ok(&self, dir: &Path, args: &[&str]) -> String {
        let out = self.run(dir, args);
        assert!(
            out.status.success(),
            "skein {args:?} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

#[test]
fn the_installed_binary_needs_no_checkout() {
    let i = install();
    // No checkout above the working directory: the lookup could not find one by accident.
    assert!(!i
        .work
        .ancestors()
        .any(|d| d.join("config/skein.toml").exists() || d.join("Cargo.toml").exists()));

    // The demo, as the README's first command runs it, from an empty directory.
    let out = i.ok(&i.work, &["run", "--json", "Brief on event sourcing"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["summary"]["sessions"], 5, "{v}");
    assert!(v["answer"].as_str().unwrap().contains("# Brief"), "{v}");
    let check = i.ok(&i.work, &["agents", "check"]);
    assert!(
        check.contains("orchestrator") && check.contains("(built in)"),
        "{check}"
    );

    // A project of one's own.
    let out = i.ok(&i.work, &["init", "proj"]);
    assert!(out.contains("OPENAI_API_KEY"), "{out}");
    let proj = i.work.join("proj");
    let check = i.ok(&proj, &["agents", "check"]);
    assert!(
        check.contains("assistant") && !check.contains("built in"),
        "{check}"
    );
    let out = i.ok(&proj, &["run", "--json", "What is here?"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "completed", "{v}");
    assert!(
        v["answer"]
            .as_str()
            .unwrap()
            .contains("You asked: What is here?"),
        "{v}"
    );
    assert!(proj.join(".skein").is_dir());

    // A second init into the same place writes nothing.
    let again = i.run(&i.work, &["init", "proj"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds"));

    // Completions and the manual page come from the same binary.
    assert!(i.ok(&i.work, &["completions", "bash"]).contains("skein"));
    assert!(i.ok(&i.work, &["man"]).contains(".TH skein"));
}
