"""kbit: LLM weights in k bits (k = 2..5) with Triton kernels that compute on the packed codes.

Public API (re-exported here; nothing else lives in this file).
"""

from kbit.dispatch.linear import kbit_gemv as gemv
from kbit.dispatch.linear import kbit_linear as linear
from kbit.format import FORMAT_VERSION, KbitWeight
from kbit.format.codebooks import DEFAULT_CODEBOOK
from kbit.format.serialize import load_file, save_file
from kbit.hf import KbitConfig, load_quantized, quantize_model, save_quantized
from kbit.nn import KbitLinear, KbitMoE
from kbit.ops._ids import check_errors, debug_ids
from kbit.ops.dequant import dequantize
from kbit.ops.gemv import kbit_grouped_gemv as grouped_gemv
from kbit.ops.quantize import KbitQualityWarning, quantize
from kbit.ops.reference import grouped_linear_reference, linear_reference
from kbit.ops.sampling import sample, sample_reference

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CODEBOOK", "FORMAT_VERSION", "KbitConfig", "KbitLinear", "KbitMoE", "KbitQualityWarning", "KbitWeight",
    "check_errors", "debug_ids", "dequantize", "gemv", "grouped_gemv", "grouped_linear_reference", "linear",
    "linear_reference", "load_file", "load_quantized", "quantize", "quantize_model", "sample", "sample_reference",
    "save_file", "save_quantized",
]
