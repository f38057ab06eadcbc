"""Expert parallel against one GPU (issue 37's correctness item for an MoE model): a Qwen3-235B-A22B-shaped model
with full-size layers (``--layers`` of them, random k = 4 weights), whole on each GPU and split over the ranks
(q/k/v and o tensor parallel, the MoE blocks expert parallel, ``lm_head`` by vocabulary), both built from the same
weights, also loaded from a sharded checkpoint of them (``kbit.parallel.save_sharded`` / ``load_sharded``).

    torchrun --nproc-per-node 2 lab/parallel/ep_check.py --layers 4 --steps 64
    PYTHONPATH=src torchrun --nproc-per-node 2 lab/parallel/ep_check.py --cpu --layers 2 --steps 8

Prints the logits' difference after one step (max |EP - one GPU| / max |one GPU| over this rank's vocabulary
slice, the larger of the ranks), whether greedy decoding gives the same tokens over ``--steps`` steps (every
sequence of the batch), the share of steps whose token is the same given the one-GPU model's history (teacher
forced: with random weights the best two logits are often closer than bf16 rounding, and one different token
makes every later one differ), and the step times (CUDA graphs) at each batch. The model code is ``big_model.py``'s.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys

import torch
import torch.distributed as dist

from kbit.nn import KbitLinear, KbitMoE
from kbit.parallel import load_sharded, parallelize_kbit, save_sharded, shard_layout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lab/parallel/big_model.py: the model and decoder
from big_model import CPU_SHAPE, PLAN, Model, decode, file_bytes, pick_dir, random_tensor, suite_shape  # noqa: E402
from rank_setup import init_ranks  # this file's folder is on sys.path


def fill_random(model: Model, device) -> None:
    """Random weights, the same on every rank (each tensor seeded by its name; ``big_model.random_tensor``)."""
    stacks = {}
    for name, m in model.named_modules():
        if isinstance(m, KbitLinear):
            stacks[f"{name}.weight"] = (m, "", m.in_features)
        elif isinstance(m, KbitMoE):
            stacks[f"{name}.gate_up"] = (m, "gate_up_", m.hidden_size)
            stacks[f"{name}.down"] = (m, "down_", m.intermediate_size)
            m.router_weight.copy_(random_tensor(f"{name}.router_weight", m.router_weight.dtype,
                                                tuple(m.router_weight.shape), 0, device, True, {}))
    scales = {w: 3.0 * K**-0.5 for w, (_, _, K) in stacks.items()}
    for w, (m, prefix, _) in stacks.items():
        for part in ("codes", "scales", "tensor_scale", "codebook"):
            t = getattr(m, prefix + part)
            t.copy_(random_tensor(f"{w}.{part}", t.dtype, tuple(t.shape), 0, device, True, scales))
    with torch.no_grad():
        model.embed.weight.copy_(random_tensor("embed.weight", model.embed.weight.dtype,
                                               tuple(model.embed.weight.shape), 0, device, True, {}))


def logits_error(ref: Model, other: Model, batch: int, context: int, device) -> float:
    """max |other - ref| / max |ref| of one step's logits (this rank's vocabulary slice), the larger over ranks."""
    start = torch.arange(batch, device=device) * 7 + 1
    with torch.no_grad():
        outs = []
        for m in (ref, other):
            pos = torch.zeros(1, dtype=torch.long, device=device)
            outs.append(m.logits(start.clone(), m.new_caches(batch, context, device), pos).double())
    a = getattr(other.lm_head, "start", 0)
    want = outs[0][:, a:a + outs[1].shape[1]]
    err = torch.tensor([((outs[1] - want).abs().max() / want.abs().max()).item()], device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


def sharded_copy(whole: Model, c: dict, dtype, device, rank: int, world: int) -> tuple[Model, str]:
    """``whole`` saved as a sharded checkpoint (rank 0 writes it) and loaded back, each rank its own file."""
    box = [pick_dir(None, sum(file_bytes(shard_layout(whole, PLAN, world), r) for r in range(world)))
           if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    directory = box[0][0]
    if directory is None:
        raise SystemExit(f"no room for the checkpoint: {box[0][1]}")
    if rank == 0:
        save_sharded(whole, directory, PLAN, world)
    dist.barrier()
    return load_sharded(directory, model=Model(c, dtype), device=device), directory


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the sharded checkpoint round trip")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, a tiny model of the same structure")
    args = p.parse_args()
    rank, world, device, say = init_ranks(args.cpu)
    dtype, c = (torch.float32, dict(CPU_SHAPE)) if args.cpu else (torch.bfloat16, suite_shape())
    c["num_hidden_layers"] = args.layers
    whole = Model(c, dtype, device=device)
    fill_random(whole, device)
    ep = copy.deepcopy(whole)
    parallelize_kbit(ep, PLAN)
    models, directory = {"EP": ep}, None
    try:
        if not args.no_checkpoint:
            models["EP from checkpoint"], directory = sharded_copy(whole, c, dtype, device, rank, world)
        say(f"{args.layers} layers of hidden {c['hidden_size']}, {c['num_experts']} experts, k=4 (Qwen3-235B-A22B's "
            f"shape{', shrunk: --cpu' if args.cpu else ''}), world {world}; one device vs {', '.join(models)}")
        say("\n| batch | model | logits: max abs diff / max abs (one step) | greedy tokens over "
            f"{args.steps} steps | same token, same history | one device ms/step | this ms/step | ratio |"
            "\n|---|---|---|---|---|---|---|---|")
        for batch in args.batches:
            want, t1, mode = decode(whole, batch, args.steps, args.context, device, not args.no_graph, say)
            for name, m in models.items():
                err = logits_error(whole, m, batch, args.context, device)
                got, t2, _ = decode(m, batch, args.steps, args.context, device, not args.no_graph, say)
                same = (got == want).all(dim=1)  # [steps]: every sequence of the batch agrees at that step
                first = int((~same).nonzero()[0]) if not bool(same.all()) else None
                what = "identical" if first is None else f"DIFFER from step {first}"
                forced, _, _ = decode(m, batch, args.steps, args.context, device, not args.no_graph, say, want)
                agree = 100.0 * (forced == want).double().mean().item()
                say(f"| {batch} | {name} | {err:.2e} | {what} | {agree:.1f}% | {1e3 * t1 / args.steps:.2f} | "
                    f"{1e3 * t2 / args.steps:.2f} | {t2 / t1:.2f} |")
        say(f"(steps: {mode}; times of rank 0)")
    finally:
        dist.barrier()
        if rank == 0 and directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
