"""Triton kernels for fused top-k / top-p / min-p sampling (launchers: ``kbit.ops.sampling``): pass 2 and the
penalties here, pass 1 in :mod:`kbit.kernels.sampling_chunks`, shared helpers in :mod:`kbit.kernels.sampling_common`.

The filtered support of a row is always an upper set ``{i : z_i >= t}`` of the tempered logits
``z``, for one threshold ``t``; the kernels find ``t`` without sorting the vocabulary.

Pass 1, ``chunk_summary_kernel``, grid ``(B, S)``: one small program reads one chunk of a row once,
as a [G, T/4, 4] tile of raw logits (z = fl(x / T) is monotone in x, so order statistics are taken
on x), and writes the chunk's max, its certificate and its candidates: the base indices of the
16-byte vectors that hold an entry ``x >= tau``, ``tau`` = the least of the G tile-row maxima (so at
least G entries pass; at most ``KC`` vectors, else ``_chunk_general``, a separate function so that
its registers do not cap the common path's occupancy, refines ``tau`` by bisection). Every entry of
the chunk not in a stored vector is ``< tau``: the certificate. The sum of ``exp(z - max)`` is only
computed for rows whose top-k is off (pass 2 needs the mass only there).

Pass 2, ``select_sample_kernel``, grid ``(B,)``, one program a row. Fast path (top-k and greedy
rows): a lower bound ``L`` of the top-k threshold from the chunks' two largest tile-row maxima; the
entries ``>= L`` and above ``F`` (the largest chunk certificate: every entry above ``F`` is a
candidate), ~k of them, are gathered, packed into scratch and ranked all-pairs; exact whenever the
top-k threshold lies above ``F``, then one Philox uniform per row picks the token by inverse CDF.
Everything else calls ``_select_fallback`` (not inlined): all candidate entries above ``F`` packed
into ``P`` scratch slots, thresholds by bisection over order-preserving integer keys, and when they
are not certified a k-ary threshold search over the whole row (``NPIV`` pivots per pass) and an
inverse-CDF scan; with no filter at all it picks the chunk from the chunk masses and scans only that
chunk.

``apply_penalties_kernel`` rewrites, in a float32 copy of the logits, the entries named by a sorted
token history (repetition, presence and frequency penalties).
"""

import triton
import triton.language as tl

from kbit.kernels.sampling_common import (
    INT32_MAX,
    NEG_INF,
    POS_INF,
    _key_to_float,
    _load_tempered,
    _ordered_key,
    _param,
    _rng_word,
    _row_scale,
    _row_shift,
    _shifted,
    _uniform,
)


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


@triton.jit
def _kth_lower_bound(a, k, F):
    """L = max(F, the k-th largest of the values a, ties counted; -inf when fewer than k are finite).

    a holds the chunks' two largest tile-row maxima (m_c, m2_c), values at distinct positions of the
    row, so at least k row entries are >= the k-th largest of them: L <= t_k whenever t_k > F (and
    pass 2 drops everything at or below F anyway). One all-pairs count, no search."""
    ge = a[:, None] >= a[None, :]  # [j, i]: the reduction over j stays mostly within each thread
    c = tl.sum(ge.to(tl.int32), 0)
    kth = tl.max(tl.where((c >= k) & (a > NEG_INF), a, NEG_INF), 0)
    return tl.maximum(kth, F)


# Several reductions in one pass (one shared-memory round instead of one each) when FUSED; the
# interpreter runs a custom combine function once per element in Python (~0.1 s per 128 elements and
# program), so under TRITON_INTERPRET the launcher passes FUSED=False: the same results from built-in
# reductions (sums may round differently).
@triton.jit
def _merge_stats(m0, f0, n0, m1, f1, n1):
    return tl.maximum(m0, m1), tl.maximum(f0, f1), n0 + n1


@triton.jit
def _sum2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _lexmax(v0, c0, v1, c1):
    c = tl.where(v0 > v1, c0, tl.where(v1 > v0, c1, tl.maximum(c0, c1)))
    return tl.maximum(v0, v1), c


@triton.jit
def _argmin_key(k0, i0, v0, k1, i1, v1):
    first = (k0 < k1) | ((k0 == k1) & (i0 <= i1))
    return tl.where(first, k0, k1), tl.where(first, i0, i1), tl.where(first, v0, v1)


