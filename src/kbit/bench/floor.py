"""The read floor of one size: the fastest plain read of ``nbytes`` bytes, timed the way every kernel is.

The read ceiling (:mod:`kbit.bench.ceiling`) is a reduction over 2 GB: the asymptotic bandwidth. A GEMV at
M = 1 reads 10-250 MB once, and a kernel that only streams those bytes (no lookup, no math) already loses
part of the ceiling to its start (launch, the first DRAM round trips) and its tail (the last wave of loads).
``measure_read_floor`` times such kernels on cold-L2 copies of a buffer of exactly ``nbytes`` bytes (several
grid sizes, with and without programmatic dependent launch, and ``x.sum()``), and keeps the fastest: what no
GEMV of that many bytes can beat on this GPU. ``kbit bench --floor`` adds it as a ``read`` row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kbit.bench.timing import Timing, copies_for_cold_l2, l2_bytes, tbps, time_calls
from kbit.cuda import compile_kernel
from kbit.utils.device import sm_count

#: (CTAs an SM, threads a CTA, loads in flight a thread, PDL) tried for every size
VARIANTS = ((1, 1024, 4, 0), (2, 512, 4, 0), (4, 256, 8, 0), (2, 512, 8, 0), (1, 1024, 4, 1), (2, 512, 4, 1),
            (2, 512, 8, 1))


@dataclass(frozen=True)
class ReadFloor:
    """us / read_tbps: the fastest variant for ``nbytes`` bytes; variants: {name: us} of every one tried."""

    us: float
    read_tbps: float
    nbytes: int
    best: str
    timing: Timing
    variants: dict


def measure_read_floor(nbytes: int, reps: int = 15, device: str = "cuda") -> ReadFloor:
    """Times plain reads of ``nbytes`` bytes (rounded up to 16) over cold-L2 copies; returns the fastest."""
    if nbytes < 16:
        raise ValueError(f"nbytes must be >= 16, got {nbytes}")
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    n16 = -(-nbytes // 16)
    n = copies_for_cold_l2(n16 * 16, l2_bytes(dev))
    bufs = [torch.randint(-2**31, 2**31 - 1, (n16 * 4,), dtype=torch.int32, device=dev) for _ in range(n)]
    out = torch.zeros(4, dtype=torch.int32, device=dev)
    sms = sm_count(dev)
    results: dict[str, Timing] = {}
    for ctas, threads, u, pdl in VARIANTS:
        kern = compile_kernel("read.cu", "kbit_read", {"U": u, "PDL": pdl}, dev)
        grid = max(1, min(sms * ctas, -(-n16 // threads)))
        calls = [lambda b=b, kern=kern, grid=grid, threads=threads, pdl=pdl:
                 kern((grid,), threads, "QqQ", b.data_ptr(), n16, out.data_ptr(), pdl=bool(pdl)) for b in bufs]
        results[f"read {ctas}x{threads} U{u}{' pdl' if pdl else ''}"] = time_calls(calls, reps=reps)
    results["x.sum()"] = time_calls([b.sum for b in bufs], reps=reps)
    del bufs
    best = min(results, key=lambda s: results[s].us)
    t = results[best]
    return ReadFloor(us=t.us, read_tbps=tbps(n16 * 16, t.us), nbytes=n16 * 16, best=best, timing=t,
                     variants={s: round(r.us, 3) for s, r in results.items()})
