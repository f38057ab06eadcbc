"""Pass 1 of the fused sampler, ``chunk_summary_kernel``: per-chunk maxima, certificates and candidate vectors
(the two passes are described in :mod:`kbit.kernels.sampling`; launcher: :mod:`kbit.ops.sampling`)."""

import triton
import triton.language as tl

from kbit.kernels.sampling_common import INT32_MAX, NEG_INF, POS_INF, _param, _row_scale, _row_shift, _shifted


@triton.jit
def _refine_tau(x1, fin1, tau, m, need, KC: tl.constexpr, MAX_ITERS: tl.constexpr):
    """Rare: bisect the value tau upward until need <= count(x >= tau) <= KC (or give up at hi)."""
    lo = tl.where(tau > NEG_INF, tau, -3.4028234663852886e38)
    hi = m
    it = 0
    searching = True
    while searching:
        mid = 0.5 * lo + 0.5 * hi
        c_mid = tl.sum((fin1 & (x1 >= mid)).to(tl.int32), 0)
        in_band = (c_mid >= need) & (c_mid <= KC)
        lo = tl.where(c_mid > KC, mid, lo)
        hi = tl.where(c_mid < need, mid, hi)
        tau = tl.where(in_band, mid, hi)
        it += 1
        searching = (~in_band) & (it < MAX_ITERS)
    return tau


