"""GEMV on packed k-bit codes (M = 1..8 rows of activations), dense and MoE-grouped.

Only @triton.jit code lives here (its inline PTX is built in ``kbit.kernels.gemv_ptx``); launchers are in
``kbit.ops.gemv``.

Reads the canonical layout of ``docs/format.md`` directly. A program owns ``BN`` weight rows and walks K in
chunks of ``G`` groups of 32 columns. One group of one row is ``WPG`` plane-0 words (k = 2, 3: 2 words of
16 two-bit codes; k = 4, 5: 4 words of 8 nibbles) plus, for k = 3 and 5, one plane-1 word (the top bit of
its 32 codes). Code tiles are ``[BN, G, WPG]`` int32 (16-byte loads at k = 4, 5), so every per-word
quantity below is one 2-D-like tile in the load's own layout: no reshapes, no layout conversions.

Fast path (``USE_ASM``): the codebook lives in registers as byte tables (low bytes and high bytes of its
fp16/bf16 values, 8 entries per register pair) and ``prmt`` looks up four codes at once; entries beyond 8
(k = 4, 5) are blended in with byte masks made from the code's high bits. The lookup yields packed
fp16x2/bf16x2 weights, multiplied with packed activation pairs by ``fma.rn.{f16,bf16}x2`` in short chains
(8 products a lane for fp16, 4 for bf16) that are then added in fp32. Block scales are applied to fp32
partial sums, the matrix scale once per output.

Portable path (``USE_ASM=False``, used under ``TRITON_INTERPRET=1``): the same tiles, codes unpacked with
shifts and masks, codebook gathered from memory, everything in fp32.
"""

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _treg(tab_ptr, lane, i: tl.constexpr, NTR: tl.constexpr):
    """Table word i in an ordinary register. The table is stored once per lane and each lane reads its own
    copy: with a uniform address ptxas would keep the word in a uniform register and copy it back before
    every prmt (about one extra instruction per weight)."""
    return tl.load(tab_ptr + lane * NTR + i)


