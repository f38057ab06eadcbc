"""The model-shape suite (issue 32): the layers a decode step of current models runs, derived from their configs.

``suites/models.json`` (package data) holds, per model, the values of its published ``config.json`` that set the
layer shapes, and the file's URL. :func:`layers` derives every layer from them by code:

==================  ==========================================  =========================================
layer               N (output rows)                             K (input columns)
==================  ==========================================  =========================================
qkv                 (heads + 2 kv_heads) x head_dim              hidden   (q/k/v fused, as quantize_model)
o                   hidden                                      heads x head_dim
gate_up             2 x intermediate                            hidden   (gate/up fused)
down                hidden                                      intermediate
lm_head             vocab                                       hidden
shared.gate_up      2 x n_shared x moe_intermediate             hidden   (DeepSeek / GLM shared experts)
shared.down         hidden                                      n_shared x moe_intermediate
experts.gate_up     E stacks of [2 x moe_intermediate, hidden]  (top-k of E per token)
experts.down        E stacks of [hidden, moe_intermediate]
==================  ==========================================  =========================================

DeepSeek's low-rank attention (``"attention": "mla"``) has ``q_a`` [q_lora_rank, hidden], ``kv_a``
[kv_lora_rank + qk_rope_head_dim, hidden], ``q_b`` [heads x (qk_nope + qk_rope), q_lora_rank], ``kv_b``
[heads x (qk_nope + v_head), kv_lora_rank] and ``o`` [hidden, heads x v_head] instead of qkv / o.

The split: families (never single models, so that no family is in both halves) sorted by their dense weight
elements, largest first (name breaks ties), go alternately to ``"tune"`` and ``"held-out"``; both halves so span
the sizes. Tuning uses the first half, the fitted rule is reported on the second. A few shapes occur in both halves
(models of two families with one layer shape, e.g. 4096 x 4096); :func:`unseen_shapes` leaves those out of the
held-out shapes a rule is judged on.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kbit.bench.moe import MoeShape
from kbit.utils.checks import check_choice

__all__ = ["SPLITS", "Layer", "Model", "by_bands", "dense_shapes", "families", "layers", "load_models",
           "model_from_config", "moe_shapes", "select", "shape_families", "split_of", "spread", "suite_markdown",
           "suite_names", "unseen_shapes"]

SUITES = Path(__file__).with_name("suites")
SPLITS = ("tune", "held-out")

#: config keys of the expert count under the names the architectures use, first found wins
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Model:
    """One model of the suite: ``config`` holds its config.json values under their own key names."""

    name: str
    family: str
    source: str
    attention: str  #: "gqa" or "mla"
    dense_mlp: bool  #: has dense (non-expert) MLP layers
    experts: bool  #: has routed experts
    config: dict
    unsure: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Layer:
    """One weight a decode step multiplies by: ``E`` stacks of [N, K] (E = 1: a dense layer; ``topk`` of the E per
    token for experts)."""

    model: str
    family: str
    name: str
    N: int
    K: int
    E: int = 1
    topk: int = 0

    @property
    def dense(self) -> bool:
        return self.E == 1

    @property
    def weights(self) -> int:
        """Elements of one [N, K] matrix."""
        return self.N * self.K


def model_from_dict(d: dict) -> Model:
    check_choice("attention", d.get("attention"), ("gqa", "mla"))
    return Model(name=d["name"], family=d["family"], source=d["source"], attention=d["attention"],
                 dense_mlp=bool(d["dense_mlp"]), experts=bool(d["experts"]), config=dict(d["config"]),
                 unsure=tuple(d.get("unsure", ())), note=d.get("note", ""))


def suite_names() -> list[str]:
    """The suites kbit ships: the names of ``suites/<name>.json``."""
    return sorted(p.stem for p in SUITES.glob("*.json"))


@cache
def load_models(name: str = "models") -> tuple[Model, ...]:
    """The models of ``suites/<name>.json``."""
    path = SUITES / f"{name}.json"
    if not path.exists():
        raise ValueError(f"suite: expected one of {suite_names()}, got {name!r}")
    return tuple(model_from_dict(d) for d in json.loads(path.read_text())["models"])


def model_from_config(name: str, config: dict) -> Model:
    """A :class:`Model` from a Hugging Face ``config.json`` dict (``text_config`` of multimodal models is used when
    present): what ``kbit tune --model DIR`` tunes."""
    cfg = dict(config.get("text_config") or config)
    mla = "kv_lora_rank" in cfg and cfg.get("kv_lora_rank")
    n_exp = next((cfg[k] for k in _EXPERT_KEYS if cfg.get(k)), 0)
    dense = not n_exp or bool(cfg.get("first_k_dense_replace")) or bool(cfg.get("mlp_only_layers"))
    return Model(name=name, family=cfg.get("model_type", name), source="", attention="mla" if mla else "gqa",
                 dense_mlp=dense, experts=bool(n_exp), config=cfg)


def _get(cfg: dict, key: str, model: str) -> int:
    if key not in cfg or not isinstance(cfg[key], int) or cfg[key] <= 0:
        raise ValueError(f"config of {model}: expected a positive int {key!r}, got {cfg.get(key)!r}")
    return cfg[key]


def _attention(m: Model) -> list[tuple[str, int, int]]:
    c, g = m.config, (lambda key: _get(m.config, key, m.name))
    hidden, heads = g("hidden_size"), g("num_attention_heads")
    if m.attention == "mla":
        nope, rope, v = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
        q_rank, kv_rank = g("q_lora_rank"), g("kv_lora_rank")
        return [("q_a", q_rank, hidden), ("kv_a", kv_rank + rope, hidden), ("q_b", heads * (nope + rope), q_rank),
                ("kv_b", heads * (nope + v), kv_rank), ("o", hidden, heads * v)]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    return [("qkv", (heads + 2 * kv) * head_dim, hidden), ("o", hidden, heads * head_dim)]


def _mlp(m: Model) -> list[tuple[str, int, int]]:
    c, g = m.config, (lambda key: _get(m.config, key, m.name))
    hidden = g("hidden_size")
    out = []
    if m.dense_mlp:
        inter = g("intermediate_size")
        out += [("gate_up", 2 * inter, hidden), ("down", hidden, inter)]
    shared = c.get("n_shared_experts") or 0
    if m.experts and shared:
        inter = shared * g("moe_intermediate_size")
        out += [("shared.gate_up", 2 * inter, hidden), ("shared.down", hidden, inter)]
    return out


def _experts(m: Model) -> list[tuple[str, int, int, int, int]]:
    if not m.experts:
        return []
    c = m.config
    hidden = _get(c, "hidden_size", m.name)
    key = next((k for k in _EXPERT_KEYS if c.get(k)), None)
    if key is None:
        raise ValueError(f"config of {m.name}: expected one of {_EXPERT_KEYS} (experts: true), got none")
    E, topk = c[key], _get(c, "num_experts_per_tok", m.name)
    inter = _get(c, "moe_intermediate_size" if c.get("moe_intermediate_size") else "intermediate_size", m.name)
    return [("experts.gate_up", E, 2 * inter, hidden, topk), ("experts.down", E, hidden, inter, topk)]


def model_layers(m: Model) -> list[Layer]:
    """Every layer of one model's decode step, from its config."""
    dense = _attention(m) + _mlp(m) + [("lm_head", _get(m.config, "vocab_size", m.name),
                                        _get(m.config, "hidden_size", m.name))]
    out = [Layer(m.name, m.family, name, N, K) for name, N, K in dense]
    out += [Layer(m.name, m.family, name, N, K, E, topk) for name, E, N, K, topk in _experts(m)]
    return out


