#!/usr/bin/env bash
# The compiler of the workspace's own crates in tests/run.sh's builds: clippy's driver,
# which compiles exactly as rustc does and runs clippy's lints beside it, here as errors.
# Cargo calls it as RUSTC_WORKSPACE_WRAPPER (`clippy_rustc.sh RUSTC ARGS...`, which the
# driver understands) for workspace members only; dependencies build with plain rustc.
# So the test build is also the lint pass, and clippy's own check of every dependency is
# not needed. SKEIN_CLIPPY_DRIVER names the driver (run.sh takes it from the toolchain).
exec "${SKEIN_CLIPPY_DRIVER:-clippy-driver}" "$@" -D warnings
