"""KbitMoE and its ops: routing and alignment exact against loops, the fused activation and combine kernels,
the whole layer against a float64 reference and against Hugging Face's own blocks (Triton interpreter on the
CPU, tiny shapes); on the GPU (marked ``gpu``): real model sizes, no host sync, CUDA graph == eager."""

import functools
import os
from dataclasses import dataclass

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # kernels run under the Triton interpreter; it must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kbit import options  # noqa: E402
from kbit.dispatch.moe import MoePlan, choose_plan, moe_experts  # noqa: E402
from kbit.format.reference import dequantize_reference  # noqa: E402
from kbit.nn.moe import KbitMoE, hf_parts  # noqa: E402
from kbit.ops.moe import (  # noqa: E402
    combine,
    combine_reference,
    moe_reference,
    relative_error,
    silu_mul_gate_up,
    silu_mul_gate_up_reference,
)
from kbit.ops.moe_align import align, align_reference, pair_order, sort_pairs  # noqa: E402
from kbit.ops.moe_router import route_pairs, select_experts, select_experts_reference  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
GEMV, MM = MoePlan("gemv", "gemv"), MoePlan("grouped_mm", "grouped_mm")
GEMM = MoePlan("gemm", "gemm")  # the grouped tensor-core kernel (CUDA); the grouped GEMV elsewhere


def _ids(T, top_k, E, gen, skew=False):
    if T == 0:
        return torch.zeros(0, top_k, dtype=torch.int32)
    if skew:  # most tokens on experts 0..top_k-1, so many experts are untouched
        return torch.stack([torch.randperm(min(E, top_k + 1), generator=gen)[:top_k] for _ in range(T)]).int()
    return torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).int()


