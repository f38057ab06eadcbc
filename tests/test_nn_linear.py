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


def test_model_dtype_casts_keep_the_format():
    """``.to(torch.bfloat16)`` / ``.half()`` / ``.float()`` on a model convert the bias and the module's dtype, never
    the quantized weight's float buffers (codebook, tensor scale, float16 scales): the weight is bit-for-bit what it
    was, and the forward still runs (it failed on the codebook's dtype before)."""
    for fmt in ("log8", "fp16"):
        torch.manual_seed(0)
        q = KbitLinear.from_linear(nn.Linear(200, 45), k=3, scale_format=fmt)
        before = {n: b.clone() for n, b in q.named_buffers() if n != "bias"}
        model = nn.Sequential(q)
        for cast, dtype in ((lambda m: m.to(torch.bfloat16), torch.bfloat16), (nn.Module.half, torch.float16),
                            (nn.Module.float, torch.float32)):
            cast(model)
            assert q.dtype == dtype and q.bias.dtype == dtype
            for n, b in before.items():
                assert q.get_buffer(n).dtype == b.dtype and torch.equal(q.get_buffer(n), b), (fmt, n)
            y = q(torch.randn(3, 200, dtype=dtype))
            assert y.dtype == dtype and torch.isfinite(y).all()


def test_cpu_bfloat16_product():
    """bfloat16 x on the CPU: the product in bfloat16 (float32 accumulation) on a bfloat16 copy of the weight, kept
    beside (not instead of) the float32 one; within bfloat16 rounding of the float64 reference."""
    from kbit.format.reference import dequantize_reference

    lin, q = _layer(k=4)
    x = torch.randn(5, 200)
    w64 = dequantize_reference(q.weight(), torch.float64)
    xb = x.bfloat16()
    ref = xb.double() @ w64.T + lin.bias.detach().double()
    y32, yb = q(x), q(xb)
    assert yb.dtype == torch.bfloat16
    assert _rel(yb, ref) < 8e-3 and _rel(y32, x.double() @ w64.T + lin.bias.detach().double()) < 1e-6
    assert q.kept_cpu_weight(torch.bfloat16).dtype == torch.bfloat16
    assert q.kept_cpu_weight(torch.float32).dtype == torch.float32
    f16 = q(x.half())  # float16 multiplies in float32 (float16 GEMM is slow on CPUs): no float16 copy kept
    assert f16.dtype == torch.float16 and q.kept_cpu_weight(torch.float16) is None


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_fast_path_matches_general_path(dtype, bias):
    """Layout "mma-v1" on CUDA runs a launcher prepared once a signature (``kbit.dispatch.linear.fast_linear``): the
    same outputs as the general path (``linear_repacked``) and the float64 reference for M = 1, 3, 8 and leading dims;
    an x whose address is not 16-byte aligned falls back; weights loaded in place and a new bias are read; the
    torch.library op takes the same launcher; a captured graph replays it."""
    from kbit.dispatch import linear as D
    from kbit.format.reference import dequantize_reference
    from kbit.ops import gemv_mma

    torch.manual_seed(0)
    lin = nn.Linear(1024, 300, bias=bias, device="cuda", dtype=dtype)
    q = KbitLinear.from_linear(lin, k=4).repack_for_kernels()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3

    def general(x):
        return gemv_mma.linear_repacked(x, q.codes, q.scales, q.tensor_scale, q.codebook,
                                        scale_format=q.scale_format, bias=q.bias, k=q.k, blocksize=q.blocksize,
                                        N=300, K=1024)

    def reference(x):
        w = dequantize_reference(q.weight()).double()
        return x.double() @ w.T + (q.bias.double() if bias else 0)

    for shape in [(1, 1024), (3, 1024), (2, 4, 1024), (8, 1024)]:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        torch.full((*shape[:-1], 300), float("nan"), device="cuda", dtype=dtype)  # poison the next block
        for _ in range(2):
            y = q(x)
            assert y.shape == (*shape[:-1], 300) and y.dtype == dtype
            assert _rel(y, general(x)) < tol and _rel(y, reference(x)) < tol, shape
    assert any(v for v in D._PREPARED.values()), "the fast path was not taken"
    y_op = torch.ops.kbit.linear_mma_v1(x, q.codes, q.scales, q.tensor_scale, q.codebook, q.k, q.blocksize,
                                        q.scale_format, 300, 1024, q.bias)  # the torch.library op: same launcher
    assert _rel(y_op, reference(x)) < tol
    buf = torch.randn(1, 1025, device="cuda", dtype=dtype)
    xm = buf[:, 1:]  # 2 bytes past a 16-byte boundary: the launcher declines, the general path runs
    assert _rel(q(xm), reference(xm)) < tol
    # new weights copied in place (same addresses), then a bias replaced by assignment
    other = KbitLinear.from_linear(nn.Linear(1024, 300, bias=bias, device="cuda", dtype=dtype), k=4)
    other.repack_for_kernels()
    q.load_state_dict(other.state_dict())
    x = torch.randn(1, 1024, device="cuda", dtype=dtype)
    assert _rel(q(x), reference(x)) < tol
    if bias:
        q.bias = torch.randn(300, device="cuda", dtype=dtype)  # a new buffer at a new address
        assert _rel(q(x), reference(x)) < tol
    # graph capture of the fast path (a warm-up call on a side stream, then the capture)
    from kbit.bench.timing import capture

    static_x = x.clone()
    eager = q(static_x)
    g, out = capture(lambda: q(static_x))
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert _rel(out, eager) < 1e-3  # split-K tiles add fp32 parts in arrival order


