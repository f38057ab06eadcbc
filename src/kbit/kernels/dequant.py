"""Dequantization of the canonical k-bit layout (docs/format.md) to float tiles, and the kernel that writes
the whole float weight.

Only @triton.jit code lives here; launchers are in ``kbit.ops.dequant``. The tile helpers (``decode_codes``,
``block_scales``) are shared with ``kbit.kernels.gemm``.

Code expansion stays in registers: a tile of packed words ``[R, C]`` is broadcast against the per-word bit
offsets to ``[R, C, codes per word]`` and reshaped to ``[R, C * codes per word]``; the last axis is held by
one thread, so the reshape is free (no shared memory, no gather). Codebook values and log8 scale factors are
read from tiny float32 tables (``tl.load`` gathers that hit L1).
"""

import triton
import triton.language as tl


@triton.jit
def _plane(codes_ptr, row_off, row_ok, w0, NW: tl.constexpr, WIDTH: tl.constexpr, plane_words):
    """Codes of one bit plane for ``NW`` consecutive words starting at word ``w0`` of the plane:
    int32 ``[R, NW * 32 / WIDTH]`` (words past the plane's end read as 0)."""
    CPW: tl.constexpr = 32 // WIDTH
    wi = w0 + tl.arange(0, NW)
    ok = row_ok[:, None] & (wi < plane_words)[None, :]
    w = tl.load(codes_ptr + row_off[:, None] + wi[None, :], mask=ok, other=0)
    shifts = tl.arange(0, CPW) * WIDTH
    c = (w[:, :, None] >> shifts[None, None, :]) & ((1 << WIDTH) - 1)
    return tl.reshape(c, [w.shape[0], NW * CPW])


@triton.jit
def decode_codes(codes_ptr, row_off, row_ok, c0, KP, BK: tl.constexpr, K_BITS: tl.constexpr):
    """Codes of columns ``c0 .. c0 + BK`` (c0 a multiple of 32) of rows at word offsets ``row_off`` [R]:
    int32 ``[R, BK]``. ``KP``: padded row length (columns), so plane 0 has ``KP * b0 / 32`` words."""
    if K_BITS == 2:
        c = _plane(codes_ptr, row_off, row_ok, c0 // 16, BK // 16, 2, KP // 16)
    elif K_BITS == 3:
        lo = _plane(codes_ptr, row_off, row_ok, c0 // 16, BK // 16, 2, KP // 16)
        hi = _plane(codes_ptr + KP // 16, row_off, row_ok, c0 // 32, BK // 32, 1, KP // 32)
        c = lo | (hi << 2)
    elif K_BITS == 4:
        c = _plane(codes_ptr, row_off, row_ok, c0 // 8, BK // 8, 4, KP // 8)
    else:
        lo = _plane(codes_ptr, row_off, row_ok, c0 // 8, BK // 8, 4, KP // 8)
        hi = _plane(codes_ptr + KP // 8, row_off, row_ok, c0 // 32, BK // 32, 1, KP // 32)
        c = lo | (hi << 4)
    return c


@triton.jit
def block_scales(scales_ptr, e_ptr, srow_off, row_ok, c0, NB, BK: tl.constexpr, BLOCKSIZE: tl.constexpr,
                 LOG8: tl.constexpr):
    """float32 scale of every column ``c0 .. c0 + BK`` of the rows: ``[R, BK]``. log8: ``E[q]`` (the tensor
    scale is not applied); fp16: the stored scale."""
    if BLOCKSIZE <= BK:
        NBT: tl.constexpr = BK // BLOCKSIZE
        bi = c0 // BLOCKSIZE + tl.arange(0, NBT)
        ok = row_ok[:, None] & (bi < NB)[None, :]
        q = tl.load(scales_ptr + srow_off[:, None] + bi[None, :], mask=ok, other=0)
        if LOG8:
            s = tl.load(e_ptr + q.to(tl.int32))
        else:
            s = q.to(tl.float32)
        s = tl.broadcast_to(s[:, :, None], [s.shape[0], NBT, BLOCKSIZE])
        s = tl.reshape(s, [s.shape[0], BK])
    else:  # one block covers the whole tile
        q = tl.load(scales_ptr + srow_off + c0 // BLOCKSIZE, mask=row_ok, other=0)
        if LOG8:
            s = tl.load(e_ptr + q.to(tl.int32))
        else:
            s = q.to(tl.float32)
        s = tl.broadcast_to(s[:, None], [s.shape[0], BK])
    return s


@triton.jit
def dequant_kernel(
    codes_ptr, scales_ptr, ts_ptr, cb_ptr, e_ptr, out_ptr,
    R, N, K, KP, WROW, NB,
    stride_or, stride_ok, stride_om,  # out strides: per row n, per column, per matrix
    K_BITS: tl.constexpr, BLOCKSIZE: tl.constexpr, LOG8: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr,
):
    """out[m, n, i] = codebook[code] * (tensor_scale[m] * E[q]) (log8) or codebook[code] * scale (fp16),
    computed in float32 in the reference's order and cast to out's dtype.

    Rows r = m * N + n of all matrices are flattened; grid (cdiv(R, BR), cdiv(KP, BK)). The strides place the
    result: [.., N, K] (stride_or = K, stride_ok = 1) or transposed [.., K, N] (1, N).
    """
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    c0 = pid_k * BK
    codes = decode_codes(codes_ptr, rows64 * WROW, row_ok, c0, KP, BK, K_BITS)
    s = block_scales(scales_ptr, e_ptr, rows64 * NB, row_ok, c0, NB, BK, BLOCKSIZE, LOG8)
    if LOG8:
        ts = tl.load(ts_ptr + rows // N, mask=row_ok, other=0.0)
        s = ts[:, None] * s
    v = tl.load(cb_ptr + codes) * s
    cols = c0 + tl.arange(0, BK)
    m = rows64 // N
    n = rows64 - m * N
    off = m[:, None] * stride_om + n[:, None] * stride_or + cols[None, :].to(tl.int64) * stride_ok
    tl.store(out_ptr + off, v.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < K)[None, :])
