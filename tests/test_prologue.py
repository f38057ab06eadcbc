"""Glue folded into the next k-bit GEMV (kbit.dispatch.prologue): the fused kernel-3 launches (``-m gpu``) and the
two-step fallback (CPU), against float64 references."""
import pytest
import torch
from torch import nn

from kbit.bench.timing import capture
from kbit.dispatch import prologue as P
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops import gemv_mma, glue
from kbit.tuning import mma_units
from kbit.tuning.mma import PIPE, MmaConfig
from kbit.tuning.mma_plan import prologue_config

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _lin(N, K, k, dtype, device, seed, bias=False):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias, dtype=torch.float32)
    return KbitLinear.from_linear(lin, k=k, dtype=dtype).to(device)


def _w64(q):
    return dequantize_reference(q.weight(), torch.float64)


def _spy(monkeypatch):
    """Record (prologue kind, epilogue) of every small-M launch."""
    calls = []
    real = gemv_mma.launch

    def spy(*a, pro=None, epi=0, **kw):
        calls.append((pro[0] if pro else 0, epi))
        return real(*a, pro=pro, epi=epi, **kw)

    monkeypatch.setattr(gemv_mma, "launch", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 6144, 4096), (3, 1024, 2888), (8, 28672, 1024), (1, 288, 8)])
def test_add_rms_norm_linear_gpu(monkeypatch, dtype, k, silu, M, N, K):
    """The fused launch where the plain launch is kernel 3 (pinned here: which kernel a shape gets is the GPU's
    tuned table's choice, and the prologue is fused only on kernel 3)."""
    dev = "cuda"
    plain = MmaConfig(kernel=3, warps=8, min_ctas=2, ring=PIPE[k], x_smem=True)
    monkeypatch.setattr(gemv_mma, "launch_config", lambda *a, **kw: plain)
    gemv_mma.PLANS.clear()
    q = _lin(N, K, k, dtype, dev, seed=N + K + k, bias=(M == 3)).repack_for_kernels()
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(dtype).to(dev)
    res = torch.randn(M, K, generator=g).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(dev)
    calls = _spy(monkeypatch)
    y, r = P.add_rms_norm_linear(x, res, w, 1e-5, q, silu_mul=silu)
    torch.cuda.synchronize()
    assert calls == [(gemv_mma.PRO_ADD_NORM, gemv_mma.EPI_SILU if silu else 0)]  # one launch, fused
    assert y.shape == (M, N // 2 if silu else N) and y.dtype == dtype and r.dtype == dtype
    assert torch.equal(r, res + x)
    h_ref, _ = glue.rms_norm_reference(x.double(), w.double(), 1e-5, res.double())
    z_ref = h_ref @ _w64(q).T.to(h_ref.device)
    if q.bias is not None:
        z_ref = z_ref + q.bias.double()
    y_ref = torch.nn.functional.silu(z_ref[:, :N // 2]) * z_ref[:, N // 2:] if silu else z_ref
    assert _rel(y, y_ref) < TOL[dtype]
    # the separate steps give the same numbers up to roundings (a subclass of KbitLinear is not fused: its forward
    # may differ)
    q.__class__ = type("NotFused", (KbitLinear,), {})
    y2, r2 = P.add_rms_norm_linear(x, res, w, 1e-5, q, silu_mul=silu)
    assert torch.equal(r2, r) and _rel(y, y2) < TOL[dtype] / 2
    # no fused launch (KbitLinear's prepared launcher, when it runs the GEMV, does not pass through launch)
    assert all(c == (0, 0) for c in calls[1:])
    gemv_mma.PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 6144, 4096), (4, 5120, 2880)])
def test_not_fused_where_plain_is_kernel_1(monkeypatch, silu, M, N, K):
    """Where the plain launch is kernel 1 (pinned here), the norm, the launch and SiLU * up run as separate steps:
    no prologue or epilogue launch, and the same numbers as the float64 reference."""
    dtype = torch.bfloat16
    monkeypatch.setattr(gemv_mma, "launch_config", lambda *a, **kw: MmaConfig(kernel=1, warps=8, min_ctas=3))
    gemv_mma.PLANS.clear()
    try:
        q, x, res, w, y_ref = _norm_case(M, N, K, silu, dtype)
        calls = _spy(monkeypatch)
        y, r = P.add_rms_norm_linear(x, res, w, 1e-5, q, silu_mul=silu)
        torch.cuda.synchronize()
        assert all(c == (0, 0) for c in calls)
        assert torch.equal(r, res + x) and _rel(y, y_ref) < TOL[dtype]
    finally:
        gemv_mma.PLANS.clear()


