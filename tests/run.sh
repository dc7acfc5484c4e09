#!/usr/bin/env bash
# The whole test suite: unit, property, conformance and end-to-end tests. The NATS suites
# start their own nats-server processes, so nats-server must be installed; on a Debian
# machine where we are root it is installed here (package `nats-server`).
set -euo pipefail
cd "$(dirname "$0")/.."

export PATH="$PATH:/usr/sbin:/usr/local/sbin"
if ! command -v nats-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "nats-server is missing: installing the Debian package nats-server" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >&2
  else
    echo "error: nats-server is required by the NATS test suites and is not installed." >&2
    echo "       Install it with: sudo apt-get install nats-server" >&2
    echo "       (or put a nats-server 2.9+ binary on PATH)" >&2
    exit 1
  fi
fi
echo "using $(nats-server --version)" >&2

cargo test --workspace --all-targets --locked
