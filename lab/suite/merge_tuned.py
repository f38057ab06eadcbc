"""Merge the entries of a ``kbit tune`` run into a packaged tuned table, refit the default rule on the result and write
it in the packaged form (CPU). For retuning part of a shipped table (some k and M buckets, after a new config joined
the search space) without retuning the rest:

    python -m kbit.bench.tune --suite models --split tune --quick --k 5 --m 1,4 --kernels mma --out new.json   (GPU)
    python lab/suite/merge_tuned.py --base src/kbit/tuning/configs/tuned-h100.json --new new.json \\
        --out src/kbit/tuning/configs/tuned-h100.json

The new run's entries replace the base's of the same (k, N, K, M bucket); with ``--behind-only``, only those where the
base's pick ran over 5% behind the new run's best in the new run, or the base has no entry. The table's metadata
keeps the base's and lists the merged runs under ``merged``: their commit, GPU name, what they cover, the file's
``runs`` (each ``kbit tune`` run's commit and how many entries it added, for a file that later runs resumed) and
``--note``. Refitting the rules on the packaged form gives the rules fitted on the full table (checked on the H100
and H200 tables of 2026-11-27: the same 224 / 112 rules), so the rules of untouched k do not move.
"""
import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from kbit.bench.tune import evaluation_lines  # noqa: E402
from kbit.tuning.tuned import TunedTable, evaluate, fit_rules  # noqa: E402


def _behind(base: TunedTable, new: TunedTable, key) -> bool:
    """Whether ``base`` lacks the entry ``key`` or its pick ran over 5% behind the best in ``new``'s trials."""
    k, N, K, b = key
    own = base.exact(k, b, N, K) if key in base.entries else None
    times = {t.candidate: t.us for t in new.trials(key) if t.us is not None}
    return own is None or times.get(own, float("inf")) > 1.05 * min(times.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the packaged table (e.g. src/kbit/tuning/configs/tuned-h100.json)")
    ap.add_argument("--new", required=True, help="the tuned table of the new run (kbit tune --out)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--behind-only", action="store_true",
                    help="take only entries where the base's pick ran over 5%% behind the new run's best, or new ones")
    ap.add_argument("--note", default=None, help="a line kept with this merge's record (e.g. the runs a file holds)")
    a = ap.parse_args(argv)
    base, new = TunedTable.load(a.base), TunedTable.load(a.new)
    if a.behind_only:
        new.entries = {key: e for key, e in new.entries.items() if _behind(base, new, key)}
    if base.gpu != new.gpu:
        raise ValueError(f"new: expected a table of the base's GPU {base.gpu!r}, got {new.gpu!r} ({a.new})")
    if not new.entries:
        raise ValueError(f"new: expected tuned entries, got none in {a.new}")
    cover = Counter((k, b) for k, _N, _K, b in new.entries)
    replaced = sum(key in base.entries for key in new.entries)
    base.merge(new)
    base.meta.setdefault("merged", []).append({
        "commit": new.meta.get("commit"), "gpu_name": new.meta.get("gpu_name"),
        "entries": {f"k={k} M={b}": n for (k, b), n in sorted(cover.items())},
        **({"runs": new.meta["runs"]} if new.meta.get("runs") else {}),
        **({"note": a.note} if a.note else {})})
    rules = fit_rules(base)
    out = base.packaged().save(a.out, indent=None)
    print(f"{len(new.entries)} entries merged ({replaced} replaced); {len(rules)} rules fitted on "
          f"{len(base.entries)} entries; written to {out}")
    print("\n".join(evaluation_lines(evaluate(rules, base), f"{a.out} itself")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
