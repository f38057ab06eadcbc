"""Which kernel and launch config computes ``x @ W.T`` for a k-bit weight: per-GPU JSON tables keyed by
M bucket (and optionally by weight shape), a heuristic fallback; never autotuning at the first call.

Kernels (``Choice.kernel``):

- ``"gemv"``: ``kbit.ops.gemv.gemv``: on CUDA with NVRTC the tensor-core small-M kernel
  (``kbit.ops.gemv_mma``, M <= :data:`MMA_MAX_M`), else the Triton GEMV (M <= 8, config from ``kbit.tuning.gemv``);
- ``"fused"``: ``kbit.ops.gemm.gemm_fused`` (tensor cores on tiles decoded in registers) with a
  :class:`GemmConfig`;
- ``"dequant_mm"``: ``kbit.ops.dequant`` to a bf16/fp16 weight, then cuBLAS (``F.linear``); for large M,
  where the decode cost of the fused kernel is paid once per weight instead of once per M tile.

Table files ``configs/gemm_<gpu>.json`` (``<gpu>`` = :func:`kbit.tuning.gemv.gpu_key`)::

    {"dense": {"<k>": {"<M bucket>": {"kernel": "fused", "BM": 16, ...},
                       "<N>x<K>": {"<M bucket>": {...}}}}}

A ``"<N>x<K>"`` entry (measured on that shape) wins over the k-wide entry; missing entries fall back to
:func:`heuristic`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kbit.tuning.gemv import gpu_key

_CONFIGS = Path(__file__).with_name("configs")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
KERNELS = ("gemv", "fused", "dequant_mm")


@dataclass(frozen=True)
class GemmConfig:
    """Launch config of ``kbit.kernels.gemm.gemm_kernel``.

    BM, BN, BK: tile (activation rows, weight rows, columns a step; BK a multiple of 32).
    SWAP: compute the tile transposed (weight rows on the MMA's wide side; for small M).
    SPLIT_K: K splits (atomic fp32 reduction); 0 = choose from the grid size.
    GROUP_M: row tiles grouped in the launch order (L2 reuse of weight tiles).
    """

    BM: int = 16
    BN: int = 128
    BK: int = 128
    SWAP: bool = True
    SPLIT_K: int = 0
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Choice:
    kernel: str
    config: GemmConfig = field(default_factory=GemmConfig)


def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    return M_BUCKETS[-1]


@functools.cache
def _table(key: str) -> dict:
    path = _CONFIGS / f"gemm_{key}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _from_entry(entry: dict) -> Choice:
    entry = dict(entry)
    kernel = entry.pop("kernel", "fused")
    entry.pop("_us", None)
    return Choice(kernel, GemmConfig(**entry))


def fused_heuristic(M: int, N: int, K: int, k: int) -> GemmConfig:
    """Swap-AB tiles with a 16..64-row activation side up to M = 64; square 128 x 128 tiles above."""
    if M <= 64:
        bm = 16
        while bm < min(M, 64):
            bm *= 2
        return GemmConfig(BM=bm, BN=128, BK=128 if bm <= 32 else 64, SWAP=True, num_warps=4, num_stages=3)
    return GemmConfig(BM=128, BN=128, BK=64, SWAP=False, num_warps=8, num_stages=3)


def heuristic(M: int, N: int, K: int, k: int, has_gemv: bool = True) -> Choice:
    if M <= 8 and has_gemv:
        return Choice("gemv")
    if M > 128:  # H100 run 2: dequantize + cuBLAS beat the fused kernel at every M >= 256
        return Choice("dequant_mm")
    return Choice("fused", fused_heuristic(M, N, K, k))


#: Up to this M the CUDA tensor-core small-M kernel (``kbit.ops.gemv_mma``, reached through ``"gemv"``) wins:
#: H100, benchmarks/results/h100/mma-2026-11-21-final.md against the fused entries of configs/gemm_h100.json,
#: k = 2 and 4 on the four benchmark shapes: 1.8-3.0x faster at M = 16, 1.1-1.8x at M = 32; with its kernel 4
#: (benchmarks/results/h100/mid-2026-11-21-run3.log) 1.15-1.9x faster than the fused entries at M = 64 as well.
MMA_MAX_M = 64

#: With its wgmma kernel 7 (sm_90) the same entry point serves larger M too: ``kbit.ops.gemv_mma.large_serves``
#: (session 4: up to 256, from benchmarks/results/h100/large7-2026-11-22-run7.log; session 6, x bulk-copied: up to
#: 2048, and every M on weights of >= 2e8 elements, from benchmarks/results/h100/large7-s6-run*.log).


def _large_serves(M: int, N: int, K: int) -> bool:
    from kbit.ops.gemv_mma import large_serves

    return large_serves(M, N, K)


def choose(M: int, N: int, K: int, k: int, device=None, grouped: bool = False, mma: bool = False,
           large: bool = False) -> Choice:
    """The kernel and config for ``M`` activation rows on a k-bit ``[N, K]`` weight on ``device``.

    ``mma``: the CUDA small-M kernel can run there (then it serves every dense M <= :data:`MMA_MAX_M`);
    ``large``: and its sm_90 kernel 7 too (dense M where ``kbit.ops.gemv_mma.large_serves``)."""
    if mma and not grouped and (_large_serves(M, N, K) if large else M <= MMA_MAX_M):
        return Choice("gemv")
    key = gpu_key(device) if device is not None else "generic"
    kt = _table(key).get("grouped" if grouped else "dense", {}).get(str(k), {})
    b = str(m_bucket(M))
    entry = kt.get(f"{N}x{K}", {}).get(b) or kt.get(b)
    if entry:
        return _from_entry(entry)
    return heuristic(M, N, K, k)


def split_k(cfg: GemmConfig, M: int, N: int, kp: int, sms: int) -> int:
    """K splits: enough programs for about two per SM when the output tiles alone are too few, each split
    keeping at least 4 K steps."""
    if cfg.SPLIT_K >= 1:
        return max(1, min(cfg.SPLIT_K, kp // cfg.BK))
    tiles = -(-M // cfg.BM) * -(-N // cfg.BN)
    if tiles >= sms:
        return 1
    want = -(-2 * sms // tiles)
    return max(1, min(want, kp // (4 * cfg.BK)))


__all__ = ["Choice", "GemmConfig", "KERNELS", "MMA_MAX_M", "M_BUCKETS", "choose", "heuristic",
           "m_bucket", "replace", "split_k"]
