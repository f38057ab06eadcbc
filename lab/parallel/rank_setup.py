"""The process group and device of a lab/parallel script under ``torchrun`` (one host)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def init_ranks(cpu: bool = False):
    """gloo on the CPU, else NCCL with one GPU a rank: ``(rank, world, device, say)``, ``say`` printing on rank 0
    only."""
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    say = print if rank == 0 else (lambda *a, **kw: None)
    return rank, world, device, say
