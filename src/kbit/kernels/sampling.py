"""Triton kernels for fused top-k / top-p / min-p sampling (launchers: ``kbit.ops.sampling``).

The filtered support of a row is always an upper set ``{i : z_i >= t}`` of the tempered logits
``z``, for one threshold ``t``; the kernels find ``t`` without sorting the vocabulary.

Pass 1, ``chunk_summary_kernel``, grid ``(B, S)``: one small program reads one chunk of a row once
and writes the chunk's max, sum of ``exp(z - max)`` and count of finite values, plus a compact list
of candidates ``{z >= tau}`` (at most ``KC`` of them, in vocabulary order). ``tau`` is the ``need``-th
largest of the chunk's group maxima (so at least ``need`` entries pass), refined by bisection in the
rare chunk where more than ``KC`` pass. ``floor``, the largest value the chunk did not keep,
certifies the list: every entry above ``max(floor)`` of the row is a candidate.

Pass 2, ``select_sample_kernel``, grid ``(B,)``: one program merges a row's candidates, finds the
top-k and top-p thresholds on them by bisection over order-preserving integer keys and, when the final
threshold lies above the certificate, samples by inverse CDF among the candidates with one Philox
uniform per row. Otherwise (wide supports, massive ties) it falls back to a k-ary threshold search
over the whole row (``NPIV`` pivots per pass) and an inverse-CDF scan; with no filter at all it picks
the chunk from the chunk masses and scans only that chunk.

``apply_penalties_kernel`` rewrites, in a float32 copy of the logits, the entries named by a sorted
token history (repetition, presence and frequency penalties).
"""

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
def _load_tempered(x_ptr, offs, mask, scale):
    """Tempered logits in float32; -inf where masked, -inf or NaN; -0.0 canonicalised to +0.0."""
    x = tl.load(x_ptr + offs, mask=mask, other=NEG_INF).to(tl.float32)
    z = x * scale + 0.0
    fin = z > NEG_INF
    return tl.where(fin, z, NEG_INF), fin


@triton.jit
def _row_scale(temp):
    """1/T for T > 0 (IEEE division, as torch computes it); 1 for greedy rows (T <= 0)."""
    greedy = temp <= 0.0
    safe = tl.where(greedy, 1.0, temp)
    return tl.where(greedy, 1.0, tl.math.div_rn(1.0, safe)), greedy


