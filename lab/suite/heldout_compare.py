"""A held-out tuned table (``run_heldout_tune.sh``) read three ways, without a GPU: per entry the time of the
built-in rules' choice (the dispatcher with no table; entries record it: ``kbit tune``, or
``lab/suite/builtin_annotate.py`` for older tables), of the shipped table's choice (what the dispatcher looks up
now: exact entry, nearest tuned shapes, fitted rules) and of the fastest candidate, each read from the entry's own
trials.

    PYTHONPATH=src python lab/suite/heldout_compare.py HELD_OUT_JSON [--table src/kbit/tuning/configs/tuned-h100.json]
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from kbit.tuning.tuned import TunedTable


def _line(name: str, v: list[float]) -> str:
    if not v:
        return f"| {name} | 0 | - | - | - |"
    return (f"| {name} | {len(v)} | {statistics.median(v):.3f} | {max(v):.2f} | "
            f"{sum(x <= 1.05 for x in v) / len(v):.0%} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("held")
    p.add_argument("--table", default="src/kbit/tuning/configs/tuned-h100.json")
    a = p.parse_args()
    held, table = TunedTable.load(a.held), TunedTable.load(a.table)
    by: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = []
    for (k, N, K, b), e in sorted(held.entries.items()):
        times = {t.candidate: t.us for t in held.trials((k, N, K, b)) if t.us is not None}
        best = min(times.values())
        own = held.builtin_candidate((k, N, K, b))
        answered, pick = table.answer(k, b, N, K)
        if answered and pick is None:
            pick = own  # the table says: the built-in rules' choice
        r = dict(k=k, N=N, K=K, M=b, best=best, builtin=times.get(own), table=times.get(pick),
                 measured=e.get("current_us"))
        rows.append(r)
        for name in ("builtin", "table", "measured"):
            if r[name] is not None:
                by[(k, b)][name].append(r[name] / best)
                by[("all", "all")][name].append(r[name] / best)
    print(f"{a.held}: {len(rows)} entries; time / the entry's fastest candidate (median, worst, within 5%)")
    print("| k | M | built-in rules | table lookup (trials) | dispatcher as timed |")
    print("|---|--:|---|---|---|")
    for key in sorted(by, key=str):
        d = by[key]

        def f(v):
            if not v:
                return "-"
            return f"{statistics.median(v):.3f} / {max(v):.2f} / {sum(x <= 1.05 for x in v) / len(v):.0%}"

        print(f"| {key[0]} | {key[1]} | {f(d['builtin'])} | {f(d['table'])} | {f(d['measured'])} |")
    worst = sorted((r for r in rows if r["table"]), key=lambda r: -r["table"] / r["best"])[:8]
    print("\nworst table picks: " + "; ".join(f"k={r['k']} {r['N']}x{r['K']} M={r['M']} {r['table'] / r['best']:.2f}x"
                                               for r in worst))


if __name__ == "__main__":
    main()
