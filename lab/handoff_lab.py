"""GPU lab: what one kernel boundary of a dependent chain costs, and whether a flag hand-off costs less.

    PYTHONUNBUFFERED=1 python lab/handoff_lab.py [--n 64] [--grids 1,16,132,264] [--reps 50] [--out DIR]

A decode step is a chain of ~10 dependent launches a layer; each waits for the one before. This times chains of
N kernels that do almost nothing (every program reads ``buf[i]``, program 0 writes ``buf[i + 1] = buf[i] + 1``),
captured in one CUDA graph, so the time a kernel is what a boundary costs:

- ``plain``: launched without programmatic dependent launch (PDL): the next kernel starts after this one ends.
- ``pdl``: PDL, the library's way (``kbit.kernels.glue._pdl_enter``): each kernel lets the next launch at its start,
  then ``griddepcontrol.wait`` blocks until the kernel before has completed and its memory is visible.
- ``flag-atom`` / ``flag-ld``: PDL launch, no ``griddepcontrol.wait``: the kernel's programs spin until the kernel
  before has raised its flag (an atomic read, or ``ld.acquire.gpu``); a kernel's programs count themselves out
  (``atom.acq_rel``) and the last raises the next kernel's flag (``st.release``/``atom.release``). Flags hold a
  generation number that a plain launch bumps once a replay (the graph is replayed with no reset).

Checks ``buf[N] == N`` after the replays. Writes ``handoff.json`` under ``--out`` (default ``$OUT``), prints a
table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kbit.kernels.glue import gdc_launch_dependents, gdc_wait  # noqa: E402


@triton.jit
def _ld_acquire(ptr):
    one = tl.arange(0, 1)
    v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr + one], dtype=tl.int32,
                                  is_pure=False, pack=1)
    return tl.max(v, axis=0)


@triton.jit
def gen_kernel(gen_ptr, flag_ptr):
    g = tl.load(gen_ptr) + 1
    tl.store(gen_ptr, g)
    tl.store(flag_ptr, g)


@triton.jit
def link_kernel(buf_ptr, flag_ptr, cnt_ptr, gen_ptr, i, MODE: tl.constexpr):
    pid = tl.program_id(0)
    if MODE == 1:
        gdc_launch_dependents()
        gdc_wait()
    if MODE >= 2:
        gdc_launch_dependents()
        g = tl.load(gen_ptr)  # written by a plain launch before the chain: visible to every kernel of it
        if MODE == 2:
            f = tl.atomic_add(flag_ptr + i, 0, sem="acquire", scope="gpu")
            while f != g:
                f = tl.atomic_add(flag_ptr + i, 0, sem="acquire", scope="gpu")
        else:
            f = _ld_acquire(flag_ptr + i)
            while f != g:
                f = _ld_acquire(flag_ptr + i)
    v = tl.load(buf_ptr + i, cache_modifier=".cg")
    if pid == 0:
        tl.store(buf_ptr + i + 1, v + 1)
    if MODE >= 2:
        tl.debug_barrier()
        c = tl.atomic_add(cnt_ptr + i, 1, sem="acq_rel", scope="gpu")
        if c == tl.num_programs(0) - 1:
            tl.store(cnt_ptr + i, 0)
            tl.atomic_xchg(flag_ptr + i + 1, g, sem="release", scope="gpu")


MODES = {"plain": 0, "pdl": 1, "flag-atom": 2, "flag-ld": 3}


def run_chain(mode: str, grid: int, n: int, reps: int) -> dict:
    dev = torch.device("cuda")
    buf = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    flag = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    cnt = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    gen = torch.zeros(1, dtype=torch.int32, device=dev)
    m = MODES[mode]
    kw = {"launch_pdl": True} if m else {}

    def chain():
        gen_kernel[(1,)](gen, flag)
        for i in range(n):
            link_kernel[(grid,)](buf, flag, cnt, gen, i, MODE=m, num_warps=4, **kw)

    chain()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            chain()
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        buf.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
        assert int(buf[n]) == n, (mode, grid, buf.tolist())
    times.sort()
    med = times[len(times) // 2]
    return {"mode": mode, "grid": grid, "n": n, "us_chain": med, "us_link": med / n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--grids", default="1,16,132,264")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    rows = []
    for grid in [int(x) for x in a.grids.split(",")]:
        for mode in MODES:
            r = run_chain(mode, grid, a.n, a.reps)
            rows.append(r)
            print(json.dumps(r), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "handoff.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                         indent=1))
    print(f"\nus a link ({torch.cuda.get_device_name()}, chain of {a.n}, median of {a.reps} graph replays)")
    print("grid " + "".join(f"{m:>11}" for m in MODES))
    for grid in sorted({r["grid"] for r in rows}):
        print(f"{grid:4d} " + "".join(f"{r['us_link']:11.2f}" for r in rows if r["grid"] == grid))


if __name__ == "__main__":
    main()
