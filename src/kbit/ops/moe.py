"""The element-wise steps of an MoE layer's experts, and the float64 oracle of the whole layer.

An MoE step over ``P = T * top_k`` (token, expert) pairs as rows (``kbit.ops.moe_align.MoeRouting``) runs
grouped gate_up, SwiGLU, grouped down and a weighted combine (composed, with the kernel choice, in
``kbit.dispatch.moe``). Here:

- :func:`silu_mul_gate_up`: ``a[P, I] = silu(gu[:, :I]) * gu[:, I:]`` of a fused gate_up product, one Triton
  kernel (float32 math, one rounding; the dense MLP's ``kbit.ops.glue.silu_mul`` takes gate and up apart and
  rounds the SiLU first, as transformers does);
- :func:`combine`: ``out[t] = sum_s w[t, s] * y[row of (t, s)]``, one Triton kernel, float32 sums in a fixed
  order;
- :func:`moe_reference`: the float64 oracle of the whole computation (any routing, float weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kbit.kernels.moe import combine_add_norm_kernel, combine_kernel, silu_mul_kernel
from kbit.ops._checks import check_norm
from kbit.ops._ids import check_ids, error_flag, host_checks
from kbit.ops.moe_align import MoeRouting
from kbit.ops.pdl import launch_kw
from kbit.ops.reference import rms_norm_reference
from kbit.utils.device import interpreting

__all__ = ["Uncombined", "combine", "combine_add_rms_norm", "combine_add_rms_norm_reference", "combine_reference",
           "moe_reference", "relative_error", "silu_mul_gate_up",
           "silu_mul_gate_up_reference"]

#: columns a program of the element-wise kernels (fewer for narrow rows)
_BLOCK = 1024


def _block(n: int) -> int:
    """Columns a program for rows of ``n`` columns: a power of two from 16 to :data:`_BLOCK`."""
    return min(_BLOCK, 1 << max(4, (n - 1).bit_length()))


def silu_mul_gate_up(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a gate_up product: ``gu[P, 2I]`` -> ``silu(gu[:, :I]) * gu[:, I:]``, ``[P, I]`` in gu's dtype
    (float32 math, one rounding)."""
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu: expected shape [P, 2I], got {tuple(gu.shape)}")
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    P, I = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(P, I, dtype=gu.dtype, device=gu.device)
    if P == 0 or I == 0:
        return out
    block = _block(I)
    silu_mul_kernel[(P, -(-I // block))](gu, out, I, gu.stride(0), out.stride(0), BLOCK=block,
                                         num_warps=4 if block >= 512 else 1, **launch_kw(gu.device))
    return out


def silu_mul_gate_up_reference(gu: torch.Tensor) -> torch.Tensor:
    """float64 ``silu(gu[..., :I]) * gu[..., I:]``."""
    I = gu.shape[-1] // 2
    g, u = gu[..., :I].double(), gu[..., I:].double()
    return g * torch.sigmoid(g) * u


def combine(y: torch.Tensor, routing: MoeRouting, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum_s topk_weights[t, s] * y[pair_rows[t * top_k + s]]``: sorted expert outputs
    ``y[P, H]`` back to token order, ``[T, H]`` in ``out_dtype`` (default y's dtype), float32 sums.
    ``pair_rows`` out of ``[0, P)``: ``ValueError`` on the CPU / in debug mode, else the token's output is NaN
    and the device's error flag is set (``kbit.ops._ids``)."""
    T, top_k = routing.T, routing.top_k
    if y.dim() != 2 or y.shape[0] != T * top_k:
        raise ValueError(f"y: expected shape [P={T * top_k}, H], got {tuple(y.shape)}")
    if y.stride(1) != 1:
        y = y.contiguous()
    H = y.shape[1]
    out = torch.empty(T, H, dtype=out_dtype or y.dtype, device=y.device)
    if T == 0 or H == 0:
        return out
    if host_checks(routing.pair_rows):
        check_ids("pair_rows", routing.pair_rows, T * top_k, "rows of y")
    block = _block(H)
    combine_kernel[(T, -(-H // block))](y, routing.pair_rows, routing.topk_weights, out, error_flag(y.device),
                                        T * top_k, H, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
                                        num_warps=4 if block >= 512 else 1, **launch_kw(y.device))
    return out


@dataclass(frozen=True)
class Uncombined:
    """An MoE layer's expert outputs before their combine: ``y [P, H]`` and the routing whose ``pair_rows`` and
    ``topk_weights`` combine them (:func:`combine`), for a caller that makes the combine part of its next launch
    (:func:`combine_add_rms_norm`). ``dtype``: the combined output's."""

    y: torch.Tensor
    routing: MoeRouting
    dtype: torch.dtype

    def combine(self) -> torch.Tensor:
        return combine(self.y, self.routing, self.dtype)


def combine_add_rms_norm(y: Uncombined, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``kbit.ops.glue.add_rms_norm(y.combine(), residual, weight, eps)`` in one launch: returns
    ``(rms_norm(r) * weight, r)``, ``r = residual + combined`` (the same numbers: the combine rounded to the
    activation dtype first). ``residual [T, H]`` in that dtype, ``weight [H]``. Off CUDA (and Triton's
    interpreter) and in float32: the combine, then the torch norm (``kbit.ops.reference.rms_norm_reference``)."""
    if not isinstance(y, Uncombined):
        raise TypeError(f"y: expected an Uncombined, got {type(y).__name__}")
    routing, T = y.routing, y.routing.T
    if y.y.dim() != 2 or y.y.shape[0] != T * routing.top_k:
        raise ValueError(f"y: expected rows [P={T * routing.top_k}, H], got {tuple(y.y.shape)}")
    H = y.y.shape[1]
    if tuple(residual.shape) != (T, H) or residual.dtype != y.dtype:
        raise ValueError(f"residual: expected shape {(T, H)} {y.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    check_norm(residual, weight, eps, None)
    if not ((y.y.is_cuda or interpreting()) and y.dtype in (torch.float16, torch.bfloat16)) or T == 0:
        return rms_norm_reference(y.combine(), weight, eps, residual)
    if host_checks(routing.pair_rows):
        check_ids("pair_rows", routing.pair_rows, T * routing.top_k, "rows of y")
    rows, res = y.y if y.y.stride(1) == 1 else y.y.contiguous(), residual.contiguous()
    out, r = torch.empty_like(res), torch.empty_like(res)
    block = max(16, 1 << (H - 1).bit_length())
    combine_add_norm_kernel[(T,)](rows, routing.pair_rows, routing.topk_weights, res, weight, out, r,
                                  error_flag(rows.device), T * routing.top_k, H, rows.stride(0), res.stride(0),
                                  out.stride(0), r.stride(0), float(eps), TOP_K=routing.top_k, BLOCK=block,
                                  num_warps=max(1, min(16, block // 256)), **launch_kw(rows.device))
    return out, r


def combine_add_rms_norm_reference(y: Uncombined, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`combine_add_rms_norm` in torch: the float64 combine rounded to the activation dtype, then
    ``kbit.ops.reference.rms_norm_reference``'s add and norm."""
    return rms_norm_reference(combine_reference(y.y, y.routing).to(y.dtype), weight, eps, residual)


def combine_reference(y: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    """float64 :func:`combine`."""
    rows = y.double()[routing.pair_rows.long()].view(routing.T, routing.top_k, y.shape[1])
    return (routing.topk_weights.double()[..., None] * rows).sum(1)


def moe_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """float64 ``out[t] = sum_s w[t, s] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = topk_ids[t, s]``.

    w_gate_up: float ``[E, 2I, H]`` (gate rows, then up rows); w_down: ``[E, H, I]``.
    """
    x = hidden.double()
    I = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64, device=x.device)
    ids = topk_ids.long()
    for e in range(w_gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ w_gate_up[e].double().T
        a = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        y = a @ w_down[e].double().T
        out.index_add_(0, tok, y * topk_weights[tok, slot].double()[:, None])
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64)."""
    d = (out.double() - ref.double()).norm()
    return float(d / ref.double().norm().clamp_min(math.ulp(0.0)))
