"""GPU A/B of the mid-M launches (M = 2..64, the kernel and config the dispatcher picks) built from two csrc trees and
two plans in one process: git revision --ref with the plan of before (T64 at M = 1 only) against the worktree with
its plan (``kbit.tuning.mma_plan.make_plan`` with T64 up to ``--t64-max-m`` (16) in kernels 1 / 3 and on kernel 7
tiles of up to ``--t64-large-groups`` (8) token groups: the library's knobs, off by default; ``lab/m16_sass.py``).

For each shape, k and M: the config of ``kbit.ops.gemv_mma`` (tuned table, then rules; kernel 7 where the dispatcher
runs it), the old plan (``make_plan(..., t64=False)`` at M > 1: what the planner did before) and the new one (``t64``
on sm_90), each built from its tree with bf16 x and log8 scales, launched with its plan's grid and shared bytes on
random weights in layout "mma-v1" (``lab/mma_lab.py``'s copies: together > 8 x L2); outputs compared (old vs old and
new vs old: max |diff|, split-K atomics may reorder fp32 sums run to run) and against the float64 product of the
dequantized weight (relative error), then timed as ``kbit.bench.timing`` does (cold L2: the copies in one CUDA
graph, median of replays), old / new / old again. Needs a GPU::

    PYTHONUNBUFFERED=1 python lab/m16_ab.py --ref REV [--shapes 65536x5120,...] [--ks 2,4] [--ms 2,4,8,16,32,64]
        [--jobs 12]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import math
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402
from sass_count import tree_sources  # noqa: E402

from kbit.bench.timing import time_calls  # noqa: E402
from kbit.cuda import runtime, sources  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402
from kbit.tuning import mma_plan as TP  # noqa: E402
from kbit.tuning.mma import MmaConfig, large_config  # noqa: E402
from kbit.tuning.mma_plan import KERNELS, SMEM_MAX, T64_SMEM, make_plan, table_smem  # noqa: E402
from kbit.utils.device import sm_count  # noqa: E402

SHAPES = "65536x5120,35840x5120,5120x17408,9216x4096"
_BUILT: dict = {}
_LOCK = threading.Lock()
_KEYS = ("NG", "MAXW", "MINB", "PD", "XS", "XK", "T64", "CAU", "LFX", "WS4", "K1WO", "D", "SK")


def sources_of(rev, file):
    """(the .cu text, {header: text}) of the worktree (rev None), of a folder holding the old csrc files (rev a
    directory: where the device copy has no git history), or of git revision rev."""
    if rev is not None and os.path.isdir(rev):
        def read(n):
            with open(os.path.join(rev, n)) as f:
                return f.read()
        return read(file), {n: read(n) for n in sorted(os.listdir(rev)) if n.endswith(".cuh")}
    return tree_sources(rev, file)


def build(rev, kernel, defines, dev):
    """Kernel 1, 3 or 7 of revision rev (None: the worktree) with defines, loaded on dev (a build of the same source
    text and defines is shared)."""
    file, name = KERNELS[kernel]
    src, hdrs = sources_of(rev, file)
    h = hashlib.sha256((src + "".join(f"{n}{t}" for n, t in sorted(hdrs.items()))).encode()).hexdigest()
    key = (h, kernel, tuple(sorted(defines.items())))
    with _LOCK:
        ev = _BUILT.get(key)
        if ev is None:
            ev = _BUILT[key] = [threading.Event(), None]
            mine = True
        else:
            mine = False
    if mine:
        try:
            arch = runtime.device_arch(dev, file in sources.ARCH_SPECIFIC)
            cubin = runtime.compile_cached(src, arch, sources.define_options(defines), name=file, headers=hdrs)
            mod, cubin = runtime.load_module(cubin, dev)
            ev[1] = runtime.get_kernel(mod, cubin, name, dev)
        finally:
            ev[0].set()
    ev[0].wait()
    if ev[1] is None:
        raise RuntimeError(f"build failed: {file} {defines}")
    return ev[1]


def prepare(N, K, k, M, ref, dev, alt=True):
    """(config, [(old plan, old kernel), (new plan, new kernel)], [(name, plan, kernel) of other configs]); compiled
    in a worker thread (NVRTC runs outside the GIL)."""
    torch.cuda.set_device(dev)  # a worker thread has no current CUDA context until it selects the device
    if MM._large_here(k, M, N, K, dev):
        cfg = MM._tuned(k, M, N, K, dev, "large") or large_config(k, M, N, K)
    else:
        cfg = MM.launch_config(k, M, N, K, dev)
    sms, sm90 = sm_count(dev), torch.cuda.get_device_capability(dev) == (9, 0)
    plans = []
    for rev, t64 in ((ref, sm90 and M == 1), (None, sm90)):
        p = make_plan(k, M, N, K, "log8", cfg, sms=sms,
                      build=lambda kernel, d, rev=rev: build(rev, kernel, {**d, "BF16": 1}, dev), t64=t64)
        plans.append((p, build(rev, p.kernel, {**p.defines, "BF16": 1}, dev)))
    alts = []  # other configs of the worktree, timed beside (data for the tables, not part of the A/B)
    d = plans[1][0].defines
    if alt and sm90 and k == 4 and isinstance(cfg, MmaConfig) and cfg.kernel == 3:
        if d.get("XS") and not d.get("XK") and not d.get("T64"):  # T64 with x from global memory instead of XS
            alts.append(("T64 x-global", dataclasses.replace(cfg, x_smem=False)))
        if M > 8 and not d.get("XK"):  # the K-sliced M = 16 config
            alts.append(("XK8", MmaConfig(3, warps=16, min_ctas=1, ring=3, x_smem=True, x_slice=8)))
    out = []
    p_new = plans[1][0]
    if alt and sm90 and k == 4 and p_new.kernel == 3 and d.get("XS") and not d.get("XK") and not d.get("T64"):
        # T64 beside the staged x where the plan's 8 KB reserve left it out, kept only at the same CTAs an SM
        d64 = {**d, "T64": 1}
        p64 = dataclasses.replace(p_new, defines=d64, shared=p_new.shared - table_smem(k) + T64_SMEM)
        k64 = build(None, 3, {**d64, "BF16": 1}, dev)
        if p64.shared <= SMEM_MAX and k64.occupancy(p64.warps * 32, p64.shared) >= p_new.ctas_per_sm:
            out.append(("T64 XS", p64, k64))
    for name, c in alts:
        p = make_plan(k, M, N, K, "log8", c, sms=sms,
                      build=lambda kernel, d: build(None, kernel, {**d, "BF16": 1}, dev), t64=sm90)
        if p.defines.get("T64"):  # (x from global memory on a route that takes LFX: no T64 there, no news)
            out.append((name, p, build(None, p.kernel, {**p.defines, "BF16": 1}, dev)))
    return cfg, plans, out


def x_for(p, x):
    """(x as plan p's kernel reads it, its row stride): kernels 1, 3 read x rows in place; kernel 7 the permuted
    rows or (XB) the pre-tiled chunks, as ``gemv_mma.launch`` makes them."""
    x2 = MM.prep_x(x, p.S)
    if p.defines.get("XB"):
        return MM.x_tiles(x2, 8 * p.defines["NG"], p.S), p.S * 4
    if p.kernel == 7:
        x2 = MM.permute_x(x2)
    return x2, x2.stride(0)


def desc(d):
    return ",".join(f"{n}={d[n]}" for n in _KEYS if d.get(n))


def run_case(N, K, k, M, prep, W, x_all, ref_all, dev):
    cfg, ((po, ko), (pn, kn)), alts = prep
    x, ref = x_all[:M].contiguous(), ref_all[:M]
    y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    xo, xn = x_for(po, x), x_for(pn, x)

    def call(p, kern, xa, w):
        ws, cnt = MM.workspace(dev, p.ws_floats, p.n_cnt) if p.use_ws else (y, y)
        args = MM._kernel_args(p, w[0], w[1], w[2], w[3], xa[0].data_ptr(), y.data_ptr(), None, ws, cnt, M, N,
                               xa[1], y.stride(0))
        kern((p.grid,), p.warps * 32, MM._ARGS_FMT, *args, shared=p.shared, pdl=True)
        return y

    w0 = W[0]
    outs = []
    for p, kern, xa in ((po, ko, xo), (po, ko, xo), (pn, kn, xn)):
        call(p, kern, xa, w0)
        torch.cuda.synchronize()
        outs.append(y.double().clone())

    def rel(a):
        return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    t_old = time_calls([(lambda w=w: call(po, ko, xo, w)) for w in W]).us
    t_new = time_calls([(lambda w=w: call(pn, kn, xn, w)) for w in W]).us
    t_old2 = time_calls([(lambda w=w: call(po, ko, xo, w)) for w in W]).us
    ratio = t_new / min(t_old, t_old2)
    extra = ""
    for name, pa, ka in alts:
        try:
            xa = x_for(pa, x)
            call(pa, ka, xa, w0)
            torch.cuda.synchronize()
            err = rel(y.double())
            ta = time_calls([(lambda w=w, pa=pa, ka=ka, xa=xa: call(pa, ka, xa, w)) for w in W]).us
            extra += (f" | alt {name} ({desc(pa.defines)}) {ta:.2f} us ({ta / min(t_old, t_old2):.3f}x, "
                      f"rel err {err:.3g})")
        except Exception as e:  # noqa: BLE001 -- an alternative's failure leaves the A/B line standing
            extra += f" | alt {name} failed: {type(e).__name__}: {e}"
    d_old, d_new = desc(po.defines), desc(pn.defines)
    print(f"{N}x{K} k={k} M={M} kernel {pn.kernel} {d_old}{' -> ' + d_new if d_new != d_old else ''}"
          f" regs {ko.num_regs}->{kn.num_regs} ctas/SM {po.ctas_per_sm}->{pn.ctas_per_sm} grid {po.grid}->{pn.grid} | "
          f"old {t_old:.2f}/{t_old2:.2f} us new {t_new:.2f} us ({ratio:.3f}x) | max|old-old| "
          f"{(outs[1] - outs[0]).abs().max().item():.3g} max|new-old| {(outs[2] - outs[0]).abs().max().item():.3g} "
          f"rel err old {rel(outs[0]):.3g} new {rel(outs[2]):.3g}{extra}", flush=True)
    return ratio


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="git revision of the old csrc (e.g. a038f36), or a folder holding "
                    "those csrc files (git archive a038f36 src/kbit/cuda/csrc | tar -x -C DIR)")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--ms", default="2,4,8,16,32,64")
    ap.add_argument("--jobs", type=int, default=12, help="threads compiling the kernels")
    ap.add_argument("--no-alt", action="store_true", help="time no other configs beside the A/B")
    ap.add_argument("--t64-max-m", type=int, default=16, help="kbit.tuning.mma_plan.T64_MAX_M of the new plans (16: "
                    "T64 at M = 2..16 as measured at 8f1ffd6; the library's default is 1)")
    ap.add_argument("--t64-large-groups", type=int, default=8, help="T64_LARGE_GROUPS of the new plans (kernel 7; "
                    "0: off, the library's default)")
    a = ap.parse_args(argv)
    TP.T64_MAX_M, TP.T64_LARGE_GROUPS = a.t64_max_m, a.t64_large_groups  # before any plan; the old plans ignore them
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"device {torch.cuda.get_device_name(dev)}, ref {a.ref}", flush=True)
    ms = [int(m) for m in a.ms.split(",")]
    groups = [(int(s.split("x")[0]), int(s.split("x")[1]), int(k)) for s in a.shapes.split(",")
              for k in a.ks.split(",")]
    cases = [(N, K, k, M) for N, K, k in groups for M in ms]
    def safe_prepare(c):
        try:
            return prepare(*c, a.ref, dev, not a.no_alt)
        except Exception as e:  # noqa: BLE001 -- one failed build must not lose the whole run
            print(f"{c}: build failed: {type(e).__name__}: {e}", flush=True)
            return None

    with concurrent.futures.ThreadPoolExecutor(a.jobs) as ex:
        preps = dict(zip(cases, ex.map(safe_prepare, cases), strict=True))
    print("built", flush=True)
    ratios: dict = {}
    for N, K, k in groups:
        W = L.copies(N, K, k)
        g = torch.Generator(device=dev).manual_seed(N + k)
        x_all = torch.randn(max(ms), K, dtype=torch.bfloat16, device=dev, generator=g)
        w = W[0]
        Wd = MM.dequant_repacked(w[0], w[1], w[2], w[3], k=k, N=N, K=K, dtype=torch.bfloat16)
        ref_all = x_all.double() @ Wd.double().T
        del Wd
        for M in ms:
            if preps[(N, K, k, M)] is None:
                continue
            try:
                r = run_case(N, K, k, M, preps[(N, K, k, M)], W, x_all, ref_all, dev)
            except Exception as e:  # noqa: BLE001 -- report and go on with the next case
                print(f"{N}x{K} k={k} M={M}: failed: {type(e).__name__}: {e}", flush=True)
                torch.cuda.synchronize()
                continue
            ratios.setdefault((k, M), []).append(r)
        del ref_all
        torch.cuda.empty_cache()
    print("geomean new / old time by (k, M):")
    for (k, M), r in sorted(ratios.items()):
        gm = math.exp(sum(math.log(v) for v in r) / len(r))
        print(f"  k={k} M={M}: {gm:.3f} (min {min(r):.3f}, max {max(r):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
