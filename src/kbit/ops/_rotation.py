"""What the ops that apply a :class:`kbit.format.Rotation` share (kbit.ops.hadamard's standalone transform and the
glue kernels of kbit.ops.glue that rotate the row they produce): the cached int8 signs, the argument checks and
the float64 butterfly reference.
"""

from __future__ import annotations

import math
import threading

import torch

from kbit.format.spec import Rotation
from kbit.utils.checks import check_tensor, fail

__all__ = ["check_rotation", "hadamard_reference", "rotation_signs"]

_SIGNS: dict[tuple, torch.Tensor] = {}
_SIGNS_LOCK = threading.Lock()


def rotation_signs(rotation: Rotation, K: int, device) -> torch.Tensor:
    """The ``K`` signs of ``rotation`` as int8 (+1/-1) on ``device``, made once per (seed, K, device) and cached
    (making them is a host computation and a copy: do it before a CUDA graph capture)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (rotation.seed, K, device)
    s = _SIGNS.get(key)
    if s is None:
        s = rotation.signs(K, torch.int8, device)
        with _SIGNS_LOCK:
            _SIGNS[key] = s
    return s


def check_rotation(rotation, signs, K: int, device, name: str = "x.shape[-1] (K)") -> torch.Tensor:
    """Checks ``rotation`` (a Rotation whose block divides ``K``) and ``signs`` (None or int8 ``[K]`` on
    ``device``); returns the signs to use (the cached ones when ``signs`` is None)."""
    if not isinstance(rotation, Rotation):
        fail(TypeError, "rotation", "a kbit.format.Rotation", type(rotation).__name__)
    rotation.check_width(K, name)
    if signs is None:
        return rotation_signs(rotation, K, device)
    check_tensor("signs", signs, torch.int8, shape=(K,), device=device, contiguous=True)
    return signs


def hadamard_reference(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """``x R`` along the last dim in float64 by butterflies (``R = diag(signs) @ blockdiag(H_block, ...) /
    sqrt(block)``), returned in x's dtype."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    h = x.to(torch.float64) * signs.to(torch.float64)
    step = 1
    while step < block:  # stage h = step: (a, c) -> (a + c, a - c) for the pairs (i, i + step) of each 2*step group
        g = h.reshape(*lead, K // (2 * step), 2, step)
        a, c = g[..., 0, :], g[..., 1, :]
        h = torch.stack((a + c, a - c), dim=-2).reshape(*lead, K)
        step *= 2
    return (h / math.sqrt(block)).to(x.dtype)
