"""GPU lab: kernel 3 with two 16-row tiles a warp (``rows_per_warp=2``, ``RT2``: each x fragment feeds both tiles'
mmas) against the same kernel a tile a warp and the dispatcher, at M = 1..16 on suite shapes, as ``kbit tune`` times
(``kbit.bench.tune.Measure``: cold L2, graphs, output checked against the dispatcher's). Prints a table per point and
writes the times to ``--out``.

    python lab/rt2_ab.py --out $OUT/rt2.json [--k 4] [--ms 1,8,16] [--shapes 28672x4096,...]

Needs ``RT2``, which is not in the package: apply
``benchmarks/results/h200/m16-x-scale-bounds-2026-11-29/rt2/k3-two-tiles-a-warp.patch`` (on 9bba8fa) first. Measured
there: slower than a tile a warp (README).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kbit.bench.timing import l2_bytes
from kbit.bench.tune import Measure, quantized_weight
from kbit.tuning.mma import MmaConfig
from kbit.tuning.space import Candidate

SHAPES = "28672x4096,100352x5120,4096x12288,7680x5120,6144x4096,5120x25600,65536x5120,4096x4096"
CONFIGS = {
    "w16x1 r3 xs": MmaConfig(3, 16, 1, ring=3, x_smem=True),
    "w8x2 r2 xs": MmaConfig(3, 8, 2, ring=2, x_smem=True),
    "w8x2 r2": MmaConfig(3, 8, 2, ring=2),
    "RT2 w16x1 r2 xs": MmaConfig(3, 16, 1, ring=2, x_smem=True, rows_per_warp=2),
    "RT2 w16x1 r2": MmaConfig(3, 16, 1, ring=2, rows_per_warp=2),
    "RT2 w8x2 r2 xs": MmaConfig(3, 8, 2, ring=2, x_smem=True, rows_per_warp=2),
    "RT2 w8x2 r2": MmaConfig(3, 8, 2, ring=2, rows_per_warp=2),
}
#: the first run's RT2 configs (one CTA of 8 warps or two of 4 an SM, 255 registers), 1.3-1.9x slower below
#: ~300M weights: "RT2 w8x1 r2 xs" (3, 8, 1, ring=2, x_smem, rows_per_warp=2), "w8x1 r3 xs", "w4x2 r3 xs",
#: "w4x2 r2 xs", "w8x1 r2"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="4")
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    l2 = l2_bytes(dev)
    t0, res = time.time(), []
    for k in (int(v) for v in a.k.split(",")):
        for shape in a.shapes.split(","):
            if time.time() - t0 > a.budget_s:
                break
            N, K = (int(v) for v in shape.split("x"))
            m = Measure(quantized_weight(N, K, k, 0, dev), 15, l2)
            for M in (int(v) for v in a.ms.split(",")):
                row = dict(N=N, K=K, k=k, M=M, dispatcher=m.set_m(M, 0), configs={})
                for name, c in CONFIGS.items():
                    try:
                        row["configs"][name] = m(Candidate("mma", c))
                    except Exception as e:  # noqa: BLE001 - one config failing ends only itself
                        row["configs"][name] = None
                        print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                res.append(row)
                ok = [v for v in row["configs"].values() if v]
                rt1 = min([v for n, v in row["configs"].items() if v and not n.startswith("RT2")] or [0])
                rt2 = min([v for n, v in row["configs"].items() if v and n.startswith("RT2")] or [0])
                print(f"{N}x{K} k={k} M={M} dispatcher {row['dispatcher']:.2f} best RT1 {rt1:.2f} best RT2 {rt2:.2f} "
                      f"({rt2 / min(rt1 or 1e9, row['dispatcher']):.3f}) | "
                      + " ".join(f"{n}:{v:.2f}" for n, v in row["configs"].items() if v), flush=True)
                del ok
            del m
            torch.cuda.empty_cache()
            with open(a.out, "w") as f:  # after each shape: a run cut by its timeout keeps what it measured
                json.dump(dict(gpu=torch.cuda.get_device_name(dev), results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
