"""GPU lab: M = 1 configs of the small-M kernels (kernel 1 / kernel 3, with and without x in shared memory) on the
N = 8192 / 4096 / 28672 shapes, k = 2, 3, 4, timed as ``pdl_lab`` times (``KBIT_MMA_CFG`` per column).

    PYTHONUNBUFFERED=1 python scripts/m1_cfg_sweep.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import pdl_lab as P  # noqa: E402

from kbit.ops import gemv_mma as MM  # noqa: E402

for N, K in [(8192, 28672), (4096, 14336), (28672, 4096)]:
    for k in (2, 3, 4):
        line = []
        for cfg in ["", "1,4,4", "1,8,2", "3,8,2,2", "3,8,2,3", "3,8,2,2,1", "3,8,2,3,1"]:
            if cfg:
                os.environ["KBIT_MMA_CFG"] = cfg
            else:
                os.environ.pop("KBIT_MMA_CFG", None)
            MM._PLANS.clear()
            try:
                us = P.time_one(N, K, k, 1)
            except Exception as e:  # noqa: BLE001
                us = float("nan")
                print(cfg, repr(e)[:200])
            line.append(f"{cfg or 'default'}: {us:.2f}")
        print(f"k={k} {N}x{K} M=1 | " + " | ".join(line), flush=True)
