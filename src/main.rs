//! The `skein` binary.

fn main() -> std::process::ExitCode {
    skein_cli::main()
}
