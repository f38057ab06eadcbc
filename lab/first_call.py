"""Wall time of a process's first ``KbitLinear`` calls (NVRTC compiles on first use), for the on-disk CUBIN cache.

    python lab/first_call.py [--shape 28672x4096] [--ms 1,16,1024] [--k 4]

Run it twice with the same ``KBIT_CACHE_DIR`` (cold, then warm), and with ``KBIT_CACHE_DIR=0`` (no cache). Prints
one line: the seconds of each M's first call (the weight is quantized and moved to the kernels' layout before
the clock starts), then of a second call at the last M.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from kbit.nn import KbitLinear  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="28672x4096")
    ap.add_argument("--ms", default="1,16,1024")
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    N, K = (int(v) for v in a.shape.split("x"))
    lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda")
    mod = KbitLinear.from_linear(lin, k=a.k)
    mod.repack_for_kernels()
    torch.cuda.synchronize()
    out = []
    for M in [int(v) for v in a.ms.split(",")]:
        x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
        t = time.perf_counter()
        mod(x)
        torch.cuda.synchronize()
        out.append(f"M={M} {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    mod(x)
    torch.cuda.synchronize()
    out.append(f"again {time.perf_counter() - t:.4f} s")
    print(f"KBIT_CACHE_DIR={os.environ.get('KBIT_CACHE_DIR', '(default)')} k={a.k} {N}x{K}: " + ", ".join(out),
          flush=True)


if __name__ == "__main__":
    main()
