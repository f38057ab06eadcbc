"""Modules: KbitLinear, KbitMoE; :func:`repack_for_kernels` puts every one of a model in the kernels' layout."""

from kbit.nn.linear import KbitLinear, repack_for_kernels
from kbit.nn.moe import KbitMoE

__all__ = ["KbitLinear", "KbitMoE", "repack_for_kernels"]
