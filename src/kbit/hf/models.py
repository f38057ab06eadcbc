"""Which modules of a Hugging Face model to quantize, per ``config.model_type``: a data table, not code.

Each :class:`ModelSpec` lists regular expressions matched against module names (``model.named_modules()``),
anchored at the end and at a dot (``self_attn\\.q_proj`` matches ``model.layers.3.self_attn.q_proj``, and
also ``bert.encoder...`` style prefixes). ``linear`` patterns pick ``nn.Linear`` modules (replaced by
:class:`kbit.nn.KbitLinear`); ``experts`` patterns pick fused MoE expert modules holding the 3-D parameters
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (transformers >= 5), replaced by
:class:`kbit.hf.experts.KbitExperts`. Anything not matched (embeddings, ``lm_head``, norms, MoE routers)
stays as it is.

To support a new architecture, add a row; patterns for both the fused-expert layout (transformers 5) and
the per-expert ``nn.Linear`` layout (transformers 4) can sit in one row, the one absent matches nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Module-name patterns of one family of architectures.

    linear : patterns of ``nn.Linear`` modules to quantize.
    experts : patterns of fused expert modules (3-D ``gate_up_proj`` / ``down_proj`` parameters).
    """

    linear: tuple[str, ...]
    experts: tuple[str, ...] = ()


_ATTN = r"self_attn\.(q|k|v|o)_proj"
_MLP = r"mlp\.(gate|up|down)_proj"

_DECODER = ModelSpec(linear=(_ATTN, _MLP))

MODELS: dict[str, ModelSpec] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma3_text": _DECODER,  # Gemma3ForCausalLM (text only; the multimodal "gemma3" has a vision tower)
    "phi3": ModelSpec(linear=(r"self_attn\.(qkv|o)_proj", r"mlp\.(gate_up|down)_proj")),  # Phi-3/4: fused qkv, gate_up
    "qwen3_moe": ModelSpec(
        linear=(_ATTN, _MLP, r"mlp\.experts\.\d+\.(gate|up|down)_proj"),  # dense layers; per-expert Linear (v4)
        experts=(r"mlp\.experts",),
    ),
    "qwen2_moe": ModelSpec(
        linear=(_ATTN, _MLP, r"mlp\.shared_expert\.(gate|up|down)_proj", r"mlp\.experts\.\d+\.(gate|up|down)_proj"),
        experts=(r"mlp\.experts",),
    ),
    "mixtral": ModelSpec(
        linear=(_ATTN, r"block_sparse_moe\.experts\.\d+\.w(1|2|3)"),  # per-expert Linear (v4)
        experts=(r"mlp\.experts",),
    ),
    # BERT-style encoders (all-MiniLM-L6-v2 is a "bert"): every Linear of the encoder; not the pooler.
    "bert": ModelSpec(
        linear=(r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
                r"|intermediate\.dense|output\.dense)",),
    ),
}


def spec_for(model_type: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``model_type``; ValueError naming the supported ones otherwise."""
    try:
        return MODELS[model_type]
    except KeyError:
        raise ValueError(f"model_type: expected one of {sorted(MODELS)}, got {model_type!r}: kbit has no table of "
                         f"which modules of a {model_type!r} model to quantize (pass include=[patterns] to "
                         "kbit.quantize_model, or add a row to kbit.hf.models.MODELS)") from None


def compile_patterns(patterns) -> re.Pattern:
    """One regex matching a module name that ends (at a dot or the start) with any of ``patterns``."""
    body = "|".join(f"(?:{p})" for p in patterns) or r"(?!)"
    return re.compile(rf"(?:^|.*\.)(?:{body})$")


def model_type_of(model) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(f"model: expected a transformers model with config.model_type, got {type(model).__name__}")
    return model_type


def select_modules(model, include=None) -> tuple[list[str], list[str]]:
    """Names of the ``nn.Linear`` modules and of the fused expert modules of ``model`` to quantize.

    ``include``: patterns of ``nn.Linear`` names to use instead of the table row of ``config.model_type``.
    """
    if include is not None:
        spec = ModelSpec(linear=tuple(include))
    else:
        spec = spec_for(model_type_of(model))
    lin, exp = compile_patterns(spec.linear), compile_patterns(spec.experts)
    linear, experts = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and lin.match(name):
            linear.append(name)
        elif exp.match(name) and _is_fused_experts(module):
            experts.append(name)
    if not linear and not experts:
        what = f"the patterns {list(spec.linear + spec.experts)}" if include is not None else \
            f"the table row of model_type {model_type_of(model)!r} ({list(spec.linear + spec.experts)})"
        raise ValueError(f"model: {what} match no nn.Linear or fused expert module of {type(model).__name__}")
    return linear, experts


def _is_fused_experts(module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
