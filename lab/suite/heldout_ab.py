"""Dispatcher times of several ``kbit bench`` runs on the same points, each against the first run (CPU):
per k the geometric mean of run / first, the best and worst ratio, and the points more than 3% faster or slower.

    python lab/suite/heldout_ab.py DIR base1 veto2 stale3 ...   # reads DIR/**/heldout-<name>*.json (kbit bench)
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from kbit.bench.report import read_results


def times(path: Path) -> dict[tuple[int, int, int, int], float]:
    return {(r["k"], r["N"], r["K"], r["M"]): r["us"] for r in read_results(path)[1]
            if r["kernel"] == "kbit-linear" and r.get("us")}


def main(d: str, names: list[str]) -> None:
    found = {n: sorted(Path(d).rglob(f"heldout-{n}*.json")) for n in names}
    runs = {n: times(p[0]) for n, p in found.items() if p}
    if len(runs) < 2:
        print(f"fewer than two runs found under {d}: {sorted(runs)}")
        return
    first, *rest = runs
    base = runs[first]
    print(f"dispatcher time / {first}'s, per k (points in both runs)\n")
    print("| run | k | points | geomean | best | worst | faster > 3% | slower > 3% |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    slow_pts = []
    for n in rest:
        for k in sorted({key[0] for key in base}) + ["all"]:
            keys = [key for key in base if key in runs[n] and (k == "all" or key[0] == k)]
            if not keys:
                continue
            r = [runs[n][key] / base[key] for key in keys]
            print(f"| {n} | {k} | {len(r)} | {statistics.geometric_mean(r):.3f} | {min(r):.3f} | {max(r):.3f} | "
                  f"{sum(x < 0.97 for x in r)} | {sum(x > 1.03 for x in r)} |")
            if k != "all":
                slow_pts += [(n, key, base[key], runs[n][key]) for key in keys if runs[n][key] / base[key] > 1.03]
    print("\npoints more than 3% slower than the first run (us):")
    for n, (k, N, K, M), a, b in slow_pts:
        print(f"- {n}: k = {k} {N}x{K} M = {M}: {a:.2f} -> {b:.2f} ({b / a:.3f})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
