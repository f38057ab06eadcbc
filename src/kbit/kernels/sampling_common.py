"""Triton helpers both passes of the fused sampler share (:mod:`kbit.kernels.sampling_chunks`,
:mod:`kbit.kernels.sampling`): order-preserving float keys, per-row parameters, Philox uniforms, tempered loads."""

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _ordered_key(z):
    """float32 -> int32 key with the same order (for non-NaN input; -0.0 must be canonicalised)."""
    bits = z.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_to_float(k):
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _param(ptr, val, row, PER_ROW: tl.constexpr, DTYPE: tl.constexpr):
    """A per-request parameter: element ``row`` of a tensor, or one scalar for every row."""
    if PER_ROW:
        return tl.load(ptr + row).to(DTYPE)
    else:
        return tl.full([], val, DTYPE)


@triton.jit
def _rng_word(ptr, val, row, MODE: tl.constexpr):
    """MODE 0: a scalar argument; 1: element 0 of a tensor; 2: element ``row`` of a tensor."""
    if MODE == 0:
        return tl.full([], val, tl.int64)
    elif MODE == 1:
        return tl.load(ptr).to(tl.int64)
    else:
        return tl.load(ptr + row).to(tl.int64)


@triton.jit
def _shifted(x, shift):
    """``x - shift`` with the row max ``shift`` (``row_max_kernel``) landing on 0 exactly, also when it is +inf
    (then every other entry is -inf: the support is the +inf entries); a row without a finite or +inf entry
    (shift = -inf) is all NaN here, -inf after the callers' NaN -> -inf. Keeps z = shifted * scale <= 0, so
    huge logits and tiny temperatures cannot overflow to +inf or NaN."""
    d = x - shift
    return tl.where(x == shift, tl.where(shift > NEG_INF, 0.0, d), d)


@triton.jit
def _load_tempered(x_ptr, offs, mask, scale, shift):
    """Tempered, shifted logits ``(x - shift) * scale`` in float32 (see ``_shifted``); -inf where masked, -inf
    or NaN; -0.0 canonicalised to +0.0."""
    x = tl.load(x_ptr + offs, mask=mask, other=NEG_INF).to(tl.float32)
    z = _shifted(x, shift) * scale + 0.0
    fin = z > NEG_INF
    return tl.where(fin, z, NEG_INF), fin


@triton.jit
def _uniform(seed, off, row):
    """One Philox draw per row: counter (row, offset), key seed; a float in [0, 1)."""
    r0, _r1, _r2, _r3 = tl.philox(seed, row.to(tl.uint32), (off & 0xFFFFFFFF).to(tl.uint32),
                                  ((off >> 32) & 0xFFFFFFFF).to(tl.uint32), (row * 0).to(tl.uint32))
    return tl.uint_to_uniform_float(r0)


@triton.jit
def _row_scale(temp):
    """1/T for T > 0 (IEEE division, as torch computes it; at most the largest float32, so that the row max,
    shifted to 0, stays 0 for a subnormal T); 1 for greedy rows (T <= 0)."""
    greedy = temp <= 0.0
    safe = tl.where(greedy, 1.0, temp)
    inv = tl.minimum(tl.math.div_rn(1.0, safe), 3.4028234663852886e38)
    return tl.where(greedy, 1.0, inv), greedy


@triton.jit
def row_max_kernel(x_ptr, stride_x, V, out_ptr, SPAN, NSPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Partial row maxima, grid ``(B, NSPLIT)``: ``out[row, s] = max(x[row, s * SPAN : (s + 1) * SPAN])`` over
    the non-NaN entries (-inf when there is none); ``_row_shift`` combines them into the sampler's shift
    (``_shifted``). Many programs a row: one program reading a whole 150k-entry row is latency-bound."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    start = part * SPAN
    end = tl.minimum(start + SPAN, V)
    m = tl.full([BLOCK], NEG_INF, tl.float32)
    for s in range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < end, other=NEG_INF).to(tl.float32)
        m = tl.maximum(m, tl.where(x == x, x, NEG_INF))
    tl.store(out_ptr + row * NSPLIT + part, tl.max(m, 0))


@triton.jit
def _row_shift(shift_ptr, row, NSPLIT: tl.constexpr):
    """The row max of ``row`` from ``row_max_kernel``'s ``NSPLIT`` partial maxima (one small load)."""
    if NSPLIT == 1:
        return tl.load(shift_ptr + row)
    else:
        return tl.max(tl.load(shift_ptr + row * NSPLIT + tl.arange(0, NSPLIT)), 0)
