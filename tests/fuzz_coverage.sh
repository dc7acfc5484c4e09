#!/usr/bin/env bash
# Builds skein-fuzz with coverage counters and runs it with the arguments given:
#   bash tests/fuzz_coverage.sh --coverage --seconds 10     # every target, guided by coverage
#   bash tests/fuzz_coverage.sh --compare --seconds 10      # both modes, runs and coverage
# The counters are SanitizerCoverage's inline 8-bit counters, which stable rustc adds with
# `-C passes=sancov-module`; skein-fuzz reads them itself (src/coverage.rs), so no other
# toolchain or fuzzing engine is needed. The build is for the host given as an explicit
# target, so the flags reach the code under test but not build scripts and proc macros,
# which are shared with the ordinary build of the same target directory. skein-fuzz itself
# is optimised (its overflow checks stay on): it reads every counter after each input.
set -euo pipefail
cd "$(dirname "$0")/.."
host="$(rustc -vV | sed -n 's/^host: //p')"
RUSTFLAGS="-C passes=sancov-module -C llvm-args=-sanitizer-coverage-level=3 -C llvm-args=-sanitizer-coverage-inline-8bit-counters" \
  cargo build --locked -p skein-fuzz --bin skein-fuzz --target "$host" \
  --config 'profile.dev.package.skein-fuzz.opt-level = 3'

exec "${CARGO_TARGET_DIR:-target}/$host/debug/skein-fuzz" "$@"
