"""Per-GPU tuning tables (``configs/<gpu>.json``), the GPU key that names them, and the M buckets they use.

One file a GPU holds a section per kernel family (``"gemm"``, ``"gemv"``, ``"mma"``, ``"large"``); a GPU without a
file, or a file without a section, takes that section from ``configs/default.json`` (where the rule tables that
apply to every GPU live), and a family without a section anywhere falls back to its heuristic function.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

__all__ = ["M_BUCKETS", "gpu_key", "m_bucket", "section"]

_CONFIGS = Path(__file__).with_name("configs")
#: M buckets of the tables: a row count is looked up under the smallest bucket that holds it
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: GPU keys, matched in this order against the device name (so "h200" is not taken for "h20")
_GPUS = ("h100", "h200", "h20", "a100", "l40s", "l4", "4090", "3090")


def m_bucket(M: int, buckets: tuple[int, ...] = M_BUCKETS) -> int:
    """The smallest bucket >= M (the largest bucket for M beyond it)."""
    for b in buckets:
        if M <= b:
            return b
    return buckets[-1]


def gpu_key(device) -> str:
    """'h100', 'h200', ... from the device name; 'generic' off CUDA or for a GPU not listed."""
    if getattr(device, "type", "cpu") != "cuda":
        return "generic"
    name = torch.cuda.get_device_name(device).lower()
    for key in _GPUS:
        if key in name:
            return key
    return "generic"


@functools.cache
def _file(name: str) -> dict:
    path = _CONFIGS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def section(gpu: str, family: str) -> dict:
    """The ``family`` section of ``configs/<gpu>.json``, else of ``configs/default.json``, else {}."""
    own = _file(gpu).get(family)
    return own if own is not None else _file("default").get(family, {})
