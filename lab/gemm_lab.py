# ruff: noqa: B023  (closures are called at once, inside the loop iteration)
"""GPU lab for the GEMM work (issue 4): correctness, dequant bandwidth, fused-config sweep, KbitLinear overhead.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src python lab/gemm_lab.py --out $OUT [--quick]

Correctness first (fresh random data every check, float64 references, outputs poisoned), then timings with
the harness method (``kbit.bench.timing.time_calls``: cold L2 by weight copies, CUDA-graph replay, median of
15). Writes ``gemm_lab.json`` (every timing) and ``gemm_h100.json`` (the best kernel + config per shape, k and
M bucket, in the dispatch table format) under --out; prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from kbit.tuning.dispatch import GemmConfig, m_bucket

import kbit
from kbit.bench.run import clone_weight
from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls
from kbit.format.reference import dequantize_reference
from kbit.ops.dequant import dequantize_triton
from kbit.ops.gemm import dequant_mm, gemm_fused, gemm_reference, linear

SHAPES = ((28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672))
MS = (16, 32, 64, 128, 256, 1024, 4096)
BF = torch.bfloat16


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def kw(qw):
    return dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.shape[-2], K=qw.shape[-1])


def rel(y, r):
    y = y.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - r).norm() / r.norm())


# ------------------------------------------------------------------------------------------ correctness
def check_dequant():
    bad = 0
    for k in (2, 3, 4, 5):
        for B, sf in ((32, "log8"),):
            for shape in ((2, 96, 1024),):
                qw = kbit.quantize(torch.randn(*shape, device="cuda"), k=k, blocksize=B, scale_format=sf)
                for dt in (BF,):
                    ref = dequantize_reference(qw, dt)
                    out = torch.full(qw.shape, float("nan"), dtype=dt, device="cuda")
                    got = dequantize_triton(qw, dt, out=out)
                    ok = torch.equal(got, ref)
                    if not ok:
                        bad += 1
                        log(f"DEQUANT MISMATCH k={k} B={B} {sf} {shape} {dt}")
    log(f"dequant bit-exact: {'PASS' if bad == 0 else f'FAIL ({bad})'}")
    return bad == 0


def fused_configs(M):
    if M <= 64:
        bm = max(16, min(64, 1 << (M - 1).bit_length()))
        return [GemmConfig(BM=bm, BN=128, BK=128, SWAP=True, num_warps=4, num_stages=3),
                GemmConfig(BM=bm, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=4)]
    if M <= 128:
        return [GemmConfig(BM=64, BN=128, BK=64, SWAP=True, num_warps=4, num_stages=3),
                GemmConfig(BM=128, BN=128, BK=64, SWAP=False, num_warps=8, num_stages=3)]
    return [GemmConfig(BM=128, BN=128, BK=64, SWAP=False, num_warps=8, num_stages=3),
            GemmConfig(BM=128, BN=256, BK=64, SWAP=False, num_warps=8, num_stages=3)]


def check_gemm(ms_cfg):
    """Every k through the dispatcher (odd shapes, bias, both dtypes); the sweep's fused configs at k = 4."""
    bad = 0
    worst = 0.0
    cases = []
    for k in (2, 3, 4, 5):
        cases.append((k, 1000, 1000, 32, "log8", BF, (1, 5, 9, 100, 1000), False))
    cases.append((4, 333, 520, 64, "fp16", torch.float16, (3, 17, 300), False))
    cases.append((3, 512, 1024, 128, "log8", torch.float16, (8, 33), False))
    cases.append((4, 1000, 1024, 32, "log8", BF, (17, 100, 1000), True))
    for (k, N, K, B, sf, dt, ms, sweep_cfgs) in cases:
        qw = kbit.quantize(torch.randn(N, K, device="cuda"), k=k, blocksize=B, scale_format=sf)
        bias = None if sweep_cfgs else torch.randn(N, device="cuda")
        for M in ms:
            x = torch.randn(M, K, device="cuda").to(dt)
            r = gemm_reference(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw(qw), bias=bias)
            outs = {"linear": linear(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw(qw), bias=bias)}
            if M > 8:
                outs["dequant_mm"] = dequant_mm(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw(qw),
                                                bias=bias)
                outs["fused"] = gemm_fused(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw(qw),
                                           bias=bias)
            if sweep_cfgs:
                for i, cfg in enumerate(ms_cfg(M)):
                    outs[f"fused{i}"] = gemm_fused(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw(qw),
                                                   config=cfg)
            for name, y in outs.items():
                e = rel(y, r)
                worst = max(worst, e)
                if not e < 1e-2:
                    bad += 1
                    log(f"GEMM ERR {name} k={k} {N}x{K} B={B} {sf} {dt} M={M}: {e:.3e}")
    log(f"gemm vs float64: {'PASS' if bad == 0 else f'FAIL ({bad})'} (worst rel err {worst:.2e})")
    return bad == 0


