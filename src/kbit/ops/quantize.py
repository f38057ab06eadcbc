"""``kbit.quantize`` / ``kbit.dequantize``: validate, resolve the codebook, run the Triton quantizer or the torch
reference, wrap the result in a :class:`~kbit.format.KbitWeight`."""

from __future__ import annotations

import torch
import triton

from kbit.format import codebooks as cbs
from kbit.format.pack import PLANES, words_per_row
from kbit.format.reference import (
    FP16_MAX,
    block_scales,
    blocks,
    normalise,
    quantize_reference,
)
from kbit.format.spec import (
    DEFAULT_BLOCKSIZE,
    DEFAULT_K,
    DEFAULT_SCALE_FORMAT,
    KbitWeight,
    check_blocksize,
    check_k,
    check_scale_format,
    log8_thresholds,
    log8_values,
    padded_k,
)
from kbit.kernels.quantize import quantize_kernel
from kbit.utils.checks import check_choice, fail

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "triton", "torch")
FIT_SAMPLE = 1 << 22  # values used to fit a codebook to a tensor
FIT_ITERS = 40


def check_weight(W, name: str = "W") -> torch.Tensor:
    """``W`` is a non-empty floating-point tensor ``[..., N, K]``; returns it."""
    if not isinstance(W, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor", type(W).__name__)
    if W.dtype not in FLOAT_DTYPES:
        fail(TypeError, name, f"a floating-point tensor {FLOAT_DTYPES}", W.dtype)
    if W.dim() < 2:
        fail(ValueError, name, "at least 2 dimensions [..., N, K]", f"shape {tuple(W.shape)}")
    if W.numel() == 0:
        fail(ValueError, name, "a non-empty tensor", f"shape {tuple(W.shape)}")
    return W


def fit_codebook(W: torch.Tensor, matrix_max: torch.Tensor, blocksize: int, scale_format: str,
                  init: torch.Tensor) -> torch.Tensor:
    """Lloyd-Max on the tensor's own block-normalised values (evenly spaced rows, deterministic)."""
    N, K = W.shape[-2:]
    rows = W.reshape(-1, K)
    take = max(1, min(rows.shape[0], FIT_SAMPLE // K))
    idx = torch.linspace(0, rows.shape[0] - 1, take, device=W.device).round().long()
    b = blocks(rows[idx], blocksize)[:, None]  # [take, 1, nb, B]: each sampled row as a 1-row matrix
    absmax = b.abs().amax(-1)
    _, scale, _ = block_scales(absmax, matrix_max.reshape(-1)[idx // N], scale_format)
    x = normalise(b, scale)[absmax > 0]
    if x.numel() == 0:
        return init
    cb = cbs.lloyd_max(x.clamp(-1, 1), init, iters=FIT_ITERS).cpu()
    if (cb[1:] <= cb[:-1]).any():  # two levels met (degenerate data): keep a valid codebook
        return init
    return cb


def quantize(
    W: torch.Tensor,
    k: int = DEFAULT_K,
    blocksize: int = DEFAULT_BLOCKSIZE,
    codebook=None,
    scale_format: str = DEFAULT_SCALE_FORMAT,
    backend: str = "auto",
) -> KbitWeight:
    """Quantize ``W[..., N, K]`` (an ``nn.Linear`` weight or a stack of them) to k bits.

    Parameters
    ----------
    W : float16/bfloat16/float32/float64 tensor ``[..., N, K]``, finite. Leading dims are separate matrices
        (e.g. experts ``[E, N, K]``), each with its own tensor scale.
    k : bits per weight, 2..5.
    blocksize : 32, 64 or 128 weights along K share one scale.
    codebook : ``None`` (the default for k, :data:`kbit.format.codebooks.DEFAULT_CODEBOOK`), a name
        (``"nf"``, ``"nf0"``, ``"uniform"``, ``"lloyd"``, ``"lloyd0"``, ``"fit"``) or ``2**k`` values.
    scale_format : ``"log8"`` (8-bit log scales + one float32 per matrix) or ``"fp16"``.
    backend : ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.

    Returns
    -------
    KbitWeight on W's device.

    Example
    -------
    >>> qw = kbit.quantize(torch.randn(256, 512), k=4)
    >>> qw.bits_per_weight  # doctest: +SKIP
    4.25...
    """
    check_weight(W)
    k = check_k(k)
    blocksize = check_blocksize(blocksize)
    scale_format = check_scale_format(scale_format)
    check_choice("backend", backend, BACKENDS)
    cb, name = cbs.resolve(codebook, k, blocksize)

    W = W.detach()
    lead = W.shape[:-2]
    matrix_max = torch.linalg.vector_norm(W.reshape(*lead, -1), ord=float("inf"), dim=-1).to(torch.float32)
    if not bool(torch.isfinite(matrix_max).all()):
        bad = int((~torch.isfinite(W)).sum())
        fail(ValueError, "W", "finite values", f"{bad} NaN/Inf entries")
    if scale_format == "fp16" and float(matrix_max.max()) > FP16_MAX:
        raise ValueError(f"W: |w| up to {float(matrix_max.max()):g} overflows fp16 scales (max {FP16_MAX:g}); "
                         "use scale_format='log8'")
    if name == "fit":
        cb = fit_codebook(W, matrix_max, blocksize, scale_format, cb)

    use_triton = backend == "triton" or (backend == "auto" and W.is_cuda)
    if use_triton:
        codes, scales, ts = _quantize_triton(W, k, blocksize, cb, scale_format, matrix_max)
    else:
        codes, scales, ts = quantize_reference(W, k, blocksize, cb, scale_format)
    return KbitWeight(codes, scales, ts.to(torch.float32), cb.to(W.device), W.shape, k, blocksize,
                      scale_format, name)


def _quantize_triton(W, k, blocksize, codebook, scale_format, matrix_max):
    *lead, N, K = W.shape
    kp = padded_k(K, blocksize)
    rows = W.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    dev = W.device
    codes = torch.empty(*lead, N, words_per_row(k, kp), dtype=torch.int32, device=dev)
    sdtype = torch.uint8 if scale_format == "log8" else torch.float16
    scales = torch.empty(*lead, N, kp // blocksize, dtype=sdtype, device=dev)
    ts = matrix_max if scale_format == "log8" else torch.ones_like(matrix_max)
    ts = ts.reshape(-1).contiguous()
    mid = cbs.midpoints(codebook).to(dev)
    planes = PLANES[k]
    w0, w1 = planes[0][0], (planes[1][0] if len(planes) > 1 else 0)
    block_k = blocksize
    while block_k < 128 and kp % (2 * block_k) == 0:
        block_k *= 2
    block_r = 32
    grid = (triton.cdiv(R, block_r), kp // block_k)
    quantize_kernel[grid](
        rows, codes, scales, ts, log8_thresholds(dev), log8_values(dev), mid,
        R, N, K, kp, rows.stride(0),
        K_BITS=k, BLOCKSIZE=blocksize, LOG8=scale_format == "log8", W0=w0, W1=w1,
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )
    return codes, scales, ts.reshape(lead)