def _norm_case(M, N, K, silu, dtype=torch.bfloat16, dev="cuda"):
    """A fused-norm GEMV case on fresh random data: (weight, x, residual, norm weight, float64 reference of y)."""
    q = _lin(N, K, 4, dtype, dev, seed=N + M).repack_for_kernels()
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(dtype).to(dev)
    res = torch.randn(M, K, generator=g).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(dev)
    h_ref, _ = glue.rms_norm_reference(x.double(), w.double(), 1e-5, res.double())
    z_ref = h_ref @ _w64(q).T.to(h_ref.device)
    y_ref = torch.nn.functional.silu(z_ref[:, :N // 2]) * z_ref[:, N // 2:] if silu else z_ref
    return q, x, res, w, y_ref


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 28672, 4096), (2, 2048, 512), (5, 6144, 2880)])
def test_silu_epilogue_default_plans(M, N, K):
    """The SiLU * up epilogue on the default plans (gate / up pairs whole in a CTA are finished from shared memory,
    the others through the workspace), twice (clean counters)."""
    dev, dtype = "cuda", torch.bfloat16
    gemv_mma.PLANS.clear()
    try:
        q, x, res, w, y_ref = _norm_case(M, N, K, True, dtype, dev)
        for _ in range(2):
            y, _ = P.add_rms_norm_linear(x, res, w, 1e-5, q, silu_mul=True)
            assert _rel(y, y_ref) < TOL[dtype]
    finally:
        gemv_mma.PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 28672, 4096), (1, 6144, 4096), (2, 2048, 512), (5, 6144, 2880)])
@pytest.mark.parametrize("silu", [True, False])
def test_prologue_cta_units(monkeypatch, M, N, K, silu):
    """The residual add + RMSNorm prologue, with and without the SiLU * up epilogue, on kernel 3's CTA-aligned
    units (``CAU``, forced on every shape): against the float64 reference, twice, bit-identical run to run."""
    dev, dtype = "cuda", torch.bfloat16
    monkeypatch.setattr(mma_units, "CAU_MIN_EFF", 0.0)
    monkeypatch.setattr(mma_units, "CAU_IDLE_US", float("inf"))
    gemv_mma.PLANS.clear()
    try:
        q, x, res, w, y_ref = _norm_case(M, N, K, silu, dtype, dev)
        ys = []
        for _ in range(2):
            y, _ = P.add_rms_norm_linear(x, res, w, 1e-5, q, silu_mul=silu)
            assert _rel(y, y_ref) < TOL[dtype]
            ys.append(y)
        assert torch.equal(ys[0], ys[1])
    finally:
        gemv_mma.PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("cau", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 6144, 4096), (3, 1024, 2888), (8, 28672, 1024)])
