"""Tensor-core GEMM on k-bit weights: ``y = x @ W.T`` with W decoded tile by tile in registers.

Only @triton.jit code; the launcher is ``kbit.ops.gemm``. A program owns ``BM`` activation rows x ``BN``
weight rows and walks its K range in ``BK`` steps (``tl.range`` pipelines the loads ``num_stages`` deep).
Each step loads the step's packed codes and block scales once, decodes them (``kbit.kernels.dequant``
helpers: codes expanded in registers, codebook and log8 factors from L1-resident tables), multiplies in
float32, casts to x's dtype and feeds ``tl.dot`` (wgmma on Hopper, mma on Ampere/Ada), accumulating in fp32.

``SWAP`` (small M): the product is computed transposed, ``acc[BN, BM] = W_tile @ x_tile.T``, so the weight
rows fill the MMA's 64/128-row side and a 16-row activation tile only its narrow side.
``SPLIT_K`` > 1: the grid's second axis splits K; partial sums are added atomically into a zeroed fp32
workspace (the launcher casts it back).
"""

import triton
import triton.language as tl

from kbit.kernels.dequant import block_scales, decode_codes


@triton.jit
def gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, ts_ptr, cb_ptr, e_ptr, bias_ptr, y_ptr,
    M, N, K, KP, WROW, NB, K_PER_SPLIT,
    stride_xm, stride_ym,
    K_BITS: tl.constexpr, BLOCKSIZE: tl.constexpr, LOG8: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """y[m, n] = tensor_scale * sum_i x[m, i] * (codebook[code[n, i]] * scale[n, i // B]) (+ bias[n]).

    Grid (cdiv(M, BM) * cdiv(N, BN), SPLIT_K); program ids along axis 0 are grouped GROUP_M row tiles at a
    time so that neighbouring programs share weight tiles in L2.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    crow = rn64 * WROW
    srow = rn64 * NB
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm

    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(KP, k_lo + K_PER_SPLIT)
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for c0 in tl.range(k_lo, k_hi, BK, num_stages=NUM_STAGES):
        cols = c0 + tl.arange(0, BK)
        if EVEN_K:
            xt = tl.load(x_rows + cols[None, :], mask=m_ok[:, None], other=0.0)
        else:
            xt = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)
        codes = decode_codes(codes_ptr, crow, n_ok, c0, KP, BK, K_BITS)
        s = block_scales(scales_ptr, e_ptr, srow, n_ok, c0, NB, BK, BLOCKSIZE, LOG8)
        # the table holds the codebook in x's dtype: 2-byte gathers stay plain L1 loads (the pipeliner would
        # turn 4-byte ones into one cp.async + one shared load per weight)
        w = tl.load(cb_ptr + codes) * s.to(xt.dtype)  # [BN, BK]
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)

    if LOG8:  # fp16 scales are absolute (docs/format.md): no tensor scale
        acc = acc * tl.load(ts_ptr)
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if SPLIT:
            b = b * (pid_k == 0).to(tl.float32)
        acc = acc + b[None, :]
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.atomic_add(y_ptr + y_off, acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)
