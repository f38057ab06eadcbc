"""Device-side tables shared by several ops (imports no op)."""

from __future__ import annotations

import torch

from kbit.format.spec import log8_values

__all__ = ["e_table"]

_E_TABLES: dict = {}


def e_table(device) -> torch.Tensor:
    """The 255 log8 scale values ``2 ** (-q / 16)`` (and 0 for the zero block) on ``device``, built once a device:
    the kernels look scales up in it instead of computing the power."""
    device = torch.device(device)
    t = _E_TABLES.get(device)
    if t is None:
        t = _E_TABLES[device] = log8_values(device).contiguous()
    return t
