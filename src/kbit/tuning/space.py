"""The config spaces ``kbit tune`` searches: for a (k, M, N, K) and what the GPU runs, every kernel family's configs.

A :class:`Candidate` is a kernel family and one config of it, as data:

==============  ===========================================  ====================================================
family          config                                       serves
==============  ===========================================  ====================================================
``mma``         :class:`~kbit.tuning.mma.MmaConfig`          CUDA kernels 1, 3, 4 (M in chunks of 64 rows)
``large``       :class:`~kbit.tuning.mma.LargeConfig`        CUDA kernel 7 (wgmma, sm_90; any M, one launch)
``fused``       :class:`~kbit.tuning.gemm.GemmConfig`        the Triton fused GEMM
``gemv``        :class:`~kbit.tuning.gemv.GemvConfig`        the Triton GEMV (M <= 8)
``dequant_mm``  none                                         dequantize to bf16, then cuBLAS
==============  ===========================================  ====================================================

The spaces are the values the rule tables (``configs/*.json``) and the labs already use, crossed, not every legal
launch: a few dozen configs a family, so that one (shape, M) is searched in seconds. ``quick`` keeps a handful
(the current default and its nearest neighbours) and, where kernel 7 runs, only the families that came near the
best in the first tuning run (:data:`QUICK_FAMILIES`). Configs that cannot launch on the shape (their plan refuses
them: shared memory) are left out of every space (:func:`infeasible` says why), so that no trial fails by design.
Dequantize + cuBLAS is a candidate at every M above 8 (it is the one that wins at large M on small weights).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field

from kbit.tuning.gemm import GemmConfig
from kbit.tuning.gemv import GemvConfig
from kbit.tuning.mma import MAX_M, LargeConfig, MmaConfig, n_groups
from kbit.tuning.mma_plan import check_config

__all__ = ["FAMILIES", "QUICK_FAMILIES", "X_SLICE", "Candidate", "candidate_from_dict", "infeasible", "search_space"]

FAMILIES = ("mma", "large", "fused", "gemv", "dequant_mm")
#: the quick space's families by M where kernel 7 runs (sm_90): in the first tuning run (H200, k = 4, five shapes,
#: ``benchmarks/results/h200/tune-part-2026-11-25-*``) the Triton fused GEMM took 2.2-5.0x the best at M = 16 and
#: 256, and kernels 1, 3, 4 (in chunks of 64 rows) 2.8-4.7x at M = 256, while kernel 7 was within 1.16-1.35x at
#: M = 16; dequantize + cuBLAS stays at every M above 8 (no build to pay, and the best at M = 256 on 2880x4096)
QUICK_FAMILIES = ((8, ("mma",)), (MAX_M, ("mma", "large", "dequant_mm")), (None, ("large", "dequant_mm")))
#: kernel 3's K slice of staged x (segments) in the search space: the form it tunes where the whole x does not fit
X_SLICE = 8
_CONFIG_TYPES = {"mma": MmaConfig, "large": LargeConfig, "fused": GemmConfig, "gemv": GemvConfig}


@dataclass(frozen=True)
class Candidate:
    """A kernel family and one config of it (``config`` None for ``dequant_mm``)."""

    family: str
    config: MmaConfig | LargeConfig | GemmConfig | GemvConfig | None = field(default=None)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        want = _CONFIG_TYPES.get(self.family)
        if (want is None) != (self.config is None) or (want is not None and not isinstance(self.config, want)):
            got = type(self.config).__name__
            raise TypeError(f"config: expected {want.__name__ if want else 'None'} for family {self.family!r}, "
                            f"got {got}")

    def as_dict(self) -> dict:
        return {"family": self.family, "config": None if self.config is None else asdict(self.config)}

    @property
    def key(self) -> str:
        """A stable text key (family and sorted config values): the same candidate measured on several shapes."""
        return json.dumps(self.as_dict(), sort_keys=True)


def candidate_from_dict(d: dict) -> Candidate:
    """The inverse of :meth:`Candidate.as_dict`."""
    family = d.get("family")
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    cfg = d.get("config")
    typ = _CONFIG_TYPES.get(family)
    return Candidate(family, None if typ is None or cfg is None else typ(**cfg))


def _mma(k: int, M: int, quick: bool) -> list[MmaConfig]:
    out = [MmaConfig(1, w, min_ctas=c) for w, c in ((4, 4), (4, 6), (8, 1), (8, 2), (8, 3), (8, 4), (16, 1))]
    for (w, c), ring, xs in itertools.product(((4, 4), (8, 2), (16, 1)), (2, 3), (False, True)):
        out.append(MmaConfig(3, w, min_ctas=c, ring=ring, x_smem=xs))
    out += [MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=X_SLICE),
            MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True, x_slice=X_SLICE)]
    if n_groups(M) >= 2:  # kernel 4 (pipelined, shared-memory stages) serves two or more token groups
        out += [MmaConfig(4, w, rows_per_warp=r, stages=s) for w, r, s in itertools.product((8, 16), (1, 2), (2, 3))]
    if quick:  # kernel 1 with 3 CTAs an SM: the built-in rules' choice at M = 1 on small weights took 0.83-0.94x
        # the time of the best other quick config there (H200, tune-suite run of 2026-11-26, k = 2..4, 4608x3584)
        # kernel 3 with one CTA of 16 warps an SM: the full space's best on 3 of 5 large shapes at k = 2, M = 1
        # (H100, 2026-11-27: 8192x28672 34.98 us against the quick space's 40.61)
        # kernel 3 with two CTAs of 8 warps and x from global memory: the shipped rules' pick on mid shapes of
        # 37-44M weights at M = 4..16, which a quick retune without it replaced by 16 warps at one CTA and lost up to
        # 12.6% (H200, 7168x5120 M = 8, benchmarks/results/h200/midm-retune-2026-11-28/)
        keep = {MmaConfig(1, 8, min_ctas=2), MmaConfig(1, 8, min_ctas=3), MmaConfig(1, 4, min_ctas=4),
                MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True), MmaConfig(3, 8, min_ctas=2, ring=2),
                MmaConfig(3, 16, min_ctas=1, ring=2),
                MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True),
                MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=X_SLICE), MmaConfig(4, 8, stages=2),
                MmaConfig(4, 16, stages=2)}
        out = [c for c in out if c in keep]
    if k == 5:  # the pair table (one CTA an SM): 16 warps, ring 2 were the best of 16 / 32 / 8 warps and rings 2 / 3
        # at M = 1, 4, 16 on 12 shapes (H100, lab/p5_ab.py, benchmarks/results/h100/p5-ab-2026-11-27.md)
        out.append(MmaConfig(3, 16, min_ctas=1, ring=2, x_smem=True, pair_table=True))
    return out


def _large(M: int, quick: bool) -> list[LargeConfig]:
    groups = [g for g in (4, 8, 16, 32) if g == 4 or 8 * g <= 2 * max(M, 32)]  # tiles of at most 2 x M tokens
    out = [LargeConfig(warps=w, groups=g, stages=s, stream_k=sk)
           for w, g, s, sk in itertools.product((8, 12, 16), groups, (4, 6), (False, True))]
    if quick:  # 8 warps: where kernel 7 was the best family in the first tuning run (tune-part-2026-11-25, H200,
        # k = 4, M = 256 on 4 shapes), its best 8-warp config took 0.57-0.996x the time of the best 12-warp one;
        # up to 64 rows also 12 and 16 warps with stream-K, the built-in rules' choices there (configs/default.json)
        out = [c for c in out if c.stages == (6 if c.groups <= 8 else 4)
               and (c.warps == 8 or (M <= 64 and c.groups <= 8 and c.stream_k))]
    return out


def _fused(M: int, quick: bool) -> list[GemmConfig]:
    if M <= 64:
        bm = max(16, min(64, 1 << (M - 1).bit_length()))
        out = [GemmConfig(BM=bm, BN=bn, BK=bk, SWAP=True, num_warps=4, num_stages=s)
               for bn, bk, s in itertools.product((64, 128), (64, 128), (3, 4))]
    else:
        out = [GemmConfig(BM=bm, BN=bn, BK=64, SWAP=False, num_warps=w, num_stages=s)
               for bm, bn, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4)) if bm * bn <= 128 * 256]
    return out[:4] if quick else out


def _gemv(M: int, K: int, quick: bool) -> list[GemvConfig]:
    G = 16 if K >= 512 else max(1, 1 << (((K + 31) // 32).bit_length() - 1))
    out = [GemvConfig(BN=bn, G=g, num_warps=4) for bn, g in itertools.product((4, 8, 16), sorted({min(G, 8), G}))]
    out += [GemvConfig(BN=bn, G=64, num_warps=4, num_stages=s, pps=p, pipelined=True)
            for bn, s, p in itertools.product((4, 8), (3, 4), (2, 4)) if K >= 2048]
    return out[:4] if quick else out


def _chunks(M: int) -> list[int]:
    """Row counts of the launches of kernels 1, 3, 4 for ``M`` rows (chunks of :data:`MAX_M`)."""
    return sorted({min(M, MAX_M)} | ({M % MAX_M} if M > MAX_M and M % MAX_M else set()))


def infeasible(cand: Candidate, k: int, M: int, N: int, K: int) -> str | None:
    """Why ``cand`` cannot launch for ``M`` rows on a k-bit ``[N, K]`` weight (its plan's refusal: e.g. kernel 3's x
    slices over the shared memory), or None. Arithmetic only: a build's limits are the plan's to respect."""
    if cand.family not in ("mma", "large"):
        return None
    try:
        for m in _chunks(M) if cand.family == "mma" else [M]:
            check_config(k, m, N, K, cand.config)
    except ValueError as e:
        return str(e)
    return None


def _quick_families(M: int) -> tuple[str, ...]:
    for bound, fams in QUICK_FAMILIES:
        if bound is None or M <= bound:
            return fams
    return FAMILIES


def search_space(k: int, M: int, N: int, K: int, *, cuda: bool = True, sm90: bool = True,
                 families: tuple[str, ...] | None = None, quick: bool = False) -> list[Candidate]:
    """The candidates of ``families`` (default: every family that serves M here; ``quick`` on sm_90:
    :data:`QUICK_FAMILIES`) for ``M`` rows on a k-bit ``[N, K]`` weight, without those that cannot launch there
    (:func:`infeasible`). ``cuda``: the NVRTC kernels run; ``sm90``: kernel 7 too (an H100-class GPU)."""
    if families is None:
        families = tuple(f for f in FAMILIES if f != "gemv" or not cuda)
        if quick and cuda and sm90:
            families = tuple(f for f in families if f in _quick_families(M))
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"families: expected a subset of {FAMILIES}, got {f!r}")
    out: list[Candidate] = []
    if "mma" in families and cuda and M <= 4 * MAX_M:
        out += [Candidate("mma", c) for c in _mma(k, M, quick)]
    if "large" in families and cuda and sm90 and M > 8:
        out += [Candidate("large", c) for c in _large(M, quick)]
    if "fused" in families and M > 8:
        out += [Candidate("fused", c) for c in _fused(M, quick)]
    if "gemv" in families and M <= 8:
        out += [Candidate("gemv", c) for c in _gemv(M, K, quick)]
    if "dequant_mm" in families and M > 8:
        out.append(Candidate("dequant_mm"))
    return [c for c in out if infeasible(c, k, M, N, K) is None]
