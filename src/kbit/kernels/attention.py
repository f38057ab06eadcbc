"""Triton kernels for split-KV decode attention (launchers: ``kbit.ops.attention``).

One decode step of grouped-query attention: the G query heads that share a KV head are the rows of one
[G, D] tile, attended against that head's cache ``[L, D]``. ``split_kernel``, grid ``(B * Hkv, S)``:
program ``(bh, s)`` walks keys ``[s * chunk, (s + 1) * chunk)`` in blocks of ``BLOCK_N`` with an online
softmax in float32 (exp2 domain: scores are pre-multiplied by ``log2(e)``). Query rows are padded to
``BLOCK_G >= 16`` so both products are ``tl.dot`` (tensor cores); the probabilities are rounded to the
value dtype before ``P @ V``, as flash attention does. A block with no valid key loads neither K nor V, so
the programs past the valid length cost one small loop and a neutral partial (``m = -inf, l = 0``).

With one split the program normalises and writes the output itself. Otherwise it writes a partial
(running max ``m``, sum ``l``, unnormalised ``acc``) and the S partials are merged:
``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``. ``FOLD``: by the split program that finishes last
(a per-(b, h) arrival counter, reset to 0 by that program, so the counters stay zero between calls); otherwise by
``combine_kernel``, one program per query row, launched after.

``PREFETCH`` (length form, no mask): the caller promises that the keys before ``NewFrom[0]`` and the length were
written before the kernels of the current dependent-launch chain (e.g. in earlier decode steps). The program then
loads its first block of those keys before the PDL wait, overlapping the kernels before it; only keys at or
after ``NewFrom[0]`` (this step's, written by the kernel just before) are read after the wait.

Validity of key j for batch row b: ``j < length[b]`` (when a length tensor is given) and, when an additive
mask is given, ``mask[b, j] > MASKED`` (bool masks: ``mask[b, j]`` true); the mask value is added to the
scaled score. A row without any valid key gets zeros.
"""

import triton
import triton.language as tl

from kbit.kernels.glue import _pdl_enter

NEG_INF = tl.constexpr(float("-inf"))
LOG2E = tl.constexpr(1.4426950408889634)
#: additive mask values at or below this are "masked out" (fp16's lowest finite value: every dtype's
#: minimum and -inf qualify; exp(s + mask - max) is exactly 0 in float32 for any such key anyway)
MASKED = tl.constexpr(-65504.0)


@triton.jit
def _attend_block(q, k_base, v_base, n, valid, bias, m_i, l_i, acc, stride_kn, stride_vn, qk_scale, offs_d):
    """One block of keys ``n`` (at least one valid) folded into the online softmax of the G rows."""
    # both loads before the first product, so V is in flight while the scores are computed
    k = tl.load(k_base + n[:, None] * stride_kn + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :], mask=valid[:, None], other=0.0)
    return _attend_kv(q, k, v, valid, bias, m_i, l_i, acc, qk_scale)


