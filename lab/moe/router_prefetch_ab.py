"""GPU lab: the fused router that loads its weight chunk before the PDL wait (``router_route_kernel`` of this tree,
``kbit.dispatch.moe.route_hidden``) against the two launches it replaces (cuBLAS ``F.linear`` + ``route_topk``,
the path ``KbitMoE.forward`` takes when given ``router_logits``) and against the reverted 328df54 kernel (a
lab-local copy below: the same launch reading its weight after the wait, 512 columns at a time).

    PYTHONUNBUFFERED=1 PYTHONPATH=src python lab/moe/router_prefetch_ab.py [--ts 1,2,8,16]
        [--shapes qwen3-30b-a3b,gpt-oss-20b,qwen3-235b-a22b] [--reps 30] [--sweep] [--out DIR]

1. Correctness, at each shape and T: the fused launch's pairs (weights, ids, tokens, rows) bit-identical to
   ``route_pairs`` on its own logits, its logits against ``F.linear``'s (bf16 ulps), its pairs against the
   unfused path's (identical wherever the logits are), the same for an expert-parallel range
   (``experts=(E/2, E)``), the counters zero after; the layer output of ``KbitMoE(x)`` (fused) equal to
   ``KbitMoE(x, fused logits)`` and within bf16 tolerance of ``KbitMoE(x, F.linear(x, w))`` (unfused).
2. Timing, one process, CUDA graphs, PDL on, the three paths interleaved replay by replay (median of ``--reps``):
   ``route``: ``layers`` x [add_rms_norm -> router product + routing], a distinct router weight a layer (their
   total over 2x L2, so they come from HBM as in a step); ``layer``: 48 x [add_rms_norm -> the whole KbitMoE
   layer] (k = 4, one expert stack shared by the layers, a router weight each). Per-layer us, and the ratio
   against the unfused path. ``--sweep``: the route chain at T = 1 for other ``FusedRouterConfig`` too.

Writes ``router_prefetch_ab.json`` / ``.log`` under ``--out`` (default ``$OUT``, else nowhere); prints the table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kbit.nn.moe as nn_moe  # noqa: E402
from kbit.bench.timing import l2_bytes  # noqa: E402
from kbit.dispatch.moe import _pairs_routing, _router_blocks, route, route_hidden  # noqa: E402
from kbit.kernels.glue import _pdl_enter  # noqa: E402
from kbit.kernels.moe import _route_row  # noqa: E402
from kbit.nn.moe import KbitMoE  # noqa: E402
from kbit.ops.glue import add_rms_norm  # noqa: E402
from kbit.ops.moe_router import route_pairs, route_pairs_hidden  # noqa: E402
from kbit.ops.pdl import launch_kw  # noqa: E402
from kbit.tuning.moe import FusedRouterConfig, fused_router_config  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(H=2048, E=128, top_k=8, I=768),
    "gpt-oss-20b": dict(H=2880, E=32, top_k=4, I=2880),  # its expert shapes; SwiGLU without gpt-oss's clamp/bias
    "qwen3-235b-a22b": dict(H=4096, E=128, top_k=8, I=1536),
}
LAYER_CHAIN = 48  # layers of the whole-layer chain (Qwen3-30B-A3B's depth)
DEV = "cuda"
T0 = time.time()
LOG = []


def log(*a):
    s = " ".join(str(v) for v in a)
    print(s, flush=True)
    LOG.append(s)


# ------------------------------------------------------------------------ the reverted kernel (328df54), verbatim
@triton.jit
def router_route_kernel_328df54(x_ptr, wr_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr,
                                blk_ptr, nblk_ptr, E, H, stride_x, scaling, start, stop, TOP_K: tl.constexpr,
                                SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                                LOCAL: tl.constexpr, RUNS: tl.constexpr, BLOCK_E: tl.constexpr,
                                BLOCK_K: tl.constexpr, CHUNK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                                PDL: tl.constexpr):
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    er = tl.program_id(1) * CHUNK_E + tl.arange(0, CHUNK_E)
    eok = er < E
    acc = tl.zeros([CHUNK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hok = hh < H
        xv = tl.load(x_ptr + t * stride_x + hh, mask=hok, other=0.0).to(tl.float32)
        wv = tl.load(wr_ptr + er[:, None].to(tl.int64) * H + hh[None, :], mask=eok[:, None] & hok[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    tl.store(logits_ptr + t * E + er, acc.to(logits_ptr.dtype.element_ty), mask=eok)
    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        x = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
        _route_row(x, t, e, ok, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr, blk_ptr, nblk_ptr, E, scaling, start,
                   stop, TOP_K, SIGMOID, HAS_BIAS, RENORM, LOCAL, RUNS, BLOCK_E, BLOCK_K)


def route_hidden_328df54(hidden, router_weight, counters, plan, *, top_k, router="softmax", renormalize=True,
                         correction_bias=None, scaling=1.0, experts=None):
    """``kbit.dispatch.moe.route_hidden`` launching the 328df54 kernel (8 experts a program, 512-column tiles
    after the wait, 4 warps); softmax router without bias only (what this lab runs)."""
    assert router == "softmax" and correction_bias is None
    T, H = hidden.shape
    E = router_weight.shape[0]
    dev = hidden.device
    blocks = _router_blocks(T, top_k, plan, dev)
    logits = torch.empty(T, E, dtype=hidden.dtype, device=dev)
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    tok = torch.empty(T * top_k, dtype=torch.int32, device=dev)
    rows = torch.empty_like(tok)
    start, stop = experts if experts is not None else (0, E)
    blk, nblk = blocks if blocks is not None else (ids, ids)
    router_route_kernel_328df54[(T, -(-E // 8))](
        hidden, router_weight, logits, counters, w, w, ids, tok, rows, blk, nblk, E, H, hidden.stride(0),
        float(scaling), start, stop, TOP_K=top_k, SIGMOID=False, HAS_BIAS=False, RENORM=bool(renormalize),
        LOCAL=experts is not None, RUNS=blocks is not None, BLOCK_E=max(16, 1 << (E - 1).bit_length()),
        BLOCK_K=max(2, 1 << (top_k - 1).bit_length()), CHUNK_E=8, BLOCK_H=512, num_warps=4, **launch_kw(dev))
    return _pairs_routing(w, ids, tok, rows, T, E if experts is None else stop - start, plan, blocks)


@contextmanager
def fused_328df54():
    """KbitMoE.forward with the 328df54 launch in place of this tree's (lab only)."""
    keep = nn_moe.route_hidden
    nn_moe.route_hidden = route_hidden_328df54
    try:
        yield
    finally:
        nn_moe.route_hidden = keep