def _stacks(E, H, I, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    dn = torch.randn(E, H, I, generator=g) / I**0.5
    return gu.to(device), dn.to(device)


def _dq(qw):
    """float32 weights: the Triton dequantizer on the GPU (bit-exact with the reference, less memory)."""
    if qw.device.type == "cuda":
        from kbit.ops.dequant import dequantize_triton

        return dequantize_triton(qw, torch.float32)
    return dequantize_reference(qw)


def _check_layer(m: KbitMoE, x, logits, plan=None, tol=1e-2):
    out = m(x, logits, plan=plan)
    r = m.route(logits, m.plan_for(x.shape[0], plan, x.dtype, x.device))  # the choice forward made
    ref = moe_reference(x, r.topk_weights, r.topk_ids, _dq(m.gate_up_weight()), _dq(m.down_weight()))
    assert out.dtype == x.dtype and out.shape == x.shape
    err = relative_error(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol} ({plan})"
    return out


# ------------------------------------------------------------------------------------------------ routing


@pytest.mark.parametrize("router,kw", [
    ("softmax", dict(renormalize=True)),
    ("softmax", dict(renormalize=False)),
    ("sigmoid", dict(renormalize=True, scaling=2.5)),
    ("sigmoid", dict(renormalize=False, n_group=4, topk_group=2)),
])
def test_select_experts_vs_reference(router, kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(13, 16, generator=g)
    if router == "sigmoid":
        kw = dict(kw, correction_bias=torch.randn(16, generator=g) * 0.1)
    w, ids = select_experts(logits, 4, router=router, **kw)
    w_ref, ids_ref = select_experts_reference(logits, 4, router=router, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-6, atol=1e-7)


def test_softmax_ties_and_selection_match_hf_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q

    if not hasattr(q, "Qwen3MoeTopKRouter"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3MoeTopKRouter")
    E = 12
    cfg = q.Qwen3MoeConfig(hidden_size=E, num_experts=E, num_experts_per_tok=3, norm_topk_prob=True)
    router = q.Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))  # logits = hidden
    logits = torch.randint(0, 3, (40, E)).float()  # many ties
    _, w_hf, ids_hf = router(logits)
    w, ids = select_experts(logits, 3, renormalize=True)
    assert torch.equal(ids.long(), ids_hf)
    torch.testing.assert_close(w, w_hf.float())


@pytest.mark.parametrize("router,T,E,top_k,kw", [
    ("softmax", 9, 16, 4, dict(renormalize=True)),
    ("softmax", 5, 12, 3, dict(renormalize=False)),
    ("softmax", 3, 60, 8, dict(renormalize=True, scaling=0.5)),
    ("sigmoid", 7, 16, 4, dict(renormalize=True, scaling=2.5, bias=True)),
    # top_k below its power of two: the padded slots must not enter the renormalisation
    ("sigmoid", 5, 24, 6, dict(renormalize=True, scaling=2.5, bias=True)),
    ("sigmoid", 4, 10, 1, dict(renormalize=False)),
    ("softmax", 0, 8, 2, dict(renormalize=True)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_pairs_vs_reference(router, T, E, top_k, kw, dtype):
    g = torch.Generator().manual_seed(T + E)
    logits = torch.randint(-3, 3, (T, E), generator=g).to(dtype) / 2  # many exact ties
    logits[:, ::3] += torch.randn(T, len(range(0, E, 3)), generator=g).to(dtype)
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["correction_bias"] = (torch.randn(E, generator=g) * 0.1).to(DEV)
    w, ids, tok, rows = route_pairs(logits.to(DEV), top_k, router=router, **kw)
    w_ref, ids_ref = select_experts_reference(logits, top_k, router=router, **kw)
    assert ids.dtype == tok.dtype == rows.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.double().cpu(), w_ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(tok.cpu(), torch.arange(T * top_k, dtype=torch.int32) // top_k)
    assert torch.equal(rows.cpu(), torch.arange(T * top_k, dtype=torch.int32))


@pytest.mark.parametrize("router,T,E,top_k,experts", [
    ("softmax", 5, 16, 4, (0, 8)),
    ("softmax", 7, 12, 8, (8, 12)),
    ("sigmoid", 3, 10, 3, (3, 7)),
    ("softmax", 4, 6, 6, (0, 6)),
    ("softmax", 0, 8, 2, (2, 5)),
])
def test_route_pairs_local_experts(router, T, E, top_k, experts):
    """``experts=(start, stop)``: the whole router's choice, written as that rank's pairs
    (``kbit.parallel.localize_pairs`` of the reference choice)."""
    from kbit.ops.moe_router import localize_pairs
    g = torch.Generator().manual_seed(T * E + top_k)
    logits = torch.randn(T, E, generator=g)
    w, ids, tok, rows = route_pairs(logits.to(DEV), top_k, router=router, experts=experts)
    w_ref, ids_ref = select_experts_reference(logits, top_k, router=router)
    lw, lid = localize_pairs(w_ref, ids_ref, *experts)
    assert torch.equal(ids.cpu(), lid)
    torch.testing.assert_close(w.double().cpu(), lw, rtol=1e-6, atol=1e-7)
    assert torch.equal(tok.cpu(), torch.arange(T * top_k, dtype=torch.int32) // top_k)
    with pytest.raises(ValueError, match=r"experts: expected \(start, stop\) with 0 <= start < stop <= E=8"):
        route_pairs(torch.randn(2, 8, device=DEV), 2, experts=(3, 9))


@pytest.mark.parametrize("E,top_k,experts", [(16, 4, None), (12, 8, None), (40, 12, (0, 3)), (20, 10, (15, 20)),
                                               (6, 1, None), (64, 8, (0, 32))])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_pairs_block_table(E, top_k, experts, seed):
    """``blocks=``: one token's block table in the router's launch, equal to ``block_table`` of its ids with 8-row
    blocks (runs longer than 8, from a rank with few local experts, are cut)."""
    from kbit.ops.moe_blocks import block_table_reference
    logits = torch.randn(1, E, generator=torch.Generator().manual_seed(seed)).to(DEV)
    blk = torch.full((top_k + 1,), -7, dtype=torch.int32, device=DEV)
    nblk = torch.full((1,), -7, dtype=torch.int32, device=DEV)
    _, ids, _, _ = route_pairs(logits, top_k, experts=experts, blocks=(blk, nblk))
    want = block_table_reference(ids.view(-1).cpu(), 8)
    n = int(nblk)
    assert n == len(want) - 1 and blk[:n + 1].tolist() == want


def test_route_pairs_block_table_errors():
    with pytest.raises(ValueError, match=r"blocks: the block table is written for one token \(T = 1\), got T = 2"):
        route_pairs(torch.randn(2, 8, device=DEV), 2, blocks=(torch.empty(3, dtype=torch.int32, device=DEV),
                                                              torch.empty(1, dtype=torch.int32, device=DEV)))
    with pytest.raises(ValueError, match=r"blocks: expected \(int32 \[3\], int32 \[1\]\)"):
        route_pairs(torch.randn(1, 8, device=DEV), 2, blocks=(torch.empty(3, dtype=torch.int64, device=DEV),
                                                              torch.empty(1, dtype=torch.int32, device=DEV)))


@pytest.mark.parametrize("T,E,H,top_k,router,experts,runs,config", [
    (1, 128, 256, 8, "softmax", None, True, None),
    (3, 12, 100, 3, "softmax", None, False, None),
    (1, 20, 64, 10, "sigmoid", (5, 9), True, None),
    (5, 64, 700, 6, "softmax", (32, 64), False, None),
    # pinned programs: one expert each (12 arrivals a token), a short last chunk, columns past H
    (3, 12, 100, 3, "softmax", None, False, (1, 128, 4)),
    (2, 20, 64, 10, "sigmoid", (5, 9), False, (8, 64, 2)),
    (1, 128, 256, 8, "softmax", (0, 64), True, (2, 512, 4)),
])
def test_route_pairs_hidden(T, E, H, top_k, router, experts, runs, config):
    """The router's product in the routing launch: logits as F.linear's (16-bit, up to the order of the sums),
    the choice on them as route_pairs makes it, the counters left zero for the next call; with the programs of
    kbit.tuning.moe.fused_router_config or pinned ones."""
    from kbit.ops.moe_router import route_pairs_hidden
    from kbit.tuning.moe import FusedRouterConfig
    config = None if config is None else FusedRouterConfig(*config)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16  # (bf16 arithmetic is not exact under the interpreter)
    g = torch.Generator().manual_seed(T * E + H)
    x, wr = torch.randn(T, H, generator=g).to(dt).to(DEV), (torch.randn(E, H, generator=g) / H**0.5).to(dt).to(DEV)
    counters = torch.zeros(16, dtype=torch.int32, device=DEV)
    blocks = (torch.empty(top_k + 1, dtype=torch.int32, device=DEV),
              torch.empty(1, dtype=torch.int32, device=DEV)) if runs else None
    for _ in range(2):  # a second call on the same counters
        logits, w, ids, tok, rows = route_pairs_hidden(x, wr, top_k, counters=counters, router=router,
                                                       experts=experts, blocks=blocks, config=config)
        ref = (x.double() @ wr.double().T).to(dt)
        assert logits.dtype == dt and logits.shape == (T, E)
        assert (logits.double() - ref.double()).abs().max().item() <= 2 * ref.double().abs().max().item() * 2**-7
        assert int(counters.abs().sum()) == 0
        w2, ids2, tok2, rows2 = route_pairs(logits, top_k, router=router, experts=experts)
        assert torch.equal(ids, ids2) and torch.equal(w, w2) and torch.equal(tok, tok2) and torch.equal(rows, rows2)
    if runs:
        from kbit.ops.moe_blocks import block_table_reference
        want = block_table_reference(ids.view(-1).cpu(), 8)
        assert blocks[0][:int(blocks[1]) + 1].tolist() == want
    with pytest.raises(ValueError, match=r"counters: expected int32 \[>= 1\]"):
        route_pairs_hidden(x[:1], wr, top_k, counters=counters.long())
    with pytest.raises(TypeError, match="hidden: expected a 2-D float16 / bfloat16 tensor"):
        route_pairs_hidden(x.float(), wr, top_k, counters=counters)
    with pytest.raises(ValueError, match="router_weight: expected"):
        route_pairs_hidden(x, wr[:, 1:], top_k, counters=counters)
    with pytest.raises(ValueError, match=r"config: expected block_h >= H"):
        route_pairs_hidden(x, wr, top_k, counters=counters, config=FusedRouterConfig(1, 32))
    with pytest.raises(TypeError, match="config: expected a FusedRouterConfig or None, got tuple"):
        route_pairs_hidden(x, wr, top_k, counters=counters, config=(1, 1024, 4))


@pytest.mark.parametrize("T,E,H,top_k,config", [(1, 128, 256, 8, None), (3, 12, 100, 3, None),
                                                 (2, 20, 64, 10, (8, 64, 2)), (5, 64, 700, 6, (1, 1024, 4))])
def test_route_pairs_hidden_add_norm(T, E, H, top_k, config):
    """The residual add and RMSNorm in the fused router's launch (``norm=``): the new residual exactly as
    kbit.ops.glue.add_rms_norm makes it, the normed rows to its rounding (an ulp: another order of the sum of
    squares), the logits and the choice as without the norm on those rows; hidden itself is left as it was."""
    from kbit.ops.glue import add_rms_norm
    from kbit.ops.moe_router import route_pairs_hidden
    from kbit.tuning.moe import FusedRouterConfig
    config = None if config is None else FusedRouterConfig(*config)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    g = torch.Generator().manual_seed(7 * T + E)
    x, res = (torch.randn(T, H, generator=g).to(dt).to(DEV) for _ in range(2))
    wr = (torch.randn(E, H, generator=g) / H**0.5).to(dt).to(DEV)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dt).to(DEV)
    x0, res0 = x.clone(), res.clone()
    counters = torch.zeros(16, dtype=torch.int32, device=DEV)
    logits, w, ids, tok, rows, y, r = route_pairs_hidden(x, wr, top_k, counters=counters, config=config,
                                                         norm=(res, nw, 1e-6))
    y_ref, r_ref = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(r, r_ref) and torch.equal(x, x0) and torch.equal(res, res0)
    assert (y.double() - y_ref.double()).abs().max().item() <= y_ref.double().abs().max().item() * 2**-7
    assert int(counters.abs().sum()) == 0
    plain = route_pairs_hidden(y, wr, top_k, counters=counters, config=config)
    assert (logits.double() - plain[0].double()).abs().max().item() <= logits.double().abs().max().item() * 2**-6
    w2, ids2, tok2, rows2 = route_pairs(logits, top_k)
    assert torch.equal(ids, ids2) and torch.equal(w, w2) and torch.equal(tok, tok2) and torch.equal(rows, rows2)
    with pytest.raises(ValueError, match="residual: expected shape"):
        route_pairs_hidden(x, wr, top_k, counters=counters, norm=(res[:0], nw, 1e-6))
    with pytest.raises(ValueError, match="eps: expected > 0"):
        route_pairs_hidden(x, wr, top_k, counters=counters, norm=(res, nw, 0.0))
    with pytest.raises(TypeError, match="norm: expected"):
        route_pairs_hidden(x, wr, top_k, counters=counters, norm=[res, nw, 1e-6])


@pytest.mark.parametrize("E,H", [(64, 2048), (128, 2048), (32, 2880), (128, 2880), (128, 4096), (256, 4096),
                                 (64, 7168), (256, 7168)])
def test_fused_router_config(E, H):
    """The fused router's programs for the brief's range (H 2048..7168, E 64..256, and gpt-oss's E = 32): whole
    rows, 64 weight elements a thread, at most 32 columns of x a thread, at least 2 experts a program (else
    ptxas spread x's loads between the sums), and one token's programs within one wave of a 132-SM H100."""
    from kbit.tuning.moe import fused_router_config
    c = fused_router_config(E, H)
    threads = 32 * c.num_warps
    assert c.block_h >= H and c.block_h < 2 * H and c.chunk_e >= 2
    assert c.chunk_e * c.block_h == 64 * threads and c.block_h <= 32 * threads
    assert -(-E // c.chunk_e) <= 132
    assert c.num_warps == (4 if H <= 4096 else 8)


def test_fused_router_config_errors():
    from kbit.tuning.moe import FusedRouterConfig, fused_router_config
    for bad in (dict(chunk_e=3, block_h=64), dict(chunk_e=1, block_h=0), dict(chunk_e=1, block_h=64, num_warps=6)):
        with pytest.raises(ValueError, match=r"FusedRouterConfig\.\w+: expected a power of two"):
            FusedRouterConfig(**bad)
    assert fused_router_config(4, 64).chunk_e == 4  # capped at the experts there are


def test_route_pairs_all_but_few_masked():
    """Fewer finite logits than top_k: the rest is filled with distinct experts (never one twice)."""
    logits = torch.full((2, 8), float("-inf"))
    logits[0, 5] = 1.0
    logits[1, [2, 6]] = 0.0
    _, ids, _, _ = route_pairs(logits.to(DEV), 3, renormalize=False)
    assert ids[0, 0] == 5 and ids[1, :2].tolist() == [2, 6]
    assert all(len(set(row)) == 3 for row in ids.tolist())


@pytest.mark.parametrize("router,renorm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_route_pairs_nan_logits_give_distinct_ids_in_range(router, renorm):
    """A NaN logit (a diverged activation): the token still gets top_k distinct experts in range (the grouped
    kernels read them unchecked) and NaN weights (its output is NaN, not a silent number); the other tokens route as
    with clean logits."""
    logits = torch.randn(3, 16)
    logits[0, 4] = float("nan")
    logits[1] = float("nan")
    w, ids, _, _ = route_pairs(logits.to(DEV), 4, router=router, renormalize=renorm)
    for t in range(3):
        row = ids[t].tolist()
        assert len(set(row)) == 4 and all(0 <= e < 16 for e in row), row
    assert torch.isnan(w[1]).all()
    w2, ids2, _, _ = route_pairs(logits[2:].to(DEV), 4, router=router, renormalize=renorm)
    assert torch.equal(ids[2], ids2[0]) and torch.equal(w[2], w2[0])


def test_select_experts_errors():
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(2, 4), 5)
    with pytest.raises(ValueError, match="router"):
        select_experts(torch.randn(2, 4), 2, router="relu")
    with pytest.raises(ValueError, match="sigmoid"):
        select_experts(torch.randn(2, 4), 2, n_group=2, topk_group=1)


# ------------------------------------------------------------------------------------------------ alignment


@dataclass(frozen=True)
class AlignCase:
    T: int
    top_k: int
    E: int
    skew: bool = False


ALIGN_CASES = [AlignCase(0, 2, 4), AlignCase(1, 1, 1), AlignCase(1, 8, 128), AlignCase(3, 2, 8),
               AlignCase(7, 3, 5), AlignCase(64, 8, 16), AlignCase(33, 4, 64, skew=True),
               AlignCase(200, 10, 512)]


@pytest.mark.parametrize("method", ["sort", "count"])
@pytest.mark.parametrize("case", ALIGN_CASES, ids=str)
def test_align_exact(case, method):
    g = torch.Generator().manual_seed(case.T)
    ids = _ids(case.T, case.top_k, case.E, g, case.skew)
    r = align(ids.to(DEV), case.E, method=method)
    assert r.P == case.T * case.top_k and r.S == min(case.E, r.P)
    for name, want in align_reference(ids, case.E).items():
        got = getattr(r, name)
        assert got.dtype == torch.int32, name
        assert torch.equal(got.cpu(), want), f"{name}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("case", ALIGN_CASES, ids=str)
def test_sort_pairs_exact(case):
    g = torch.Generator().manual_seed(case.T)
    ids = _ids(case.T, case.top_k, case.E, g, case.skew).to(DEV)
    P = case.T * case.top_k
    rows = torch.arange(P, dtype=torch.int32, device=DEV)
    r = sort_pairs(torch.ones(case.T, case.top_k, device=DEV), ids.contiguous(), rows, case.E)
    assert r.sorted and not r.has_groups
    ref = align_reference(ids.cpu(), case.E)
    for name in ("expert_ids", "token_ids", "pair_rows"):
        got = getattr(r, name)
        assert got.dtype == torch.int32, name
        assert torch.equal(got.cpu(), ref[name]), f"{name}: {got.tolist()} != {ref[name].tolist()}"


def test_pair_order_routing():
    w, ids, tok, rows = route_pairs(torch.randn(3, 6, device=DEV), 2)
    r = pair_order(w, ids, tok, rows, 6)
    assert not r.sorted and not r.has_groups and r.P == 6
    assert torch.equal(r.expert_ids, ids.view(-1)) and torch.equal(r.pair_rows, rows)


# ------------------------------------------------------------------------------------------------ element-wise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("P,I", [(0, 8), (3, 37), (5, 128)])
def test_silu_mul_gate_up(dtype, P, I):
    gu = (torch.randn(P, 2 * I) * 3).to(dtype).to(DEV)
    out = silu_mul_gate_up(gu)
    assert out.shape == (P, I) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.double(), silu_mul_gate_up_reference(gu), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,top_k,E,H", [(0, 2, 4, 8), (1, 1, 3, 5), (6, 3, 8, 70)])
def test_combine(dtype, T, top_k, E, H):
    g = torch.Generator().manual_seed(T)
    r = align(_ids(T, top_k, E, g).to(DEV), E, torch.rand(T, top_k, generator=g).to(DEV))
    y = torch.randn(T * top_k, H, generator=g).to(dtype).to(DEV)
    out = combine(y, r)
    assert out.shape == (T, H) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), combine_reference(y, r), rtol=tol, atol=tol)


@pytest.mark.parametrize("T,top_k,E,H", [(1, 8, 128, 2048), (3, 2, 8, 100), (5, 6, 16, 700)])
def test_combine_add_rms_norm(T, top_k, E, H):
    """The combine and the next norm's residual add + RMSNorm in one launch: the residual exactly as
    add_rms_norm(combine(y)) makes it, the normed rows to an ulp (another order of the sum of squares), both
    against the float64 combine rounded as the combine rounds; the inputs left as they were."""
    from kbit.ops.glue import add_rms_norm
    from kbit.ops.moe import Uncombined, combine_add_rms_norm, combine_add_rms_norm_reference
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16  # (bf16 arithmetic is not exact under the interpreter)
    g = torch.Generator().manual_seed(11 * T + H)
    routing = align(_ids(T, top_k, E, g).to(DEV), E, torch.rand(T, top_k, generator=g).to(DEV))
    y = torch.randn(T * top_k, H, generator=g).to(dt).to(DEV)
    res = torch.randn(T, H, generator=g).to(dt).to(DEV)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dt).to(DEV)
    y0, res0 = y.clone(), res.clone()
    u = Uncombined(y, routing, dt)
    out, r = combine_add_rms_norm(u, res, nw, 1e-6)
    want, r_want = add_rms_norm(combine(y, routing), res, nw, 1e-6)
    assert torch.equal(r, r_want) and torch.equal(y, y0) and torch.equal(res, res0)
    assert (out.double() - want.double()).abs().max().item() <= want.double().abs().max().item() * 2**-7
    ref, r_ref = combine_add_rms_norm_reference(u, res, nw, 1e-6)
    torch.testing.assert_close(r.double(), r_ref.double(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref.double(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(u.combine(), combine(y, routing))
    with pytest.raises(ValueError, match="residual: expected shape"):
        combine_add_rms_norm(u, res[:, 1:], nw, 1e-6)
    with pytest.raises(TypeError, match="y: expected an Uncombined"):
        combine_add_rms_norm(y, res, nw, 1e-6)


# ------------------------------------------------------------------------------------------------ layer


@pytest.mark.parametrize("dtype,plan,k", [
    (torch.float32, MM, 2),
    (torch.float16, GEMV, 4),
    (torch.float16, MoePlan("grouped_mm", "gemv"), 5),
    (torch.float16, None, 3),
])
def test_layer_vs_reference(dtype, plan, k):
    E, H, I, top_k, T = 6, 64, 40, 2, 5
    gu, dn = _stacks(E, H, I, seed=k)
    m = KbitMoE.from_float(gu, dn, top_k=top_k, k=k, dtype=dtype).to(DEV)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEV)
    _check_layer(m, x, torch.randn(T, E, generator=g).to(DEV), plan)


@pytest.mark.parametrize("T,E,top_k", [(1, 4, 2), (7, 6, 3), (0, 4, 2)])
def test_routed_experts_vs_reference_and_as_an_op(T, E, top_k):
    """``routed_experts`` (the router's choice in, what KbitExperts runs) against the float64 reference on the
    dequantized stacks, the same through ``torch.ops.kbit.routed_experts`` in a full torch.compile graph; ids out of
    range raise on the CPU."""
    from kbit.dispatch.moe import routed_experts
    from kbit.ops.quantize import quantize

    H, I = 64, 40
    gu, dn = _stacks(E, H, I, seed=T)
    qgu, qdn = quantize(gu.to(DEV), k=4), quantize(dn.to(DEV), k=4)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(DEV)
    ids = _ids(T, top_k, E, g).to(DEV)
    w = torch.rand(T, top_k, generator=g).to(DEV)
    want = moe_reference(x, w, ids, _dq(qgu), _dq(qdn))
    got = routed_experts(x, ids, w, qgu, qdn)
    assert got.shape == (T, H) and got.dtype == x.dtype
    if T:
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-4

    def op(x, ids, w):
        return torch.ops.kbit.routed_experts(x, ids, w, qgu.codes, qgu.scales, qgu.tensor_scale, qgu.codebook,
                                             qdn.codes, qdn.scales, qdn.tensor_scale, qdn.codebook, 4, 32, "log8",
                                             E, H, I)

    if T:
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(op, backend="eager", fullgraph=True)(x, ids, w), got)
    if T and DEV == "cpu":
        bad = ids.clone()
        bad[0, 0] = E
        with pytest.raises(ValueError, match="topk_ids"):
            routed_experts(x, bad, w, qgu, qdn)


@pytest.mark.parametrize("T,router", [(3, "softmax"), (20, "softmax"), (6, "sigmoid")])
def test_layer_fused_routing_vs_align(T, router):
    """GEMV-only steps route in one launch: pair order (T <= PAIR_ORDER_MAX_T) or sort_pairs (above); the
    output equals that of the torch routing + align path up to the router's float32 rounding."""
    E, H, I, top_k = 6, 64, 32, 2
    kw = dict(router="sigmoid", correction_bias=torch.randn(E) * 0.1, routed_scaling_factor=1.5) \
        if router == "sigmoid" else {}
    m = KbitMoE.from_float(*_stacks(E, H, I, seed=T), top_k=top_k, k=4, dtype=torch.float16, **kw).to(DEV)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).half().to(DEV)
    logits = torch.randn(T, E, generator=g).to(DEV)
    fused = m.route(logits, GEMV)
    assert fused.sorted == (T > 16) and not fused.has_groups
    out = _check_layer(m, x, logits, GEMV)
    slow = moe_experts(x, m.route(logits), m.gate_up_weight(), m.down_weight(), GEMV)
    torch.testing.assert_close(out, slow, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="group tables"):
        moe_experts(x, fused, m.gate_up_weight(), m.down_weight(), MoePlan("grouped_mm", "gemv"))


def test_layer_sigmoid_router_shared_expert_and_3d_input():
    E, H, I, top_k = 8, 32, 32, 3
    gu, dn = _stacks(E, H, I, seed=3)
    shared = torch.nn.Sequential(torch.nn.Linear(H, 16, bias=False), torch.nn.SiLU(), torch.nn.Linear(16, H))
    sgate = torch.nn.Linear(H, 1, bias=False)
    m = KbitMoE.from_float(gu, dn, top_k=top_k, k=4, router="sigmoid", routed_scaling_factor=2.0, n_group=2,
                           topk_group=1, correction_bias=torch.randn(E) * 0.1, shared_expert=shared,
                           shared_expert_gate=sgate, dtype=torch.float32).to(DEV)
    x = torch.randn(2, 3, H, device=DEV)
    logits = torch.randn(6, E, device=DEV)
    with torch.no_grad():
        out = m(x, logits, plan=MM)
        r = m.route(logits)
        x2 = x.reshape(-1, H)
        ref = moe_reference(x2, r.topk_weights, r.topk_ids, dequantize_reference(m.gate_up_weight()),
                            dequantize_reference(m.down_weight()))
        ref = ref + (torch.sigmoid(sgate(x2)) * shared(x2)).double()
    w_ref, ids_ref = select_experts_reference(logits.cpu(), top_k, router="sigmoid", renormalize=True,
                                              correction_bias=m.correction_bias.cpu(), n_group=2, topk_group=1,
                                              scaling=2.0)
    assert torch.equal(r.topk_ids.cpu(), ids_ref)
    assert out.shape == x.shape
    assert relative_error(out.reshape(-1, H), ref) < 1e-5


def test_cpu_tensors_without_the_interpreter(monkeypatch):
    """A KbitMoE on the CPU of a machine that runs Triton only on its GPU: the reference forward, no kernel."""
    E, H, I, top_k = 8, 32, 32, 3
    gu, dn = _stacks(E, H, I, seed=4)
    shared = torch.nn.Linear(H, H, bias=False)
    m = KbitMoE.from_float(gu, dn, top_k=top_k, k=4, shared_expert=shared, dtype=torch.float32)
    x = torch.randn(2, 5, H)
    logits = torch.randn(10, E)
    import kbit.nn.moe as nn_moe

    monkeypatch.setattr(nn_moe, "moe_experts", None)  # the kernel path would fail here
    with torch.no_grad(), options.override(interpret=False):
        out = m(x, logits)
        w, ids = select_experts_reference(logits, top_k)
        ref = moe_reference(x.reshape(-1, H), w, ids, dequantize_reference(m.gate_up_weight()),
                            dequantize_reference(m.down_weight())) + shared(x.reshape(-1, H)).double()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out.reshape(-1, H), ref) < 1e-6


def test_state_dict_round_trip_and_errors():
    E, H, I = 4, 32, 32
    gu, dn = _stacks(E, H, I)
    m = KbitMoE.from_float(gu, dn, top_k=2, k=2, dtype=torch.float32, router_weight=torch.randn(E, H))
    fresh = KbitMoE(E, H, I, 2, k=2, dtype=torch.float32, has_router_weight=True)
    fresh.load_state_dict(m.state_dict())
    x = torch.randn(3, H)
    assert torch.equal(fresh(x, plan=MM), m(x, plan=MM))
    with pytest.raises(ValueError, match="k="):
        KbitMoE(E, H, I, 2, k=3, has_router_weight=True).load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="router_logits"):
        m(x, torch.randn(3, E + 1))
    with pytest.raises(ValueError, match="hidden"):
        m(torch.randn(3, H + 1))


def test_zero_tokens():
    m = KbitMoE.from_float(*_stacks(4, 32, 32), top_k=2, k=4, dtype=torch.float32)
    assert m(torch.zeros(0, 32), torch.zeros(0, 4)).shape == (0, 32)


def test_choose_plan():
    f16 = torch.float16
    assert not GEMV.needs_groups and MM.needs_groups and MoePlan("gemv", "grouped_mm").needs_groups
    assert choose_plan(1, 8, 128, 2048, 768, f16, DEV) == GEMV
    assert choose_plan(64, 8, 128, 2048, 768, f16, DEV) == GEMV  # 4 rows per expert
    assert choose_plan(256, 8, 128, 2048, 768, f16, DEV) == MM
    assert choose_plan(1, 2, 8, 64, 64, torch.float32, DEV) == MM  # no fp32 GEMV


# ------------------------------------------------------------------------------------------------ Hugging Face


def _hf_block(kind, E=8, H=64, I=32, top_k=2, norm=True, dtype=torch.float32):
    pytest.importorskip("transformers")
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k)
    elif kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=top_k,
                             norm_topk_prob=norm)
    elif kind in ("minimax", "ernie4_5_moe"):  # softmax routers without a norm_topk_prob flag
        tr = pytest.importorskip(f"transformers.models.{kind}.modeling_{kind}")
        Block = tr.MiniMaxSparseMoeBlock if kind == "minimax" else tr.Ernie4_5_MoeSparseMoeBlock
        Config = tr.MiniMaxConfig if kind == "minimax" else tr.Ernie4_5_MoeConfig
        cfg = Config(hidden_size=H, intermediate_size=I, moe_intermediate_size=I, num_local_experts=E,
                     num_experts=E, num_experts_per_tok=top_k)
    elif kind in ("deepseek_v3", "glm4_moe"):  # sigmoid router: correction bias, groups, scaling; shared experts
        tr = pytest.importorskip(f"transformers.models.{kind}.modeling_{kind}")
        Block = tr.DeepseekV3MoE if kind == "deepseek_v3" else tr.Glm4MoeMoE
        Config = tr.DeepseekV3Config if kind == "deepseek_v3" else tr.Glm4MoeConfig
        cfg = Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=top_k,
                     norm_topk_prob=norm, n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1)
    else:
        tr = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
        Block = tr.Qwen3NextSparseMoeBlock
        cfg = tr.Qwen3NextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=top_k,
                                 norm_topk_prob=norm, shared_expert_intermediate_size=I)
    torch.manual_seed(0)
    block = Block(cfg)
    for p in list(block.parameters()) + list(block.buffers()):  # the correction bias too: zeros would hide it
        torch.nn.init.normal_(p, std=0.1)
    return block.to(dtype).eval()


