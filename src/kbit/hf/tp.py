"""transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` or ``distributed_config=
DistributedConfig(tp_size=N)``, under torchrun) with a :class:`~kbit.hf.config.KbitConfig` model, quantized while
loading or loaded from a kbit folder: kbit's k-bit layers are sharded by :func:`kbit.parallel.parallelize_kbit`
(experts by :class:`TensorParallelKbitExperts`), every other module (embeddings, a float ``lm_head``) by
transformers, with the model's own plan names (``colwise``, ``rowwise``, ``colwise_gather_output``,
``moe_tp_experts``, ...).

Why not transformers' own styles for the k-bit layers: transformers (5.17 - 5.24) shards *parameters* as DTensors
(``distributed/tensor_parallel.py``, ``apply_tensor_parallelism``) before the weights are read, and hooks the
module's forward. A k-bit layer holds packed codes and per-block scales in buffers, which it leaves whole (the
hooks would then take a whole output for a shard), and an element-wise DTensor split does not describe them anyway
(a K split must fall on whole blocks and cut every bit plane of a row). Quantizing while loading would see each
rank's float slice as a DTensor (``quantize`` fails on it) or, sliced, quantize it on its own (another tensor scale
per rank, q/k/v no longer quantized jointly). transformers offers no quantizer flag for this; the quantizer's
``_process_model_before_weight_loading`` runs before transformers reads ``model.tp_plan`` (both versions), so
there it takes the entries of the modules it quantizes out of the plan (those weights then load whole), and its
post-load hook shards them: each shard a bit-exact slice of the whole k-bit weight. The entries go back into
``model.tp_plan`` afterwards: transformers sizes its KV cache for this rank's heads from it
(``get_kv_heads_per_rank``, 5.24).

Memory, per rank: from a kbit folder, the whole packed model in host memory (read there, sharded there), then
only its shards and the replicated modules on its device. Quantizing while loading, the float checkpoint in host
memory and the whole k-bit model on the device (plus one float weight) until the post-load hook cuts its shards.
A sharded kbit checkpoint (:func:`kbit.parallel.load_sharded`) is the way to never hold more than a shard.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from kbit.hf.experts import KbitExperts
from kbit.nn import KbitLinear
from kbit.parallel import (
    STYLES,
    RowParallelKbitLinear,
    all_reduce_sum,
    parallelize_kbit,
    plan_unit,
    shard_range,
    shard_weight,
)
from kbit.parallel.shard import COLUMN_UNIT
from kbit.utils.checks import fail

__all__ = ["EXPERT_STYLE", "TensorParallelKbitExperts", "apply_kbit_tp", "check_heads", "check_k_splits",
           "decode_plan", "shard_loaded", "take_kbit_entries", "tp_size_of"]

#: transformers' tensor-parallel style of fused MoE experts (every expert's intermediate dimension split)
EXPERT_STYLE = "moe_tp_experts"

#: attention projections whose output columns (colwise) or input columns (rowwise) are whole heads
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
#: styles whose split output (colwise) or input (rowwise) the attention sees: heads must stay whole (the gathered
#: and split-input styles compute every head on every rank)
_SPLIT_STYLES = ("colwise", "packed_colwise", "rowwise")


def tp_size_of(config) -> int:
    """The tensor-parallel size transformers was asked for (``config.distributed_config.tp_size``), 1 if none."""
    dc = getattr(config, "distributed_config", None)
    return int(getattr(dc, "tp_size", None) or 1)


def _generic(name: str) -> str:
    # transformers' plans name layers with "*" for every number component (replace_layer_number_by_wildcard)
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def take_kbit_entries(model: nn.Module, plan: dict, kbit_modules: dict[str, str]) -> dict[str, str]:
    """Move the entries of ``plan`` (transformers' ``tp_plan``, changed in place) that name modules kbit quantizes
    (``kbit_modules``: name -> ``"linear"`` or ``"experts"``) into the returned plan, for
    :func:`apply_kbit_tp` after loading; the parameter entries of k-bit experts (``experts.gate_up_proj``) are
    dropped (their module's ``"moe_tp_experts"`` entry cuts both stacks). ValueError (naming the ``tp_plan`` entry)
    for an entry kbit cannot honour: a style kbit does not shard with, or one entry over both k-bit and float
    modules."""
    targets: dict[str, list[str]] = {}
    for name in kbit_modules:
        targets.setdefault(_generic(name), []).append(name)
    taken = {}
    float_names = {_generic(n) for n, _ in model.named_modules() if n not in kbit_modules}
    for pattern, style in list(plan.items()):
        owner = pattern.rsplit(".", 1)[0]  # a parameter entry ("experts.gate_up_proj") belongs to its module
        names = targets.get(pattern) or targets.get(owner) or []
        if not names:
            continue
        if pattern in float_names and pattern in targets:
            fail(ValueError, f"tp_plan[{pattern!r}]", "an entry over k-bit modules only (keep all of its layers "
                 "quantized, or none: KbitConfig.overrides / modules_to_not_convert)", "k-bit and float modules")
        kinds = {kbit_modules[n] for n in names}
        if kinds == {"experts"}:
            if pattern not in targets:  # gate_up_proj / down_proj of k-bit experts: buffers, cut by the module entry
                plan.pop(pattern)
            elif style != EXPERT_STYLE:
                fail(ValueError, f"tp_plan[{pattern!r}]", f"{EXPERT_STYLE!r} for k-bit experts", repr(style))
            else:
                taken[pattern] = plan.pop(pattern)
            continue
        if kinds != {"linear"} or pattern not in targets:
            fail(ValueError, f"tp_plan[{pattern!r}]", "an entry over k-bit Linear modules or k-bit experts",
                 f"{style!r} on k-bit {sorted(kinds)}")
        if style not in STYLES or style == "ep":
            fail(ValueError, f"tp_plan[{pattern!r}]", f"a style kbit shards k-bit layers with, one of "
                 f"{tuple(s for s in STYLES if s != 'ep')}", repr(style))
        taken[pattern] = plan.pop(pattern)
    return taken


def check_heads(config, plan: dict[str, str], tp_size: int, blocksize: int) -> None:
    """ValueError (naming ``tp_plan``) where the attention projections of ``plan`` cannot be split on whole heads:
    the head counts must divide by ``tp_size`` and ``head_dim`` must be a whole number of split units (16 rows,
    and ``blocksize`` columns for the row-parallel output projection), else a rank would hold part of a head."""
    heads = [p for p, style in plan.items() if p.rsplit(".", 1)[-1] in _HEAD_PROJECTIONS and style in _SPLIT_STYLES]
    if not heads or tp_size == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_q = getattr(text, "num_attention_heads", None)
    n_kv = getattr(text, "num_key_value_heads", None) or n_q
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // n_q if n_q else None)
    if n_q is None or head_dim is None:
        return
    for what, n in (("num_attention_heads", n_q), ("num_key_value_heads", n_kv)):
        if n % tp_size:
            fail(ValueError, "tp_plan", f"{what} divisible by the tensor-parallel size {tp_size} to split "
                 f"{heads[0]!r} on whole heads", f"{what}={n}")
    unit = max(COLUMN_UNIT, blocksize)
    if head_dim % unit:
        fail(ValueError, "tp_plan", f"head_dim a multiple of the split unit {unit} (16 rows and the blocksize) to "
             f"split {heads[0]!r} on whole heads", f"head_dim={head_dim}")


def check_k_splits(plan: dict[str, str], modules: dict[str, dict]) -> None:
    """ValueError (naming the ``tp_plan`` entry) where a split of K (row-parallel layers, the down projection of
    tensor-parallel experts) would cut a rotated weight (``modules``: name -> format with ``"rotation"``): its
    Hadamard rotation spans all of K, no shard holds it. Before any weight is read."""
    rotated = {_generic(n) for n, info in modules.items() if info.get("rotation")}
    for pattern, style in plan.items():
        splits_k = style == EXPERT_STYLE or (style in STYLES and STYLES[style][0] is RowParallelKbitLinear)
        if splits_k and pattern in rotated:
            fail(ValueError, f"tp_plan[{pattern!r}]", "unrotated k-bit weights for a split of K (a Hadamard "
                 "rotation spans all of K: keep these layers unrotated, KbitConfig.overrides)", "rotated weights")


def decode_plan(model: nn.Module, world: int) -> dict[str, str]:
    """The plan :func:`shard_loaded` splits a loaded model over ``world`` ranks with: the entries of its config's
    ``base_model_tp_plan`` in styles kbit shards (others, such as Qwen3's replicated q/k norms, or the parameter
    entries of fused experts, leave their modules whole on every rank, which computes them in full), and the
    ``lm_head`` split by vocabulary (``"colwise_rep"``) where it has a whole number of 16 rows for every rank (else
    it stays whole). ValueError where the config has no such plan."""
    cfg = getattr(model, "config", None)
    base = getattr(cfg, "base_model_tp_plan", None) or {}
    plan = {p: s for p, s in base.items() if s in STYLES and s != "ep"}
    if not plan:
        fail(ValueError, "model", "a transformers model whose config has a tensor-parallel plan "
             "(base_model_tp_plan)", f"model_type {getattr(cfg, 'model_type', None)!r} without one")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) in (KbitLinear, nn.Linear) and head.out_features >= world * COLUMN_UNIT:
        plan["lm_head"] = "colwise_rep"
    return plan


def shard_loaded(model: nn.Module, group=None) -> dict[str, str]:
    """Split a loaded k-bit transformers model (whole on every rank, e.g. from ``kbit.load_quantized`` on the CPU)
    over ``group`` with :func:`decode_plan`, in place: this rank keeps its shards (``kbit generate`` under
    ``torchrun``). ValueError (naming ``tp_plan``) where the heads do not split over the ranks. Returns
    ``{module name: style}`` of the replaced modules."""
    world = dist.get_world_size(group)
    plan = decode_plan(model, world)
    check_heads(model.config, plan, world, plan_unit([m for m in model.modules() if isinstance(m, KbitLinear)]))
    return parallelize_kbit(model, plan, group=group)


def _tp_group(model: nn.Module):
    # transformers (5.17 - 5.24) keeps the mesh it built in a private attribute and offers no accessor; the tp
    # axis of a pure tensor-parallel run is the whole world, the default group (None)
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()) and mesh.ndim > 1:
        return mesh["tp"].get_group()
    return None


def apply_kbit_tp(model: nn.Module, plan: dict[str, str], tp_size: int) -> dict[str, str]:
    """Shard the k-bit layers ``plan`` names over transformers' tensor-parallel group (after loading) and put the
    entries back into ``model.tp_plan``. Returns ``{module name: style}`` of the replaced modules."""
    if not dist.is_initialized():
        fail(RuntimeError, "tp_plan", "torch.distributed initialised (run under torchrun)", "no process group")
    group = _tp_group(model)
    if dist.get_world_size(group) != tp_size:
        fail(ValueError, "tp_plan", f"a tensor-parallel group of {tp_size} ranks", dist.get_world_size(group))
    linear = {p: s for p, s in plan.items() if s != EXPERT_STYLE}
    replaced = parallelize_kbit(model, linear, group=group) if linear else {}
    for name, module in list(model.named_modules()):
        if isinstance(module, KbitExperts) and plan.get(_generic(name)) == EXPERT_STYLE:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, TensorParallelKbitExperts(module, group=group))
            replaced[name] = EXPERT_STYLE
    model.tp_plan.update(plan)  # transformers reads it after loading: its KV cache holds this rank's heads
    return replaced


class TensorParallelKbitExperts(nn.Module):
    """transformers' ``"moe_tp_experts"`` for :class:`~kbit.hf.experts.KbitExperts`: every expert's intermediate
    dimension I split over the group (``gate_up_proj [E, 2I, H]``: this rank's rows of the gate part and of the up
    part, ``down_proj [E, H, I]``: the same columns, on whole blocks), the partial outputs all-reduced. Every rank
    routes every token (the router is replicated); the shard is an ordinary ``KbitExperts`` (``self.shard``).

    ``start``, ``stop``: this rank's columns of I; the split unit is a whole number of 16 rows and of both
    blocksizes, so that the down projection's K split falls on blocks and matches the gate / up rows."""

    def __init__(self, experts: KbitExperts, group=None):
        super().__init__()
        if not isinstance(experts, KbitExperts):
            fail(TypeError, "experts", "a KbitExperts", type(experts).__name__)
        if experts.gate_fn is not None or experts.down_bias is not None:  # interleaved rows; biases after the sum
            fail(ValueError, "experts", "KbitExperts of gate-then-up rows without biases (the split takes a gate "
                 "part and an up part)", f"{type(experts).__name__} with its own gate or biases")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        gate_up, down = experts.weight("gate_up_proj"), experts.weight("down_proj")
        inter = experts.intermediate_dim
        self.unit = max(COLUMN_UNIT, gate_up.blocksize, down.blocksize)
        self.start, self.stop = shard_range(inter, self.rank, self.world, self.unit)
        self.shard = KbitExperts(shard_weight(gate_up, 0, self.rank, self.world, self.unit, parts=(inter, inter)),
                                 shard_weight(down, 1, self.rank, self.world, self.unit), experts.act_fn,
                                 experts.dtype)
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts.num_experts, experts.hidden_dim, inter

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = self.shard(hidden_states, top_k_index, top_k_weights)
        return all_reduce_sum(out, self.group) if self.world > 1 else out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, intermediate_dim={self.intermediate_dim}, columns={self.start}:"
                f"{self.stop}, rank={self.rank}/{self.world}")
