"""Triton kernel: quantize float rows to kbit format version 1 (scales, nearest codes, bit-plane packing).

Bit-exact with kbit.format.reference.quantize_reference: the same float32 operations (IEEE division,
comparisons against the same tables) in the same order.
"""

import triton
import triton.language as tl


@triton.jit
def _pack_plane(codes, WIDTH: tl.constexpr, SHIFT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_R, BLOCK_K] codes -> [BLOCK_R, BLOCK_K * WIDTH / 32] words holding bits SHIFT.. of each code."""
    PER_WORD: tl.constexpr = 32 // WIDTH
    bits = ((codes >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.uint32)
    bits = tl.reshape(bits, (BLOCK_R, BLOCK_K // PER_WORD, PER_WORD))
    offsets = (tl.arange(0, PER_WORD) * WIDTH).to(tl.uint32)
    return tl.sum(bits << offsets[None, None, :], axis=2)


@triton.jit
def _store_plane(words_ptr, words, rows, row_ok, word_start, WORDS_PER_ROW, BLOCK_R: tl.constexpr,
                 NW: tl.constexpr):
    cols = word_start + tl.arange(0, NW)
    ptrs = words_ptr + rows[:, None].to(tl.int64) * WORDS_PER_ROW + cols[None, :]
    tl.store(ptrs, words.to(tl.int32, bitcast=True), mask=row_ok[:, None])


@triton.jit
def quantize_kernel(
    w_ptr, codes_ptr, scales_ptr, tensor_scale_ptr, thresholds_ptr, log8_ptr, mid_ptr,
    R, N, K, KP, stride_wr,
    K_BITS: tl.constexpr, BLOCKSIZE: tl.constexpr, LOG8: tl.constexpr,
    W0: tl.constexpr, W1: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program quantizes rows [BLOCK_R] x columns [BLOCK_K] (whole blocks) of W viewed as [R, K].

    W0, W1: widths of the two bit planes (W1 = 0 when k has one plane). Row r belongs to matrix r // N.
    """
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wr + cols[None, :]
    w = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)

    NB: tl.constexpr = BLOCK_K // BLOCKSIZE
    wb = tl.reshape(w, (BLOCK_R, NB, BLOCKSIZE))
    absmax = tl.max(tl.abs(wb), axis=2)  # [BLOCK_R, NB]
    ts = tl.load(tensor_scale_ptr + rows // N, mask=row_ok, other=1.0)
    if LOG8:
        safe_ts = tl.where(ts > 0, ts, 1.0)
        r = tl.math.div_rn(absmax, safe_ts[:, None])
        q = tl.zeros((BLOCK_R, NB), dtype=tl.int32)
        for j in range(254):
            q += (r < tl.load(thresholds_ptr + j)).to(tl.int32)
        q = tl.where(absmax > 0, q, 255)
        scale = ts[:, None] * tl.load(log8_ptr + q)
        stored = q.to(tl.uint8)
    else:
        # fp16 scales: keep the block axis in the tile's 3-D layout (a [BLOCK_R, NB] scale reshaped back to 3-D
        # made the compiler replicate the whole tile in every thread: 30-260k PTX lines, minutes of ptxas)
        stored3 = tl.max(tl.abs(wb), axis=2, keep_dims=True).to(tl.float16)
        scale3 = stored3.to(tl.float32)
        stored = tl.reshape(stored3, (BLOCK_R, NB))
    s_rows = rows[:, None].to(tl.int64) * (KP // BLOCKSIZE) + pid_k * NB + tl.arange(0, NB)[None, :]
    tl.store(scales_ptr + s_rows, stored, mask=row_ok[:, None])

    if LOG8:
        s3 = tl.reshape(scale, (BLOCK_R, NB, 1))
    else:
        s3 = scale3
    x = tl.where(s3 > 0, tl.math.div_rn(wb, tl.where(s3 > 0, s3, 1.0)), 0.0)
    x = tl.reshape(x, (BLOCK_R, BLOCK_K))
    codes = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range((1 << K_BITS) - 1):
        codes += (x > tl.load(mid_ptr + j)).to(tl.int32)

    WORDS_PER_ROW = KP * K_BITS // 32
    words0 = _pack_plane(codes, W0, 0, BLOCK_R, BLOCK_K)
    _store_plane(codes_ptr, words0, rows, row_ok, pid_k * (BLOCK_K * W0 // 32), WORDS_PER_ROW, BLOCK_R,
                 BLOCK_K * W0 // 32)
    if W1 > 0:
        words1 = _pack_plane(codes, W1, W0, BLOCK_R, BLOCK_K)
        _store_plane(codes_ptr, words1, rows, row_ok, KP * W0 // 32 + pid_k * (BLOCK_K * W1 // 32),
                     WORDS_PER_ROW, BLOCK_R, BLOCK_K * W1 // 32)
