"""GPU lab: the fused x-prologue launches (residual add + RMSNorm before q/k/v and gate/up, SiLU * up after gate/up;
``kbit.dispatch.prologue``) over kernel 3's configs, against what ships and against the unfused steps.

The decode step runs these launches with ``kbit.tuning.mma_plan.prologue_config``: the built-in kernel-3 rule, or
8 warps x 2 CTAs, never a measured pick. Per (shape, k, M) this times, cold L2 and CUDA graphs as ``kbit bench``
does (``kbit.bench.timing.time_calls``):

- ``shipped``: ``add_rms_norm_linear`` as the step calls it;
- ``unfused``: ``add_rms_norm``, the module (the tuned plain launch), ``silu_mul`` for gate/up;
- ``plain``: the module alone on a normed x (what the weight read costs without the glue);
- each kernel-3 config of :func:`space` with the prologue (and the epilogue for gate/up).

Each output is checked against ``unfused`` first. Shapes: the fused q/k/v and gate/up layers of the dense suite
models whose x fits in shared memory beside the table.

    PYTHONUNBUFFERED=1 python lab/prologue_sweep.py --k 2,3,4,5 --m 1 --out $OUT/prologue.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from kbit.bench import suite as S  # noqa: E402
from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.bench.tune import quantized_weight  # noqa: E402
from kbit.bench.tune_build import _compile, _FakeKernel  # noqa: E402
from kbit.bench.weights import clone_weight, kbit_bytes  # noqa: E402
from kbit.cuda import runtime, sources  # noqa: E402
from kbit.dispatch.prologue import add_rms_norm_linear  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops import gemv_mma  # noqa: E402
from kbit.ops.gemv_mma import EPI_SILU, PRO_ADD_NORM  # noqa: E402
from kbit.ops.glue import add_rms_norm, silu_mul  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.mma_plan import KERNELS, make_plan, prologue_config  # noqa: E402
from kbit.utils.device import sm_count  # noqa: E402

BF16 = torch.bfloat16
EPS = 1e-6


def space(k: int) -> list[MmaConfig]:
    out = [MmaConfig(3, w, min_ctas=c, ring=r, x_smem=True)
           for (w, c) in ((4, 4), (4, 6), (8, 1), (8, 2), (8, 3), (16, 1), (16, 2)) for r in (2, 3)]
    out.append(MmaConfig(3, 8, min_ctas=2, ring=4, x_smem=True))
    if k == 5:
        out += [MmaConfig(3, 16, min_ctas=1, ring=r, x_smem=True, pair_table=True) for r in (2, 3)]
    return out


def shapes() -> list[tuple[str, str, int, int]]:
    """(model, layer, N, K) of every fused q/k/v and gate/up layer of the suite, one row a distinct shape."""
    seen, out = set(), []
    for m in S.load_models():
        for lay in S.model_layers(m):
            if lay.name in ("qkv", "gate_up") and (lay.N, lay.K, lay.name) not in seen and lay.K <= 8192:
                seen.add((lay.N, lay.K, lay.name))
                out.append((m.name, lay.name, lay.N, lay.K))
    return out


def prebuild(jobs, ks, ms, dev, sms):
    """Compile every variant's build in a pool of CPU processes into the on-disk cache."""
    arch = {f: runtime.device_arch(dev, f in sources.ARCH_SPECIFIC) for f, _ in KERNELS.values()}
    builds = set()
    for _, name, N, K in jobs:
        epi = EPI_SILU if name == "gate_up" and N % 32 == 0 else 0
        for k in ks:
            for M in ms:
                for cfg in space(k):
                    def build(kernel, defines):
                        builds.add((KERNELS[kernel][0], tuple(sorted(defines.items()))))
                        return _FakeKernel(defines)
                    try:
                        p = make_plan(k, M, N, K, "log8", cfg, sms=sms, build=build, pro=PRO_ADD_NORM, epi=epi,
                                      bf16=True)
                        builds.add((p.source[0], tuple(sorted(p.defines.items()))))
                    except ValueError:
                        pass
    pool = cf.ProcessPoolExecutor(max(1, (os.cpu_count() or 2) - 1), mp_context=multiprocessing.get_context("spawn"))
    t0 = time.time()
    futs = [pool.submit(_compile, f, d, arch[f]) for f, d in builds]
    bad = sum(1 for f in futs if f.exception() is not None)
    pool.shutdown()
    print(f"prebuild: {len(builds)} builds in {time.time() - t0:.0f} s, {bad} failed", flush=True)


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_point(N, K, k, M, gate_up, l2, dev):
    qw = quantized_weight(N, K, k, 0, dev)
    n = copies_for_cold_l2(kbit_bytes(qw), l2)
    lins = [KbitLinear.from_weight(qw if i == 0 else clone_weight(qw)).repack_for_kernels() for i in range(n)]
    g = torch.Generator(device=dev).manual_seed(N + K + M)
    x = torch.randn(M, K, generator=g, device=dev).to(BF16)
    res = torch.randn(M, K, generator=g, device=dev).to(BF16)
    nw = (1 + 0.1 * torch.randn(K, generator=g, device=dev)).to(BF16)
    epi = EPI_SILU if gate_up and N % 32 == 0 else 0
    Ny = N // 2 if gate_up else N
    lin0 = lins[0]

    def unfused(lin):
        h, r = add_rms_norm(x, res, nw, EPS)
        z = lin(h)
        return silu_mul(z[:, :N // 2], z[:, N // 2:]) if gate_up else z

    ref = unfused(lin0)
    h0, _ = add_rms_norm(x, res, nw, EPS)
    rows = {}

    def timed(name, fn, check=True):
        try:
            y = fn(lin0)
            torch.cuda.synchronize()
            if check:
                err = rel(y, ref)
                if not err <= 2e-2:
                    rows[name] = dict(us=None, err=err)
                    return
            t = time_calls([lambda lin=lin: fn(lin) for lin in lins])
            rows[name] = dict(us=t.us, us_min=t.us_min, us_max=t.us_max)
        except Exception as e:  # noqa: BLE001 - a config that cannot launch ends only itself
            rows[name] = dict(us=None, error=f"{type(e).__name__}: {str(e)[:120]}")

    timed("shipped", lambda lin: add_rms_norm_linear(x, res, nw, EPS, lin, silu_mul=gate_up)[0])
    timed("unfused", unfused)
    timed("plain", lambda lin: lin(h0), check=False)
    ys = [torch.empty(M, Ny, dtype=BF16, device=dev) for _ in lins]
    routs = [torch.empty_like(res) for _ in lins]
    by_id = {id(lin): i for i, lin in enumerate(lins)}
    for cfg in space(k):
        def fused(lin, cfg=cfg):
            i = by_id[id(lin)]
            gemv_mma.launch(x, lin.codes, lin.scales, lin.tensor_scale, lin.codebook, None, ys[i], k=k,
                            scale_format=lin.scale_format, N=N, K=K, M=M, config=cfg,
                            pro=(PRO_ADD_NORM, res, routs[i], nw, EPS), epi=epi)
            y = ys[i]
            return y if epi or not gate_up else silu_mul(y[:, :N // 2], y[:, N // 2:])
        timed(f"k3 w{cfg.warps}x{cfg.min_ctas} r{cfg.ring}{' p5' if cfg.pair_table else ''}", fused)
    ship = prologue_config(k, M, N, K, gemv_mma.launch_config(k, M, N, K, dev))
    return rows, (None if ship is None else f"k3 w{ship.warps}x{ship.min_ctas} r{ship.ring}"
                  f"{' p5' if ship.pair_table else ''}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="2,3,4,5")
    ap.add_argument("--m", default="1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new shape after this many seconds")
    a = ap.parse_args()
    start = time.time()
    ks = [int(v) for v in a.k.split(",")]
    ms = [int(v) for v in a.m.split(",")]
    dev = torch.device("cuda")
    sms, l2 = sm_count(dev), l2_bytes(dev)
    first = ("Llama-3.1-8B", "Qwen2.5-7B", "Qwen3-8B")  # the end-to-end models' launches first
    jobs = sorted(shapes(), key=lambda j: j[0] not in first)
    print(torch.cuda.get_device_name(dev), sms, "SMs;", len(jobs), "shapes", flush=True)
    prebuild(jobs, ks, ms, dev, sms)
    results = []
    for model, name, N, K in jobs:
        if time.time() - start > a.budget_s:
            print(f"budget: stopped before {model} {name}", flush=True)
            break
        for k in ks:
            for M in ms:
                t0 = time.time()
                rows, ship = run_point(N, K, k, M, name == "gate_up", l2, dev)
                torch.cuda.empty_cache()
                results.append(dict(model=model, layer=name, N=N, K=K, k=k, M=M, shipped_config=ship, rows=rows))
                ok = {n: r["us"] for n, r in rows.items() if r.get("us") is not None and n.startswith("k3")}
                best = min(ok, key=ok.get) if ok else None
                print(f"{model:>24} {name:>7} {N}x{K} k={k} M={M}: shipped {rows['shipped'].get('us')} "
                      f"[{ship}] unfused {rows['unfused'].get('us')} plain {rows['plain'].get('us')} best "
                      f"{best} {ok.get(best)} ({time.time() - t0:.1f} s)", flush=True)
                with open(a.out, "w") as f:
                    json.dump(dict(gpu=torch.cuda.get_device_name(dev), sms=sms,
                                   commit=os.environ.get("KBIT_COMMIT"), results=results), f, indent=1)
    # short table: per (k) geomean of best / shipped and unfused / shipped
    print("\n| k | M | points | best k3 / shipped (geomean, min) | unfused / shipped | shipped / plain |")
    print("|---|---|--:|--:|--:|--:|")
    for k in ks:
        for M in ms:
            pts = [r for r in results if r["k"] == k and r["M"] == M and r["rows"]["shipped"].get("us")]
            b, u, p = [], [], []
            for r in pts:
                s = r["rows"]["shipped"]["us"]
                ok = [v["us"] for n, v in r["rows"].items() if n.startswith("k3") and v.get("us")]
                if ok:
                    b.append(min(ok) / s)
                if r["rows"]["unfused"].get("us"):
                    u.append(r["rows"]["unfused"]["us"] / s)
                if r["rows"]["plain"].get("us"):
                    p.append(s / r["rows"]["plain"]["us"])
            gm = (lambda v: statistics.geometric_mean(v) if v else float("nan"))
            print(f"| {k} | {M} | {len(pts)} | {gm(b):.3f}, {min(b, default=float('nan')):.3f} | {gm(u):.3f} | "
                  f"{gm(p):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