# ------------------------------------------------------------------------------------------ timing
def copies(qw, extra=0):
    nb = qw.codes.numel() * 4 + qw.scales.numel() * qw.scales.element_size() + extra
    n = copies_for_cold_l2(nb, l2_bytes())
    return [qw] + [clone_weight(qw) for _ in range(n - 1)]


def t_us(fn_of_weight, weights):
    return time_calls([lambda w=w: fn_of_weight(w) for w in weights]).us


def dequant_bw(rows):
    for (N, K) in SHAPES[:2]:
        for k in (2, 3, 4, 5):
            qw = kbit.quantize(torch.randn(N, K, device="cuda", dtype=BF), k=k)
            ws = copies(qw)
            outs = [torch.empty(N, K, dtype=BF, device="cuda") for _ in range(2)]
            us = time_calls([lambda w=w, i=i: dequantize_triton(w, BF, out=outs[i % 2])
                             for i, w in enumerate(ws)]).us
            nb = qw.codes.numel() * 4 + qw.scales.numel() + 2 * N * K
            rows.append(dict(what="dequant", N=N, K=K, k=k, us=us, tbps=nb / us / 1e6))
            log(f"dequant {N}x{K} k={k}: {us:8.1f} us {nb / us / 1e6:5.2f} TB/s")
            del ws


