"""Launch configs of the Triton GEMV kernels (``kbit.ops.gemv``): a frozen dataclass, the section ``"gemv"`` of the
per-GPU tables (``kbit.tuning.tables``) keyed by M bucket, a heuristic fallback (:func:`gemv_heuristic`).

Section format: ``{"dense" | "grouped": {"<k>": {"<M bucket>": {"BN": .., "G": .., "num_warps": ..,
"num_stages": ..}}}}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kbit.tuning.tables import gpu_key, m_bucket, section

__all__ = ["GemvConfig", "gemv_config", "gemv_heuristic"]


@dataclass(frozen=True)
class GemvConfig:
    BN: int  #: weight rows per program
    G: int  #: 32-column groups per K step (K step = 32 * G columns)
    num_warps: int
    num_stages: int = 4  #: pipelined kernel: software-pipelining depth of the K loop (cp.async stages)
    split: int = 0  #: K splits (dense only): 0 = choose from the grid size, 1 = none
    pps: int = 0  #: pipelined kernel: programs per SM of the persistent grid (0 = one program per tile)
    pipelined: bool = False  #: the v3 kernel (cp.async pipeline, persistent); False: v2 (plain loop)

    def as_dict(self):
        return asdict(self)


def gemv_heuristic(k: int, M: int, N: int, K: int, sms: int = 132, grouped: bool = False, P: int = 1) -> GemvConfig:
    """Few row blocks (N <= 8192) and M <= 4: the pipelined, persistent v3 kernel with thin tiles (4 rows x 64
    groups). Many row blocks, M = 8 and grouped: v2 (plain loop; 8 rows x 16 groups for k = 2, 4, 16 x 8 for
    k = 3, 5 and grouped), where v3 was 10-45% slower on an H100 (docs/notes/gemv.md)."""
    G = 16 if K >= 512 else max(1, 1 << (((K + 31) // 32).bit_length() - 1))
    if grouped:
        return GemvConfig(BN=16, G=min(G, 8), num_warps=4)
    if N <= 8192 and M <= 4 and K >= 2048:
        return GemvConfig(BN=4, G=64, num_warps=4, num_stages=4, pps=4, pipelined=True)
    if k in (3, 5):
        return GemvConfig(BN=16, G=min(G, 8), num_warps=4)
    return GemvConfig(BN=8, G=G, num_warps=4)


def gemv_config(k: int, M: int, N: int, K: int, device=None, grouped: bool = False, P: int = 1) -> GemvConfig:
    """The config of a launch of ``M`` (<= 8) rows: the table's entry for M's bucket, else :func:`gemv_heuristic`."""
    key = gpu_key(device) if device is not None else "generic"
    entry = section(key, "gemv").get("grouped" if grouped else "dense", {}).get(str(k), {}).get(
        str(m_bucket(min(M, 8))))
    if entry:
        return GemvConfig(**entry)
    sms = 132
    if key != "generic":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return gemv_heuristic(k, M, N, K, sms, grouped, P)
