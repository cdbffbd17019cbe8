#!/usr/bin/env python3
"""The service benchmark: flashsamplerd under fs_load, next to the kernel.

Starts the daemon on synthetic weights, runs fs_load over a grid of load
points (closed loop: callers x rows per request; open loop: fixed request
rates), scrapes the daemon's own histograms before and after each point, and
prints one table: throughput and latency percentiles beside the daemon's
mean queue wait, batch rows and batch execution time, and the kernel's own
time at the same batch sizes when fs_bench results are given.

  load/service_bench.py --daemon build/bin/flashsamplerd \\
      --load build/bin/fs_load --backend cpu --grid smoke --out /tmp/sb \\
      --weights synthetic:vocab=4096,hidden=256,seed=1,dtype=bf16
  # the same with sampling controls on every request:
  load/service_bench.py ... --grid callers --load_arg=--top_k=50 \
      --load_arg=--top_p=0.9 --load_arg=--min_p=0.05
  # requests of 1 to 256 rows with a bitmask and raw logprobs on each row
  # (--row_params: sent per row, so that each row's bitmask is its own):
  load/service_bench.py ... --grid rows --load_arg=--allow_even_ids \
      --load_arg=--logprobs=5 --load_arg=--row_params
  # every control at once, on rows as peaked as a language model's (fs_load's
  # random hidden states are flat on synthetic weights unless scaled):
  load/service_bench.py ... --grid rows --load_arg=--hidden_scale=2.5 \
      --load_arg=--temperature=0.8 --load_arg=--top_k=50 \
      --load_arg=--top_p=0.9 --load_arg=--min_p=0.05 \
      --load_arg=--logit_bias=64 --load_arg=--penalized_ids=64 \
      --load_arg=--allow_even_ids --load_arg=--logprobs=5
  # over a Unix socket instead of loopback TCP (callers on the same host):
  load/service_bench.py ... --unix_socket
  # the service path alone (engine answers at once):
  load/service_bench.py --daemon build/bin/flashsamplerd_null_engine \\
      --load build/bin/fs_load --backend null --out /tmp/sb
  # what controls cost, paired: at each point, temperature alone and then
  # with the controls (--compare_arg, added to --load_arg), against the same
  # daemon, in alternating order, three rounds; compare.csv holds each
  # round's ratio of the two rows/s:
  load/service_bench.py ... --grid rows --rounds 3 \\
      --load_arg=--temperature=0.8 --compare_arg=--top_k=50 \\
      --compare_arg=--top_p=0.9 --compare_arg=--min_p=0.05

Columns: fs_load's throughput and percentiles; the daemon's mean request
decoding, queue wait, batch execution time, response encoding and batch
rows over the point (Prometheus histograms scraped before and after);
overhead_ms = p50 - decode - queue - execute - encode (gRPC's two hops,
the threads' hand-offs and wake-ups); the kernel's time at the
nearest batch size when --kernel_csv (fs_bench results.csv) is given;
the daemon's CPU time (user + system) and context switches (all its
threads) over the point, per answered request (warm-up calls included on
both sides); fs_load's CPU time (getrusage of the finished process, its
start-up included) per answered request; and how busy the
host's CPUs were over the point (all processes; near 100% the host, not
the service, is the limit, and fs_load shares it); and the share of the
batches' rows whose controls took the exact fallback
(flashsampler_exact_fallback_rows_total). Exit status 1 when any point had
errors or the daemon failed.

Only the standard library: it runs on the GPU machines as they are.
"""

import argparse
import collections
import csv
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

# (mode, callers or rate, rows per request)
FULL_GRID = ([("closed", c, 1) for c in (1, 16, 64, 256)] +
             [("closed", c, r) for r in (16, 64, 256) for c in (1, 4, 16)] +
             [("open", rate, 1) for rate in (1000, 5000, 10000, 20000)])
# Single-row callers only: the service's own ceiling (with --backend null).
CALLERS_GRID = [("closed", c, 1) for c in (1, 16, 64, 256)]
SMOKE_GRID = [("closed", 1, 1), ("closed", 16, 1), ("closed", 4, 16),
              ("open", 200, 1)]
# Batches of the kernel's sizes from one and from several callers: what
# per-row controls (bitmasks, logprobs) cost the service.
ROWS_GRID = [("closed", 1, 1), ("closed", 64, 1), ("closed", 1, 64),
             ("closed", 1, 256), ("closed", 4, 64)]

