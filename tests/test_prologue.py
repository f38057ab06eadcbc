"""Glue folded into the next k-bit GEMV (kbit.ops.prologue): the fused kernel-3 launches (``-m gpu``) and the
two-step fallback (CPU), against float64 references."""
import pytest
import torch
from torch import nn

from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops import gemv_mma, glue
from kbit.ops import prologue as P

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
    """Record the prologue kind of every small-M launch."""
    kinds = []
    real = gemv_mma._launch

    def spy(*a, pro=None, **kw):
        kinds.append(pro[0] if pro else 0)
        return real(*a, pro=pro, **kw)

    monkeypatch.setattr(gemv_mma, "_launch", spy)
    return kinds


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (3, 1000, 2888), (8, 6144, 1024), (1, 272, 8)])
def test_add_rms_norm_linear_gpu(monkeypatch, dtype, k, M, N, K):
    dev = "cuda"
    q = _lin(N, K, k, dtype, dev, seed=N + K + k, bias=(M == 3)).repack_for_kernels()
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(dtype).to(dev)
    res = torch.randn(M, K, generator=g).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(dev)
    kinds = _spy(monkeypatch)
    y, r = P.add_rms_norm_linear(x, res, w, 1e-5, q)
    torch.cuda.synchronize()
    assert kinds == [P.PRO_ADD_NORM]  # one launch, fused
    assert y.shape == (M, N) and y.dtype == dtype and r.dtype == dtype
    assert torch.equal(r, res + x)
    h_ref, _ = glue.rms_norm_reference(x.double(), w.double(), 1e-5, res.double())
    y_ref = h_ref @ _w64(q).T.to(h_ref.device)
    if q.bias is not None:
        y_ref = y_ref + q.bias.double()
    assert _rel(y, y_ref) < TOL[dtype]
    # the two-step path gives the same numbers up to the rounding of the normalised x
    monkeypatch.setenv("KBIT_FUSE_PROLOGUE", "0")
    y2, r2 = P.add_rms_norm_linear(x, res, w, 1e-5, q)
    assert torch.equal(r2, r) and _rel(y, y2) < TOL[dtype] / 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 14336), (5, 1000, 2888), (8, 272, 1024)])
def test_silu_mul_linear_gpu(monkeypatch, dtype, k, M, N, K):
    dev = "cuda"
    q = _lin(N, K, k, dtype, dev, seed=N + 3 * K + k).repack_for_kernels()
    g = torch.Generator().manual_seed(M + K)
    gu = (2 * torch.randn(M, 2 * K, generator=g)).to(dtype).to(dev)
    kinds = _spy(monkeypatch)
    y = P.silu_mul_linear(gu, q)
    torch.cuda.synchronize()
    assert kinds == [P.PRO_SILU]
    gate, up = gu[:, :K].double(), gu[:, K:].double()
    y_ref = (torch.nn.functional.silu(gate) * up) @ _w64(q).T.to(gate.device)
    assert y.shape == (M, N) and y.dtype == dtype
    assert _rel(y, y_ref) < TOL[dtype]
    monkeypatch.setenv("KBIT_FUSE_PROLOGUE", "0")
    assert _rel(y, P.silu_mul_linear(gu, q)) < TOL[dtype] / 2


@pytest.mark.gpu
def test_prologue_graph_replay():
    dev, dtype = "cuda", torch.bfloat16
    q = _lin(6144, 4096, 4, dtype, dev, seed=1).repack_for_kernels()
    d = _lin(4096, 3072, 4, dtype, dev, seed=2).repack_for_kernels()
    x = torch.randn(1, 4096, device=dev).to(dtype)
    res = torch.randn(1, 4096, device=dev).to(dtype)
    w = torch.rand(4096, device=dev).to(dtype) + 0.5

    def step():
        y, r = P.add_rms_norm_linear(x, res, w, 1e-6, q)
        return P.silu_mul_linear(y, d), r

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


def test_fused_config():
    assert P.fused_config(4, 1, 28672, 4096)[0] == 3
    assert P.fused_config(4, 1, 4096, 14336) == (3, 8, 2, gemv_mma.PIPE[4], 1)
    assert P.fused_config(4, 9, 4096, 4096) is None  # M > 8: kernel 4
    assert P.fused_config(4, 8, 4096, 65536) is None  # x does not fit in shared memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_cpu(dtype):
    """Off the fused path (CPU here) the functions are the two steps they replace."""
    q = _lin(48, 64, 4, dtype, "cpu", seed=3)
    x, res = torch.randn(2, 64).to(dtype), torch.randn(2, 64).to(dtype)
    w = (torch.rand(64) + 0.5).to(dtype)
    y, r = P.add_rms_norm_linear(x, res, w, 1e-6, q)
    h, r2 = glue.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(r, r2) and torch.equal(y, q(h))
    gu = torch.randn(2, 128).to(dtype)
    assert torch.equal(P.silu_mul_linear(gu, q), q(glue.silu_mul(gu[:, :64], gu[:, 64:])))


def test_errors():
    q = _lin(48, 64, 4, torch.float32, "cpu", seed=4)
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(ValueError, match="gate_up"):
        P.silu_mul_linear(torch.randn(2, 100), q)
    with pytest.raises(ValueError, match="residual"):
        P.add_rms_norm_linear(x, torch.randn(3, 64), w, 1e-6, q)
    with pytest.raises(ValueError, match="lin"):
        P.add_rms_norm_linear(torch.randn(2, 32), torch.randn(2, 32), torch.ones(32), 1e-6, q)
    with pytest.raises(TypeError, match="gate_up"):
        P.silu_mul_linear(torch.randn(2, 128).to(torch.int32), q)
