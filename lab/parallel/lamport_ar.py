"""Experiment: a barrier-free one-shot all-reduce for decode-sized messages ("Lamport" style: the data carries its
own arrival flag), against NCCL and PyTorch's symmetric-memory one-shot, in CUDA graphs.

    torchrun --nproc-per-node 2 lab/parallel/lamport_ar.py
    torchrun --nproc-per-node 2 lab/parallel/lamport_ar.py --batches 1 16 64 --hidden 4096

PyTorch's one-shot kernel meets its peers twice through signal pads (before loading their buffers and after),
each a round trip over NVLink. Here every rank stores its partial product straight into each peer's buffer
(remote stores) and polls its own buffer until no element still holds the sentinel (bf16 -0.0; a payload's -0.0
is sent as +0.0, the same number), sums, and clears the slot of the call before for reuse. Three slots in turn:
during call c a peer may write slots c and c + 1 of this rank's buffer, never c - 1 (it needs this rank's
data of c + 1 first), so that one is cleared. Each of the P programs keeps its own call counter and last size in
device memory, so CUDA-graph replays go on counting. Every poll is bounded (``SPIN_LIMIT``): a broken protocol
prints WRONG, not a hang.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kbit.parallel.comm import AllReduceConfig, all_reduce_sum

SENTINEL = tl.constexpr(-32768)  # bf16 -0.0 as int16 bits
SPIN_LIMIT = 1 << 18
PROGRAMS, BLOCK = 16, 2048  # programs a call (fixed: their counters must advance together), elements a chunk


@triton.jit
def _lamport(x, bufs, out, state, n, max_n, limit, rank: tl.constexpr, world: tl.constexpr, P: tl.constexpr,
             BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    call = tl.load(state + pid)
    prev_n = tl.load(state + P + pid)
    slot = call % 3
    old = (call + 2) % 3  # the slot of the call before: no peer writes it now
    ptrs = bufs.to(tl.pointer_type(tl.uint64))
    mine = tl.multiple_of(tl.load(ptrs + rank).to(tl.pointer_type(tl.int16)), 16)
    offs = tl.arange(0, BLOCK)
    # 1. this rank's partial product into every peer's buffer (region `rank` of slot `slot`)
    for start in range(pid * BLOCK, n, P * BLOCK):
        m = start + offs < n
        v = tl.load(x.to(tl.pointer_type(tl.int16)) + start + offs, mask=m, other=0)
        v = tl.where(v == SENTINEL, 0, v)  # -0.0 -> +0.0: the sentinel never travels as data
        for peer in tl.static_range(world):
            if peer != rank:
                theirs = tl.multiple_of(tl.load(ptrs + peer).to(tl.pointer_type(tl.int16)), 16)
                tl.store(theirs + (slot * world + rank) * max_n + start + offs, v, mask=m)
    # 2. wait for every peer's data in this rank's buffer, sum with this rank's own
    for start in range(pid * BLOCK, n, P * BLOCK):
        m = start + offs < n
        acc = tl.load(x + start + offs, mask=m, other=0.0).to(tl.float32)
        for peer in tl.static_range(world):
            if peer != rank:
                src = mine + (slot * world + peer) * max_n + start + offs
                v = tl.load(src, mask=m, other=0, volatile=True)
                k = 0
                while (tl.max(((v == SENTINEL) & m).to(tl.int32), axis=0) != 0) & (k < limit):
                    v = tl.load(src, mask=m, other=0, volatile=True)
                    k += 1
                acc += v.to(tl.bfloat16, bitcast=True).to(tl.float32)
        tl.store(out + start + offs, acc.to(tl.bfloat16), mask=m)
    # 3. clear the slot of the call before (this rank's buffer, every peer's region), then count this call
    for start in range(pid * BLOCK, prev_n, P * BLOCK):  # whole chunks (max_n is a multiple of BLOCK)
        for peer in tl.static_range(world):
            if peer != rank:
                tl.store(mine + (old * world + peer) * max_n + start + offs, tl.full([BLOCK], SENTINEL, tl.int16))
    tl.store(state + pid, call + 1)
    tl.store(state + P + pid, n)


class LamportAllReduce:
    """Sum of a bf16 tensor of at most ``max_numel`` elements over the group, one launch, no barrier."""

    def __init__(self, max_numel: int, device, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.max_n = -(-max_numel // BLOCK) * BLOCK
        self.buf = symm_mem.empty(3 * self.world * self.max_n, dtype=torch.int16, device=device)
        self.handle = symm_mem.rendezvous(self.buf, self.group.group_name)
        self.buf.fill_(SENTINEL.value)
        self.state = torch.zeros(2 * PROGRAMS, dtype=torch.int32, device=device)  # call counters, last sizes
        torch.cuda.synchronize(device)
        dist.barrier(self.group)  # every buffer holds sentinels before any peer writes into it

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        assert y.dtype == torch.bfloat16 and y.is_contiguous() and y.numel() <= self.max_n
        out = torch.empty_like(y)
        _lamport[(PROGRAMS,)](y, self.handle.buffer_ptrs_dev, out, self.state, y.numel(), self.max_n, SPIN_LIMIT,
                              rank=self.rank, world=self.world, P=PROGRAMS, BLOCK=BLOCK, num_warps=8)
        return out


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
            want = x.clone()
            dist.all_reduce(want)
            ok &= torch.equal(lam(x), want)
    xs = [torch.zeros(n, device=device, dtype=torch.bfloat16) for n in sizes]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [lam(x) for x in xs]
    for rep in range(4):
        wants = []
        for x in xs:
            x.copy_(torch.randn(x.numel(), device=device, generator=torch.Generator(device=device).manual_seed(
                7 * rep + x.numel() + 100 * dist.get_rank())).to(torch.bfloat16))
            w = x.clone()
            dist.all_reduce(w)
            wants.append(w)
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
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    say = print if rank == 0 else (lambda *a, **kw: None)
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
