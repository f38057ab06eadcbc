"""The online randomized Hadamard transform of a layer's input: ``rotate(x, rotation) = x R`` along the last dim.

A weight quantized under a :class:`kbit.format.Rotation` holds ``W R`` (``R = diag(signs) @ blockdiag(H_b, ...)``,
orthogonal), so the layer computes ``y = (x R) (W R)^T = x W^T``. This module is the standalone op: the torch op
``kbit::hadamard_rotate`` (with a fake implementation, no host sync: CUDA-graph safe once the signs are made),
its Triton kernel (:mod:`kbit.kernels.hadamard`) and the plain-torch reference :func:`rotate_reference`.

CUDA tensors run the kernel; CPU tensors run it under ``TRITON_INTERPRET=1`` and the reference otherwise. The
signs of a (seed, K, device) are made once on the host and cached (:func:`rotation_signs`): call :func:`rotate`
once before capturing a CUDA graph or compiling with ``torch.compile`` (which then traces a dict look-up), or
pass ``signs=`` (e.g. a layer's buffer).

Where the transform belongs in a fast layer (a fused prologue or the producing kernel's epilogue, not a launch of
its own) is in docs/notes/hadamard.md; ``lab/hadamard_speed.py`` measures what this op costs on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kbit.format.spec import Rotation
from kbit.kernels import hadamard as _k
from kbit.ops._rotation import check_rotation, hadamard_reference, rotation_signs
from kbit.ops.pdl import launch_kw
from kbit.utils.checks import check_int, check_tensor, fail
from kbit.utils.device import interpreting

__all__ = ["HadamardConfig", "hadamard_config", "rotate", "rotate_reference", "rotation_signs"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: elements of x one program holds (BM * C): 4096 fp32 keep 8 warps at 16 values a thread
TILE_ELEMENTS = 4096
#: columns a program covers when the rotation block is smaller (whole blocks, so loads stay long and coalesced)
MIN_COLS = 1024


@dataclass(frozen=True)
class HadamardConfig:
    """The launch of :func:`kbit.kernels.hadamard.hadamard_rotate_kernel`."""

    block_m: int  # rows of x per program (a power of two)
    cols: int  # columns per program: a power of two, a multiple of the rotation block
    num_warps: int


def hadamard_config(M: int, K: int, block: int) -> HadamardConfig:
    """A tile of about TILE_ELEMENTS elements: at least one rotation block wide, more rows where M allows."""
    cols = max(block, min(triton.next_power_of_2(K), MIN_COLS))
    block_m = max(1, min(triton.next_power_of_2(max(M, 1)), TILE_ELEMENTS // cols))
    return HadamardConfig(block_m, cols, max(1, min(16, block_m * cols // 512)))


# ------------------------------------------------------------------------------------------ reference
def rotate_reference(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """``x @ R`` along the last dim in float64, by butterflies (no dense ``R``), returned in x's dtype.

    ``x [..., K]`` with K a multiple of ``rotation.block``."""
    K = x.shape[-1]
    rotation.check_width(K, "x.shape[-1] (K)")
    return hadamard_reference(x, rotation.signs(K, torch.float64, x.device), rotation.block)


# ------------------------------------------------------------------------------------------ the op
def _launch(x2: torch.Tensor, signs: torch.Tensor, block: int, config: HadamardConfig | None) -> torch.Tensor:
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    # the interpreter's bfloat16 arithmetic is wrong: compute in float32 there
    xd = x2.float() if interpreting() and x2.dtype == torch.bfloat16 else x2
    y = torch.empty_like(xd)
    if M == 0:
        return y.to(x2.dtype)
    cfg = config or hadamard_config(M, K, block)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(K, cfg.cols))
    _k.hadamard_rotate_kernel[grid](
        xd, signs, y, M, K, xd.stride(0), y.stride(0), 1.0 / math.sqrt(block),
        BM=cfg.block_m, C=cfg.cols, LOG_B=block.bit_length() - 1, num_warps=cfg.num_warps, **launch_kw(x2.device))
    return y.to(x2.dtype)


@torch.library.custom_op("kbit::hadamard_rotate", mutates_args=())
def _hadamard_rotate_op(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    if not (x.is_cuda or interpreting()):
        return hadamard_reference(x, signs, block)
    return _launch(x.reshape(-1, x.shape[-1]), signs, block, None).reshape(x.shape)


@_hadamard_rotate_op.register_fake
def _(x, signs, block):
    return torch.empty_like(x)


def _check(x, rotation, signs):
    check_tensor("x", x, _DTYPES)
    if x.dim() < 1:
        fail(ValueError, "x", "a tensor [..., K] with at least one dim", "a 0-dim tensor")
    K = x.shape[-1]
    check_int("x.shape[-1] (K)", K, minimum=1)
    return check_rotation(rotation, signs, K, x.device)


def rotate(x: torch.Tensor, rotation: Rotation, signs: torch.Tensor | None = None,
           config: HadamardConfig | None = None) -> torch.Tensor:
    """``x @ R`` along the last dim: the input of a layer whose weight was quantized under ``rotation``.

    Parameters
    ----------
    x : float16, bfloat16 or float32 ``[..., K]``, K a multiple of ``rotation.block``.
    rotation : the weight's :class:`kbit.format.Rotation`.
    signs : int8 ``[K]`` on x's device, ``rotation_signs(rotation, K, x.device)`` (made and cached when None).
    config : a pinned launch (tests, lab); None takes :func:`hadamard_config`. Not used by the torch op path.

    Returns
    -------
    ``x R`` in x's dtype and shape, computed in float32 (the kernel) or float64 (the CPU reference).

    Example
    -------
    >>> rot = Rotation.for_width(5120, seed=7)          # block 1024
    >>> y = rotate(torch.randn(3, 5120), rot)           # (x R)(W R)^T == x W^T
    """
    signs = _check(x, rotation, signs)
    if config is not None and (x.is_cuda or interpreting()):
        if config.cols % rotation.block:
            fail(ValueError, "config.cols", f"a multiple of the rotation block {rotation.block}", config.cols)
        return _launch(x.reshape(-1, x.shape[-1]), signs, rotation.block, config).reshape(x.shape)
    return torch.ops.kbit.hadamard_rotate(x, signs, rotation.block)
