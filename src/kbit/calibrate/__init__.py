"""Calibrated rounding (GPTQ into the kbit format) and the randomized Hadamard rotation along K.

:func:`gptq_quantize` rounds one weight with its input Hessian; :func:`calibrate_model` runs it over a decoder
model layer by layer; :class:`RandomHadamard` is the rotation studied in ``docs/quality.md``.
"""

from kbit.calibrate.gptq import Hessian, gptq_quantize
from kbit.calibrate.model import calibrate_layers, calibrate_model, decoder_layers, token_batches
from kbit.calibrate.rotation import RandomHadamard, hadamard, hadamard_block

__all__ = ["Hessian", "RandomHadamard", "calibrate_layers", "calibrate_model", "decoder_layers", "gptq_quantize",
           "hadamard", "hadamard_block", "token_batches"]
