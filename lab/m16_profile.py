"""A small driver for ncu: the dispatcher's launch of M rows on a random k-bit weight in layout "mma-v1"
(``kbit.ops.gemv_mma.linear_repacked``, the path of a repacked ``KbitLinear``), a few eager calls per M, each M's
kernel named in the output, so that one ncu run profiles M = 1 / 8 / 16 side by side (what bounds M = 2..16 when
fewer instructions a weight did not make it faster: benchmarks/results/h200/m16-ab-2026-11-26.md). Needs a GPU::

    python lab/m16_profile.py [--shape 65536x5120] [--k 4] [--ms 1,8,16] [--calls 3]
    ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -k regex:kbit_gemv_mma \\
        -o m16 python lab/m16_profile.py --calls 1
    (two profiled launches a M, in the order of --ms; kernel 7, kbit_wgmma, is not matched)
    (source counters: ncu --set full ... -o m16s; ncu -i m16s.ncu-rep --page source --csv --print-source sass
     > m16s.csv; python lab/ncu_top.py m16s.csv)

Without ncu it prints each M's plan (kernel, defines, grid) and its eager time from CUDA events (warm L2: not the
harness's number).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from kbit.ops import gemv_mma as MM  # noqa: E402
from kbit.tuning.mma import MAX_M  # noqa: E402

_KEYS = ("NG", "MAXW", "MINB", "PD", "XS", "XK", "CAU", "LFX", "WS4", "K1WO", "D", "SK")


def rand_repacked(N, K, k, dev, seed=0):
    """Random codes and log8 scales directly in layout "mma-v1" (timing and profiling only)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    nt, s = -(-N // 16), -(-K // 256)
    rc = torch.randint(-(2**31), 2**31 - 1, (nt, s, k, 32, 4), generator=g, dtype=torch.int32, device=dev)
    rs = torch.randint(0, 64, (nt, s, 8, 16), generator=g, dtype=torch.uint8, device=dev)
    ts = torch.rand((), generator=g, device=dev) + 0.5
    cb = torch.sort(torch.rand(2**k, generator=g, device=dev) * 2 - 1).values
    return rc, rs, ts, cb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="65536x5120")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--calls", type=int, default=3, help="eager calls a M (the first one compiles)")
    a = ap.parse_args(argv)
    N, K = (int(v) for v in a.shape.split("x"))
    dev = torch.device("cuda", torch.cuda.current_device())
    rc, rs, ts, cb = rand_repacked(N, K, a.k, dev)
    for M in (int(m) for m in a.ms.split(",")):
        x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
        if M <= MAX_M and not MM._large_here(a.k, M, N, K, dev):
            p = MM.plan_launch(a.k, M, N, K)
            plan = f"kernel {p.kernel} " + ",".join(f"{n}={p.defines[n]}" for n in _KEYS if p.defines.get(n)) + \
                f" grid {p.grid} warps {p.warps} regs {p.regs} shared {p.shared}"
        else:
            plan = "kernel 7 (x tiles first)"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        MM.linear_repacked(x, rc, rs, ts, cb, k=a.k, N=N, K=K)  # compiles
        torch.cuda.synchronize()
        start.record()
        for _ in range(a.calls):
            MM.linear_repacked(x, rc, rs, ts, cb, k=a.k, N=N, K=K)
        end.record()
        torch.cuda.synchronize()
        print(f"{a.shape} k={a.k} M={M}: {plan} | eager {start.elapsed_time(end) * 1e3 / a.calls:.1f} us a call",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
