"""Calibrated rounding (GPTQ into the kbit format) and the randomized Hadamard rotation along K.

:func:`gptq_quantize` rounds one weight with its input Hessian; :func:`calibrate_model` runs it over a decoder
model layer by layer; :class:`RandomHadamard` is the rotation studied in ``docs/quality.md``;
:func:`rotate_residual` rotates a decoder's residual stream offline (no online transform but down_proj's);
:func:`finetune` tunes a rounded model's codebooks, block scales and norm gains end to end (codes fixed).
"""

from kbit.calibrate.finetune import (
    FinetuneConfig,
    TeacherTargets,
    TunableWeight,
    decoder_linear_names,
    finetune,
    sparse_kl,
    teacher_targets,
)
from kbit.calibrate.gptq import Hessian, gptq_quantize
from kbit.calibrate.model import calibrate_layers, calibrate_model, decoder_layers, token_batches
from kbit.calibrate.residual import RotationReport, residual_unsupported, rotate_residual
from kbit.calibrate.rotation import RandomHadamard, hadamard, hadamard_block

__all__ = ["FinetuneConfig", "Hessian", "RandomHadamard", "RotationReport", "TeacherTargets", "TunableWeight",
           "calibrate_layers", "calibrate_model", "decoder_layers", "decoder_linear_names", "finetune",
           "gptq_quantize", "hadamard", "hadamard_block", "residual_unsupported", "rotate_residual", "sparse_kl",
           "teacher_targets", "token_batches"]
