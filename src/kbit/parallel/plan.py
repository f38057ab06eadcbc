"""``parallelize_kbit``: replace a model's ``KbitLinear`` modules by their column- / row-parallel versions from a
plan ``{module-name pattern: style}``, written like transformers' ``tp_plan`` (``"layers.*.mlp.up_proj":
"colwise"``; ``*`` stands for one name component, a pattern matches a module whose name ends with it).
"""

from __future__ import annotations

import re

from torch import nn

from kbit.nn.linear import KbitLinear
from kbit.nn.moe import KbitMoE
from kbit.parallel.linear import ColumnParallelKbitLinear, ColumnParallelLinear, RowParallelKbitLinear
from kbit.parallel.moe import ExpertParallelKbitMoE
from kbit.parallel.shard import COLUMN_UNIT
from kbit.utils.checks import fail

__all__ = ["LLAMA_PLAN", "PACKED_LLAMA_PLAN", "QWEN3_MOE_PLAN", "STYLES", "parallelize_kbit", "planned_modules"]

#: style name (transformers' ``ParallelInterface`` names) -> (parallel class, keyword arguments)
STYLES: dict[str, tuple[type, dict]] = {
    "colwise": (ColumnParallelKbitLinear, {"gather_output": False}),
    "colwise_gather_output": (ColumnParallelKbitLinear, {"gather_output": True}),
    "colwise_rep": (ColumnParallelKbitLinear, {"gather_output": True}),
    # a packed weight (q/k/v or gate/up side by side): every part split on its own; parts from the layer's
    # ``packed_parts``, else two halves
    "packed_colwise": (ColumnParallelKbitLinear, {"gather_output": False, "parts": "packed"}),
    "rowwise": (RowParallelKbitLinear, {"input_is_parallel": True}),
    "rowwise_split_input": (RowParallelKbitLinear, {"input_is_parallel": False}),
    "rowwise_rep": (RowParallelKbitLinear, {"input_is_parallel": False}),
    # a KbitMoE block: its experts split over the ranks, the router replicated, one all-reduce of [T, H]
    "ep": (ExpertParallelKbitMoE, {}),
}

#: Llama-style decoder blocks (transformers' ``LlamaConfig.base_model_tp_plan``): attention heads and the MLP's
#: intermediate dimension split over the ranks, two all-reduces a block
LLAMA_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


#: the same blocks with q/k/v and gate/up packed into one layer each (``qkv_proj`` with ``packed_parts`` (q, k, v)
#: rows, ``gate_up_proj``): a rank runs 4 k-bit kernels a block instead of 7
PACKED_LLAMA_PLAN: dict[str, str] = {
    "layers.*.self_attn.qkv_proj": "packed_colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up_proj": "packed_colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


#: Qwen3-MoE-style blocks (q/k/v colwise, o rowwise, the sparse MoE block ``mlp`` a ``KbitMoE``, expert parallel):
#: two all-reduces a block, as the dense plan
QWEN3_MOE_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp": "ep",
}


def _regex(pattern: str) -> re.Pattern:
    body = re.escape(pattern).replace(r"\*", r"[^.]+")
    return re.compile(r"(?:^|.*\.)" + body + "$")


def _float_ok(style: str) -> bool:
    """Whether ``style`` also splits a float ``nn.Linear`` (:class:`~kbit.parallel.ColumnParallelLinear`): the
    column styles of unpacked layers, e.g. a bf16 ``lm_head``."""
    cls, kwargs = STYLES[style]
    return cls is ColumnParallelKbitLinear and "parts" not in kwargs


def planned_modules(model: nn.Module, plan: dict[str, str], allow_float: bool = False) -> list[tuple[str, str]]:
    """(module name, style) of every module a pattern of ``plan`` matches (the first matching pattern wins).
    ``allow_float``: a column style may also name a float ``nn.Linear``."""
    compiled = [(_regex(p), s) for p, s in plan.items()]
    out = []
    for name, module in model.named_modules():
        style = next((s for rx, s in compiled if rx.match(name)), None)
        if style is None:
            continue
        want = KbitMoE if STYLES[style][0] is ExpertParallelKbitMoE else KbitLinear
        if allow_float and _float_ok(style) and type(module) is nn.Linear:
            out.append((name, style))
            continue
        if not isinstance(module, want):
            fail(TypeError, f"module {name!r} (style {style!r})", f"a {want.__name__}", type(module).__name__)
        out.append((name, style))
    return out


def plan_unit(modules: list[KbitLinear]) -> int:
    """The split unit for a plan: a whole number of every blocksize (K splits must fall on blocks, and a row-parallel
    layer's split of K must equal the column-parallel split of the N it reads) and of :data:`COLUMN_UNIT` rows."""
    unit = COLUMN_UNIT
    for m in modules:
        unit = max(unit, m.blocksize)  # all are powers of two: the largest is a multiple of the others
    return unit


def parallelize_kbit(model: nn.Module, plan: dict[str, str] | None = None, group=None, unit: int | None = None
                     ) -> dict[str, str]:
    """Replace (in place) the ``KbitLinear`` / ``KbitMoE`` modules that ``plan`` names by their parallel versions on
    this rank (``"ep"``: :class:`~kbit.parallel.ExpertParallelKbitMoE`). A float ``nn.Linear`` under a column style
    (a bf16 ``lm_head``: ``"colwise_rep"``) becomes a :class:`~kbit.parallel.ColumnParallelLinear`.

    Parameters
    ----------
    model : the model, the same on every rank of ``group`` (its k-bit weights whole, on this rank's device).
    plan : ``{pattern: style}``, styles from :data:`STYLES`; default :data:`LLAMA_PLAN`.
    group : the ``torch.distributed`` process group (None: the default group).
    unit : rows / columns per unit of every split (:func:`kbit.parallel.shard_range`); default :func:`plan_unit`
        of the planned modules. For attention, heads stay whole where the head counts divide by the world size
        and ``head_dim`` is a multiple of the unit (true for 128 / 64 with blocksize <= 64).

    Returns ``{module name: style}`` of the replaced modules. ValueError for an unknown style or a plan that
    matches nothing; TypeError where a pattern matches a module of another class than its style takes.
    """
    plan = dict(LLAMA_PLAN if plan is None else plan)
    for pattern, style in plan.items():
        if style not in STYLES:
            fail(ValueError, f"plan[{pattern!r}]", f"one of {tuple(STYLES)}", repr(style))
    found = planned_modules(model, plan, allow_float=True)
    if not found:
        fail(ValueError, "plan", "patterns matching at least one module of the model", f"no match for {list(plan)}")
    if unit is None:
        unit = plan_unit([m for m in (model.get_submodule(n) for n, _ in found) if isinstance(m, KbitLinear)])
    for name, style in found:
        cls, kwargs = STYLES[style]
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if type(old) is nn.Linear:  # float rows split anywhere: 16-row units, not the k-bit layers' blocks
            new = ColumnParallelLinear.from_linear(old, group=group, unit=COLUMN_UNIT, **kwargs)
        elif cls is ExpertParallelKbitMoE:
            new = cls.from_moe(old, group=group)
        else:
            new = cls.from_linear(old, group=group, unit=unit, **kwargs)
        setattr(parent, child, new)
    return dict(found)
