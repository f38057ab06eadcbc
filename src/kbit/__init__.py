"""kbit: LLM weights in k bits (k = 2..5) with Triton kernels that compute on the packed codes.

Public API (re-exported here; nothing else lives in this file).
"""

from kbit.format import FORMAT_VERSION, KbitWeight
from kbit.format.codebooks import DEFAULT_CODEBOOK
from kbit.format.serialize import load_file, save_file
from kbit.ops.quantize import dequantize, quantize
from kbit.ops.reference import grouped_linear_reference, linear_reference

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CODEBOOK", "FORMAT_VERSION", "KbitWeight", "dequantize", "grouped_linear_reference",
    "linear_reference", "load_file", "quantize", "save_file",
]
