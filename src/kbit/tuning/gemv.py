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
    num_stages: int = 4  # software-pipelining depth of the K loop (cp.async stages; 1 = none)
    split: int = 0  # K splits (dense only): 0 = choose from the grid size, 1 = none
    pps: int = 0  # persistent grid: programs per SM (0 = one program per tile)

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
    """v3 (docs/notes/gemv.md): tiles of ~2 KB of codes (BN rows x G groups of 32 columns, 128 threads),
    a 4-deep cp.async pipeline, a persistent grid of 8 programs per SM. Fewer row blocks than program slots:
    thinner tiles (BN = 4, G = 32) before any K split."""
    G = 16 if K >= 512 else max(1, 1 << (((K + 31) // 32).bit_length() - 1))
    BN = 8
    pps = 8 if M <= 2 else (6 if M <= 4 else 4)  # registers grow with M (k = 4: 48 / 72 / 128 at M = 1 / 4 / 8)
    if grouped:
        if K < 1024:
            G, BN = min(G, 8), 16
        return GemvConfig(BN=BN, G=G, num_warps=4, num_stages=4, pps=pps)
    if K >= 1024 and -(-N // BN) < sms * pps:
        BN, G = 4, 32
    return GemvConfig(BN=BN, G=G, num_warps=4, num_stages=4, pps=pps)


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
