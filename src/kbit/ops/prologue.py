"""Transitional: the decoder-glue prologue moved to ``kbit.dispatch.prologue`` (it chooses between the fused launch
and separate steps) and its config to ``kbit.tuning.mma_plan.prologue_config``. ``kbit.hf.fast_decode`` still
imports ``add_rms_norm_linear`` from here; delete this module once it imports from ``kbit.dispatch.prologue``."""

from __future__ import annotations

from kbit.ops.gemv_mma import EPI_SILU, PRO_ADD_NORM
from kbit.tuning.mma_plan import prologue_config as fused_config

__all__ = ["EPI_SILU", "PRO_ADD_NORM", "fused_config"]


def __getattr__(name: str):
    if name == "add_rms_norm_linear":
        from kbit.dispatch import prologue as _dispatch  # transitional upward import (see the module docstring)

        return _dispatch.add_rms_norm_linear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