@triton.jit
def _max_max_sum(a, b, c, FUSED: tl.constexpr):
    """(max a, max b, sum c) over axis 0."""
    if FUSED:
        ra, rb, rc = tl.reduce((a, b, c), 0, _merge_stats)
    else:
        ra = tl.max(a, 0)
        rb = tl.max(b, 0)
        rc = tl.sum(c, 0)
    return ra, rb, rc


@triton.jit
def _sum_sum(a, b, axis: tl.constexpr, FUSED: tl.constexpr):
    if FUSED:
        ra, rb = tl.reduce((a, b), axis, _sum2)
    else:
        ra = tl.sum(a, axis)
        rb = tl.sum(b, axis)
    return ra, rb


@triton.jit
def _max_then_max(v, c, FUSED: tl.constexpr):
    """The largest v, and the largest c among the entries holding it."""
    if FUSED:
        rv, rc = tl.reduce((v, c), 0, _lexmax)
    else:
        rv = tl.max(v, 0)
        rc = tl.max(tl.where(v == rv, c, NEG_INF), 0)
    return rv, rc


@triton.jit
def _argmin(key, idx, v, FUSED: tl.constexpr):
    """(idx, v) of the smallest key; ties: the lowest idx."""
    if FUSED:
        _k, ri, rv = tl.reduce((key, idx, v), 0, _argmin_key)
    else:
        kmin = tl.min(key, 0)
        ri = tl.min(tl.where(key == kmin, idx, INT32_MAX), 0)
        rv = tl.max(tl.where((key == kmin) & (idx == ri), v, NEG_INF), 0)
    return ri, rv


