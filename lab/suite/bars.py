"""Issue 32's bars, read from `kbit bench --suite models` results files (no GPU): per k and M, over the dense shapes
the files hold, how kbit's dispatcher (`kbit-linear`) stands against humming at the same k and bf16 cuBLAS of the
same run, and its share of the read ceiling.

    python lab/suite/bars.py benchmarks/results/h100/suite-k4-2026-11-27.json [more.json ...]

Printed per (k, M): shapes, kbit >= humming (count, worst ratio), of the points where kbit is slower how many read
their bytes at >= 0.99x humming's TB/s (slower by the bytes of the format, not by the kernel: kbit reads a scale
byte per 32 weights where humming's w<k> reads a bf16 scale per 128, 3% more bytes at k = 4 and 6% at k = 2), x bf16
(median, worst), and at M = 1 the share of the read ceiling on shapes of >= 100M weights (worst; the bar: >= 85% at
k = 3..5, >= 75% at k = 2). The half of each shape comes from the suite, by shape: "tune" where a layer of the tune
half has it (a rule fitted there saw it), else "held-out" (``kbit.bench.suite.unseen_shapes``). So a run of
``kbit bench --split held-out``, which takes the held-out families' layers, can show "tune" rows: shapes those
families share with a tuned family. Then the points where the dispatcher's time falls as k grows (more than 3%). A
point's rows come from the first file that has them.
"""
from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict

from kbit.bench import report
from kbit.bench import suite as S


def main(paths: list[str]) -> int:
    halves = dict.fromkeys(S.dense_shapes(S.select(split="tune")), "tune")
    halves.update(dict.fromkeys(S.unseen_shapes(), "held-out"))
    pts = defaultdict(dict)  # (k, M, N, K) -> {kernel: row}
    for path in paths:
        _, rows = report.read_results(path)
        ks = sorted({r["k"] for r in rows if r["kernel"] != "bf16"})  # a bf16 row counts for every k of its file
        for r in rows:
            if r.get("E", 1) != 1:
                continue
            for kk in (ks if r["kernel"] == "bf16" else [r["k"]]):
                pts[(kk, r["M"], r["N"], r["K"])].setdefault(r["kernel"], r)
    print("| k | M | half | shapes | kbit >= humming | worst x humming | slower, at >= 0.99x humming's TB/s | "
          "x bf16 median (worst) | M=1 ceiling share >= 100M weights, worst |")
    print("|--:|--:|---|--:|--:|--:|--:|--:|--:|")
    keys = sorted({(k, M) for k, M, _, _ in pts})
    for k, M in keys:
        for half in ("all", "tune", "held-out"):
            sel = [(n, kk_, d) for (kk, m, n, kk_), d in pts.items() if kk == k and m == M and "kbit-linear" in d
                   and (half == "all" or halves.get((n, kk_)) == half)]
            if not sel:
                continue
            hum = [d["humming"]["us"] / d["kbit-linear"]["us"] for _, _, d in sel if "humming" in d]
            bf = [d["bf16"]["us"] / d["kbit-linear"]["us"] for _, _, d in sel if "bf16" in d]
            share = [d["kbit-linear"]["tbps"] / d["kbit-linear"]["ceiling_tbps"] for n, kk_, d in sel
                     if n * kk_ >= 100e6 and d["kbit-linear"].get("tbps") and d["kbit-linear"].get("ceiling_tbps")]
            ok = sum(h >= 1.0 for h in hum)
            slow = [d for _, _, d in sel if "humming" in d and d["humming"]["us"] < d["kbit-linear"]["us"]]
            by_bytes = sum(d["kbit-linear"].get("tbps", 0) >= 0.99 * d["humming"].get("tbps", math.inf) for d in slow)
            cells = [f"{ok} of {len(hum)}" if hum else "-", f"{min(hum):.2f}" if hum else "-",
                     f"{by_bytes} of {len(slow)}" if hum else "-",
                     f"{statistics.median(bf):.2f} ({min(bf):.2f})" if bf else "-",
                     f"{min(share):.0%} ({len(share)} shapes)" if share and M == 1 else "-"]
            print(f"| {k} | {M} | {half} | {len(sel)} | " + " | ".join(cells) + " |")
    falls = not_monotonic(pts)
    n = len({(M, N, K) for M, N, K, *_ in falls})
    print(f"\nTime falls as k grows (by more than {MONO_TOL:.0%}) at {n} (M, shape) points" + (":" if falls else ""))
    for M, N, K, k0, t0, k1, t1 in falls:
        print(f"  M={M} {N}x{K}: k = {k0} {t0:.2f} us > k = {k1} {t1:.2f} us ({t1 / t0:.2f}x)")
    return 0


#: issue 32: "M = 1 time does not decrease as k grows (within 3%)"
MONO_TOL = 0.03


def not_monotonic(pts: dict) -> list[tuple]:
    """(M, N, K, k, us, larger k, its us) wherever the dispatcher took less time at a larger k than at a smaller
    one by more than :data:`MONO_TOL` (points whose k are timed in different files compare across runs)."""
    t = defaultdict(dict)
    for (k, M, N, K), d in pts.items():
        if "kbit-linear" in d:
            t[(M, N, K)][k] = d["kbit-linear"]["us"]
    out = []
    for (M, N, K), by_k in sorted(t.items()):
        ks = sorted(by_k)
        for i, k0 in enumerate(ks):
            for k1 in ks[i + 1:]:
                if by_k[k1] < by_k[k0] * (1 - MONO_TOL):
                    out.append((M, N, K, k0, by_k[k0], k1, by_k[k1]))
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
