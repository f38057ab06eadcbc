"""kbit.ops.chain.linear_chain: projections in one persistent launch (kernel 8, ``-m gpu``) against a float64
reference of the same steps, and its fallback (separate launches; CPU)."""
import pytest
import torch
from torch import nn

from kbit.bench.timing import capture
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops import chain as C
from kbit.ops import glue

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _lin(N, K, k, dtype, device, seed, bias=False, repack=True):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias, dtype=torch.float32)
    q = KbitLinear.from_linear(lin, k=k, dtype=dtype).to(device)
    return q.repack_for_kernels() if repack else q


def _layer(H, I, Q, k, dtype, dev, seed, bias=False):
    """Stages of o -> add + norm, gate/up, SiLU * up -> down -> add + norm, q/k/v (Llama-shaped, small)."""
    g = torch.Generator().manual_seed(seed)
    w1 = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(dev)
    w2 = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(dev)
    return [(_lin(H, H, k, dtype, dev, seed + 1, bias), None, 0.0, False),
            (_lin(2 * I, H, k, dtype, dev, seed + 2), w1, 1e-5, True),
            (_lin(H, I, k, dtype, dev, seed + 3, bias), None, 0.0, False),
            (_lin(Q, H, k, dtype, dev, seed + 4), w2, 1e-6, False)]


def _reference(x, res, stages):
    """float64 steps on the dequantized weights."""
    h, r = x.double(), None if res is None else res.double()
    for lin, nw, eps, silu in stages:
        if nw is not None:
            h, r = glue.rms_norm_reference(h, nw.double(), eps, r)  # r + h, then the norm
        z = h @ dequantize_reference(lin.weight(), torch.float64).T.to(h.device)
        if lin.bias is not None:
            z = z + lin.bias.double()
        n = lin.out_features
        h = torch.nn.functional.silu(z[:, :n // 2]) * z[:, n // 2:] if silu else z
    return h, r


def _spy(monkeypatch):
    calls = []
    real = C._launch_chain

    def spy(*a, **kw):
        calls.append(len(a[2]))
        return real(*a, **kw)

    monkeypatch.setattr(C, "_launch_chain", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("H,I,Q,bias", [(1024, 1536, 1536, False), (768, 2048, 1280, True)])
def test_chain_gpu(monkeypatch, dtype, k, M, H, I, Q, bias):
    dev = "cuda"
    stages = _layer(H, I, Q, k, dtype, dev, seed=H + I + k, bias=bias)
    g = torch.Generator().manual_seed(M * H + k)
    x = torch.randn(M, H, generator=g).to(dtype).to(dev)
    res = torch.randn(M, H, generator=g).to(dtype).to(dev)
    calls = _spy(monkeypatch)
    y, r = C.linear_chain(x, res, stages)
    torch.cuda.synchronize()
    assert calls == [4]  # one fused launch
    assert y.shape == (M, Q) and y.dtype == dtype and r.shape == (M, H)
    y_ref, r_ref = _reference(x, res, stages)
    assert _rel(r, r_ref) < TOL[dtype]
    assert _rel(y, y_ref) < 2 * TOL[dtype]
    # the separate launches give the same numbers up to the order of the fp32 partial sums
    y2, r2 = C.linear_chain_unfused(x, res, stages)
    assert _rel(y, y2) < TOL[dtype] and _rel(r, r2) < TOL[dtype]
    # the arrival counters are back at zero: a second call gives the same result
    y3, r3 = C.linear_chain(x, res, stages)
    assert _rel(y3, y) < 1e-3 and torch.equal(r3, r)
    assert int(C._bar(torch.device(dev)).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3])
def test_chain_shorter_gpu(n):
    """Chains of 1..3 phases (the last layer of a model has no next q/k/v)."""
    dev, dtype = "cuda", torch.bfloat16
    stages = _layer(512, 1024, 768, 4, dtype, dev, seed=n)[:n]
    x = torch.randn(1, 512, device=dev).to(dtype)
    res = torch.randn(1, 512, device=dev).to(dtype)
    y, r = C.linear_chain(x, res, stages)
    y_ref, r_ref = _reference(x, res, stages)
    assert _rel(y, y_ref) < 2 * TOL[dtype]
    if n >= 2:
        assert _rel(r, r_ref) < TOL[dtype]
    assert int(C._bar(torch.device(dev)).abs().sum()) == 0


@pytest.mark.gpu
def test_chain_graph_gpu():
    """Captured in a CUDA graph: replays with new inputs match eager calls."""
    dev, dtype = "cuda", torch.bfloat16
    stages = _layer(1024, 2048, 1536, 4, dtype, dev, seed=7)
    x = torch.randn(1, 1024, device=dev).to(dtype)
    res = torch.randn(1, 1024, device=dev).to(dtype)
    graph, (y, r) = capture(lambda: C.linear_chain(x, res, stages))
    for i in range(3):
        x.copy_(torch.randn(1, 1024, device=dev).to(dtype))
        res.copy_(torch.randn(1, 1024, device=dev).to(dtype))
        graph.replay()
        y_e, r_e = C.linear_chain(x, res, stages)
        torch.cuda.synchronize()
        assert torch.equal(r, r_e) and _rel(y, y_e) < 1e-3, i


@pytest.mark.gpu
def test_chain_falls_back_gpu(monkeypatch):
    """M above MAX_M, a canonical-layout module, or KBIT_CHAIN=0: separate launches, same result."""
    dev, dtype = "cuda", torch.float16
    stages = _layer(512, 1024, 512, 4, dtype, dev, seed=3)
    calls = _spy(monkeypatch)
    x = torch.randn(C.MAX_M + 1, 512, device=dev).to(dtype)
    res = torch.randn_like(x)
    y, r = C.linear_chain(x, res, stages)
    y_ref, r_ref = _reference(x, res, stages)
    assert calls == [] and _rel(y, y_ref) < 2 * TOL[dtype]
    monkeypatch.setenv("KBIT_CHAIN", "0")
    C.linear_chain(x[:1], res[:1], stages)
    assert calls == []


def test_chain_cpu_fallback():
    """On the CPU (interpreter / torch reference paths) the chain runs its stages one by one."""
    dtype = torch.float32
    stages = _layer(64, 96, 80, 4, dtype, "cpu", seed=11, bias=True)
    x = torch.randn(3, 64)
    res = torch.randn(3, 64)
    y, r = C.linear_chain(x, res, stages)
    y_ref, r_ref = _reference(x, res, stages)
    assert y.shape == (3, 80) and _rel(y, y_ref) < 1e-3 and _rel(r, r_ref) < 1e-5


def test_chain_bad_input():
    stages = _layer(64, 96, 80, 4, torch.float32, "cpu", seed=1)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="residual"):
        C.linear_chain(x, None, stages)
    with pytest.raises(ValueError, match="in_features"):
        C.linear_chain(torch.randn(1, 32), torch.randn(1, 32), stages)
    with pytest.raises(ValueError, match="stages"):
        C.linear_chain(x, torch.randn(1, 64), [])
    with pytest.raises(ValueError, match="norm weight"):
        C.linear_chain(x, torch.randn(1, 64), [(stages[1][0], torch.ones(32), 1e-5, True)])
