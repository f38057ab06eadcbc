"""MoE kernels: the fused router (softmax/sigmoid top-k into pair lists), a small-P stable sort of the pairs by
expert, the fused SwiGLU activation and the weighted combine back to token order.

Only @triton.jit code lives here; launchers are in ``kbit.ops.moe_router``, ``kbit.ops.moe_align`` and
``kbit.ops.moe`` (``silu_mul_gate_up``, ``combine``). The element-wise kernels read and write the activation
dtype and compute in float32.
"""

import triton
import triton.language as tl

from kbit.kernels.glue import _add_norm_row, _add_norm_vals, _pdl_enter

#: rows a block of the run table :func:`route_topk_kernel` writes at most: the grouped GEMM's smallest block (8 NG
#: rows, NG >= 1), so the table serves every NG
RUN_BLOCK_ROWS = tl.constexpr(8)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out[r, c] = silu(gu[r, c]) * gu[r, I + c]`` for ``c < I``: one program per (row, column block).

    ``gu`` is the gate_up product ``[P, 2I]`` with the gate in columns ``[0, I)`` and up in ``[I, 2I)``
    (Hugging Face's ``gate_up_proj`` order). ``PDL``: as the glue kernels (``kbit.kernels.glue``)."""
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    base = gu_ptr + row * stride_gu
    g = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(base + I + cols, mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_kernel(y_ptr, pair_rows_ptr, w_ptr, out_ptr, err_ptr, P, H, stride_y, stride_out, TOP_K: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out[t, c] = sum_s w[t, s] * y[pair_rows[t * TOP_K + s], c]``: one program per (token, column block).

    Each token's ``TOP_K`` expert rows are summed in a fixed order in float32 (deterministic, no atomics).
    A pair row out of ``[0, P)`` reads row 0 instead (in bounds), makes the token's output NaN and ORs 4 into
    ``err[0]`` (``kbit.ops._ids``). ``PDL``: as the glue kernels (``kbit.kernels.glue``)."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = _combine_sum(y_ptr, pair_rows_ptr, w_ptr, err_ptr, t, cols, ok, tl.program_id(1) == 0, P, stride_y, TOP_K)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_sum(y_ptr, pair_rows_ptr, w_ptr, err_ptr, t, cols, ok, report, P, stride_y, TOP_K: tl.constexpr):
    """Token t's ``sum_s w[t, s] * y[pair_rows[t * TOP_K + s], cols]`` in float32, s in order. A pair row out of
    ``[0, P)`` reads row 0 instead, makes the sum NaN and, where ``report``, ORs 4 into ``err[0]``."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        p = t * TOP_K + s
        r = tl.load(pair_rows_ptr + p)
        rb = (r < 0) | (r >= P)
        if rb & report:
            tl.atomic_or(err_ptr, 4)
        r = tl.where(rb, 0, r).to(tl.int64)
        w = tl.load(w_ptr + p) + tl.where(rb, float("nan"), 0.0)
        v = tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        acc += w * v
    return acc


@triton.jit
def combine_add_norm_kernel(y_ptr, pair_rows_ptr, w_ptr, res_ptr, nw_ptr, out_ptr, rout_ptr, err_ptr, P, H, stride_y,
                            stride_r, stride_out, stride_ro, eps, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
    """:func:`combine_kernel` of token t (one program, ``BLOCK >= H``: the norm needs the whole row), rounded to the
    activation dtype, then the next norm's residual add and RMSNorm as ``kbit.kernels.glue.add_rms_norm_kernel``
    makes them: ``r = residual + combined`` (stored), ``out = nw * norm(r)``. The numbers of the combine launch
    followed by the norm launch, in one launch."""
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    nw = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: no dependency, read before the wait
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    acc = _combine_sum(y_ptr, pair_rows_ptr, w_ptr, err_ptr, t, cols, ok, True, P, stride_y, TOP_K)
    h = _add_norm_vals(acc.to(out_ptr.dtype.element_ty), res_ptr, rout_ptr, t, cols, ok, ok, stride_r, stride_ro,
                       H, eps, True)
    tl.store(out_ptr + t * stride_out + cols, (nw * h).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def route_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr, blk_ptr, nblk_ptr, E, stride_l,
                      scaling, start, stop, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RENORM: tl.constexpr, LOCAL: tl.constexpr, RUNS: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program per token: router scores, the ``TOP_K`` best experts, their weights, and the pair lists.

    Softmax (float32) or sigmoid scores; the choice is on the score (+ ``bias`` for the sigmoid router), the
    highest first, ties to the lower expert index (``torch.topk`` on the CPU, and the set ``torch.topk`` picks
    on the GPU); weights are the chosen scores (without the bias), divided by their sum when ``RENORM``
    (sigmoid: sum + 1e-20), times ``scaling``. Writes, for pair ``p = t * TOP_K + s``: ``w[p]`` (float32),
    ``ids[p]`` (int32), ``tok[p] = t`` and ``rows[p] = p`` (the grouped GEMV's row lists, in pair order).

    ``LOCAL``: only experts ``start:stop`` are this rank's (expert parallel), and the pairs are written as
    ``kbit.ops.moe_router.localize_pairs`` makes them: ids relative to ``start``; a pair of another rank's expert
    weighted 0 and sent to the expert of the nearest local slot before it (else the token's first local slot,
    else local expert 0), so that a token's local experts form runs of equal ids, which the grouped kernels'
    block tables read once a run.

    ``RUNS`` (one token: one program): also the grouped GEMM's block table of the pairs in this order
    (``kbit.ops.moe_blocks.block_table``'s format: ``blk[b]`` the first row of block b, ``blk[nblk[0]] = TOP_K``),
    blocks cut from each run of equal ids every ``RUN_BLOCK_ROWS`` rows, so the step needs no table launch.
    ``PDL``: as the glue kernels (``kbit.kernels.glue``)."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    _route_row(x, t, e, ok, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr, blk_ptr, nblk_ptr, E, scaling, start, stop,
               TOP_K, SIGMOID, HAS_BIAS, RENORM, LOCAL, RUNS, BLOCK_E, BLOCK_K)


@triton.jit
def _route_row(x, t, e, ok, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr, blk_ptr, nblk_ptr, E, scaling, start, stop,
               TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
               LOCAL: tl.constexpr, RUNS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Token ``t``'s choice from its float32 logits ``x [BLOCK_E]`` (experts ``e``, ``ok = e < E``), written as
    :func:`route_topk_kernel` says."""
    # Each reduction across the program's warps is a shared-memory round trip and a barrier, and they run one after
    # another: the choice takes one a slot (the most of a packed key), and the softmax with renormalisation none
    # over all experts (its top k by logit are its top k by score, and its weights exp(x - x_best) / their sum)
    SOFT_RENORM: tl.constexpr = RENORM and not SIGMOID
    if SIGMOID:
        score = tl.sigmoid(x)
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    elif SOFT_RENORM:
        score = x
        choice = x
    else:
        z = tl.exp(x - tl.max(x, axis=0))
        score = z / tl.sum(z, axis=0)
        choice = score
    # key: the choice's bits in an order-preserving int32 (negative floats' magnitude bits flipped) over BLOCK_E - 1
    # - e, so the largest key is the best choice, ties to the lower index; experts past E lowest. A NaN sorts above
    # +inf (its token's output is NaN either way); the ids are distinct and in range (kbit.ops._ids: routed ids need
    # no check)
    bits = choice.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(ok, (order.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64), -9223372036854775807 - 1)
    slot = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    top = 0.0
    for s in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        ids = tl.where(slot == s, idx, ids)
        if not HAS_BIAS:  # the score is the choice: from the key's bits
            hi = (best >> 32).to(tl.int32)
            v = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            w = tl.where(slot == s, v, w)
            if s == 0:
                top = v
        key = tl.where(e == idx, -9223372036854775807 - 1, key)
    keep = slot < TOP_K
    if HAS_BIAS:  # the chosen scores, without the bias (slots past TOP_K zero: they must not count in the sum)
        w = tl.sum(tl.where((e[None, :] == ids[:, None]) & keep[:, None], score[None, :], 0.0), axis=1)
    if SOFT_RENORM:  # w holds the chosen logits, the best (top) in slot 0
        w = tl.where(keep, tl.exp(w - top), 0.0)
    if RENORM:
        denom = tl.sum(w, axis=0)
        if SIGMOID:
            denom = denom + 1e-20
        w = w / denom
    w = w * scaling
    if LOCAL:
        mine = (ids >= start) & (ids < stop) & keep
        ids = ids - start
        # slot j stands in for slot s: the last local j <= s, else the first local slot, else none (-1)
        before = mine[None, :] & (slot[None, :] <= slot[:, None])
        src = tl.max(tl.where(before, slot[None, :], -1), axis=1)
        first = tl.min(tl.where(mine, slot, BLOCK_K), axis=0)
        src = tl.where(src < 0, first, src)
        local = tl.sum(tl.where(slot[None, :] == src[:, None], ids[None, :], 0), axis=1)
        ids = tl.where(src < BLOCK_K, local, 0)
        w = tl.where(mine, w, 0.0)
    if RUNS:  # slot s opens a run where its id differs from slot s - 1's; a block every RUN_BLOCK_ROWS of a run
        prev = tl.sum(tl.where(slot[None, :] == slot[:, None] - 1, ids[None, :], 0), axis=1)
        opens = keep & ((slot == 0) | (ids != prev))
        run0 = tl.max(tl.where(opens[None, :] & (slot[None, :] <= slot[:, None]), slot[None, :], 0), axis=1)
        starts = keep & ((slot - run0) % RUN_BLOCK_ROWS == 0)
        pos = tl.sum(tl.where(starts[None, :] & (slot[None, :] < slot[:, None]), 1, 0), axis=1)
        tl.store(blk_ptr + pos, slot, mask=starts)
        n = tl.sum(starts.to(tl.int32), axis=0)
        tl.store(blk_ptr + n, tl.full([], TOP_K, tl.int32))
        tl.store(nblk_ptr, n)
    p = t * TOP_K + slot
    tl.store(w_ptr + p, w, mask=keep)
    tl.store(ids_ptr + p, ids, mask=keep)
    tl.store(tok_ptr + p, t.to(tl.int32) + tl.zeros([BLOCK_K], dtype=tl.int32), mask=keep)
    tl.store(rows_ptr + p, p.to(tl.int32), mask=keep)


@triton.jit
def router_route_kernel(x_ptr, wr_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr, blk_ptr,
                        nblk_ptr, E, H, stride_x, scaling, start, stop, res_ptr, nw_ptr, y_ptr, rout_ptr, stride_r,
                        stride_y, stride_ro, eps, TOP_K: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr, RUNS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr, NORM: tl.constexpr = False):
    """The router's logits and :func:`route_topk_kernel`'s choice in one launch, grid ``(T, cdiv(E, CHUNK_E))``.

    Program ``(t, c)`` computes ``logits[t, c CHUNK_E : (c + 1) CHUNK_E] = wr[chunk] @ x[t]`` (float32 sums,
    rounded to x's dtype as ``F.linear`` returns them) and stores them; the program of token t that arrives last
    (an arrival counter, ``acq_rel``) reads the whole row back and routes it, then resets its counter (``cnt`` is
    zero between calls). Replaces the router's matrix product (a cuBLAS launch) and the routing launch of a
    decode step with one launch.

    A program holds its whole weight chunk (``CHUNK_E`` rows of ``BLOCK_H >= H`` columns, in registers; sizes:
    ``kbit.tuning.moe.fused_router_config``) and loads it before the PDL wait: the router weight never depends on
    the kernel before, so its latency passes while that kernel runs, and after the wait only x, the sums and the
    routing remain. (Loaded after the wait, tile after tile, the launch ended ~12 us after the norm before it:
    ``docs/notes/2026-11-26-moe-chain-ep.md``.)

    ``NORM``: x is the layer's pre-norm input; every program makes the residual add and RMSNorm of its token
    (``r = x + res``, ``y = nw * norm(r)``, :func:`kbit.kernels.glue._add_norm_row`'s rounding) and takes the logits
    of y, and program ``(t, 0)`` stores y and r (the experts' input and the next residual): the norm's own launch,
    a hop on a decode step's critical path, goes. The whole row is one program's anyway (``BLOCK_H >= H``)."""
    t = tl.program_id(0).to(tl.int64)
    er = tl.program_id(1) * CHUNK_E + tl.arange(0, CHUNK_E)
    eok = er < E
    hh = tl.arange(0, BLOCK_H)
    hok = hh < H
    wv = tl.load(wr_ptr + er[:, None].to(tl.int64) * H + hh[None, :], mask=eok[:, None] & hok[None, :], other=0.0)
    if NORM:
        nw = tl.load(nw_ptr + hh, mask=hok, other=0.0).to(tl.float32)  # a weight as well: before the wait
    _pdl_enter(PDL)  # x, the counters and the outputs belong to this step: from here on
    if NORM:
        # one program a token stores the residual and the normed row (the scalar widened: the interpreter's masks)
        first = hok & (hh * 0 + tl.program_id(1) == 0)
        xn = _add_norm_row(x_ptr, res_ptr, rout_ptr, t, hh, hok, first, stride_x, stride_r, stride_ro, H, eps, True)
        yv = (nw * xn).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + t * stride_y + hh, yv, mask=first)
        xv = yv.to(tl.float32)
    else:
        xv = tl.load(x_ptr + t * stride_x + hh, mask=hok, other=0.0).to(tl.float32)
    acc = tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
    tl.store(logits_ptr + t * E + er, acc.to(logits_ptr.dtype.element_ty), mask=eok)
    # every thread's logits stores precede the release below (one thread issues the scalar atomic), as in the
    # decode attention's fold: else the last program could route from logits another program has not written yet
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")  # ready for the next call
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        # .cg: the other programs wrote these (to L2); never a stale line of this SM's L1
        x = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
        _route_row(x, t, e, ok, bias_ptr, w_ptr, ids_ptr, tok_ptr, rows_ptr, blk_ptr, nblk_ptr, E, scaling, start,
                   stop, TOP_K, SIGMOID, HAS_BIAS, RENORM, LOCAL, RUNS, BLOCK_E, BLOCK_K)


@triton.jit
def sort_pairs_kernel(ids_ptr, expert_ptr, tok_ptr, pair_rows_ptr, P, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """A stable sort of the pairs by expert without a global pass: one program per block of pairs counts,
    for each of its pairs, the pairs that come first (lower expert, or the same expert and a lower pair
    index) among all ``P``; that count is the pair's sorted row. O(P^2) compares, for the small P of decode.

    Writes ``pair_rows[p]`` (row of pair p), ``expert[row]`` and ``tok[row] = p // TOP_K``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok_i = i < P
    ei = tl.load(ids_ptr + i, mask=ok_i, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, P, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ej = tl.load(ids_ptr + j, mask=j < P, other=2147483647)  # past the end: after every pair
        first = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(first.to(tl.int32), axis=1)
    tl.store(pair_rows_ptr + i, rank, mask=ok_i)
    tl.store(expert_ptr + rank, ei, mask=ok_i)
    tl.store(tok_ptr + rank, i // TOP_K, mask=ok_i)


@triton.jit
def ids_guard_kernel(rows_ptr, eids_ptr, rows_out, eids_out, bad_out, err_ptr, P, T, E, BLOCK: tl.constexpr):
    """Bounds of a grouped op's ids: ``rows`` in ``[0, T)``, ``eids`` in ``[0, E)``. Writes them clamped into
    range (so the kernel that reads them stays in bounds; clamping keeps ids sorted by expert sorted), ``bad[p] =
    1`` for a row with either id out of range, and ORs 1 (a row) / 2 (an expert) into ``err[0]`` (one atomic a
    program, only when it saw one)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < P
    r = tl.load(rows_ptr + p, mask=ok, other=0)
    e = tl.load(eids_ptr + p, mask=ok, other=0)
    rb = ((r < 0) | (r >= T)) & ok
    eb = ((e < 0) | (e >= E)) & ok
    tl.store(rows_out + p, tl.minimum(tl.maximum(r, 0), T - 1), mask=ok)
    tl.store(eids_out + p, tl.minimum(tl.maximum(e, 0), E - 1), mask=ok)
    tl.store(bad_out + p, (rb | eb).to(tl.int8), mask=ok)
    code = tl.max(rb.to(tl.int32), 0) | (tl.max(eb.to(tl.int32), 0) * 2)
    if code != 0:
        tl.atomic_or(err_ptr, code)


@triton.jit
def poison_rows_kernel(y_ptr, stride_y, N, bad_ptr, blk_ptr, nblk_ptr, n_max, P, DROP: tl.constexpr,
                       BLOCK: tl.constexpr):
    """``y[r, :] = NaN`` for a row the guard mask marks (``bad[r] != 0``) or, with ``DROP``, a row of a block the
    grouped kernel 7 dropped (a block table of ``nblk > n_max`` blocks, built from bad ids: the rows from
    ``blk[min(n_max, P)]`` on are not written). One program a row; a good row reads two ints and stops."""
    r = tl.program_id(0)
    hit = tl.load(bad_ptr + r) != 0
    if DROP:
        lim = tl.load(blk_ptr + tl.minimum(n_max, P))
        hit = hit | ((tl.load(nblk_ptr) > n_max) & (r >= lim))
    if hit:
        base = y_ptr + r.to(tl.int64) * stride_y
        for c in range(0, N, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            tl.store(base + cols, tl.full([BLOCK], float("nan"), tl.float32).to(y_ptr.dtype.element_ty),
                     mask=cols < N)
