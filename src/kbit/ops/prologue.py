"""Decoder glue folded into the next k-bit GEMV: residual add + RMSNorm, or SiLU * up, computed by the GEMV itself.

A one-token decode step runs a small kernel before most of its projections (the residual add + RMSNorm before q/k/v
and gate/up, SiLU * up before down). Each costs a launch and a dependency hop on the critical path (~1.5 us on an
H100, ``benchmarks/results/h100/step-timeline-s8-ablate.txt``: the norms 102 us and SiLU * up 31 us of a 2648 us
Llama-3-8B step). The small-M kernel 3 of :mod:`kbit.ops.gemv_mma` stages x in shared memory before its loop, so it
can compute that glue while staging (``PRO`` of ``kbit.cuda.gemv_mma_src``, transformers' rounding):

- :func:`add_rms_norm_linear`: ``r = x + residual``; ``y = lin(RMSNorm(r) * weight)``; returns ``(y, r)`` (the
  first CTA writes ``r``);
- :func:`silu_mul_linear`: ``y = lin(silu(gu[:, :K]) * gu[:, K:])`` for a fused gate/up output ``gu [M, 2K]``.

The fused launch runs for a :class:`~kbit.nn.KbitLinear` held in layout "mma-v1" on CUDA, M <= 8 rows, 16-bit
activations with 16-byte aligned rows and x staged in shared memory fitting (:func:`fused_config`). Anything else
runs the same computation as the two separate steps (the torch ops of :mod:`kbit.ops.glue`, then the module), so
the functions work for any module and device, and under ``torch.compile`` (traced as those two steps).
``KBIT_FUSE_PROLOGUE=0`` turns the fused launches off (``norm`` / ``silu``: only that one on; lab).
"""
from __future__ import annotations

import os

import torch

from kbit.ops import gemv_mma
from kbit.ops.glue import _check_norm, _check_rows, add_rms_norm, silu_mul

__all__ = ["PRO_ADD_NORM", "PRO_NORM", "PRO_SILU", "add_rms_norm_linear", "fused_config", "silu_mul_linear"]

#: ``PRO`` values of kernel 3 (x prologues)
PRO_NORM, PRO_ADD_NORM, PRO_SILU = 1, 2, 3


def _enabled(what: str) -> bool:
    """``KBIT_FUSE_PROLOGUE`` (lab): ``1`` (default) fuses both, ``0`` neither, ``norm`` or ``silu`` only that."""
    v = os.environ.get("KBIT_FUSE_PROLOGUE", "1")
    return v == "1" or what in v.split(",")


def fused_config(k: int, M: int, N: int, K: int):
    """The kernel-3 config (x in shared memory) of a prologue launch, or None when it does not apply (M > 8, or
    x [M, K] does not fit in shared memory beside the lookup table)."""
    if not 1 <= M <= 8:
        return None
    S = -(-K // gemv_mma.SEG)
    if gemv_mma._table_smem(k) + M * S * gemv_mma.SEG * 2 > gemv_mma.XS_MAX:
        return None
    cfg = gemv_mma.default_config(k, M, N, K)
    if cfg[0] == 3 and len(cfg) > 4 and cfg[4]:
        return cfg
    return (3, 8, 2, gemv_mma.PIPE[k], 1)


def _rows_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _fusable(what, lin, x: torch.Tensor, K: int) -> bool:
    from kbit.nn import KbitLinear

    return (_enabled(what) and type(lin) is KbitLinear and lin.layout == gemv_mma.LAYOUT and x.is_cuda
            and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2 and K % 8 == 0
            and gemv_mma.available(x.device) and not torch.compiler.is_compiling()
            and fused_config(lin.k, x.shape[0], lin.out_features, K) is not None)


def _launch(kind, x, lin, res, res_out, nw, eps, x_off):
    M = x.shape[0]
    N, K = lin.out_features, lin.in_features
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    Kp = -(-K // lin.blocksize) * lin.blocksize
    bias = lin.bias.contiguous() if lin.bias is not None else None
    gemv_mma._launch(x, lin.codes, lin.scales, lin.tensor_scale, lin.codebook, bias, y, k=lin.k,
                     scale_format=lin.scale_format, N=N, K=K, M=M, Kp=Kp,
                     config=fused_config(lin.k, M, N, K), pro=(kind, res, res_out, nw, eps, x_off))
    return y


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        lin) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x``; ``(lin(rms_norm(r) * weight), r)``: :func:`kbit.ops.glue.add_rms_norm` and the
    module ``lin`` in one kernel where it can (see the module doc), in two steps otherwise."""
    _check_norm(x, weight, eps, residual)
    if lin.in_features != x.shape[1]:
        raise ValueError(f"lin: expected in_features {x.shape[1]} (x's width), got {lin.in_features}")
    if _fusable("norm", lin, x, x.shape[1]) and weight.dtype == x.dtype and _rows_ok(x) and residual.is_contiguous() \
            and _rows_ok(residual):
        r = torch.empty_like(residual, memory_format=torch.contiguous_format)
        y = _launch(PRO_ADD_NORM, x, lin, residual, r, weight, eps, 0)
        return y, r
    h, r = add_rms_norm(x, residual, weight, eps)
    return lin(h), r


def silu_mul_linear(gate_up: torch.Tensor, lin) -> torch.Tensor:
    """``lin(silu(gate_up[:, :K]) * gate_up[:, K:])`` with ``K = lin.in_features``: :func:`kbit.ops.glue.silu_mul`
    and the module in one kernel where it can (see the module doc), in two steps otherwise."""
    _check_rows("gate_up", gate_up)
    K = lin.in_features
    if gate_up.shape[1] != 2 * K:
        raise ValueError(f"gate_up: expected {2 * K} columns (2 x lin.in_features), got {gate_up.shape[1]}")
    if _fusable("silu", lin, gate_up, K) and _rows_ok(gate_up):
        return _launch(PRO_SILU, gate_up, lin, None, None, None, 0.0, K)
    return lin(silu_mul(gate_up[:, :K], gate_up[:, K:]))
