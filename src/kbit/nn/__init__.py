"""Modules: KbitLinear, KbitMoE."""

from kbit.nn.linear import KbitLinear
from kbit.nn.moe import KbitMoE

__all__ = ["KbitLinear", "KbitMoE"]
