"""Decoder glue folded into the k-bit GEMVs where it can be: residual add + RMSNorm before, SiLU * up after.

A one-token decode step runs a small kernel around most of its projections (the residual add + RMSNorm before q/k/v
and gate/up, SiLU * up between gate/up and down). Each costs a launch and a dependency hop on the critical path
(on an H100 the norms took ~4% and SiLU * up ~1% of a Llama-3-8B step). The small-M kernel 3 of
:mod:`kbit.ops.gemv_mma` can do that glue itself (transformers' rounding throughout):

- ``PRO`` (x prologue): while it stages x in shared memory, ``r = x + residual`` (the first CTA writes ``r``) and
  ``RMSNorm(r) * weight``; the norm weight is staged before the PDL wait;
- ``EPI`` (SiLU * up epilogue) on a fused gate/up weight (gate rows first): the warp that completes a gate tile and
  its up tile (workspace counter) writes ``silu(gate) * up``, so the GEMV returns ``[M, N / 2]``.

:func:`add_rms_norm_linear` chooses: the fused launch (``kbit.ops.gemv_mma.launch`` with a prologue) for a
:class:`~kbit.nn.KbitLinear` held in layout "mma-v1" on CUDA, M <= 8 rows, 16-bit activations with 16-byte aligned
rows, the plain launch of the weight being kernel 3 and x staged in shared memory fitting
(``kbit.tuning.mma_plan.prologue_config`` says why kernel 3 only).
Anything else runs the same computation as separate steps (the torch ops of :mod:`kbit.ops.glue` and the module),
so it works for any module and device, and under ``torch.compile`` (traced as those steps).

A layer quantized under a rotation (``lin.rotation``, a :class:`kbit.format.Rotation`) needs ``x R``, which kernel
3's prologue does not make: there the norm kernel of :mod:`kbit.ops.glue` rotates the row it produces and the layer
takes it as it is (``lin.forward_rotated``); unrotated layers take the path above unchanged.

Not done: SiLU * up as the down GEMV's x prologue. Every CTA would recompute the whole activation (14336 values at
Llama-3-8B shapes), which cost more than the separate kernel.
"""

from __future__ import annotations

import torch

from kbit.ops import gemv_mma
from kbit.ops._checks import check_bias
from kbit.ops.gemv_mma import EPI_SILU, PRO_ADD_NORM
from kbit.ops.glue import add_rms_norm, check_norm, silu_mul
from kbit.ops.mma.common import kernels_available, rows_aligned
from kbit.ops.mma.layout import LAYOUT
from kbit.tuning.mma_plan import prologue_config

__all__ = ["add_rms_norm_linear"]


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, lin, *,
                        silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x``; ``z = lin(rms_norm(r) * weight)``; returns ``(z, r)``, or with ``silu_mul``
    ``(silu(z[:, :N/2]) * z[:, N/2:], r)`` (``lin`` a fused gate/up projection, gate rows first): the
    :func:`kbit.ops.glue.add_rms_norm`, the module and :func:`kbit.ops.glue.silu_mul` in one kernel where it can
    (see the module doc), as separate steps otherwise. ``x``, ``residual`` ``[M, K]``, ``weight [K]``.
    The fused launch needs ``lin`` to be exactly a ``kbit.nn.KbitLinear`` in layout "mma-v1" (its class says so
    with ``fuses_prologue``; a subclass may change the forward). A ``lin`` with a ``rotation`` (not None) gets
    ``rms_norm(r) R`` from the norm kernel through ``lin.forward_rotated``."""
    check_norm(x, weight, eps, residual)
    K = x.shape[1]
    N = getattr(lin, "out_features", None)
    if getattr(lin, "in_features", None) != K:
        raise ValueError(f"lin: expected in_features {K} (x's width), got {getattr(lin, 'in_features', None)}")
    if silu_mul and (N is None or N % 2):
        raise ValueError(f"lin: silu_mul needs an even out_features (gate and up halves), got {N}")
    rotation = getattr(lin, "rotation", None)
    if rotation is not None:  # x R from the norm kernel (see the module doc)
        h, r = add_rms_norm(x, residual, weight, eps, rotation=rotation)
        z = lin.forward_rotated(h)
        return (_silu_halves(z, N) if silu_mul else z), r
    M = x.shape[0]
    cfg = None
    if (type(lin).__dict__.get("fuses_prologue", False) and lin.layout == LAYOUT and x.is_cuda
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and K % 8 == 0
            and rows_aligned(x) and residual.is_contiguous() and rows_aligned(residual)
            and kernels_available(x.device) and not torch.compiler.is_compiling()):
        cfg = prologue_config(lin.k, M, N, K, gemv_mma.launch_config(lin.k, M, N, K, x.device))
    if cfg is None:
        h, r = add_rms_norm(x, residual, weight, eps)
        z = lin(h)
        return (_silu_halves(z, N) if silu_mul else z), r
    epi = EPI_SILU if silu_mul and N % 32 == 0 else 0
    y = torch.empty(M, N // 2 if epi else N, dtype=x.dtype, device=x.device)
    r = torch.empty_like(residual)
    check_bias(lin.bias, N, x.device, (torch.float16, torch.bfloat16, torch.float32))  # the kernel reads N values
    bias = lin.bias.contiguous() if lin.bias is not None else None
    gemv_mma.launch(x, lin.codes, lin.scales, lin.tensor_scale, lin.codebook, bias, y, k=lin.k,
                    scale_format=lin.scale_format, N=N, K=K, M=M, config=cfg,
                    pro=(PRO_ADD_NORM, residual, r, weight, eps), epi=epi)
    return (_silu_halves(y, N) if silu_mul and not epi else y), r


def _silu_halves(z: torch.Tensor, N: int) -> torch.Tensor:
    return silu_mul(z[:, :N // 2], z[:, N // 2:])
