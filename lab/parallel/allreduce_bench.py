"""All-reduce latency at decode message sizes inside CUDA graphs: NCCL against PyTorch's symmetric-memory one-shot
and two-shot kernels (``kbit.parallel.all_reduce_sum``), with a check of each result against NCCL's.

    torchrun --nproc-per-node 2 lab/parallel/allreduce_bench.py
    torchrun --nproc-per-node 2 lab/parallel/allreduce_bench.py --hidden 4096 --batches 1 2 4 8 16 32 64 128 256

First it says what this torch has (the ``torch.ops.symm_mem`` ops, the symmetric-memory backend, P2P between the
GPUs); a method it lacks is reported as n/a, not run. Each time is one all-reduce of ``batch x hidden`` bf16,
the median over replays of a CUDA graph of ``--calls`` all-reduces, the slower rank's. The last lines propose an
``ALLREDUCE_TABLE`` row (``src/kbit/parallel/comm.py``) from the measured crossovers.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from rank_setup import init_ranks  # this file's folder is on sys.path

from kbit.parallel import comm
from kbit.parallel.comm import METHODS, AllReduceConfig, all_reduce_sum, symm_mem_missing
from kbit.tuning.tables import gpu_key

#: the ops of torch.ops.symm_mem worth knowing about (multimem ones listed, never run: multicast stays off)
OPS = ("one_shot_all_reduce", "one_shot_all_reduce_out", "one_shot_all_reduce_copy", "one_shot_all_reduce_copy_out",
       "two_shot_all_reduce_", "two_shot_all_reduce_out", "multimem_all_reduce_", "multimem_one_shot_all_reduce")


def report_support(say, device) -> None:
    import torch.distributed._symmetric_memory as symm_mem  # a private torch module: what this torch has

    ns = getattr(torch.ops, "symm_mem", None)
    have = [op for op in OPS if ns is not None and hasattr(ns, op)]
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)} (key {gpu_key(device)})")
    say(f"torch.ops.symm_mem has: {', '.join(have) or 'nothing'}")
    say(f"missing: {', '.join(op for op in OPS if op not in have) or 'nothing'}")
    backend = getattr(symm_mem, "get_backend", None)
    try:
        say(f"symmetric-memory backend: {backend(device) if backend else 'n/a (no get_backend)'}")
    except (RuntimeError, TypeError) as err:
        say(f"symmetric-memory backend: unknown ({err})")
    peers = [torch.cuda.can_device_access_peer(device.index, j) for j in range(torch.cuda.device_count())
             if j != device.index]
    say(f"P2P access from GPU {device.index} to the others: {peers}")


def check(method: str, n: int, device, config: AllReduceConfig) -> float:
    """max |method's sum - NCCL's sum| / max |NCCL's| on rank-dependent bf16 data (0 where both agree)."""
    g = torch.Generator(device=device).manual_seed(dist.get_rank() * 7919 + n)
    x = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
    want = x.clone()
    dist.all_reduce(want)
    got = all_reduce_sum(x.clone(), None, config, method)
    err = torch.tensor([((got.float() - want.float()).abs().max() / want.float().abs().max()).item()], device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


def time_us(method: str, x: torch.Tensor, config: AllReduceConfig, calls: int, reps: int) -> float:
    """Median microseconds of one all-reduce, ``calls`` of them captured in one CUDA graph; max over ranks."""
    y = x.clone()

    def body():
        for _ in range(calls):  # NCCL sums in place: y doubles a call (inf after a while: same time)
            all_reduce_sum(y, None, config, method)

    body()  # eager: NCCL's communicator and the symmetric buffer are made outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    t = torch.tensor([statistics.median(times)], device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _fastest(t: dict[str, float | None]) -> str:
    return min((m for m in METHODS if t[m] is not None), key=lambda m: t[m])


def propose(rows: list[tuple[int, dict[str, float | None]]]) -> AllReduceConfig:
    """One-shot up to the end of the first run of sizes where it is the fastest, then two-shot up to the end of the
    run where that is (sizes ascending); NCCL above."""
    one = two = i = 0
    while i < len(rows) and _fastest(rows[i][1]) == "one_shot":
        one, i = rows[i][0], i + 1
    while i < len(rows) and _fastest(rows[i][1]) == "two_shot":
        two, i = rows[i][0], i + 1
    return AllReduceConfig(one_shot_max_bytes=one, two_shot_max_bytes=two)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    rank, world, device, say = init_ranks()
    report_support(say, device)
    big = max(args.batches) * args.hidden * 2
    config = AllReduceConfig(one_shot_max_bytes=big)  # only sizes the symmetric buffer: methods are forced below
    usable = {m: not symm_mem_missing(m) for m in METHODS}
    errs = {}
    for m in METHODS:
        if usable[m]:
            errs[m] = check(m, args.hidden * max(args.batches), device, config)
    buf = comm._BUFFERS.get((dist.group.WORLD.group_name, device.index, torch.bfloat16))
    if buf is None:
        say("symmetric buffer: not made (rendezvous failed or input not eligible): one/two-shot fall back to NCCL")
        usable["one_shot"] = usable["two_shot"] = False
    say("max |method - NCCL| / max |NCCL| at the largest size: "
        + ", ".join(f"{m} {e:.1e}" for m, e in errs.items() if usable[m]))
    rows = []
    say(f"\nTP={world}, bf16 [batch, {args.hidden}], one all-reduce in a CUDA graph of {args.calls}, "
        "us (max over ranks)")
    say("| batch | KiB | nccl | one_shot | two_shot | fastest |\n|---|---|---|---|---|---|")
    for b in args.batches:
        x = torch.randn(b, args.hidden, device=device).to(torch.bfloat16)
        t = {m: time_us(m, x, config, args.calls, args.reps) if usable[m] else None for m in METHODS}
        nbytes = x.numel() * 2
        rows.append((nbytes, t))
        fastest = _fastest(t)
        cells = " | ".join("n/a" if t[m] is None else f"{t[m]:.1f}" for m in METHODS)
        say(f"| {b} | {nbytes / 1024:.0f} | {cells} | {fastest} |")
    c = propose(rows)
    say(f"\nproposed row: ({gpu_key(device)!r}, {world}): AllReduceConfig(one_shot_max_bytes={c.one_shot_max_bytes}, "
        f"two_shot_max_bytes={c.two_shot_max_bytes}),")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
