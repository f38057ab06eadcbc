"""GPU lab: kernel 3 at M = 9..16 with the whole of x staged in shared memory at one CTA an SM. The plan stages x
only below ``XS_MAX`` (110 KB, sized for two CTAs an SM), so at M = 16 and K >= 4096 a 16-warp, one-CTA config reads
x from global memory (its rows at a multiple of 128 bytes: 8-way conflicting B-fragment loads, see
docs/notes/2026-11-28-x-row-pad.md) or, with K slices, stages padded slices. This times, on the same weight: the
config as planned, the same config with ``XS_MAX`` raised to the whole shared memory (x staged, padded), and the
K-slice configs the tuned tables pick there (``kbit.bench.tune.Measure``: cold L2, graphs, output checked).

    PYTHONPATH=src python lab/xs_one_cta.py [--ms 12,16] [--k 4]
"""
from __future__ import annotations

import argparse
import sys

import torch

from kbit.bench.timing import l2_bytes
from kbit.bench.tune import Measure, quantized_weight
from kbit.ops import gemv_mma
from kbit.tuning import mma_plan
from kbit.tuning.mma import MmaConfig
from kbit.tuning.space import Candidate

SHAPES = [(28672, 4096), (12288, 4096), (9216, 4096), (6144, 4096), (4096, 4096), (35840, 5120)]
ONE = [MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True), MmaConfig(3, 16, min_ctas=1, ring=2, x_smem=True),
       MmaConfig(3, 12, min_ctas=1, ring=2, x_smem=True)]
SLICES = [MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=8),
          MmaConfig(3, 12, min_ctas=1, ring=2, x_smem=True, x_slice=8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16")
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    dev = torch.device("cuda")
    l2 = l2_bytes(dev)
    base = mma_plan.XS_MAX
    print("| shape | M | dispatcher | " + " | ".join(f"w{c.warps} r{c.ring} planned | staged" for c in ONE)
          + " | " + " | ".join(f"w{c.warps} r{c.ring} xk{c.x_slice}" for c in SLICES) + " |", flush=True)
    for N, K in SHAPES:
        m = Measure(quantized_weight(N, K, a.k, 0, dev), 15, l2)
        for M in (int(v) for v in a.ms.split(",")):
            cells = [m.set_m(M, 0)]
            for c in ONE:
                for xs_max in (base, mma_plan.SMEM_MAX):
                    mma_plan.XS_MAX = xs_max
                    gemv_mma.PLANS.clear()
                    try:
                        cells.append(m(Candidate("mma", c)))
                    except Exception as e:  # noqa: BLE001 - one config failing ends only itself
                        print(f"  {c} XS_MAX={xs_max}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                        cells.append(float("nan"))
            mma_plan.XS_MAX = base
            gemv_mma.PLANS.clear()
            cells += [m(Candidate("mma", c)) for c in SLICES]
            print(f"| {N}x{K} | {M} | " + " | ".join(f"{v:.2f}" for v in cells) + " |", flush=True)
        del m
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