def test_prologue_pair_table_gpu(monkeypatch, dtype, silu, cau, M, N, K):
    """k = 5 where the plain launch takes the pair table (forced here): the prologue launch takes it too (P5 with
    the norm prologue and the SiLU * up epilogue, CTA-aligned units forced or not), against the float64 reference."""
    p5 = MmaConfig(kernel=3, warps=16, min_ctas=1, ring=2, x_smem=True, pair_table=True)
    monkeypatch.setattr(gemv_mma, "launch_config", lambda *a, **kw: p5)
    if cau:
        monkeypatch.setattr(mma_units, "CAU_MIN_EFF", 0.0)
        monkeypatch.setattr(mma_units, "CAU_IDLE_US", float("inf"))
    gemv_mma.PLANS.clear()
    try:
        q = _lin(N, K, 5, dtype, "cuda", seed=N + K + M, bias=(M == 3)).repack_for_kernels()
        g = torch.Generator().manual_seed(M * K)
        x, res = (torch.randn(M, K, generator=g).to(dtype).cuda() for _ in range(2))
        w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).cuda()
        assert prologue_config(5, M, N, K, p5) == p5
        plans = []
        real_get = gemv_mma.PLANS.get
        monkeypatch.setattr(gemv_mma.PLANS, "get", lambda *a, **kw: plans.append(real_get(*a, **kw)) or plans[-1])
        h_ref, _ = glue.rms_norm_reference(x.double(), w.double(), 1e-5, res.double())
        z_ref = h_ref @ _w64(q).T.to(h_ref.device)
        if q.bias is not None:
            z_ref = z_ref + q.bias.double()
        y_ref = torch.nn.functional.silu(z_ref[:, :N // 2]) * z_ref[:, N // 2:] if silu else z_ref
        for _ in range(2):  # twice: the epilogue's counters are left clean
            y, r = P.add_rms_norm_linear(x, res, w, 1e-5, q, silu_mul=silu)
            assert torch.equal(r, res + x) and _rel(y, y_ref) < TOL[dtype]
        assert plans and all(p[0].defines.get("P5") == 1 and p[0].defines.get("PRO") for p in plans)
    finally:
        gemv_mma.PLANS.clear()



@pytest.mark.gpu
def test_counters_reset_between_calls():
    """The epilogue's pair counters are back at zero after a call: repeated calls give identical outputs."""
    dev, dtype = "cuda", torch.bfloat16
    q = _lin(2048, 512, 4, dtype, dev, seed=5).repack_for_kernels()
    x, res = torch.randn(2, 512, device=dev).to(dtype), torch.randn(2, 512, device=dev).to(dtype)
    w = torch.rand(512, device=dev).to(dtype) + 0.5
    outs = [P.add_rms_norm_linear(x, res, w, 1e-6, q, silu_mul=True)[0] for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.gpu
def test_prologue_graph_replay():
    dev, dtype = "cuda", torch.bfloat16
    q = _lin(6144, 4096, 4, dtype, dev, seed=1).repack_for_kernels()
    d = _lin(4096, 3072, 4, dtype, dev, seed=2).repack_for_kernels()
    x = torch.randn(1, 4096, device=dev).to(dtype)
    res = torch.randn(1, 4096, device=dev).to(dtype)
    w = torch.rand(4096, device=dev).to(dtype) + 0.5

    def step():
        y, r = P.add_rms_norm_linear(x, res, w, 1e-6, q, silu_mul=True)
        return d(y), r

    eager = step()
    graph, out = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    # kernel 3 adds the partial sums of a tile split between warps in arrival order (fp32 atomics): equal up to
    # that order's rounding; the residual is exact
    assert torch.equal(out[1], eager[1]) and _rel(out[0], eager[0]) < 1e-2


def test_fused_config():
    assert prologue_config(4, 1, 28672, 4096).kernel == 3
    assert prologue_config(4, 1, 4096, 4096) == MmaConfig(kernel=3, warps=8, min_ctas=2, ring=PIPE[4], x_smem=True)
    assert prologue_config(4, 9, 4096, 4096) is None  # M > 8: kernel 4
    assert prologue_config(4, 8, 4096, 65536) is None  # x does not fit in shared memory
    p5 = MmaConfig(kernel=3, warps=16, min_ctas=1, ring=2, x_smem=True, pair_table=True)
    assert prologue_config(5, 1, 6144, 4096, p5) == p5  # the plain launch's pair table (k = 5)
    assert prologue_config(5, 1, 6144, 4096, MmaConfig(kernel=3, warps=8)).kernel == 3  # any other kernel 3: as before
    assert prologue_config(4, 1, 6144, 4096, MmaConfig(kernel=1, warps=8, min_ctas=3)) is None  # not fused
    assert prologue_config(4, 4, 6144, 4096, MmaConfig(kernel=4, warps=8)) is None
    assert not prologue_config(5, 1, 4096, 25600, p5).pair_table  # x, the norm weight and 128 KB: over 227 KB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_cpu(dtype):
    """Off the fused path (CPU here) the function is the separate steps it replaces."""
    q = _lin(48, 64, 4, dtype, "cpu", seed=3)
    x, res = torch.randn(2, 64).to(dtype), torch.randn(2, 64).to(dtype)
    w = (torch.rand(64) + 0.5).to(dtype)
    y, r = P.add_rms_norm_linear(x, res, w, 1e-6, q)
    h, r2 = glue.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(r, r2) and torch.equal(y, q(h))
    a, r3 = P.add_rms_norm_linear(x, res, w, 1e-6, q, silu_mul=True)
    z = q(h)
    assert torch.equal(r3, r2) and torch.equal(a, glue.silu_mul(z[:, :24], z[:, 24:]))


def test_errors():
    q = _lin(48, 64, 4, torch.float32, "cpu", seed=4)
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(ValueError, match="residual"):
        P.add_rms_norm_linear(x, torch.randn(3, 64), w, 1e-6, q)
    with pytest.raises(ValueError, match="lin"):
        P.add_rms_norm_linear(torch.randn(2, 32), torch.randn(2, 32), torch.ones(32), 1e-6, q)
    with pytest.raises(ValueError, match="silu_mul"):
        P.add_rms_norm_linear(x, x, w, 1e-6, _lin(47, 64, 4, torch.float32, "cpu", seed=4), silu_mul=True)
    with pytest.raises(TypeError, match="x"):
        P.add_rms_norm_linear(x.to(torch.int32), x, w, 1e-6, q)
