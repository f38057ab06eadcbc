"""Plain-torch reference ops: the executable spec for every linear kernel (float64 math by default).

Two kinds: on a :class:`~kbit.format.KbitWeight` (:func:`linear_reference`, :func:`grouped_linear_reference`, the
public ones), and on the weight's tensors with the format parameters as keywords, the way the kernels' launchers
take them (:func:`dequantize_tensors_reference`, :func:`gemv_reference`, :func:`grouped_gemv_reference`,
:func:`linear_tensors_reference`). Imports no op, so every op may import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kbit.format.pack import unpack
from kbit.format.reference import dequantize_reference
from kbit.format.spec import KbitWeight

__all__ = ["dequantize_tensors_reference", "gemm_reference", "gemv_reference", "grouped_gemv_reference",
           "grouped_linear_reference", "linear_reference", "linear_tensors_reference", "rms_norm_reference"]


def _check_pair(x, qw: KbitWeight, stacked: bool):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"weight: expected a KbitWeight, got {type(qw).__name__}")
    if (len(qw.shape) == 3) != stacked:
        want = "[E, N, K]" if stacked else "[N, K]"
        raise ValueError(f"weight: expected shape {want}, got {qw.shape}")
    if x.shape[-1] != qw.K:
        raise ValueError(f"x: expected last dimension K = {qw.K}, got shape {tuple(x.shape)}")
    if x.device != qw.device:
        raise ValueError(f"x: expected device {qw.device} (that of weight), got {x.device}")


def _check_bias(bias, N: int, device):
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    if bias.shape[-1:] != (N,):
        raise ValueError(f"bias: expected last dimension N = {N}, got shape {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"bias: expected device {device}, got {bias.device}")


def linear_reference(x: torch.Tensor, weight: KbitWeight, bias: torch.Tensor | None = None,
                     compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``y[..., N] = x[..., K] @ W.T + bias`` with W the dequantized ``weight [N, K]``, in ``compute_dtype``."""
    _check_pair(x, weight, stacked=False)
    _check_bias(bias, weight.N, x.device)
    W = dequantize_reference(weight, torch.float32).to(compute_dtype)
    y = x.to(compute_dtype) @ W.T
    return y if bias is None else y + bias.to(compute_dtype)


def grouped_linear_reference(x: torch.Tensor, weight: KbitWeight, token_ids: torch.Tensor,
                             expert_ids: torch.Tensor, bias: torch.Tensor | None = None,
                             compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """MoE expert linear: ``y[p] = x[token_ids[p]] @ W[expert_ids[p]].T (+ bias[expert_ids[p]])``.

    x: ``[T, K]``; weight: ``[E, N, K]``; token_ids, expert_ids: integer ``[P]`` (one row per (token, expert)
    assignment, any order); bias: ``[E, N]`` or None. Returns ``[P, N]`` in assignment order.
    """
    _check_pair(x, weight, stacked=True)
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [T, K], got {tuple(x.shape)}")
    E = weight.shape[0]
    for name, ids, hi in (("token_ids", token_ids, x.shape[0]), ("expert_ids", expert_ids, E)):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"{name}: expected an int32/int64 tensor, got {got}")
        if ids.dim() != 1:
            raise ValueError(f"{name}: expected shape [P], got {tuple(ids.shape)}")
        if ids.device != x.device:
            raise ValueError(f"{name}: expected device {x.device}, got {ids.device}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= hi):
            raise ValueError(f"{name}: expected values in [0, {hi}), got [{int(ids.min())}, {int(ids.max())}]")
    if token_ids.shape != expert_ids.shape:
        raise ValueError(f"expert_ids: expected shape {tuple(token_ids.shape)} (that of token_ids), "
                         f"got {tuple(expert_ids.shape)}")
    if bias is not None and tuple(bias.shape) != (E, weight.N):
        raise ValueError(f"bias: expected shape {(E, weight.N)}, got {tuple(bias.shape)}")
    _check_bias(bias, weight.N, x.device)
    W = dequantize_reference(weight, torch.float32).to(compute_dtype)  # [E, N, K]
    xs = x.to(compute_dtype)[token_ids.long()]  # [P, K]
    e_ids = expert_ids.long()
    y = torch.empty(xs.shape[0], weight.N, dtype=compute_dtype, device=x.device)
    for e in torch.unique(e_ids).tolist():
        rows = e_ids == e
        y[rows] = xs[rows] @ W[e].T
    return y if bias is None else y + bias.to(compute_dtype)[expert_ids.long()]


def dequantize_tensors_reference(codes, scales, tensor_scale, codebook, *, k, blocksize, scale_format, K):
    """float64 ``W [..., N, K]`` from the canonical tensors (the format's definition, nothing else)."""
    Kp = codes.shape[-1] * 32 // k
    c = unpack(codes, k, Kp).long()
    v = codebook.to(torch.float64)[c]
    if scale_format == "log8":
        q = scales.to(torch.float64)
        s = torch.where(q < 255, torch.exp2(-q / 16), torch.zeros_like(q))
        s = s * tensor_scale.to(torch.float64)[..., None, None]
    else:
        s = scales.to(torch.float64)
    w = v * s.repeat_interleave(blocksize, dim=-1)
    return w[..., :K]


def gemv_reference(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                   bias=None):
    """float64 ``x @ W.T (+ bias)``, shape ``[..., N]``: the oracle of every dense kernel."""
    w = dequantize_tensors_reference(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                                     scale_format=scale_format, K=K)
    y = x.to(torch.float64) @ w.T
    return y + bias.to(torch.float64) if bias is not None else y


#: float64 ``x @ W.T (+ bias)`` of the fused GEMM: the same oracle as the GEMV's
gemm_reference = gemv_reference


def grouped_gemv_reference(x, token_ids, expert_ids, codes, scales, tensor_scale, codebook, *, k,
                           blocksize=32, scale_format="log8", N, K, bias=None):
    """float64 ``y[p] = x[token_ids[p]] @ W[expert_ids[p]].T (+ bias[expert_ids[p]])``, ``[P, N]``."""
    w = dequantize_tensors_reference(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                                     scale_format=scale_format, K=K)  # [E, N, K]
    e = expert_ids.long()
    y = torch.einsum("pk,pnk->pn", x.to(torch.float64)[token_ids.long()], w[e])
    return y + bias.to(torch.float64)[e] if bias is not None else y


def linear_tensors_reference(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N,
                             K, bias=None) -> torch.Tensor:
    """The CPU path of ``kbit.dispatch.linear.linear``: W dequantized in float32 (bit-exact reference), product in
    float32, result in x's dtype."""
    qw = KbitWeight(codes, scales, tensor_scale, codebook, (N, K), k, blocksize, scale_format)
    w = dequantize_reference(qw, torch.float32)
    y = F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))
    return y.to(x.dtype)


def rms_norm_reference(x, weight, eps, residual=None):
    """transformers' ``residual + x`` (in the activation dtype) then RMSNorm; returns ``(y, new_residual)``."""
    r = x if residual is None else residual + x
    h = r.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(r.dtype), r
