"""Launch configs of the MoE path and the rules that choose them: plain functions of shapes, no device queries.

Three grouped tensor-core kernels serve a grouped GEMM ``y[r] = x[rows[r]] @ W[expert_ids[r]].T`` (launchers in
``kbit.ops.grouped_mma``); the rows are cut into blocks of at most ``8 * ng`` rows of one expert:

- kernel 1, ``kbit_grouped_mma``: register double buffer, x read from L1/L2;
- kernel 4, ``kbit_grouped_mma_pipe``: x rows, codes and scales through a cp.async shared-memory pipeline that
  runs on across items, block scales folded into the A fragments;
- kernel 7, the grouped ``kbit_wgmma`` (sm_90 only): x pre-tiled per block and bulk-copied, 64- to 256-row
  blocks, for many rows an expert with the rows sorted by expert.

``rpe`` below is the expected rows per touched expert of a step, ``P / min(E, P)`` for ``P`` rows on ``E``
experts (:func:`rows_per_expert`). The thresholds were measured on an H100 at k = 4 (``docs/notes``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kbit.tuning.mma import check_wgmma_fixed

__all__ = ["FUSED_ROUTER_MAX_T", "GEMM_MAX_ROWS_PER_EXPERT", "GEMV_MAX_ROWS_PER_EXPERT", "GEMV_T1_MAX_WEIGHTS",
           "GROUPED4_MAX_SEG_NG1", "GROUPED4_MIN_NG", "PAIRS_MAX_REREAD", "PAIR_ORDER_MAX_T", "SORT_PAIRS_MAX_T",
           "TAIL_ROWS", "TAIL_SPLIT_BT", "TAIL_SPLIT_MIN_E", "WGMMA_MIN_ROWS", "FusedRouterConfig", "GroupedMmaConfig",
           "WgmmaGroupedConfig", "block_groups", "fused_router_config", "grouped_kernel", "grouped_mma_config",
           "pairs_rereads", "rows_per_expert", "wgmma_config"]

# ------------------------------------------------------------------------------------------------ MoE plan

#: The GEMV reads an expert's weight once per row, dequantize + ``torch._grouped_mm`` once per expert plus a
#: bf16 write and read (~4x the packed bytes at k = 4): the GEMV up to this many rows per touched expert where
#: the grouped tensor-core kernel is not available (a first guess; ``benchmarks/bench_moe.py --plans`` sweeps).
GEMV_MAX_ROWS_PER_EXPERT = 4
#: GEMV-only steps of up to this many tokens keep the pairs in router order (no sort: one fused routing
#: launch); longer ones sort them by expert in one more launch, so that the rows of an expert are adjacent in
#: the GEMV's grid and its weight is re-read from L2. At T = 16 (P = 128) all the GEMV's programs are resident
#: at once anyway.
PAIR_ORDER_MAX_T = 16
#: the router's matrix product in the routing launch (kbit.ops.moe_router.route_pairs_hidden) up to this many
#: tokens: a decode step's sizes, where two launches cost more than the product. H100, norm + MoE layer, fused /
#: unfused: 0.89-0.94x at T = 1, 0.98-0.99x at T = 16 on three expert shapes, where the routing alone was 1.02x
#: for Qwen3-235B-A22B's experts (benchmarks/results/h100/router-prefetch-ab-2026-11-26.log)
FUSED_ROUTER_MAX_T = 16
#: The grouped tensor-core GEMM up to this many rows per touched expert, dequantize + ``torch._grouped_mm``
#: above: the grouped GEMM won at 256 rows an expert (Qwen3-30B-A3B T = 4096, Mixtral T = 1024) and lost at
#: 1024 (Mixtral T = 4096).
GEMM_MAX_ROWS_PER_EXPERT = 256
#: Steps of a fused-routing plan above this many tokens sort with torch's radix sort (~30 launches) instead of
#: the one-launch ``sort_pairs``, whose O(P^2) compares grow past that cost.
SORT_PAIRS_MAX_T = 1024
#: At T = 1 the Triton GEMV beats the grouped GEMM on experts of up to this many weights (Qwen3-30B-A3B,
#: Qwen3-Next); on larger experts (Mixtral) the grouped GEMM wins.
GEMV_T1_MAX_WEIGHTS = 1 << 24
#: The pairs' dense GEMV (``kbit.ops.gemv_mma.pairs_linear``) reads an expert's weight once a pair, the grouped
#: kernels once a touched expert: the pairs launch while the expected reads a touched expert
#: (:func:`pairs_rereads`) stay at most this. H200, k = 4, decode steps against the grouped kernels: 1.28x at
#: 1.10 (Qwen3-30B-A3B-shaped, T = 4), 1.02x at 1.14 (Mixtral-shaped, T = 2), 1.16x at 1.24 (Qwen3, T = 8), 0.93x
#: at 1.30 (Mixtral, T = 3), 0.98x at 1.46 (Mixtral, T = 4); benchmarks/results/h200/moe-pairs-few-tokens-2026-11-29/
PAIRS_MAX_REREAD = 1.25

# ------------------------------------------------------------------------------------------------ fused router


@dataclass(frozen=True)
class FusedRouterConfig:
    """Launch config of ``kbit.kernels.moe.router_route_kernel``, grid ``(T, cdiv(E, chunk_e))``."""

    #: experts (weight rows) a program; it holds them in registers, loaded before its PDL wait
    chunk_e: int
    #: columns a program holds: a power of two >= H (whole rows, no loop over H)
    block_h: int
    #: warps a program
    num_warps: int = 4

    def __post_init__(self):
        for name in ("chunk_e", "block_h", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"FusedRouterConfig.{name}: expected a power of two >= 1, got {v!r}")


@functools.cache  # called on every launch: one object a (E, H)
def fused_router_config(E: int, H: int) -> FusedRouterConfig:
    """The fused router's programs for ``E`` experts of ``H`` columns: whole rows (``block_h`` = H rounded up to
    a power of two), ``num_warps = block_h / 1024`` (4..16) and 64 weight elements a thread (eight 16-byte
    loads, 32 registers), at least 2 experts a program.

    Why: the weight (256 KB at E = 64, H = 2048 to 3.5 MB at E = 256, H = 7168) never depends on the kernel
    before, so every program loads its chunk before the PDL wait, all chunks in flight at once, while that
    kernel runs (at T = 1 the norm before it holds one SM of 132). That needs the chunks in registers, hence a
    fixed amount a thread, and all programs of a token resident together: 16 (H = 2048, E = 64; 4 experts of
    16 KB) to 128 (H = 7168, E = 256; 2 experts of 28 KB, 8 warps) programs a token, one wave on a 132-SM H100
    at T = 1. Fewer experts a program would only add arrivals on the token's counter and programs the weight
    does not need; splitting H would need a second reduction across programs. After the wait a thread reads at
    most 32 columns of x (four 16-byte loads; with more, or with 1 expert a program, ptxas 13 issued them one
    after another between the sums: SASS of sm_90), and the last program of a token routes it with this many
    warps (fewer warps, fewer barriers in its reductions)."""
    block_h = 1 << max(0, H - 1).bit_length()
    num_warps = min(16, max(4, block_h // 1024))
    block_e = 1 << max(0, E - 1).bit_length()
    chunk_e = max(1, min(block_e, max(2, 64 * 32 * num_warps // block_h)))
    return FusedRouterConfig(chunk_e, block_h, num_warps)


# ------------------------------------------------------------------------------------------------ tail split

#: An expert's last block goes to kernel 4 (one 32-row block) when it has at most this many rows.
TAIL_ROWS = 32
#: The tail split runs where kernel 7 serves a step with blocks of this many rows (each short last block costs
#: kernel 7 a full block's weight lookups), on stacks of at least ``TAIL_SPLIT_MIN_E`` experts: with few
#: experts (Mixtral, 8) the few tails do not pay for the extra launches.
TAIL_SPLIT_BT = 256
TAIL_SPLIT_MIN_E = 64

# ------------------------------------------------------------------------------------------------ kernels 1 / 4

#: kernel 4 from this many 8-row groups a block ...
GROUPED4_MIN_NG = 2
#: ... and for single-group blocks (T = 1..4 decode steps) on short K (at most this many 256-column segments:
#: Qwen3-30B-A3B down, K = 768, and Qwen3-Next down, K = 512); longer K (gate_up, K = 2048) stays on kernel 1
GROUPED4_MAX_SEG_NG1 = 4
#: kernel 1: at most this many warps a CTA (one 256-column segment each)
GROUPED1_MAX_WARPS = 8


def rows_per_expert(P: int, E: int) -> float:
    """Expected rows per touched expert of ``P`` rows on ``E`` experts: ``P / min(E, P)``."""
    return P / max(1, min(E, P))


def pairs_rereads(T: int, top_k: int, E: int) -> float:
    """Expected reads of a touched expert's weight when ``T`` tokens' ``top_k`` pairs each read their expert:
    ``T top_k`` over the expected touched experts ``E (1 - (1 - top_k / E)^T)`` (the tokens' choices uniform and
    independent; 1 at T = 1)."""
    if T <= 1:
        return 1.0
    return T * top_k / (E * (1.0 - (1.0 - min(top_k, E) / E) ** T))


def block_groups(rpe: float) -> int:
    """8-row groups a block of kernels 1 / 4: the expected rows per touched expert rounded up to 8, 16, 32 or 64
    rows (kernel 4 holds 64-row blocks without register spills; more rows are more blocks, whose tile reads
    coincide in L2)."""
    return 1 if rpe <= 8 else 2 if rpe <= 16 else 4 if rpe <= 32 else 8


def grouped_kernel(ng: int, S: int | None = None) -> int:
    """Which of kernels 1 and 4 serves blocks of ``8 ng`` rows on ``S`` 256-column segments of K: kernel 4 from
    :data:`GROUPED4_MIN_NG` groups a block, or on short K (:data:`GROUPED4_MAX_SEG_NG1`), else kernel 1."""
    return 4 if ng >= GROUPED4_MIN_NG or (S is not None and S <= GROUPED4_MAX_SEG_NG1) else 1


@dataclass(frozen=True)
class GroupedMmaConfig:
    """Launch config of kernel 1 or kernel 4 for blocks of ``8 * ng`` rows."""

    #: 1 (``kbit_grouped_mma``) or 4 (``kbit_grouped_mma_pipe``)
    kernel: int
    #: 8-row groups a block
    groups: int
    #: warps a CTA (kernel 1: one a 256-column segment; kernel 4: one a 16-row weight tile of a work item)
    warps: int
    #: kernel 1: CTAs an SM asked of the compiler (``__launch_bounds__`` minimum blocks); kernel 4: 1
    min_blocks: int = 1
    #: kernel 4: shared-memory pipeline stages
    stages: int = 2

    def __post_init__(self):
        if self.kernel not in (1, 4):
            raise ValueError(f"GroupedMmaConfig.kernel: expected 1 or 4, got {self.kernel}")
        if self.groups not in (1, 2, 4, 8):
            raise ValueError(f"GroupedMmaConfig.groups: expected one of 1, 2, 4, 8, got {self.groups}")


@functools.cache  # called on every launch: one object a (ng, S, kernel)
def grouped_mma_config(ng: int, S: int, kernel: int | None = None) -> GroupedMmaConfig:
    """The config of kernel ``kernel`` (default :func:`grouped_kernel`) for blocks of ``8 ng`` rows on ``S``
    segments. Kernel 4: 4 warps on single-group blocks (decode: more CTAs), 16 on 64-row blocks, else 8.
    Kernel 1: a warp a segment (at most :data:`GROUPED1_MAX_WARPS`), 512 (``ng <= 2``) or 256 threads an SM."""
    kernel = kernel or grouped_kernel(ng, S)
    if kernel == 4:
        return GroupedMmaConfig(4, ng, 16 if ng == 8 else 4 if ng == 1 else 8)
    W = max(1, min(GROUPED1_MAX_WARPS, S))
    return GroupedMmaConfig(1, ng, W, max(1, (512 if ng <= 2 else 256) // (32 * W)))


# ------------------------------------------------------------------------------------------------ kernel 7

#: kernel 7 from this many rows per touched expert (the dense kernel 7 beat kernel 4 from M ~ 64)
WGMMA_MIN_ROWS = 48


@dataclass(frozen=True)
class WgmmaGroupedConfig:
    """Launch config of the grouped kernel 7 (sm_90 wgmma, x pre-tiled per block of a block table). Its fields are
    those of the dense kernel 7's config (``kbit.tuning.mma.LargeConfig`` on the dense path) that the grouped
    form uses."""

    #: warps a CTA
    warps: int
    #: 8-row groups a block: 8, 16 or 32 (64-, 128- or 256-row blocks)
    groups: int
    #: x pipeline stages (``D``; clamped to what shared memory holds)
    stages: int = 4
    #: token blocks a raster group (``GM``)
    raster: int = 8
    #: x tiles in wgmma's 128-byte swizzle (``XSW``)
    x_swizzle: bool = True
    #: x tiles by bulk copy with a CTA barrier (``XB`` 1): the one x loader kernel 7 is built with
    x_bulk: int = 1

    def __post_init__(self):
        check_wgmma_fixed(self)


_WGMMA_64 = WgmmaGroupedConfig(warps=16, groups=8, x_bulk=1)
_WGMMA_128 = WgmmaGroupedConfig(warps=12, groups=16, x_bulk=1)
_WGMMA_256 = WgmmaGroupedConfig(warps=8, groups=32, x_bulk=1)


def wgmma_config(rpe: float) -> WgmmaGroupedConfig:
    """Kernel 7's blocks for ``rpe`` rows per touched expert: 64 rows (16 warps) below 48, 128 rows (12 warps)
    below 192, else 256 rows (8 warps): 64 won at 20 rows an expert, 128 at 64-80, 256 at 256 (Mixtral; tied on
    Qwen3-30B-A3B)."""
    return _WGMMA_64 if rpe < 48 else _WGMMA_128 if rpe < 192 else _WGMMA_256
