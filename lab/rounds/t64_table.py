"""The table of lab/rounds/t64_ab.py: per (shape, k, M), the medians of the rounds with T64 allowed (on) and refused
(off), off / on, and the spread of each variant's two rounds (the run's noise).

    python lab/rounds/t64_table.py RESULTS.json
"""
import statistics
import sys

from kbit.bench import report

t: dict = {}
for r in report.read_results(sys.argv[1])[1]:
    if r["kernel"].startswith("t64-"):
        var = r["kernel"].split("-")[1]
        t.setdefault((r["N"], r["K"], r["k"], r["M"]), {}).setdefault(var, []).append(r["us"])
print("| shape | k | M | on us | off us | off / on | round spread on, off |")
print("|---|--:|--:|--:|--:|--:|--:|")
ratios, spreads = [], []
for (N, K, k, M), d in sorted(t.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
    if "on" in d and "off" in d:
        on, off = statistics.median(d["on"]), statistics.median(d["off"])
        sp = [max(v) / min(v) - 1 for v in (d["on"], d["off"])]
        spreads += sp
        ratios.append(off / on)
        print(f"| {N}x{K} | {k} | {M} | {on:.2f} | {off:.2f} | {off / on:.3f} | {sp[0]:.1%}, {sp[1]:.1%} |")
if ratios:
    print(f"\n{len(ratios)} points: off / on median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; off faster by > 3% at {sum(x < 0.97 for x in ratios)}, slower by > 3% at "
          f"{sum(x > 1.03 for x in ratios)}; round spread median {statistics.median(spreads):.1%}, "
          f"max {max(spreads):.1%}")