def _set_hf_experts(block, m: KbitMoE):
    """Replace the block's expert weights by the dequantized kbit weights (fused or per-expert layout)."""
    gu = dequantize_reference(m.gate_up_weight()).to(block.gate.weight.dtype)
    dn = dequantize_reference(m.down_weight()).to(block.gate.weight.dtype)
    ex = block.experts
    with torch.no_grad():
        if hasattr(ex, "gate_up_proj"):
            ex.gate_up_proj.copy_(gu)
            ex.down_proj.copy_(dn)
        else:
            I = m.intermediate_size
            for e, mod in enumerate(ex):
                g, u, d = (mod.gate_proj, mod.up_proj, mod.down_proj) if hasattr(mod, "gate_proj") else \
                    (mod.w1, mod.w3, mod.w2)
                g.weight.copy_(gu[e, :I])
                u.weight.copy_(gu[e, I:])
                d.weight.copy_(dn[e])


def _hf_choice(block, x):
    """The experts the HF block picks: its router's output (transformers >= 5) or the top-k of its gate's
    softmax (the older blocks compute it inline)."""
    if isinstance(block.gate, torch.nn.Linear):
        return torch.topk(torch.softmax(block.gate(x).float(), -1), block.top_k).indices
    return block.gate(x)[2]


def _hf_out(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out  # transformers < 5 also returns the router logits


@pytest.mark.parametrize("kind,norm,k", [("qwen3_moe", True, 4), ("qwen3_moe", False, 3), ("mixtral", True, 2),
                                         ("qwen3_next", True, 4), ("deepseek_v3", True, 4), ("glm4_moe", False, 3)])
def test_hf_block(kind, norm, k):
    block = _hf_block(kind, norm=norm)
    m = KbitMoE.from_hf(block, k=k)
    assert m.norm_topk_prob == norm and m.top_k == 2
    _set_hf_experts(block, m)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        ref = _hf_out(block, x)
        out = m(x, plan=MM)
        ids_hf = _hf_choice(block, x.view(-1, 64))
    r = m.route(torch.nn.functional.linear(x.view(-1, 64), m.router_weight))
    assert torch.equal(r.topk_ids.long().sort(-1).values, ids_hf.sort(-1).values)  # DeepSeek's top-k: unsorted
    assert relative_error(out, ref) < 1e-2


def test_hf_block_whose_routing_differs_is_refused(monkeypatch):
    """A router read wrongly (here DeepSeek-V3's as softmax, the options a block without a correction bias gets)
    is caught by the check on random tokens: ValueError, not a KbitMoE that routes otherwise."""
    from kbit.nn import moe

    block = _hf_block("deepseek_v3")
    real = moe.hf_routing

    def as_softmax(b):
        out = real(b)
        for key in ("correction_bias", "n_group", "topk_group", "routed_scaling_factor"):
            out.pop(key)
        return out | {"router": "softmax"}

    monkeypatch.setattr(moe, "hf_routing", as_softmax)
    with pytest.raises(ValueError, match=r"^block: expected a sparse MoE block whose routing KbitMoE reproduces, "
                                         r"got DeepseekV3MoE: the gate"):
        KbitMoE.from_hf(block, k=4)


def test_hf_block_without_a_norm_flag():
    """MiniMax's router renormalises its top-k weights and says so nowhere: the choice comes from its gate's own
    output (and the block converts); ERNIE-4.5's gate holds expert statistics kbit's router does not read:
    refused, naming them."""
    block = _hf_block("minimax")
    m = KbitMoE.from_hf(block, k=4)
    assert m.norm_topk_prob is True
    _set_hf_experts(block, m)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        assert relative_error(m(x, plan=MM), _hf_out(block, x)) < 1e-2
    with pytest.raises(ValueError, match=r"gate of Ernie4_5_MoeSparseMoeBlock holds \['moe_statics\."):
        KbitMoE.from_hf(_hf_block("ernie4_5_moe"), k=4)


def test_hf_block_fp16_gemv():
    block = _hf_block("qwen3_moe", dtype=torch.float16)
    m = KbitMoE.from_hf(block, k=4)
    assert m.dtype == torch.float16
    _set_hf_experts(block, m)
    x = torch.randn(1, 3, 64).half()
    with torch.no_grad():
        assert relative_error(m(x, plan=GEMV), _hf_out(block, x)) < 1e-2


class _LegacyBlock(torch.nn.Module):
    """The transformers < 5 layout: a gate ``nn.Linear`` and a ``ModuleList`` of expert MLPs."""

    def __init__(self, fused, names, mixtral):
        super().__init__()
        E, I2, H = fused.experts.gate_up_proj.shape
        I = I2 // 2
        self.top_k = fused.gate.top_k
        if not mixtral:
            self.norm_topk_prob = fused.gate.norm_topk_prob
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.gate.weight.data.copy_(fused.gate.weight.data)
        mlps = []
        for e in range(E):
            mlp = torch.nn.Module()
            for n, (o, i), w in zip(names, ((I, H), (I, H), (H, I)),
                                    (fused.experts.gate_up_proj[e, :I], fused.experts.gate_up_proj[e, I:],
                                     fused.experts.down_proj[e]), strict=True):
                lin = torch.nn.Linear(i, o, bias=False)
                lin.weight.data.copy_(w.data)
                setattr(mlp, n, lin)
            mlp.act_fn = torch.nn.SiLU()
            mlps.append(mlp)
        self.experts = torch.nn.ModuleList(mlps)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hf_legacy_layout_matches_fused(kind):
    fused = _hf_block(kind)
    mixtral = kind == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    legacy = _LegacyBlock(fused, names, mixtral)
    if mixtral:  # from_hf knows Mixtral (always renormalised) by the class name
        legacy.__class__ = type("MixtralSparseMoeBlock", (_LegacyBlock,), {})
    a, b = hf_parts(fused), hf_parts(legacy)
    for key in ("w_gate_up", "w_down", "router_weight"):
        assert torch.equal(a[key], b[key]), key
    assert (a["top_k"], a["norm_topk_prob"]) == (b["top_k"], b["norm_topk_prob"])


# ------------------------------------------------------------------------------------------------ GPU

QWEN3_30B = dict(E=128, top_k=8, H=2048, I=768)
QWEN3_NEXT = dict(E=512, top_k=10, H=2048, I=512)


@functools.lru_cache(maxsize=2)
def _gpu_layer(E, top_k, H, I, k=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) / H**0.5
    dn = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) / I**0.5
    return KbitMoE.from_float(gu, dn, top_k=top_k, k=k, dtype=torch.bfloat16)


