#!/usr/bin/env python3
"""Runs built test binaries in lanes: a few at once, longest first.

Reads `cargo test --no-run --message-format=json` on standard input, picks the test
binaries (all of them, or those `--crate` and `--suite` name), and runs them `--lanes` at
a time, each in its package's directory as `cargo test` would. Most suites spend their
time waiting on servers and processes they start, so two of them side by side take about
the time of the longer; `cargo test` runs one binary after another. Each suite's output is
printed whole when it ends, with its time; a table of the times and the list of failed
suites close the run. Every suite runs, also after one failed; the exit status is 1 when
any failed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

# Seconds each suite took on two cores in a recent run, alone: the order to start them in
# (longest first, so no long one starts last). A suite not listed counts as short.
KNOWN_SECONDS = {
    "skein-nats/backend": 50,
    "skein/nats_node_loss": 78,
    "skein/nats_e2e": 36,
    "skein/nats_definitions": 30,
    "skein/ops": 24,
    "skein/ui_browser": 19,
    "skein/patterns": 18,
    "skein-sim/seeds": 18,
    "skein-quota-server/quota": 17,
    "skein/nats_refusals": 14,
    "skein-sim/versions": 11,
    "skein-fuzz/runner": 10,
    "skein-nats/filters": 9,
    "skein/embedded": 9,
    "skein/mcp_e2e": 8,
    "skein-mcp/servers": 8,
    "skein/nats_features": 7,
}


def suites(lines, crates, names):
    found = []
    for line in lines:
        if not line.strip():
            continue
        m = json.loads(line)
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        if not m["profile"]["test"]:
            continue
        t = m["target"]
        pkg_dir = os.path.dirname(m["manifest_path"])
        in_crates = os.path.basename(os.path.dirname(pkg_dir)) == "crates"
        package = os.path.basename(pkg_dir) if in_crates else "skein"
        name = f"{package}/{t['name']}" + ("" if t["kind"] == ["test"] else " (unit)")
        wanted = not crates and not names
        wanted |= any(pkg_dir.endswith("/" + c) for c in crates)
        wanted |= t["kind"] == ["test"] and t["name"] in names
        if wanted:
            found.append((name, pkg_dir, m["executable"]))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--crate", action="append", default=[],
                    help="every test binary of this crate directory (crates/NAME)")
    ap.add_argument("--suite", action="append", default=[],
                    help="an integration test target of this name")
    ap.add_argument("--at-least", type=int, default=1,
                    help="fail when fewer binaries than this were found")
    args = ap.parse_args()

    todo = suites(sys.stdin, args.crate, args.suite)
    if len(todo) < args.at_least:
        print(f"error: {len(todo)} test binaries found, expected at least {args.at_least}",
              file=sys.stderr)
        return 1
    todo.sort(key=lambda s: -KNOWN_SECONDS.get(s[0], 0))
    lock = threading.Lock()
    results = []
    started = time.monotonic()

    def lane():
        while True:
            with lock:
                if not todo:
                    return
                name, cwd, exe = todo.pop(0)
            t0 = time.monotonic()
            with tempfile.TemporaryFile() as out:
                rc = subprocess.call([exe], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
                out.seek(0)
                text = out.read().decode("utf-8", "replace")
            secs = time.monotonic() - t0
            with lock:
                results.append((name, secs, rc))
                verdict = "ok" if rc == 0 else f"FAILED (exit {rc})"
                sys.stdout.write(f"\n--- {name}: {verdict} in {secs:.1f} s\n{text}")
                sys.stdout.flush()

    threads = [threading.Thread(target=lane) for _ in range(max(1, args.lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    wall = time.monotonic() - started
    busy = sum(s for _, s, _ in results)
    print(f"\n{len(results)} test binaries in {args.lanes} lanes: {wall:.0f} s "
          f"({busy:.0f} s one after another)")
    for name, secs, rc in sorted(results, key=lambda r: -r[1])[:15]:
        print(f"  {secs:7.1f} s  {name}{'' if rc == 0 else '  FAILED'}")
    failed = [name for name, _, rc in results if rc != 0]
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
