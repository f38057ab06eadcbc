"""Run a test module's function on several ranks (torch.multiprocessing): gloo ranks forked on the CPU, NCCL ranks
spawned on the GPUs. The function is a module-level function ``fn(rank, world, *args)`` of a test module; each
rank finds it again by module and name."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, init_file, backend, module, name, args):
    torch.set_num_threads(1)  # the ranks share a small CPU
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        getattr(importlib.import_module(module), name)(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(tmp_path, fn, *args, backend: str = "gloo", world: int = 2) -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks of a process group of ``backend``, rendezvous in ``tmp_path``."""
    # fork on the CPU: a spawned rank re-imports torch and kbit, ~10-20 s of a test; CUDA needs spawn
    method = "spawn" if backend == "nccl" else "fork"
    mp.start_processes(_worker, args=(world, str(tmp_path / "rendezvous"), backend, fn.__module__, fn.__name__, args),
                       nprocs=world, join=True, start_method=method)


def device(backend: str) -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
