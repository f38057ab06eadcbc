"""Kernel 1's grid at M = 1 (issue 32): CTAs per SM balanced, and K splits chosen for the SMs, against the plan's grid.

    PYTHONPATH=src python lab/k1_grid.py [--shapes 5120x32768,...] [--k 4,2] [--configs 8x2,4x4]

The plan (``kbit.tuning.mma_plan._grid``) gives kernel 1 ``ceil(items / ceil(items / slots))`` CTAs, the same items
each, with ``slots`` = SMs x CTAs an SM. Where that is not a multiple of the SM count, some SMs hold two CTAs and
others one: 5120 rows are 320 tiles, 160 CTAs of two tiles, so 28 SMs stream 4 tiles while the mean is 2.4 (the
2026-11-27 retune's held-out run: 5120x32768 k = 4 took 46.7 us in kernel 1 against 35.8 in kernel 3). Variants,
each timed (cold L2, CUDA graphs: ``kbit.bench.tune.Measure``) for each kernel-1 config:
  plan   the plan as shipped
  bal    the same K splits, ``min(slots, items)`` CTAs (a multiple of the SMs where items >= slots): an SM's items
         differ by at most one
  bal2   two K splits where the plan has one, then as bal
  sm     K splits that fill the SMs evenly (``_splits`` with the SMs as slots, at least 4 segments a split a warp),
         then as bal
Prints us per variant and the dispatcher's time, a short table last.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from kbit.bench.tune import Measure, quantized_weight  # noqa: E402
from kbit.ops import gemv_mma  # noqa: E402
from kbit.tuning import mma_plan  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.space import Candidate  # noqa: E402

REAL = mma_plan._grid
VARIANTS = ("plan", "bal", "bal2", "sm")


def variant_grid(name):
    def grid(st, kernel, build, cfg, k, M, N, K, epi, ng):
        REAL(st, kernel, build, cfg, k, M, N, K, epi, ng)
        if kernel != 1 or name == "plan":
            return
        Nt, S, W, slots, sms = st["Nt"], st["S"], st["W"], st["slots"], st["sms"]
        splits = st["splits"]
        if name == "bal2" and splits == 1:
            splits = 2
        elif name == "sm":
            splits = mma_plan._splits(Nt, S, sms, max(1, S // (4 * W)), divide=False)
        sps = -(-S // splits)
        splits = -(-S // sps)
        st.update(splits=splits, sps=sps, grid=max(1, min(slots, Nt * splits)))
    return grid


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="2880x4096,3584x3584,3584x18944,5120x8192,5120x17408,5120x32768,5376x21504,"
                                       "7168x5120,7168x18432,9216x4096,4096x14336,8192x28672")
    p.add_argument("--k", default="4,2")
    p.add_argument("--configs", default="8x2,4x4")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    dev = torch.device("cuda")
    cfgs = [MmaConfig(1, int(w), min_ctas=int(c)) for w, c in (s.split("x") for s in a.configs.split(","))]
    rows = []
    for k in (int(v) for v in a.k.split(",")):
        for s in a.shapes.split(","):
            N, K = (int(v) for v in s.split("x"))
            meas = Measure(quantized_weight(N, K, k), a.reps, l2)
            disp = meas.set_m(1, seed=0)
            for cfg in cfgs:
                out = {}
                for v in VARIANTS:
                    mma_plan._grid = variant_grid(v)
                    gemv_mma.PLANS.clear()
                    try:
                        plan = gemv_mma.plan_launch(k, 1, N, K, "log8", cfg, dev, bf16=True)
                        out[v] = (plan.splits, plan.grid, meas(Candidate("mma", cfg)))
                    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                        print(f"{s} k={k} {cfg} {v}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    finally:
                        mma_plan._grid = REAL
                        gemv_mma.PLANS.clear()
                line = "  ".join(f"{v} s{sp} g{g} {us:.2f}" for v, (sp, g, us) in out.items())
                print(f"{s} k={k} k1 w{cfg.warps} c{cfg.min_ctas} tiles {-(-N // 16)}: {line}; dispatcher {disp:.2f}",
                      flush=True)
                rows.append((s, k, cfg, out, disp))
            del meas
            torch.cuda.empty_cache()
    print("\n| shape | k | config | " + " | ".join(f"{v} us (splits, grid)" for v in VARIANTS) + " | dispatcher us |")
    print("|---|--:|---|" + "--:|" * (len(VARIANTS) + 1))
    for s, k, cfg, out, disp in rows:
        cells = [f"{out[v][2]:.2f} ({out[v][0]}, {out[v][1]})" if v in out else "-" for v in VARIANTS]
        print(f"| {s} | {k} | k1 w{cfg.warps} c{cfg.min_ctas} | " + " | ".join(cells) + f" | {disp:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
