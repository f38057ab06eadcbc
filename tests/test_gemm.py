"""kbit.ops.gemm (fused tensor-core GEMM), dequant + cuBLAS and the dispatcher (kbit.dispatch.linear) against the
float64 reference.

CPU: the interpreter, small shapes, fp16 activations. GPU (``-m gpu``): every k, M in {1..8, 9, 17, 100, 1000,
4096}, odd N and K.
"""
import pytest
import torch

import kbit
from kbit.dispatch.linear import dequant_mm, linear, pick
from kbit.ops.gemm import gemm_fused, gemm_reference
from kbit.ops.reference import linear_tensors_reference
from kbit.tuning.gemm import Choice, GemmConfig, gemm_choice, split_k
from kbit.tuning.tables import m_bucket

GPU = torch.cuda.is_available()


def _args(qw):
    return (qw.codes, qw.scales, qw.tensor_scale, qw.codebook)


def _kw(qw):
    return dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.shape[0], K=qw.shape[1])


def _rel(y, r):
    assert torch.isfinite(y).all()
    return float((y.double() - r).norm() / r.norm())


CPU_CONFIGS = [
    GemmConfig(BM=16, BN=32, BK=64, SWAP=True, SPLIT_K=1, num_warps=4, num_stages=2),
    GemmConfig(BM=32, BN=32, BK=128, SWAP=False, SPLIT_K=2, GROUP_M=2, num_warps=4, num_stages=2),
    GemmConfig(BM=16, BN=64, BK=32, SWAP=True, SPLIT_K=3, num_warps=4, num_stages=2),
]


@pytest.mark.skipif(GPU, reason="interpreter test")
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("blocksize,scale_format", [(32, "log8"), (64, "fp16"), (128, "log8")])
def test_fused_interpreter(k, blocksize, scale_format):
    torch.manual_seed(k + blocksize)
    N, K, M = 45, 200, 19
    qw = kbit.quantize(torch.randn(N, K), k=k, blocksize=blocksize, scale_format=scale_format)
    x = torch.randn(M, K).half()
    bias = torch.randn(N)
    r = gemm_reference(x, *_args(qw), **_kw(qw), bias=bias)
    for cfg in CPU_CONFIGS:
        y = gemm_fused(x, *_args(qw), **_kw(qw), bias=bias, config=cfg)
        assert y.shape == (M, N) and y.dtype == torch.float16
        assert _rel(y, r) < 3e-3, cfg


def test_linear_cpu_reference_and_leading_dims():
    torch.manual_seed(0)
    qw = kbit.quantize(torch.randn(33, 70), k=4)
    x = torch.randn(2, 3, 70)
    y = linear(x, *_args(qw), **_kw(qw))
    assert y.shape == (2, 3, 33)
    r = gemm_reference(x, *_args(qw), **_kw(qw))
    assert _rel(y, r) < 1e-5
    assert torch.equal(y, linear_tensors_reference(x, *_args(qw), **_kw(qw)))


def test_validation_messages():
    qw = kbit.quantize(torch.randn(16, 64), k=4)
    with pytest.raises(ValueError, match="last dimension K=64"):
        gemm_fused(torch.randn(2, 32).half(), *_args(qw), **_kw(qw))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        gemm_fused(torch.randn(2, 64), *_args(qw), **_kw(qw))


def test_dispatch_table_and_heuristic():
    assert m_bucket(1) == 1 and m_bucket(9) == 16 and m_bucket(5000) == 4096
    assert pick(1, 4096, 4096, 4).kernel == "gemv"
    c = pick(16, 4096, 4096, 4)
    assert isinstance(c, Choice) and c.kernel == "fused" and c.config.SWAP
    assert pick(4096, 4096, 4096, 4).kernel in ("fused", "dequant_mm")
    cfg = GemmConfig(BM=16, BN=128, BK=128)
    assert split_k(cfg, 16, 4096, 14336, 132) > 1
    assert split_k(cfg, 16, 57344, 8192, 132) == 1
    # the CUDA small-M kernel (reached through "gemv") takes every dense M <= MMA_MAX_M where it can run
    assert pick(32, 4096, 4096, 4, mma=True).kernel == "gemv"
    assert pick(16, 4096, 4096, 4, mma=False).kernel == "fused"
    assert pick(64, 4096, 4096, 4, mma=True).kernel == "gemv"
    assert pick(65, 4096, 4096, 4, mma=True).kernel != "gemv"
    # with its sm_90 kernel 7 up to 2048 rows, and beyond on weights of >= 2e8 elements
    assert pick(65, 8192, 4096, 4, mma=True, large=True).kernel == "gemv"
    assert pick(256, 4096, 4096, 4, mma=True, large=True).kernel != "gemv"  # small weight: dequant + cuBLAS
    assert pick(64, 4096, 4096, 4, mma=True, large=True).kernel == "gemv"  # small weight, M <= 64: kernel 1
    assert pick(65, 4096, 4096, 4, mma=True, large=True).kernel != "gemv"
    assert pick(32, 4096, 4096, 4, mma=True, large=True).kernel == "gemv"
    assert pick(2048, 4096, 4096, 4, mma=True, large=True).kernel == "gemv"
    assert pick(2049, 4096, 4096, 4, mma=True, large=True).kernel != "gemv"
    assert pick(4096, 57344, 8192, 4, mma=True, large=True).kernel == "gemv"
    assert pick(100, 4096, 4096, 4, mma=False, large=True).kernel != "gemv"
    assert gemm_choice(16, 4096, 4096, 4, grouped=True).kernel != "gemv"


def test_fake_impls():
    qw = kbit.quantize(torch.randn(16, 64), k=3)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        for op in (torch.ops.kbit.linear, torch.ops.kbit.gemm):
            y = op(x, torch.empty(qw.codes.shape, dtype=torch.int32),
                   torch.empty(qw.scales.shape, dtype=torch.uint8), torch.empty(()), torch.empty(8), 3, 32, "log8",
                   16, 64, None)
            assert y.shape == (2, 5, 16) and y.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_all_paths(k, dtype):
    torch.manual_seed(k)
    N, K = 1001, 1000  # odd N, K not a multiple of the block
    qw = kbit.quantize(torch.randn(N, K, device="cuda"), k=k)
    bias = torch.randn(N, device="cuda")
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 100, 1000, 4096):
        x = torch.randn(M, K, device="cuda").to(dtype)
        r = gemm_reference(x, *_args(qw), **_kw(qw), bias=bias)
        assert _rel(linear(x, *_args(qw), **_kw(qw), bias=bias), r) < 1e-2, M
        if M > 8:
            assert _rel(gemm_fused(x, *_args(qw), **_kw(qw), bias=bias), r) < 1e-2, M
            assert _rel(dequant_mm(x, *_args(qw), **_kw(qw), bias=bias), r) < 1e-2, M
