"""Decoder-layer glue for one-token steps: residual add + RMSNorm, rotary embedding + KV-cache append, SiLU * up.

Torch ops ``kbit::rms_norm``, ``kbit::add_rms_norm``, ``kbit::rope_append`` (writes the caches) and
``kbit::silu_mul``, each with a plain-torch reference beside it that follows transformers' eager code (Llama,
Qwen2/3, Mistral). CUDA tensors run the Triton kernels of :mod:`kbit.kernels.glue`, launched with programmatic
dependent launch on sm_90 (:mod:`kbit.ops.pdl`) so that the next k-bit GEMV starts streaming its
weights while they run; CPU tensors run the Triton kernels under ``TRITON_INTERPRET=1`` and the references
otherwise.

``rms_norm``, ``add_rms_norm`` and ``silu_mul`` take an optional ``rotation`` (a :class:`kbit.format.Rotation`):
the row they produce is then multiplied by ``R`` before the store (``kbit::rms_norm_rotated``,
``kbit::add_rms_norm_rotated``, ``kbit::silu_mul_rotated``; the unrotated ops keep their schemas and kernels),
so a layer quantized under ``R`` gets ``x R`` without a launch of :func:`kbit.ops.hadamard.rotate` of its own
(docs/notes/hadamard.md). Reference: the unrotated reference, rounded to the dtype, then the float64 transform.
"""
from __future__ import annotations

import torch
import triton

from kbit.format.spec import Rotation
from kbit.kernels import glue as _k
from kbit.ops._checks import check_norm
from kbit.ops._checks import check_rows as _check_rows
from kbit.ops._rotation import check_rotation, hadamard_reference
from kbit.ops.pdl import launch_kw
from kbit.ops.reference import rms_norm_reference
from kbit.utils.checks import fail
from kbit.utils.device import interpreting

__all__ = ["add_rms_norm", "argmax", "check_norm", "rms_norm", "rms_norm_reference", "rope_append",
           "rope_append_reference", "silu_mul", "silu_mul_reference"]


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


def _up(t):
    """The interpreter's bfloat16 arithmetic is wrong: compute in float32 there."""
    return t.float() if interpreting() and t is not None and t.dtype == torch.bfloat16 else t


# ------------------------------------------------------------------------------------------ RMSNorm
def _rotation_signs(rotation, signs, width, device, name):
    """The signs of the optional ``rotation`` (None when there is none; ``signs`` must then be None too)."""
    if rotation is None:
        if signs is not None:
            fail(ValueError, "signs", "None when rotation is None", "a tensor")
        return None
    return check_rotation(rotation, signs, width, device, name)


