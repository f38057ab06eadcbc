"""The dispatcher against the fastest kbit candidate at every point of a results file (issue 32: within 5% of it at
every measured point), with bf16 and humming beside it.

    python -m kbit.bench.dispatch_points RESULTS_JSON [...]     # no GPU needed

One row per (N, K, M, k) of the dense rows: the dispatcher's time (``kbit-linear``), the fastest kbit candidate's
time and name (the dispatcher included, so the ratio is >= 1), their ratio, bf16's and humming's time; then a line:
at how many points the dispatcher was within 5% of the fastest, the median and the worst ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterable, Sequence

from kbit.bench.report import read_results
from kbit.bench.summary import kbit_times

__all__ = ["WITHIN", "dispatch_points", "points_markdown"]

#: the issue's bar: the dispatcher's time at most this times the fastest kbit candidate's
WITHIN = 1.05


def dispatch_points(rows: Iterable[dict]) -> list[dict]:
    """Per dense (N, K, M, k) with a dispatcher time: {N, K, M, k, disp, best, best_name, ratio, bf16, humming}."""
    out = []
    for (E, N, K, M, k), d in sorted(kbit_times(rows).items()):
        if E != 1 or d["disp"] is None or not d["best"]:
            continue
        out.append(dict(N=N, K=K, M=M, k=k, disp=d["disp"], best=d["best"], best_name=d["best_name"],
                        ratio=d["disp"] / d["best"], bf16=d["bf16"], humming=d["humming"]))
    return out


def _us(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def points_markdown(points: Sequence[dict]) -> str:
    """The points as a markdown table and a closing line (see the module docstring)."""
    lines = ["| N x K | M | k | dispatcher us | best kbit us | best | dispatcher / best | bf16 us | humming us |",
             "|---|--:|--:|--:|--:|---|--:|--:|--:|"]
    for p in points:
        lines.append(f"| {p['N']}x{p['K']} | {p['M']} | {p['k']} | {_us(p['disp'])} | {_us(p['best'])} | "
                     f"{p['best_name']} | {p['ratio']:.3f} | {_us(p['bf16'])} | {_us(p['humming'])} |")
    if points:
        r = [p["ratio"] for p in points]
        worst = max(points, key=lambda p: p["ratio"])
        lines.append(f"\ndispatcher within {100 * (WITHIN - 1):.0f}% of the fastest kbit candidate at "
                     f"{sum(v <= WITHIN for v in r)} of {len(r)} points; dispatcher / best: median "
                     f"{statistics.median(r):.3f}, worst {worst['ratio']:.3f} ({worst['N']}x{worst['K']} "
                     f"M={worst['M']} k={worst['k']}, best {worst['best_name']})")
    else:
        lines.append("\nno point with a dispatcher time")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kbit.bench.dispatch_points", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", metavar="RESULTS_JSON")
    args = p.parse_args(argv)
    for path in args.results:
        header, rows = read_results(path)
        print(f"{path}: {header.get('gpu_name', '?')}, commit {header.get('commit', '?')}")
        print(points_markdown(dispatch_points(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
