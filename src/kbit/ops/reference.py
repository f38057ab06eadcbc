"""Plain-torch reference ops: the executable spec for every linear kernel (float64 math by default)."""

from __future__ import annotations

import torch

from kbit.format.reference import dequantize_reference
from kbit.format.spec import KbitWeight


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