def _norm_launch(x, residual, weight, eps, signs=None, block=0):
    """The (residual add +) RMSNorm kernel; with ``signs``, the one storing the row times the rotation of blocks of
    ``block`` (``add_rms_norm_rot_kernel``)."""
    R, H = x.shape
    xd, rd = _up(x), _up(residual)
    rs = rd if rd is not None else xd
    y = torch.empty_like(xd)
    r_out = torch.empty_like(xd) if residual is not None else y
    width = triton.next_power_of_2(H)
    rows = (xd.stride(0), rs.stride(0), y.stride(0), r_out.stride(0), H, float(eps))
    kw = dict(HAS_RES=residual is not None, BLOCK=width, num_warps=max(1, min(16, width // 256)),
              **launch_kw(x.device))
    if signs is None:
        _k.add_rms_norm_kernel[(R,)](xd, rs, _up(weight), y, r_out, *rows, **kw)
    else:
        _k.add_rms_norm_rot_kernel[(R,)](xd, rs, _up(weight), signs, y, r_out, *rows, block ** -0.5,
                                         LOG_B=block.bit_length() - 1, **kw)
    return y.to(x.dtype), r_out.to(x.dtype)


@torch.library.custom_op("kbit::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _use_triton(x):
        return rms_norm_reference(x, weight, eps)[0]
    return _norm_launch(x, None, weight, eps)[0]


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("kbit::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(x):
        return rms_norm_reference(x, weight, eps, residual)
    return _norm_launch(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("kbit::rms_norm_rotated", mutates_args=())
def _rms_norm_rot_op(x: torch.Tensor, weight: torch.Tensor, eps: float, signs: torch.Tensor,
                     block: int) -> torch.Tensor:
    if not _use_triton(x):
        return hadamard_reference(rms_norm_reference(x, weight, eps)[0], signs, block)
    return _norm_launch(x, None, weight, eps, signs, block)[0]


@_rms_norm_rot_op.register_fake
def _(x, weight, eps, signs, block):
    return torch.empty_like(x)


@torch.library.custom_op("kbit::add_rms_norm_rotated", mutates_args=())
def _add_rms_norm_rot_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         signs: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(x):
        y, r = rms_norm_reference(x, weight, eps, residual)
        return hadamard_reference(y, signs, block), r
    return _norm_launch(x, residual, weight, eps, signs, block)


@_add_rms_norm_rot_op.register_fake
def _(x, residual, weight, eps, signs, block):
    return torch.empty_like(x), torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rotation: Rotation | None = None,
             signs: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x [R, H]`` (transformers' rounding); see :func:`rms_norm_reference`.

    With ``rotation`` (its block dividing H) the result is ``rms_norm(x) R``, one kernel; ``signs`` int8 ``[H]``
    on x's device (``kbit.ops.hadamard.rotation_signs``; made and cached when None)."""
    check_norm(x, weight, eps, None)
    signs = _rotation_signs(rotation, signs, x.shape[1], x.device, "x.shape[1] (H)")
    if signs is None:
        return torch.ops.kbit.rms_norm(x, weight, float(eps))
    return torch.ops.kbit.rms_norm_rotated(x, weight, float(eps), signs, rotation.block)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 rotation: Rotation | None = None, signs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x`` then RMSNorm of ``r``, in one kernel: returns ``(rms_norm(r), r)``.

    With ``rotation`` the first result is ``rms_norm(r) R`` (``r`` is not rotated); ``signs`` as in
    :func:`rms_norm`.

    Example
    -------
    >>> rot = Rotation.for_width(4096, seed=0)   # the rotation q/k/v were quantized under
    >>> y, res = add_rms_norm(x, res, norm.weight, 1e-5, rotation=rot)   # doctest: +SKIP
    >>> q = q_proj.forward_rotated(y)   # doctest: +SKIP
    """
    check_norm(x, weight, eps, residual)
    signs = _rotation_signs(rotation, signs, x.shape[1], x.device, "x.shape[1] (H)")
    if signs is None:
        return torch.ops.kbit.add_rms_norm(x, residual, weight, float(eps))
    return torch.ops.kbit.add_rms_norm_rotated(x, residual, weight, float(eps), signs, rotation.block)


# ------------------------------------------------------------------------------------------ rotary + cache
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


@torch.library.custom_op("kbit::rope_append", mutates_args=("k_cache", "v_cache"))
def _rope_append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float, pos_settled: bool = False) -> torch.Tensor:
    if not _use_triton(q):
        return rope_append_reference(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, eps)
    B, Hkv, _, D = k_cache.shape
    Hq = q.shape[1] // D
    qd, kd, vd, cd, sd = _up(q), _up(k), _up(v), _up(cos), _up(sin)
    interp_cache = interpreting() and k_cache.dtype == torch.bfloat16
    kc, vc = (k_cache.float(), v_cache.float()) if interp_cache else (k_cache, v_cache)
    q_out = torch.empty(B, Hq, D, dtype=qd.dtype, device=q.device)
    qn = _up(q_norm) if q_norm is not None else cd
    kn = _up(k_norm) if k_norm is not None else cd
    _k.rope_append_kernel[(B, Hq + Hkv)](
        qd, kd, vd, cd, sd, pos, qn, kn, q_out, kc, vc,
        qd.stride(0), kd.stride(0), vd.stride(0), cd.stride(0), q_out.stride(0), q_out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        Hq, float(eps), D=D, QK_NORM=q_norm is not None, POS_EARLY=pos_settled, num_warps=1, **launch_kw(q.device))
    if interp_cache:
        k_cache.copy_(kc)
        v_cache.copy_(vc)
    return q_out.to(q.dtype)


@_rope_append_op.register_fake
def _(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, eps, pos_settled=False):
    B, _, _, D = k_cache.shape
    return q.new_empty(B, q.shape[1] // D, D)


def rope_append(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm=None, k_norm=None, eps=1e-6, *,
                pos_settled=False):
    """One-token step of a layer's attention input: rotary embedding of ``q [B, Hq * D]`` and ``k [B, Hkv * D]``
    (optionally after the per-head RMSNorms ``q_norm``/``k_norm [D]``, Qwen3), k and ``v [B, Hkv * D]`` appended
    to ``k_cache``/``v_cache [B, Hkv, L, D]`` at the position ``pos`` (an int tensor of one element, on the
    device: graph-safe), ``cos``/``sin`` ``[L', D]`` tables indexed by position. Returns the rotated q
    ``[B, Hq, D]``. q, k, v may be column slices of one fused projection output. ``pos_settled``: ``pos`` was
    written before the kernels of the current programmatic-dependent-launch chain (as ``new_from`` of
    :func:`kbit.ops.attention.decode_attention`), so the kernel reads it and its cos / sin rows before waiting for
    the kernel before it; else after."""
    if not isinstance(pos_settled, bool):
        raise TypeError(f"pos_settled: expected a bool, got {type(pos_settled).__name__}")
    _check_rows("q", q)
    dt, dev = q.dtype, q.device
    _check_rows("k", k, dt, dev)
    _check_rows("v", v, dt, dev, k.shape[1])
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
        if t.dim() != 2 or t.shape[1] != D or t.device != dev or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a [positions, {D}] table on {dev}, got {tuple(t.shape)}")
    if not (isinstance(pos, torch.Tensor) and pos.numel() == 1 and pos.dtype in (torch.int32, torch.int64)
            and pos.device == dev):
        raise ValueError(f"pos: expected a one-element int32/int64 tensor on {dev}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: give both or neither")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (D,) or w.device != dev):
            raise ValueError(f"{name}: expected shape ({D},) on {dev}, got {tuple(w.shape)}")
    return torch.ops.kbit.rope_append(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, float(eps),
                                      pos_settled)


# ------------------------------------------------------------------------------------------ SiLU * up
def silu_mul_reference(gate, up):
    return torch.nn.functional.silu(gate) * up


SILU_BLOCK = 1024


@torch.library.custom_op("kbit::silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not _use_triton(gate):
        return silu_mul_reference(gate, up)
    R, I = gate.shape
    g, u = _up(gate), _up(up)
    y = torch.empty(R, I, dtype=g.dtype, device=gate.device)
    _k.silu_mul_kernel[(R, triton.cdiv(I, SILU_BLOCK))](
        g, u, y, g.stride(0), u.stride(0), y.stride(0), I, BLOCK=SILU_BLOCK, num_warps=4, **launch_kw(gate.device))
    return y.to(gate.dtype)


@_silu_mul_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape[0], gate.shape[1])


@torch.library.custom_op("kbit::silu_mul_rotated", mutates_args=())
def _silu_mul_rot_op(gate: torch.Tensor, up: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    if not _use_triton(gate):
        return hadamard_reference(silu_mul_reference(gate, up), signs, block)
    R, I = gate.shape
    g, u = _up(gate), _up(up)
    y = torch.empty(R, I, dtype=g.dtype, device=gate.device)
    width = max(SILU_BLOCK, block)  # whole rotation blocks a program
    _k.silu_mul_rot_kernel[(R, triton.cdiv(I, width))](
        g, u, signs, y, g.stride(0), u.stride(0), y.stride(0), I, block ** -0.5, BLOCK=width,
        LOG_B=block.bit_length() - 1, num_warps=max(4, min(16, width // 256)), **launch_kw(gate.device))
    return y.to(gate.dtype)


@_silu_mul_rot_op.register_fake
def _(gate, up, signs, block):
    return gate.new_empty(gate.shape[0], gate.shape[1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor, rotation: Rotation | None = None,
             signs: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``[R, I]`` rows (column slices of a fused gate/up output are fine).

    With ``rotation`` (its block dividing I) the result is ``(silu(gate) * up) R``, one kernel: the input of a
    down projection quantized under ``rotation``; ``signs`` int8 ``[I]`` (made and cached when None)."""
    _check_rows("gate", gate)
    _check_rows("up", up, gate.dtype, gate.device, gate.shape[1])
    if up.shape[0] != gate.shape[0]:
        raise ValueError(f"up: expected {gate.shape[0]} rows, got {up.shape[0]}")
    signs = _rotation_signs(rotation, signs, gate.shape[1], gate.device, "gate.shape[1] (I)")
    if signs is None:
        return torch.ops.kbit.silu_mul(gate, up)
    return torch.ops.kbit.silu_mul_rotated(gate, up, signs, rotation.block)



# ------------------------------------------------------------------------------------------ argmax
ARGMAX_BLOCK = 4096


@torch.library.custom_op("kbit::argmax", mutates_args=())
def _argmax_op(x: torch.Tensor) -> torch.Tensor:
    if not _use_triton(x):
        return x.argmax(-1)
    R, V = x.shape
    nb = triton.cdiv(V, ARGMAX_BLOCK)
    pv = torch.empty(R, nb, dtype=torch.float32, device=x.device)
    pi = torch.empty(R, nb, dtype=torch.int32, device=x.device)
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    kw = launch_kw(x.device)
    _k.argmax_partial_kernel[(R, nb)](_up(x), pv, pi, x.stride(0), V, nb, BLOCK=ARGMAX_BLOCK, num_warps=8, **kw)
    _k.argmax_final_kernel[(R,)](pv, pi, out, 1, nb, V, NB_PAD=triton.next_power_of_2(nb), num_warps=1, **kw)
    return out


@_argmax_op.register_fake
def _(x):
    return x.new_empty(x.shape[0], dtype=torch.int64)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value of each row of ``x [R, V]`` (the first one on ties; NaN counts as the largest),
    as ``torch.argmax(x, -1)``; two small kernels instead of torch's one-block-a-row reduction, which is slow on
    a vocabulary-sized row."""
    _check_rows("x", x)
    if x.shape[1] == 0:
        raise ValueError("x: expected at least one column")
    return torch.ops.kbit.argmax(x)
