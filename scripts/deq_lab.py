"""GPU lab: the dequantize + cuBLAS route of large M, by parts (session 16). For each shape and M: bf16
``F.linear``; the canonical dequantize alone; :func:`unrepack` alone; ``dequant_repacked`` (layout "mma-v1" straight to
bf16) alone; and the routes a layer takes: canonical ``dequant_mm``, repacked before (unrepack + dequant_mm) and
now (``linear_mma_v1``: dequant_repacked + F.linear). Cold L2 (weight copies > 8x L2), CUDA graphs, median of 15.

    PYTHONUNBUFFERED=1 python scripts/deq_lab.py [--shapes 28672x4096,...] [--ms 256,4096] [--ks 4,2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402
from kbit.ops.dequant import dequantize_tensors  # noqa: E402
from kbit.ops.gemm import dequant_mm  # noqa: E402


def weight(N, K, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(-(2**31), 2**31 - 1, (N, K * k // 32), generator=g, dtype=torch.int32, device="cuda")
    scales = torch.randint(0, 64, (N, K // 32), generator=g, dtype=torch.uint8, device="cuda")
    ts = torch.ones((), device="cuda") / K**0.5
    cb = torch.linspace(-1, 1, 2**k, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K)
    rc, rs = MM.repack(codes, scales, **kw)
    return codes, scales, rc, rs, ts, cb, kw


COLS = ["bf16", "deq", "unrepack", "deq_rep", "dequant_mm", "before", "now"]
#: --split: where dequantize + cuBLAS loses its time. gemm_wd: F.linear on the dequantized weight, made beforehand;
#: deq+gemm_wd: a dequantize whose result is dropped, then that same F.linear; deq_own: dequantize, then F.linear on
#: its result (= dequant_mm's two kernels); deq_into: the same into a buffer allocated beforehand
SPLIT_COLS = ["bf16", "gemm_wd", "deq", "deq+gemm_wd", "deq_own", "deq_into"]


def routes(x, w, wb, k, N, K, split):
    """The timed calls of one weight copy: column -> callable (``split``: the SPLIT_COLS ones, which hold two more
    [N, K] weights a copy)."""
    codes, scales, rc, rs, ts, cb, kw = w

    def deq(out=None):
        return dequantize_tensors(codes, scales, ts, cb, k=k, blocksize=32, scale_format="log8", shape=(N, K),
                                  dtype=x.dtype, out=out)

    def before():
        c, s = MM.unrepack(rc, rs, k=k, blocksize=32, N=N, K=K)
        return dequant_mm(x, c, s, ts, cb, **kw)

    calls = {
        "bf16": lambda: F.linear(x, wb),
        "deq": deq,
        "unrepack": lambda: MM.unrepack(rc, rs, k=k, blocksize=32, N=N, K=K),
        "deq_rep": lambda: MM.dequant_repacked(rc, rs, ts, cb, dtype=x.dtype, **kw),
        "dequant_mm": lambda: dequant_mm(x, codes, scales, ts, cb, **kw),
        "before": before,
        "now": lambda: MM.linear_mma_v1(x, rc, rs, ts, cb, **kw),
    }
    if split:
        wd = deq()
        buf = torch.empty_like(wd)
        calls.update({
            "gemm_wd": lambda: F.linear(x, wd),
            "deq+gemm_wd": lambda: (deq(), F.linear(x, wd)),
            "deq_own": lambda: F.linear(x, deq()),
            "deq_into": lambda: F.linear(x, deq(buf)),
        })
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x4096,4096x14336,4096x4096")
    ap.add_argument("--ms", default="256,4096")
    ap.add_argument("--ks", default="4,2")
    ap.add_argument("--split", action="store_true", help="the SPLIT_COLS columns instead")
    args = ap.parse_args()
    cols = SPLIT_COLS if args.split else COLS
    print("| k | shape | M | " + " | ".join(cols) + " |  (us)")
    print("|---|---|--:|" + "--:|" * len(cols))
    for s in args.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        for k in (int(v) for v in args.ks.split(",")):
            n = copies_for_cold_l2(N * K * 2, l2_bytes())
            ws = [weight(N, K, k, i) for i in range(n)]
            wb = [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") / K**0.5 for _ in range(n)]
            for M in (int(v) for v in args.ms.split(",")):
                x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                calls = [routes(x, w, b, k, N, K, args.split) for w, b in zip(ws, wb, strict=True)]
                row = [f"{time_calls([c[col] for c in calls]).us:.1f}" for col in cols]
                print(f"| {k} | {N}x{K} | {M} | " + " | ".join(row) + " |", flush=True)
            ws.clear()
            wb.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
