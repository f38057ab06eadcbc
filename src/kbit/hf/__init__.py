"""Hugging Face transformers integration: ``quantize_model`` (driven by the per-``model_type`` table in
:mod:`kbit.hf.models`, or a model's structure where it has no row), ``save_quantized`` / ``load_quantized``
(a Hugging Face folder with ``quantization_config``), ``KbitExperts`` for fused MoE experts, and ``KbitConfig``:
transformers' ``from_pretrained(..., quantization_config=KbitConfig(k=4))`` (registered on import when
transformers is installed).

Needs ``transformers`` only to load checkpoints (``pip install 'kbit[hf]'``).
"""

from kbit.hf.checkpoint import empty_quantized, load_quantized, save_quantized
from kbit.hf.config import KbitConfig
from kbit.hf.experts import KbitExperts
from kbit.hf.models import MODELS, ModelSpec
from kbit.hf.quantize_model import plan, quantize_model
from kbit.hf.quantizer import register_with_transformers

__all__ = ["MODELS", "KbitConfig", "KbitExperts", "ModelSpec", "empty_quantized", "load_quantized", "plan",
           "quantize_model", "register_with_transformers", "save_quantized"]
