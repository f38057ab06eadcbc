"""CPU lab: a ``KbitLinear`` forward on the CPU against ``nn.Linear`` in float32 (issue 33, item 5: the CPU path no
slower than plain float32), with the dequantized weight kept (``cache_cpu_weight``, the default) and without.

Shapes are SmolLM2-135M's projections (hidden 576, MLP 1536) and one larger; M = 1 (a decode step) and M = 16.
``nn.Linear`` and the kept weight run interleaved, one call each in turn, so load from other processes hits both
alike (the variant without the kept weight runs apart: its temporaries would evict their weights from the caches);
the median of the per-call times is printed (microseconds), with the ratio to ``nn.Linear``.

    PYTHONPATH=src python lab/cpu_linear_speed.py [--reps 300] [--threads N]
"""
import argparse
import statistics
import time

import torch
from torch import nn

from kbit.nn import KbitLinear


def bench(fns: dict, x, reps: int) -> dict:
    times = {n: [] for n in fns}
    with torch.no_grad():
        for f in fns.values():  # warm-up (fills the kept weight)
            f(x)
        for _ in range(reps):
            for n, f in fns.items():
                t = time.perf_counter()
                f(x)
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) * 1e6 for n, v in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'K x N':>12} {'M':>3} {'nn.Linear':>10} {'kept':>10} {'ratio':>6} {'not kept':>10} {'ratio':>6}")
    for K, N in ((576, 1536), (1536, 576), (576, 576), (2048, 8192)):
        torch.manual_seed(0)
        lin = nn.Linear(K, N)
        kept = KbitLinear.from_linear(lin, k=4)
        fresh = KbitLinear.from_linear(lin, k=4)
        fresh.cache_cpu_weight = False
        for M in (1, 16):
            x = torch.randn(M, K)
            reps = a.reps if K * N < 4e6 else a.reps // 10
            r = bench({"linear": lin, "kept": kept}, x, reps)  # the pair compared: interleaved
            r |= bench({"fresh": fresh}, x, max(3, reps // 20))  # apart: its temporaries would evict the others
            print(f"{K:>5} x {N:<5} {M:>3} {r['linear']:>10.1f} {r['kept']:>10.1f} {r['kept'] / r['linear']:>6.2f} "
                  f"{r['fresh']:>10.1f} {r['fresh'] / r['linear']:>6.2f}")


if __name__ == "__main__":
    main()