@triton.jit
def _load_tile(x_row, start, V, shift, CHUNK: tl.constexpr, G: tl.constexpr, T: tl.constexpr):
    """The chunk at ``start`` as a [G, T/4, 4] tile of logits shifted by the row max (``_shifted``; NaN ->
    -inf), whether every entry
    is finite (padding does not count), and the base index of each thread's 16-byte vector.

    Interior chunks: vector [g, v] is entries start + g * T + 4 v. The row's tail chunk deals its
    vectors round-robin to the G tile rows (vector v * G + g), so that each tile row holds about 1/G of
    the valid entries and the bound keeps its strength (it used to take the general branch, whose
    certificate was the tail's max: ~15% of N(0, 1) rows then fell back to the whole-row search)."""
    g_i = tl.arange(0, G)[:, None]
    v_i = tl.arange(0, T // 4)[None, :]
    tail = start + CHUNK > V
    vb = start + tl.where(tail, (v_i * G + g_i) * 4, g_i * T + v_i * 4)
    offs = vb[:, :, None] + tl.arange(0, 4)[None, None, :]
    if start + CHUNK <= V:
        x = _shifted(tl.load(x_row + offs).to(tl.float32), shift)
        x = tl.where(x == x, x, NEG_INF)  # NaN -> -inf
        all_fin = tl.min(tl.min(tl.min(x, 2), 0), 0) > NEG_INF
    else:
        x = _shifted(tl.load(x_row + offs, mask=offs < V, other=NEG_INF).to(tl.float32), shift)
        x = tl.where(x == x, x, NEG_INF)
        all_fin = tl.min(tl.min(tl.min(tl.where(offs < V, x, POS_INF), 2), 0), 0) > NEG_INF
    return x, all_fin, vb


@triton.jit
def _chunk_stats(x, scale, need_mass, G: tl.constexpr):
    """Vector maxima, tile-row maxima, chunk max m, the largest tile-row max other than m's (m2), the
    bound tau (least max over tile rows holding a finite entry) and, when asked, sum exp(z - max z)."""
    vmax = tl.max(x, 2)
    gmax = tl.max(vmax, 1)
    m = tl.max(gmax, 0)
    g_ar = tl.arange(0, G)
    g_top = tl.min(tl.where(gmax == m, g_ar, G), 0)
    m2 = tl.max(tl.where(g_ar == g_top, NEG_INF, gmax), 0)
    tau = tl.min(tl.where(gmax > NEG_INF, gmax, POS_INF), 0)
    s = 0.0
    if need_mass:
        # relative to the chunk max, scaled before log2(e): x * c - m * c would be -inf - -inf for a tiny T,
        # and scale * log2(e) overflows for a subnormal one
        mc = tl.where(m > NEG_INF, m, 0.0)
        s = tl.sum(tl.sum(tl.sum(tl.exp2(((x - mc) * scale) * 1.4426950408889634), 2), 0), 0)
    return vmax, gmax, m, m2, tau, s


@triton.jit
def _store_stats(stats_ptr, at, plane, m, s, cert, n_fin, n_vec, m2, scale):
    tl.store(stats_ptr + at, m * scale + 0.0)
    tl.store(stats_ptr + plane + at, s)
    tl.store(stats_ptr + 2 * plane + at, cert * scale + 0.0)
    tl.store(stats_ptr + 3 * plane + at, n_fin.to(tl.float32))
    tl.store(stats_ptr + 4 * plane + at, n_vec.to(tl.float32))
    tl.store(stats_ptr + 5 * plane + at, m2 * scale + 0.0)


@triton.jit(noinline=True)
def _chunk_general(x_ptr, stride_x, V, row, chunk, scale, shift, need_mass, cand_idx_ptr, cand_val_ptr, stats_ptr, B, S,
                   CHUNK: tl.constexpr, KC: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
                   MAX_ITERS: tl.constexpr):
    """Pass 1's general branch (rare: -inf or NaN entries, more than KC vectors at both bounds, massive
    ties), in vocabulary order (tile order in the tail): re-reads the chunk (a separate function, so
    its registers do not count against the common path's occupancy). Bisects tau into
    [min(G, KC/2), KC] entries; keeps the first KC vectors; certificate = max when ties overflow (the
    row then falls back), and slot 0 holds the vector of the lowest index holding the max (greedy)."""
    start = chunk * CHUNK
    x_row = x_ptr + row.to(tl.int64) * stride_x
    x, _all_fin, vb = _load_tile(x_row, start, V, shift, CHUNK, G, T)
    vmax, _gmax, m, m2, tau, s = _chunk_stats(x, scale, need_mass, G)
    x1 = tl.reshape(x, [CHUNK])
    fin1 = x1 > NEG_INF
    n_fin = tl.sum(fin1.to(tl.int32), 0)
    tau = tl.where(n_fin <= KC, NEG_INF, tau)
    n_keep = tl.sum((fin1 & (x1 >= tau)).to(tl.int32), 0)
    if n_keep > KC:
        # tau is finite here (n_fin > KC); the bisection runs between it and the max
        tau = _refine_tau(x1, fin1, tau, m, tl.minimum(G, KC // 2), KC, MAX_ITERS)
    keep1 = fin1 & (x1 >= tau)
    n_keep = tl.sum(keep1.to(tl.int32), 0)
    kv1 = tl.max(tl.reshape(keep1.to(tl.int32), [CHUNK // 4, 4]), 1)
    pos1 = tl.cumsum(kv1, 0) - 1
    vb1 = tl.reshape(vb, [CHUNK // 4])
    base = (row.to(tl.int64) * S + chunk) * KC
    put1 = (kv1 > 0) & (pos1 < KC)
    tl.store(cand_idx_ptr + base + pos1, vb1, mask=put1)
    tl.store(cand_val_ptr + base + pos1, tl.reshape(vmax, [CHUNK // 4]) * scale + 0.0, mask=put1)
    n_vec = tl.sum(kv1, 0)
    kk = tl.arange(0, KC)
    tl.store(cand_val_ptr + base + kk, tl.full([KC], NEG_INF, tl.float32), mask=kk >= n_vec)
    if n_vec > KC:
        # ties beyond KC (this chunk then certifies nothing, so none of its entries survive in
        # pass 2): slot 0 holds the vector of the lowest index holding the max, for greedy rows
        idx1 = tl.reshape(vb[:, :, None] + tl.arange(0, 4)[None, None, :], [CHUNK])
        i_max = tl.min(tl.where(x1 == m, idx1, INT32_MAX), 0)
        tl.debug_barrier()
        tl.store(cand_idx_ptr + base, i_max - i_max % 4)
        tl.store(cand_val_ptr + base, m * scale + 0.0)
    # every finite entry not stored is <= cert (-inf: all stored; ties beyond KC: certify nothing)
    cert = tl.where(n_vec > KC, m, tl.where(n_keep == n_fin, NEG_INF, tau))
    n_vec = tl.minimum(n_vec, KC)
    _store_stats(stats_ptr, row * S + chunk, B * S, m, s, cert, n_fin, n_vec, m2, scale)


@triton.jit
def chunk_summary_kernel(
    x_ptr, stride_x, V, shift_ptr,
    temp_ptr, temp_val, topk_ptr, topk_val,
    cand_idx_ptr, cand_val_ptr, stats_ptr, B, S,
    TEMP_PER_ROW: tl.constexpr, TOPK_PER_ROW: tl.constexpr,
    CHUNK: tl.constexpr, KC: tl.constexpr, G: tl.constexpr, T: tl.constexpr, MAX_ITERS: tl.constexpr,
    NSPLIT: tl.constexpr = 1,
):
    """One chunk of one row, as a [G, T/4, 4] tile of logits x shifted by the row max (one read;
    each [g, v, :] is one 16-byte load of one thread).

    Works on x, not z = x * scale: scale > 0 and rounding is monotone, so every order statistic
    maps through z = fl(x * scale). The candidate bound is ``tau = min over tile rows of the row
    max``, so at least G entries pass, and a chunk can only fail to certify a row threshold when
    every one of its G rows holds an entry above it. Common path: all x finite and at most KC
    vectors holding an entry >= tau; anything else calls ``_chunk_general`` (not inlined).

    Outputs per chunk: KC candidate slots, each the base index of a vector and its tempered max (unused
    slots: -inf), and 6 stats planes: max, mass (top-k off rows only), certificate, finite count,
    vectors, m2.
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = _param(temp_ptr, temp_val, row, TEMP_PER_ROW, tl.float32)
    top_k = _param(topk_ptr, topk_val, row, TOPK_PER_ROW, tl.int32)
    scale, greedy = _row_scale(temp)
    need_mass = (top_k <= 0) & (~greedy)  # pass 2 needs the row mass only for rows with top-k off

    start = chunk * CHUNK
    x_row = x_ptr + row.to(tl.int64) * stride_x
    shift = _row_shift(shift_ptr, row, NSPLIT)  # NSPLIT partial maxima of row_max_kernel
    x, all_fin, vb = _load_tile(x_row, start, V, shift, CHUNK, G, T)
    vmax, gmax, m, m2, tau, s = _chunk_stats(x, scale, need_mass, G)

    # candidates are stored as 16-byte vectors (base index of 4 entries) holding an entry >= tau:
    # the slot arithmetic and the scatter run on a quarter of the entries
    kv = (vmax >= tau).to(tl.int32)
    col = tl.sum(kv, 0)
    n_vec = tl.sum(col, 0)
    if all_fin & (n_vec > KC):
        # ~9% of N(0, 1) chunks: the second-least row max (at least G - 1 entries pass) leaves ~0.2%
        tau2 = tl.min(tl.where(gmax > tau, gmax, POS_INF), 0)
        if tau2 < POS_INF:
            tau = tau2
            kv = (vmax >= tau).to(tl.int32)
            col = tl.sum(kv, 0)
            n_vec = tl.sum(col, 0)
    if all_fin & (n_vec <= KC):
        base = (row.to(tl.int64) * S + chunk) * KC
        # slots: exclusive prefix over the columns, then a running count down each column
        pos = (tl.cumsum(col, 0) - col)[None, :] + tl.cumsum(kv, 0) - 1
        slot = tl.where(kv > 0, pos, -1)
        tl.store(cand_idx_ptr + base + slot, vb, mask=slot >= 0)
        tl.store(cand_val_ptr + base + slot, vmax * scale + 0.0, mask=slot >= 0)
        kk = tl.arange(0, KC)
        tl.store(cand_val_ptr + base + kk, tl.full([KC], NEG_INF, tl.float32), mask=kk >= n_vec)
        _store_stats(stats_ptr, row * S + chunk, B * S, m, s, tau, tl.minimum(V - start, CHUNK), n_vec, m2,
                     scale)
    else:
        _chunk_general(x_ptr, stride_x, V, row, chunk, scale, shift, need_mass, cand_idx_ptr, cand_val_ptr, stats_ptr,
                       B, S, CHUNK, KC, G, T, MAX_ITERS)
