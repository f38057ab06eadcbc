"""Index safety of the ops that take ids (kbit.ops._ids): on the CPU a clear ValueError before any launch; the
device semantics (no host read: an out-of-range id reads row / expert 0, its row is NaN, the error flag is set)
run here too, with the host checks switched off, under the Triton interpreter; on the GPU (marked ``gpu``) the
same against the real kernels, the debug mode, CUDA graphs."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # kernels run under the Triton interpreter; it must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kbit.dispatch import moe as D  # noqa: E402
from kbit.dispatch.moe import MoePlan, moe_experts  # noqa: E402
from kbit.nn.moe import KbitMoE  # noqa: E402
from kbit.ops import _ids  # noqa: E402
from kbit.ops import gemv as G  # noqa: E402
from kbit.ops import moe as MO  # noqa: E402
from kbit.ops import moe_align as MA  # noqa: E402
from kbit.ops.moe import combine  # noqa: E402
from kbit.ops.moe_align import align  # noqa: E402
from kbit.tuning.gemv import GemvConfig  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
GEMV, MM, GEMM = MoePlan("gemv", "gemv"), MoePlan("grouped_mm", "grouped_mm"), MoePlan("gemm", "gemm")
V2 = GemvConfig(BN=8, G=2, num_warps=4)
V3 = GemvConfig(BN=4, G=2, num_warps=4, num_stages=1, pps=8, pipelined=True)


def make_stack(E, N, K_, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-(2**31), 2**31 - 1, (E, N, K_ * k // 32), generator=g, dtype=torch.int32)
    scales = torch.randint(0, 64, (E, N, K_ // 32), generator=g, dtype=torch.uint8)
    ts = torch.rand(E, generator=g) + 0.5
    cb = torch.sort(torch.rand(2**k, generator=g) * 2 - 1).values
    return [t.to(device) for t in (codes, scales, ts, cb)]


def i32(v, device=DEV):
    return torch.tensor(v, dtype=torch.int32, device=device)


@pytest.fixture
def device_semantics(monkeypatch):
    """The CUDA behaviour on CPU tensors: no host check anywhere, the kernels see the bad ids."""
    for mod in (G, MO, MA, _ids):
        monkeypatch.setattr(mod, "host_checks", lambda t: False)
    _ids.error_flag("cpu").zero_()
    yield
    _ids.error_flag("cpu").zero_()


# ------------------------------------------------------------------------------------------------ host checks

BAD_GROUPED = [
    ([0, 1000000], [0, 1], r"token_ids: expected ids in \[0, 3\) \(rows of x\), got 1000000 at position 1"),
    ([0, -2**31], [0, 1], r"token_ids: expected ids in \[0, 3\) \(rows of x\), got -2147483648 at position 1"),
    ([0, 1], [5, 1], r"expert_ids: expected ids in \[0, 5\) \(experts of the stack\), got 5 at position 0"),
    ([0, 1], [0, -1], r"expert_ids: expected ids in \[0, 5\) \(experts of the stack\), got -1 at position 1"),
]


@pytest.mark.parametrize("tok,exp,match", BAD_GROUPED)
def test_grouped_gemv_bad_ids_raise_on_the_host(tok, exp, match):
    codes, scales, ts, cb = make_stack(5, 12, 64, 4, device="cpu")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        G.grouped_gemv(x, i32(tok, "cpu"), i32(exp, "cpu"), codes, scales, ts, cb, k=4, N=12, K=64)


def test_grouped_gemv_rows_without_x_rows():
    codes, scales, ts, cb = make_stack(2, 12, 64, 4, device="cpu")
    x = torch.randn(0, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected at least one row for 1 token_ids, got 0"):
        G.grouped_gemv(x, i32([0], "cpu"), i32([0], "cpu"), codes, scales, ts, cb, k=4, N=12, K=64)


def test_grouped_gemm_fallbacks_raise_on_the_host():
    """kbit.dispatch.moe.grouped_gemm runs the grouped GEMV off CUDA: the same errors."""
    E, H, I = 3, 64, 16
    m = KbitMoE.from_float(torch.randn(E, 2 * I, H), torch.randn(E, H, I), top_k=1, k=4, dtype=torch.float16)
    x = torch.randn(2, H, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 2\) \(rows of x\), got 7"):
        D.grouped_gemm(x, i32([0, 7], "cpu"), i32([0, 1], "cpu"), m.gate_up_weight())
    with pytest.raises(ValueError, match=r"expert_ids: expected ids in \[0, 3\) \(experts of the stack\), got 3"):
        D.grouped_gemm(x, i32([0, 1], "cpu"), i32([0, 3], "cpu"), m.gate_up_weight())


def test_align_and_combine_raise_on_the_host():
    with pytest.raises(ValueError, match=r"topk_ids: expected ids in \[0, 4\) \(experts\), got 9 at position 3"):
        align(i32([[0, 1], [2, 9]], "cpu"), 4)
    r = align(i32([[0, 1], [2, 3]], "cpu"), 4)
    bad = MA.MoeRouting(**{**r.__dict__, "pair_rows": i32([0, 1, 2, 4], "cpu")})
    with pytest.raises(ValueError, match=r"pair_rows: expected ids in \[0, 4\) \(rows of y\), got 4 at position 3"):
        combine(torch.randn(4, 8), bad)


@pytest.mark.parametrize("plan", [GEMV, MM], ids=["gemv", "grouped_mm"])
def test_moe_experts_bad_routing_raises_on_the_host(monkeypatch, plan):
    monkeypatch.setattr(MA, "host_checks", lambda t: False)  # let align build the bad routing
    E, H, I = 4, 64, 32
    m = KbitMoE.from_float(torch.randn(E, 2 * I, H), torch.randn(E, H, I), top_k=2, k=4, dtype=torch.float16)
    r = align(i32([[0, 1], [2, 6]], "cpu"), E)
    x = torch.randn(2, H, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"expert_ids: expected ids in \[0, 4\) \(experts of the stack\), got 6"):
        moe_experts(x, r, m.gate_up_weight(), m.down_weight(), plan)


def test_debug_ids_mode_and_check_errors():
    assert not _ids._DEBUG[0]
    with _ids.debug_ids():
        assert _ids._DEBUG[0]
        with _ids.debug_ids(False):
            assert not _ids._DEBUG[0]
        assert _ids._DEBUG[0]
    assert not _ids._DEBUG[0]
    flag = _ids.error_flag("cpu")
    flag.fill_(_ids.ERR_EXPERTS | _ids.ERR_PAIR_ROWS)
    with pytest.raises(ValueError, match=r"expert_ids: expected ids in \[0, E\).*pair_rows: expected rows"):
        _ids.check_errors("cpu")
    assert int(flag) == 0
    _ids.check_errors()  # cleared: nothing to report


# ------------------------------------------------------------------------------------------------ device semantics


@pytest.mark.parametrize("cfg", [V2, V3], ids=["v2", "v3"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemv_device_semantics(device_semantics, cfg, bias):
    E, N, K_, T = 5, 12, 96, 3
    codes, scales, ts, cb = make_stack(E, N, K_, 4, device="cpu")
    x = torch.randn(T, K_, dtype=torch.bfloat16)
    tok = i32([0, 1000000, 1, -2**31, 2, 2], "cpu")
    exp = i32([4, 1, 7, 0, -1, 3], "cpu")
    kw = dict(k=4, blocksize=32, scale_format="log8", N=N, K=K_, bias=torch.randn(E, N) if bias else None)
    y = G.grouped_gemv(x, tok, exp, codes, scales, ts, cb, config=cfg, **kw)
    good = torch.tensor([0, 5])
    assert torch.isnan(y[1:5]).all() and not torch.isnan(y[good]).any()
    ref = G.grouped_gemv_reference(x, tok[good], exp[good], codes, scales, ts, cb, **kw)
    assert ((y[good].double() - ref).norm() / ref.norm()).item() < 1.2e-2
    assert int(_ids.error_flag("cpu")) == _ids.ERR_ROWS | _ids.ERR_EXPERTS
    with pytest.raises(ValueError, match="token_ids / rows.*expert_ids"):
        _ids.check_errors("cpu")
    G.grouped_gemv(x, tok[good], exp[good], codes, scales, ts, cb, config=cfg, **kw)
    _ids.check_errors("cpu")  # good ids leave the flag clear


def test_guard_and_poison_device_semantics(device_semantics):
    rows, eids = i32([3, -1, 0, 2, 9], "cpu"), i32([0, 1, 1, 8, 2], "cpu")
    r, e, bad = _ids.guard(rows, 4, eids, 3)
    assert r.tolist() == [3, 0, 0, 2, 3] and e.tolist() == [0, 1, 1, 2, 2]
    assert bad.tolist() == [0, 1, 0, 1, 1]
    assert int(_ids.error_flag("cpu")) == _ids.ERR_ROWS | _ids.ERR_EXPERTS
    y = _ids.poison(torch.ones(5, 2), bad)
    assert torch.isnan(y[:, 0]).tolist() == [False, True, False, True, True]
    out = _ids.poison_tokens(torch.ones(2, 3), bad[:4].contiguous(), i32([0, 2, 1, 3], "cpu"), 2)
    assert torch.isnan(out[:, 0]).tolist() == [False, True]


@pytest.mark.parametrize("strided", [False, True])
def test_poison_drops_the_rows_past_kernel_7s_blocks(device_semantics, strided):
    """With a block table of more blocks than kernel 7 takes (from bad ids), the rows of the dropped blocks are NaN
    too, in the one poison launch (a strided view: the same in torch ops)."""
    bad = torch.tensor([0, 1, 0, 0, 0, 0, 0], dtype=torch.int8)
    blk, nblk = i32([0, 2, 4, 5, 7, 7, 7, 7], "cpu"), i32([4], "cpu")  # 4 blocks: rows 0-1, 2-3, 4, 5-6
    for n_max, nan in ((2, [0, 1, 0, 0, 1, 1, 1]), (4, [0, 1, 0, 0, 0, 0, 0]), (9, [0, 1, 0, 0, 0, 0, 0])):
        y = torch.ones(7, 70)[:, ::2] if strided else torch.ones(7, 35)
        _ids.poison(y, bad, (blk, nblk), n_max)
        assert torch.isnan(y).all(1).int().tolist() == nan, n_max
        assert not torch.isnan(y[[i for i in range(7) if not nan[i]]]).any()


def test_align_count_with_bad_ids_stays_a_permutation(device_semantics):
    ids = i32([[2, -3], [7, 0], [1, 2]], "cpu")
    for method in ("sort", "count"):
        r = align(ids, 4, method=method)
        assert sorted(r.pair_rows.tolist()) == list(range(6)), method
        assert sorted(r.expert_ids.tolist()) == sorted(ids.view(-1).tolist()), method


def test_combine_device_semantics(device_semantics):
    r = align(i32([[0, 1], [2, 3], [1, 0]], "cpu"), 4)
    bad = MA.MoeRouting(**{**r.__dict__, "pair_rows": i32([0, 1, 2, 60, 4, 5], "cpu")})
    y = torch.randn(6, 8)
    out = combine(y, bad)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
    fixed = MA.MoeRouting(**{**r.__dict__, "pair_rows": i32([0, 1, 2, 3, 4, 5], "cpu")})
    torch.testing.assert_close(out[[0, 2]], combine(y, fixed)[[0, 2]])
    assert int(_ids.error_flag("cpu")) == _ids.ERR_PAIR_ROWS


def test_combine_add_rms_norm_device_semantics(device_semantics):
    """The combine in the next norm's launch: a token with a bad pair row gets NaN outputs and residual, the others
    those of the same rows fixed, and the error flag is set."""
    from kbit.ops.moe import Uncombined, combine_add_rms_norm
    r = align(i32([[0, 1], [2, 3], [1, 0]], "cpu"), 4)
    bad = MA.MoeRouting(**{**r.__dict__, "pair_rows": i32([0, 1, 2, 60, 4, 5], "cpu")})
    fixed = MA.MoeRouting(**{**r.__dict__, "pair_rows": i32([0, 1, 2, 3, 4, 5], "cpu")})
    y, res, w = torch.randn(6, 8).half(), torch.randn(3, 8).half(), torch.ones(8).half()
    out, new = combine_add_rms_norm(Uncombined(y, bad, torch.float16), res, w, 1e-6)
    assert torch.isnan(out[1]).all() and torch.isnan(new[1]).all() and not torch.isnan(out[[0, 2]]).any()
    want, want_r = combine_add_rms_norm(Uncombined(y, fixed, torch.float16), res, w, 1e-6)
    assert torch.equal(out[[0, 2]], want[[0, 2]]) and torch.equal(new[[0, 2]], want_r[[0, 2]])
    assert int(_ids.error_flag("cpu")) == _ids.ERR_PAIR_ROWS


@pytest.mark.parametrize("plan", [GEMV, MoePlan("grouped_mm", "gemv")], ids=["gemv", "grouped_mm+gemv"])
def test_moe_experts_device_semantics(device_semantics, plan):
    """Tokens with a bad pair get NaN outputs; the others equal those of the same step with the bad ids replaced."""
    E, H, I, T = 4, 64, 32, 4
    g = torch.Generator().manual_seed(0)
    m = KbitMoE.from_float(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g), top_k=2, k=4,
                           dtype=torch.float16)
    x = torch.randn(T, H, generator=g).half()
    ids = i32([[0, 1], [2, 6], [3, 1], [-1, 2]], "cpu")
    fixed = torch.where((ids < 0) | (ids >= E), 0, ids)
    out = moe_experts(x, align(ids, E), m.gate_up_weight(), m.down_weight(), plan)
    ref = moe_experts(x, align(fixed, E), m.gate_up_weight(), m.down_weight(), plan)
    assert torch.isnan(out[[1, 3]]).all(dim=1).all()
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], rtol=2e-3, atol=2e-3)
    assert int(_ids.error_flag("cpu")) & _ids.ERR_EXPERTS


def test_expert_matmul_grouped_mm_guards_token_ids(device_semantics):
    E, H, I = 3, 32, 16
    m = KbitMoE.from_float(torch.randn(E, 2 * I, H), torch.randn(E, H, I), top_k=1, k=4, dtype=torch.float32)
    r = align(i32([[0], [1], [2]], "cpu"), E)
    r = MA.MoeRouting(**{**r.__dict__, "token_ids": i32([0, 99, 2], "cpu")})
    y = D.expert_matmul(torch.randn(3, H), r, m.gate_up_weight(), "grouped_mm", gather=True)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()
    assert int(_ids.error_flag("cpu")) == _ids.ERR_ROWS


def test_routed_ids_are_checked_by_construction():
    """A routing from kbit's router is marked checked (its grouped GEMMs skip the guard); align of a caller's ids is
    not; the router kernel gives in-range ids even for NaN scores."""
    E, top_k = 8, 3
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(1))
    logits[1] = float("nan")
    logits[2, :4] = float("nan")
    for plan in (None, GEMV, MoePlan("gemm", "gemm")):
        r = D.route(logits, plan, top_k=top_k, E=E)
        assert r.checked, plan
        ids = r.expert_ids
        assert bool(((ids >= 0) & (ids < E)).all()), (plan, ids.tolist())
    assert not align(i32([[0, 1]], "cpu"), E).checked


def test_checked_routing_skips_the_guard(device_semantics, monkeypatch):
    """``guard(..., checked=True)`` returns the ids as they are without a launch (no mask, no flag) on the device
    path; the host path still checks them."""
    rows, eids = i32([0, 1], "cpu"), i32([1, 2], "cpu")
    r, e, bad = _ids.guard(rows, 2, eids, 3, checked=True)
    assert r is rows and e is eids and bad is None
    monkeypatch.setattr(_ids, "host_checks", lambda t: True)
    with pytest.raises(ValueError, match=r"expert_ids: expected ids in \[0, 3\)"):
        _ids.guard(rows, 2, i32([1, 7], "cpu"), 3, checked=True)


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_case(E=16, N=1536, K_=2048, T=4, top_k=8, seed=0):
    codes, scales, ts, cb = make_stack(E, N, K_, 4, device="cuda", seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, K_, device="cuda", generator=g).bfloat16()
    tok = torch.arange(T, device="cuda", dtype=torch.int32).repeat_interleave(top_k)
    exp = torch.randint(0, E, (T * top_k,), device="cuda", dtype=torch.int32, generator=g)
    exp, order = torch.sort(exp, stable=True)
    return codes, scales, ts, cb, x, tok[order].contiguous(), exp.contiguous()


def _spoil(tok, exp, T, E):
    """Copies with bad ids at a few rows (a negative expert first, a huge token, INT_MIN, an expert past E last:
    rows sorted by expert stay sorted, as ``align`` sorts bad ids)."""
    tok, exp = tok.clone(), exp.clone()
    bad = [0, 1, 2, exp.shape[0] - 1]
    exp[0], tok[1], tok[2], exp[-1] = -1, 1000000, -2**31, E + 3
    return tok, exp, bad


def _check_spoiled(y, ref, bad):
    good = [r for r in range(y.shape[0]) if r not in bad]
    assert torch.isnan(y[bad]).all(dim=1).all(), "rows of bad ids: NaN"
    yg, rg = y[good].double(), ref[good]
    assert ((yg - rg).norm() / rg.norm()).item() < 1.2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None, V3], ids=["auto", "v3"])
def test_gpu_grouped_gemv_bad_ids(cfg):
    codes, scales, ts, cb, x, tok, exp = _gpu_case()
    kw = dict(k=4, blocksize=32, scale_format="log8", N=1536, K=2048)
    ref = G.grouped_gemv_reference(x, tok, exp, codes, scales, ts, cb, **kw)
    _ids.check_errors()
    btok, bexp, bad = _spoil(tok, exp, 4, 16)
    y = G.grouped_gemv(x, btok, bexp, codes, scales, ts, cb, config=cfg, **kw)
    torch.cuda.synchronize()  # no fault
    _check_spoiled(y, ref, bad)
    with pytest.raises(ValueError, match="token_ids / rows.*expert_ids"):
        _ids.check_errors()
    with _ids.debug_ids(), pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 4\)"):
        G.grouped_gemv(x, btok, bexp, codes, scales, ts, cb, config=cfg, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T,sorted_rows", [(1, False), (4, True), (64, True), (600, True), (64, False)])
def test_gpu_grouped_linear_bad_ids(T, sorted_rows):
    from kbit.ops import grouped_mma as GR
    from kbit.ops.mma.common import kernels_available

    if not kernels_available("cuda"):
        pytest.skip("CUDA kernels not available")
    E, top_k = 8 if T == 600 else 16, 2 if T == 600 else 8
    codes, scales, ts, cb, x, tok, exp = _gpu_case(E=E, N=512, K_=1024, T=T, top_k=top_k, seed=T)
    kw = dict(k=4, blocksize=32, scale_format="log8", N=512, K=1024)
    ref = G.grouped_gemv_reference(x, tok, exp, codes, scales, ts, cb, **kw)
    _ids.check_errors()
    btok, bexp, bad = _spoil(tok, exp, T, E)
    y = GR.grouped_linear(x, btok, bexp, codes, scales, ts, cb, sorted_rows=sorted_rows, **kw)
    torch.cuda.synchronize()
    _check_spoiled(y, ref, bad)
    with pytest.raises(ValueError, match="token_ids / rows.*expert_ids"):
        _ids.check_errors()
    with _ids.debug_ids(), pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, \d+\)"):
        GR.grouped_linear(x, btok, bexp, codes, scales, ts, cb, sorted_rows=sorted_rows, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T,plan,repacked", [(1, GEMV, False), (1, GEMM, False), (1, GEMM, True), (64, GEMV, False),
                                             (64, GEMM, True), (300, MM, False), (300, GEMM, False),
                                             (2048, GEMM, False), (2048, GEMM, True)])
def test_gpu_moe_experts_bad_routing(T, plan, repacked):
    """Every kernel of the MoE step (repacked at 2048 rows: kernel 7 with the tail split) with a routing made of
    bad top-k ids: the tokens of the bad pairs NaN, the others as with the ids replaced, the flag set."""
    E, H, I, top_k = 64, 512, 256, 4
    g = torch.Generator().manual_seed(T)
    m = KbitMoE.from_float(torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5,
                           top_k=top_k, k=4, dtype=torch.bfloat16).cuda()
    if repacked:
        m.repack_for_kernels()
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).int().cuda()
    spoiled = ids.clone()
    spoiled[0, 0], spoiled[T - 1, top_k - 1] = E + 5, -7
    fixed = torch.where((spoiled < 0) | (spoiled >= E), 0, spoiled)
    _ids.check_errors()
    out = moe_experts(x, align(spoiled, E), *m.kernel_weights(), plan)
    ref = moe_experts(x, align(fixed, E), *m.kernel_weights(), plan)
    torch.cuda.synchronize()
    assert torch.isnan(out[[0, T - 1]]).all()
    if T > 2:
        torch.testing.assert_close(out[1:T - 1], ref[1:T - 1], rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="expert_ids"):
        _ids.check_errors()


@pytest.mark.gpu
def test_gpu_bad_ids_under_a_cuda_graph_and_no_sync():
    codes, scales, ts, cb, x, tok, exp = _gpu_case()
    kw = dict(k=4, blocksize=32, scale_format="log8", N=1536, K=2048)
    G.grouped_gemv(x, tok, exp, codes, scales, ts, cb, **kw)  # warm-up, makes the flag
    _ids.check_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        G.grouped_gemv(x, tok, exp, codes, scales, ts, cb, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.grouped_gemv(x, tok, exp, codes, scales, ts, cb, **kw)
    graph.replay()
    _ids.check_errors()  # good ids: clear
    tok[3] = 99  # the captured ids tensor, now bad
    graph.replay()
    with pytest.raises(ValueError, match="token_ids / rows"):
        _ids.check_errors()
