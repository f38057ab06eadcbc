"""A/B of programmatic dependent launch on the barrier-free all-reduce (kbit.ops.allreduce) in the TP decode step of
benchmarks/bench_tp.py's Llama-3-8B-shaped k-bit model: the same TP model timed with the all-reduce launched with
PDL (the package's default on sm_90) and without, alternating, in one process.

    torchrun --nproc-per-node 2 lab/parallel/ar_pdl_ab.py [--batch 1,16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_e2e import build_kbit, configs, with_layers  # noqa: E402
from bench_tp import PLAN, timed  # noqa: E402

import kbit.ops.allreduce as ar  # noqa: E402
from kbit.parallel import parallelize_kbit  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = build_kbit(with_layers(configs()["llama3-8b"], args.layers), device, 4, fuse_proj=True)
    parallelize_kbit(model, PLAN)
    with_pdl = ar.launch_kw
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        for r in range(args.rounds):
            for label, kw in (("pdl", with_pdl), ("no pdl", lambda device: {"PDL": False})):
                ar.launch_kw = kw
                rows.append((b, r, label, timed(model, b, args)["ms_per_step"]))
    ar.launch_kw = with_pdl
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}: TP decode step ms, all-reduce with / without PDL")
        print("| batch | round | all-reduce launch | ms/step |\n|---|---|---|---|")
        for b, r, label, ms in rows:
            print(f"| {b} | {r} | {label} | {ms:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