def _inputs(T, E, H, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(T, H, device="cuda", generator=g).bfloat16(),
            torch.randn(T, E, device="cuda", generator=g).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN3_30B, QWEN3_NEXT], ids=["qwen3-30b-a3b", "qwen3-next"])
@pytest.mark.parametrize("T", [1, 4, 64, 300])
@pytest.mark.parametrize("plan", [None, GEMV, MM, GEMM], ids=["auto", "gemv", "grouped_mm", "gemm"])
def test_gpu_layer_real_sizes(shape, T, plan):
    m = _gpu_layer(**shape)
    x, logits = _inputs(T, shape["E"], shape["H"])
    _check_layer(m, x, logits, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("plan", [None, GEMM], ids=["auto", "gemm"])
def test_gpu_mixtral_size(T, plan):
    m = _gpu_layer(E=8, top_k=2, H=4096, I=14336, k=3)
    x, logits = _inputs(T, 8, 4096)
    _check_layer(m, x, logits, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("T,plan", [(4, GEMV), (64, GEMV), (300, MM), (64, MoePlan("gemv", "grouped_mm")),
                                    (1, GEMM), (4, GEMM), (64, GEMM), (300, GEMM), (2048, GEMM)])
def test_gpu_no_host_sync(T, plan):
    m = _gpu_layer(**QWEN3_30B)
    x, logits = _inputs(T, QWEN3_30B["E"], QWEN3_30B["H"])
    m(x, logits, plan=plan)  # warm-up: Triton compiles, tables are built and cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = m(x, logits, plan=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["sort", "count"])
def test_gpu_route_and_align_no_host_sync(method):
    """The routing alone, per alignment method: tells which one to blame if the layer test syncs."""
    E, top_k = QWEN3_NEXT["E"], QWEN3_NEXT["top_k"]
    logits = torch.randn(4096, E, device="cuda")
    align(select_experts(logits, top_k)[1], E, method=method)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w, ids = select_experts(logits, top_k)
        r = align(ids, E, w, method=method)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = align_reference(ids.cpu(), E)
    assert torch.equal(r.offsets.cpu(), ref["offsets"]) and torch.equal(r.pair_rows.cpu(), ref["pair_rows"])


@pytest.mark.gpu
@pytest.mark.parametrize("T,plan", [(1, None), (4, None), (8, None), (16, GEMV), (64, GEMV), (512, MM), (1, GEMM),
                                    (16, GEMM), (64, GEMM), (300, GEMM), (2048, GEMM)])
def test_gpu_cuda_graph_equals_eager(T, plan):
    """A captured layer replayed on new inputs (a new routing each time) equals the eager call, bit for bit; at 1-8
    tokens the pairs launches, whose down launch reads the routing before its PDL wait (a stale read would show)."""
    m = _gpu_layer(**QWEN3_30B)
    x, logits = _inputs(T, QWEN3_30B["E"], QWEN3_30B["H"])
    m(x, logits, plan=plan)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x, logits, plan=plan)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = m(x, logits, plan=plan)
    for seed in (2, 3):  # new inputs into the captured buffers: a different routing each time
        x2, l2 = _inputs(T, QWEN3_30B["E"], QWEN3_30B["H"], seed=seed)
        x.copy_(x2)
        logits.copy_(l2)
        graph.replay()
        eager = m(x2, l2, plan=plan)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("T,plan", [(1, None), (1, GEMM), (4, None), (16, GEMM)])
def test_gpu_fused_router(T, plan):
    """A block with its router weight, called without logits at decode sizes, routes in one launch
    (kbit.dispatch.moe.route_hidden): the same output as with the logits that launch computed, the same in a
    CUDA graph, and the arrival counters zero after."""
    from kbit.ops.moe_router import route_pairs_hidden
    s = QWEN3_30B
    g = torch.Generator(device="cuda").manual_seed(T)
    gu = torch.randn(s["E"], 2 * s["I"], s["H"], device="cuda", generator=g, dtype=torch.bfloat16) / s["H"]**0.5
    dn = torch.randn(s["E"], s["H"], s["I"], device="cuda", generator=g, dtype=torch.bfloat16) / s["I"]**0.5
    wr = torch.randn(s["E"], s["H"], device="cuda", generator=g, dtype=torch.bfloat16) / s["H"]**0.5
    m = KbitMoE.from_float(gu, dn, top_k=s["top_k"], k=4, dtype=torch.bfloat16, router_weight=wr)
    x = torch.randn(T, s["H"], device="cuda", generator=g).bfloat16()
    out = m(x, plan=plan)
    assert m._router_ws is not None and int(m._router_ws.abs().sum()) == 0
    logits = route_pairs_hidden(x, wr, s["top_k"], counters=torch.zeros(16, dtype=torch.int32, device="cuda"))[0]
    torch.testing.assert_close(out, m(x, logits, plan=plan), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = m(x, plan=plan)
    for _ in range(2):  # new inputs: a different routing each time
        x.copy_(torch.randn(T, s["H"], device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, m(x, plan=plan), rtol=2e-2, atol=2e-2)
    assert int(m._router_ws.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T,plan", [(1, None), (4, None), (16, GEMM), (17, None)])
def test_gpu_forward_add_norm(T, plan):
    """KbitMoE.forward_add_norm (the decode step's post-attention add + norm, in the router's launch where the
    fused router takes the step; T = 17 does not): the same output and residual as add_rms_norm then the block,
    the same in a CUDA graph replayed on new inputs, the counters zero after, and the norm launch gone."""
    from kbit.ops.glue import add_rms_norm
    s = QWEN3_30B
    g = torch.Generator(device="cuda").manual_seed(100 + T)
    gu = torch.randn(s["E"], 2 * s["I"], s["H"], device="cuda", generator=g, dtype=torch.bfloat16) / s["H"]**0.5
    dn = torch.randn(s["E"], s["H"], s["I"], device="cuda", generator=g, dtype=torch.bfloat16) / s["I"]**0.5
    wr = torch.randn(s["E"], s["H"], device="cuda", generator=g, dtype=torch.bfloat16) / s["H"]**0.5
    m = KbitMoE.from_float(gu, dn, top_k=s["top_k"], k=4, dtype=torch.bfloat16, router_weight=wr)
    nw = (1 + 0.1 * torch.randn(s["H"], device="cuda", generator=g)).bfloat16()
    x, res = (torch.randn(T, s["H"], device="cuda", generator=g).bfloat16() for _ in range(2))

    def unfused():
        y, r = add_rms_norm(x, res, nw, 1e-6)
        return m(y, plan=plan), r

    out, r = m.forward_add_norm(x, res, nw, 1e-6, plan=plan)
    want, r_want = unfused()
    assert torch.equal(r, r_want)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        m.forward_add_norm(x, res, nw, 1e-6, plan=plan)
        torch.cuda.synchronize()
    norms = [e for e in prof.events() if "add_rms_norm" in e.name]
    assert bool(norms) == (T > 16), [e.name for e in norms]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_r = m.forward_add_norm(x, res, nw, 1e-6, plan=plan)
    for _ in range(2):  # new inputs: a different routing each time
        x.copy_(torch.randn(T, s["H"], device="cuda", generator=g).bfloat16())
        res.copy_(torch.randn(T, s["H"], device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want, r_want = unfused()
        assert torch.equal(static_r, r_want)
        torch.testing.assert_close(static_out, want, rtol=2e-2, atol=2e-2)
    assert m._router_ws is None or int(m._router_ws.abs().sum()) == 0
    with pytest.raises(ValueError, match="residual: expected shape"):
        m.forward_add_norm(x, torch.cat([res, res]), nw, 1e-6)
    # the combine left to the caller where the fused router takes the step (no shared expert here)
    from kbit.ops.moe import Uncombined
    u, r = m.forward_add_norm(x, res, nw, 1e-6, plan=plan, defer_combine=True)
    want, r_want = unfused()
    assert isinstance(u, Uncombined) == (T <= 16) and torch.equal(r, r_want)
    torch.testing.assert_close(u.combine() if T <= 16 else u, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,top_k", [(128, 2048, 8), (32, 2880, 4), (128, 4096, 8), (256, 7168, 8)])
def test_gpu_fused_router_routes_its_own_logits(E, H, top_k):
    """The last program of a token routes from every program's logits: the pairs equal route_pairs of the logits
    the same launch returned, over many fresh inputs (the weights to float32 rounding: the launch's routing sums
    the softmax over more warps than route_topk_kernel, in another order; H100)."""
    from kbit.ops.moe_router import route_pairs_hidden
    g = torch.Generator(device="cuda").manual_seed(E + H)
    wr = torch.randn(E, H, device="cuda", generator=g, dtype=torch.bfloat16) / H**0.5
    cnt = torch.zeros(16, dtype=torch.int32, device="cuda")
    for T in (1, 2, 8, 16):
        for experts in (None, (E // 2, E)):
            for _ in range(8):
                x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
                logits, *pairs = route_pairs_hidden(x, wr, top_k, counters=cnt, experts=experts)
                own = route_pairs(logits, top_k, experts=experts)
                torch.testing.assert_close(pairs[0], own[0], rtol=1e-6, atol=1e-7, msg=f"{T} {experts}")
                for a, b in zip(pairs[1:], own[1:], strict=True):
                    assert torch.equal(a, b), (T, experts)
    assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_hf_qwen3_bf16():
    pytest.importorskip("transformers")
    block = _hf_block("qwen3_moe", E=128, H=2048, I=768, top_k=8, norm=True, dtype=torch.bfloat16).cuda()
    m = KbitMoE.from_hf(block, k=4)
    _set_hf_experts(block, m)
    x = torch.randn(1, 37, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = _hf_out(block, x)
        out = m(x)
        ids_hf = _hf_choice(block, x.view(-1, 2048))
    r = m.route(torch.nn.functional.linear(x.view(-1, 2048), m.router_weight))
    assert torch.equal(r.topk_ids.long().sort(-1).values, ids_hf.sort(-1).values)  # DeepSeek's top-k: unsorted
    assert relative_error(out, ref) < 1e-2


# ------------------------------------------------------------------------------------------------ tail split


def _skewed_inputs(T, E, H, seed=5):
    """Inputs whose routing leaves some experts with only a few rows (all-tail experts) besides ~256-row ones."""
    x, logits = _inputs(T, E, H, seed=seed)
    logits = logits.float()
    logits[:, -1] -= 3.0  # the last expert: a handful of rows
    return x, logits.bfloat16()


@pytest.mark.parametrize("bt,tail", [(256, 32), (64, 8), (16, 16)])
def test_tail_split_reference_invariants(bt, tail):
    """The split's definition: a permutation of the rows; the main part and the tail part each sorted by expert;
    every main block one expert's and at most bt rows, every tail block one expert's whole tail (1..tail rows)."""
    from kbit.ops.moe_blocks import tail_split_reference

    T, E, top_k = 300, 6, 2
    g = torch.Generator().manual_seed(bt)
    ids = torch.multinomial(torch.tensor([8.0, 8, 8, 8, 1, 0.2]), T * top_k, replacement=True, generator=g)
    ids = ids.view(T, top_k).to(torch.int32)
    ref = align_reference(ids, E)
    eid2, tok2, pr2, rows_t, blk_m, blk_t = tail_split_reference(ref["expert_ids"], ref["offsets"],
                                                                 ref["pair_rows"], top_k, bt, tail)
    P = T * top_k
    assert sorted(pr2) == list(range(P))
    p_main = blk_m[-1]
    assert eid2[:p_main] == sorted(eid2[:p_main]) and eid2[p_main:] == sorted(eid2[p_main:])
    flat = ids.view(-1).tolist()
    for p in range(P):
        assert eid2[pr2[p]] == flat[p] and tok2[pr2[p]] == p // top_k
    for a, b in zip(blk_m[:-1], blk_m[1:], strict=True):
        assert 0 < b - a <= bt and len(set(eid2[a:b])) == 1
    for a, b in zip(blk_t[:-1], blk_t[1:], strict=True):
        assert 0 < b - a <= tail and len(set(eid2[a:b])) == 1
        assert eid2.count(eid2[a]) % bt == b - a  # the expert's whole short last block
    assert blk_t[-1] == P and P - min(P, tail * E) <= p_main
    assert all(rows_t[n] == n - (P - min(P, tail * E)) for n in range(p_main, P))


@pytest.mark.gpu
@pytest.mark.parametrize("E,T,top_k", [(8, 1100, 2), (128, 4096, 8), (16, 2500, 2)])
def test_gpu_tail_split_vs_reference(E, T, top_k):
    """kbit_moe_split + kbit_moe_split_rows equal their Python definition, entry for entry."""
    from kbit.ops import moe_blocks as MB
    from kbit.ops.mma.common import kernels_available

    if not kernels_available(torch.device("cuda")):
        pytest.skip("needs the CUDA kernels")
    _, logits = _skewed_inputs(T, E, 64)
    w, ids = select_experts(logits, top_k)
    r = align(ids, E, w)
    sp = MB.tail_split(r, 256)
    eid2, tok2, pr2, rows_t, blk_m, blk_t = MB.tail_split_reference(r.expert_ids.cpu(), r.offsets.cpu(),
                                                                   r.pair_rows.cpu(), top_k, 256)
    assert sp.expert_ids.tolist() == eid2 and sp.token_ids.tolist() == tok2
    assert sp.pair_rows.tolist() == pr2 and sp.tail_rows.tolist() == rows_t
    nm, nt = int(sp.main_blocks[1]), int(sp.tail_blocks[1])
    assert sp.main_blocks[0][: nm + 1].tolist() == blk_m and sp.tail_blocks[0][: nt + 1].tolist() == blk_t
    if E == 8 or E == 128:
        assert nt > 0  # the skewed routing makes tails (E = 16: its last expert gets no row)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [(dict(E=8, top_k=2, H=512, I=256), 1100), (QWEN3_30B, 4096)],
                         ids=["small", "qwen3-30b-a3b"])
def test_gpu_tail_split_layer(shape, T, monkeypatch):
    """The layer with the tail split (kernel 4 on each expert's short last block) against the float64 reference
    and against the layer without it; no host sync; a graph replay equals eager."""
    from kbit.dispatch import moe as MOE
    from kbit.ops.grouped_mma import large_rows

    monkeypatch.setattr(MOE, "TAIL_SPLIT_MIN_E", 8)
    m = _gpu_layer(**shape)
    x, logits = _skewed_inputs(T, shape["E"], shape["H"])
    r = m.route(logits)
    if not r.has_groups or large_rows(r.P, r.E, x.device) != MOE.TAIL_SPLIT_BT:
        pytest.skip("needs sm_90 (the grouped kernel 7 with 256-row blocks)")
    out = _check_layer(m, x, logits)
    assert MOE._tail_split_rows(x, r, *m.kernel_weights()) == MOE.TAIL_SPLIT_BT  # the forward took the split
    monkeypatch.setattr(MOE, "TAIL_SPLIT_MIN_E", 1 << 30)  # no stack has that many experts: no split
    plain = _check_layer(m, x, logits)
    monkeypatch.setattr(MOE, "TAIL_SPLIT_MIN_E", 8)
    assert relative_error(out, plain) < 1e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out2 = m(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, out2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x, logits)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = m(x, logits)
    x2, l2 = _skewed_inputs(T, shape["E"], shape["H"], seed=9)
    x.copy_(x2)
    logits.copy_(l2)
    graph.replay()
    eager = m(x2, l2)
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
