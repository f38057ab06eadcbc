"""GPU lab: the host (CPU) cost of one ``KbitLinear`` call at M = 1 outside CUDA graphs, against a bare launch of
the same kernel (issue 4: at most 5 us more), and a captured graph's replay against eager output.

Each variant is called N times back to back without synchronising, then the device is synchronised once; the
time per call is the host's, as long as it exceeds the kernel's device time (printed beside it from the graph
harness: small weights, so the loop is host-bound). Median of 7 repetitions.

Variants: ``torch.add`` (a one-kernel torch op, for scale); ``bare`` = ``gemv_mma._launch`` (the plan cached,
output preallocated: argument packing + ``cuLaunchKernelEx``); ``prepared`` = the launcher of
``gemv_mma.prepare_repacked`` (arguments packed once; allocates y); ``repacked`` = ``gemv_mma.linear_repacked`` (checks,
output allocation); ``op`` = ``torch.ops.kbit.linear_mma_v1`` (the torch.library op, as torch.compile calls it);
``module`` = ``KbitLinear.__call__``.

    PYTHONUNBUFFERED=1 python lab/linear_overhead.py [--shapes 512x512,...] [--out DIR]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from kbit.bench.timing import capture, time_calls  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402

LINES: list = []


def log(s=""):
    print(s, flush=True)
    LINES.append(s)


def host_us(fn, n=3000, reps=7):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def one(N, K, k, dt):
    torch.manual_seed(N + K)
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=dt)
    q = KbitLinear.from_linear(lin, k=k).repack_for_kernels()
    x = torch.randn(1, K, device="cuda", dtype=dt)
    y = torch.empty(1, N, device="cuda", dtype=dt)
    z = torch.empty_like(x)
    parts = (q.codes, q.scales, q.tensor_scale, q.codebook)
    fmt = dict(k=q.k, blocksize=q.blocksize, scale_format=q.scale_format, N=N, K=K)
    q(x)  # plan + compile

    run = MM.prepare_repacked(x, *parts, bias=None, **fmt)

    def bare():
        MM._launch(x, *parts, None, y, k=q.k, scale_format=q.scale_format, N=N, K=K, M=1, Kp=K)

    res = {
        "torch.add": host_us(lambda: torch.add(x, 1.0, out=z)),
        "bare": host_us(bare),
        "prepared": host_us(lambda: run(x)),
        "repacked": host_us(lambda: MM.linear_repacked(x, *parts, bias=None, **fmt)),
        "op": host_us(lambda: torch.ops.kbit.linear_mma_v1(x, *parts, q.k, q.blocksize, q.scale_format, N, K, None)),
        "module": host_us(lambda: q(x)),
    }
    dev = time_calls([lambda: q(x)]).us
    xs = torch.randn(3, 1, K, device="cuda", dtype=dt)
    eager = [q(xs[i]).clone() for i in range(3)]
    static_x = xs[0].clone()
    graph, static_y = capture(lambda: q(static_x))
    # kernel 1's in-CTA sums are not bit-stable run to run (det-probe-2026-11-22.log): a difference, not a bool
    diff = 0.0
    for i in range(3):
        static_x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        diff = max(diff, (static_y.float() - eager[i].float()).abs().max().item())
    log(f"| {N}x{K} | {dev:.2f} | " + " | ".join(f"{v:.2f}" for v in res.values())
        + f" | {res['module'] - res['bare']:.2f} | {diff:.2g} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512x512,1024x1024,4096x4096")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    dt = torch.bfloat16
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call (median of 7 x 3000), k = "
        f"{args.k}, M = 1, {dt}")
    log("| N x K | device us (graph) | torch.add | bare launch | prepared | repacked | op | module | module - bare | "
        "max abs(graph - eager) |")
    log("|---|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for s in args.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        one(N, K, args.k, dt)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "linear_overhead.log").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
