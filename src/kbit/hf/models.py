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

A ``model_type`` without a row is planned by structure (:func:`structural_modules`): every ``nn.Linear`` and
fused expert module inside the decoder layers (the ``nn.ModuleList`` as long as the text config's
``num_hidden_layers``), but not a MoE router. On every family of the table the structure picks the same modules
as its row (``tests/test_hf.py``), so the table holds the families kbit has run, not a list of the only ones
allowed.

Fused experts are quantized where :class:`kbit.hf.experts.KbitExperts` computes what they compute
(:func:`experts_layout_problem`: gated MLP experts, stacks either way round, biases and the module's own gate
allowed, as gpt-oss has them, routed by ``forward(hidden_states, indices, weights)``); others (Llama-4: tokens
routed beforehand) stay in float, with a warning naming them and why.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from kbit.hf.experts import hidden_size_of, is_transposed, own_gate
from kbit.utils.checks import check_regex, fail


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
    """Names of the ``nn.Linear`` modules and of the fused expert modules of ``model`` to quantize: ``include``
    (patterns of ``nn.Linear`` names), else the table row of ``config.model_type``, else
    :func:`structural_modules`. Fused experts in a layout :class:`~kbit.hf.experts.KbitExperts` does not compute
    are left out with a warning (:func:`experts_layout_problem`).
    """
    if include is not None:
        if not isinstance(include, (list, tuple)):  # a str too: it would be read letter by letter
            fail(TypeError, "include", "a list of nn.Linear name patterns", repr(include))
        for i, pattern in enumerate(include):
            check_regex(f"include[{i}]", pattern)
    if include is None and model_type_of(model) not in MODELS:
        linear, experts = structural_modules(model)
        if not linear and not experts:
            raise ValueError(f"model: model_type {model_type_of(model)!r} has no row in kbit.hf.models.MODELS and "
                             f"its decoder layers hold no nn.Linear or fused expert module ({type(model).__name__}); "
                             "pass include=[patterns] (nn.Linear names) or add a row")
    else:
        spec = ModelSpec(linear=tuple(include)) if include is not None else spec_for(model_type_of(model))
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
            raise ValueError(f"{'include' if include is not None else 'model'}: {what} match no nn.Linear or fused "
                             f"expert module of {type(model).__name__}")
    experts = _supported_experts(model, experts)
    if not linear and not experts:
        raise ValueError(f"model: {type(model).__name__} has only fused experts of a layout kbit does not quantize "
                         "(the warning names them) and no nn.Linear to quantize")
    return linear, experts


#: module names that hold another modality's encoder (a vision tower's layers are not the decoder's)
_FOREIGN = re.compile(r"(?:^|\.)[^.]*(?:vision|visual|image|audio|speech|video)[^.]*(?:\.|$)")


def decoder_layer_lists(model) -> list[str]:
    """Names of the ``nn.ModuleList`` modules as long as the (text) config's ``num_hidden_layers``, outside other
    modalities' towers: the decoder (or encoder) layers."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"model: expected config.num_hidden_layers (a positive int) to find the decoder layers, "
                         f"got {n!r}")
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) == n and not _FOREIGN.search(name)]


def structural_modules(model) -> tuple[list[str], list[str]]:
    """(nn.Linear names, fused expert names) inside the decoder layers (:func:`decoder_layer_lists`), without
    the MoE routers: a Linear of a module that has ``experts`` (the MoE block), outside those experts, with one
    output or one per expert (``mlp.gate`` of transformers 4, ``shared_expert_gate``, HunYuan's ``gate.wg``)."""
    lists = decoder_layer_lists(model)
    if not lists:
        raise ValueError(f"model: found no nn.ModuleList of config.num_hidden_layers layers in "
                         f"{type(model).__name__}; pass include=[patterns] (nn.Linear names) to choose the modules")
    modules = dict(model.named_modules())
    routers = set()
    for name, block in modules.items():
        experts = getattr(block, "experts", None)
        E = _num_experts(experts)
        if E is None:
            continue
        ename = f"{name}.experts" if name else "experts"
        for sub, m in block.named_modules(prefix=name):
            if isinstance(m, nn.Linear) and not sub.startswith(ename + ".") and m.out_features in (1, E):
                routers.add(sub)
    linear, experts = [], []
    inside = tuple(f"{n}." for n in lists)
    for name, m in modules.items():
        if not name.startswith(inside) or name in routers:
            continue
        if isinstance(m, nn.Linear):
            linear.append(name)
        elif _is_fused_experts(m):
            experts.append(name)
    return linear, experts


def _num_experts(experts) -> int | None:
    """Experts in a module ``experts`` (fused stacks or a ModuleList of per-expert MLPs), else None."""
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    if experts is not None and _is_fused_experts(experts):
        return int(experts.gate_up_proj.shape[0])
    return None


def _is_fused_experts(module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def experts_layout_problem(module) -> str | None:
    """Why :class:`~kbit.hf.experts.KbitExperts` cannot stand in for the fused expert ``module`` (None: it can).
    It computes gated MLP experts (``act_fn(gate) * up``, or the module's own ``_apply_gate``) with optional
    biases, from stacks stored either way round, called as ``experts(hidden, indices, weights)``. Reads the layout
    flags transformers' ``use_experts_implementation`` sets where present."""
    why = []
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        why.append("no gated MLP")
    if own_gate(module) is None and not callable(getattr(module, "act_fn", None)):
        why.append("no act_fn")
    try:
        transposed = is_transposed(module)
    except ValueError as e:
        return str(e)
    gu, dn = module.gate_up_proj.shape, module.down_proj.shape
    if transposed:
        gu, dn = (gu[0], gu[2], gu[1]), (dn[0], dn[2], dn[1])
    E, two_i, H = gu
    if two_i % 2 or tuple(dn) != (E, H, two_i // 2) or H != (hidden_size_of(module) or H):
        why.append(f"stacks {tuple(module.gate_up_proj.shape)} and {tuple(module.down_proj.shape)}, not "
                   "[E, 2I, H] and [E, H, I] either way round")
    try:
        args = [p for p in inspect.signature(type(module).forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        args = []
    if len(args) < 4:  # self, hidden states, expert indices, routing weights
        why.append("forward without (hidden states, expert indices, routing weights): tokens routed beforehand")
    return ", ".join(why) or None


def _supported_experts(model, names: list[str]) -> list[str]:
    kept, skipped = [], []
    for name in names:
        m = model.get_submodule(name)
        why = experts_layout_problem(m)
        (kept if why is None else skipped).append(name if why is None else f"{name} ({type(m).__name__}: {why})")
    if skipped:
        more = f" and {len(skipped) - 1} more like it" if len(skipped) > 1 else ""
        warnings.warn(f"kbit: fused experts kept in float (not quantized), a layout KbitExperts does not compute: "
                      f"{skipped[0]}{more}", UserWarning, stacklevel=3)
    return kept
