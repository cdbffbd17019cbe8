#!/usr/bin/env python3
"""Daemons against each other under the same load, alternating.

Starts every variant at once, each on its own ports (a daemon build, its
flags, its environment), then runs fs_load over the load points on each
variant in turn, the order reversed every other round, so that a drift of
the host (clocks, power, neighbours) favours none. Builds and settings are
judged this way on one machine: machines of one kind differ by more than
most changes (docs/performance.md). Prints each point's requests/s, p50,
the daemon's CPU per answered request and its batches' mean rows, the
rounds' range per variant, and writes every run to ab.csv (with the
batches' mean execution time, from the daemon's histograms).

  load/service_ab.py --load build/bin/fs_load --out /tmp/ab \\
      --variant 'four=build/bin/flashsamplerd --backend=cpu
                 --weights=synthetic:vocab=4096,hidden=256,seed=1,dtype=bf16
                 --sample_threads=4' \\
      --variant 'one=build/bin/flashsamplerd --backend=cpu
                 --weights=synthetic:vocab=4096,hidden=256,seed=1,dtype=bf16
                 --sample_threads=1' \\
      --points 1x1,16x1,4x64 --rounds 2 --duration 2s --warmup 0.5s

A variant is NAME=COMMAND: the daemon and its flags as a shell would split
them, optionally led by VAR=value words for its environment; the script
adds --listen_address, --metrics_port and --metrics_address. A point is
CALLERSxROWS, a closed loop of that many callers sending requests of that
many rows, one connection per 8 callers (at most 8, as service_bench.py).
"""

import argparse
import csv
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import service_bench as sb  # noqa: E402  (the same environment, scrape and reads)


def parse_variant(text):
    """NAME=COMMAND -> (name, argv, environment additions)."""
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise argparse.ArgumentTypeError(
            f"--variant must be NAME=COMMAND, got {text!r}")
    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        raise argparse.ArgumentTypeError(f"--variant {name}: no command")
    return name, words, env


