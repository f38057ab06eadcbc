"""A/B of ``TunedTable.nearest`` without a GPU: the left-out-family lookups of ``lab/suite/cv_families.py`` with the
built-in candidate's win answering its one measured choice (the library since 2026-11-27) against always answering
``BUILTIN`` (the rule before, re-implemented here: the rules then chose again at the looked-up shape). Prints the
entries whose pick changed, with each pick's time over the entry's best (from the entry's own trials).

    PYTHONPATH=src python lab/suite/nearest_builtin_ab.py src/kbit/tuning/configs/tuned-h100.json
"""
from __future__ import annotations

import json
import math
import sys

from cv_families import folds

from kbit.tuning import tuned as T
from kbit.tuning.tuned import BUILTIN, TunedTable, evaluate, fit_rules


def slowdowns(table: TunedTable) -> dict:
    rows = []
    for fitted, held in folds(table):
        rows += evaluate(fit_rules(fitted), held, fitted=fitted)["rows"]
    return {(r["k"], r["N"], r["K"], r["M"]): r["slowdown"] for r in rows}


def nearest_before(self, k, bucket, N, K):
    keys = [key for key in self.entries if key[0] == k and key[3] == bucket]
    if not keys:
        return None
    keys.sort(key=lambda key: (abs(math.log(N / key[1])) + abs(math.log(K / key[2])), key))
    near = keys[:T.NEAREST]
    slow = T._slowdowns(self, near)
    own = [self.builtin_slowdown(key) for key in near]
    if all(v is not None for v in own):
        slow[BUILTIN] = own
    picked = T._pick(slow, len(near))
    if picked is None:
        return None
    return BUILTIN if picked[0] == BUILTIN else T.candidate_from_dict(json.loads(picked[0]))


def main(path: str) -> None:
    table = TunedTable.load(path)
    new = slowdowns(table)
    TunedTable.nearest = nearest_before
    old = slowdowns(table)
    changed = [(key, old[key], new[key]) for key in sorted(new) if old[key] != new[key]]
    both = [c for c in changed if c[1] is not None and c[2] is not None]
    print(f"{len(changed)} of {len(new)} entries changed: {sum(c[2] < c[1] for c in both)} faster, "
          f"{sum(c[2] > c[1] for c in both)} slower, {sum(c[2] is None for c in changed)} not timed at the entry")
    if both:
        def gm(v):
            return math.exp(sum(math.log(x) for x in v) / len(v))
        print(f"geometric mean over the changed timed ones: before {gm([c[1] for c in both]):.3f}, "
              f"after {gm([c[2] for c in both]):.3f}")
    for key, a, b in changed:
        print(f"  k={key[0]} {key[1]}x{key[2]} M={key[3]}: {'-' if a is None else f'{a:.3f}'} -> "
              f"{'-' if b is None else f'{b:.3f}'}")


if __name__ == "__main__":
    main(sys.argv[1])
