"""Decoder glue folded into the k-bit GEMVs: residual add + RMSNorm before, SiLU * up after, in the GEMV itself.

A one-token decode step runs a small kernel around most of its projections (the residual add + RMSNorm before q/k/v
and gate/up, SiLU * up between gate/up and down). Each costs a launch and a dependency hop on the critical path
(H100, ``benchmarks/results/h100/step-timeline-s8-ablate.txt``: the norms 102 us and SiLU * up 31 us of a 2648 us
Llama-3-8B step). The small-M kernel 3 of :mod:`kbit.ops.gemv_mma` can do that glue itself
(``kbit.cuda.gemv_mma_src``, transformers' rounding throughout):

- ``PRO`` (x prologue): while it stages x in shared memory, ``r = x + residual`` (the first CTA writes ``r``) and
  ``RMSNorm(r) * weight``; the norm weight is staged before the PDL wait;
- ``EPI`` (SiLU * up epilogue) on a fused gate/up weight (gate rows first): the warp that completes a gate tile and
  its up tile (workspace counter) writes ``silu(gate) * up``, so the GEMV returns ``[M, N / 2]``.

:func:`add_rms_norm_linear` runs them for a :class:`~kbit.nn.KbitLinear` held in layout "mma-v1" on CUDA, M <= 8
rows, 16-bit activations with 16-byte aligned rows and x staged in shared memory fitting (:func:`fused_config`).
Anything else runs the same computation as separate steps (the torch ops of :mod:`kbit.ops.glue` and the module),
so it works for any module and device, and under ``torch.compile`` (traced as those steps).
``KBIT_FUSE_PROLOGUE=0`` turns the fused launches off (``norm`` / ``silu``: only that one on; lab).

Measured and dropped: SiLU * up as the down GEMV's x prologue. Every CTA recomputes the whole activation (14336
values at Llama-3-8B shapes), and that cost 150 us a step more than the separate kernel
(``benchmarks/results/h100/step-timeline-s9-prologue-a.txt``).
"""
from __future__ import annotations

import os

import torch

from kbit.ops import gemv_mma
from kbit.ops.glue import _check_norm, add_rms_norm, silu_mul

__all__ = ["EPI_SILU", "PRO_ADD_NORM", "add_rms_norm_linear", "fused_config"]

#: ``PRO`` value of kernel 3: residual add + RMSNorm x prologue (1, RMSNorm alone, is not used from Python)
PRO_ADD_NORM = 2
#: ``EPI`` value of kernel 3: SiLU * up of a fused gate/up weight
EPI_SILU = 1


def _enabled(what: str) -> bool:
    """``KBIT_FUSE_PROLOGUE`` (lab): ``1`` (default) fuses both, ``0`` neither, ``norm`` or ``silu`` only that."""
    v = os.environ.get("KBIT_FUSE_PROLOGUE", "1")
    return v == "1" or what in v.split(",")


def fused_config(k: int, M: int, N: int, K: int):
    """The kernel-3 config (x in shared memory) of a prologue launch, or None when it does not apply (M > 8, or
    x [M, K] and the norm weight do not fit in shared memory beside the lookup table)."""
    if not 1 <= M <= 8:
        return None
    S = -(-K // gemv_mma.SEG)
    if gemv_mma._table_smem(k) + (M + 1) * S * gemv_mma.SEG * 2 > gemv_mma.XS_MAX:
        return None
    cfg = gemv_mma.default_config(k, M, N, K)
    if cfg[0] == 3 and len(cfg) > 4 and cfg[4]:
        return cfg
    return (3, 8, 2, gemv_mma.PIPE[k], 1)


def _rows_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, lin, *,
                        silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x``; ``z = lin(rms_norm(r) * weight)``; returns ``(z, r)``, or with ``silu_mul``
    ``(silu(z[:, :N/2]) * z[:, N/2:], r)`` (``lin`` a fused gate/up projection, gate rows first): the
    :func:`kbit.ops.glue.add_rms_norm`, the module and :func:`kbit.ops.glue.silu_mul` in one kernel where it can
    (see the module doc), as separate steps otherwise. ``x``, ``residual`` ``[M, K]``, ``weight [K]``."""
    from kbit.nn import KbitLinear

    _check_norm(x, weight, eps, residual)
    K = x.shape[1]
    N = getattr(lin, "out_features", None)
    if getattr(lin, "in_features", None) != K:
        raise ValueError(f"lin: expected in_features {K} (x's width), got {getattr(lin, 'in_features', None)}")
    if silu_mul and (N is None or N % 2):
        raise ValueError(f"lin: silu_mul needs an even out_features (gate and up halves), got {N}")
    M = x.shape[0]
    cfg = None
    if (_enabled("norm") and type(lin) is KbitLinear and lin.layout == gemv_mma.LAYOUT and x.is_cuda
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and K % 8 == 0
            and _rows_ok(x) and residual.is_contiguous() and _rows_ok(residual)
            and gemv_mma.available(x.device) and not torch.compiler.is_compiling()):
        cfg = fused_config(lin.k, M, N, K)
    if cfg is None:
        h, r = add_rms_norm(x, residual, weight, eps)
        z = lin(h)
        return (_silu_halves(z, N) if silu_mul else z), r
    epi = EPI_SILU if silu_mul and _enabled("silu") and N % 32 == 0 else 0
    y = torch.empty(M, N // 2 if epi else N, dtype=x.dtype, device=x.device)
    r = torch.empty_like(residual)
    Kp = -(-K // lin.blocksize) * lin.blocksize
    bias = lin.bias.contiguous() if lin.bias is not None else None
    gemv_mma._launch(x, lin.codes, lin.scales, lin.tensor_scale, lin.codebook, bias, y, k=lin.k,
                     scale_format=lin.scale_format, N=N, K=K, M=M, Kp=Kp, config=cfg,
                     pro=(PRO_ADD_NORM, residual, r, weight, eps), epi=epi)
    return (_silu_halves(y, N) if silu_mul and not epi else y), r


def _silu_halves(z: torch.Tensor, N: int) -> torch.Tensor:
    return silu_mul(z[:, :N // 2], z[:, N // 2:])
