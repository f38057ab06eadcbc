"""The table of a two-tree A/B through ``kbit bench`` (lab/rounds/k1split_ab.sh, xtail_ab.sh): the dispatcher's
time per (shape, k, M) in each tree and round (results under <dir>/<tree>-<round>/<gpu>/<name>-*.json, trees
``base`` and ``head``), and after / before of the round medians.

    python lab/rounds/ab_table.py DIR NAME BASE_LABEL [CANDIDATE]

CANDIDATE: the rows compared (default ``kbit-linear``, the dispatcher; e.g. ``grouped_mma`` for expert stacks,
whose shape column reads ExNxK and M the tokens).
"""
import statistics
import sys
from pathlib import Path

from kbit.bench import report

root, name, base = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cand = sys.argv[4] if len(sys.argv) > 4 else "kbit-linear"
t = {}
for f in sorted(root.glob(f"*-*/*/{name}-*.json")):
    tree, rnd = f.parts[-3].split("-")
    for r in report.read_results(f)[1]:
        if r["kernel"] == cand:
            t.setdefault((r.get("E", 1), r["N"], r["K"], r["k"], r["M"]), {}).setdefault(tree, []).append(r["us"])
print(f"| shape | k | M | before ({base}) us | after us | after / before |")
print("|---|--:|--:|--:|--:|--:|")
ratios = []
for (E, N, K, k, M), d in sorted(t.items()):
    if "base" in d and "head" in d:
        b, h = statistics.median(d["base"]), statistics.median(d["head"])
        ratios.append(h / b)
        runs = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
        shape = f"{E}x{N}x{K}" if E != 1 else f"{N}x{K}"
        print(f"| {shape} | {k} | {M} | {runs(d['base'])} | {runs(d['head'])} | {h / b:.3f} |")
if ratios:
    print(f"\n{len(ratios)} points: after / before median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}; faster by > 3%: {sum(r < 0.97 for r in ratios)}, "
          f"slower by > 3%: {sum(r > 1.03 for r in ratios)}")
