"""Plain-torch quantize/dequantize of the format (docs/format.md; the same tensors in versions 1 and 2): the
executable spec that kernels are tested against.

Works on any device; bit-exact with the Triton quantizer (the same float32 operations in the same order).
"""

from __future__ import annotations

import torch

from kbit.format.codebooks import midpoints
from kbit.format.pack import pack, unpack
from kbit.format.spec import ZERO_BLOCK, KbitWeight, log8_thresholds, log8_values, padded_k

FP16_MAX = 65504.0


def blocks(W: torch.Tensor, blocksize: int) -> torch.Tensor:
    """float32 ``[..., N, nb, blocksize]`` view of ``W[..., N, K]``, zero-padded along K."""
    K = W.shape[-1]
    kp = padded_k(K, blocksize)
    Wf = W.to(torch.float32)
    if kp != K:
        Wf = torch.nn.functional.pad(Wf, (0, kp - K))
    return Wf.reshape(*W.shape[:-1], kp // blocksize, blocksize)


def block_scales(absmax: torch.Tensor, matrix_max: torch.Tensor, scale_format: str):
    """Per-block scales from block absmax ``[..., N, nb]`` and the per-matrix max ``[...]``.

    Returns (stored scales, float32 scales, tensor_scale).
    """
    if scale_format == "fp16":
        stored = absmax.to(torch.float16)
        return stored, stored.to(torch.float32), torch.ones_like(matrix_max)
    ts = matrix_max[..., None, None]
    r = absmax / torch.where(ts > 0, ts, torch.ones_like(ts))
    thresholds_ascending = log8_thresholds(absmax.device).flip(0)
    q = (ZERO_BLOCK - 1) - torch.bucketize(r, thresholds_ascending, right=True)
    q = torch.where(absmax > 0, q, torch.full_like(q, ZERO_BLOCK))
    scale = ts * log8_values(absmax.device)[q]
    return q.to(torch.uint8), scale, matrix_max


def normalise(b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``b / scale`` per block (float32, IEEE division), 0 where the scale is 0."""
    s = scale[..., None]
    return torch.where(s > 0, b / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(b))


def nearest_codes(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook entry; a value on a midpoint takes the lower entry."""
    return torch.bucketize(x, midpoints(codebook).to(x.device), right=False)


def quantize_reference(W: torch.Tensor, k: int, blocksize: int, codebook: torch.Tensor, scale_format: str):
    """(codes, scales, tensor_scale) of ``W[..., N, K]`` for a resolved float32 codebook (no validation)."""
    b = blocks(W, blocksize)
    absmax = b.abs().amax(-1)
    matrix_max = absmax.amax(dim=(-2, -1))
    scales, scale, ts = block_scales(absmax, matrix_max, scale_format)
    codes = nearest_codes(normalise(b, scale), codebook.to(b.device))
    return pack(codes.reshape(*W.shape[:-1], -1), k), scales, ts.to(torch.float32)


def dequantize_reference(qw: KbitWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[..., N, K]`` that ``qw`` stands for, computed in float32, returned as ``dtype``."""
    kp = qw.padded_k
    codes = unpack(qw.codes, qw.k, kp).to(torch.int64)
    values = qw.codebook.to(codes.device)[codes].reshape(*qw.shape[:-1], kp // qw.blocksize, qw.blocksize)
    if qw.scale_format == "log8":
        scale = qw.tensor_scale[..., None, None] * log8_values(codes.device)[qw.scales.to(torch.int64)]
    else:
        scale = qw.scales.to(torch.float32)
    W = (values * scale[..., None]).reshape(*qw.shape[:-1], kp)[..., : qw.K]
    return W.to(dtype)
