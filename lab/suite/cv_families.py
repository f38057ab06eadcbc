"""How a tuned table generalises to shapes never tuned, without a GPU: each model family of the suite's tune half
is left out in turn, the rules are fitted on the other families' entries, and the left-out entries are looked up
(a) by the fitted rules alone, (b) as the dispatcher looks them up (nearest tuned shapes with the built-in choice
competing, then the rules); each pick's time is read from the left-out entry's own trials, as is (c) the built-in
rules' choice (entries record it: ``lab/suite/builtin_annotate.py``).

    PYTHONPATH=src python lab/suite/cv_families.py TUNED_JSON     # a table of kbit tune (with its trials)
"""
from __future__ import annotations

import statistics
import sys

from kbit.bench import suite as S
from kbit.tuning.tuned import TunedTable, evaluate, fit_rules


def folds(table: TunedTable):
    """``(fitted, held)`` a model family of the suite's tune half: ``held`` its entries, ``fitted`` the others'."""
    fam = S.shape_families(S.select(S.load_models(), split="tune"))
    for f in sorted({fam[(k[1], k[2])] for k in table.entries}):
        fitted, held = TunedTable(table.gpu, table.meta), TunedTable(table.gpu, table.meta)
        fitted.candidates = held.candidates = table.candidates  # a packed table's entries index its candidates
        for key, e in table.entries.items():
            (held if fam[(key[1], key[2])] == f else fitted).entries[key] = e
        yield fitted, held


def main(path: str) -> None:
    table = TunedTable.load(path)
    rows: dict[str, list] = {"rules": [], "lookup": []}
    for fitted, held in folds(table):
        rules = fit_rules(fitted)
        rows["rules"] += evaluate(rules, held)["rows"]
        rows["lookup"] += evaluate(rules, held, fitted=fitted)["rows"]
    builtin = [dict(M=r["M"], slowdown=table.builtin_slowdown((r["k"], r["N"], r["K"], r["M"])))
               for r in rows["rules"]]  # entries that record the built-in choice (lab/suite/builtin_annotate.py)
    buckets = sorted({key[3] for key in table.entries})
    print(f"{path}: {len(table.entries)} entries; time / the entry's best, left-out families; per M bucket: "
          "within 5%")
    print("| pick | entries | timed | median | worst | within 5% | " + " | ".join(f"M = {b}" for b in buckets) + " |")
    print("|---|--:|--:|--:|--:|--:|" + "--:|" * len(buckets))
    for name, rs in (("fitted rules", rows["rules"]), ("nearest shapes, then rules", rows["lookup"]),
                     ("built-in rules", builtin)):
        s = [r["slowdown"] for r in rs if r["slowdown"] is not None]

        def within(ms, rs=rs):
            v = [r["slowdown"] for r in rs if r["M"] in ms]
            return f"{sum(x is not None and x <= 1.05 for x in v) / len(v):.0%}" if v else "-"

        print(f"| {name} | {len(rs)} | {len(s)} | {statistics.median(s):.3f} | {max(s):.2f} | {within(set(buckets))} | "
              + " | ".join(within({b}) for b in buckets) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
