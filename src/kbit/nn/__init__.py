"""Modules: KbitLinear."""

from kbit.nn.linear import KbitLinear

__all__ = ["KbitLinear"]
from kbit.nn.moe import KbitMoE  # noqa: E402, F401
