"""Memory safety on the GPU: the grouped ops (GEMV, grouped GEMM kernels 1 / 4 / 7, the MoE layer) with out-of-range
ids, and the dense kernels at odd shapes, meant to run under compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=src compute-sanitizer --tool memcheck --print-limit 20 \
        python lab/sanitize_grouped.py [--quick]

(without PyTorch's caching allocator, so that an access past a tensor leaves its allocation and memcheck sees it).

Every case runs, is synchronised and checked (no fault; rows of bad ids NaN, the others finite; the device error
flag set and cleared by ``kbit.ops._ids.check_errors``; dense outputs against the float32 reference). Prints one
line a case and a summary last; the exit status is the number of failed cases. memcheck's own report (``ERROR
SUMMARY: 0 errors``) comes after it. Sizes are small: memcheck makes kernels ~100x slower, and Triton compiles
every config once.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import kbit  # noqa: E402
from kbit.dispatch.moe import MoePlan, moe_experts  # noqa: E402
from kbit.ops import _ids  # noqa: E402
from kbit.ops import gemv as G  # noqa: E402
from kbit.ops import grouped_mma as GR  # noqa: E402
from kbit.ops.mma.common import kernels_available  # noqa: E402
from kbit.ops.moe import combine  # noqa: E402
from kbit.ops.moe_align import MoeRouting, align  # noqa: E402
from kbit.tuning import mma as TM  # noqa: E402
from kbit.tuning.gemv import GemvConfig  # noqa: E402
from kbit.tuning.moe import WgmmaGroupedConfig, grouped_mma_config  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def case(name):
    def wrap(fn):
        def run(*a, **kw):
            label = name.format(*a, **kw)
            t0 = time.time()
            try:
                fn(*a, **kw)
                torch.cuda.synchronize()
                RESULTS.append((label, True, ""))
                print(f"ok    {label} ({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:  # report and go on: one summary for the lead
                RESULTS.append((label, False, f"{type(e).__name__}: {e}"))
                print(f"FAIL  {label}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
        return run
    return wrap


def stack(E, N, K, k=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(-(2**31), 2**31 - 1, (E, N, K * k // 32), generator=g, dtype=torch.int32, device="cuda")
    scales = torch.randint(0, 64, (E, N, K // 32), generator=g, dtype=torch.uint8, device="cuda")
    ts = torch.rand(E, generator=g, device="cuda") + 0.5
    cb = torch.sort(torch.rand(2**k, generator=g, device="cuda") * 2 - 1).values
    return codes, scales, ts, cb


def routing(T, top_k, E, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, E, (T * top_k,), generator=g, device="cuda", dtype=torch.int32)
    tok = torch.arange(T * top_k, device="cuda", dtype=torch.int32) // top_k
    ids, order = torch.sort(ids, stable=True)
    return tok[order].contiguous(), ids.contiguous()


def spoil(tok, exp, E):
    """Copies with a negative expert first, a huge token id, INT_MIN, an expert past E last (sorted rows stay
    sorted, as ``align`` sorts bad ids); returns them and the bad rows."""
    tok, exp = tok.clone(), exp.clone()
    exp[0], tok[1], tok[2], exp[-1] = -1, 1000000, -2**31, E + 1000
    return tok, exp, [0, 1, 2, tok.shape[0] - 1]


def expect_bad_rows(y, bad):
    nan = torch.isnan(y.float()).all(dim=1)
    want = torch.zeros_like(nan)
    want[bad] = True
    if not torch.equal(nan, want):
        raise AssertionError(f"NaN rows {nan.nonzero().flatten().tolist()[:8]}, expected {bad}")
    if not torch.isfinite(y[~want].float()).all():
        raise AssertionError("a row of good ids is not finite")


def expect_flag(what="expert_ids"):
    try:
        _ids.check_errors()
    except ValueError as e:
        if what not in str(e):
            raise AssertionError(f"flag message without {what!r}: {e}") from None
        return
    raise AssertionError("the error flag was not set")


# ------------------------------------------------------------------------------------------------ grouped


@case("grouped_gemv T={0} cfg={1}")
def grouped_gemv(T, cfg):
    E, N, K = 16, 272, 544
    codes, scales, ts, cb = stack(E, N, K)
    tok, exp = routing(T, 8, E)
    x = torch.randn(T, K, device="cuda").bfloat16()
    btok, bexp, bad = spoil(tok, exp, E)
    config = None if cfg == "auto" else (GemvConfig(BN=8, G=2, num_warps=4) if cfg == "v2" else
                                         GemvConfig(BN=4, G=32, num_warps=4, num_stages=4, pps=8, pipelined=True))
    y = G.grouped_gemv(x, btok, bexp, codes, scales, ts, cb, k=4, N=N, K=K, config=config)
    torch.cuda.synchronize()
    expect_bad_rows(y, bad)
    expect_flag()


@case("grouped_linear T={0} kernel={1}")
def grouped_linear(T, kernel):
    E, N, K = 16, 336, 1280
    codes, scales, ts, cb = stack(E, N, K)
    tok, exp = routing(T, 4, E)
    x = torch.randn(T, K, device="cuda").bfloat16()
    btok, bexp, bad = spoil(tok, exp, E)
    kw = dict(k=4, blocksize=32, scale_format="log8", N=N, K=K)
    if kernel == "auto":
        y = GR.grouped_linear(x, btok, bexp, codes, scales, ts, cb, sorted_rows=True, **kw)
    elif kernel == "7":
        cfg = WgmmaGroupedConfig(warps=16, groups=8, stages=4, raster=8, x_swizzle=True, x_bulk=1)
        y = GR.grouped_linear(x, btok, bexp, codes, scales, ts, cb, sorted_rows=True, config=cfg, **kw)
    else:
        cfg = grouped_mma_config(2, -(-K // 256), kernel=int(kernel))
        y = GR.grouped_linear(x, btok, bexp, codes, scales, ts, cb, config=cfg, **kw)
    torch.cuda.synchronize()
    expect_bad_rows(y, bad)
    expect_flag()


@case("moe_experts T={0} plan={1} repacked={2}")
def moe_layer(T, plan, repacked):
    E, H, I, top_k = 64, 512, 256, 4
    g = torch.Generator().manual_seed(T)
    m = kbit.KbitMoE.from_float(torch.randn(E, 2 * I, H, generator=g) / H**0.5,
                                torch.randn(E, H, I, generator=g) / I**0.5, top_k=top_k, k=4,
                                dtype=torch.bfloat16).cuda()
    if repacked:
        m.repack_for_kernels()
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, top_k), device="cuda", dtype=torch.int32)
    ids[0, 0], ids[T - 1, top_k - 1] = E + 100, -5
    p = None if plan == "auto" else MoePlan(plan, plan)
    out = moe_experts(x, align(ids, E), *m.kernel_weights(), p)
    torch.cuda.synchronize()
    nan = torch.isnan(out.float()).all(dim=1)
    if not (nan[0] and nan[T - 1]) or (T > 2 and not torch.isfinite(out[1:T - 1].float()).all()):
        raise AssertionError(f"NaN tokens {nan.nonzero().flatten().tolist()[:8]}, expected [0, {T - 1}]")
    expect_flag()
    m(x, torch.randn(T, E, device="cuda").bfloat16())  # the layer itself (router ids valid by construction): no flag
    torch.cuda.synchronize()
    _ids.check_errors()


@case("combine with bad pair_rows")
def combine_bad():
    r = align(torch.randint(0, 8, (5, 2), device="cuda", dtype=torch.int32), 8)
    pr = r.pair_rows.clone()
    pr[3] = 10**6
    out = combine(torch.randn(10, 64, device="cuda"), MoeRouting(**{**r.__dict__, "pair_rows": pr}))
    torch.cuda.synchronize()
    if not torch.isnan(out[1]).all() or torch.isnan(out[[0, 2, 3, 4]]).any():
        raise AssertionError("combine: token 1 must be NaN, the others finite")
    expect_flag("pair_rows")


@case("sample edge rows")
def sample_edges():
    x = torch.randn(5, 1003, device="cuda")
    x[0, 17] = math.inf
    x[1] = math.nan
    x[2] = -math.inf
    x[3] = torch.where(torch.rand(1003, device="cuda") < 0.1, 3e38, -3e38)
    tok = kbit.sample(x, temperature=torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-38], device="cuda"), seed=1)
    t = tok.tolist()
    if t[0] != 17 or t[1] != -1 or t[2] != -1 or x[3, t[3]] <= 0 or t[4] != int(x[4].argmax()):
        raise AssertionError(f"tokens {t}")
    expect_flag("logits")


# ------------------------------------------------------------------------------------------------ dense


@case("dense N={0} K={1} M={2} repacked={3}")
def dense(N, K, M, repacked):
    g = torch.Generator().manual_seed(N * 7 + K)
    lin = kbit.KbitLinear.from_weight(kbit.quantize(torch.randn(N, K, generator=g).cuda(), k=4),
                                      torch.randn(N, generator=g).cuda(), dtype=torch.bfloat16)
    if repacked:
        lin.repack_for_kernels()
    x = torch.randn(M, K, generator=g).cuda().bfloat16()
    y = lin(x)
    torch.cuda.synchronize()
    ref = x.float() @ kbit.dequantize(lin.weight(), torch.float32).T + lin.bias.float()
    if not torch.isfinite(y.float()).all():
        raise AssertionError("non-finite output")
    err = ((y.float() - ref).norm() / ref.norm()).item()
    if err > 2e-2:
        raise AssertionError(f"relative error {err:.3g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer cases (a first look)")
    a = ap.parse_args()
    _ids.check_errors()
    for T in (1, 4) if a.quick else (1, 4, 64):
        for cfg in ("auto", "v2", "v3"):
            grouped_gemv(T, cfg)
    if kernels_available("cuda"):
        kernels = ["auto", "1", "4"] + (["7"] if TM.large_ok("cuda") else [])
        for T in (1, 64) if a.quick else (1, 16, 64, 600):
            for kern in kernels:
                grouped_linear(T, kern)
    moe_cases = [(1, "auto", False), (1, "gemv", False), (64, "gemm", False), (300, "grouped_mm", False),
                 (1, "gemm", True), (64, "gemm", True), (2048, "gemm", True), (2048, "auto", False)]
    for T, plan, rep in moe_cases[:3] if a.quick else moe_cases:
        moe_layer(T, plan, rep)
    combine_bad()
    sample_edges()
    shapes = [(17, 200), (100, 300), (250, 1000), (333, 4500)]
    for N, K in shapes[:2] if a.quick else shapes:
        for M in (1, 3, 17) if a.quick else (1, 3, 17, 65, 300):
            for rep in (False, True):
                dense(N, K, M, rep)
    bad = [r for r in RESULTS if not r[1]]
    print(f"\nsanitize_grouped: {len(RESULTS) - len(bad)}/{len(RESULTS)} cases ok on {torch.cuda.get_device_name()}")
    for name, _, why in bad:
        print(f"  FAIL {name}: {why}")
    return len(bad)


if __name__ == "__main__":
    sys.exit(main())
