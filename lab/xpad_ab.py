"""GPU lab: kernel 3 with x staged in shared memory (``XS``), one source tree per process (PYTHONPATH): times the
dispatcher and a few x-staged configs (and one without, as a control) at M = 1..16 on suite shapes whose x fits,
as ``kbit tune`` times (``kbit.bench.tune.Measure``: cold L2, graphs, output checked). Run once per tree and compare
(lab/rounds/xpad_ab.sh).

    PYTHONPATH=<tree>/src python lab/xpad_ab.py --out $OUT/<tree>.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from kbit.bench.timing import l2_bytes
from kbit.bench.tune import Measure, quantized_weight
from kbit.tuning.mma import MmaConfig
from kbit.tuning.space import Candidate

SHAPES = [(28672, 4096), (9216, 4096), (6144, 4096), (12288, 4096), (35840, 5120), (5120, 2880), (4096, 14336)]
CONFIGS = [MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True), MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True),
           MmaConfig(3, 4, min_ctas=4, ring=2, x_smem=True), MmaConfig(3, 8, min_ctas=2, ring=3, x_smem=True),
           MmaConfig(3, 16, min_ctas=1, ring=2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="4")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import kbit

    dev = torch.device("cuda")
    l2 = l2_bytes(dev)
    res = []
    for k in (int(v) for v in a.k.split(",")):
        for N, K in SHAPES:
            m = Measure(quantized_weight(N, K, k, 0, dev), 15, l2)
            for M in (int(v) for v in a.ms.split(",")):
                row = dict(N=N, K=K, k=k, M=M, dispatcher=m.set_m(M, 0), configs={})
                for c in CONFIGS:
                    name = f"w{c.warps}x{c.min_ctas} r{c.ring}{' xs' if c.x_smem else ''}"
                    try:
                        row["configs"][name] = m(Candidate("mma", c))
                    except Exception as e:  # noqa: BLE001 - one config failing ends only itself
                        row["configs"][name] = None
                        print(f"  {name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                res.append(row)
                print(N, K, k, M, f"{row['dispatcher']:.2f}",
                      " ".join(f"{n}:{v:.2f}" for n, v in row["configs"].items() if v), flush=True)
            del m
            torch.cuda.empty_cache()
            with open(a.out, "w") as f:  # after each shape: a run cut by its timeout keeps what it measured
                json.dump(dict(gpu=torch.cuda.get_device_name(dev), tree=os.path.dirname(kbit.__file__),
                               results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
