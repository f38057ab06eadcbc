"""The barrier-free one-shot all-reduce (``kbit.ops.allreduce``, "Lamport" style: the data carries its own arrival
flag) against NCCL and PyTorch's symmetric-memory one-shot, in CUDA graphs, with a bit-for-bit check against NCCL.

    torchrun --nproc-per-node 2 lab/parallel/lamport_ar.py
    torchrun --nproc-per-node 2 lab/parallel/lamport_ar.py --batches 1 16 64 --hidden 4096

PyTorch's one-shot kernel meets its peers twice through signal pads (before loading their buffers and after),
each a round trip over NVLink; the Lamport kernel stores its partial product straight into each peer's buffer and
polls its own (see kbit.kernels.allreduce). The check: varying sizes, -0.0 in the payload, eager calls and replays
of a CUDA graph of several calls, each sum equal to NCCL's.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from rank_setup import init_ranks  # this file's folder is on sys.path

from kbit.ops.allreduce import LamportBuffer, all_reduce_reference, lamport_all_reduce
from kbit.parallel.comm import AllReduceConfig, all_reduce_sum


class LamportAllReduce:
    """``lamport_all_reduce`` on a buffer of ``max_numel`` elements for the default group."""

    def __init__(self, max_numel: int, device):
        self.buffer = LamportBuffer(max_numel, device)
        self.max_n = self.buffer.capacity

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return lamport_all_reduce(y, self.buffer)


def graph_us(fn, calls: int, reps: int) -> float:
    """Median us of one ``fn()``, ``calls`` of them in one CUDA graph; max over ranks."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check(lam: LamportAllReduce, sizes, device) -> bool:
    """Sums of rank-dependent data of varying sizes (eager, then replays of a graph of several calls with new data)
    equal NCCL's bit for bit."""
    ok = True
    for rep in range(3):
        for n in sizes:
            g = torch.Generator(device=device).manual_seed(1000 * dist.get_rank() + n + rep)
            x = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
            x[::7] = -0.0  # payload zeros of both signs
            ok &= torch.equal(lam(x), all_reduce_reference(x))
    xs = [torch.zeros(n, device=device, dtype=torch.bfloat16) for n in sizes]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [lam(x) for x in xs]
    for rep in range(4):
        wants = []
        for x in xs:
            x.copy_(torch.randn(x.numel(), device=device, generator=torch.Generator(device=device).manual_seed(
                7 * rep + x.numel() + 100 * dist.get_rank())).to(torch.bfloat16))
            wants.append(all_reduce_reference(x))
        graph.replay()
        torch.cuda.synchronize()
        ok &= all(torch.equal(o, w) for o, w in zip(outs, wants, strict=True))
    flag = torch.tensor([float(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    rank, world, device, say = init_ranks()
    big = max(args.batches) * args.hidden
    lam = LamportAllReduce(big, device)
    ok = check(lam, [args.hidden, 3 * args.hidden, 100, big, 8], device)
    say("lamport all-reduce: " + ("equal to NCCL (eager and CUDA-graph replays)" if ok else "WRONG: differs from NCCL"))
    one_shot = AllReduceConfig(one_shot_max_bytes=big * 2)
    say(f"\nTP={world}, bf16 [batch, {args.hidden}], us per all-reduce (CUDA graph of {args.calls}, max over ranks)")
    say("| batch | KiB | nccl | one_shot | lamport |\n|---|---|---|---|---|")
    for b in args.batches:
        x = torch.randn(b, args.hidden, device=device).to(torch.bfloat16)
        t_nccl = graph_us(lambda x=x: all_reduce_sum(x.clone(), None, AllReduceConfig()), args.calls, args.reps)
        t_one = graph_us(lambda x=x: all_reduce_sum(x, None, one_shot, "one_shot"), args.calls, args.reps)
        t_lam = graph_us(lambda x=x: lam(x), args.calls, args.reps) if ok else float("nan")
        say(f"| {b} | {b * args.hidden * 2 / 1024:.0f} | {t_nccl:.1f} | {t_one:.1f} | {t_lam:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
