//! The `skein` binary.

// jemalloc rather than the system allocator: see the dependency's note in Cargo.toml.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    skein_cli::main()
}