@triton.jit
def _table(tab_ptr, K_BITS: tl.constexpr):
    """The 2**(k-1) byte-table registers (a tuple of scalars); tab_ptr: the table repeated for 32 lanes."""
    NTR: tl.constexpr = 2 ** (K_BITS - 1)
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.load(tab_ptr)], dtype=tl.int32,
                                     is_pure=True, pack=1)
    t0 = _treg(tab_ptr, lane, 0, NTR)
    t1 = _treg(tab_ptr, lane, 1, NTR)
    if K_BITS == 2:
        t = (t0, t1)
    else:
        t2 = _treg(tab_ptr, lane, 2, NTR)
        t3 = _treg(tab_ptr, lane, 3, NTR)
        if K_BITS == 3:
            t = (t0, t1, t2, t3)
        else:
            t4 = _treg(tab_ptr, lane, 4, NTR)
            t5 = _treg(tab_ptr, lane, 5, NTR)
            t6 = _treg(tab_ptr, lane, 6, NTR)
            t7 = _treg(tab_ptr, lane, 7, NTR)
            if K_BITS == 4:
                t = (t0, t1, t2, t3, t4, t5, t6, t7)
            else:
                t8 = _treg(tab_ptr, lane, 8, NTR)
                t9 = _treg(tab_ptr, lane, 9, NTR)
                t10 = _treg(tab_ptr, lane, 10, NTR)
                t11 = _treg(tab_ptr, lane, 11, NTR)
                t12 = _treg(tab_ptr, lane, 12, NTR)
                t13 = _treg(tab_ptr, lane, 13, NTR)
                t14 = _treg(tab_ptr, lane, 14, NTR)
                t15 = _treg(tab_ptr, lane, 15, NTR)
                t = (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
    return t


@triton.jit
def _lookup_asm(w, h, tab, K_BITS: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr):
    if K_BITS == 2:
        v = tl.inline_asm_elementwise(ASM, CONS, [w, tab[0], tab[1]], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    elif K_BITS == 3:
        v = tl.inline_asm_elementwise(ASM, CONS, [w, h, tab[0], tab[1], tab[2], tab[3]], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
    elif K_BITS == 4:
        v = tl.inline_asm_elementwise(
            ASM, CONS, [w, tab[0], tab[1], tab[2], tab[3], tab[4], tab[5], tab[6], tab[7]],
            dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        v = tl.inline_asm_elementwise(
            ASM, CONS, [w, h, tab[0], tab[1], tab[2], tab[3], tab[4], tab[5], tab[6], tab[7], tab[8], tab[9],
                        tab[10], tab[11], tab[12], tab[13], tab[14], tab[15]],
            dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    return v


@triton.jit
def _dot_asm(v, x, NP: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr):
    if NP == 4:
        r = tl.inline_asm_elementwise(ASM, CONS, [v[0], v[1], v[2], v[3], x[0], x[1], x[2], x[3]],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise(
            ASM, CONS, [v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], x[0], x[1], x[2], x[3], x[4], x[5],
                        x[6], x[7]], dtype=tl.float32, is_pure=True, pack=1)
    return r


@triton.jit
def _half_lo(p, BF16: tl.constexpr):
    """fp32 value of the low half of a packed pair (int32)."""
    if BF16:
        r = (p << 16).to(tl.float32, bitcast=True)
    else:
        r = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return r


@triton.jit
def _half_hi(p, BF16: tl.constexpr):
    if BF16:
        r = (p & -65536).to(tl.float32, bitcast=True)
    else:
        r = ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return r


@triton.jit
def _code(w, h, i, K_BITS: tl.constexpr):
    """Code of column i (constexpr) of a plane-0 word w, h holding the word's plane-1 bits at bit 0."""
    if K_BITS == 2:
        c = (w >> (2 * i)) & 3
    elif K_BITS == 3:
        c = ((w >> (2 * i)) & 3) | (((h >> i) & 1) << 2)
    elif K_BITS == 4:
        c = (w >> (4 * i)) & 15
    else:
        c = ((w >> (4 * i)) & 15) | (((h >> i) & 1) << 4)
    return c


@triton.jit
def _dot_portable(w, h, cb_ptr, x, K_BITS: tl.constexpr, NP: tl.constexpr, BF16: tl.constexpr):
    """fp32 sum over the word's columns of codebook[code] * x (x: natural activation pairs)."""
    acc = tl.zeros(w.shape, tl.float32)
    for p in tl.static_range(NP):
        c0 = _code(w, h, 2 * p, K_BITS)
        c1 = _code(w, h, 2 * p + 1, K_BITS)
        v0 = tl.load(cb_ptr + c0)
        v1 = tl.load(cb_ptr + c1)
        acc += v0 * _half_lo(x[p], BF16) + v1 * _half_hi(x[p], BF16)
    return acc


@triton.jit
def _ldx(x32_ptr, xoff, p: tl.constexpr, mask, lim, XTAIL: tl.constexpr):
    if XTAIL:  # K / 2 not a multiple of the pairs a word holds: mask each pair
        r = tl.load(x32_ptr + xoff + p, mask=mask & (xoff + p < lim), other=0)
    elif mask is None:
        r = tl.load(x32_ptr + xoff + p)
    else:
        r = tl.load(x32_ptr + xoff + p, mask=mask, other=0)
    return r


@triton.jit
def _load_x(x32_ptr, xoff, mask, lim, NP: tl.constexpr, PERMUTE: tl.constexpr, XTAIL: tl.constexpr):
    """NP activation pairs for each word (xoff: int32 offset of the word's first pair; lim: end of the row).

    PERMUTE (k = 2, 3 fast path): regroup pairs of pairs as (x0, x2), (x1, x3), ... to match the lookup.
    """
    p0 = _ldx(x32_ptr, xoff, 0, mask, lim, XTAIL)
    p1 = _ldx(x32_ptr, xoff, 1, mask, lim, XTAIL)
    p2 = _ldx(x32_ptr, xoff, 2, mask, lim, XTAIL)
    p3 = _ldx(x32_ptr, xoff, 3, mask, lim, XTAIL)
    if NP == 4:
        xs = (p0, p1, p2, p3)
    else:
        p4 = _ldx(x32_ptr, xoff, 4, mask, lim, XTAIL)
        p5 = _ldx(x32_ptr, xoff, 5, mask, lim, XTAIL)
        p6 = _ldx(x32_ptr, xoff, 6, mask, lim, XTAIL)
        p7 = _ldx(x32_ptr, xoff, 7, mask, lim, XTAIL)
        if PERMUTE:
            xs = (
                (p0 & 0xFFFF) | (p1 << 16), ((p0 >> 16) & 0xFFFF) | (p1 & -65536),
                (p2 & 0xFFFF) | (p3 << 16), ((p2 >> 16) & 0xFFFF) | (p3 & -65536),
                (p4 & 0xFFFF) | (p5 << 16), ((p4 >> 16) & 0xFFFF) | (p5 & -65536),
                (p6 & 0xFFFF) | (p7 << 16), ((p6 >> 16) & 0xFFFF) | (p7 & -65536),
            )
        else:
            xs = (p0, p1, p2, p3, p4, p5, p6, p7)
    return xs


@triton.jit
def _load_x_vec(x32_ptr, xoff, NP: tl.constexpr, PERMUTE: tl.constexpr):
    """The NP activation pairs of each word by 16-byte ``ld.global.nc`` (xoff 4-word aligned, no masks).

    Inline asm on purpose: the software pipeliner leaves it alone (x is tiny and L1-resident; routing it
    through cp.async costs 16 scalar copies a step, each with its own predication), and it is one 16-byte load
    for 4 pairs where tl.load emitted 4 scalar loads."""
    ptr = x32_ptr + xoff
    p0, p1, p2, p3 = tl.inline_asm_elementwise("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                               [ptr], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                               is_pure=True, pack=1)
    if NP == 4:
        xs = (p0, p1, p2, p3)
    else:
        p4, p5, p6, p7 = tl.inline_asm_elementwise("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4+16];",
                                                   "=r,=r,=r,=r,l", [ptr],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=True, pack=1)
        if PERMUTE:
            xs = (
                (p0 & 0xFFFF) | (p1 << 16), ((p0 >> 16) & 0xFFFF) | (p1 & -65536),
                (p2 & 0xFFFF) | (p3 << 16), ((p2 >> 16) & 0xFFFF) | (p3 & -65536),
                (p4 & 0xFFFF) | (p5 << 16), ((p4 >> 16) & 0xFFFF) | (p5 & -65536),
                (p6 & 0xFFFF) | (p7 << 16), ((p6 >> 16) & 0xFFFF) | (p7 & -65536),
            )
        else:
            xs = (p0, p1, p2, p3, p4, p5, p6, p7)
    return xs


@triton.jit
def _scale_words(sw_ptr, soff, mask, LOG8: tl.constexpr):
    """Block scales (fp32) at element offsets ``soff`` of the scales tensor, read as the aligned int32 word that
    holds each one: a 4-byte load can go through cp.async (a 1-byte one cannot, and then stalls every step).
    The last word may extend up to 3 bytes past the tensor (allocations are padded to >= 256 bytes)."""
    SH: tl.constexpr = 2 if LOG8 else 1
    if mask is None:
        wv = tl.load(sw_ptr + (soff >> SH))
    else:
        wv = tl.load(sw_ptr + (soff >> SH), mask=mask, other=0)
    if LOG8:
        q = ((wv >> ((soff & 3) * 8)) & 0xFF).to(tl.float32)
        r = tl.where(q < 255.0, tl.exp2(q * -0.0625), 0.0)
    else:
        r = ((wv >> ((soff & 1) * 16)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return r


@triton.jit
def _row_dot(x32_ptr, xrow, vals, w, h, cb_ptr, gg, j, g_ok, K2, acc,
             K_BITS: tl.constexpr, NP: tl.constexpr, CPW: tl.constexpr, BF16: tl.constexpr,
             USE_ASM: tl.constexpr, DASM: tl.constexpr, DCONS: tl.constexpr, XTAIL: tl.constexpr,
             EVEN_K: tl.constexpr, XVEC: tl.constexpr):
    """acc[BN, G] += per-group sums of one activation row (unscaled)."""
    xoff = xrow + gg * 16 + j * (CPW // 2)  # [1, G, WPG]
    lim = xrow + K2
    if EVEN_K:
        xmask = None
    else:
        xmask = g_ok & (xoff < lim)
    if USE_ASM:
        if XVEC:
            xs = _load_x_vec(x32_ptr, xoff, NP, K_BITS < 4)
        else:
            xs = _load_x(x32_ptr, xoff, xmask, lim, NP, K_BITS < 4, XTAIL)
        part = _dot_asm(vals, xs, NP, DASM, DCONS)
    else:
        xs = _load_x(x32_ptr, xoff, xmask, lim, NP, False, XTAIL)
        part = _dot_portable(w, h, cb_ptr, xs, K_BITS, NP, BF16)
    return acc + tl.sum(part, axis=2)


@triton.jit
def _grouped_ids(tok_ptr, exp_ptr, pid_p, T, E, err_ptr, first):
    """(token, expert, NaN or 0) of grouped row ``pid_p``: an id out of range reads row / matrix 0 instead (in
    bounds) and the row's outputs get NaN added; the ``first`` program of the row ORs 1 (token) / 2 (expert) into
    the error flag (``kbit.ops._ids``)."""
    tok = tl.load(tok_ptr + pid_p)
    e = tl.load(exp_ptr + pid_p)
    tb = (tok < 0) | (tok >= T)
    eb = (e < 0) | (e >= E)
    code = tb.to(tl.int32) | (eb.to(tl.int32) * 2)
    if (code != 0) & first:
        tl.atomic_or(err_ptr, code)
    nan = tl.where(tb | eb, float("nan"), 0.0)
    return tl.where(tb, 0, tok), tl.where(eb, 0, e), nan


@triton.jit
def _out(y_ptr, off, acc, ts, bias, rows, row_ok, SPLIT: tl.constexpr):
    v = tl.sum(acc, axis=1) * ts + bias
    if SPLIT:  # fp32 workspace, one partial sum per K split
        tl.atomic_add(y_ptr + off + rows, v, mask=row_ok, sem="relaxed")
    else:
        tl.store(y_ptr + off + rows, v.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _scale(s_raw, LOG8: tl.constexpr):
    if LOG8:
        q = s_raw.to(tl.float32)
        r = tl.where(q < 255.0, tl.exp2(q * -0.0625), 0.0)
    else:
        r = s_raw.to(tl.float32)
    return r


# --------------------------------------------------------------------------------------------------------
# the kernel, v2: one program per (row block, K split), plain loop
# --------------------------------------------------------------------------------------------------------


@triton.jit
def gemv_kernel(
    x32_ptr,  # int32 view of activations [.., K] (pairs of halves), row stride stride_xm (int32 units)
    codes_ptr, scales_ptr, ts_ptr, tab_ptr, cb_ptr, bias_ptr, y_ptr,
    tok_ptr, exp_ptr,  # grouped: int32 [P] each
    T, E, err_ptr,  # grouped: rows of x, matrices (the ids' bounds), the error flag (int32 [1])
    N, K2, NG, NB, gpb_shift, GS,  # rows, K / 2, Kp / 32 (groups of 32 columns), blocks per row, log2(B / 32)
    stride_xm, stride_ym, stride_ce, stride_se, stride_be,
    K_BITS: tl.constexpr, LOG8: tl.constexpr, M: tl.constexpr,
    BN: tl.constexpr, G: tl.constexpr, BF16: tl.constexpr, USE_ASM: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, XTAIL: tl.constexpr, EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr, SPLIT: tl.constexpr, LASM: tl.constexpr, LCONS: tl.constexpr, DASM: tl.constexpr,
    DCONS: tl.constexpr,
):
    """y[m, n] = sum_i x[m, i] * codebook[code[n, i]] * scale[n, i // B] (per matrix: * tensor_scale).

    Dense: grid (cdiv(N, BN), 1), rows m = 0..M-1 of x, y [M, N].
    SPLIT: grid (cdiv(N, BN), 1, splits); y is a zeroed fp32 workspace that the splits add into.
    Grouped: grid (cdiv(N, BN), P), program (., p) computes y[p, :] = x[tok[p]] @ W[exp[p]]^T (M = 1).
    """
    pid_n = tl.program_id(0)
    g_lo = 0
    g_hi = NG
    if SPLIT:  # program (., ., s) covers groups [s * GS, s * GS + GS)
        pid_k = tl.program_id(2)
        g_lo = pid_k * GS
        g_hi = tl.minimum(NG, g_lo + GS)
    WPG: tl.constexpr = 2 if K_BITS < 4 else 4  # plane-0 words per 32-column group
    CPW: tl.constexpr = 32 // WPG  # codes per plane-0 word
    NP: tl.constexpr = CPW // 2  # activation pairs per word
    HAS_H: tl.constexpr = K_BITS == 3 or K_BITS == 5
    WROW = NG * (WPG + HAS_H)  # words per row
    poison = 0.0
    if GROUPED:
        pid_p = tl.program_id(1)
        tok, e, poison = _grouped_ids(tok_ptr, exp_ptr, pid_p, T, E, err_ptr, pid_n == 0)
        e = e.to(tl.int64)
        codes_ptr += e * stride_ce
        scales_ptr += e * stride_se
        ts_ptr += e
        x32_ptr += tok.to(tl.int64) * stride_xm
        y_ptr += pid_p.to(tl.int64) * stride_ym
        if HAS_BIAS:
            bias_ptr += e * stride_be
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)  # clamp: loads stay in bounds without a mask on the row
    r3 = rows[:, None, None].to(tl.int64)
    g3 = tl.arange(0, G)[None, :, None]
    j = tl.arange(0, WPG)[None, None, :]
    if USE_ASM:
        tab = _table(tab_ptr, K_BITS)
    acc0 = tl.zeros([BN, G], tl.float32)
    acc1 = tl.zeros([BN, G], tl.float32)
    acc2 = tl.zeros([BN, G], tl.float32)
    acc3 = tl.zeros([BN, G], tl.float32)
    acc4 = tl.zeros([BN, G], tl.float32)
    acc5 = tl.zeros([BN, G], tl.float32)
    acc6 = tl.zeros([BN, G], tl.float32)
    acc7 = tl.zeros([BN, G], tl.float32)
    crow = codes_ptr + r3 * WROW
    srow = scales_ptr + r3 * NB
    if PREFETCH:  # registers double-buffer the next step's codes and scales (needs EVEN_K)
        wn = tl.load(crow + (g_lo + g3) * WPG + j)
        sn = tl.load(srow + ((g_lo + g3) >> gpb_shift))
        if HAS_H:
            hn = tl.load(crow + NG * WPG + (((g_lo + g3) << gpb_shift) >> gpb_shift))
    for g0 in range(g_lo, g_hi, G):
        gg = g0 + g3  # [1, G, 1]
        if PREFETCH:
            g_ok = gg >= 0
            w = wn
            s3 = sn
            gq = (g0 + G) % NG + g3  # wraps on the last step: a harmless re-read
            wn = tl.load(crow + gq * WPG + j)
            sn = tl.load(srow + (gq >> gpb_shift))
        elif EVEN_K:  # no K tail anywhere: no masks
            g_ok = gg >= 0
            w = tl.load(crow + gg * WPG + j)  # [BN, G, WPG]
            s3 = tl.load(srow + (gg >> gpb_shift))  # [BN, G, 1]
        else:
            g_ok = gg < NG
            w = tl.load(crow + gg * WPG + j, mask=g_ok, other=0)
            s3 = tl.load(srow + (gg >> gpb_shift), mask=g_ok, other=0)
        # a [BN, G, 1] load reduced over its unit axis lands in the accumulator's layout (no conversion);
        # the run-time shift keeps the compiler from vectorizing it along G into another layout
        s = tl.sum(_scale(s3, LOG8), axis=2)  # [BN, G]
        h = w  # unused unless HAS_H
        if HAS_H:
            gh = (gg << gpb_shift) >> gpb_shift  # = gg; opaque, so the load keeps the codes' layout
            if PREFETCH:
                hw = hn
                hn = tl.load(crow + NG * WPG + ((gq << gpb_shift) >> gpb_shift))
            elif EVEN_K:
                hw = tl.load(crow + NG * WPG + gh)  # [BN, G, 1]
            else:
                hw = tl.load(crow + NG * WPG + gh, mask=g_ok, other=0)
            h = hw >> (j * CPW)
        vals = w
        if USE_ASM:
            vals = _lookup_asm(w, h, tab, K_BITS, LASM, LCONS)
        zero = tl.zeros([BN, G], tl.float32)
        acc0 += s * _row_dot(x32_ptr, 0, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                             K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 1:
            acc1 += s * _row_dot(x32_ptr, stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 2:
            acc2 += s * _row_dot(x32_ptr, 2 * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 3:
            acc3 += s * _row_dot(x32_ptr, 3 * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 4:
            acc4 += s * _row_dot(x32_ptr, 4 * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 5:
            acc5 += s * _row_dot(x32_ptr, 5 * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 6:
            acc6 += s * _row_dot(x32_ptr, 6 * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
        if M > 7:
            acc7 += s * _row_dot(x32_ptr, 7 * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                                 K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, False)
    ts = 1.0
    if LOG8:  # fp16 scales are absolute (docs/format.md): tensor_scale is not applied
        ts = tl.load(ts_ptr)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0).to(tl.float32)
        if SPLIT:
            bias = bias * (pid_k == 0).to(tl.float32)
    bias = bias + poison  # NaN on a grouped row with an id out of range
    _out(y_ptr, 0, acc0, ts, bias, rows, row_ok, SPLIT)
    if M > 1:
        _out(y_ptr, stride_ym, acc1, ts, bias, rows, row_ok, SPLIT)
    if M > 2:
        _out(y_ptr, 2 * stride_ym, acc2, ts, bias, rows, row_ok, SPLIT)
    if M > 3:
        _out(y_ptr, 3 * stride_ym, acc3, ts, bias, rows, row_ok, SPLIT)
    if M > 4:
        _out(y_ptr, 4 * stride_ym, acc4, ts, bias, rows, row_ok, SPLIT)
    if M > 5:
        _out(y_ptr, 5 * stride_ym, acc5, ts, bias, rows, row_ok, SPLIT)
    if M > 6:
        _out(y_ptr, 6 * stride_ym, acc6, ts, bias, rows, row_ok, SPLIT)
    if M > 7:
        _out(y_ptr, 7 * stride_ym, acc7, ts, bias, rows, row_ok, SPLIT)


# --------------------------------------------------------------------------------------------------------
# the kernel, v3: pipelined K loop, persistent flat tile loop
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _acc_row(acc, m: tl.constexpr, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
             K_BITS: tl.constexpr, NP: tl.constexpr, CPW: tl.constexpr, BF16: tl.constexpr,
             USE_ASM: tl.constexpr, DASM: tl.constexpr, DCONS: tl.constexpr, XTAIL: tl.constexpr,
             EVEN_K: tl.constexpr, M: tl.constexpr, XVEC: tl.constexpr):
    if M > m:
        zero = tl.zeros(acc.shape, tl.float32)
        acc += s * _row_dot(x32_ptr, m * stride_xm, vals, w, h, cb_ptr, gg, j, g_ok, K2, zero,
                            K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, XVEC)
    return acc


@triton.jit
def _flush(y_ptr, m: tl.constexpr, stride_ym, acc, ts, bias, rows, row_ok, SPLIT: tl.constexpr, M: tl.constexpr):
    if M > m:
        _out(y_ptr, m * stride_ym, acc, ts, bias, rows, row_ok, SPLIT)


@triton.jit
def gemv_kernel_v3(
    x32_ptr,  # int32 view of activations [.., K] (pairs of halves), row stride stride_xm (int32 units)
    codes_ptr, scales_ptr, ts_ptr, tab_ptr, cb_ptr, bias_ptr, y_ptr,
    tok_ptr, exp_ptr,  # grouped: int32 [P] each
    T, E, err_ptr,  # grouped: rows of x, matrices (the ids' bounds), the error flag (int32 [1])
    N, K2, NG, NB, gpb_shift, GS,  # rows, K / 2, Kp / 32 (groups of 32 columns), blocks per row, log2(B / 32)
    NT, SPT, SPLITS,  # tiles (row block x K split) per matrix, K steps per tile, K splits
    stride_xm, stride_ym, stride_ce, stride_se, stride_be,
    K_BITS: tl.constexpr, LOG8: tl.constexpr, M: tl.constexpr,
    BN: tl.constexpr, G: tl.constexpr, BF16: tl.constexpr, USE_ASM: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, XTAIL: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, LASM: tl.constexpr, LCONS: tl.constexpr, DASM: tl.constexpr,
    DCONS: tl.constexpr, STAGES: tl.constexpr = 1, XVEC: tl.constexpr = False,
):
    """y[m, n] = sum_i x[m, i] * codebook[code[n, i]] * scale[n, i // B] (per matrix: * tensor_scale).

    Work is cut into tiles: BN rows x one K split (GS groups, SPT steps of G groups). Grid (programs, P):
    program (q, .) takes tiles q, q + programs, q + 2 programs, ... of its matrix and walks all their steps in
    ONE flat loop, software-pipelined STAGES deep (cp.async into shared memory), so the loads never drain
    between tiles; a tile's sums are written when its last step is done.
    Dense: P = 1, rows m = 0..M-1 of x, y [M, N]. SPLIT: y is a zeroed fp32 workspace the splits add into.
    Grouped: program (., p) computes y[p, :] = x[tok[p]] @ W[exp[p]]^T (M = 1).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    WPG: tl.constexpr = 2 if K_BITS < 4 else 4  # plane-0 words per 32-column group
    CPW: tl.constexpr = 32 // WPG  # codes per plane-0 word
    NP: tl.constexpr = CPW // 2  # activation pairs per word
    HAS_H: tl.constexpr = K_BITS == 3 or K_BITS == 5
    WROW = NG * (WPG + HAS_H)  # words per row
    s_base = 0  # element offset of this matrix's scales (kept out of the pointer: the words must stay aligned)
    poison = 0.0
    if GROUPED:
        pid_p = tl.program_id(1)
        tok, e, poison = _grouped_ids(tok_ptr, exp_ptr, pid_p, T, E, err_ptr, pid == 0)
        e = e.to(tl.int64)
        codes_ptr += e * stride_ce
        s_base = e.to(tl.int32) * stride_se
        ts_ptr += e
        x32_ptr += tok.to(tl.int64) * stride_xm
        y_ptr += pid_p.to(tl.int64) * stride_ym
        if HAS_BIAS:
            bias_ptr += e * stride_be
    sw_ptr = scales_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    ts = 1.0
    if LOG8:  # fp16 scales are absolute (docs/format.md): tensor_scale is not applied
        ts = tl.load(ts_ptr)
    g3 = tl.arange(0, G)[None, :, None]
    j = tl.arange(0, WPG)[None, None, :]
    ar = tl.arange(0, BN)
    if USE_ASM:
        tab = _table(tab_ptr, K_BITS)
    acc0 = tl.zeros([BN, G], tl.float32)
    acc1 = tl.zeros([BN, G], tl.float32)
    acc2 = tl.zeros([BN, G], tl.float32)
    acc3 = tl.zeros([BN, G], tl.float32)
    acc4 = tl.zeros([BN, G], tl.float32)
    acc5 = tl.zeros([BN, G], tl.float32)
    acc6 = tl.zeros([BN, G], tl.float32)
    acc7 = tl.zeros([BN, G], tl.float32)
    n_mine = (NT - pid + nprog - 1) // nprog  # tiles of this program
    for t in tl.range(0, n_mine * SPT, num_stages=STAGES):
        u = t // SPT
        st = t - u * SPT
        tile = pid + u * nprog
        if SPLIT:
            rb = tile // SPLITS
            ks = tile - rb * SPLITS
            g_lo = ks * GS
            g_end = tl.minimum(NG, g_lo + GS)
        else:
            rb = tile
            g_lo = 0
            g_end = NG
        rows = rb * BN + ar
        row_ok = rows < N
        rows = tl.where(row_ok, rows, 0)  # clamp: loads stay in bounds without a mask on the row
        r3 = rows[:, None, None].to(tl.int64)
        gg = g_lo + st * G + g3  # [1, G, 1]
        crow = codes_ptr + r3 * WROW
        soff = s_base + rows[:, None, None] * NB + (gg >> gpb_shift)  # [BN, G, 1] scale element offsets
        if EVEN_K:  # no K tail anywhere: no masks
            g_ok = gg >= 0
            w = tl.load(crow + gg * WPG + j)  # [BN, G, WPG]
            s3 = _scale_words(sw_ptr, soff, None, LOG8)  # [BN, G, 1]
        else:
            g_ok = gg < g_end
            w = tl.load(crow + gg * WPG + j, mask=g_ok, other=0)
            s3 = _scale_words(sw_ptr, soff, g_ok, LOG8)
        # a [BN, G, 1] load reduced over its unit axis lands in the accumulator's layout (no conversion);
        # the run-time shift keeps the compiler from vectorizing it along G into another layout
        s = tl.sum(s3, axis=2)  # [BN, G]
        h = w  # unused unless HAS_H
        if HAS_H:
            gh = (gg << gpb_shift) >> gpb_shift  # = gg; opaque, so the load keeps the codes' layout
            if EVEN_K:
                hw = tl.load(crow + NG * WPG + gh)  # [BN, G, 1]
            else:
                hw = tl.load(crow + NG * WPG + gh, mask=g_ok, other=0)
            h = hw >> (j * CPW)
        vals = w
        if USE_ASM:
            vals = _lookup_asm(w, h, tab, K_BITS, LASM, LCONS)
        acc0 = _acc_row(acc0, 0, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc1 = _acc_row(acc1, 1, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc2 = _acc_row(acc2, 2, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc3 = _acc_row(acc3, 3, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc4 = _acc_row(acc4, 4, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc5 = _acc_row(acc5, 5, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc6 = _acc_row(acc6, 6, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        acc7 = _acc_row(acc7, 7, x32_ptr, stride_xm, s, vals, w, h, cb_ptr, gg, j, g_ok, K2,
                        K_BITS, NP, CPW, BF16, USE_ASM, DASM, DCONS, XTAIL, EVEN_K, M, XVEC)
        if st == SPT - 1:  # the tile's last step: write its sums, start the next tile from zero
            bias = 0.0
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rows, mask=row_ok, other=0).to(tl.float32)
                if SPLIT:
                    bias = bias * (ks == 0).to(tl.float32)
            bias = bias + poison  # NaN on a grouped row with an id out of range
            _flush(y_ptr, 0, stride_ym, acc0, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 1, stride_ym, acc1, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 2, stride_ym, acc2, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 3, stride_ym, acc3, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 4, stride_ym, acc4, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 5, stride_ym, acc5, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 6, stride_ym, acc6, ts, bias, rows, row_ok, SPLIT, M)
            _flush(y_ptr, 7, stride_ym, acc7, ts, bias, rows, row_ok, SPLIT, M)
            acc0 = tl.zeros([BN, G], tl.float32)
            acc1 = tl.zeros([BN, G], tl.float32)
            acc2 = tl.zeros([BN, G], tl.float32)
            acc3 = tl.zeros([BN, G], tl.float32)
            acc4 = tl.zeros([BN, G], tl.float32)
            acc5 = tl.zeros([BN, G], tl.float32)
            acc6 = tl.zeros([BN, G], tl.float32)
            acc7 = tl.zeros([BN, G], tl.float32)
