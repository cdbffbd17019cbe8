#!/usr/bin/env python3
"""Plots fs_load's CSVs as a PNG (matplotlib, headless).

Per-call files (fs_load --csv): latency over time (OK calls as dots, errors
as red crosses, a rolling p99 line) and latency by percentile with
p50/p99/p99.9 marked, one colour per file:
    plot_latency.py run_a.csv [run_b.csv ...] -o latency.png
Sweep file (fs_load --summary_csv, one line per run): p50/p99/p99.9 latency
against achieved throughput, the latency-throughput curve:
    plot_latency.py --summary sweep.csv -o curve.png
"""

import argparse
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def nearest_rank(sorted_values, q):
    """Same definition as fs_load's Percentile (load/load_stats.cc)."""
    if len(sorted_values) == 0:
        return 0.0
    rank = int(np.ceil(q * len(sorted_values)))
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


def read_calls(path):
    start, latency, ok = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            start.append(float(row["start_s"]))
            latency.append(float(row["latency_s"]))
            ok.append(row["code"] == "OK")
    return np.array(start), np.array(latency), np.array(ok, dtype=bool)


def rolling_p99(start, latency, window_s):
    """p99 of the OK calls in each window_s-wide bin, at the bin's centre."""
    if len(start) == 0:
        return np.array([]), np.array([])
    edges = np.arange(0.0, start.max() + window_s, window_s)
    centres, values = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = np.sort(latency[(start >= lo) & (start < hi)])
        if len(in_bin):
            centres.append((lo + hi) / 2)
            values.append(nearest_rank(in_bin, 0.99))
    return np.array(centres), np.array(values)


def plot_calls(paths, output, title):
    fig, (ax_time, ax_cdf) = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, path in enumerate(paths):
        colour = colours[i % len(colours)]
        label = os.path.splitext(os.path.basename(path))[0]
        start, latency, ok = read_calls(path)
        ms = latency * 1e3
        ax_time.scatter(start[ok], ms[ok], s=3, alpha=0.4, color=colour,
                        label=f"{label} ok ({ok.sum()})")
        if (~ok).any():
            ax_time.scatter(start[~ok], ms[~ok], s=12, marker="x",
                            color="red", label=f"{label} errors ({(~ok).sum()})")
        duration = start.max() if len(start) else 1.0
        centres, p99 = rolling_p99(start[ok], ms[ok], max(duration / 20, 0.1))
        ax_time.plot(centres, p99, color=colour, linewidth=1.5,
                     label=f"{label} rolling p99")

        # Percentile spectrum (HdrHistogram style): x = 1 / (1 - q) on a
        # log axis so that p99 and p99.9 get as much room as the median.
        sorted_ms = np.sort(ms[ok])
        if len(sorted_ms):
            q = np.arange(1, len(sorted_ms) + 1) / (len(sorted_ms) + 1)
            ax_cdf.step(1 / (1 - q), sorted_ms, where="post", color=colour,
                        label=label)
            for quantile in (0.5, 0.99, 0.999):
                value = nearest_rank(sorted_ms, quantile)
                ax_cdf.plot([1 / (1 - quantile)], [value], marker="o",
                            color=colour)
                ax_cdf.annotate(f"p{quantile * 100:g} {value:.3g} ms",
                                (1 / (1 - quantile), value),
                                textcoords="offset points",
                                xytext=(-60, 8 + 12 * i), fontsize=8,
                                color=colour)
    ax_time.set_xlabel("time since start of measured window (s)")
    ax_time.set_ylabel("latency (ms)")
    ax_time.set_yscale("log")
    ax_time.set_title("latency over time")
    ax_time.legend(fontsize=8, markerscale=3)
    ax_cdf.set_xscale("log")
    ticks = [1, 2, 10, 100, 1000, 10000]
    ax_cdf.set_xticks(ticks)
    ax_cdf.set_xticklabels(["p0", "p50", "p90", "p99", "p99.9", "p99.99"])
    ax_cdf.set_xlabel("percentile of OK calls")
    ax_cdf.set_ylabel("latency (ms)")
    ax_cdf.set_yscale("log")
    ax_cdf.set_title("latency by percentile")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def plot_summary(path, output, title):
    runs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            runs.append(row)
    if not runs:
        raise SystemExit(f"{path}: no runs")
    runs.sort(key=lambda r: float(r["throughput_rps"]))
    x = np.array([float(r["throughput_rps"]) for r in runs])
    fig, ax = plt.subplots(figsize=(8, 5))
    for column, name in (("p50_ms", "p50"), ("p99_ms", "p99"),
                         ("p999_ms", "p99.9")):
        ax.plot(x, [float(r[column]) for r in runs], marker="o", label=name)
    for r, xi in zip(runs, x):
        setting = (f"c={r['concurrency']}" if r["mode"] == "closed"
                   else f"{float(r['rate']):g}/s")
        ax.annotate(r["label"] or setting, (xi, float(r["p99_ms"])),
                    textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("achieved throughput (OK requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", nargs="*", help="fs_load --csv files")
    parser.add_argument("--summary", help="fs_load --summary_csv file")
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--title", default="flashsampler latency")
    args = parser.parse_args(argv)
    if bool(args.csv) == bool(args.summary):
        parser.error("give per-call CSV files or --summary, not both")
    if args.summary:
        plot_summary(args.summary, args.output, args.title)
    else:
        plot_calls(args.csv, args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
