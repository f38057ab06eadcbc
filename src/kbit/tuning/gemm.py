"""Launch configs of the Triton fused GEMM (``kbit.ops.gemm.gemm_fused``) and which of the GEMM-class kernels
serves an M: per-GPU tables keyed by M bucket (and optionally by weight shape), a heuristic fallback; never
autotuning at the first call.

Kernels (``Choice.kernel``): ``"gemv"`` (the small-M kernels: ``kbit.dispatch`` picks the CUDA or the Triton one),
``"fused"`` (tensor cores on tiles decoded in registers, with a :class:`GemmConfig`) and ``"dequant_mm"``
(``kbit.ops.dequant`` to a 16-bit weight, then cuBLAS: for large M, where the fused kernel's decode cost is paid
once per M tile instead of once per weight).

Section ``"gemm"`` of ``configs/<gpu>.json`` (``kbit.tuning.tables``)::

    {"dense": {"<k>": {"<M bucket>": {"kernel": "fused", "BM": 16, ...},
                       "<N>x<K>": {"<M bucket>": {...}}}}}

A ``"<N>x<K>"`` entry (measured on that shape) wins over the k-wide entry; missing entries fall back to
:func:`gemm_heuristic`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kbit.tuning.tables import gpu_key, m_bucket, section

__all__ = ["KERNELS", "MMA_MAX_M", "Choice", "GemmConfig", "fused_heuristic", "gemm_choice", "gemm_heuristic",
           "split_k"]

KERNELS = ("gemv", "fused", "dequant_mm")
#: up to this M the CUDA small-M kernels (``kbit.ops.gemv_mma``) beat the fused entries of the GEMM table on an
#: H100 (1.8-3.0x at M = 16, 1.1-1.8x at M = 32, 1.15-1.9x with kernel 4 at M = 64)
MMA_MAX_M = 64


@dataclass(frozen=True)
class GemmConfig:
    """Launch config of ``kbit.kernels.gemm.gemm_kernel``."""

    BM: int = 16  #: activation rows a tile
    BN: int = 128  #: weight rows a tile
    BK: int = 128  #: columns a K step (a multiple of 32)
    SWAP: bool = True  #: the tile computed transposed (weight rows on the MMA's wide side; for small M)
    SPLIT_K: int = 0  #: K splits (atomic fp32 reduction); 0 = choose from the grid size
    GROUP_M: int = 8  #: row tiles grouped in the launch order (L2 reuse of weight tiles)
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Choice:
    kernel: str  #: one of :data:`KERNELS`
    config: GemmConfig = field(default_factory=GemmConfig)  #: the fused kernel's config


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


def gemm_heuristic(M: int, N: int, K: int, k: int, has_gemv: bool = True) -> Choice:
    """The GEMV up to M = 8, dequantize + cuBLAS above M = 128 (it beat the fused kernel at every M >= 256 on an
    H100), the fused kernel between."""
    if M <= 8 and has_gemv:
        return Choice("gemv")
    if M > 128:
        return Choice("dequant_mm")
    return Choice("fused", fused_heuristic(M, N, K, k))


def gemm_choice(M: int, N: int, K: int, k: int, device=None, grouped: bool = False) -> Choice:
    """The kernel and config of the table for ``M`` activation rows on a k-bit ``[N, K]`` weight on ``device``
    (without the CUDA small-M kernels: ``kbit.dispatch`` decides those first)."""
    key = gpu_key(device) if device is not None else "generic"
    kt = section(key, "gemm").get("grouped" if grouped else "dense", {}).get(str(k), {})
    b = str(m_bucket(M))
    entry = kt.get(f"{N}x{K}", {}).get(b) or kt.get(b)
    if entry:
        return _from_entry(entry)
    return gemm_heuristic(M, N, K, k)


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
