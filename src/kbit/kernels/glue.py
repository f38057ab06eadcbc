"""Triton kernels for the element-wise glue of a decoder layer's one-token step (launchers and torch references in
:mod:`kbit.ops.glue`).

- :func:`add_rms_norm_kernel`: ``r = x + residual`` (rounded to the activation dtype, as transformers adds), then
  ``weight * (r * rsqrt(mean(r^2) + eps))``: the residual add and the next RMSNorm in one pass over the row.
- :func:`rope_append_kernel`: rotary embedding of q and k (optionally after a per-head RMSNorm of q and k, as in
  Qwen3), k and v written into the static cache at the step's position, the rotated q written out.
- :func:`silu_mul_kernel`: ``silu(gate) * up`` of a dense MLP (silu rounded first, as transformers does; the MoE
  kernel of :mod:`kbit.kernels.moe` rounds once, on a fused ``[P, 2I]`` input).
- :func:`add_rms_norm_rot_kernel`, :func:`silu_mul_rot_kernel`: the same, then the row multiplied by a randomized
  Hadamard rotation ``R`` before the store (the input of a layer whose weight was quantized under ``R``;
  :mod:`kbit.kernels.hadamard`): the value the unrotated kernel stores is rounded to the dtype first, so the result
  is the unfused op followed by ``kbit.ops.hadamard.rotate``, in one pass over the row.
- :func:`argmax_partial_kernel`, :func:`argmax_final_kernel`: the index of each row's largest value.

Each kernel takes ``PDL``: launched with programmatic dependent launch (sm_90), it first lets the next kernel launch
(``gdc_launch_dependents``; that kernel reads only weights before its own wait, which waits for this one), then waits
for the previous kernel (``gdc_wait``) before reading anything that kernel may have written, so a following k-bit
GEMV loads its first weights while this kernel runs.
Rounding follows transformers' eager code: every product and sum that it computes in the activation dtype is
rounded to that dtype here too (products of two 16-bit values are exact in float32, so rounding the float32 result
gives the 16-bit operation's value).
"""

import triton
import triton.language as tl

from kbit.kernels.hadamard import hadamard_butterflies

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL is never requested there (see kbit.ops.glue)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    if PDL:  # the next kernel may launch now: it reads only weights before its own wait, which waits for us
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _add_norm_row(X, Res, ResOut, row, offs, ok, store_ok, stride_x, stride_r, stride_ro, H, eps,
                  HAS_RES: tl.constexpr):
    """Row ``row``'s residual add (``r = x + res``, stored to ``ResOut`` where ``store_ok``) and
    ``r * rsqrt(mean(r^2) + eps)``, rounded to x's dtype as transformers rounds (returned in float32, before the
    norm weight)."""
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    return _add_norm_vals(x, Res, ResOut, row, offs, ok, store_ok, stride_r, stride_ro, H, eps, HAS_RES)


