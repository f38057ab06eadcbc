"""Rotated weights end to end: ``kbit.quantize(..., rotation=)`` and ``KbitLinear`` feeding ``x R`` to ``W R``.

The rotated layer must equal ``(x R) (dequant(W R))^T`` in float64 tightly (the same weight, the same rotated
input), and ``x W^T`` within the quantization error. CPU tests run the rotation kernel under TRITON_INTERPRET=1;
``-m gpu`` covers the GEMV / mid-M / large-M paths."""
import pytest
import torch
from torch import nn

import kbit
from kbit.format import Rotation
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops.hadamard import rotate, rotate_reference
from kbit.ops.quantize import rotate_weight, unrotate_weight

#: relative output error of a k-bit layer on Gaussian weights and inputs, with room (RTN, blocksize 32)
QUANT_ERROR = {2: 0.45, 3: 0.22, 4: 0.11, 5: 0.06}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("K", [7, 100, 96, 256])
def test_rotate_weight_is_the_dense_rotation(K):
    r = Rotation.for_width(K, seed=11)
    W = torch.randn(3, 5, K, dtype=torch.float64)
    R = r.matrix(K)
    torch.testing.assert_close(rotate_weight(W, r), W @ R, rtol=0, atol=1e-13)
    torch.testing.assert_close(unrotate_weight(W, r), W @ R.T, rtol=0, atol=1e-13)
    torch.testing.assert_close(rotate_weight(W, r), rotate_reference(W, r), rtol=0, atol=1e-13)
    assert rotate_weight(W.float(), r).dtype == torch.float32


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_quantize_records_the_rotation_and_quantizes_w_r(k):
    torch.manual_seed(k)
    W = torch.randn(33, 96)
    qw = kbit.quantize(W, k=k, rotation="hadamard", seed=5)
    assert qw.rotation == Rotation.for_width(96, 5) and qw.rotation.block == 32
    plain = kbit.quantize(rotate_weight(W, qw.rotation), k=k)  # the same weight W R, quantized unrotated
    assert torch.equal(qw.codes, plain.codes) and torch.equal(qw.scales, plain.scales)
    assert plain.rotation is None
    back = unrotate_weight(dequantize_reference(qw, torch.float64), qw.rotation)
    assert _rel(back, W) < QUANT_ERROR[k]
    same = kbit.quantize(W, k=k, rotation=Rotation(seed=5, block=32))
    assert torch.equal(same.codes, qw.codes) and same.rotation == qw.rotation


def test_quantize_rotation_errors():
    W = torch.randn(8, 96)
    with pytest.raises(ValueError, match="rotation: expected None, one of"):
        kbit.quantize(W, rotation="walsh")
    with pytest.raises(ValueError, match="a multiple of the rotation block 64"):
        kbit.quantize(W, rotation=Rotation(seed=0, block=64))
    with pytest.raises(ValueError, match="seed"):
        kbit.quantize(W, rotation="hadamard", seed=-1)
    with pytest.raises(ValueError, match="finite values"):
        kbit.quantize(torch.full((8, 96), float("nan")), rotation="hadamard")
    with pytest.raises(TypeError, match="rotation: expected None or a kbit.format.Rotation"):
        KbitLinear(96, 8, rotation="hadamard")
    with pytest.raises(ValueError, match="in_features: expected a multiple of the rotation block 64"):
        KbitLinear(96, 8, rotation=Rotation(seed=0, block=64))


def _rotated(K, N=40, k=3, seed=7, dtype=torch.float32):
    torch.manual_seed(K + k)
    lin = nn.Linear(K, N)
    return lin, KbitLinear.from_linear(lin, k=k, rotation="hadamard", seed=seed, dtype=dtype)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("K", [96, 100, 77, 512])
