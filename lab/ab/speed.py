"""M = 1 time of ``KbitLinear`` (the model path) on the README's M = 1 shapes, k = 2..5, for one tree.

CUDA graphs, cold L2 (as many weight copies as make > 8x the L2 size, one call each per replay), the median of
``--reps`` replays; appends one JSON line per point to ``--out``.

    python lab/ab/speed.py --src .ab/old/src --tag old --out $OUT/m1.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import M1_SHAPES, import_kbit  # noqa: E402


def time_point(kbit, N, K, k, reps):
    import torch

    g = torch.Generator(device="cuda").manual_seed(N + K + k)
    W = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    base = kbit.KbitLinear.from_weight(kbit.quantize(W, k=k), None, dtype=torch.bfloat16).cuda()
    del W
    base.repack_for_kernels()
    nbytes = sum(b.numel() * b.element_size() for b in base.buffers())
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    copies = max(2, -(-8 * l2 // nbytes))
    mods = [base] + [_copy(base) for _ in range(copies - 1)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for m in mods:  # compile and warm outside the graph
            m(x)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for m in mods:
                m(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for m in mods:
                m(x)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(mods))
    del graph, mods, base
    torch.cuda.empty_cache()
    return statistics.median(times), nbytes


def _copy(mod):
    import copy

    return copy.deepcopy(mod)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--src", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    kbit = import_kbit(a.src)
    with open(a.out, "a") as f:
        for N, K in M1_SHAPES:
            for k in (2, 3, 4, 5):
                us, nbytes = time_point(kbit, N, K, k, a.reps)
                f.write(json.dumps(dict(tag=a.tag, N=N, K=K, k=k, us=us, bytes=nbytes)) + "\n")
                print(f"{a.tag} {N}x{K} k={k}: {us:.2f} us", flush=True)


if __name__ == "__main__":
    main()