def sweep(rows, ks, ms, full_k=4, t0=0.0, budget=1e9):
    best = {}
    for (N, K) in SHAPES:
        if time.time() - t0 > budget:
            log(f'budget: skip {N}x{K}')
            continue
        W = torch.randn(N, K, device="cuda", dtype=BF) * 0.02
        wb = [W] + [W.clone() for _ in range(copies_for_cold_l2(2 * N * K, l2_bytes()) - 1)]
        bf = {}
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=BF)
            bf[M] = t_us(lambda w: F.linear(x, w), wb)
            rows.append(dict(what="bf16", N=N, K=K, M=M, us=bf[M]))
        del wb
        for k in ks:
            qw = kbit.quantize(W, k=k)
            ws = copies(qw)
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=BF)
                cands = {"dequant_mm": (lambda w: dequant_mm(x, w.codes, w.scales, w.tensor_scale, w.codebook,
                                                             **kw(w)), None)}
                cfgs = fused_configs(M)
                if k != full_k:
                    prev = best.get((N, K, full_k, M))
                    cfgs = [GemmConfig(**prev[1])] if prev and prev[0] == "fused" else cfgs[:1]
                for i, cfg in enumerate(cfgs):
                    cands[f"fused{i}"] = (lambda w, cfg=cfg: gemm_fused(x, w.codes, w.scales, w.tensor_scale,
                                                                        w.codebook, **kw(w), config=cfg), cfg)
                res = {}
                ref = None
                if M <= 256:
                    ref = F.linear(x.double(), dequantize_reference(qw, torch.float64))
                for name, (fn, cfg) in cands.items():
                    try:
                        if ref is not None:
                            e = rel(fn(qw), ref)
                            if not e < 1e-2:
                                log(f"  ERR {name} {N}x{K} k={k} M={M}: rel err {e:.2e}")
                                rows.append(dict(what="error", name=name, N=N, K=K, k=k, M=M, err=e))
                        us = t_us(fn, ws)
                    except Exception as e:  # noqa: BLE001
                        log(f"  FAIL {name} {N}x{K} k={k} M={M}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    res[name] = us
                    rows.append(dict(what=name, N=N, K=K, k=k, M=M, us=us, bf16_us=bf[M],
                                     config=asdict(cfg) if cfg else None))
                name = min(res, key=res.get)
                cfg = cands[name][1]
                best[(N, K, k, M)] = ("fused" if cfg else "dequant_mm", asdict(cfg) if cfg else None, res[name])
                log(f"{N}x{K} k={k} M={M:<5} bf16 {bf[M]:8.1f}  " + "  ".join(
                    f"{n} {u:8.1f}" for n, u in res.items()) + f"  best {name} x{bf[M] / res[name]:.2f}")
            del ws
        torch.cuda.empty_cache()
    return best


def table_json(best):
    out = {"_source": "lab/gemm_lab.py sweep on H100 (cold L2, graph replay, median of 15)", "dense": {}}
    for (N, K, k, M), (kernel, cfg, us) in best.items():
        entry = {"kernel": kernel, "_us": round(us, 2)}
        if cfg:
            entry.update(cfg)
        out["dense"].setdefault(str(k), {}).setdefault(f"{N}x{K}", {})[str(m_bucket(M))] = entry
    return out


# ------------------------------------------------------------------------------------------ overhead
def overhead(rows):
    from kbit.nn import KbitLinear
    from kbit.ops.gemv import gemv
    for (N, K) in ((512, 512), (4096, 4096)):
        lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=BF)
        q = KbitLinear.from_linear(lin, k=4)
        qw = q.weight()
        x = torch.randn(1, K, device="cuda", dtype=BF)

        def bare():
            return gemv(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw(qw))

        res = {}
        for name, fn in (("bare_gemv", bare), ("KbitLinear", lambda: q(x)), ("bare_gemv2", bare),
                         ("KbitLinear2", lambda: q(x))):
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            n = 2000
            t = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            res[name] = (time.perf_counter() - t) / n * 1e6
        # graph replay == eager
        xs = torch.randn(3, 1, K, device="cuda", dtype=BF)
        eager = [q(xs[i]).clone() for i in range(3)]
        static_x = xs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            q(static_x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = q(static_x)
        same = True
        for i in range(3):
            static_x.copy_(xs[i])
            g.replay()
            torch.cuda.synchronize()
            same &= torch.equal(static_y, eager[i])
        extra = min(res["KbitLinear"], res["KbitLinear2"]) - min(res["bare_gemv"], res["bare_gemv2"])
        rows.append(dict(what="overhead", N=N, K=K, **res, extra_us=extra, graph_equal=bool(same)))
        log(f"overhead {N}x{K} M=1: " + " ".join(f"{k} {v:.1f}us" for k, v in res.items())
            + f" extra {extra:.1f} us; graph replay == eager: {same}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--ks", default="4,2")
    ap.add_argument("--budget-s", type=float, default=280)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    t0 = time.time()
    ok = True
    if not args.skip_check:
        ok = check_dequant()
        log(f"checks {time.time() - t0:.0f} s")
    overhead(rows)
    dequant_bw(rows)
    log(f"dequant bw done {time.time() - t0:.0f} s")
    ks = [int(v) for v in args.ks.split(",")]
    best = sweep(rows, ks, MS, t0=t0, budget=args.budget_s)
    json.dump(dict(checks_passed=ok, rows=rows), open(f"{args.out}/gemm_lab.json", "w"), indent=1)
    json.dump(table_json(best), open(f"{args.out}/gemm_h100.json", "w"), indent=1)
    print(f"\nchecks passed: {ok}; total {time.time() - t0:.0f} s")
    print("N x K | k | M | bf16 us | best | us | x bf16")
    for (N, K, k, M), (kernel, _cfg, us) in sorted(best.items()):
        b = next(r["us"] for r in rows if r["what"] == "bf16" and r["N"] == N and r["K"] == K and r["M"] == M)
        print(f"{N}x{K} | {k} | {M} | {b:.1f} | {kernel} | {us:.1f} | {b / us:.2f}")
    for r in rows:
        if r["what"] in ("dequant", "overhead"):
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
