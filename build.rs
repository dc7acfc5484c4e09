//! Links the `skein` binary as a position-dependent executable on Linux with glibc.
//!
//! A position-independent executable (rustc's default there) is relocated by the loader at
//! every start: about 47,000 pointers in the binary's read-only data are rewritten, which
//! copies some 200 pages of it into the process before `main` runs. A `skein run` is a
//! short process on a small machine, and those copies were about half a millisecond of the
//! fan-out of 8 (docs/perf.md). The loader still places the shared libraries, the heap, the
//! stacks and every `mmap` at random; only the binary's own code and data sit at the
//! address it was linked for, as Go's linker does by default on this platform. Set
//! `SKEIN_PIE=1` when building to keep a position-independent binary.

fn main() {
    println!("cargo:rerun-if-env-changed=SKEIN_PIE");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let keep_pie = std::env::var("SKEIN_PIE").is_ok_and(|v| !v.is_empty() && v != "0");
    if os == "linux" && env == "gnu" && !keep_pie {
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
}