@triton.jit
def _attend_kv(q, k, v, valid, bias, m_i, l_i, acc, qk_scale):
    """:func:`_attend_block` on loaded keys and values."""
    s = tl.dot(q, tl.trans(k)) * qk_scale + bias[None, :]
    s = tl.where(valid[None, :], s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the block has a valid key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _row_value(T, b, PER_ROW: tl.constexpr):
    """``T[b]`` (one value per batch row) or ``T[0]`` (one for all), as int32."""
    if PER_ROW:
        v = tl.load(T + b)
    else:
        v = tl.load(T)
    return v.to(tl.int32)


@triton.jit
def _combine_store(PartO, PartM, PartL, Out, bh, S, G, o_base, stride_og,
                   D: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, SB: tl.constexpr):
    """Merge KV head ``bh``'s S partials into its G output rows at ``o_base`` (row stride ``stride_og``)."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    row_ok = offs_g < G
    offs_s = tl.arange(0, S_PAD)
    mg = (bh * S + offs_s[:, None]) * G + offs_g[None, :]
    ok = (offs_s[:, None] < S) & row_ok[None, :]
    # .cg: other programs wrote these (to L2); never a stale line of this SM's L1
    m = tl.load(PartM + mg, mask=ok, other=NEG_INF, cache_modifier=".cg")
    l_all = tl.load(PartL + mg, mask=ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > NEG_INF, m_max, 0.0)  # no split with a valid key: every weight is 0
    denom = tl.sum(tl.exp2(m - m_max[None, :]) * l_all, axis=0)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s0 in range(0, S, SB):  # SB partials at a time: [SB, G_PAD, D] loads in flight together
        s = s0 + tl.arange(0, SB)
        r = (bh * S + s[:, None]) * G + offs_g[None, :]
        ms = tl.load(PartM + r, mask=(s[:, None] < S) & row_ok[None, :], other=NEG_INF, cache_modifier=".cg")
        ws = tl.exp2(ms - m_max[None, :])
        o = tl.load(PartO + r[:, :, None] * D + offs_d[None, None, :], mask=(ws > 0)[:, :, None], other=0.0,
                    cache_modifier=".cg")
        acc += tl.sum(ws[:, :, None] * o, axis=0)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(o_base + offs_g[:, None] * stride_og + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def split_kernel(
    Q, K, V, Mask, Length, NewFrom, Counter, Out, PartO, PartM, PartL,
    stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mn,
    stride_ob, stride_oh, stride_og,
    H, G, L, S, chunk, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_LENGTH: tl.constexpr, LENGTH_PER_ROW: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, FOLD: tl.constexpr = False,
    G_PAD: tl.constexpr = 1, S_PAD: tl.constexpr = 1, SB: tl.constexpr = 1,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_g < G
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    start = split * chunk
    end = tl.minimum(start + chunk, L)
    if PREFETCH:  # the length and the keys before NewFrom are settled: first block before the wait
        end = tl.minimum(end, _row_value(Length, b, LENGTH_PER_ROW))
        new0 = _row_value(NewFrom, b, LENGTH_PER_ROW)
        n = start + offs_n
        valid0 = n < end
        old = valid0 & (n < new0)
        k0 = tl.load(k_base + n[:, None] * stride_kn + offs_d[None, :], mask=old[:, None], other=0.0)
        v0 = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :], mask=old[:, None], other=0.0)
    _pdl_enter(PDL)
    if HAS_LENGTH and not PREFETCH:
        end = tl.minimum(end, _row_value(Length, b, LENGTH_PER_ROW))

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    first = start
    if PREFETCH:
        fresh = valid0 & (n >= new0)  # this step's keys: written by the kernel before, read after the wait
        k1 = tl.load(k_base + n[:, None] * stride_kn + offs_d[None, :], mask=fresh[:, None], other=0.0)
        v1 = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :], mask=fresh[:, None], other=0.0)
        if start < end:
            m_i, l_i, acc = _attend_kv(q, tl.where(fresh[:, None], k1, k0), tl.where(fresh[:, None], v1, v0),
                                       valid0, tl.zeros([BLOCK_N], tl.float32), m_i, l_i, acc, qk_scale)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        n = n0 + offs_n
        valid = n < end
        if HAS_MASK:
            mv = tl.load(Mask + b * stride_mb + n * stride_mn, mask=valid, other=0)
            if MASK_BOOL:
                valid = valid & (mv != 0)
                bias = tl.zeros([BLOCK_N], tl.float32)
            else:
                bias = mv.to(tl.float32)
                valid = valid & (bias > MASKED)
                bias = tl.where(valid, bias, 0.0) * LOG2E
            if tl.max(valid.to(tl.int32), axis=0) > 0:  # a masked-out block loads no K/V
                m_i, l_i, acc = _attend_block(q, k_base, v_base, n, valid, bias, m_i, l_i, acc, stride_kn, stride_vn,
                                              qk_scale, offs_d)
        else:  # every block has a valid key: no branch, so the loop's loads can be pipelined
            m_i, l_i, acc = _attend_block(q, k_base, v_base, n, valid, tl.zeros([BLOCK_N], tl.float32), m_i, l_i,
                                          acc, stride_kn, stride_vn, qk_scale, offs_d)

    if SPLIT:
        ml = (bh * S + split) * G + offs_g
        tl.store(PartM + ml, m_i, mask=row_ok)
        tl.store(PartL + ml, l_i, mask=row_ok)
        tl.store(PartO + ml[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        if FOLD:  # the last of the S programs to arrive merges the partials (classic threadfence reduction)
            tl.debug_barrier()  # every thread's partial stores precede the release of the arrival below
            arrived = tl.atomic_add(Counter + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == S - 1:
                tl.atomic_xchg(Counter + bh, 0, sem="relaxed", scope="gpu")  # ready for the next call
                _combine_store(PartO, PartM, PartL, Out, bh, S, G, Out + b * stride_ob + h * stride_oh, stride_og,
                               D, G_PAD, S_PAD, SB)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = Out + b * stride_ob + h * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_partials(PartO, PartM, PartL, r, ok, offs_d, m_run, l_run, acc, D: tl.constexpr):
    """Fold the partials at rows ``r`` (where ``ok``) into the running ``m_run, l_run, acc`` of one query row; their
    ``m``, ``l`` and ``acc`` are loaded together, no load behind another."""
    m = tl.load(PartM + r, mask=ok, other=NEG_INF)
    l = tl.load(PartL + r, mask=ok, other=0.0)
    o = tl.load(PartO + r[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    m_new = tl.maximum(m_run, tl.max(m, axis=0))
    m_ref = tl.where(m_new > NEG_INF, m_new, 0.0)  # no valid key yet: every weight is 0
    alpha = tl.exp2(m_run - m_ref)
    w = tl.exp2(m - m_ref)
    return m_new, l_run * alpha + tl.sum(w * l, axis=0), acc * alpha + tl.sum(w[:, None] * o, axis=0)


@triton.jit
def combine_kernel(
    PartO, PartM, PartL, Out,
    stride_ob, stride_oh, stride_og,
    H, G, S,
    D: tl.constexpr, BLOCK_S: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge query row ``g`` of KV head ``bh``'s S partials, ``BLOCK_S`` a step, the steps merged online.
    ``ONE_STEP`` (``S <= BLOCK_S``): one round of loads after the wait, compiled without the loop (with it, D = 128
    and 64 partials at 4 warps take every register)."""
    pid = tl.program_id(0)
    _pdl_enter(PDL)
    bh = pid // G
    g = pid % G
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, D)
    offs_s = tl.arange(0, BLOCK_S)

    r = (bh * S + offs_s) * G + g
    m_run, l_run, acc = _merge_partials(PartO, PartM, PartL, r, offs_s < S, offs_d,
                                        tl.max(tl.full([BLOCK_S], NEG_INF, tl.float32), axis=0),
                                        tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0), tl.zeros([D], tl.float32), D)
    if not ONE_STEP:
        for s0 in range(BLOCK_S, S, BLOCK_S):
            s = s0 + offs_s
            m_run, l_run, acc = _merge_partials(PartO, PartM, PartL, (bh * S + s) * G + g, s < S, offs_d, m_run,
                                                l_run, acc, D)

    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + g * stride_og + offs_d, out.to(Out.dtype.element_ty))
