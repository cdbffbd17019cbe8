#!/usr/bin/env python3
"""CI smoke run of load/service_ab.py: two CPU-backend daemons on tiny
synthetic weights (one and two Sample threads, the second started with an
environment word), two short points, two rounds. Asserts that ab.csv holds
every round of every point on both variants, in the alternating order, with
no errors, the daemon's CPU per request measured and its batches' mean rows
and execution time scraped (one caller of one row: batches of one row;
batches of at most two callers' rows); then that a malformed
--variant and --points are refused before anything starts (timings are not
asserted).

  service_ab_smoke.py SOURCE_DIR DAEMON FS_LOAD OUT_DIR
"""

import csv
import math
import os
import subprocess
import sys


def main():
    source, daemon, load, out = sys.argv[1:5]
    script = os.path.join(source, "load", "service_ab.py")
    weights = "--weights=synthetic:vocab=4096,hidden=256,seed=1,dtype=bf16"
    base = f"{daemon} --backend=cpu {weights} --cpu_threads=1"
    done = subprocess.run(
        [sys.executable, script, "--load", load, "--out", out,
         "--variant", f"one={base} --sample_threads=1",
         "--variant", f"two=FS_UNUSED=1 {base} --sample_threads=2",
         "--points", "1x1,2x4", "--rounds", "2", "--duration", "0.3s",
         "--warmup", "0.1s"],
        capture_output=True, text=True, timeout=240)
    print(done.stdout)
    if done.returncode != 0:
        print(f"service_ab exited {done.returncode}: {done.stderr}",
              file=sys.stderr)
        return 1
    with open(os.path.join(out, "ab.csv")) as f:
        rows = list(csv.DictReader(f))
    runs = [(row["round"], row["point"], row["variant"]) for row in rows]
    expected = [("1", "1x1", "one"), ("1", "1x1", "two"),
                ("1", "2x4", "one"), ("1", "2x4", "two"),
                ("2", "1x1", "two"), ("2", "1x1", "one"),
                ("2", "2x4", "two"), ("2", "2x4", "one")]
    if runs != expected:
        print(f"runs {runs}, expected {expected}", file=sys.stderr)
        return 1
    for row in rows:
        cpu = float(row["daemon_cpu_us_per_req"])
        batch_rows = float(row["batch_rows"])
        execute_ms = float(row["execute_ms"])
        callers, rows_each = (int(x) for x in row["point"].split("x"))
        if row["errors"] != "0" or float(row["req_per_s"]) <= 0 or \
                not math.isfinite(cpu) or cpu < 0 or \
                not rows_each <= batch_rows <= callers * rows_each or \
                not execute_ms > 0:
            print(f"bad run: {row}", file=sys.stderr)
            return 1
    for bad in (["--variant", "no-command"],
                ["--variant", f"x={base}", "--points", "4"]):
        refused = subprocess.run(
            [sys.executable, script, "--load", load, "--out", out] + bad,
            capture_output=True, text=True, timeout=60)
        if refused.returncode != 2:
            print(f"{bad}: exit {refused.returncode}, expected 2 (usage)",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
