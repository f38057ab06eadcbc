"""The barrier-free one-shot all-reduce of bf16 decode-sized messages over symmetric memory
(:func:`kbit.kernels.allreduce.lamport_all_reduce_kernel`), and its reference (``torch.distributed.all_reduce``).

:class:`LamportBuffer` holds one process group's receive buffer (``torch.distributed._symmetric_memory``: three
slots of ``world`` regions of ``capacity`` elements, every peer's mapped here) and the kernel's per-program slot
counters; making one is collective (a rendezvous and a barrier), so every rank makes it at the same point, outside
CUDA-graph capture. Its calls must come in the same order with the same sizes on every rank (as any collective's)
and from one stream at a time. Measured on 2 x H200 (benchmarks/results/h200x2/tp-comm-2026-11-26.md): 3.3 us at
8 KiB against NCCL's 8.3 and symmetric-memory one-shot's 7.3, in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:  # a private torch module (absent from builds without distributed support): no buffer can be made then
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:  # pragma: no cover
    symm_mem = None

from kbit.kernels import allreduce as _k
from kbit.ops.pdl import launch_kw
from kbit.utils.checks import check_int, check_tensor, fail

__all__ = ["LamportBuffer", "all_reduce_reference", "lamport_all_reduce"]

#: programs a call (fixed: each keeps its own call counter) and bf16 elements a chunk
PROGRAMS, BLOCK = 16, 2048
#: messages of at most this many bytes are launched with programmatic dependent launch (sm_90). In the TP = 2 decode
#: step of a Llama-3-8B-shaped k = 4 model (2 x H200, lab/parallel/ar_pdl_ab.py) PDL took the step from 1.90 to
#: 1.78 ms at batch 1 (8 KiB messages) and from 2.66 to 2.74 ms at batch 16 (128 KiB): the crossover between was
#: not measured; 16 KiB keeps batch 1 up to hidden 8192
PDL_MAX_BYTES = 16 * 1024
#: loads of one poll before the kernel gives up on a peer: none in practice (hours). A peer may be late by anything
#: (its first call compiles the kernel, its host stalls) and giving up would return a wrong sum; like NCCL's, the
#: wait lasts until the data comes
SPIN_LIMIT = 2**31 - 1


class LamportBuffer:
    """The receive buffer and call state of the barrier-free all-reduce for ``group`` on ``device``: messages of up
    to ``capacity`` bf16 elements. Made collectively (every rank of the group, at the same point)."""

    def __init__(self, capacity: int, device, group=None):
        check_int("capacity", capacity, minimum=1)
        device = torch.device(device)
        if device.type != "cuda" or symm_mem is None:
            fail(ValueError, "device", "a CUDA device with torch.distributed._symmetric_memory", device)
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.capacity = -(-capacity // BLOCK) * BLOCK
        self.buf = symm_mem.empty(3 * self.world * self.capacity, dtype=torch.int16, device=device)
        self.handle = symm_mem.rendezvous(self.buf, self.group.group_name)
        self.buf.fill_(_k.SENTINEL.value)
        self.state = torch.zeros(2 * PROGRAMS, dtype=torch.int32, device=device)  # slots (calls mod 3), last sizes
        torch.cuda.synchronize(device)
        dist.barrier(self.group)  # every buffer holds sentinels before any peer writes into it


def lamport_all_reduce(y: torch.Tensor, buffer: LamportBuffer) -> torch.Tensor:
    """The sum of bf16 ``y`` (contiguous, at most ``buffer.capacity`` elements, on the buffer's device) over the
    buffer's group, as a new tensor. CUDA-graph safe (the call counters live on the device)."""
    check_tensor("y", y, torch.bfloat16, device=buffer.buf.device, contiguous=True)
    if y.numel() > buffer.capacity:
        fail(ValueError, "y", f"at most {buffer.capacity} elements (the buffer's capacity)", y.numel())
    out = torch.empty_like(y)
    if y.numel() == 0:
        return out
    _k.lamport_all_reduce_kernel[(PROGRAMS,)](
        y, buffer.handle.buffer_ptrs_dev, out, buffer.state, y.numel(), buffer.capacity, SPIN_LIMIT,
        rank=buffer.rank, world=buffer.world, P=PROGRAMS, BLOCK=BLOCK, num_warps=8,
        **(launch_kw(y.device) if y.numel() * 2 <= PDL_MAX_BYTES else {"PDL": False}))
    return out


def all_reduce_reference(y: torch.Tensor, group=None) -> torch.Tensor:
    """``torch.distributed.all_reduce`` of a copy of ``y`` (sum): what :func:`lamport_all_reduce` computes."""
    out = y.clone()
    dist.all_reduce(out, group=group)
    return out
