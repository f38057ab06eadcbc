"""GPU lab: kernel 3 / the dispatcher on the same shapes with log8 block scales (a shared-memory table lookup a
scale in the kernels) against fp16 block scales (a conversion in registers, one byte more a block), at M = 1..16,
as ``kbit tune`` times (``kbit.bench.tune.Measure``: cold L2, graphs). The dispatcher's pick and a few pinned
kernel-3 configs, per format; prints fp16 / log8 per point and writes the times to ``--out``.

    python lab/scale_form_ab.py --out $OUT/scale-form.json [--k 4] [--ms 1,8,16] [--shapes 28672x4096,...]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from kbit.bench.timing import l2_bytes
from kbit.bench.tune import Measure, quantized_weight
from kbit.tuning.mma import MmaConfig
from kbit.tuning.space import Candidate

SHAPES = "28672x4096,100352x5120,4096x12288,7680x5120,6144x4096,65536x5120,4096x4096"
CONFIGS = {"w16x1 r3 xs": MmaConfig(3, 16, 1, ring=3, x_smem=True),
           "w8x2 r2 xs": MmaConfig(3, 8, 2, ring=2, x_smem=True), "w8x2 r2": MmaConfig(3, 8, 2, ring=2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="4")
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    l2 = l2_bytes(dev)
    res = []
    for k in (int(v) for v in a.k.split(",")):
        for shape in a.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            ms = {f: Measure(quantized_weight(N, K, k, 0, dev, scale_format=f), 15, l2) for f in ("log8", "fp16")}
            for M in (int(v) for v in a.ms.split(",")):
                row = dict(N=N, K=K, k=k, M=M, times={})
                for f, m in ms.items():
                    t = row["times"][f] = {"dispatcher": m.set_m(M, 0)}
                    for name, c in CONFIGS.items():
                        try:
                            t[name] = m(Candidate("mma", c))
                        except Exception as e:  # noqa: BLE001 - one config failing ends only itself
                            t[name] = None
                            print(f"  {f} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                res.append(row)
                lo, fp = row["times"]["log8"], row["times"]["fp16"]
                print(f"{N}x{K} k={k} M={M} log8 {lo['dispatcher']:.2f} fp16 {fp['dispatcher']:.2f} | "
                      + " ".join(f"{n} {fp[n] / lo[n]:.3f}" for n in lo if lo[n] and fp[n]), flush=True)
            del ms
            torch.cuda.empty_cache()
            with open(a.out, "w") as f:  # after each shape: a run cut by its timeout keeps what it measured
                json.dump(dict(gpu=torch.cuda.get_device_name(dev), results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
