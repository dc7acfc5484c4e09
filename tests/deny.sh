#!/usr/bin/env bash
# The dependency policy of deny.toml, checked by cargo-deny: licences, bans (duplicate
# versions, wildcards), sources, and security advisories.
#
# cargo-deny comes from crates.io, built once into a cache directory (kept between runs
# where the machine keeps it). Its own release profile optimises the whole program as one
# unit (fat LTO, one codegen unit), which took about 6 minutes on two cores, most of it on
# one core; a policy check needs none of that speed, so it is built optimised per crate
# (opt-level 1, no LTO), which takes a fraction of that. `bash tests/deny.sh --install`
# only installs it (tests/run.sh starts that early, beside the other builds).
#
# The advisory database is a git repository on GitHub, which a machine that reaches only
# the package registries cannot fetch. In that order, the advisories are checked against:
#   1. the database, fetched as usual, when GitHub answers;
#   2. SKEIN_ADVISORY_DB: a clone of github.com/rustsec/advisory-db brought here some
#      other way (a path to a git repository, bare or not);
#   3. the copy an earlier run fetched (~/.cargo/advisory-dbs), named with its date;
#   4. none: the run says in capitals that advisories were NOT checked and exits 0, so
#      that licences, bans and sources still gate the run; SKEIN_REQUIRE_ADVISORIES=1
#      makes that a failure instead.
# The other three checks need no network.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_DENY=0.20.2
# Where cargo-deny $CARGO_DENY keeps the default database (a name derived from its URL).
DB_NAME=advisory-db-3157b0e258782691

cache="${SKEIN_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skein-tests}"
deny="$cache/cargo-deny-$CARGO_DENY/bin/cargo-deny"
if [ ! -x "$deny" ]; then
  echo "installing cargo-deny $CARGO_DENY from crates.io into $cache" >&2
  cargo install --quiet --locked --version "$CARGO_DENY" --root "$cache/cargo-deny-$CARGO_DENY" \
    --config 'profile.release.lto = false' --config 'profile.release.codegen-units = 16' \
    --config 'profile.release.opt-level = 1' cargo-deny
fi
[ "${1:-}" = "--install" ] && exit 0

"$deny" --locked check --hide-inclusion-graph bans licenses sources

db_date() { git -C "$1" log -1 --format=%cs 2>/dev/null || echo "unknown date"; }
# A config that reads the database from $1 (a directory holding $DB_NAME).
config_with_db_path() {
  sed "s|^\[advisories\]$|[advisories]\ndb-path = \"$1\"|" deny.toml >"$1/deny.toml"
  echo "$1/deny.toml"
}

home_dbs="${CARGO_HOME:-$HOME/.cargo}/advisory-dbs"
if "$deny" --locked fetch db >/dev/null 2>&1; then
  echo "advisories: checked against the database fetched now ($(db_date "$home_dbs/$DB_NAME"))" >&2
  "$deny" --locked --offline check --hide-inclusion-graph advisories
elif [ -n "${SKEIN_ADVISORY_DB:-}" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  git clone --quiet --depth 1 "file://$(cd "$SKEIN_ADVISORY_DB" && pwd)" "$work/$DB_NAME"
  echo "advisories: checked against SKEIN_ADVISORY_DB ($SKEIN_ADVISORY_DB, $(db_date "$work/$DB_NAME"))" >&2
  "$deny" --locked --offline --config "$(config_with_db_path "$work")" \
    check --hide-inclusion-graph advisories
elif [ -d "$home_dbs/$DB_NAME/.git" ]; then
  echo "advisories: the database could not be fetched; checked against the copy of" \
    "$(db_date "$home_dbs/$DB_NAME") in $home_dbs (advisories published since are not seen)" >&2
  "$deny" --locked --offline check --hide-inclusion-graph advisories
else
  {
    echo "ADVISORIES NOT CHECKED: the RustSec advisory database (a git repository on GitHub)"
    echo "could not be fetched, and no copy is at hand (SKEIN_ADVISORY_DB, or $home_dbs)."
    echo "Checked: licences, bans (duplicate versions, wildcards) and sources."
  } >&2
  if [ "${SKEIN_REQUIRE_ADVISORIES:-0}" = 1 ]; then
    echo "error: SKEIN_REQUIRE_ADVISORIES=1 asks for the advisories to be checked" >&2
    exit 1
  fi
fi
