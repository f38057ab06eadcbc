"""Where a TP = 2 decode step's time goes: kernel times on rank 0 (torch.profiler over CUDA-graph replays) of the
tp_check stack on one GPU and at TP = 2, by kernel family and by kernel, against the step's wall time.

    torchrun --nproc-per-node 2 lab/parallel/tp_profile.py --layers 32 --batches 1 16
    torchrun --nproc-per-node 2 lab/parallel/tp_profile.py --layers 32 --batches 1 --comm nccl --top 25

"busy" is the sum of kernel times a step; "step" the replay's wall time (CUDA events), so ``step - busy`` is
time the GPU of rank 0 waited (launch gaps inside the graph, the peer in a collective's barrier). One block's
kernels are also listed in order with the gap before each. The all-reduce
rows include the wait for the slower rank. Families: kbit GEMV kernels, all-reduce (NCCL or symmetric memory),
glue (norms, SiLU * up, the attention stand-in, copies).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_setup import init_ranks  # this file's folder is on sys.path
from tp_check import HEAD_DIM, HIDDEN, INTER, KV, Q, build, set_comm, step_ms  # noqa: E402  (the same stack)

from kbit.parallel import LLAMA_PLAN, PACKED_LLAMA_PLAN, parallelize_kbit  # noqa: E402


def family(name: str) -> str:
    n = name.lower()
    if "nccl" in n or "all_reduce" in n or "allreduce" in n or "symm" in n:
        return "all-reduce"
    if n.startswith("kbit_") or "gemv" in n or "mma" in n or "wgmma" in n:
        return "kbit GEMV"
    return "glue"


def graph_of(fn):
    """``fn`` captured in a CUDA graph (after an eager warm-up on a side stream)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def profile_step(fn, steps: int):
    """Device events (kernels, copies) of ``steps`` replays of ``fn``'s graph on this rank, in start order."""
    g = graph_of(fn)
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e.time_range.start)


def kernel_times(events, steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (calls a step, us a step)}."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        out[e.name][0] += 1 / steps
        out[e.name][1] += e.time_range.elapsed_us() / steps  # a device event's own span
    return {k: (v[0], v[1]) for k, v in out.items()}


def one_block(events, steps: int, layers: int) -> list[tuple[str, float, float]]:
    """(name, us, gap before it in us) of the kernels of the second block of the last replay: the kernels of a
    step are the same each replay, ``layers`` blocks of the same sequence (the first block's norm differs)."""
    n = len(events) // steps
    last = events[-n:]
    per = n // layers
    block = last[per:2 * per]
    out, prev = [], last[per - 1].time_range.end
    for e in block:
        out.append((e.name, e.time_range.elapsed_us(), e.time_range.start - prev))
        prev = e.time_range.end
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--layout", choices=("packed", "separate"), default="packed")
    p.add_argument("--comm", choices=("auto", "nccl", "one_shot", "two_shot", "lamport"), default="auto")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12, help="kernels listed a configuration")
    args = p.parse_args()
    rank, world, device, say = init_ranks()
    d = {"hidden": HIDDEN, "q": Q, "kv": KV, "inter": INTER, "head": HEAD_DIM}
    whole = build(args.layers, args.k, d, device, args.layout)
    tp = copy.deepcopy(whole)
    parallelize_kbit(tp, PACKED_LLAMA_PLAN if args.layout == "packed" else LLAMA_PLAN)
    set_comm(tp, args.comm, max(args.batches) * HIDDEN * 2)
    say(f"{args.layers} blocks, layout {args.layout}, TP={world} all-reduce {args.comm}; us per step on rank 0")
    summary = []
    with torch.no_grad():
        for batch in args.batches:
            x = torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16)
            for label, model in (("one GPU", whole), (f"TP={world}", tp)):
                step = step_ms(lambda x=x, m=model: m(x), True) * 1000
                events = profile_step(lambda x=x, m=model: m(x), args.steps)
                kt = kernel_times(events, args.steps)
                fam: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
                for name, (calls, us) in kt.items():
                    fam[family(name)][0] += calls
                    fam[family(name)][1] += us
                busy = sum(us for _, us in kt.values())
                summary.append((batch, label, step, busy, fam))
                say(f"\nbatch {batch}, {label}: step {step:.1f} us, kernels busy {busy:.1f} us "
                    f"({sum(c for c, _ in kt.values()):.0f} kernels)")
                say("| kernel | calls/step | us/step | us/call |\n|---|---|---|---|")
                for name, (calls, us) in sorted(kt.items(), key=lambda kv: -kv[1][1])[:args.top]:
                    say(f"| {name[:90]} | {calls:.0f} | {us:.1f} | {us / max(calls, 1e-9):.2f} |")
                say("one block's kernels in order (us, gap before it us): " + "; ".join(
                    f"{family(nm)}:{nm[:28]} {us:.1f} (+{gap:.1f})" for nm, us, gap in one_block(events, args.steps,
                                                                                               args.layers)))
    say("\n| batch | config | step us | busy us | kbit GEMV us (n) | all-reduce us (n) | glue us (n) |"
        "\n|---|---|---|---|---|---|---|")
    for batch, label, step, busy, fam in summary:
        cells = " | ".join(f"{fam[f][1]:.0f} ({fam[f][0]:.0f})" for f in ("kbit GEMV", "all-reduce", "glue"))
        say(f"| {batch} | {label} | {step:.0f} | {busy:.0f} | {cells} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
