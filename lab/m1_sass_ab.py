"""GPU A/B of the M = 1 kernel (kernel 3 or 1, as the dispatcher picks) built from two csrc trees in one process: git
revision --ref (the old source) and the worktree (the new one; T64 on at k = 2, 3, 4 where the 64 KB table fits).

For each shape and k: the M = 1 plan of kbit.ops.gemv_mma (kernel 3 forced if the dispatcher picks neither; bf16 x,
log8 scales, random weights in layout "mma-v1"), both kernels launched with the plan's grid and arguments (the new
one with 32 KB more shared memory under T64), outputs compared (old vs old, new vs old: max |diff|; split-K atomics
may reorder fp32 sums run to run) and against the float64 product of the dequantized weight, then timed as
kbit.bench.timing does (cold L2: weight copies > 8 x L2 in one CUDA graph, median of replays). Needs a GPU::

    PYTHONUNBUFFERED=1 python lab/m1_sass_ab.py --ref REV [--shapes 65536x5120,...] [--ks 2,3,4,5] [--no-t64]
        [--jobs 4]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402
from sass_count import tree_sources  # noqa: E402

from kbit.bench.timing import time_calls  # noqa: E402
from kbit.cuda import runtime, sources  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.mma_plan import XS_MAX, table_smem  # noqa: E402

FILES = {1: ("gemv_mma_split.cu", "kbit_gemv_mma_split"), 3: ("gemv_mma_streamk.cu", "kbit_gemv_mma_streamk")}
T64_TABLE = 65536 + 128  # the T64 table and its alignment pad (csrc/common.cuh)
_BUILT: dict = {}


def build(rev, kernel, defines, dev):
    """Kernel 1 or 3 of revision rev (None: the worktree) with defines, loaded on dev."""
    file, name = FILES[kernel]
    key = (rev, kernel, tuple(sorted(defines.items())))
    if key not in _BUILT:
        src, hdrs = tree_sources(rev, file)
        cubin = runtime.compile_cached(src, runtime.device_arch(dev), sources.define_options(defines), name=file,
                                       headers=hdrs)
        mod, cubin = runtime.load_module(cubin, dev)
        _BUILT[key] = runtime.get_kernel(mod, cubin, name, dev)
    return _BUILT[key]


def prepare(N, K, k, ref, t64_on, dev):
    """The plan of M = 1 and the old and new kernels (compiled in a thread: NVRTC runs outside the GIL)."""
    torch.cuda.set_device(dev)  # a worker thread has no current CUDA context until it selects the device
    p = MM.plan_launch(k, 1, N, K)
    if p.kernel not in (1, 3):
        p = MM.plan_launch(k, 1, N, K, config=MmaConfig(kernel=3, warps=8, min_ctas=2, x_smem=True))
    # the old build's defines and shared bytes (a plan that already sets T64 reserved the 64 KB table)
    d = {**{n: v for n, v in p.defines.items() if n != "T64"}, "BF16": 1}
    shared0 = p.shared - p.defines.get("T64", 0) * (T64_TABLE - table_smem(k))
    if p.kernel == 3:
        t64 = int(t64_on and k in (2, 3, 4) and not d.get("XK") and d["MINB"] <= 2
                  and shared0 - table_smem(k) + T64_TABLE <= XS_MAX - 8 * 1024)
    else:  # kernel 1: the table alone, at most 3 CTAs an SM fit
        t64 = int(t64_on and k in (2, 3, 4) and d["MINB"] <= 3)
    new_shared = shared0 + t64 * (T64_TABLE - table_smem(k))
    old, new = build(ref, p.kernel, d, dev), build(None, p.kernel, {**d, **({"T64": 1} if t64 else {})}, dev)
    return p, shared0, new_shared, t64, old, new


def run_case(N, K, k, prep, dev):
    p, shared0, new_shared, t64, old, new = prep
    ws_all = L.copies(N, K, k)
    x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
    S = -(-K // 256)
    x2 = MM.prep_x(x, S)
    y = torch.empty(1, N, dtype=torch.bfloat16, device=dev)
    ws, cnt = MM.workspace(dev, p.ws_floats, p.n_cnt) if p.use_ws else (y, y)

    def call(kern, shared, w):
        args = MM._kernel_args(p, w[0], w[1], w[2], w[3], x2.data_ptr(), y.data_ptr(), None, ws, cnt, 1, N,
                               x2.stride(0), y.stride(0))
        kern((p.grid,), p.warps * 32, MM._ARGS_FMT, *args, shared=shared, pdl=True)
        return y

    w0 = ws_all[0]
    outs = []
    for kern, sh in ((old, shared0), (old, shared0), (new, new_shared)):
        call(kern, sh, w0)
        torch.cuda.synchronize()
        outs.append(y.float().clone())
    W = MM.dequant_repacked(w0[0], w0[1], w0[2], w0[3], k=k, N=N, K=K, dtype=torch.bfloat16)
    ref_y = (x.double() @ W.double().T).float()

    def rel(a):
        return ((a - ref_y).norm() / ref_y.norm().clamp_min(1e-30)).item()

    t_old = time_calls([(lambda w=w: call(old, shared0, w)) for w in ws_all]).us
    t_new = time_calls([(lambda w=w: call(new, new_shared, w)) for w in ws_all]).us
    t_old2 = time_calls([(lambda w=w: call(old, shared0, w)) for w in ws_all]).us
    occ = (old.occupancy(p.warps * 32, shared0), new.occupancy(p.warps * 32, new_shared))
    print(f"{N}x{K} k={k} kernel {p.kernel} T64={t64} regs {old.num_regs}->{new.num_regs} ctas/SM {occ[0]}->{occ[1]} "
          f"old {t_old:.1f}/{t_old2:.1f} us new {t_new:.1f} us ({t_new / min(t_old, t_old2):.3f}x) | "
          f"max|old-old| {(outs[1] - outs[0]).abs().max().item():.3g} max|new-old| "
          f"{(outs[2] - outs[0]).abs().max().item():.3g} rel err old {rel(outs[0]):.3g} new {rel(outs[2]):.3g}",
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="git revision of the old csrc (e.g. bf965aa)")
    ap.add_argument("--shapes", default="65536x5120,35840x5120,5120x25600,28672x4096,8192x28672")
    ap.add_argument("--ks", default="2,3,4,5")
    ap.add_argument("--no-t64", action="store_true", help="the new kernel without T64 at k = 2, 3, 4")
    ap.add_argument("--jobs", type=int, default=4, help="threads compiling the kernels (1: one at a time)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    cases = [(int(s.split("x")[0]), int(s.split("x")[1]), int(k)) for s in a.shapes.split(",")
             for k in a.ks.split(",")]
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as ex:
        preps = list(ex.map(lambda c: prepare(*c, a.ref, not a.no_t64, dev), cases))
    for (N, K, k), prep in zip(cases, preps, strict=True):
        run_case(N, K, k, prep, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
