"""``y = x @ W.T (+ bias)`` on a k-bit weight for mid-size M: the fused tensor-core kernel (Triton). Which kernel
serves an M (a small-M kernel, this one, or dequantize + cuBLAS) is ``kbit.dispatch``'s choice.

Launchers validate -> allocate -> pick config -> launch; :func:`gemm_reference` (float64) is the oracle.
Torch op ``torch.ops.kbit.gemm`` (the fused kernel) with a fake implementation, so it traces under
``torch.compile`` and runs inside CUDA graphs (no host sync, no allocation that depends on data).
"""

from __future__ import annotations

import torch

from kbit.kernels.gemm import gemm_kernel
from kbit.ops._checks import check_linear
from kbit.ops._common import e_table
from kbit.ops.reference import gemm_reference, grouped_gemv_reference
from kbit.tuning.gemm import GemmConfig, gemm_choice, split_k
from kbit.utils.cache import TensorCache
from kbit.utils.checks import fail
from kbit.utils.device import sm_count

__all__ = ["gemm_fused", "gemm_reference", "grouped_gemm_reference", "kbit_gemm"]

_X_DTYPES = (torch.float16, torch.bfloat16)


_CB_TABLES = TensorCache(max_entries=None)  # a few bytes per live codebook


def _codebook_table(codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The codebook in the activations' dtype (the fused kernel's lookup table), cached per codebook tensor and
    version."""
    tab = _CB_TABLES.get((codebook,), dtype)
    if tab is None:
        tab = _CB_TABLES.put((codebook,), dtype, codebook.to(dtype).contiguous())
    return tab


# ------------------------------------------------------------------------------------------------ fused


def gemm_fused(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
               bias=None, config: GemmConfig | None = None):
    """Fused tensor-core ``x @ W.T (+ bias)``: fp16/bf16 ``x [..., K]`` -> ``[..., N]`` in x's dtype.

    Weight tensors in the canonical layout (``docs/format.md``) of a 2-D ``W[N, K]``; accumulation in fp32;
    each weight is rounded to x's dtype before the product (``codebook * block scale`` in fp32, then cast;
    the log8 tensor scale is applied to the fp32 sums). ``config``: pin a
    :class:`~kbit.tuning.gemm.GemmConfig`; default from ``kbit.tuning.gemm``.
    """
    kp = check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if x.dtype not in _X_DTYPES:
        fail(TypeError, "x", "dtype float16 or bfloat16", x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    cfg = config or gemm_choice(M, N, K, k, x.device).config
    sms = sm_count(x.device.index or 0) if x.is_cuda else 132
    splits = split_k(cfg, M, N, kp, sms)
    steps = -(-kp // cfg.BK)
    per_split = -(-steps // splits) * cfg.BK
    splits = -(-kp // per_split)
    if splits > 1:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (-(-M // cfg.BM) * -(-N // cfg.BN), splits)
    gemm_kernel[grid](
        x2, codes, scales, tensor_scale, _codebook_table(codebook, x.dtype), e_table(x.device),
        bias if bias is not None else y, y,
        M, N, K, kp, codes.shape[-1], scales.shape[-1], per_split, x2.stride(0), y.stride(0),
        K_BITS=k, BLOCKSIZE=blocksize, LOG8=scale_format == "log8", BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
        GROUP_M=cfg.GROUP_M, SWAP=cfg.SWAP, SPLIT=splits > 1, HAS_BIAS=bias is not None,
        EVEN_K=K % cfg.BK == 0 and K == kp, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        y = y.to(x.dtype)
    return y.reshape(*lead, N)


# ------------------------------------------------------------------------------------------------ torch ops


@torch.library.custom_op("kbit::gemm", mutates_args=())
def _gemm_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
             codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, N: int, K: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemm_fused(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                      scale_format=scale_format, N=N, K=K, bias=bias)


@_gemm_op.register_fake
def _(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    return x.new_empty(*x.shape[:-1], N)


def _wargs(weight):
    return weight.k, weight.blocksize, weight.scale_format, weight.shape[-2], weight.shape[-1]


def kbit_gemm(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused GEMM on a 2-D :class:`~kbit.format.KbitWeight` (``torch.ops.kbit.gemm``)."""
    return torch.ops.kbit.gemm(x, weight.codes, weight.scales, weight.tensor_scale, weight.codebook,
                               *_wargs(weight), bias)



def grouped_gemm_reference(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, weight) -> torch.Tensor:
    """float64 oracle of ``kbit.dispatch.moe.grouped_gemm`` (``kbit.ops.reference.grouped_gemv_reference``)."""
    k, blocksize, scale_format, N, K = _wargs(weight)
    return grouped_gemv_reference(x, rows, expert_ids, weight.codes, weight.scales, weight.tensor_scale,
                                  weight.codebook, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)