def test_moe_dtype_cast_keeps_the_format():
    """KbitMoE under ``.to(torch.bfloat16)``: only the router weight and the module's dtype follow."""
    from kbit.nn import KbitMoE

    torch.manual_seed(0)
    E, H, inter = 4, 64, 32
    m = KbitMoE.from_float(torch.randn(E, 2 * inter, H), torch.randn(E, H, inter), top_k=2, k=3, dtype=torch.float32,
                           router_weight=torch.randn(E, H))
    before = {n: b.clone() for n, b in m.named_buffers() if n != "router_weight"}
    m.to(torch.bfloat16)
    assert m.dtype == torch.bfloat16 and m.router_weight.dtype == torch.bfloat16
    for n, b in before.items():
        assert m.get_buffer(n).dtype == b.dtype and torch.equal(m.get_buffer(n), b), n


@pytest.mark.gpu
@pytest.mark.parametrize("repack", [False, True])
def test_gpu_float32_activations(repack):
    """A float32 x on CUDA (a float32 checkpoint loaded on a GPU) goes to the Triton GEMV, not to the small-M CUDA
    kernels, which read 16-bit activations: a float32 x read as float16 gave NaN for M = 1..8. Both layouts
    (canonical, and "mma-v1" after a repack) against the float64 reference; the kernels' own entry refuses it."""
    from kbit.format.reference import dequantize_reference
    from kbit.ops import gemv_mma

    torch.manual_seed(0)
    lin = KbitLinear.from_linear(nn.Linear(1024, 768, bias=True), k=4).to("cuda")
    if repack:
        lin.repack_for_kernels()
    W = dequantize_reference(lin.weight(), torch.float64)
    for M in (1, 3, 8, 40):
        x = torch.randn(M, 1024, device="cuda")
        y = lin(x)
        assert y.dtype == torch.float32 and torch.isfinite(y).all(), M
        want = x.double() @ W.T + lin.bias.double()
        assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-3, M
    if repack:
        with pytest.raises(TypeError, match="x: expected float16 or bfloat16"):
            gemv_mma.linear_repacked(x, lin.codes, lin.scales, lin.tensor_scale, lin.codebook, k=4, N=768, K=1024)