# One fs_load run: its label in the tables (the point, then "-rN" where
# --rounds > 1 and "-base" or "-compared" with --compare_arg), the point
# and the run's round and configuration, and fs_load's arguments beyond
# the point's.
Run = collections.namedtuple(
    "Run", "label point config round mode amount rows load_args")

HISTOGRAMS = ("flashsampler_queue_wait_seconds",
              "flashsampler_batch_execute_seconds",
              "flashsampler_batch_rows",
              # its count: every answer, warm-up calls included
              "flashsampler_request_duration_seconds",
              "flashsampler_request_decode_seconds",
              "flashsampler_response_encode_seconds")


def daemon_env(extra=None):
    """This environment plus `extra` for a daemon, with NVLink multicast
    off for every library that would use it (`extra` cannot turn it on)."""
    env = dict(os.environ, **(extra or {}))
    env.update(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    return env


def load_channels(callers):
    """fs_load's --channels for `callers`: one connection per 8 callers (at
    most 8), since one HTTP/2 connection tops out near 17k small calls/s,
    below the daemon."""
    return min(8, max(1, callers // 8))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rows whose controls the fast path could not certify (every reason).
FALLBACK_ROWS = "flashsampler_exact_fallback_rows_total"


def scrape(port):
    """Sum and count of each histogram in HISTOGRAMS and the FALLBACK_ROWS
    counter (each over all labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                timeout=5) as reply:
        text = reply.read().decode()
    totals = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1) in HISTOGRAMS:
            key = (match.group(1), match.group(2))
            totals[key] = totals.get(key, 0.0) + float(match.group(4))
        match = re.match(r"^(\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1) == FALLBACK_ROWS:
            key = (FALLBACK_ROWS, "total")
            totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def mean_delta(before, after, name):
    count = after.get((name, "count"), 0) - before.get((name, "count"), 0)
    total = after.get((name, "sum"), 0) - before.get((name, "sum"), 0)
    return total / count if count > 0 else float("nan")


def answered(before, after):
    """Requests the daemon answered between two scrapes, warm-up calls
    included (the request duration histogram's count)."""
    return (after.get((HISTOGRAMS[3], "count"), 0) -
            before.get((HISTOGRAMS[3], "count"), 0))


def fallback_pct(before, after):
    """Share of the batches' rows (warm-up included) that took the exact
    fallback, in percent."""
    rows = (after.get((HISTOGRAMS[2], "sum"), 0) -
            before.get((HISTOGRAMS[2], "sum"), 0))
    fallback = (after.get((FALLBACK_ROWS, "total"), 0) -
                before.get((FALLBACK_ROWS, "total"), 0))
    return 100.0 * fallback / rows if rows > 0 else float("nan")


def process_usage(pid):
    """The daemon's CPU seconds (user + system) and context switches
    (voluntary and not, summed over its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the parenthesized name; utime and stime are 14 and 15.
        fields = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = 0
    task_dir = f"/proc/{pid}/task"
    for task in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, task, "status")) as f:
                for line in f:
                    # voluntary_ctxt_switches, nonvoluntary_ctxt_switches
                    if "ctxt_switches:" in line:
                        switches += int(line.split()[-1])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return cpu_s, switches


def host_cpu():
    """Jiffies the host's CPUs spent busy and in total so far (/proc/stat's
    first line; idle and iowait count as idle)."""
    with open("/proc/stat") as f:
        # user .. steal; guest and guest_nice are inside user and nice.
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def children_cpu_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_serving(port, metrics_port, daemon, deadline_s):
    """True once the metrics endpoint answers and the gRPC port accepts (the
    metrics endpoint comes up first, while the gRPC server still starts)."""
    end = time.time() + deadline_s
    while time.time() < end:
        if daemon.poll() is not None:
            return False
        try:
            scrape(metrics_port)
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def kernel_times(path, config):
    """fs_bench results.csv -> {batch: fused kernel ms} for `config`."""
    times = {}
    if not path:
        return times
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("config") == config and row.get("fused_us"):
                times[int(row["batch"])] = float(row["fused_us"]) / 1e3
    return times


def nearest(times, batch):
    if not times or batch != batch:  # NaN: no batch ran
        return None
    return times[min(times, key=lambda b: abs(b - batch))]


def fmt(value, digits=3):
    return "" if value is None or value != value else f"{value:.{digits}f}"


def write_comparison(runs, load_rows, path):
    """compare.csv and its table: each point's and round's rows/s and p50 of
    the two configurations and the compared one's share of the base's
    rows/s, then each point's lowest, median and highest share."""
    pairs = {}
    for run in runs:
        pairs.setdefault((run.point, run.round),
                         {})[run.config] = load_rows[run.label]
    header = ["point", "round", "base_rows_per_s", "compared_rows_per_s",
              "compared_share", "base_p50_ms", "compared_p50_ms"]
    shares = {}
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        print()
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for (point, round_), pair in pairs.items():
            base = float(pair["base"]["rows_per_s"])
            compared = float(pair["compared"]["rows_per_s"])
            share = compared / base if base > 0 else float("nan")
            shares.setdefault(point, []).append(share)
            values = [point, str(round_), fmt(base, 0), fmt(compared, 0),
                      fmt(share), fmt(float(pair["base"]["p50_ms"])),
                      fmt(float(pair["compared"]["p50_ms"]))]
            writer.writerow(values)
            print("| " + " | ".join(values) + " |")
    print()
    print("| point | compared share: lowest | median | highest |")
    print("|---|---|---|---|")
    for point, values in shares.items():
        ordered = sorted(values)
        print(f"| {point} | {fmt(ordered[0])} | "
              f"{fmt(statistics.median(ordered))} | {fmt(ordered[-1])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--load", required=True)
    parser.add_argument("--backend", default="cpu",
                        choices=("cpu", "cuda", "null"),
                        help="null: --daemon is flashsamplerd_null_engine")
    parser.add_argument("--weights",
                        default="synthetic:vocab=151936,hidden=4096,seed=1,"
                        "dtype=bf16",
                        help="passed to the daemon as --weights (always "
                        "explicit); ignored by the null engine")
    parser.add_argument("--kernel_config", default="qwen",
                        help="fs_bench config whose times to show")
    parser.add_argument("--grid", default="full",
                        choices=("full", "callers", "smoke", "rows"))
    parser.add_argument("--duration", default="8s")
    parser.add_argument("--warmup", default="2s")
    parser.add_argument("--kernel_csv", default="",
                        help="fs_bench results.csv: the kernel alone")
    parser.add_argument("--out", required=True)
    parser.add_argument("--unix_socket", action="store_true",
                        help="fs_load calls the daemon over a Unix socket "
                        "(--unix_socket) instead of loopback TCP")
    parser.add_argument("--daemon_arg", action="append", default=[])
    parser.add_argument("--load_arg", action="append", default=[],
                        help="passed to every fs_load run, e.g. "
                        "--load_arg=--top_k=50")
    parser.add_argument("--compare_arg", action="append", default=[],
                        help="fs_load args of a second configuration, run "
                        "after (or before) --load_arg's at every point and "
                        "round, with --load_arg's; compare.csv holds the "
                        "ratios, e.g. --compare_arg=--top_k=50")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each point (and configuration)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    os.makedirs(args.out, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    env = daemon_env()
    log = open(os.path.join(args.out, "daemon.log"), "w")
    command = [args.daemon, f"--listen_address=127.0.0.1:{port}",
               f"--metrics_port={metrics_port}", "--metrics_address=127.0.0.1"]
    if args.backend != "null":
        command += [f"--backend={args.backend}", f"--weights={args.weights}"]
    target = f"127.0.0.1:{port}"
    socket_dir = None
    if args.unix_socket:
        # Under /tmp whatever TMPDIR says: a socket path fits in 108 bytes.
        socket_dir = tempfile.mkdtemp(prefix="fs_sb_", dir="/tmp")
        socket_path = os.path.join(socket_dir, "sampler.sock")
        command.append(f"--unix_socket={socket_path}")
        target = f"unix:{socket_path}"
    daemon = subprocess.Popen(command + args.daemon_arg, stdout=log,
                              stderr=subprocess.STDOUT, env=env)
    failed = False
    try:
        if not wait_serving(port, metrics_port, daemon, 600):
            print("service_bench: the daemon did not come up; see daemon.log",
                  file=sys.stderr)
            return 1
        grid = {"full": FULL_GRID, "callers": CALLERS_GRID,
                "smoke": SMOKE_GRID, "rows": ROWS_GRID}[args.grid]
        summary = os.path.join(args.out, "load.csv")
        if os.path.exists(summary):
            os.remove(summary)
        runs = []
        for mode, amount, rows in grid:
            point = f"{mode}-{amount}-{rows}"
            for round_ in range(1, args.rounds + 1):
                configs = [("base", args.load_arg)]
                if args.compare_arg:
                    configs.append(("compared",
                                    args.load_arg + args.compare_arg))
                    # Alternating order: a drift of the host over a round
                    # favours neither.
                    if round_ % 2 == 0:
                        configs.reverse()
                for config, load_args in configs:
                    label = point
                    if args.rounds > 1:
                        label += f"-r{round_}"
                    if args.compare_arg:
                        label += f"-{config}"
                    runs.append(Run(label, point, config, round_, mode,
                                    amount, rows, load_args))
        rows_out = []
        for label, _, _, _, mode, amount, rows, load_args in runs:
            command = [args.load, f"--target={target}",
                       f"--mode={mode}", f"--rows={rows}",
                       f"--duration={args.duration}",
                       f"--warmup={args.warmup}", f"--summary_csv={summary}",
                       f"--label={label}", "--timeout=30s", "--retries=1"]
            command.append(f"--concurrency={amount}" if mode == "closed" else
                           f"--rate={amount}")
            callers = amount if mode == "closed" else 64
            command.append(f"--channels={load_channels(callers)}")
            command += load_args
            before = scrape(metrics_port)
            usage_before = process_usage(daemon.pid)
            host_before, load_before = host_cpu(), children_cpu_s()
            done = subprocess.run(command, capture_output=True, text=True,
                                  env=env)
            host_after, load_after = host_cpu(), children_cpu_s()
            usage_after = process_usage(daemon.pid)
            after = scrape(metrics_port)
            answers = answered(before, after)
            # fs_load exits 3 when calls failed: that is a result to show
            # (the errors column), anything else means no summary line.
            if done.returncode not in (0, 3):
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
            failed = failed or done.returncode != 0
            rows_out.append({
                "label": label,
                "decode_ms": 1e3 * mean_delta(before, after, HISTOGRAMS[4]),
                "queue_ms": 1e3 * mean_delta(before, after, HISTOGRAMS[0]),
                "execute_ms": 1e3 * mean_delta(before, after, HISTOGRAMS[1]),
                "encode_ms": 1e3 * mean_delta(before, after, HISTOGRAMS[5]),
                "batch_rows": mean_delta(before, after, HISTOGRAMS[2]),
                "fallback_pct": fallback_pct(before, after),
                "cpu_us": (1e6 * (usage_after[0] - usage_before[0]) / answers
                           if answers > 0 else float("nan")),
                "switches": ((usage_after[1] - usage_before[1]) / answers
                             if answers > 0 else float("nan")),
                "load_cpu_us": (1e6 * (load_after - load_before) / answers
                                if answers > 0 else float("nan")),
                "host_busy": (100.0 * (host_after[0] - host_before[0]) /
                              max(1, host_after[1] - host_before[1])),
            })
        with open(summary) as f:
            load_rows = {row["label"]: row for row in csv.DictReader(f)}
        kernel = kernel_times(args.kernel_csv, args.kernel_config)
        table = os.path.join(args.out, "service.csv")
        header = ["point", "req_per_s", "rows_per_s", "p50_ms", "p99_ms",
                  "errors", "decode_ms", "queue_ms", "execute_ms",
                  "encode_ms", "overhead_ms",
                  "batch_rows", "kernel_ms_at_batch", "daemon_cpu_us_per_req",
                  "switches_per_req", "load_cpu_us_per_req",
                  "host_cpu_busy_pct", "fallback_rows_pct"]
        with open(table, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
            for extra in rows_out:
                load = load_rows[extra["label"]]
                p50 = float(load["p50_ms"])
                overhead = (p50 - extra["decode_ms"] - extra["queue_ms"] -
                            extra["execute_ms"] - extra["encode_ms"])
                values = [extra["label"],
                          fmt(float(load["throughput_rps"]), 0),
                          fmt(float(load["rows_per_s"]), 0), fmt(p50),
                          fmt(float(load["p99_ms"])), load["errors"],
                          fmt(extra["decode_ms"]), fmt(extra["queue_ms"]),
                          fmt(extra["execute_ms"]),
                          fmt(extra["encode_ms"]), fmt(overhead), fmt(extra["batch_rows"], 1),
                          fmt(nearest(kernel, extra["batch_rows"])),
                          fmt(extra["cpu_us"], 1), fmt(extra["switches"], 2),
                          fmt(extra["load_cpu_us"], 1),
                          fmt(extra["host_busy"], 0),
                          fmt(extra["fallback_pct"], 2)]
                writer.writerow(values)
                print("| " + " | ".join(values) + " |")
        if args.compare_arg:
            write_comparison(runs, load_rows,
                             os.path.join(args.out, "compare.csv"))
        if daemon.poll() is not None:
            print("service_bench: the daemon died; see daemon.log",
                  file=sys.stderr)
            return 1
        return 1 if failed else 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
