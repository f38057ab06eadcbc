"""GPU diagnosis: where the time of a mid-M (17..64 tokens) k-bit GEMM on a small weight goes.

For each (shape, M, config): the CUDA-graph time of the call (cold L2, ``mma_lab.time_mma``) and the device time
of each kernel it launches (torch profiler, eager, warm L2, mean of 20 calls), next to bf16 ``F.linear``.

    PYTHONUNBUFFERED=1 python scripts/mid_small_diag.py [--shapes 4096x4096,...] [--ms 32,64] [--cfgs "default;4,8,1,2"]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kbit.ops import gemv_mma as MM  # noqa: E402


def kernel_times(fn, n=20):
    """{kernel name: mean device us a call} of ``fn`` run eagerly ``n`` times (after a warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    tot = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            tot[ev.name[:40]] += ev.device_time / n
    return dict(tot)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1024x4096,4096x4096,6144x4096,14336x4096")
    ap.add_argument("--ms", default="32,64")
    ap.add_argument("--cfgs", default="default;4,8,1,2;1,8,2;1,4,4")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    k, table = a.k, []
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        for M in (int(v) for v in a.ms.split(",")):
            bf = L.time_bf16(N, K, M)
            wb = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            kt = kernel_times(lambda wb=wb, x=x: F.linear(x, wb))
            L.log(f"{N}x{K} M={M} bf16 graph {bf:.1f} us | eager kernels: " +
                  ", ".join(f"{n} {v:.1f}" for n, v in kt.items()))
            rc, rs, ts, cb = L.rand_repacked(N, K, k, 0)
            for c in a.cfgs.split(";"):
                cfg = None if c == "default" else tuple(int(v) for v in c.split(","))
                use = cfg or (MM.large_config(k, M, N, K) if MM.uses_large(M, N, K, x.device) else None)
                try:
                    us, _ = L.time_mma(N, K, k, M, torch.bfloat16, use)
                    y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                    kt = kernel_times(partial(MM._launch, x, rc, rs, ts, cb, None, y, k=k, scale_format="log8", N=N,
                                              K=K, M=M, Kp=K, config=use))
                except Exception as ex:  # noqa: BLE001
                    L.log(f"  {c} failed: {repr(ex)[:200]}")
                    continue
                L.log(f"  {c} ({use}): graph {us:.1f} us ({bf / us:.2f}x) | eager kernels: " +
                      ", ".join(f"{n} {v:.1f}" for n, v in kt.items()))
                table.append((N, K, M, c, bf, us, sum(kt.values())))
            L._COPIES.clear()
            torch.cuda.empty_cache()
    L.log("\n| N x K | M | config | bf16 us | graph us | x bf16 | eager kernel sum us |")
    L.log("|---|--:|---|--:|--:|--:|--:|")
    for N, K, M, c, bf, us, ks in table:
        L.log(f"| {N}x{K} | {M} | {c} | {bf:.1f} | {us:.1f} | {bf / us:.2f} | {ks:.1f} |")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "mid_small_diag.log").write_text("\n".join(L.LOG))


if __name__ == "__main__":
    main()