def test_rotated_layer_float32(k, K):
    """K = 100 (blocks of 4), 77 (signs only), 512 (one block)."""
    lin, q = _rotated(K, k=k)
    assert q.rotation == Rotation.for_width(K, 7) and q.weight().rotation == q.rotation
    x = torch.randn(2, 3, K)
    y = q(x).double()
    w_r = dequantize_reference(q.weight(), torch.float64)  # W R, quantized
    b = lin.bias.detach().double()
    xr = x.double() @ q.rotation.matrix(K)
    assert _rel(y, xr @ w_r.T + b) < 1e-6
    exact = x.double() @ lin.weight.detach().double().T + b
    assert _rel(y, exact) < QUANT_ERROR[k]
    torch.testing.assert_close(q.forward_rotated(rotate(x, q.rotation)), q(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_rotated_layer_other_dtypes(dtype):
    lin, q = _rotated(160, k=4, dtype=dtype)
    x = torch.randn(5, 160, dtype=dtype)
    y = q(x)
    assert y.dtype == dtype
    w_r = dequantize_reference(q.weight(), torch.float64)
    ref = x.double() @ q.rotation.matrix(160) @ w_r.T + lin.bias.detach().double()
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float64: 1e-6}[dtype]
    assert _rel(y, ref) < tol
    assert _rel(y, x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()) < QUANT_ERROR[4]


def test_rotated_state_dict_round_trip_and_refusals():
    _, q = _rotated(96)
    sd = q.state_dict()
    assert sd["_extra_state"]["rotation"] == {"kind": "hadamard", "seed": 7, "block": 32}
    q2 = KbitLinear(96, 40, k=3, dtype=torch.float32, rotation=q.rotation)
    q2.load_state_dict(sd)
    x = torch.randn(4, 96)
    assert torch.equal(q2(x), q(x)) and "rotation=Rotation(seed=7" in repr(q2)
    with pytest.raises(ValueError, match="an unrotated weight cannot load into a layer with a rotation"):
        q2.load_state_dict(KbitLinear(96, 40, k=3, dtype=torch.float32).state_dict())
    with pytest.raises(ValueError, match="weight cannot load into a layer without a rotation"):
        KbitLinear(96, 40, k=3, dtype=torch.float32).load_state_dict(sd)
    other = KbitLinear(96, 40, k=3, dtype=torch.float32, rotation=Rotation(seed=8, block=32))
    with pytest.raises(ValueError, match="expected rotation="):
        other.load_state_dict(sd)


def test_rotated_layer_torch_compile_cpu():
    _, q = _rotated(96)
    x = torch.randn(3, 96)
    f = torch.compile(q, backend="eager", fullgraph=True)
    assert torch.equal(f(x), q(x))


def test_rotated_weight_file_round_trip(tmp_path):
    _, q = _rotated(100, k=5)
    kbit.save_file({"w": q.weight()}, tmp_path / "w.safetensors")
    qw = kbit.load_file(tmp_path / "w.safetensors")["w"]
    assert qw.rotation == q.rotation
    q2 = KbitLinear.from_weight(qw, q.bias, torch.float32)
    x = torch.randn(3, 100)
    assert torch.equal(q2(x), q(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K", [4096, 5120, 2880])
def test_gpu_rotated_layer_paths(dtype, K):
    """GEMV (M = 1), mid-M (7, 64) and large-M (300) paths, canonical and repacked, eager and in a CUDA graph."""
    torch._dynamo.reset()  # one compile per M below; the cases of a worker would pass dynamo's recompile limit
    torch.manual_seed(0)
    lin = nn.Linear(K, 512, device="cuda", dtype=dtype)
    q = KbitLinear.from_linear(lin, k=3, rotation="hadamard", seed=1)
    w_r = dequantize_reference(q.weight(), torch.float64)
    R = q.rotation.matrix(K, device="cuda")
    tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3
    for M in (1, 7, 64, 300):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        ref = x.double() @ R @ w_r.T + lin.bias.double()
        exact = x.double() @ lin.weight.double().T + lin.bias.double()
        y = q(x)
        assert y.dtype == dtype and _rel(y, ref) < tol, M
        assert _rel(y, exact) < QUANT_ERROR[3], M
        static_x = x.clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = q(static_x)
        g.replay()
        torch.cuda.synchronize()
        # split-K adds parts in arrival order (KBIT_DETERMINISTIC fixes it): equal up to the output's rounding
        assert _rel(out, q(x)) < 2e-3, M
        f = torch.compile(q, fullgraph=True)
        assert _rel(f(x), ref) < tol, M
