"""Whether a tuned M bucket's pick should serve smaller M, without a GPU: on every entry of a tuned table (with
its trials and the built-in choice recorded), the time of a larger tuned bucket's best candidate for the same shape
and k, against the built-in rules' choice, both over the entry's best (geometric mean / worst / share within 5%).
This decides ``kbit.tuning.tuned.EXTRAPOLATE_MAX``.

    PYTHONPATH=src python lab/suite/bucket_extrapolation.py TUNED_JSON
"""
from __future__ import annotations

import statistics
import sys
from collections import defaultdict

from kbit.tuning.space import candidate_from_dict
from kbit.tuning.tuned import TunedTable


def main(path: str) -> None:
    t = TunedTable.load(path)
    pairs: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    buckets = sorted({key[3] for key in t.entries})
    for (k, N, K, b) in t.entries:
        times = {tr.candidate: tr.us for tr in t.trials((k, N, K, b)) if tr.us is not None}
        best, own = min(times.values()), t.builtin_slowdown((k, N, K, b))
        for b2 in buckets:
            if b2 <= b or (k, N, K, b2) not in t.entries or own is None:
                continue
            c = candidate_from_dict(t.entries[(k, N, K, b2)]["best"])
            if c in times:  # the larger bucket's pick runs at this M too (was a candidate here)
                pairs[(b, b2)][0].append(times[c] / best)
                pairs[(b, b2)][1].append(own)

    def f(v):
        return f"{statistics.geometric_mean(v):.3f} / {max(v):.2f} / {sum(x <= 1.05 for x in v) / len(v):.0%}"

    print(f"{path}: time / the entry's best (geomean / worst / within 5%)")
    print("| M | pick of bucket | entries | that pick | built-in rules |")
    print("|--:|--:|--:|---|---|")
    for (b, b2), (a, own) in sorted(pairs.items()):
        if len(a) >= 8:
            print(f"| {b} | {b2} | {len(a)} | {f(a)} | {f(own)} |")


if __name__ == "__main__":
    main(sys.argv[1])
