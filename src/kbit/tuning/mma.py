"""Launch configs of the swap-AB tensor-core kernels (``kbit.ops.gemv_mma``): what they are and which one a shape
gets.

Kernels 1, 3 and 4 serve up to :data:`MAX_M` rows a launch (sm_80 and up); kernel 7 (wgmma, sm_90) serves larger M
in one launch. A config is a frozen dataclass: :class:`MmaConfig` (kernels 1, 3, 4) or :class:`LargeConfig`
(kernel 7). The default for a shape comes from an ordered rule table (``configs/<gpu>.json``, section ``"mma"`` /
``"large"``, else ``configs/default.json``; first match wins), with :func:`mma_heuristic` where no rule matches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kbit.tuning.mma_units import cau_plan, read_us
from kbit.tuning.tables import section

__all__ = ["BIG", "LARGE7_BIG_NK", "LARGE7_MAX_M", "LARGE7_MIN_M", "LARGE7_SMALL_NK", "MAX_M", "PIPE", "SEG",
           "LargeConfig", "MmaConfig", "default_config", "large_config", "large_ok", "large_serves", "mma_heuristic",
           "n_groups", "uses_large"]

#: rows a launch of kernels 1, 3, 4 (larger M runs in chunks of this many)
MAX_M = 64
#: K columns a segment (the unit of the layout "mma-v1" along K)
SEG = 256
#: kernel 3: register ring depth (segments) per k, where a config leaves it at 0
PIPE = {2: 2, 3: 3, 4: 2, 5: 2}
#: N * K from which many tiles or long K change the best config (the rule tables use the same bound)
BIG = 2 * 10**8
#: kernel 7 serves every M from this on sm_90 (at M = 16 kernels 1 and 3 win)
LARGE7_MIN_M = 17
#: kernel 7 serves every M up to this; above it only weights of at least LARGE7_BIG_NK elements (dequantize + cuBLAS
#: wins by ~5% below that at M = 4096, kernel 7 by 4-8% above)
LARGE7_MAX_M = 2048
LARGE7_BIG_NK = 2 * 10**8
#: below this many weight elements, M 65..256 goes to dequantize + cuBLAS and M 17..64 to kernel 1 (a CTA of 8
#: warps a tile, 2 CTAs an SM): kernel 7's 64-token tiles are too few there to fill the GPU
LARGE7_SMALL_NK = 2 * 10**7


@dataclass(frozen=True)
class MmaConfig:
    """Launch config of kernels 1, 3 and 4 (up to :data:`MAX_M` rows a launch)."""

    #: 1: a CTA per (16-row tile, K split), its warps take the split's segments round-robin; 3: stream-K, each warp
    #: a contiguous range of (tile, segment) pairs through a register ring; 4: stream-K over (row block, segment)
    #: pairs, x / codes / scales through a cp.async shared-memory pipeline
    kernel: int
    #: warps a CTA
    warps: int
    #: CTAs an SM the build is bounded for (``MINB`` of ``__launch_bounds__``)
    min_ctas: int = 1
    #: kernel 4: 16-row tiles a warp (``RT``)
    rows_per_warp: int = 1
    #: kernel 4: pipeline stages (``D``)
    stages: int = 3
    #: kernel 3: register ring depth in segments (``PD``); 0: :data:`PIPE` of k
    ring: int = 0
    #: kernel 3: x staged in shared memory (``XS``) where it fits
    x_smem: bool = False
    #: kernel 3: K slices of this many segments with x in shared memory (``XK``; 0: none); it also caps the grid's
    #: CTAs an SM at this value
    x_slice: int = 0
    #: kernel 1: CTAs an SM in the grid, below the occupancy (0: the occupancy)
    grid_ctas: int = 0
    #: kernel 3 at k = 5: codes looked up in pairs from one 1024-entry table (``P5``; 128 KB of shared memory, so one
    #: CTA an SM); other k ignore it (their tables already hold pairs, k = 2 has none)
    pair_table: bool = False

    def __post_init__(self):
        if self.kernel not in (1, 3, 4):
            raise ValueError(f"config: kernel expected 1, 3 or 4 (7: LargeConfig), got {self.kernel}")
        if self.pair_table and (self.kernel != 3 or self.min_ctas != 1):
            raise ValueError(f"config.pair_table: expected kernel 3 at min_ctas 1 (the 128 KB table leaves one CTA "
                             f"an SM), got kernel {self.kernel} at min_ctas {self.min_ctas}")

    @classmethod
    def of(cls, t: tuple) -> MmaConfig:
        """From the positional form that result files of earlier runs record: ``(1, warps, min_ctas[, grid_ctas])``,
        ``(3, warps, min_ctas[, ring[, x_smem[, x_slice[, pair_table]]]])``,
        ``(4, warps, rows_per_warp[, stages[, min_ctas]])``."""
        t = tuple(int(v) for v in t)
        if len(t) < 3:
            raise ValueError(f"config: expected (kernel, warps, X, ...), got {t}")
        if t[0] == 1:
            return cls(1, t[1], min_ctas=t[2], grid_ctas=t[3] if len(t) > 3 else 0)
        if t[0] == 4:
            return cls(4, t[1], rows_per_warp=t[2], stages=t[3] if len(t) > 3 else 3,
                       min_ctas=t[4] if len(t) > 4 else 1)
        return cls(t[0], t[1], min_ctas=t[2], ring=t[3] if len(t) > 3 else 0, x_smem=len(t) > 4 and bool(t[4]),
                   x_slice=t[5] if len(t) > 5 else 0, pair_table=len(t) > 6 and bool(t[6]))

    def legacy(self, k: int) -> tuple:
        """The positional form of :meth:`of` (kernel 3's ring resolved for ``k``), to match result files."""
        if self.kernel == 1:
            return (1, self.warps, self.min_ctas) + ((self.grid_ctas,) if self.grid_ctas else ())
        if self.kernel == 4:
            return (4, self.warps, self.rows_per_warp, self.stages) + ((self.min_ctas,) if self.min_ctas != 1 else ())
        t = (3, self.warps, self.min_ctas, self.ring or PIPE[k])
        if self.x_smem or self.x_slice or self.pair_table:
            t += (int(self.x_smem),)
        if self.pair_table:
            return t + (self.x_slice, 1)
        return t + ((self.x_slice,) if self.x_slice else ())


def check_wgmma_fixed(cfg) -> None:
    """Kernel 7's source (``csrc/wgmma.cu``) is built with one raster group size, the swizzled x tiles, bulk copies
    with a CTA barrier and its own refill lag (the other variants were experiments and are gone): a config that asks
    for another value is refused rather than silently built as these."""
    for name, want in (("raster", 8), ("x_swizzle", True), ("x_bulk", 1), ("refill_lag", 0)):
        got = getattr(cfg, name, want)
        if got != want:
            raise ValueError(f"config.{name}: expected {want!r} (the value kernel 7 is built with), got {got!r}")


@dataclass(frozen=True)
class LargeConfig:
    """Launch config of kernel 7 (wgmma, sm_90; dense: any M in one launch; grouped: ``kbit.ops.grouped_mma``)."""

    #: warps a CTA
    warps: int
    #: 8-token groups a tile: 4 (32 tokens), 8 (64), 16 (128) or 32 (256). Not 16-token tiles: at M = 16 they took
    #: 1.21x (median of 44 shapes) the time of kernel 3 (benchmarks/results/h200/k7-n16-2026-11-28/)
    groups: int
    #: x pipeline stages (``D``; clamped to 3 .. 8 and to shared memory)
    stages: int = 4
    #: token blocks a raster group (``GM``): 8, the one value ``wgmma.cu`` is built with
    raster: int = 8
    #: x tiles in wgmma's 128-byte swizzle (``XSW``): always, in ``wgmma.cu``
    x_swizzle: bool = True
    #: x pre-tiled and bulk-copied with a CTA barrier (``XB`` 1): the one x loader ``wgmma.cu`` has
    x_bulk: int = 1
    #: chunks between a stage's last read and its refill: 0, the source's fixed lag
    refill_lag: int = 0
    #: stream-K over (tile, segment) pairs (``SK``; dense only)
    stream_k: bool = False

    kernel = 7

    def __post_init__(self):
        if self.groups not in (4, 8, 16, 32):
            raise ValueError(f"config.groups: expected 4, 8, 16 or 32 (the tiles kernel 7 is built for), "
                             f"got {self.groups!r}")
        check_wgmma_fixed(self)

    @classmethod
    def of(cls, t: tuple) -> LargeConfig:
        """From the positional form ``(7, warps, groups, stages, raster, x_swizzle, x_bulk, refill_lag, stream_k)``
        that result files and the recorded plans of ``tests/data`` hold."""
        names = [f.name for f in fields(cls)]
        if not t or t[0] != 7 or len(t) < 3:
            raise ValueError(f"config: expected (7, warps, groups, ...), got {t}")
        vals = dict(zip(names, t[1:], strict=False))
        for b in ("x_swizzle", "stream_k"):
            if b in vals:
                vals[b] = bool(vals[b])
        return cls(**vals)


def n_groups(M: int) -> int:
    """8-token groups of a launch of kernels 1, 3, 4 (``NG``): 1, 2, 4, 8 for M up to 8, 16, 32, 64."""
    return 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else 8 if M <= 64 else 16 if M <= 128 else 32


def cau_mid(k: int, N: int, K: int, sms: int | None) -> bool:
    """M = 9..16 on sm_90: kernel 3 (8 warps, 2 CTAs an SM) with CTA-aligned units beats the K slices where the plan
    would take those units: below BIG weights (k = 5: below 1e8)."""
    if not sms or N * K >= BIG or (k == 5 and N * K >= 10**8):
        return False
    return cau_plan(-(-N // 16), -(-K // SEG), 8, 2, sms, 0, 2, read_us(k, N, K)) is not None


def _matches(cond: dict, k: int, M: int, N: int, K: int, sm90: bool, sms: int | None) -> bool:
    """Whether a rule's conditions (``configs/default.json`` describes them) hold."""
    nk = N * K
    checks = {
        "sm90": lambda v: sm90 == v,
        "ng": lambda v: n_groups(M) in v,
        "k": lambda v: k in v,
        "M_min": lambda v: M >= v,
        "M_max": lambda v: M <= v,
        "N_min": lambda v: N >= v,
        "N_max": lambda v: N <= v,
        "NK_min": lambda v: nk >= v,
        "NK_below": lambda v: nk < v,
        "tiles_per_sm_max": lambda v: bool(sms) and N <= 16 * v * sms,
        "cau_mid": lambda v: cau_mid(k, N, K, sms) == v,
    }
    for name, v in cond.items():
        if name not in checks:
            raise ValueError(f"rule condition: expected one of {sorted(checks)}, got {name!r}")
        if not checks[name](v):
            return False
    return True


def _first_rule(family: str, gpu: str, k, M, N, K, sm90, sms) -> dict | None:
    for rule in section(gpu, family).get("rules", ()):
        if _matches(rule["if"], k, M, N, K, sm90, sms):
            return rule["config"]
    return None


def mma_heuristic(k: int, M: int, N: int, K: int) -> MmaConfig:
    """Where no rule matches: kernel 1, 8 warps a CTA, 2 CTAs an SM (every tile its CTAs, K split to fill the
    GPU)."""
    return MmaConfig(kernel=1, warps=8, min_ctas=2)


def default_config(k: int, M: int, N: int, K: int, sm90: bool = False, sms: int | None = None,
                   gpu: str = "generic") -> MmaConfig:
    """The config of one launch of kernels 1, 3, 4 for ``M`` (<= :data:`MAX_M`) rows on a k-bit ``[N, K]`` weight.
    ``sm90``: an H100-class GPU (some rules were measured there only); ``sms``: its SM count (rules that count CTA
    slots need it; None: those rules are not taken); ``gpu``: the table key (``kbit.tuning.tables.gpu_key``)."""
    entry = _first_rule("mma", gpu, k, M, N, K, sm90, sms)
    return MmaConfig(**entry) if entry is not None else mma_heuristic(k, M, N, K)


def large_config(k: int, M: int, N: int, K: int, gpu: str = "generic") -> LargeConfig:
    """Kernel 7's config for ``M`` rows on a k-bit ``[N, K]`` weight (rule table ``"large"``)."""
    entry = _first_rule("large", gpu, k, M, N, K, True, None)
    if entry is None:
        return LargeConfig(warps=8, groups=32, x_bulk=1)
    return LargeConfig(**entry)


def large_ok(device) -> bool:
    """Kernel 7 runs here: sm_90 (it is compiled for sm_90a)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def uses_large(M: int, N: int, K: int, device) -> bool:
    """Whether ``M`` rows run as one kernel 7 launch: M >= :data:`LARGE7_MIN_M` on sm_90, except small weights
    at M <= :data:`MAX_M` (kernel 1 there)."""
    return M >= LARGE7_MIN_M and large_ok(device) and not (M <= MAX_M and N * K < LARGE7_SMALL_NK)


def large_serves(M: int, N: int, K: int) -> bool:
    """Whether the swap-AB family serves dense ``M`` rows on an ``[N, K]`` weight where kernel 7 runs (sm_90):
    every M up to :data:`LARGE7_MAX_M` except small weights at M 65..256, and every M on weights of at least
    :data:`LARGE7_BIG_NK` elements (elsewhere dequantize + cuBLAS is faster)."""
    if N * K < LARGE7_SMALL_NK and MAX_M < M <= 256:
        return False
    return M <= LARGE7_MAX_M or N * K >= LARGE7_BIG_NK
