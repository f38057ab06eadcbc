"""Hugging Face transformers integration: ``quantize_model`` (driven by the per-``model_type`` table in
:mod:`kbit.hf.models`), ``save_quantized`` / ``load_quantized``, and ``KbitExperts`` for fused MoE experts.

Needs ``transformers`` only to load checkpoints (``pip install 'kbit[hf]'``).
"""

from kbit.hf.experts import KbitExperts
from kbit.hf.models import MODELS, ModelSpec
from kbit.hf.quantize_model import load_quantized, plan, quantize_model, save_quantized

__all__ = ["MODELS", "KbitExperts", "ModelSpec", "load_quantized", "plan", "quantize_model", "save_quantized"]
