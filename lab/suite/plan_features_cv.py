"""Which plan features of a transferred config differ between the looked-up shape and its nearest tuned shapes, and
how far those lookups miss (no GPU): the left-out-family lookups of ``lab/suite/cv_families.py`` (M <= 64) that
answer an "mma" candidate, each planned (``make_plan`` with the tuner's fake build: occupancy = MINB) at the shape
and at its neighbours. Features: K split, x staged (XS), CTA-aligned units (CAU), the local fix-up (LFX), WS4,
x slices, T64. Times come from the entries' trials, measured with the plans of their day.

    PYTHONPATH=src python lab/suite/plan_features_cv.py src/kbit/tuning/configs/tuned-h100.json
"""
from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict

from cv_families import folds

from kbit.bench.tune_build import _FakeKernel
from kbit.tuning import tuned as T
from kbit.tuning.mma_plan import make_plan
from kbit.tuning.tuned import BUILTIN, TunedTable, fit_rules

NAMES = ("split", "XS", "CAU", "LFX", "WS4", "XK", "T64")


def features(cand, k: int, M: int, N: int, K: int) -> tuple | None:
    try:
        p = make_plan(k, M, N, K, "log8", cand.config, sms=132, build=lambda kk, d: _FakeKernel(d))
    except ValueError:
        return None
    d = p.defines
    return (p.splits > 1, d.get("XS", 0), d.get("CAU", 0), d.get("LFX", 0), d.get("WS4", 0), d.get("XK", 0) > 0,
            d.get("T64", 0))


def main(path: str) -> None:
    table = TunedTable.load(path)
    stats, worst = defaultdict(list), []
    for fitted, held in folds(table):
        fitted.rules = fit_rules(fitted)
        for key in held.entries:
            k, N, K, b = key
            cand = fitted.nearest(k, b, N, K) if b <= 64 else None
            if cand is None or cand == BUILTIN or cand.family != "mma":
                continue
            trials = {t.candidate.key: t.us for t in held.trials(key) if t.us is not None}
            if cand.key not in trials:
                continue
            slow = trials[cand.key] / min(trials.values())
            keys = sorted((kk for kk in fitted.entries if kk[0] == k and kk[3] == b),
                          key=lambda kk: (abs(math.log(N / kk[1])) + abs(math.log(K / kk[2])), kk))[:T.NEAREST]
            here = features(cand, k, b, N, K)
            there = [features(cand, kk[0], kk[3], kk[1], kk[2]) for kk in keys]
            if here is None or any(x is None for x in there):
                diff = ("not planned",)
            else:
                diff = tuple(NAMES[i] for i in range(len(here)) if any(x[i] != here[i] for x in there))
            stats[diff].append(slow)
            worst.append((slow, key, cand.config, diff))
    print("| plan features unlike the neighbours' | lookups | within 5% | geometric mean | worst |")
    print("|---|--:|--:|--:|--:|")
    for d, v in sorted(stats.items(), key=lambda kv: -len(kv[1])):
        print(f"| {', '.join(d) or 'none'} | {len(v)} | {sum(x <= 1.05 for x in v) / len(v):.0%} | "
              f"{statistics.geometric_mean(v):.3f} | {max(v):.2f} |")
    print("\nworst lookups:")
    for slow, key, cfg, d in sorted(worst, key=lambda w: -w[0])[:12]:
        print(f"  {slow:.2f}x k={key[0]} {key[1]}x{key[2]} M={key[3]}: {cfg} (differs: {', '.join(d) or 'none'})")


if __name__ == "__main__":
    main(sys.argv[1])
