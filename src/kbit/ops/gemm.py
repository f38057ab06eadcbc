"""``y = x @ W.T (+ bias)`` on a k-bit weight for any M: the fused tensor-core kernel, dequantize + cuBLAS,
and :func:`linear`, which dispatches between them and the GEMV by M (``kbit.tuning.dispatch``).

Launchers validate -> allocate -> pick config -> launch; :func:`gemm_reference` (float64) is the oracle.
Torch ops: ``torch.ops.kbit.gemm`` (the fused kernel) and ``torch.ops.kbit.linear`` (the dispatcher; CPU:
the reference in float32), both with fake implementations, so they trace under ``torch.compile`` and run
inside CUDA graphs (no host sync, no allocation that depends on data).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from kbit.ops.dequant import _e_table, dequantize_tensors
from kbit.ops.gemv import gemv_reference
from kbit.tuning.dispatch import Choice, GemmConfig, choose, split_k

__all__ = ["dequant_mm", "gemm_fused", "gemm_reference", "grouped_gemm_reference", "kbit_grouped_gemm",
           "linear", "linear_reference", "kbit_gemm",
           "kbit_linear"]

_X_DTYPES = (torch.float16, torch.bfloat16)


def _fail(cls, name, expected, got):
    raise cls(f"{name}: expected {expected}, got {got}")


def _check(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias):
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
    if x.dim() < 1 or x.shape[-1] != K:
        _fail(ValueError, "x", f"last dimension K={K}", tuple(x.shape))
    if k not in (2, 3, 4, 5):
        _fail(ValueError, "k", "one of 2, 3, 4, 5", k)
    if blocksize not in (32, 64, 128):
        _fail(ValueError, "blocksize", "one of 32, 64, 128", blocksize)
    if scale_format not in ("log8", "fp16"):
        _fail(ValueError, "scale_format", "'log8' or 'fp16'", repr(scale_format))
    kp = math.ceil(K / blocksize) * blocksize
    want = {"codes": (codes, torch.int32, (N, kp * k // 32)),
            "scales": (scales, torch.uint8 if scale_format == "log8" else torch.float16, (N, kp // blocksize)),
            "tensor_scale": (tensor_scale, torch.float32, ()), "codebook": (codebook, torch.float32, (2**k,))}
    for name, (t, dt, shape) in want.items():
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dtype != dt:
            _fail(TypeError, name, f"dtype {dt}", t.dtype)
        if tuple(t.shape) != shape:
            _fail(ValueError, name, f"shape {shape}", tuple(t.shape))
        if t.device != x.device:
            _fail(ValueError, name, f"device {x.device} (that of x)", t.device)
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        _fail(ValueError, "bias", f"shape ({N},) on {x.device}", f"{tuple(bias.shape)} on {bias.device}")
    return kp


_CB_CACHE: dict = {}


def _codebook_table(codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The codebook in the activations' dtype (the fused kernel's lookup table), cached per codebook tensor
    and version (keyed by the tensor object through a weak reference, not by its address)."""
    import weakref
    key = (id(codebook), dtype)
    hit = _CB_CACHE.get(key)
    if hit is not None and hit[0]() is codebook and hit[1] == codebook._version:
        return hit[2]
    tab = codebook.to(dtype).contiguous()
    if len(_CB_CACHE) > 256:
        _CB_CACHE.clear()
    _CB_CACHE[key] = (weakref.ref(codebook), codebook._version, tab)
    return tab


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ------------------------------------------------------------------------------------------------ fused