@triton.jit
def _add_norm_vals(x, Res, ResOut, row, offs, ok, store_ok, stride_r, stride_ro, H, eps, HAS_RES: tl.constexpr):
    """:func:`_add_norm_row` of a row already loaded (or made): ``x`` in the activation dtype, zero where not
    ``ok``."""
    if HAS_RES:
        r = tl.load(Res + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ResOut + row * stride_ro + offs, x, mask=store_ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    return (xf * rstd).to(x.dtype).to(tl.float32)


@triton.jit
def add_rms_norm_kernel(X, Res, W, Y, ResOut, stride_x, stride_r, stride_y, stride_ro, H, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)  # a weight: no dependency, read before the wait
    _pdl_enter(PDL)
    h = _add_norm_row(X, Res, ResOut, row, offs, ok, ok, stride_x, stride_r, stride_ro, H, eps, HAS_RES)
    tl.store(Y + row * stride_y + offs, (w * h).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def add_rms_norm_rot_kernel(X, Res, W, Signs, Y, ResOut, stride_x, stride_r, stride_y, stride_ro, H, eps, scale,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr, LOG_B: tl.constexpr, PDL: tl.constexpr):
    """:func:`add_rms_norm_kernel` storing ``(weight * norm(r)) R``: one program a row (the norm needs the whole
    row; the rotation blocks divide H, so the ``BLOCK - H`` padded columns are whole blocks of zeros)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)  # weight and signs: no dependency, before the wait
    s = tl.load(Signs + offs, mask=ok, other=0).to(tl.float32)
    _pdl_enter(PDL)
    h = _add_norm_row(X, Res, ResOut, row, offs, ok, ok, stride_x, stride_r, stride_ro, H, eps, HAS_RES)
    y = (w * h).to(Y.dtype.element_ty).to(tl.float32)  # what the unrotated kernel stores
    y = hadamard_butterflies(y * s, BLOCK, LOG_B) * scale
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _load_head(base, Wn, offs, rot, eps, D: tl.constexpr, QK_NORM: tl.constexpr, dtype: tl.constexpr):
    """A head's values and their rotate-half partners (float32), after the head's RMSNorm when ``QK_NORM``."""
    x = tl.load(base + offs).to(tl.float32)
    xr = tl.load(base + rot).to(tl.float32)
    if QK_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = (tl.load(Wn + offs).to(tl.float32) * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xr = (tl.load(Wn + rot).to(tl.float32) * (xr * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x, xr


@triton.jit
def _rotate(x, xr, c, s, dtype: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` with each product and the sum rounded to ``dtype``."""
    a = (x * c).to(dtype).to(tl.float32)
    b = (xr * s).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _pos_rows(Pos, Cos, Sin, stride_cos, offs):
    p = tl.load(Pos).to(tl.int32)
    return p, tl.load(Cos + p * stride_cos + offs).to(tl.float32), tl.load(Sin + p * stride_cos + offs).to(tl.float32)


@triton.jit
def rope_append_kernel(Q, Kx, V, Cos, Sin, Pos, QN, KN, Qout, Kc, Vc,
                       stride_qb, stride_kb, stride_vb, stride_cos, stride_qob, stride_qoh,
                       stride_kcb, stride_kch, stride_kcl, stride_vcb, stride_vch, stride_vcl,
                       Hq, eps, D: tl.constexpr, QK_NORM: tl.constexpr, POS_EARLY: tl.constexpr, PDL: tl.constexpr):
    """``POS_EARLY``: the position and its cos / sin rows are read before the PDL wait (the caller wrote ``Pos``
    before the dependent-launch chain): two dependent loads off the critical path."""
    b = tl.program_id(0)
    h = tl.program_id(1)  # query heads first, then one program a KV head (k and v)
    dtype = Qout.dtype.element_ty
    offs = tl.arange(0, D)
    half: tl.constexpr = D // 2
    rot = (offs + half) % D
    sign = tl.where(offs < half, -1.0, 1.0)
    if POS_EARLY:
        p, c, s = _pos_rows(Pos, Cos, Sin, stride_cos, offs)
        _pdl_enter(PDL)
    else:
        _pdl_enter(PDL)
        p, c, s = _pos_rows(Pos, Cos, Sin, stride_cos, offs)
    if h < Hq:
        x, xr = _load_head(Q + b * stride_qb + h * D, QN, offs, rot, eps, D, QK_NORM, dtype)
        tl.store(Qout + b * stride_qob + h * stride_qoh + offs, _rotate(x, sign * xr, c, s, dtype))
    else:
        j = h - Hq
        x, xr = _load_head(Kx + b * stride_kb + j * D, KN, offs, rot, eps, D, QK_NORM, dtype)
        tl.store(Kc + b * stride_kcb + j * stride_kch + p * stride_kcl + offs,
                 _rotate(x, sign * xr, c, s, Kc.dtype.element_ty))
        v = tl.load(V + b * stride_vb + j * D + offs)
        tl.store(Vc + b * stride_vcb + j * stride_vch + p * stride_vcl + offs, v.to(Vc.dtype.element_ty))


@triton.jit
def silu_mul_kernel(G, U, Y, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    _pdl_enter(PDL)
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(Y + row * stride_y + offs, (a * u).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_rot_kernel(G, U, Signs, Y, stride_g, stride_u, stride_y, I, scale,
                        BLOCK: tl.constexpr, LOG_B: tl.constexpr, PDL: tl.constexpr):
    """:func:`silu_mul_kernel` storing ``(silu(gate) * up) R``; ``BLOCK`` is a multiple of the rotation block, so
    a program holds whole blocks (and the masked columns past I are whole blocks of zeros)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    s = tl.load(Signs + offs, mask=ok, other=0).to(tl.float32)
    _pdl_enter(PDL)
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    y = (a * u).to(Y.dtype.element_ty).to(tl.float32)  # what the unrotated kernel stores
    y = hadamard_butterflies(y * s, BLOCK, LOG_B) * scale
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def argmax_partial_kernel(X, PV, PI, stride_x, V, NB, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Max and first index of the max over one ``BLOCK`` of a row (NaN counts as the largest, as in torch)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    _pdl_enter(PDL)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    m = tl.max(x, axis=0)
    i = tl.min(tl.where(x == m, offs, V), axis=0)
    tl.store(PV + row * NB + blk, m)
    tl.store(PI + row * NB + blk, i)


@triton.jit
def argmax_final_kernel(PV, PI, Out, stride_o, NB, V, NB_PAD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, NB_PAD)
    ok = offs < NB
    _pdl_enter(PDL)
    v = tl.load(PV + row * NB + offs, mask=ok, other=float("-inf"))
    i = tl.load(PI + row * NB + offs, mask=ok, other=V)
    m = tl.max(v, axis=0)
    tl.store(Out + row * stride_o, tl.min(tl.where(v == m, i, V), axis=0).to(Out.dtype.element_ty))