def layers(models: Iterable[Model] | None = None) -> list[Layer]:
    """Every layer of ``models`` (default: the ``models`` suite), in file order."""
    return [lay for m in (load_models() if models is None else models) for lay in model_layers(m)]


def families(models: Iterable[Model] | None = None) -> list[str]:
    """The families of ``models`` in file order."""
    return list(dict.fromkeys(m.family for m in (load_models() if models is None else models)))


def split_of(models: Sequence[Model] | None = None) -> dict[str, str]:
    """family -> "tune" or "held-out" (the module docstring says how)."""
    models = load_models() if models is None else models
    size = {f: 0 for f in families(models)}
    for lay in layers(models):
        if lay.dense:
            size[lay.family] += lay.weights
    order = sorted(size, key=lambda f: (-size[f], f))
    return {f: SPLITS[i % 2] for i, f in enumerate(order)}


def select(models: Sequence[Model] | None = None, *, families_: Sequence[str] | None = None,
           split: str | None = None, min_weights: int = 0) -> list[Layer]:
    """The layers of the families named (None: all) in ``split`` (None: both), of at least ``min_weights`` elements
    per matrix."""
    models = load_models() if models is None else models
    known = families(models)
    if families_:
        for f in families_:
            check_choice("families", f, known)
    if split is not None:
        check_choice("split", split, SPLITS)
    halves = split_of(models)
    return [lay for lay in layers(models)
            if (not families_ or lay.family in families_) and (split is None or halves[lay.family] == split)
            and lay.weights >= min_weights]


