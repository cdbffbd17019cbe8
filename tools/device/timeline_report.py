#!/usr/bin/env python3
"""Reads fs_bench --timeline files and says where the fused wgmma kernel's
time goes: per CTA, the two consumer warpgroups' pieces alternate, and the
tensor pipe idles wherever neither is inside its wgmma loop. For each call
this splits the kernel's span (first wgmma start to last scoring end, over
all CTAs) into

  mma      time some consumer of the CTA is in its wgmma loop (union),
  head     from the kernel's first wgmma start to this CTA's first one,
  gaps     between one piece's wgmmas and the next piece's, where the next
           piece's consumer was still scoring an earlier piece,
  tail     from the CTA's last wgmma end to the kernel's end (its last
           scoring, and the wait for the slowest CTA),

averaged over CTAs, and prints the mean wgmma and scoring time per piece
position (the first pieces score without floors; the last ones form the
tail).

  tools/device/timeline_report.py <timeline_*.csv> [...]
"""
import collections
import csv
import signal
import statistics
import sys


def report(path):
    calls = collections.defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            calls[int(row["call"])].append(row)
    print(f"== {path}")
    for call, rows in sorted(calls.items()):
        call_us = float(rows[0]["call_us"])
        ctas = collections.defaultdict(list)
        for row in rows:
            ctas[int(row["cta"])].append(
                (int(row["piece"]), int(row["mma_start_ns"]),
                 int(row["mma_end_ns"]), int(row["score_end_ns"])))
        start = min(p[1] for pieces in ctas.values() for p in pieces)
        end = max(p[3] for pieces in ctas.values() for p in pieces)
        span = (end - start) / 1e3
        parts = collections.defaultdict(list)
        mma_by_piece = collections.defaultdict(list)
        score_by_piece = collections.defaultdict(list)
        for pieces in ctas.values():
            pieces.sort()
            busy = 0
            gaps = 0
            covered_until = pieces[0][1]
            for j, (_, mma_start, mma_end, score_end) in enumerate(pieces):
                mma_by_piece[j].append((mma_end - mma_start) / 1e3)
                score_by_piece[j].append((score_end - mma_end) / 1e3)
                if mma_start > covered_until:
                    gaps += mma_start - covered_until
                busy += max(0, mma_end - max(mma_start, covered_until))
                covered_until = max(covered_until, mma_end)
            parts["mma"].append(busy / 1e3)
            parts["head"].append((pieces[0][1] - start) / 1e3)
            parts["gaps"].append(gaps / 1e3)
            parts["tail"].append((end - covered_until) / 1e3)
        mean = {name: statistics.mean(values) for name, values in parts.items()}
        print(f"call {call}: {call_us:.1f} us (events), span {span:.1f} us, "
              f"{len(ctas)} CTAs; per CTA, mean: " +
              ", ".join(f"{name} {mean[name]:.1f}"
                        for name in ("mma", "head", "gaps", "tail")) +
              f" us; gaps max {max(parts['gaps']):.1f}, "
              f"tail min {min(parts['tail']):.1f} max {max(parts['tail']):.1f}")
        if call == 0:
            print("  piece  mma_us  score_us  (mean over CTAs)")
            for j in sorted(mma_by_piece):
                print(f"  {j:5d}  {statistics.mean(mma_by_piece[j]):6.1f}  "
                      f"{statistics.mean(score_by_piece[j]):8.1f}")


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        report(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
