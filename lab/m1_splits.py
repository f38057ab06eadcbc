"""M = 1 on a few held-out suite shapes where kernel 1 took twice its bytes' time (5120x8192 k = 4: 23.1 us against
humming's 14.6, ``benchmarks/results/h100/suite-k4-rest-2026-11-27.json``): the dispatcher's pick beside kernel 1 and 3
configs, with their plans' K splits and grids (cold L2, CUDA graphs: ``kbit.bench.tune.Measure``).

    PYTHONPATH=src python lab/m1_splits.py [--shapes 5120x8192,4096x8192,5120x5120] [--k 4]

``--unsplit``: for each kernel-1 config whose plan splits K, also the same config with the plan's K splits forced
to 1 (``kbit.tuning.mma_plan._splits`` patched here), at M = 1 and 4 on the given shapes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from kbit.bench.tune import Measure, quantized_weight  # noqa: E402
from kbit.ops import gemv_mma  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.space import Candidate  # noqa: E402

CONFIGS = [MmaConfig(1, 8, min_ctas=c, grid_ctas=g) for c, g in ((1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2),
                                                                  (4, 0), (4, 2), (4, 3))] + \
          [MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True), MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="5120x8192,4096x8192,5120x5120,7168x5120")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--unsplit", action="store_true")
    a = p.parse_args()
    if a.unsplit:
        return unsplit(a)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    dev = torch.device("cuda")
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        meas = Measure(quantized_weight(N, K, a.k), a.reps, l2)
        disp = meas.set_m(1, seed=0)
        print(f"{s} k={a.k} M=1 dispatcher {disp:.2f} us ({gemv_mma.launch_config(a.k, 1, N, K, dev)})", flush=True)
        for cfg in CONFIGS:
            try:
                plan = gemv_mma.plan_launch(a.k, 1, N, K, "log8", cfg, dev, bf16=True)
                us = meas(Candidate("mma", cfg))
            except Exception as e:  # noqa: BLE001 - a config the plan refuses: reported, the run goes on
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            print(f"  {us:8.2f} us  k{cfg.kernel} w{cfg.warps} c{cfg.min_ctas} g{cfg.grid_ctas} ring{cfg.ring} "
                  f"xs{int(cfg.x_smem)}: grid {plan.grid}, splits {plan.splits}", flush=True)
        del meas
        torch.cuda.empty_cache()
    return 0


def unsplit(a) -> int:
    from kbit.tuning import mma_plan

    real = mma_plan._splits
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    dev = torch.device("cuda")
    rows = []
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        meas = Measure(quantized_weight(N, K, a.k), a.reps, l2)
        for M in (1, 4):
            disp = meas.set_m(M, seed=0)
            for c in (1, 2, 3, 4):
                cfg = MmaConfig(1, 8, min_ctas=c)
                out = []
                for forced in (False, True):
                    mma_plan._splits = (lambda *args, **kw: 1) if forced else real
                    gemv_mma.PLANS.clear()
                    plan = gemv_mma.plan_launch(a.k, M, N, K, "log8", cfg, dev, bf16=True)
                    if forced or plan.splits > 1:
                        out.append((plan.splits, plan.grid, meas(Candidate("mma", cfg))))
                    if not out:
                        break
                mma_plan._splits = real
                gemv_mma.PLANS.clear()
                if len(out) == 2:
                    rows.append((s, M, c, N // 16, *out[0], *out[1], disp))
                    print(f"{s} M={M} k1 w8 c{c} (tiles {N // 16}): splits {out[0][0]} grid {out[0][1]} "
                          f"{out[0][2]:.2f} us; unsplit grid {out[1][1]} {out[1][2]:.2f} us; dispatcher {disp:.2f}",
                          flush=True)
        del meas
        torch.cuda.empty_cache()
    print("\n| shape | M | config | tiles | splits | grid | us | unsplit grid | unsplit us | unsplit / split |")
    print("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|")
    for s, M, c, nt, sp, g, us, _, g1, us1, _d in rows:
        print(f"| {s} | {M} | k1 w8 c{c} | {nt} | {sp} | {g} | {us:.2f} | {g1} | {us1:.2f} | {us1 / us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