def dense_shapes(sel: Iterable[Layer]) -> list[tuple[int, int]]:
    """The distinct (N, K) of the dense layers of ``sel``, largest first (a shape several models share runs once)."""
    shapes = {(lay.N, lay.K) for lay in sel if lay.dense}
    return sorted(shapes, key=lambda s: (-s[0] * s[1], s))


def moe_shapes(sel: Iterable[Layer]) -> list[MoeShape]:
    """The distinct expert stacks of ``sel`` as the harness's :class:`~kbit.bench.moe.MoeShape` (named by the first
    model that has them)."""
    out: dict[tuple, MoeShape] = {}
    for lay in sel:
        if not lay.dense:
            key = (lay.E, lay.N, lay.K, lay.topk)
            out.setdefault(key, MoeShape(f"{lay.model}.{lay.name.removeprefix('experts.')}", *key))
    return list(out.values())


def spread(shapes: list, n: int | None) -> list:
    """At most ``n`` of ``shapes`` (sorted by size), evenly spaced over them (the largest and the smallest
    included)."""
    if n is None or n >= len(shapes):
        return list(shapes)
    if n <= 1:
        return list(shapes[:max(n, 0)])
    idx = sorted({round(i * (len(shapes) - 1) / (n - 1)) for i in range(n)})
    return [shapes[i] for i in idx]


def shape_families(sel: Iterable[Layer]) -> dict[tuple[int, int], str]:
    """(N, K) -> the family of the first dense layer of ``sel`` with that shape."""
    out: dict[tuple[int, int], str] = {}
    for lay in sel:
        if lay.dense:
            out.setdefault((lay.N, lay.K), lay.family)
    return out


def by_bands(shapes: Sequence[tuple[int, int]], edges: Sequence[int],
             family: dict[tuple[int, int], str] | None = None) -> list[tuple[int, int]]:
    """``shapes`` reordered so that any first few cover every band of N x K (bounds ``edges``) and, within a band,
    the model families (``family``: shape -> family) in turn: rounds over the bands, largest band first, each
    taking the largest shape left of the family picked least so far. A run cut short by its budget (``kbit tune``)
    then holds shapes of every size and family rather than the largest only."""
    family = family or {}

    def band(s):
        return sum(s[0] * s[1] >= e for e in edges)

    left: dict[int, list] = {}
    for s in sorted(dict.fromkeys(shapes), key=lambda s: (-s[0] * s[1], s)):
        left.setdefault(band(s), []).append(s)
    picks: dict[str, int] = {}
    out = []
    while any(left.values()):
        for b in sorted(left, reverse=True):
            if not left[b]:
                continue
            s = min(left[b], key=lambda s: (picks.get(family.get(s, ""), 0), -s[0] * s[1], s))
            left[b].remove(s)
            picks[family.get(s, "")] = picks.get(family.get(s, ""), 0) + 1
            out.append(s)
    return out


def unseen_shapes(models: Sequence[Model] | None = None, **select_kw) -> list[tuple[int, int]]:
    """The dense (N, K) of the held-out half (narrowed by ``select_kw``: ``families_``, ``min_weights``) that no layer
    of the tune half has: the shapes on which a rule fitted on the tune half is judged."""
    models = load_models() if models is None else models
    seen = set(dense_shapes(select(models, split="tune")))
    return [s for s in dense_shapes(select(models, split="held-out", **select_kw)) if s not in seen]


def suite_markdown(models: Sequence[Model] | None = None) -> str:
    """The suite as markdown: per model its family, half, config values (``?``: marked unsure), source, and the
    layer shapes derived from them."""
    models = load_models() if models is None else models
    halves = split_of(models)
    lines = ["| model | family | half | config values | layers (N x K; experts E x N x K, top-k) |",
             "|---|---|---|---|---|"]
    for m in models:
        cfg = ", ".join(f"{k}={v}{'?' if k in m.unsure else ''}" for k, v in m.config.items())
        lays = ", ".join(f"{lay.name} {lay.N}x{lay.K}" if lay.dense else
                         f"{lay.name} {lay.E}x{lay.N}x{lay.K} top-{lay.topk}" for lay in model_layers(m))
        lines.append(f"| [{m.name}]({m.source}) | {m.family} | {halves[m.family]} | {cfg} | {lays} |")
    dense = [lay for lay in layers(models) if lay.dense]
    lines += ["", f"{len(models)} models, {len(families(models))} families, {len(dense)} dense layers "
              f"({len(dense_shapes(dense))} distinct shapes), {len(moe_shapes(layers(models)))} expert stacks. "
              f"Regenerate with `python -m kbit.bench.suite`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # ``python -m kbit.bench.suite``: the suite as markdown
    print(suite_markdown(), end="")
