"""Where tests/test_layout.py::test_gpu_linear_memory_1x_and_outputs_identical[4] goes over its bound on an H100
(the peak of the first small-M forwards of a repacked KbitLinear, 8192x4096, was ~1.2 MB over held + outputs +
1% of the weight): the peak above the held memory of each M's first forward, alone, with the launch plan it ran.

    PYTHONPATH=src python lab/layout_memory_probe.py
"""
from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops import gemv_mma  # noqa: E402
from kbit.ops.quantize import quantize  # noqa: E402
from kbit.tuning import mma as T  # noqa: E402
from kbit.tuning.tables import gpu_key  # noqa: E402


def alloc() -> int:
    torch.cuda.synchronize()
    gc.collect()
    return torch.cuda.memory_allocated()


def main() -> int:
    N, K = 8192, 4096
    dev = torch.device("cuda")
    for k in (4, 3):
        torch.manual_seed(k)
        qw = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), k=k)
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        q = KbitLinear.from_weight(qw, bias, dtype=torch.bfloat16)
        del qw
        xs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in (1, 4, 16, 64)}
        q(xs[1])
        for M, x in xs.items():
            held = alloc()
            torch.cuda.reset_peak_memory_stats()
            y = q(x)
            peak = torch.cuda.max_memory_allocated() - held - y.numel() * y.element_size()
            after = alloc() - held - y.numel() * y.element_size()
            large = gemv_mma._large_here(k, M, N, K, dev)
            try:
                p = gemv_mma.plan_launch(k, M, N, K, device=dev, bf16=True, config=T.large_config(
                    k, M, N, K, gpu_key(dev)) if large else None)
                plan = (f"kernel {p.kernel} grid {p.grid} splits {p.splits} ws_floats {p.ws_floats} "
                        f"use_ws {p.use_ws} n_cnt {p.n_cnt}")
            except Exception as e:  # noqa: BLE001 - a probe: say what failed and go on
                plan = f"{type(e).__name__}: {e}"
            print(f"k={k} M={M}: peak over held + output {peak} B, kept {after} B; large {large}; {plan}", flush=True)
            del y
        del q, xs
    return 0


if __name__ == "__main__":
    sys.exit(main())
