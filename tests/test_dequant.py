"""kbit.ops.dequant: bit-exact against kbit.format.reference.dequantize_reference (interpreter on the CPU)."""
import pytest
import torch

import kbit
from kbit.format.reference import dequantize_reference
from kbit.ops.dequant import dequantize_tensors

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _dq(qw, dtype, transpose=False):
    return dequantize_tensors(qw.codes, qw.scales, qw.tensor_scale, qw.codebook, k=qw.k, blocksize=qw.blocksize,
                              scale_format=qw.scale_format, shape=qw.shape, dtype=dtype, transpose=transpose)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("blocksize,scale_format", [(32, "log8"), (64, "fp16"), (128, "log8")])
@pytest.mark.parametrize("shape", [(37, 200), (2, 19, 96)])
def test_bit_exact(k, blocksize, scale_format, shape):
    torch.manual_seed(k * 100 + blocksize)
    qw = kbit.quantize(torch.randn(*shape), k=k, blocksize=blocksize, scale_format=scale_format).to(DEV)
    for dtype in (torch.float16, torch.float32):
        ref = dequantize_reference(qw, dtype)
        assert torch.equal(_dq(qw, dtype), ref)
        assert torch.equal(_dq(qw, dtype, transpose=True), ref.transpose(-1, -2))


def test_zero_block_and_float64():
    W = torch.randn(8, 96)
    W[3, 32:64] = 0  # an all-zero block: q = 255, scale 0
    qw = kbit.quantize(W, k=4).to(DEV)
    assert torch.equal(_dq(qw, torch.float64), dequantize_reference(qw, torch.float64))


def test_fake_impl_shape():
    qw = kbit.quantize(torch.randn(5, 64), k=2)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        f = torch.ops.kbit.dequantize(
                   torch.empty(qw.codes.shape, dtype=torch.int32), torch.empty(qw.scales.shape, dtype=torch.uint8),
                                      torch.empty(()), torch.empty(4), 2, 32, "log8", [5, 64], 0, True)
    assert tuple(f.shape) == (64, 5) and f.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_gpu_dequantize_hook(k):
    torch.manual_seed(k)
    qw = kbit.quantize(torch.randn(300, 333, device="cuda"), k=k)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(kbit.dequantize(qw, dtype), dequantize_reference(qw, dtype))
