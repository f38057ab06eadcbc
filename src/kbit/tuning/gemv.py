"""Launch configs for the GEMV kernels: a frozen dataclass, per-GPU JSON tables keyed by M bucket,
a heuristic fallback.

Table files: ``configs/gemv_<gpu>.json`` (``<gpu>`` = :func:`gpu_key`), ``{"<k>": {"<M bucket>": {"BN": ..,
"G": .., "num_warps": .., "num_stages": ..}}}``. Missing entries fall back to :func:`heuristic`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

_CONFIGS = Path(__file__).with_name("configs")
M_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GemvConfig:
    BN: int  # weight rows per program
    G: int  # 32-column groups per K step (K step = 32 * G columns)
    num_warps: int
    num_stages: int = 4  # pipelined kernel: software-pipelining depth of the K loop (cp.async stages)
    split: int = 0  # K splits (dense only): 0 = choose from the grid size, 1 = none
    pps: int = 0  # pipelined kernel: programs per SM of the persistent grid (0 = one program per tile)
    pipelined: bool = False  # the v3 kernel (cp.async pipeline, persistent); False: v2 (plain loop)

    def as_dict(self):
        return asdict(self)


def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    return M_BUCKETS[-1]


def gpu_key(device) -> str:
    """'h100', 'h200', ... from the device name; 'generic' off CUDA."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return "generic"
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h100", "h200", "h20", "a100", "l40s", "l4", "4090", "3090"):
        if key in name:
            return key
    return "generic"


@functools.cache
def _table(key: str) -> dict:
    path = _CONFIGS / f"gemv_{key}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def heuristic(k: int, M: int, N: int, K: int, sms: int = 132, grouped: bool = False, P: int = 1) -> GemvConfig:
    """From the H100 runs 2-4 (docs/notes/gemv.md). Few row blocks (N <= 8192) and M <= 4: the pipelined,
    persistent v3 kernel with thin tiles (4 rows x 64 groups): 4096x14336 k = 4 23 us (v2 29.5), 4096x4096
    10 us (v2 12.7, its split kernels gone). Many row blocks, M = 8 and grouped: v2 (plain loop, 8 rows x 16
    groups for k = 2, 4, 16 x 8 for k = 3, 5, 16 x 8 grouped): v3 was 10-45% slower there."""
    G = 16 if K >= 512 else max(1, 1 << (((K + 31) // 32).bit_length() - 1))
    if grouped:
        return GemvConfig(BN=16, G=min(G, 8), num_warps=4)
    if N <= 8192 and M <= 4 and K >= 2048:
        return GemvConfig(BN=4, G=64, num_warps=4, num_stages=4, pps=4, pipelined=True)
    if k in (3, 5):
        return GemvConfig(BN=16, G=min(G, 8), num_warps=4)
    return GemvConfig(BN=8, G=G, num_warps=4)


def gemv_config(k: int, M: int, N: int, K: int, device=None, grouped: bool = False, P: int = 1) -> GemvConfig:
    key = gpu_key(device) if device is not None else "generic"
    entry = _table(key).get("grouped" if grouped else "dense", {}).get(str(k), {}).get(str(m_bucket(M)))
    if entry:
        return GemvConfig(**entry)
    sms = 132
    if key != "generic":
        import torch

        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return heuristic(k, M, N, K, sms, grouped, P)
