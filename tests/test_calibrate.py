"""kbit.calibrate: GPTQ rounding into the kbit format, the layer-by-layer model pass, the Hadamard rotation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kbit
from kbit.calibrate import (
    Hessian,
    RandomHadamard,
    calibrate_layers,
    calibrate_model,
    decoder_layers,
    gptq_quantize,
    hadamard,
    hadamard_block,
)
from kbit.format import KbitWeight
from kbit.format.reference import dequantize_reference


def _calibration(K: int, T: int = 2048, seed: int = 0) -> torch.Tensor:
    """Correlated inputs ``[T, K]`` with a few large channels (what real activations look like)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g, dtype=torch.float64) / K ** 0.5 + torch.eye(K, dtype=torch.float64)
    X = torch.randn(T, K, generator=g, dtype=torch.float64) @ mix
    X[:, : max(1, K // 32)] *= 8
    return X


def _output_error(X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor) -> float:
    """``||X W^T - X W_hat^T||^2`` in float64."""
    return float(((X @ (W.double() - W_hat.double()).T) ** 2).sum())


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("scales", ["updated", "original"])
def test_gptq_lowers_output_error_against_rtn(k, scales):
    K, N = 160, 48
    X = _calibration(K)
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    qw = gptq_quantize(W, (X.T @ X).float(), k=k, scales=scales)
    rtn = _output_error(X, W, dequantize_reference(kbit.quantize(W, k=k)))
    gptq = _output_error(X, W, dequantize_reference(qw))
    assert gptq < 0.8 * rtn, (k, scales, gptq / rtn)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("K", [160, 100])
def test_rotated_gptq_lowers_the_rotated_layer_error(k, K):
    """GPTQ on ``W R`` with ``R^T H R``: the rotated layer ``(x R) Q(W R)^T`` errs less than rounding ``W R`` to
    nearest, on the calibration batch; the result records the rotation and is rounded on ``W R``."""
    from kbit.format import Rotation
    from kbit.ops.quantize import unrotate_weight

    X = _calibration(K)
    W = torch.randn(48, K, generator=torch.Generator().manual_seed(2))
    qw = gptq_quantize(W, (X.T @ X).float(), k=k, rotation="hadamard", seed=4)
    assert qw.rotation == Rotation.for_width(K, 4)
    rtn = kbit.quantize(W, k=k, rotation="hadamard", seed=4)
    R = qw.rotation.matrix(K)
    err = {name: _output_error(X @ R, W.double() @ R, dequantize_reference(q, torch.float64))
           for name, q in (("gptq", qw), ("rtn", rtn))}
    assert err["gptq"] < 0.8 * err["rtn"], (k, K, err)
    back = unrotate_weight(dequantize_reference(qw, torch.float64), qw.rotation)  # the same error unrotated
    assert abs(_output_error(X, W, back) - err["gptq"]) < 1e-6 * err["gptq"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [37, 96, 200])
def test_gptq_result_is_a_valid_weight_odd_k_and_dtypes(dtype, K):
    X = _calibration(K, T=512)
    W = torch.randn(24, K).to(dtype)
    qw = gptq_quantize(W, (X.T @ X / X.shape[0]).to(dtype), k=3)  # scaled: fp16 holds it
    assert isinstance(qw, KbitWeight) and qw.shape == (24, K)
    qw.validate()
    ref = kbit.quantize(W, k=3)
    assert qw.codes.shape == ref.codes.shape and qw.scales.dtype == ref.scales.dtype
    assert torch.equal(qw.tensor_scale, ref.tensor_scale) and torch.equal(qw.codebook, ref.codebook)
    W_hat = dequantize_reference(qw)
    assert _output_error(X, W, W_hat) < _output_error(X, W, dequantize_reference(ref))
    lin = kbit.KbitLinear.from_weight(qw, dtype=torch.float32)
    x = torch.randn(5, K)
    torch.testing.assert_close(lin(x), x @ W_hat.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scales", ["updated", "original"])
@pytest.mark.parametrize("scale_format", ["log8", "fp16"])
def test_gptq_with_identity_hessian_is_round_to_nearest(scales, scale_format):
    W = torch.randn(40, 100)
    qw = gptq_quantize(W, torch.eye(100), k=4, scales=scales, scale_format=scale_format)
    ref = kbit.quantize(W, k=4, scale_format=scale_format)
    for name in ("codes", "scales", "tensor_scale", "codebook"):
        assert torch.equal(getattr(qw, name), getattr(ref, name)), name


def test_gptq_act_order_dead_columns_and_codebooks():
    K = 128
    X = _calibration(K)
    X[:, 5] = 0  # an input never seen: its column rounds to nearest
    W = torch.randn(32, K)
    H = (X.T @ X).float()
    rtn = _output_error(X, W, dequantize_reference(kbit.quantize(W, k=3)))
    for kw in ({"act_order": True, "scales": "original"}, {"codebook": "fit"}, {"codebook": "lloyd"},
               {"blocksize": 64, "columns": 64}):
        qw = gptq_quantize(W, H, k=3, **kw)
        assert _output_error(X, W, dequantize_reference(qw)) < rtn, kw


def test_gptq_errors_name_the_argument():
    W, H = torch.randn(8, 64), torch.eye(64)
    with pytest.raises(ValueError, match=r"H: expected shape \(64, 64\) or"):
        gptq_quantize(W, torch.eye(32))
    with pytest.raises(ValueError, match="scales: expected 'original' with act_order"):
        gptq_quantize(W, H, act_order=True)
    with pytest.raises(ValueError, match="scales: expected one of"):
        gptq_quantize(W, H, scales="best")
    with pytest.raises(ValueError, match="columns: expected a multiple of blocksize"):
        gptq_quantize(W, H, columns=48)
    with pytest.raises(ValueError, match="damp: expected"):
        gptq_quantize(W, H, damp=-1.0)
    with pytest.raises(ValueError, match="W: expected a 2-D weight"):
        gptq_quantize(torch.randn(2, 8, 64), H, act_order=True, scales="original")
    with pytest.raises(ValueError, match="H: expected finite"):
        gptq_quantize(W, torch.full((64, 64), float("nan")))
    with pytest.raises(ValueError, match="k: expected one of"):
        gptq_quantize(W, H, k=6)


def test_hessian_accumulates_x_transpose_x():
    h = Hessian(24)
    xs = [torch.randn(3, 7, 24, dtype=torch.bfloat16), torch.randn(5, 24)]
    for x in xs:
        h.add(x)
    ref = sum(x.double().reshape(-1, 24).T @ x.double().reshape(-1, 24) for x in xs)
    torch.testing.assert_close(h.H.double(), ref, rtol=1e-5, atol=1e-4)
    assert h.tokens == 26


# ------------------------------------------------------------------------------------------------- rotation


@pytest.mark.parametrize("K", [1, 7, 64, 96, 576, 640])
def test_rotation_keeps_the_layer_output(K):
    rot = RandomHadamard(K, seed=3)
    R = rot.matrix()
    torch.testing.assert_close(R @ R.T, torch.eye(K, dtype=torch.float64), rtol=0, atol=1e-12)
    x, W = torch.randn(5, 3, K, dtype=torch.float64), torch.randn(11, K, dtype=torch.float64)
    torch.testing.assert_close(rot.rotate(x), x @ R, rtol=0, atol=1e-12)
    torch.testing.assert_close(rot.unrotate(x), x @ R.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(rot.rotate(x) @ rot.rotate(W).T, x @ W.T, rtol=1e-12, atol=1e-12)
    H = x.reshape(-1, K).T @ x.reshape(-1, K)
    torch.testing.assert_close(rot.rotate_hessian(H), R.T @ H @ R, rtol=1e-12, atol=1e-10)


def test_rotation_blocks_seeds_and_errors():
    assert hadamard_block(576) == 64 and hadamard_block(1536) == 512 and hadamard_block(33) == 1
    assert hadamard_block(4096, max_block=256) == 256
    h = hadamard(8)
    torch.testing.assert_close(h @ h, torch.eye(8, dtype=torch.float64))
    assert torch.equal(RandomHadamard(64, seed=1).signs(), RandomHadamard(64, seed=1).signs())
    assert not torch.equal(RandomHadamard(64, seed=1).signs(), RandomHadamard(64, seed=2).signs())
    assert RandomHadamard(96, block=32).block == 32
    with pytest.raises(ValueError, match="b: expected a power of two"):
        hadamard(12)
    with pytest.raises(ValueError, match="block: expected a power of two dividing K=96"):
        RandomHadamard(96, block=64)
    with pytest.raises(ValueError, match="x: expected last dimension K=64"):
        RandomHadamard(64).rotate(torch.randn(2, 32))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_rotation_spreads_scattered_outliers(k):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 256, generator=g)
    W[torch.rand(64, 256, generator=g) < 0.01] *= 20  # 1% outliers: a sixth of the blocks hold one
    rot = RandomHadamard(256, seed=0)
    rtn = ((dequantize_reference(kbit.quantize(W, k=k)) - W) ** 2).sum()
    rotated = ((rot.unrotate(dequantize_reference(kbit.quantize(rot.rotate(W), k=k))) - W) ** 2).sum()
    assert rotated < 0.9 * rtn


# ---------------------------------------------------------------------------------------------- model pass


class _Layer(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, hidden_states, scale=None):
        return hidden_states + scale * self.down(torch.relu(self.up(hidden_states)))


class _TinyLM(nn.Module):
    """Embedding, a ModuleList of layers taking a keyword argument (like a mask), a head."""

    def __init__(self, vocab: int = 50, d: int = 72, hidden: int = 100, n: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d, hidden) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, use_cache=False):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return self.head(h)


def test_calibrate_model_replaces_decoder_linears_and_beats_rtn():
    torch.manual_seed(0)
    model = _TinyLM().eval()
    batches = [torch.randint(0, 50, (2, 16)) for _ in range(4)]
    with torch.no_grad():
        ref = torch.cat([model(b) for b in batches])
    assert decoder_layers(model)[0] == "layers"

    rtn = _TinyLM().eval()
    rtn.load_state_dict(model.state_dict())
    for layer in rtn.layers:
        for n in ("up", "down"):
            setattr(layer, n, kbit.KbitLinear.from_linear(getattr(layer, n), k=2, dtype=torch.float32))
    calibrate_model(model, batches, k=2)
    assert all(isinstance(m, kbit.KbitLinear) for layer in model.layers for m in (layer.up, layer.down))
    assert isinstance(model.head, nn.Linear)
    with torch.no_grad():
        err_gptq = float(((torch.cat([model(b) for b in batches]) - ref) ** 2).sum())
        err_rtn = float(((torch.cat([rtn(b) for b in batches]) - ref) ** 2).sum())
    assert err_gptq < err_rtn


def test_calibrate_layers_sees_quantized_predecessors():
    torch.manual_seed(0)
    model = _TinyLM().eval()
    seen, hessians = [], {}

    def record(name, linear, H):
        seen.append((name, H.shape[0]))
        hessians[name] = H.double()
        linear.weight.data.zero_()  # quantize to nothing: the next layer's inputs must show it
        return None

    ids = torch.randint(0, 50, (1, 8))
    x0 = model.embed(ids)[0].detach().double()
    calibrate_layers(model, [ids], record)
    # layer 0 became the identity (residual only), so layer 1 sees the embeddings themselves
    torch.testing.assert_close(hessians["layers.1.up"], x0.T @ x0, rtol=1e-5, atol=1e-4)
    assert seen == [("layers.0.up", 72), ("layers.0.down", 100), ("layers.1.up", 72), ("layers.1.down", 100),
                    ("layers.2.up", 72), ("layers.2.down", 100)]
    with pytest.raises(ValueError, match="batches: expected at least one batch"):
        calibrate_layers(model, [], record)


@pytest.mark.parametrize("shared_h", [False, True])
def test_gptq_stack_equals_one_matrix_at_a_time(shared_h):
    K = 72
    Hs = torch.stack([(X.T @ X).float() for X in (_calibration(K, 256, seed=s) for s in range(3))])
    Hs = Hs[:1].expand(3, K, K) if shared_h else Hs
    W = torch.randn(3, 20, K)
    W[1] *= 5  # its own tensor scale
    qw = gptq_quantize(W, Hs[0] if shared_h else Hs, k=3)
    assert qw.shape == (3, 20, K) and qw.tensor_scale.shape == (3,)
    for e in range(3):
        one = gptq_quantize(W[e], Hs[e], k=3)
        torch.testing.assert_close(dequantize_reference(qw[e]), dequantize_reference(one), rtol=1e-6, atol=1e-6)
