"""kbit.nn.KbitLinear on the CPU (reference path) and, with ``-m gpu``, CUDA graphs and torch.compile."""
import pytest
import torch
from torch import nn

from kbit.nn import KbitLinear


def _layer(bias=True, k=4, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    lin = nn.Linear(200, 45, bias=bias, device=device, dtype=dtype)
    return lin, KbitLinear.from_linear(lin, k=k)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_forward_leading_dims(bias, k):
    lin, q = _layer(bias, k)
    x = torch.randn(2, 3, 200)
    y = q(x)
    assert y.shape == (2, 3, 45) and y.dtype == x.dtype
    w = q.weight()
    from kbit.format.reference import dequantize_reference
    ref = x @ dequantize_reference(w).T + (lin.bias.detach() if bias else 0)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)


def test_state_dict_roundtrip_and_repr():
    _, q = _layer()
    sd = q.state_dict()
    assert {"codes", "scales", "tensor_scale", "codebook", "bias", "_extra_state"} <= set(sd)
    q2 = KbitLinear(200, 45, k=4, dtype=torch.float32)
    q2.load_state_dict(sd)
    x = torch.randn(4, 200)
    assert torch.equal(q2(x), q(x))
    assert "k=4" in repr(q) and "blocksize=32" in repr(q)
    q3 = KbitLinear(200, 45, k=3)
    with pytest.raises((ValueError, RuntimeError)):
        q3.load_state_dict(sd)


def test_torch_compile_cpu():
    _, q = _layer()
    x = torch.randn(3, 200)
    f = torch.compile(q, backend="eager", fullgraph=True)
    assert torch.equal(f(x), q(x))


@pytest.mark.gpu
def test_gpu_graph_replay_and_compile():
    lin, q = _layer(dtype=torch.bfloat16, device="cuda")
    for M in (1, 4, 16, 300):
        x = torch.randn(M, 200, device="cuda", dtype=torch.bfloat16)
        eager = q(x)
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            q(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = q(static_x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), M
        f = torch.compile(q, fullgraph=True)
        assert torch.equal(f(x), eager), M


def test_cpu_weight_cache_follows_loaded_state():
    a, b = _layer(k=3)[1], _layer(k=3)[1]
    with torch.no_grad():
        b.codes.copy_(torch.randint(-2**31, 2**31 - 1, b.codes.shape, dtype=torch.int32))
    x = torch.randn(4, a.in_features)
    ya = a(x)  # fills a's cache
    a.load_state_dict(b.state_dict())  # in-place copies: the cache must not serve a's old weight
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.equal(a(x), ya)
