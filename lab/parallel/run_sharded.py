"""Greedy decoding of a kbit checkpoint folder split over the ranks (tensor parallel), checked against the same
model on one device.

    torchrun --nproc-per-node 2 lab/parallel/run_sharded.py out-dir --prompt-ids 1 2 3 --steps 64
    PYTHONPATH=src torchrun --nproc-per-node 2 lab/parallel/run_sharded.py out-dir --cpu --steps 8

Each rank loads the packed checkpoint on the CPU (``kbit.load_quantized``), keeps its shards
(``kbit.parallel.parallelize_kbit`` with the model's ``base_model_tp_plan``, else ``LLAMA_PLAN``) and moves the
model to its GPU. ``--shards DIR``: rank 0 first writes the sharded checkpoint there if it is not there yet
(``kbit.parallel.save_sharded``), then each rank builds the model from the folder's config alone
(``kbit.hf.empty_quantized``) and reads only its own file (``kbit.parallel.load_sharded``). ``--check`` (default
on) also decodes with a whole copy on rank's device and compares the tokens.
transformers' ``generate`` with its dynamic cache runs the step (the cache holds this rank's KV heads).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from rank_setup import init_ranks  # this file's folder is on sys.path

import kbit
from kbit.hf import empty_quantized
from kbit.parallel import (
    LLAMA_PLAN,
    ColumnParallelKbitLinear,
    RowParallelKbitLinear,
    load_sharded,
    parallelize_kbit,
    save_sharded,
)


def greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)[:, ids.shape[1]:]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a folder written by kbit.save_quantized / kbit quantize")
    p.add_argument("--prompt-ids", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    p.add_argument("--no-check", action="store_true", help="skip decoding with a whole copy")
    p.add_argument("--shards", default=None, help="a sharded checkpoint folder (written from CHECKPOINT if absent)")
    args = p.parse_args()
    rank, world, device, _ = init_ranks(args.cpu)
    if args.shards:
        skeleton = empty_quantized(args.checkpoint)
        plan = getattr(skeleton.config, "base_model_tp_plan", None) or LLAMA_PLAN
        if rank == 0 and not os.path.exists(os.path.join(args.shards, "kbit-sharded.json")):
            save_sharded(kbit.load_quantized(args.checkpoint, device="cpu"), args.shards, plan, world)
        dist.barrier()
        model = load_sharded(args.shards, model=skeleton, device=device)
        replaced = [n for n, m in model.named_modules() if isinstance(m, (ColumnParallelKbitLinear,
                                                                          RowParallelKbitLinear))]
        whole = None if args.no_check else kbit.load_quantized(args.checkpoint, device=device)
    else:
        model = kbit.load_quantized(args.checkpoint, device="cpu")  # packed weights only, no float copy
        whole = None if args.no_check else copy.deepcopy(model).to(device)
        plan = getattr(model.config, "base_model_tp_plan", None) or LLAMA_PLAN
        replaced = parallelize_kbit(model, plan)
        model.to(device)
    held = sum(b.numel() * b.element_size() for b in model.buffers()) / 2**20
    ids = torch.tensor([args.prompt_ids], device=device)
    tokens = greedy(model, ids, args.steps)
    if rank == 0:
        print(f"TP={world}: {len(replaced)} layers sharded, rank 0 holds {held:.1f} MiB of buffers")
        print("tokens:", tokens[0].tolist())
    if whole is not None:
        want = greedy(whole, ids, args.steps)
        same = torch.equal(tokens, want)
        if rank == 0:
            print("identical to one device" if same else f"DIFFERENT from one device: {want[0].tolist()}")
        if not same:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
