"""The device-memory read ceiling, measured the way every kernel is timed.

A GEMV at small M reads each weight byte once and does little else, so its floor is ``bytes / read
bandwidth``. The datasheet number (3.35 TB/s on an H100 SXM) is not reachable; what a plain reduction over
a buffer far larger than the L2 achieves is the honest ceiling, and every row reports its TB/s against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kbit.bench.timing import Timing, tbps, time_calls

CEILING_BYTES = 2 * 1024**3  # the issue asks for a reduction over >= 2 GB
CALLS = 3                    # reductions per replay, all over the same buffer (it is >> 8 x L2 by itself)


@dataclass(frozen=True)
class Ceiling:
    """read_tbps: TB/s of ``x.sum()`` over ``nbytes`` bytes of bfloat16; timing: how it was measured."""

    read_tbps: float
    nbytes: int
    timing: Timing


def measure_read_ceiling(nbytes: int = CEILING_BYTES, reps: int = 15, device: str = "cuda") -> Ceiling:
    """Times ``x.sum()`` over a ``nbytes``-byte bfloat16 tensor of random values (CUDA-graph replay)."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    timing = time_calls([x.sum] * CALLS, reps=reps)
    nb = x.numel() * x.element_size()
    del x
    torch.cuda.empty_cache()
    return Ceiling(read_tbps=tbps(nb, timing.us), nbytes=nb, timing=timing)