def parse_points(text):
    points = []
    for item in text.split(","):
        callers, sep, rows = item.partition("x")
        if not sep or not callers.isdigit() or not rows.isdigit() or \
                int(callers) < 1 or int(rows) < 1:
            raise argparse.ArgumentTypeError(
                f"--points: each point is CALLERSxROWS, got {item!r}")
        points.append((int(callers), int(rows)))
    return points


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="fs_load")
    parser.add_argument("--variant", action="append", type=parse_variant,
                        required=True, help="NAME=COMMAND (repeat)")
    parser.add_argument("--points", type=parse_points,
                        default=parse_points("1x1,64x1,256x1,4x64"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", default="2s")
    parser.add_argument("--warmup", default="0.5s")
    parser.add_argument("--load_arg", action="append", default=[],
                        help="passed to every fs_load run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    names = [name for name, _, _ in args.variant]
    if len(set(names)) != len(names):
        parser.error("--variant names must differ")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    os.makedirs(args.out, exist_ok=True)

    daemons = []
    try:
        for name, command, extra_env in args.variant:
            port, metrics_port = sb.free_port(), sb.free_port()
            env = sb.daemon_env(extra_env)
            log = open(os.path.join(args.out, f"{name}.log"), "w")
            process = subprocess.Popen(
                command + [f"--listen_address=127.0.0.1:{port}",
                           f"--metrics_port={metrics_port}",
                           "--metrics_address=127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
            daemons.append((name, process, port, metrics_port))
        for name, process, port, metrics_port in daemons:
            if not sb.wait_serving(port, metrics_port, process, 600):
                print(f"service_ab: {name} did not come up; see {name}.log",
                      file=sys.stderr)
                return 1
        summary = os.path.join(args.out, "load.csv")
        if os.path.exists(summary):
            os.remove(summary)
        runs = []
        for round_ in range(1, args.rounds + 1):
            order = daemons if round_ % 2 else daemons[::-1]
            for callers, rows in args.points:
                for name, process, port, metrics_port in order:
                    label = f"{callers}x{rows}-r{round_}-{name}"
                    command = [args.load, f"--target=127.0.0.1:{port}",
                               f"--concurrency={callers}", f"--rows={rows}",
                               f"--channels={sb.load_channels(callers)}",
                               f"--duration={args.duration}",
                               f"--warmup={args.warmup}",
                               f"--summary_csv={summary}", f"--label={label}",
                               "--timeout=30s", "--retries=1"] + args.load_arg
                    before = sb.scrape(metrics_port)
                    usage_before = sb.process_usage(process.pid)
                    done = subprocess.run(command, capture_output=True,
                                          text=True)
                    usage_after = sb.process_usage(process.pid)
                    after = sb.scrape(metrics_port)
                    if done.returncode not in (0, 3):  # 3: some calls failed
                        print(done.stdout, done.stderr, file=sys.stderr)
                        return 1
                    answers = sb.answered(before, after)
                    runs.append({
                        "label": label, "round": round_, "variant": name,
                        "point": f"{callers}x{rows}",
                        "cpu_us": (1e6 * (usage_after[0] - usage_before[0]) /
                                   answers if answers else float("nan")),
                        "batch_rows": sb.mean_delta(before, after,
                                                    sb.HISTOGRAMS[2]),
                        "execute_ms": 1e3 * sb.mean_delta(before, after,
                                                          sb.HISTOGRAMS[1])})
        with open(summary) as f:
            load_rows = {row["label"]: row for row in csv.DictReader(f)}
    finally:
        for _, process, _, _ in daemons:
            process.terminate()
        for _, process, _, _ in daemons:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()

    header = ["point", "round", "variant", "req_per_s", "rows_per_s",
              "p50_ms", "p99_ms", "errors", "daemon_cpu_us_per_req",
              "batch_rows", "execute_ms"]
    table = []
    for run in runs:
        load = load_rows[run["label"]]
        table.append({"point": run["point"], "round": run["round"],
                      "variant": run["variant"],
                      "req_per_s": float(load["throughput_rps"]),
                      "rows_per_s": float(load["rows_per_s"]),
                      "p50_ms": float(load["p50_ms"]),
                      "p99_ms": float(load["p99_ms"]),
                      "errors": int(load["errors"]),
                      "daemon_cpu_us_per_req": run["cpu_us"],
                      "batch_rows": run["batch_rows"],
                      "execute_ms": run["execute_ms"]})
    with open(os.path.join(args.out, "ab.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(table)

    def spread(values, digits):
        low, high = min(values), max(values)
        if round(low, digits) == round(high, digits):
            return f"{low:,.{digits}f}"
        return f"{low:,.{digits}f}-{high:,.{digits}f}"

    print("requests/s over the rounds (p50 ms; daemon CPU us per request; "
          "rows per batch)")
    print("| point | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    errors = 0
    for callers, rows in args.points:
        point = f"{callers}x{rows}"
        cells = []
        for name in names:
            mine = [r for r in table
                    if r["point"] == point and r["variant"] == name]
            errors += sum(r["errors"] for r in mine)
            cells.append(
                f"{spread([r['req_per_s'] for r in mine], 0)} "
                f"({spread([r['p50_ms'] for r in mine], 2)}; "
                f"{spread([r['daemon_cpu_us_per_req'] for r in mine], 0)}; "
                f"{spread([r['batch_rows'] for r in mine], 1)})")
        print(f"| {point} | " + " | ".join(cells) + " |")
    medians = {name: statistics.median(
        r["req_per_s"] for r in table if r["variant"] == name)
        for name in names}
    print("median requests/s over every run: " +
          ", ".join(f"{name} {value:,.0f}" for name, value in medians.items()))
    if errors:
        print(f"service_ab: {errors} calls failed (the errors column of "
              "ab.csv)", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
