"""Experiment: the all-reduce of a row-parallel layer fused with the residual add + RMSNorm that follows it in a
decoder block, one kernel instead of two (symmetric memory, P2P loads; no NVLink multicast).

    torchrun --nproc-per-node 2 lab/parallel/fused_ar_norm.py
    torchrun --nproc-per-node 2 lab/parallel/fused_ar_norm.py --batches 1 16 64 --hidden 4096

A decode step runs ``y = all_reduce(partial); r = residual + y; h = rms_norm(r) * w`` twice a block. The kernel
here does it in one launch, one program a row: store the row's partial product in this rank's symmetric buffer,
a barrier with the same program on every peer (signal pads: release / acquire at system scope, the pattern of
PyTorch's own one-shot kernel), load the peers' rows, sum, add the residual, normalize, store ``h`` and ``r``, a
second barrier (no peer may overwrite its buffer while another still reads it). Checked against
``kbit.parallel.all_reduce_sum`` + ``kbit.ops.glue.add_rms_norm``; timed in CUDA graphs against NCCL / one-shot
followed by the norm kernel. Every wait is bounded (``SPIN_LIMIT`` polls): a broken barrier gives wrong numbers
and a WRONG line, not a hang.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl
from rank_setup import init_ranks  # this file's folder is on sys.path

from kbit.ops.glue import add_rms_norm
from kbit.parallel.comm import AllReduceConfig, all_reduce_sum

SPIN_LIMIT = 1 << 18  # polls of one wait (well under a second; a peer takes microseconds); then the kernel gives up


@triton.jit
def _barrier(pads, row, rank: tl.constexpr, world: tl.constexpr, limit):
    """Every peer's program ``row`` and this one meet: send a flag to each peer (0 -> 1, release), then take each
    peer's flag (1 -> 0, acquire). A slot is reset by its reader, so the pads are all zero between kernels (CUDA
    graphs replay them as they are)."""
    tl.debug_barrier()  # the block's stores before the release
    bases = pads.to(tl.pointer_type(tl.uint64))
    for peer in tl.static_range(world):
        if peer != rank:
            remote = tl.load(bases + peer).to(tl.pointer_type(tl.int32)) + row * world + rank
            old = tl.atomic_cas(remote, 0, 1, sem="release", scope="sys")  # a scalar atomic: one thread, broadcast
            n = 0
            while (old != 0) & (n < limit):
                old = tl.atomic_cas(remote, 0, 1, sem="release", scope="sys")
                n += 1
    local = tl.load(bases + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(world):
        if peer != rank:
            old = tl.atomic_cas(local + row * world + peer, 1, 0, sem="acquire", scope="sys")
            n = 0
            while (old != 1) & (n < limit):
                old = tl.atomic_cas(local + row * world + peer, 1, 0, sem="acquire", scope="sys")
                n += 1
    tl.debug_barrier()  # every thread reads after the acquire


@triton.jit
def _ar_add_rms_norm(x, bufs, pads, res, w, out, res_out, eps, limit, H: tl.constexpr, rank: tl.constexpr,
                     world: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    ptrs = bufs.to(tl.pointer_type(tl.uint64))
    # the buffers are allocations of their own (16-byte aligned): vector loads and stores
    mine = tl.multiple_of(tl.load(ptrs + rank).to(tl.pointer_type(tl.bfloat16)), 16) + row * H
    part = tl.load(x + row * H + offs, mask=mask, other=0.0)
    tl.store(mine + offs, part, mask=mask)
    _barrier(pads, row, rank, world, limit)
    acc = part.to(tl.float32)
    for peer in tl.static_range(world):
        if peer != rank:
            theirs = tl.multiple_of(tl.load(ptrs + peer).to(tl.pointer_type(tl.bfloat16)), 16) + row * H
            acc += tl.load(theirs + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = acc.to(tl.bfloat16)  # the all-reduced partial, rounded as NCCL's bf16 sum is
    r = (tl.load(res + row * H + offs, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(tl.bfloat16)
    h = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    normed = (h * inv).to(tl.bfloat16).to(tl.float32)
    wt = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * H + offs, (wt * normed).to(tl.bfloat16), mask=mask)
    tl.store(res_out + row * H + offs, r, mask=mask)
    _barrier(pads, row, rank, world, limit)


class FusedAllReduceNorm:
    """``(rms_norm(residual + sum over ranks of x) * w, residual + sum)`` for bf16 ``x``, ``residual`` ``[B, H]``
    (B <= ``max_rows``), one launch. Holds a symmetric buffer of ``max_rows x H`` (made collectively here)."""

    def __init__(self, max_rows: int, hidden: int, device, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.buf = symm_mem.empty(max_rows * hidden, dtype=torch.bfloat16, device=device)
        self.handle = symm_mem.rendezvous(self.buf, self.group.group_name)
        self.max_rows, self.hidden = max_rows, hidden

    def __call__(self, x, residual, weight, eps):
        B, H = x.shape
        assert H == self.hidden and B <= self.max_rows and x.is_contiguous() and residual.is_contiguous()
        out, res_out = torch.empty_like(x), torch.empty_like(residual)
        _ar_add_rms_norm[(B,)](x, self.handle.buffer_ptrs_dev, self.handle.signal_pad_ptrs_dev, residual, weight,
                               out, res_out, eps, SPIN_LIMIT, H=H, rank=self.rank, world=self.world,
                               BLOCK=triton.next_power_of_2(H), num_warps=8)
        return out, res_out


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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    rank, world, device, say = init_ranks()
    H, eps = args.hidden, 1e-5
    fused = FusedAllReduceNorm(max(args.batches), H, device)
    one_shot = AllReduceConfig(one_shot_max_bytes=max(args.batches) * H * 2)
    ok = True
    say(f"TP={world}, hidden {H}: all-reduce + residual add + RMSNorm, us per call (CUDA graph, max over ranks)")
    say("| batch | nccl + norm | one-shot + norm | fused | max abs(fused - nccl path) h / r | ok |\n"
        "|---|---|---|---|---|---|")
    for b in args.batches:
        g = torch.Generator(device=device).manual_seed(1000 * rank + b)
        x = torch.randn(b, H, device=device, generator=g).to(torch.bfloat16)
        res = torch.randn(b, H, device=device, generator=torch.Generator(device=device).manual_seed(b)).to(
            torch.bfloat16)
        w = (1 + 0.1 * torch.randn(H, device=device, generator=torch.Generator(device=device).manual_seed(7))).to(
            torch.bfloat16)

        def unfused(config, x=x, res=res, w=w):
            return add_rms_norm(all_reduce_sum(x.clone(), None, config), res, w, eps)

        want_h, want_r = unfused(AllReduceConfig())
        got_h, got_r = fused(x, res, w, eps)
        torch.cuda.synchronize()
        dh = (got_h.float() - want_h.float()).abs().max().item()
        dr = (got_r.float() - want_r.float()).abs().max().item()
        good = torch.tensor([float(dr == 0 and dh <= 0.02 * want_h.float().abs().max().item())], device=device)
        dist.all_reduce(good, op=dist.ReduceOp.MIN)
        ok &= bool(good.item())
        t_nccl = graph_us(lambda: unfused(AllReduceConfig()), args.calls, args.reps)
        t_one = graph_us(lambda: unfused(one_shot), args.calls, args.reps)
        t_fused = float("nan")  # not timed where wrong: a broken barrier spins to its limit at every call
        if good.item():
            t_fused = graph_us(lambda x=x, res=res, w=w: fused(x, res, w, eps), args.calls, args.reps)
        verdict = "yes" if good.item() else "WRONG"
        say(f"| {b} | {t_nccl:.1f} | {t_one:.1f} | {t_fused:.1f} | {dh:.1e} / {dr:.1e} | {verdict} |")
    say("fused kernel correct" if ok else "WRONG: the fused kernel differs from all-reduce + add_rms_norm")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
