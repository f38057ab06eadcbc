"""Quantize/dequantize: SQNR bars on Gaussian weights, Triton quantizer bit-exact with the torch reference
(under the interpreter on CPU, compiled on GPU), edge shapes, zero blocks, and every bad input."""

import pytest
import torch

import kbit
from kbit.format.codebooks import sqnr_db


def normal(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gaussian():
    return normal(1024, 1024, seed=1234)


def _sqnr(W, **kw):
    qw = kbit.quantize(W, **kw)
    return sqnr_db(W, kbit.dequantize(qw, torch.float32)), qw


LLOYD_BAR = {2: 9.0, 3: 14.7, 4: 20.7, 5: 26.7}
DEFAULT_BAR = {2: 4.9, 3: 13.8, 4: 20.6, 5: 26.0}


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_lloyd_sqnr_at_k_plus_quarter_bits(gaussian, k):
    db, qw = _sqnr(gaussian, k=k, codebook="lloyd")
    # codes + 8-bit scales per 32 weights + one float32 per matrix
    assert qw.bits_per_weight == k + 0.25 + 32 / gaussian.numel()
    assert db >= LLOYD_BAR[k], db


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_default_sqnr(gaussian, k):
    db, qw = _sqnr(gaussian, k=k)
    assert qw.bits_per_weight == k + 0.25 + 32 / gaussian.numel()
    assert qw.codebook_name == kbit.DEFAULT_CODEBOOK[k]
    assert db >= DEFAULT_BAR[k], db


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_fit_beats_lloyd_on_student_t(k):
    g = torch.Generator().manual_seed(5)
    # a seeded Student-t(5): normal / sqrt(chi2_5 / 5)
    z = torch.randn(512, 1024, generator=g)
    chi2 = (torch.randn(512, 1024, 5, generator=g) ** 2).sum(-1)
    W = z / torch.sqrt(chi2 / 5)
    fit, _ = _sqnr(W, k=k, codebook="fit")
    lloyd, _ = _sqnr(W, k=k, codebook="lloyd")
    assert fit >= lloyd, (fit, lloyd)


def test_blocksize_32_log8_beats_64_fp16_at_equal_bits(gaussian):
    for k in (2, 3, 4, 5):
        a, qa = _sqnr(gaussian, k=k, codebook="nf", blocksize=32, scale_format="log8")
        b, qb = _sqnr(gaussian, k=k, codebook="nf", blocksize=64, scale_format="fp16")
        assert abs(qa.bits_per_weight - qb.bits_per_weight) < 1e-3
        assert a > b, (k, a, b)


SHAPES = [(1, 32), (7, 33), (5, 2880), (3, 5, 100), (2, 1, 129), (16, 11008)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_triton_quantizer_bit_exact_with_reference(shape, k):
    W = normal(*shape, seed=k) * 0.02
    W.view(-1)[:40] = 0.0  # an all-zero block
    configs = [(b, f, c) for b in (32, 64, 128) for f in ("log8", "fp16") for c in ("nf0", "lloyd")]
    if W.shape[-1] > 1000:  # long rows are slow under the interpreter: two configurations cover them
        configs = [(32, "log8", "lloyd"), (128, "fp16", "nf0")]
    for blocksize, scale_format, codebook in configs:
        a = kbit.quantize(W, k, blocksize, codebook, scale_format, backend="triton")
        b = kbit.quantize(W, k, blocksize, codebook, scale_format, backend="torch")
        for name, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[name]), (name, blocksize, scale_format, codebook)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_input_dtypes_and_output_shape(dtype):
    W = normal(48, 70).to(dtype)
    qw = kbit.quantize(W, k=3, blocksize=64)
    assert qw.shape == (48, 70) and qw.codes.shape == (48, 128 * 3 // 32) and qw.scales.shape == (48, 2)
    out = kbit.dequantize(qw, dtype=dtype)
    assert out.shape == W.shape and out.dtype == dtype
    assert sqnr_db(W.float(), out.float()) > 13


def test_all_zero_blocks_and_tensors_dequantize_to_exact_zero():
    W = normal(4, 96)
    W[1] = 0
    W[2, 32:64] = 0
    for codebook in ("nf", "lloyd", "uniform"):  # none of these has a 0 level
        for scale_format in ("log8", "fp16"):
            out = kbit.dequantize(kbit.quantize(W, k=2, codebook=codebook, scale_format=scale_format), torch.float32)
            assert torch.isfinite(out).all()
            assert (out[1] == 0).all() and (out[2, 32:64] == 0).all()
    Z = torch.zeros(3, 8, 64)
    out = kbit.dequantize(kbit.quantize(Z, k=4), torch.float32)
    assert torch.equal(out, Z)


def test_block_max_is_exact_with_pm1_codebook_fp16_scales():
    W = normal(8, 64)
    qw = kbit.quantize(W, k=4, blocksize=64, codebook="nf", scale_format="fp16")
    out = kbit.dequantize(qw, torch.float32)
    i = W.abs().argmax(dim=1)
    rows = torch.arange(8)
    torch.testing.assert_close(out[rows, i], W[rows, i].half().float(), rtol=0, atol=0)


def test_expert_stack_has_one_tensor_scale_per_matrix():
    W = normal(3, 16, 64)
    W[1] *= 100
    qw = kbit.quantize(W, k=4)
    assert qw.tensor_scale.shape == (3,)
    torch.testing.assert_close(qw.tensor_scale, W.abs().amax(dim=(1, 2)))
    expert = qw[1]
    assert expert.shape == (16, 64)
    torch.testing.assert_close(kbit.dequantize(expert, torch.float32), kbit.dequantize(qw, torch.float32)[1])


def test_weight_object_api():
    qw = kbit.quantize(normal(64, 256), k=5)
    assert (qw.k, qw.blocksize, qw.scale_format) == (5, 32, "log8")
    assert qw.nbytes == 64 * 256 * 5 // 8 + 64 * 8 + 4 + 32 * 4
    assert qw.to("cpu").shape == qw.shape
    assert "k=5" in repr(qw)


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("W, kw, err, match", [
    (torch.ones(4, 32, dtype=torch.int32), {}, TypeError, "floating-point"),
    ([[1.0]], {}, TypeError, "torch.Tensor"),
    (torch.ones(32), {}, ValueError, "at least 2 dimensions"),
    (torch.ones(0, 32), {}, ValueError, "non-empty"),
    (torch.tensor([[1.0, float("nan")] * 16]), {}, ValueError, "finite"),
    (torch.tensor([[1.0, float("inf")] * 16]), {}, ValueError, "finite"),
    (torch.ones(2, 32), {"k": 6}, ValueError, "k: expected one of"),
    (torch.ones(2, 32), {"k": 4.0}, TypeError, "k: expected an int"),
    (torch.ones(2, 32), {"blocksize": 48}, ValueError, "blocksize"),
    (torch.ones(2, 32), {"scale_format": "fp8"}, ValueError, "scale_format"),
    (torch.ones(2, 32), {"codebook": "nope"}, ValueError, "codebook"),
    (torch.ones(2, 32), {"codebook": [0.0, 1.0]}, ValueError, "codebook"),
    (torch.ones(2, 32), {"backend": "cuda"}, ValueError, "backend"),
    (torch.full((2, 32), 1e6), {"scale_format": "fp16"}, ValueError, "overflows fp16"),
])
def test_bad_input(W, kw, err, match):
    with pytest.raises(err, match=match):
        kbit.quantize(W, **kw)


def test_bad_weight_objects():
    qw = kbit.quantize(normal(8, 64), k=4)
    with pytest.raises(ValueError, match="codes: expected shape"):
        kbit.KbitWeight(qw.codes[:, :-1], qw.scales, qw.tensor_scale, qw.codebook, qw.shape, 4, 32)
    with pytest.raises(ValueError, match="scales: expected dtype"):
        kbit.KbitWeight(qw.codes, qw.scales.half(), qw.tensor_scale, qw.codebook, qw.shape, 4, 32)
    with pytest.raises(TypeError, match="qw: expected a KbitWeight"):
        kbit.dequantize(torch.ones(2, 2))


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_gpu_quantizer_matches_reference(k):
    W = normal(3, 515, 2880, seed=k).cuda().to(torch.bfloat16)
    for scale_format in ("log8", "fp16"):
        a = kbit.quantize(W, k=k, scale_format=scale_format)  # Triton on CUDA
        b = kbit.quantize(W, k=k, scale_format=scale_format, backend="torch")
        for name, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[name]), name
        c = kbit.quantize(W.cpu(), k=k, scale_format=scale_format)
        assert torch.equal(a.codes.cpu(), c.codes)