def gemm_fused(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
               bias=None, config: GemmConfig | None = None):
    """Fused tensor-core ``x @ W.T (+ bias)``: fp16/bf16 ``x [..., K]`` -> ``[..., N]`` in x's dtype.

    Weight tensors in the canonical layout (``docs/format.md``) of a 2-D ``W[N, K]``; accumulation in fp32;
    each weight is rounded to x's dtype before the product (``codebook * block scale`` in fp32, then cast;
    the log8 tensor scale is applied to the fp32 sums). ``config``: pin a
    :class:`~kbit.tuning.dispatch.GemmConfig`; default from ``kbit.tuning.dispatch``.
    """
    kp = _check(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if x.dtype not in _X_DTYPES:
        _fail(TypeError, "x", "dtype float16 or bfloat16", x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    cfg = config or choose(M, N, K, k, x.device).config
    sms = _sms(x.device.index or 0) if x.is_cuda else 132
    splits = split_k(cfg, M, N, kp, sms)
    steps = -(-kp // cfg.BK)
    per_split = -(-steps // splits) * cfg.BK
    splits = -(-kp // per_split)
    if splits > 1:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    from kbit.kernels.gemm import gemm_kernel

    grid = (-(-M // cfg.BM) * -(-N // cfg.BN), splits)
    gemm_kernel[grid](
        x2, codes, scales, tensor_scale, _codebook_table(codebook, x.dtype), _e_table(x.device),
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


# ------------------------------------------------------------------------------------------------ unfused


def dequant_mm(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
               bias=None):
    """Dequantize W to x's dtype (``kbit.ops.dequant``, one pass), then cuBLAS ``F.linear``."""
    _check(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    w = dequantize_tensors(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                           scale_format=scale_format, shape=(N, K), dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


# ------------------------------------------------------------------------------------------------ dispatch


@functools.lru_cache(maxsize=4096)
def _choice(M, N, K, k, device) -> Choice:
    from kbit.ops import gemv_mma

    mma = gemv_mma.available(device)
    # with kernel 7 (sm_90) the entry point's range is gemv_mma.large_serves (cached: one lookup per shape)
    return choose(M, N, K, k, device, mma=mma, large=mma and gemv_mma.large_ok(device))


def linear(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
           bias=None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` through the kernel the dispatcher picks for ``M = x.numel() / K`` on x's GPU
    (the small-M kernel for M <= 32 where NVRTC works, else the GEMV for M <= 8; the fused tensor-core GEMM; or
    dequantize + cuBLAS); the float32 reference on the CPU."""
    if not x.is_cuda:
        return linear_reference(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                                scale_format=scale_format, N=N, K=K, bias=bias)
    M = x.numel() // K if K else 0
    ch = _choice(M, N, K, k, x.device)
    kw = dict(k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K, bias=bias)
    if ch.kernel == "gemv":
        from kbit.ops.gemv import gemv
        return gemv(x, codes, scales, tensor_scale, codebook, **kw)
    if ch.kernel == "dequant_mm":
        return dequant_mm(x, codes, scales, tensor_scale, codebook, **kw)
    return gemm_fused(x, codes, scales, tensor_scale, codebook, config=ch.config, **kw)


# ------------------------------------------------------------------------------------------------ references


#: float64 ``x @ W.T (+ bias)`` from the format's definition: the same oracle as the GEMV's.
gemm_reference = gemv_reference


def linear_reference(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N,
                     K, bias=None) -> torch.Tensor:
    """The CPU path of :func:`linear`: W dequantized in float32 (bit-exact reference), product in float32,
    result in x's dtype."""
    from kbit.format.reference import dequantize_reference
    from kbit.format.spec import KbitWeight
    qw = KbitWeight(codes, scales, tensor_scale, codebook, (N, K), k, blocksize, scale_format)
    w = dequantize_reference(qw, torch.float32)
    y = F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))
    return y.to(x.dtype)


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


@torch.library.custom_op("kbit::linear", mutates_args=())
def _linear_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
               codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, N: int, K: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                  scale_format=scale_format, N=N, K=K, bias=bias)


@_linear_op.register_fake
def _(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    return x.new_empty(*x.shape[:-1], N)


def _wargs(weight):
    return weight.k, weight.blocksize, weight.scale_format, weight.shape[-2], weight.shape[-1]


def kbit_gemm(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused GEMM on a 2-D :class:`~kbit.format.KbitWeight` (``torch.ops.kbit.gemm``)."""
    return torch.ops.kbit.gemm(x, weight.codes, weight.scales, weight.tensor_scale, weight.codebook,
                               *_wargs(weight), bias)


def kbit_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatched ``x @ W.T (+ bias)`` on a 2-D :class:`~kbit.format.KbitWeight` (``torch.ops.kbit.linear``)."""
    return torch.ops.kbit.linear(x, weight.codes, weight.scales, weight.tensor_scale, weight.codebook,
                                 *_wargs(weight), bias)


def kbit_grouped_gemm(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, weight,
                      blocks=None, sorted_rows: bool = False) -> torch.Tensor:
    """MoE expert matmul on a stacked :class:`~kbit.format.KbitWeight` ``[E, N, K]``: ``y[r] = x[rows[r]] @
    W[expert_ids[r]].T``, ``[P, N]`` in x's dtype (the grouped GEMV's semantics). Rows grouped by expert
    (sorted) share weight reads: the CUDA tensor-core kernel ``kbit.ops.grouped_mma.grouped_linear``; the
    Triton grouped GEMV where that is not available.
    ``blocks``: a ``grouped_mma.block_table`` to reuse; ``sorted_rows``: see ``grouped_mma.grouped_linear``."""
    from kbit.ops.grouped_mma import grouped_linear

    k, blocksize, scale_format, N, K = _wargs(weight)
    return grouped_linear(x, rows, expert_ids, weight.codes, weight.scales, weight.tensor_scale, weight.codebook,
                          k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K, blocks=blocks,
                          sorted_rows=sorted_rows)


def grouped_gemm_reference(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, weight) -> torch.Tensor:
    """float64 oracle of :func:`kbit_grouped_gemm` (``kbit.ops.gemv.grouped_gemv_reference``)."""
    from kbit.ops.gemv import grouped_gemv_reference

    k, blocksize, scale_format, N, K = _wargs(weight)
    return grouped_gemv_reference(x, rows, expert_ids, weight.codes, weight.scales, weight.tensor_scale,
                                  weight.codebook, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)