# ----------------------------------------------------------------------------------------- pass 1
@triton.jit
def chunk_summary_kernel(
    x_ptr, stride_x, V,
    temp_ptr, temp_val, topk_ptr, topk_val,
    cand_val_ptr, cand_idx_ptr, stats_ptr, B, S,
    TEMP_PER_ROW: tl.constexpr, TOPK_PER_ROW: tl.constexpr,
    CHUNK: tl.constexpr, KC: tl.constexpr, GROUPS: tl.constexpr, MAX_ITERS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = _param(temp_ptr, temp_val, row, TEMP_PER_ROW, tl.float32)
    top_k = _param(topk_ptr, topk_val, row, TOPK_PER_ROW, tl.int32)
    scale, greedy = _row_scale(temp)
    # entries the chunk should keep: the row's top-k when it fits in half the slots, else half
    need = tl.where((top_k > 0) & (top_k <= KC // 2), top_k, KC // 2)
    need = tl.where(greedy, 1, need)

    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    z, fin = _load_tempered(x_ptr + row.to(tl.int64) * stride_x, offs, offs < V, scale)
    gmax = tl.max(tl.reshape(z, [GROUPS, CHUNK // GROUPS]), 1)
    m = tl.max(gmax, 0)
    s = tl.sum(tl.where(fin, tl.exp(z - m), 0.0), 0)
    n_fin = tl.sum(fin.to(tl.int32), 0)

    # first guess for tau: the need-th largest group max, so that count(z >= tau) >= need
    # (ranked by counting strictly larger maxima: cheaper than a sort network)
    larger = tl.sum((gmax[None, :] > gmax[:, None]).to(tl.int32), 1)
    tau = tl.min(tl.where(larger < need, gmax, POS_INF), 0)
    tau = tl.where(n_fin <= KC, NEG_INF, tau)
    cnt = tl.sum((z >= tau).to(tl.int32), 0)
    # rare: too many entries above the guess; bisect on the value for need <= count <= KC
    lo = tl.where(tau > NEG_INF, tau, -3.4028234663852886e38)
    hi = m
    it = 0
    searching = (n_fin > KC) & (cnt > KC)
    while searching:
        mid = 0.5 * lo + 0.5 * hi
        c_mid = tl.sum((z >= mid).to(tl.int32), 0)
        in_band = (c_mid >= need) & (c_mid <= KC)
        lo = tl.where(c_mid > KC, mid, lo)
        hi = tl.where(c_mid < need, mid, hi)
        tau = tl.where(in_band, mid, hi)
        it += 1
        searching = (~in_band) & (it < MAX_ITERS)

    keep = fin & (z >= tau)
    pos = tl.cumsum(keep.to(tl.int32), 0) - 1
    stored = keep & (pos < KC)
    base = (row.to(tl.int64) * S + chunk) * KC
    tl.store(cand_val_ptr + base + pos, z, mask=stored)
    tl.store(cand_idx_ptr + base + pos, offs, mask=stored)
    n_kept = tl.minimum(tl.sum(keep.to(tl.int32), 0), KC)
    slots = tl.arange(0, KC)
    tl.store(cand_val_ptr + base + slots, tl.full([KC], NEG_INF, tl.float32), mask=slots >= n_kept)
    floor = tl.max(tl.where(fin & (~stored), z, NEG_INF), 0)

    plane = B * S
    at = row * S + chunk
    tl.store(stats_ptr + at, m)
    tl.store(stats_ptr + plane + at, s)
    tl.store(stats_ptr + 2 * plane + at, floor)
    tl.store(stats_ptr + 3 * plane + at, n_fin.to(tl.float32))


# ------------------------------------------------------------------- pass 2: candidate searches
@triton.jit
def _cand_kth_largest(v, keys, fin, k):
    """Value of the k-th largest finite candidate (ties counted); -inf (uncertifiable) when fewer than k."""
    n = tl.sum(fin.to(tl.int32), 0)
    lo = _ordered_key(tl.min(tl.where(fin, v, POS_INF), 0)).to(tl.int64)
    hi = _ordered_key(tl.max(v, 0)).to(tl.int64) + 1
    c_lo = n
    c_hi = 0
    while (hi - lo > 1) & (c_lo != k) & (c_lo - c_hi > 1) & (n >= k):
        mid = lo + (hi - lo) // 2
        cnt = tl.sum((fin & (keys >= mid.to(tl.int32))).to(tl.int32), 0)
        good = cnt >= k
        lo = tl.where(good, mid, lo)
        c_lo = tl.where(good, cnt, c_lo)
        hi = tl.where(good, hi, mid)
        c_hi = tl.where(good, c_hi, cnt)
    kth = tl.min(tl.where(fin & (keys >= lo.to(tl.int32)), v, POS_INF), 0)
    return tl.where(n >= k, kth, NEG_INF)


@triton.jit
def _cand_top_p(v, keys, w, sel, target):
    """Largest candidate value t with sum(w[sel & v >= t]) >= target; -inf when all of sel is short."""
    total = tl.sum(tl.where(sel, w, 0.0), 0)
    lo = _ordered_key(tl.min(tl.where(sel, v, POS_INF), 0)).to(tl.int64)
    hi = _ordered_key(tl.max(tl.where(sel, v, NEG_INF), 0)).to(tl.int64) + 1
    c_lo = tl.sum(sel.to(tl.int32), 0)
    c_hi = 0
    while (hi - lo > 1) & (c_lo - c_hi > 1) & (total >= target):
        mid = lo + (hi - lo) // 2
        ge = sel & (keys >= mid.to(tl.int32))
        mass = tl.sum(tl.where(ge, w, 0.0), 0)
        cnt = tl.sum(ge.to(tl.int32), 0)
        good = mass >= target
        lo = tl.where(good, mid, lo)
        c_lo = tl.where(good, cnt, c_lo)
        hi = tl.where(good, hi, mid)
        c_hi = tl.where(good, c_hi, cnt)
    tp = tl.min(tl.where(sel & (keys >= lo.to(tl.int32)), v, POS_INF), 0)
    return tl.where(total >= target, tp, NEG_INF)


# ----------------------------------------------------------------- pass 2: whole-row fallbacks
@triton.jit
def _row_ge_stats(x_ptr, V, scale, M, piv, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """For each pivot key p: (count, sum of exp(z - M)) over the finite z of the row with key >= p."""
    cnt = tl.zeros([NPIV], tl.float32)
    mass = tl.zeros([NPIV], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z, fin = _load_tempered(x_ptr, offs, offs < V, scale)
        ge = (_ordered_key(z)[:, None] >= piv[None, :]) & fin[:, None]
        cnt += tl.sum(ge.to(tl.float32), 0)
        mass += tl.sum(tl.where(ge, tl.exp(z - M)[:, None], 0.0), 0)
    return cnt, mass


@triton.jit
def _row_mass_ge(x_ptr, V, scale, M, t, BLOCK: tl.constexpr):
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z, fin = _load_tempered(x_ptr, offs, offs < V, scale)
        mass += tl.where(fin & (z >= t), tl.exp(z - M), 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _row_search(x_ptr, V, scale, M, lo, hi, c_lo, mass_lo, target, stop_count, BY_MASS: tl.constexpr,
                BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """Largest key lo with f(lo) >= target, given f(lo) >= target > f(hi), where f is the count
    (BY_MASS=0) or the mass (BY_MASS=1) of the row at or above a key; c_lo and mass_lo are the
    count and mass at lo. Returns (lo, count at lo, mass at lo).

    Each pass over the row tests NPIV pivots, shrinking [lo, hi) by a factor NPIV + 1; it stops
    early once [lo, hi) holds a single entry or the count at lo equals ``stop_count`` (the set
    {key >= lo} is then final).
    """
    j = tl.arange(0, NPIV).to(tl.int64)
    c_hi = 0.0
    while (hi - lo > 1) & (c_lo - c_hi > 1.0) & (c_lo != stop_count):
        piv = lo + ((hi - lo) * (j + 1)) // (NPIV + 1)
        cnt, mass = _row_ge_stats(x_ptr, V, scale, M, piv.to(tl.int32), BLOCK, NPIV)
        if BY_MASS:
            good = mass >= target
        else:
            good = cnt >= target
        new_lo = tl.max(tl.where(good, piv, lo), 0)
        moved = new_lo > lo
        at_lo = good & (piv == new_lo)
        mass_lo = tl.where(moved, tl.max(tl.where(at_lo, mass, 0.0), 0), mass_lo)
        c_lo = tl.where(moved, tl.max(tl.where(at_lo, cnt, 0.0), 0), c_lo)
        c_hi = tl.max(tl.where(good, c_hi, cnt), 0)
        hi = tl.min(tl.where(good, hi, piv), 0)
        lo = new_lo
    return lo, c_lo, mass_lo


@triton.jit
def _row_scan(x_ptr, start, end, scale, M, t, target, BLOCK: tl.constexpr):
    """First index in [start, end) where the running sum of exp(z - M) over z >= t exceeds target."""
    acc = 0.0
    tok = -1
    last = -1
    pos = start
    while (pos < end) & (tok < 0):
        offs = pos + tl.arange(0, BLOCK)
        z, fin = _load_tempered(x_ptr, offs, offs < end, scale)
        w = tl.where(fin & (z >= t), tl.exp(z - M), 0.0)
        cs = acc + tl.cumsum(w, 0)
        first = tl.min(tl.where((cs > target) & (w > 0.0), offs, INT32_MAX), 0)
        tok = tl.where(first < INT32_MAX, first, tok)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs, -1), 0))
        acc += tl.sum(w, 0)
        pos += BLOCK
    return tl.where(tok < 0, last, tok)


# ----------------------------------------------------------------------------------------- pass 2
@triton.jit
def select_sample_kernel(
    x_ptr, stride_x, V,
    cand_val_ptr, cand_idx_ptr, stats_ptr, B, S,
    temp_ptr, temp_val, topk_ptr, topk_val, topp_ptr, topp_val, minp_ptr, minp_val,
    seed_ptr, seed_val, offset_ptr, offset_val,
    tok_ptr, logprob_ptr,
    TEMP_PER_ROW: tl.constexpr, TOPK_PER_ROW: tl.constexpr, TOPP_PER_ROW: tl.constexpr,
    MINP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr, OFFSET_MODE: tl.constexpr,
    CHUNK: tl.constexpr, KC: tl.constexpr, SP: tl.constexpr, NCP: tl.constexpr,
    BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    temp = _param(temp_ptr, temp_val, row, TEMP_PER_ROW, tl.float32)
    top_k = _param(topk_ptr, topk_val, row, TOPK_PER_ROW, tl.int32)
    top_p = _param(topp_ptr, topp_val, row, TOPP_PER_ROW, tl.float32)
    min_p = _param(minp_ptr, minp_val, row, MINP_PER_ROW, tl.float32)
    scale, greedy = _row_scale(temp)

    # one Philox draw per row, counter (row, offset), key seed
    seed = _rng_word(seed_ptr, seed_val, row, SEED_MODE)
    off = _rng_word(offset_ptr, offset_val, row, OFFSET_MODE)
    r0, _r1, _r2, _r3 = tl.philox(seed, row.to(tl.uint32), (off & 0xFFFFFFFF).to(tl.uint32),
                                  ((off >> 32) & 0xFFFFFFFF).to(tl.uint32), (row * 0).to(tl.uint32))
    u = tl.uint_to_uniform_float(r0)

    # merge the chunk summaries
    sl = tl.arange(0, SP)
    smask = sl < S
    plane = B * S
    sat = row * S + sl
    m_c = tl.load(stats_ptr + sat, mask=smask, other=NEG_INF)
    s_c = tl.load(stats_ptr + plane + sat, mask=smask, other=0.0)
    f_c = tl.load(stats_ptr + 2 * plane + sat, mask=smask, other=NEG_INF)
    n_c = tl.load(stats_ptr + 3 * plane + sat, mask=smask, other=0.0)
    M = tl.max(m_c, 0)
    mass_c = tl.where(m_c > NEG_INF, s_c * tl.exp(m_c - M), 0.0)
    Z = tl.sum(mass_c, 0)
    F = tl.max(f_c, 0)
    n_fin = tl.sum(n_c, 0).to(tl.int32)
    zmin = tl.full([], -3.4028234663852886e38, tl.float32)  # lowest finite value: fallback searches start here

    cl = tl.arange(0, NCP)
    cbase = row.to(tl.int64) * S * KC
    v = tl.load(cand_val_ptr + cbase + cl, mask=cl < S * KC, other=NEG_INF)
    idx = tl.load(cand_idx_ptr + cbase + cl, mask=cl < S * KC, other=0)
    fin = v > NEG_INF

    if greedy:
        # the lowest index holding the row max is always a candidate
        tok = tl.min(tl.where(fin & (v == M), idx, INT32_MAX), 0)
        logprob = 0.0
    else:
        keys = _ordered_key(v)
        w = tl.where(fin, tl.exp(v - M), 0.0)
        t_min = tl.where(min_p > 0.0, M + tl.log(min_p), NEG_INF)
        topk_on = (top_k > 0) & (top_k < n_fin)
        topp_on = top_p < 1.0

        # thresholds from the candidates; each is exact when it lies above the certificate F
        t_k = tl.full([], NEG_INF, tl.float32)
        if topk_on:
            t_k = _cand_kth_largest(v, keys, fin, top_k)
        in_k = fin & (v >= t_k)
        W_k = tl.where(topk_on, tl.sum(tl.where(in_k, w, 0.0), 0), Z)
        t_p = tl.full([], NEG_INF, tl.float32)
        if topp_on:
            t_p = _cand_top_p(v, keys, w, in_k, top_p * W_k)
        ok_k = (~topk_on) | (t_k > F)
        ok_p = (~topp_on) | (t_p > F)
        t = tl.maximum(tl.maximum(t_k, t_p), t_min)

        if ok_k & ok_p & (t > F):
            # the whole support is among the candidates (kept in vocabulary order)
            ws = tl.where(fin & (v >= t), w, 0.0)
            W_t = tl.sum(ws, 0)
            cs = tl.cumsum(ws, 0)
            # a parallel scan may round up across a zero weight: only land on kept entries
            pick = tl.min(tl.where((cs > u * W_t) & (ws > 0.0), cl, NCP), 0)
            pick = tl.where(pick < NCP, pick, tl.max(tl.where(ws > 0.0, cl, 0), 0))
            tok = tl.sum(tl.where(cl == pick, idx, 0), 0)
            z_tok = tl.sum(tl.where(cl == pick, v, 0.0), 0)
            logprob = z_tok - M - tl.log(W_t)
        else:
            # whole-row passes for whatever the candidates could not certify
            hi0 = _ordered_key(M).to(tl.int64) + 1
            c_k = tl.where(topk_on, tl.sum(in_k.to(tl.float32), 0), n_fin.to(tl.float32))
            if topk_on & (~ok_k):
                lo_k, c_k, W_k = _row_search(x_row, V, scale, M, _ordered_key(zmin).to(tl.int64), hi0,
                                             n_fin.to(tl.float32), Z, top_k.to(tl.float32),
                                             top_k.to(tl.float32), 0, BLOCK, NPIV)
                t_k = _key_to_float(lo_k.to(tl.int32))
            W_p = W_k
            if topp_on:
                lo_p0 = _ordered_key(tl.maximum(t_k, zmin)).to(tl.int64)
                lo_p, _c_p, W_p = _row_search(x_row, V, scale, M, lo_p0, hi0, c_k, W_k, top_p * W_k,
                                              -1.0, 1, BLOCK, NPIV)
                t_p = _key_to_float(lo_p.to(tl.int32))
            t = tl.maximum(tl.maximum(t_k, t_p), t_min)
            if t == NEG_INF:
                # no filter: choose the chunk by its mass, then scan that chunk alone
                cum = tl.cumsum(mass_c, 0)
                c_pick = tl.min(tl.where((cum > u * Z) & (mass_c > 0.0), sl, SP), 0)
                c_pick = tl.where(c_pick < SP, c_pick, tl.max(tl.where(mass_c > 0.0, sl, 0), 0))
                before = tl.sum(tl.where(sl < c_pick, mass_c, 0.0), 0)
                start = c_pick * CHUNK
                tok = _row_scan(x_row, start, tl.minimum(start + CHUNK, V), scale, M, t,
                                u * Z - before, BLOCK)
                W_t = Z
            else:
                if t == t_p:
                    W_t = W_p
                elif t == t_k:
                    W_t = W_k
                else:
                    W_t = _row_mass_ge(x_row, V, scale, M, t, BLOCK)
                tok = _row_scan(x_row, 0, V, scale, M, t, u * W_t, BLOCK)
            tok = tl.minimum(tl.maximum(tok, 0), V - 1)
            z_tok = tl.load(x_row + tok).to(tl.float32) * scale
            logprob = z_tok - M - tl.log(W_t)

    tok = tl.minimum(tl.maximum(tok, 0), V - 1)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)


# ---------------------------------------------------------------------------------- penalties
@triton.jit
def apply_penalties_kernel(
    out_ptr, stride_o, V, hist_ptr, stride_h, L, search_steps,
    rep_ptr, rep_val, pres_ptr, pres_val, freq_ptr, freq_val,
    REP_PER_ROW: tl.constexpr, PRES_PER_ROW: tl.constexpr, FREQ_PER_ROW: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Penalise, in place in a float32 copy, each distinct valid token of a row's sorted history."""
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    h_row = hist_ptr + row.to(tl.int64) * stride_h
    in_l = j < L
    h = tl.load(h_row + j, mask=in_l, other=-1).to(tl.int64)
    prev = tl.load(h_row + j - 1, mask=in_l & (j > 0), other=-1).to(tl.int64)
    first = in_l & (h >= 0) & (h < V) & (prev != h)
    # occurrences of h = (first index past h) - j, by binary search in the sorted row
    lo = j
    hi = tl.zeros_like(j) + L
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        s_mid = tl.load(h_row + mid, mask=first & (mid < hi), other=-1).to(tl.int64)
        right = (mid < hi) & (s_mid <= h)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right | (mid >= hi), hi, mid)
    count = (lo - j).to(tl.float32)
    rep = _param(rep_ptr, rep_val, row, REP_PER_ROW, tl.float32)
    pres = _param(pres_ptr, pres_val, row, PRES_PER_ROW, tl.float32)
    freq = _param(freq_ptr, freq_val, row, FREQ_PER_ROW, tl.float32)
    ptrs = out_ptr + row.to(tl.int64) * stride_o + h
    x = tl.load(ptrs, mask=first, other=0.0)
    x = tl.where(x > 0.0, tl.math.div_rn(x, tl.zeros_like(x) + rep), x * rep)
    x = x - pres - freq * count
    tl.store(ptrs, x, mask=first)
