"""M = 9..16 on the swap-AB kernels (issue 32): is the second 8-token group's cost a register limit?

Every kernel-3 config of the tuner's space runs 16 warps an SM (128 registers a thread at most); at two token
groups the build keeps a stack frame. This times, at M = 8 and 16 on a few large shapes (k = 4, cold L2, CUDA
graphs: kbit.bench.tune.Measure), the space's best kernel-3 configs beside register-richer ones (8 or 12 warps an
SM) and kernel 1 / 4, and prints their registers (the build's). Run it once per source tree (lab/ab_trees.sh) to
A/B a csrc change in the same call::

    python lab/m16_configs.py [--shapes 65536x5120,35840x5120] [--ms 8,16] [--k 4]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from kbit.bench.tune import Measure, quantized_weight  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.space import Candidate  # noqa: E402

CONFIGS = [
    MmaConfig(3, 16, min_ctas=1, ring=2, x_smem=True),   # the tuned picks at M = 16
    MmaConfig(3, 16, min_ctas=1, ring=2, x_smem=False),
    MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True),
    MmaConfig(3, 8, min_ctas=1, ring=2, x_smem=True),    # 8 warps an SM, up to 255 registers
    MmaConfig(3, 8, min_ctas=1, ring=3, x_smem=True),
    MmaConfig(3, 8, min_ctas=1, ring=4, x_smem=True),
    MmaConfig(3, 12, min_ctas=1, ring=2, x_smem=True),   # 12 warps, up to 168
    MmaConfig(3, 12, min_ctas=1, ring=3, x_smem=True),
    MmaConfig(3, 4, min_ctas=3, ring=2, x_smem=True),    # 12 warps in CTAs of 4
    MmaConfig(3, 4, min_ctas=2, ring=3, x_smem=True),    # 8 warps in CTAs of 4
    MmaConfig(1, 8, min_ctas=1),
    MmaConfig(4, 8, rows_per_warp=1, stages=3),
    MmaConfig(4, 16, rows_per_warp=2, stages=3),
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="65536x5120,35840x5120,9216x4096")
    p.add_argument("--ms", default="8,16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        qw = quantized_weight(N, K, a.k)
        meas = Measure(qw, a.reps, l2)
        for M in (int(v) for v in a.ms.split(",")):
            disp = meas.set_m(M, seed=0)
            print(f"{s} M={M} dispatcher {disp:.2f} us", flush=True)
            for cfg in CONFIGS:
                try:
                    us = meas(Candidate("mma", cfg))
                except Exception as e:  # noqa: BLE001 - a config the plan refuses: reported, the run goes on
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append((s, M, cfg, us, disp))
                print(f"  {us:8.2f} us  {cfg}", flush=True)
        del meas
        torch.cuda.empty_cache()
    print("\n| shape | M | best config | best us | dispatcher us |")
    print("|---|--:|---|--:|--:|")
    for s in a.shapes.split(","):
        for M in (int(v) for v in a.ms.split(",")):
            rs = [r for r in rows if r[0] == s and r[1] == M]
            if rs:
                b = min(rs, key=lambda r: r[3])
                c = b[2]
                print(f"| {s} | {M} | k{c.kernel} w{c.warps} c{c.min_ctas} ring{c.ring} xs{int(c.x_smem)} "
                      f"rt{c.rows_per_warp} | {b[3]:.2f} | {b[4]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
