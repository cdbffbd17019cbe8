#!/usr/bin/env python3
"""Draws fs_bench's results.csv: per config, median time vs batch size for
the fused sampler and the three unfused baselines, and fused / cuBLAS-only
on a second axis. Usage: plot_bench.py results.csv out.png"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path, png_path):
    rows = list(csv.DictReader(open(csv_path)))
    configs = []
    for row in rows:
        if row["config"] not in configs:
            configs.append(row["config"])
    fig, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 5),
                             squeeze=False)
    series = [("fused_us", "fused (stage 1 + 2)"),
              ("cublas_only_us", "cuBLAS matmul only"),
              ("cublas_softmax_multinomial_us", "cuBLAS + softmax + multinomial"),
              ("cublas_gumbel_us", "cuBLAS + Gumbel-max")]
    for ax, config in zip(axes[0], configs):
        data = [r for r in rows if r["config"] == config]
        batches = [int(r["batch"]) for r in data]
        for key, label in series:
            ax.plot(batches, [float(r[key]) for r in data], marker="o",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch rows B")
        ax.set_ylabel("median us (L2 flushed)")
        ax.set_title("%s: V=%s, D=%s" % (config, data[0]["vocab"],
                                          data[0]["hidden"]))
        ax.grid(True, alpha=0.3)
        ratio = ax.twinx()
        ratio.plot(batches, [float(r["fused_over_cublas"]) for r in data],
                   color="black", linestyle="--", label="fused / cuBLAS")
        ratio.axhline(1.0, color="gray", linewidth=0.5)
        ratio.set_ylabel("fused / cuBLAS-only")
        lines, labels = ax.get_legend_handles_labels()
        lines2, labels2 = ratio.get_legend_handles_labels()
        ax.legend(lines + lines2, labels + labels2, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print("plot written to", png_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
