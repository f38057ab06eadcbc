"""The rotary + KV-append step of a decoder layer's one-token step: its plain-torch reference and argument checks.

Shared by two ops that must agree on them: :func:`kbit.ops.glue.rope_append` (the step alone) and
:func:`kbit.ops.attention.rope_decode_attention` (the step fused into the decode attention). ``rms_norm_reference``
lives here because Qwen3's per-head q/k norms are that RMSNorm. Imports no op, so every op may import it.
"""
from __future__ import annotations

import torch

from kbit.utils.checks import check_tensor, fail

__all__ = ["check_rope_append", "rms_norm_reference", "rope_append_reference"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rms_norm_reference(x, weight, eps, residual=None):
    """transformers' ``residual + x`` (in the activation dtype) then RMSNorm; returns ``(y, new_residual)``."""
    r = x if residual is None else residual + x
    h = r.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(r.dtype), r


def rope_append_reference(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm=None, k_norm=None, eps=1e-6):
    """transformers' order: per-head RMSNorm of q and k (Qwen3; when the weights are given), rotate-half rotary
    with ``cos[pos]``, ``sin[pos]`` (``[L, D]`` tables), k and v written into ``k_cache``/``v_cache``
    ``[B, Hkv, L, D]`` at ``pos``. ``q [B, Hq * D]``, ``k``/``v [B, Hkv * D]``. Returns the rotated q
    ``[B, Hq, D]``; the caches are written in place."""
    B, Hkv, _, D = k_cache.shape
    qh = q.reshape(B, -1, D)
    kh = k.reshape(B, Hkv, D)
    if q_norm is not None:
        qh = rms_norm_reference(qh.reshape(-1, D), q_norm, eps)[0].reshape(qh.shape)
        kh = rms_norm_reference(kh.reshape(-1, D), k_norm, eps)[0].reshape(kh.shape)
    p = pos.reshape(-1)[:1]
    c = cos.index_select(0, p).to(q.dtype)  # [1, D]
    s = sin.index_select(0, p).to(q.dtype)

    def rot(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((-x2, x1), dim=-1)

    q_out = qh * c + rot(qh) * s
    k_out = kh * c + rot(kh) * s
    k_cache.index_copy_(2, p, k_out.unsqueeze(2).to(k_cache.dtype))
    v_cache.index_copy_(2, p, v.reshape(B, Hkv, 1, D).to(v_cache.dtype))
    return q_out


def check_rows(name, t, dtype=None, device=None, width=None):
    """``t`` is a [rows, features] float16/bfloat16/float32 tensor with a contiguous last dim, of ``dtype``,
    on ``device`` and ``width`` features where given."""
    check_tensor(name, t, dtype if dtype is not None else _DTYPES, device=device)
    if t.dim() != 2:
        fail(ValueError, name, "2 dims [rows, features]", f"shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(ValueError, name, "a contiguous last dim (stride 1)", f"strides {t.stride()}")
    if width is not None and t.shape[-1] != width:
        fail(ValueError, name, f"{width} features", f"shape {tuple(t.shape)}")


def check_rope_append(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, dtypes=_DTYPES):
    """The arguments of :func:`kbit.ops.glue.rope_append` (q of one of ``dtypes``; see its docstring)."""
    check_rows("q", q, dtypes)
    dt, dev = q.dtype, q.device
    check_rows("k", k, dt, dev)
    check_rows("v", v, dt, dev, k.shape[1])
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.device != dev or c.stride(-1) != 1:
            raise ValueError(f"{name}: expected a [B, Hkv, L, D] tensor on {dev} with a contiguous last dim, got "
                             f"{tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__}")
    B, Hkv, L, D = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if D < 2 or D & (D - 1):
        raise ValueError(f"k_cache: head dim must be a power of two >= 2, got {D}")
    if q.shape[0] != B or k.shape != (B, Hkv * D) or q.shape[1] % D:
        raise ValueError(f"q, k: expected [B = {B}, Hq * {D}] and [{B}, {Hkv * D}], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2 or t.shape[1] != D \
                or t.device != dev or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a float [positions, {D}] table on {dev}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if sin.shape != cos.shape or sin.stride(0) != cos.stride(0):  # the kernels index both with cos's row stride
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)} and row stride {cos.stride(0)}, got "
                         f"{tuple(sin.shape)} and {sin.stride(0)}")
    if not (isinstance(pos, torch.Tensor) and pos.numel() == 1 and pos.dtype in (torch.int32, torch.int64)
            and pos.device == dev):
        raise ValueError(f"pos: expected a one-element int32/int64 tensor on {dev}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: give both or neither")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (not isinstance(w, torch.Tensor) or w.shape != (D,) or w.device != dev
                              or w.stride(0) != 1):
            raise ValueError(f"{name}: expected a contiguous ({D},) tensor on {dev}, got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