# ----------------------------------------------------------------- pass 2: whole-row fallbacks
@triton.jit
def _row_ge_stats(x_ptr, V, scale, shift, M, piv, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """For each pivot key p: (count, sum of exp(z - M)) over the finite z of the row with key >= p."""
    cnt = tl.zeros([NPIV], tl.float32)
    mass = tl.zeros([NPIV], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z, fin = _load_tempered(x_ptr, offs, offs < V, scale, shift)
        ge = (_ordered_key(z)[:, None] >= piv[None, :]) & fin[:, None]
        cnt += tl.sum(ge.to(tl.float32), 0)
        mass += tl.sum(tl.where(ge, tl.exp(z - M)[:, None], 0.0), 0)
    return cnt, mass


@triton.jit
def _row_mass_ge(x_ptr, V, scale, shift, M, t, BLOCK: tl.constexpr):
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z, fin = _load_tempered(x_ptr, offs, offs < V, scale, shift)
        mass += tl.where(fin & (z >= t), tl.exp(z - M), 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _row_search(x_ptr, V, scale, shift, M, lo, hi, c_lo, mass_lo, target, stop_count, BY_MASS: tl.constexpr,
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
        cnt, mass = _row_ge_stats(x_ptr, V, scale, shift, M, piv.to(tl.int32), BLOCK, NPIV)
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
def _row_scan(x_ptr, start, end, scale, shift, M, t, target, BLOCK: tl.constexpr):
    """First index in [start, end) where the running sum of exp(z - M) over z >= t exceeds target."""
    acc = 0.0
    tok = -1
    last = -1
    pos = start
    while (pos < end) & (tok < 0):
        offs = pos + tl.arange(0, BLOCK)
        z, fin = _load_tempered(x_ptr, offs, offs < end, scale, shift)
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
def _expand(x_row, cand_row, nvec_row, vs, S, KC: tl.constexpr, V, scale, shift, NV: tl.constexpr):
    """Entries of candidate vectors [vs, vs + NV): (index, tempered value, finite), flattened."""
    vl = vs + tl.arange(0, NV)
    slot_ok = vl < S * KC
    n_vec = tl.load(nvec_row + vl // KC, mask=slot_ok, other=0.0)
    v_ok = slot_ok & ((vl % KC).to(tl.float32) < n_vec)
    vb = tl.load(cand_row + vl, mask=v_ok, other=0)
    e_idx = vb[:, None] + tl.arange(0, 4)[None, :]
    e_z, e_fin = _load_tempered(x_row, e_idx, v_ok[:, None] & (e_idx < V), scale, shift)
    return tl.reshape(e_idx, [NV * 4]), tl.reshape(e_z, [NV * 4]), tl.reshape(e_fin, [NV * 4])


@triton.jit(noinline=True)
def _select_fallback(
    x_ptr, stride_x, V, row, cand_idx_ptr, stats_ptr, B, S, scr_val_ptr, scr_idx_ptr,
    scale, shift, greedy, top_k, top_p, min_p, seed, off, tok_ptr, logprob_ptr,
    CHUNK: tl.constexpr, KC: tl.constexpr, SP: tl.constexpr, NVP: tl.constexpr, P: tl.constexpr,
    VB: tl.constexpr, BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    """Pass 2 for the rows the fast path could not certify (and rows with top-k off): expands every
    candidate vector, keeps the entries above the certificate F packed into P scratch slots, bisects
    the thresholds on them and, when a threshold is not certified, searches the whole row. Not inlined:
    its registers and code stay out of the fast path. Stores the row's token and log-probability."""
    x_row = x_ptr + row.to(tl.int64) * stride_x
    u = _uniform(seed, off, row)
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
    cand_row = cand_idx_ptr + row.to(tl.int64) * S * KC
    nvec_row = stats_ptr + 4 * plane + row * S
    tok = tl.full([], 0, tl.int32)
    logprob = tl.full([], 0.0, tl.float32)

    # candidate entries: the 4 entries of each stored vector. Survivors (above the certificate F)
    # are packed into P scratch slots, streaming VB vectors at a time, when there are more entries
    if NVP * 4 > P:
        scr = row.to(tl.int64) * P
        tok_g = tl.full([], INT32_MAX, tl.int32)
        n_surv = tl.full([], 0, tl.int32)
        F_pack = tl.where(greedy, POS_INF, F)  # greedy rows need no survivors
        for vs in range(0, S * KC, VB):
            e_idx, e_z, e_fin = _expand(x_row, cand_row, nvec_row, vs, S, KC, V, scale, shift, VB)
            tok_g = tl.minimum(tok_g, tl.min(tl.where(e_fin & (e_z == M), e_idx, INT32_MAX), 0))
            surv = e_fin & (e_z > F_pack)
            pos = n_surv + tl.cumsum(surv.to(tl.int32), 0) - 1
            put = surv & (pos < P)
            tl.store(scr_val_ptr + scr + pos, e_z, mask=put)
            tl.store(scr_idx_ptr + scr + pos, e_idx, mask=put)
            n_surv += tl.sum(surv.to(tl.int32), 0)
        F = tl.where(n_surv > P, POS_INF, F)  # survivors lost: certify nothing
        tl.debug_barrier()
        cl = tl.arange(0, P)
        fin = cl < n_surv
        v = tl.load(scr_val_ptr + scr + cl, mask=fin, other=NEG_INF)
        idx = tl.load(scr_idx_ptr + scr + cl, mask=fin, other=0)
    else:
        e_idx, e_z, e_fin = _expand(x_row, cand_row, nvec_row, 0, S, KC, V, scale, shift, NVP)
        tok_g = tl.min(tl.where(e_fin & (e_z == M), e_idx, INT32_MAX), 0)
        cl = tl.arange(0, NVP * 4)
        fin = e_fin & (e_z > F)
        v = tl.where(fin, e_z, NEG_INF)
        idx = e_idx

    if greedy:
        # the lowest index holding the row max is always a candidate
        tok = tok_g
    else:
        # pass 1 summed exp(z - max) only for rows with top-k off
        mass_known = top_k <= 0
        topk_on = (top_k > 0) & (top_k < n_fin)
        topp_on = top_p < 1.0
        if (~mass_known) & (~topk_on):
            Z = _row_mass_ge(x_row, V, scale, shift, M, NEG_INF, BLOCK)
        # (a candidate at or below F can never be part of a certified support: dropped above)
        keys = _ordered_key(v)
        w = tl.where(fin, tl.exp(v - M), 0.0)
        t_min = tl.where(min_p > 0.0, M + tl.log(min_p), NEG_INF)

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
            # the whole support is among the candidates
            ws = tl.where(fin & (v >= t), w, 0.0)
            W_t = tl.sum(ws, 0)
            cs = tl.cumsum(ws, 0)
            # a parallel scan may round up across a zero weight: only land on kept entries
            pick = tl.min(tl.where((cs > u * W_t) & (ws > 0.0), cl, INT32_MAX), 0)
            pick = tl.where(pick < INT32_MAX, pick, tl.max(tl.where(ws > 0.0, cl, 0), 0))
            tok = tl.sum(tl.where(cl == pick, idx, 0), 0)
            z_tok = tl.sum(tl.where(cl == pick, v, 0.0), 0)
            logprob = z_tok - M - tl.log(W_t)
        else:
            # whole-row passes for whatever the candidates could not certify
            hi0 = _ordered_key(M).to(tl.int64) + 1
            if (~mass_known) & topk_on:
                Z = _row_mass_ge(x_row, V, scale, shift, M, NEG_INF, BLOCK)
            c_k = tl.where(topk_on, tl.sum(in_k.to(tl.float32), 0), n_fin.to(tl.float32))
            if topk_on & (~ok_k):
                lo_k, c_k, W_k = _row_search(x_row, V, scale, shift, M, _ordered_key(zmin).to(tl.int64), hi0,
                                             n_fin.to(tl.float32), Z, top_k.to(tl.float32),
                                             top_k.to(tl.float32), 0, BLOCK, NPIV)
                t_k = _key_to_float(lo_k.to(tl.int32))
            W_p = W_k
            if topp_on:
                lo_p0 = _ordered_key(tl.maximum(t_k, zmin)).to(tl.int64)
                lo_p, _c_p, W_p = _row_search(x_row, V, scale, shift, M, lo_p0, hi0, c_k, W_k, top_p * W_k,
                                              -1.0, 1, BLOCK, NPIV)
                t_p = _key_to_float(lo_p.to(tl.int32))
            t = tl.maximum(tl.maximum(t_k, t_p), t_min)
            if (t == NEG_INF) & mass_known:
                # no filter: choose the chunk by its mass, then scan that chunk alone
                cum = tl.cumsum(mass_c, 0)
                c_pick = tl.min(tl.where((cum > u * Z) & (mass_c > 0.0), sl, SP), 0)
                c_pick = tl.where(c_pick < SP, c_pick, tl.max(tl.where(mass_c > 0.0, sl, 0), 0))
                before = tl.sum(tl.where(sl < c_pick, mass_c, 0.0), 0)
                start = c_pick * CHUNK
                tok = _row_scan(x_row, start, tl.minimum(start + CHUNK, V), scale, shift, M, t,
                                u * Z - before, BLOCK)
                W_t = Z
            else:
                if t == t_p:
                    W_t = W_p
                elif t == t_k:
                    W_t = W_k
                else:
                    W_t = _row_mass_ge(x_row, V, scale, shift, M, t, BLOCK)
                tok = _row_scan(x_row, 0, V, scale, shift, M, t, u * W_t, BLOCK)
            tok = tl.minimum(tl.maximum(tok, 0), V - 1)
            z_tok = _shifted(tl.load(x_row + tok).to(tl.float32), shift) * scale
            logprob = z_tok - M - tl.log(W_t)

    tok = tl.minimum(tl.maximum(tok, 0), V - 1)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logprob_ptr + row, logprob)


@triton.jit
def select_sample_kernel(
    x_ptr, stride_x, V, shift_ptr, err_ptr,
    cand_idx_ptr, cand_val_ptr, stats_ptr, B, S, scr_val_ptr, scr_idx_ptr, fscr_ptr,
    temp_ptr, temp_val, topk_ptr, topk_val, topp_ptr, topp_val, minp_ptr, minp_val,
    seed_ptr, seed_val, offset_ptr, offset_val,
    tok_ptr, logprob_ptr,
    TEMP_PER_ROW: tl.constexpr, TOPK_PER_ROW: tl.constexpr, TOPP_PER_ROW: tl.constexpr,
    MINP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr, OFFSET_MODE: tl.constexpr,
    CHUNK: tl.constexpr, KC: tl.constexpr, SP: tl.constexpr, NVP: tl.constexpr, P: tl.constexpr,
    VB: tl.constexpr, BLOCK: tl.constexpr, NPIV: tl.constexpr, PE: tl.constexpr, EVEN4: tl.constexpr,
    FUSED: tl.constexpr, NSPLIT: tl.constexpr = 1,
):
    """One program per row. Fast path (top-k rows and greedy rows):

    1. Read at once: the chunk stats and every candidate slot (vector base and max).
    2. L = max(F, the k-th largest of the chunks' two largest tile-row maxima) <= t_k (all-pairs).
    3. The vectors whose max is >= L and > F (~k + 15) are read in place (one masked 16-byte gather per
       slot); their entries >= L and > F are packed, (value bits, index) in one int64 each, into PE
       scratch slots: the j-th such entry of a slot's vector goes to (prefix over slots) + j.
    4. Ranked all-pairs in the order (value desc, index asc): rank r_i and mass C_i at or before i.
       t_k = max{v_i : r_i >= k}; the mass at or above a value is the largest C of its tie group, so
       (t_k, W_k), (t_p, W_p) are one reduction each; the draw is the first entry (in that order)
       with C_i > u * W_t: inverse CDF, independent of the slot order. Exact whenever t_k > F (every
       entry >= t_k is then packed).

    Greedy rows: the lowest candidate index holding the row max (every chunk stores the vector of its
    lowest index holding its max: always exact). Everything else calls ``_select_fallback``.

    Logits are read shifted by the row max (``_shifted``, ``_row_shift``). A row without a finite or +inf
    logit (shift = -inf) gets token -1 and logprob NaN and ORs 8 into ``err[0]`` (``kbit.ops._ids``)."""
    row = tl.program_id(0)
    shift = _row_shift(shift_ptr, row, NSPLIT)  # NSPLIT partial maxima of row_max_kernel
    if shift == NEG_INF:
        tl.store(tok_ptr + row, tl.full([], -1, tl.int64))
        tl.store(logprob_ptr + row, tl.full([], float("nan"), tl.float32))
        tl.atomic_or(err_ptr, 8)
        return
    x_row = x_ptr + row.to(tl.int64) * stride_x
    temp = _param(temp_ptr, temp_val, row, TEMP_PER_ROW, tl.float32)
    top_k = _param(topk_ptr, topk_val, row, TOPK_PER_ROW, tl.int32)
    top_p = _param(topp_ptr, topp_val, row, TOPP_PER_ROW, tl.float32)
    min_p = _param(minp_ptr, minp_val, row, MINP_PER_ROW, tl.float32)
    scale, greedy = _row_scale(temp)
    seed = _rng_word(seed_ptr, seed_val, row, SEED_MODE)
    off = _rng_word(offset_ptr, offset_val, row, OFFSET_MODE)

    # everything the fast path reads, issued at once: chunk stats and all candidate slots
    sl = tl.arange(0, SP)
    smask = sl < S
    plane = B * S
    sat = row * S + sl
    m_c = tl.load(stats_ptr + sat, mask=smask, other=NEG_INF)
    f_c = tl.load(stats_ptr + 2 * plane + sat, mask=smask, other=NEG_INF)
    n_c = tl.load(stats_ptr + 3 * plane + sat, mask=smask, other=0.0)
    a_i = tl.arange(0, 2 * SP)
    a_s = a_i % SP
    a = tl.load(stats_ptr + tl.where(a_i < SP, 0, 5 * plane) + row * S + a_s, mask=a_s < S, other=NEG_INF)
    ns = tl.arange(0, NVP)
    nmask = ns < S * KC
    slot_row = row.to(tl.int64) * S * KC
    j4 = tl.arange(0, 4)
    sval = tl.load(cand_val_ptr + slot_row + ns, mask=nmask, other=NEG_INF)
    sidx = tl.load(cand_idx_ptr + slot_row + ns, mask=nmask, other=0)
    M, F, n_fin = _max_max_sum(m_c, f_c, n_c, FUSED)
    topk_on = (top_k > 0) & (top_k < n_fin.to(tl.int32))

    tok = tl.full([], 0, tl.int32)
    logprob = tl.full([], 0.0, tl.float32)
    done = tl.full([], 0, tl.int32)
    if greedy | topk_on:
        L = tl.where(greedy, M, _kth_lower_bound(a, top_k, F))
        F_f = tl.where(greedy, NEG_INF, F)  # greedy rows only need the entries holding M
        keep_v = (sval >= L) & (sval > F_f)  # unused slots hold -inf: never kept
        e_idx = tl.multiple_of(sidx, 4)[:, None] + j4[None, :]
        if EVEN4:  # no vector straddles V: a per-vector mask keeps the gather 16 bytes wide
            z, fin = _load_tempered(x_row, e_idx, keep_v[:, None], scale, shift)
        else:
            z, fin = _load_tempered(x_row, e_idx, keep_v[:, None] & (e_idx < V), scale, shift)
        keep_e = fin & (z >= L) & (z > F_f)
        if greedy:
            tok = tl.min(tl.min(tl.where(keep_e & (z == M), e_idx, INT32_MAX), 1), 0)
            done = tl.full([], 1, tl.int32)
        else:
            # pack (value bits, index) of the survivors: four 1-D stores, so that no 2-D tile changes
            # layout for the scatter
            k_i = keep_e.to(tl.int32)
            cnt_v = tl.sum(k_i, 1)
            n_se = tl.sum(cnt_v, 0)
            excl = tl.cumsum(cnt_v, 0) - cnt_v
            rank_e = tl.cumsum(k_i, 1)
            zbits = z.to(tl.int32, bitcast=True)
            fbase = row.to(tl.int64) * PE
            for j in tl.static_range(4):
                sel = keep_e & (rank_e == j + 1)
                idx_j = tl.sum(tl.where(sel, e_idx, 0), 1)
                bits_j = tl.sum(tl.where(sel, zbits, 0), 1)
                packed = (bits_j.to(tl.int64) << 32) | idx_j.to(tl.int64)
                tl.store(fscr_ptr + fbase + excl + j, packed, mask=(cnt_v > j) & (excl + j < PE))
            if n_se <= PE:
                tl.debug_barrier()
                ce = tl.arange(0, PE)
                efin = ce < n_se
                pk = tl.load(fscr_ptr + fbase + ce, mask=efin, other=0)
                eidx = (pk & 0xFFFFFFFF).to(tl.int32)
                ev = tl.where(efin, (pk >> 32).to(tl.int32).to(tl.float32, bitcast=True), NEG_INF)
                w = tl.where(efin, tl.exp(ev - M), 0.0)
                # [j, i]: j precedes-or-is i in the order (value desc, index asc); the reduction over j
                # stays mostly within each thread
                prec = efin[:, None] & ((ev[:, None] > ev[None, :])
                                        | ((ev[:, None] == ev[None, :]) & (eidx[:, None] <= eidx[None, :])))
                r_i, C_i = _sum_sum(prec.to(tl.int32), tl.where(prec, w[:, None], 0.0), 0, FUSED)
                t_k, W_k = _max_then_max(tl.where(efin & (r_i >= top_k), ev, NEG_INF), C_i, FUSED)
                in_k = efin & (ev >= t_k)
                t_p = tl.full([], NEG_INF, tl.float32)
                W_p = W_k
                if top_p < 1.0:
                    # t_p = the largest kept value whose upper set holds >= top_p of the mass
                    t_p, W_p = _max_then_max(tl.where(in_k & (C_i >= top_p * W_k), ev, NEG_INF), C_i, FUSED)
                t_min = tl.where(min_p > 0.0, M + tl.log(min_p), NEG_INF)
                t = tl.maximum(tl.maximum(t_k, t_p), t_min)
                W_t = tl.where(t == t_p, W_p, W_k)
                if t > tl.maximum(t_k, t_p):
                    W_t = tl.max(tl.where(in_k & (ev >= t), C_i, 0.0), 0)
                # inverse CDF: the first entry with C_i > u * W_t (rounding: the last with weight);
                # the uniform is drawn here, long after its seed and offset were read
                u = _uniform(seed, off, row)
                supp = in_k & (ev >= t) & (w > 0.0)
                key = tl.where(C_i > u * W_t, C_i, 3.0 * W_t + (W_t - C_i))
                tok, z_tok = _argmin(tl.where(supp, key, POS_INF), eidx, ev, FUSED)
                logprob = z_tok - M - tl.log(W_t)
                done = (t_k > F).to(tl.int32)

    if done != 0:
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(logprob_ptr + row, logprob)
    else:
        _select_fallback(x_ptr, stride_x, V, row, cand_idx_ptr, stats_ptr, B, S, scr_val_ptr, scr_idx_ptr,
                         scale, shift, greedy, top_k, top_p, min_p, seed, off, tok_ptr, logprob_ptr,
                         CHUNK, KC, SP, NVP, P, VB, BLOCK, NPIV)


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
