"""The old-vs-new speed table: M = 1 points (lab/ab/speed.py lines) and decode steps (bench_e2e.py JSON files).

    python lab/ab/summary.py --m1 $OUT/m1.jsonl --e2e $OUT/e2e_old_1.json,... > $OUT/ab-summary.md

Per point: each tree's median over its runs (runs alternate old, new, old, new), new / old time, and the
verdict against the 2% bar.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m1", required=True)
    p.add_argument("--e2e", default="", help="comma list of tag=file.json")
    a = p.parse_args()
    pts = defaultdict(lambda: defaultdict(list))
    for line in open(a.m1):
        r = json.loads(line)
        pts[(f"{r['N']}x{r['K']}", f"k={r['k']}", "M=1 us")][r["tag"]].append(r["us"])
    for item in filter(None, a.e2e.split(",")):
        tag, path = item.split("=", 1)
        for r in json.load(open(path))["rows"]:
            if "ms_per_step" in r:
                pts[(r["model"], f"k={r['k']}", f"B={r['batch']} step us")][tag].append(1e3 * r["ms_per_step"])
    print("| point | | what | old (median of runs) | new | new / old | runs old / new |")
    print("|---|---|---|--:|--:|--:|---|")
    worst = 0.0
    for key, by in pts.items():
        old, new = statistics.median(by["old"]), statistics.median(by["new"])
        worst = max(worst, new / old)
        runs = " ".join(f"{v:.2f}" for v in by["old"]) + " / " + " ".join(f"{v:.2f}" for v in by["new"])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {old:.2f} | {new:.2f} | {new / old:.3f} | {runs} |")
    print(f"\nworst new / old: {worst:.3f} ({'within' if worst <= 1.02 else 'OVER'} the 2% bar)")


if __name__ == "__main__":
    main()
