"""k-bit GEMV time of the Llama-3-8B layers on one GPU against their TP = 2 shards: does half the weight take half
the time? One GPU, no torch.distributed.

    PYTHONPATH=src python lab/parallel/shard_gemv.py
    PYTHONPATH=src python lab/parallel/shard_gemv.py --k 4 --batches 1 16 64

Each layer is timed as ``KbitLinear`` forwards in a CUDA graph that cycles over copies of the weight totalling more
than 200 MB, so every call reads its weight from HBM as a decode step does (a shard of a few MB would otherwise
stay in L2). Printed per shape and batch: us a call, the weight's GB/s, the kernel the dispatcher chose; per layer
the shard / whole time ratio (0.5 is perfect scaling); per batch the sum over a block's four layers.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kbit
from kbit.dispatch.linear import choice
from kbit.nn import KbitLinear

#: (layer, whole [N, K], TP = 2 shard [N, K]) of Llama-3-8B with q/k/v and gate/up packed
LAYERS = [("qkv", (6144, 4096), (3072, 4096)), ("o", (4096, 4096), (4096, 2048)),
          ("gate_up", (28672, 4096), (14336, 4096)), ("down", (4096, 14336), (4096, 7168))]


def layer_us(N: int, K: int, k: int, batch: int, calls: int = 40, reps: int = 15) -> tuple[float, float, str]:
    """(us a call, weight GB/s, the dispatcher's choice) of a k-bit [N, K] layer at ``batch`` rows."""
    def layer():
        qw = kbit.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5, k=k, blocksize=32)
        return KbitLinear.from_weight(qw, None, torch.bfloat16)

    layers = [layer()]
    nbytes = sum(b.numel() * b.element_size() for b in layers[0].buffers())
    layers += [layer() for _ in range(max(1, -(-200 * 2**20 // nbytes)) - 1)]
    copies = len(layers)
    x = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16)
    for lin in layers:  # eager first: kernels compile, layers repack to their kernel layout
        lin(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            layers[i % copies](x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    us = statistics.median(times)
    what = choice(batch, N, K, k, x.device)
    return us, nbytes / us / 1e3, what.kernel


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, k={args.k}: k-bit GEMV of whole layers and their TP=2 shards")
    print("| batch | layer | whole N x K | us | GB/s | kernel | shard N x K | us | GB/s | kernel | shard / whole |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sums = []
    for batch in args.batches:
        tw = ts = 0.0
        for name, (N, K), (n, kk) in LAYERS:
            uw, bw, cw = layer_us(N, K, args.k, batch)
            us, bs, cs = layer_us(n, kk, args.k, batch)
            tw, ts = tw + uw, ts + us
            print(f"| {batch} | {name} | {N} x {K} | {uw:.1f} | {bw:.0f} | {cw} | {n} x {kk} | {us:.1f} | {bs:.0f} | "
                  f"{cs} | {us / uw:.2f} |")
        sums.append((batch, tw, ts))
    print("\n| batch | whole block's 4 GEMVs us | shard's us | shard / whole |\n|---|---|---|---|")
    for batch, tw, ts in sums:
        print(f"| {batch} | {tw:.1f} | {ts:.1f} | {ts / tw:.2f} |")


if __name__ == "__main__":
    main()
