"""GPU lab: which form of kernel 3's staged x wins on shapes the tuned tables never timed (the held-out half of the
suite): the whole x, K slices, or x from global memory, for one CTA of 16 warps, and the two-CTA config of 8 warps;
beside the dispatcher's choice as shipped. Judges ``kbit.tuning.tuned._x_form`` (a K-slice pick takes the whole x
where it fits). Prints one table row a point: us per form, the dispatcher's, and which the lookup now answers.

    PYTHONPATH=src python lab/xform_ab.py [--ks 3,4] [--ms 12,16] [--min-nk 20000000] [--max-k 6144]
"""
from __future__ import annotations

import argparse
import sys

import torch

from kbit.bench import suite as S
from kbit.bench.timing import l2_bytes
from kbit.bench.tune import Measure, quantized_weight
from kbit.tuning import tuned
from kbit.tuning.mma import MmaConfig
from kbit.tuning.space import Candidate
from kbit.tuning.tables import gpu_key

FORMS = {"whole": MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True),
         "slices": MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=8),
         "global r2": MmaConfig(3, 16, min_ctas=1, ring=2),
         "w8x2 staged": MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True)}


def name(c: Candidate | None) -> str:
    if c is None:
        return "built-in"
    for n, cfg in FORMS.items():
        if c.family == "mma" and c.config == cfg:
            return n
    return str(c.config)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="3,4")
    ap.add_argument("--ms", default="12,16")
    ap.add_argument("--min-nk", type=int, default=20_000_000)
    ap.add_argument("--max-k", type=int, default=6144)
    ap.add_argument("--extra", default="", help="k:M:NxK points to time as well")
    a = ap.parse_args()
    dev = torch.device("cuda")
    gpu = gpu_key(dev)
    l2 = l2_bytes(dev)
    shapes = sorted({(s.N, s.K) for s in S.select(S.load_models(), split="held-out")}, key=lambda s: -s[0] * s[1])
    points = [(k, M, N, K) for N, K in shapes if N * K >= a.min_nk and K <= a.max_k
              for k in map(int, a.ks.split(",")) for M in map(int, a.ms.split(","))]
    for p in filter(None, a.extra.split(",")):
        k, M, s = p.split(":")
        N, K = map(int, s.split("x"))
        points.append((int(k), int(M), N, K))
    print(f"{gpu}: {len(points)} points; us (cold L2, graphs)", flush=True)
    print("| k | M | shape | dispatcher | " + " | ".join(FORMS) + " | lookup answers | best form |", flush=True)
    m, cur = None, None
    for k, M, N, K in sorted(points, key=lambda p: (p[2], p[3], p[0], p[1])):
        if cur != (k, N, K):
            m = None
            torch.cuda.empty_cache()
            m, cur = Measure(quantized_weight(N, K, k, 0, dev), 15, l2), (k, N, K)
        cells = {"dispatcher": m.set_m(M, 0)}
        for n, cfg in FORMS.items():
            try:
                cells[n] = m(Candidate("mma", cfg))
            except Exception as e:  # noqa: BLE001 - one config failing ends only itself
                print(f"  {n} {k} {M} {N}x{K}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                cells[n] = float("nan")
        ans = name(tuned.tuned_candidate(k, M, N, K, gpu))
        best = min(FORMS, key=lambda n: cells[n] if cells[n] == cells[n] else 1e9)
        print(f"| {k} | {M} | {N}x{K} | " + " | ".join(f"{cells[n]:.2f}" for n in ["dispatcher", *FORMS])
              + f" | {ans} | {best} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
