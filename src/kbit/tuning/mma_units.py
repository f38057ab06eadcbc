"""Kernel 3's ways of adding the split-K parts of a tile without the global workspace's fix-up pass.

CTA-aligned units (``CAU`` in the kernel source): each CTA takes whole units (16-row tiles; with the SiLU epilogue
gate / up tile pairs) and sums their parts in shared memory, in warp order (so deterministic too). The CTA-local
fix-up (``LFX``): the parts a CTA holds of the tiles its range touches are summed in shared memory first. Pure
arithmetic on the launch geometry, shared by the rule tables (:mod:`kbit.tuning.mma`) and the plan
(:mod:`kbit.tuning.mma_plan`).
"""

from __future__ import annotations

__all__ = ["CAU_IDLE_US", "CAU_K2_RING", "CAU_MAX_SLOT_BYTES", "CAU_MIN_EFF", "LFX_MAX_SLOT_BYTES", "LFX_MAX_UNITS",
           "cau_plan", "lfx_defines", "read_us"]

#: CAU only where the busiest CTA's units are at most 1 / CAU_MIN_EFF of an even share of the SMs, and the SM time
#: left idle by whole units a CTA, (1 - eff) x the weights' read time, is at most CAU_IDLE_US: the split-K fix-up it
#: saves costs ~2-4 us a call on an H100 (57344x8192 k = 4 at eff 0.97 of ~90 us was 3% slower with CAU)
CAU_MIN_EFF = 0.9
CAU_IDLE_US = 1.5
#: CAU's shared slots: at most this many bytes a CTA
CAU_MAX_SLOT_BYTES = 32768
#: CAU at k = 2 and one token group, without a prologue or epilogue: the register ring holds at least this many
#: segments (``PD``), whatever the config asks. A k = 2 segment is half a k = 4 one, so ring 4 keeps k = 4's ring-2
#: bytes in flight. At M = 1 on 9 suite shapes with CAU (7680x5120 .. 151936x4096) ring 4 took 0.89-0.99x the time
#: of the tuned ring 2 (H200; 0.89-0.95 on 8), on 8 without CAU 0.99-1.03x; ring 6 0.94-1.08x; M = 8 0.97-1.02x
#: (benchmarks/results/h200/k2-m1-ring-2026-11-30/). The tuned tables never offered it.
CAU_K2_RING = 4
#: LFX: at most this many units (tiles; EPI: gate / up pairs) a CTA's range
LFX_MAX_UNITS = 64
#: LFX's shared slots (``MAXW * LFW * NG`` x 512 bytes, static ``__shared__`` in the kernel): at most this many bytes
#: a CTA. Static shared data is capped at 48 KiB a build (ptxas: "uses too much shared data (0x10460 bytes, 0xc000
#: max)" for 8 warps, LFW 2, NG 8, i.e. kernel 3 at M = 33..64 with 2 CTAs an SM); the slots' sizes are powers of two
#: times 512, so the next size down, 32 KiB (CAU's cap too), leaves room for the counters and the kernel's other
#: static arrays
LFX_MAX_SLOT_BYTES = 32768


def read_us(k: int, N: int, K: int) -> float:
    """A k-bit N x K weight's read time at 2.5 TB/s, in us (CAU's idle-time rule)."""
    return N * K * (k + 0.25) / 8 / 2.5e6


def cau_plan(Nt, S, W, occ, sms, epi, ng=1, est_us=0.0):
    """Kernel 3 with CTA-aligned units over ``Nt`` tiles of ``S`` segments. Tries the configured CTAs (``W`` warps,
    ``occ`` an SM) and, where ``occ`` is even, half as many CTAs of twice the warps; returns ``(W, CTAs an SM,
    defines, units a CTA, grid)`` of the one that leaves the fewest SM slots idle, or None where the busiest CTA
    carries more than 1 / CAU_MIN_EFF of an even share (or leaves more than CAU_IDLE_US of ``est_us`` idle), or
    the shared slots would not fit."""
    tpu = 2 if epi else 1
    if Nt % tpu:
        return None
    n_u, U = Nt // tpu, tpu * S
    best = None
    for w, o in ((W, occ), (2 * W, occ // 2)):
        if o < 1 or w > 32:
            continue
        slots = sms * o
        upc = -(-n_u // slots)
        eff = n_u / (slots * upc)
        if best is None or eff > best[0] + 1e-9:
            best = (eff, w, o, upc)
    eff, w, o, upc = best
    if eff < CAU_MIN_EFF or (1 - eff) * est_us > CAU_IDLE_US:
        return None
    grid = -(-n_u // upc)
    lfw = 1  # slots a warp: the tiles its range touches (not EPI: a part of a tile each end at most)
    for b in (0, grid - 1):
        c0, cn = b * upc * U, (min(n_u, (b + 1) * upc) - b * upc) * U
        for wi in range(w):
            j0, j1 = c0 + cn * wi // w, c0 + cn * (wi + 1) // w
            if j1 > j0:
                lfw = max(lfw, (j1 - 1) // S - j0 // S + 1)
    if not epi:
        lfw = min(lfw, 2)
    if w * lfw * ng * 512 > CAU_MAX_SLOT_BYTES:
        return None
    return w, o, dict(CAU=1, LFW=lfw), upc, grid


def lfx_defines(Nt, S, grid, W, epi, ng=1):
    """Defines of the CTA-local fix-up for a grid of ``grid`` CTAs of ``W`` warps over Nt x S (tile, segment) pairs,
    ranges as the kernel cuts them: ``LFU`` = the most units a CTA's range touches (its shared counters), ``LFW`` =
    shared slots a warp (a part of a tile each: 2; EPI: the most tiles a warp's range touches); None where a CTA
    would touch more than LFX_MAX_UNITS units, or its slots of ``ng`` token groups would take more than
    LFX_MAX_SLOT_BYTES."""
    T, TW, U = Nt * S, grid * W, (2 if epi else 1) * S
    lfu, lfw = 1, 2
    for b in range(grid):
        c0, c1 = T * b * W // TW, T * (b * W + W) // TW
        if c1 > c0:
            lfu = max(lfu, (c1 - 1) // U - c0 // U + 1)
    if epi:
        for gw in range(TW):
            j0, j1 = T * gw // TW, T * (gw + 1) // TW
            if j1 > j0:
                lfw = max(lfw, (j1 - 1) // S - j0 // S + 1)
    if lfu > LFX_MAX_UNITS or W * lfw * ng * 512 > LFX_MAX_SLOT_BYTES:
        return None
    return dict(LFX=1, LFU=lfu, LFW=lfw)