# ------------------------------------------------------------------------------------------------ models
def build(name: str, n_router: int, seed: int = 0):
    s = SHAPES[name]
    E, H, I = s["E"], s["H"], s["I"]
    g = torch.Generator(device=DEV).manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, device=DEV, generator=g, dtype=torch.bfloat16) / H**0.5
    dn = torch.randn(E, H, I, device=DEV, generator=g, dtype=torch.bfloat16) / I**0.5
    wr = torch.randn(n_router, E, H, device=DEV, generator=g, dtype=torch.bfloat16) / H**0.5
    m = KbitMoE.from_float(gu, dn, top_k=s["top_k"], k=4, dtype=torch.bfloat16, router_weight=wr[0])
    del gu, dn
    torch.cuda.empty_cache()
    return m, wr


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between two bf16 tensors of finite values."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


def check(name: str, m: KbitMoE, wr: torch.Tensor, T: int) -> dict:
    s = SHAPES[name]
    E, top_k = s["E"], s["top_k"]
    g = torch.Generator(device=DEV).manual_seed(100 + T)
    x = torch.randn(T, s["H"], device=DEV, generator=g).bfloat16()
    w0 = wr[0]
    res = {"shape": name, "T": T}
    ok = True
    for experts in (None, (E // 2, E)):
        cnt = torch.zeros(16, dtype=torch.int32, device=DEV)
        blocks = (torch.empty(top_k + 1, dtype=torch.int32, device=DEV),
                  torch.empty(1, dtype=torch.int32, device=DEV)) if T == 1 else None
        logits, *pairs = route_pairs_hidden(x, w0, top_k, counters=cnt, experts=experts, blocks=blocks)
        own = route_pairs(logits, top_k, experts=experts)
        ref_logits = F.linear(x, w0)
        unf = route_pairs(ref_logits, top_k, experts=experts)
        # weights to float32 rounding: the fused launch sums the softmax over more warps, in another order
        same_own = (torch.allclose(pairs[0], own[0], rtol=1e-6, atol=1e-7)
                    and all(torch.equal(a, b) for a, b in zip(pairs[1:], own[1:], strict=True)))
        rows_same = ((pairs[1] == unf[1]).all(dim=1)
                     & torch.isclose(pairs[0], unf[0], rtol=1e-6, atol=1e-7).all(dim=1)).cpu()
        logits_same = (logits == ref_logits).all(dim=1).cpu()
        # a token whose logits are F.linear's bit for bit must route as the unfused path does
        consistent = bool((rows_same | ~logits_same).all())
        tag = "" if experts is None else "_ep"
        res[f"pairs_equal_own{tag}"] = same_own
        res[f"tokens_same_as_unfused{tag}"] = int(rows_same.sum())
        res[f"tokens_logits_bit_equal{tag}"] = int(logits_same.sum())
        res[f"logits_max_ulps{tag}"] = ulps(logits, ref_logits)
        res[f"counters_zero{tag}"] = int(cnt.abs().sum()) == 0
        res[f"consistent{tag}"] = consistent
        ok &= same_own and consistent and res[f"counters_zero{tag}"]  # (ulps: reported, cuBLAS's order of sums)
    m.router_weight = w0
    out = m(x)  # fused: no logits given
    fused_logits = route_pairs_hidden(x, w0, top_k, counters=torch.zeros(16, dtype=torch.int32, device=DEV))[0]
    out_own = m(x, fused_logits)
    out_unf = m(x, F.linear(x, w0))
    res["out_equal_fused_logits"] = torch.equal(out, out_own)
    err = (out.float() - out_unf.float()).abs().max().item()
    scale = out_unf.float().abs().max().item()
    res["out_max_abs_err_vs_unfused"] = err
    res["out_ok"] = err <= 2e-2 + 2e-2 * scale
    res["module_counters_zero"] = int(m._router_ws.abs().sum()) == 0
    ok &= res["out_equal_fused_logits"] and res["out_ok"] and res["module_counters_zero"]
    res["ok"] = bool(ok)
    return res


# ------------------------------------------------------------------------------------------------ timing
def chains(name: str, m: KbitMoE, wr: torch.Tensor, T: int, kind: str, n_layers: int, configs=()):
    """name -> a function running ``n_layers`` x [add_rms_norm -> routing (kind 'route') or the layer ('layer')]
    for each path; every path starts from the same inputs."""
    s = SHAPES[name]
    H, E, top_k = s["H"], s["E"], s["top_k"]
    g = torch.Generator(device=DEV).manual_seed(7)
    h0 = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    r0 = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    wn = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    plan = m.plan_for(T, None, torch.bfloat16, torch.device(DEV))
    cnt = torch.zeros(16, dtype=torch.int32, device=DEV)
    kw = dict(top_k=top_k, router=m.router, renormalize=m.norm_topk_prob)

    def run(path, cfg=None):
        def f():
            h, r = h0, r0
            for i in range(n_layers):
                w = wr[i % wr.shape[0]]
                y, r = add_rms_norm(h, r, wn, 1e-6)
                if kind == "route":
                    if path == "unfused":
                        route(F.linear(y, w), plan, E=E, **kw)
                    elif path == "fused-328df54":
                        route_hidden_328df54(y, w, cnt, plan, **kw)
                    elif cfg is None:
                        route_hidden(y, w, cnt, plan, **kw)
                    else:  # a pinned config: the launch route_hidden makes, with cfg's programs
                        blocks = _router_blocks(T, top_k, plan, y.device)
                        _, pw, ids, tok, rows = route_pairs_hidden(y, w, top_k, counters=cnt, blocks=blocks,
                                                                   config=cfg)
                        _pairs_routing(pw, ids, tok, rows, T, E, plan, blocks)
                    h = y
                else:
                    m.router_weight = w
                    if path == "unfused":
                        h = m(y, F.linear(y, w))
                    elif path == "fused-328df54":
                        with fused_328df54():
                            h = m(y)
                    else:
                        h = m(y)
            return h
        return f

    out = {p: run(p) for p in ("unfused", "fused-328df54", "fused")}
    for c in configs:
        out[f"fused c{c.chunk_e}/h{c.block_h}/w{c.num_warps}"] = run("fused", c)
    return out


def time_paths(fns: dict, n_layers: int, reps: int) -> dict:
    graphs = {}
    for p, f in fns.items():
        f()  # compile, allocate, repack outside the capture
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            f()
        graphs[p] = graph
    times = {p: [] for p in graphs}
    for _ in range(3):
        for gph in graphs.values():
            gph.replay()
    torch.cuda.synchronize()
    for _ in range(reps):
        for p, gph in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            gph.replay()
            b.record()
            b.synchronize()
            times[p].append(a.elapsed_time(b) * 1000 / n_layers)
    del graphs
    return {p: statistics.median(v) for p, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,2,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("router_prefetch_ab: needs a CUDA GPU")
        return 0
    ts = [int(t) for t in args.ts.split(",")]
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    l2 = l2_bytes()
    checks, rows = [], []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        router_bytes = s["E"] * s["H"] * 2
        n_route = min(400, max(LAYER_CHAIN, math.ceil(2 * l2 / router_bytes)))
        m, wr = build(name, n_route)
        c = fused_router_config(s["E"], s["H"])
        log(f"[{time.time() - T0:.0f}s] {name}: {s}, fused config {c}, route chain {n_route} layers")
        for T in ts:
            r = check(name, m, wr, T)
            checks.append(r)
            log(f"check {name} T={T}: {'ok' if r['ok'] else 'FAIL'} {r}")
        for T in ts:
            for kind, n in (("route", n_route), ("layer", LAYER_CHAIN)):
                sweep = ()
                if args.sweep and kind == "route" and T == 1:
                    sweep = [FusedRouterConfig(ce, c.block_h, nw) for ce in (1, 2, 4, 8) for nw in (4, 8)
                             if (ce, nw) != (c.chunk_e, c.num_warps) and ce * c.block_h <= 32768]
                us = time_paths(chains(name, m, wr, T, kind, n, sweep), n, args.reps)
                base = us["unfused"]
                for p, v in us.items():
                    rows.append(dict(shape=name, T=T, chain=kind, path=p, us=v, ratio=v / base))
                log(f"[{time.time() - T0:.0f}s] {name} T={T} {kind}: " +
                    ", ".join(f"{p} {v:.2f}" for p, v in us.items()))
        del m, wr
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "router_prefetch_ab.json").write_text(json.dumps(dict(checks=checks, rows=rows), indent=1))
        (Path(args.out) / "router_prefetch_ab.log").write_text("\n".join(LOG) + "\n")
    print()
    print(f"checks: {sum(r['ok'] for r in checks)}/{len(checks)} ok")
    print("us a layer (median of replays), ratio to the unfused path; route = add_rms_norm + routing, "
          "layer = add_rms_norm + KbitMoE layer")
    print(f"{'shape':16} {'T':>3} {'chain':6} {'path':28} {'us':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['shape']:16} {r['T']:>3} {r['chain']:6} {r['path']:28} {r['us']:8.2f} {r['ratio']:6.3f}")
    return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
