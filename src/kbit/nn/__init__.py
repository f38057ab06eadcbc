"""Modules: KbitLinear."""

from kbit.nn.linear import KbitLinear

__all__ = ["KbitLinear"]
