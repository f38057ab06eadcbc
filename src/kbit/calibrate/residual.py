"""Rotate the residual stream of a decoder model once, offline: the rotated projections need no online transform.

QuaRot's computational invariance, in plain torch on a Hugging Face model, in place. With ``R [H, H]`` orthogonal
(:class:`~kbit.calibrate.rotation.RandomHadamard` over the hidden size) and every RMSNorm weight ``g`` folded into
the Linears that read the normed ``x`` (``W <- W diag(g)``, then ``g = 1``; Gemma's ``(1 + g)`` form: ``g = 0``),
``RMSNorm(x R) = RMSNorm(x) R``, because the norm's mean of squares does not change under ``R``. So the model computes
the same function when the residual stream holds ``x R`` instead of ``x``:

- the embedding ``E <- E R``; every Linear reading the residual (q/k/v, gate/up, the MoE router and experts'
  gate_up, lm_head) ``W <- W R``; every Linear writing into it (o_proj, down_proj, the experts' down) ``W <- R^T W``
  and its bias ``b <- b R``;
- o_proj's input too, with a per-head Hadamard ``Q [d, d]`` (``d = head_dim``): V's rows of each head
  ``W_v <- Q^T W_v`` (bias ``b_v <- b_v Q``) and o_proj's columns of each head ``W_o <- W_o Q``. Attention is
  linear in V per head (``a = softmax(.) V``, so ``a Q`` from ``V Q``), and q/k (with Qwen3/Gemma3's per-head
  q_norm/k_norm after the projection) are untouched: the scores do not change;
- down_proj's input, ``SiLU(gate) * up``, is elementwise in the intermediate dimension and cannot be rotated offline:
  down_proj keeps its input basis (:attr:`RotationReport.online_inputs` names it; kbit's fused ``silu_mul`` can
  rotate it online, which this module does not decide).

Afterwards q/k/v, gate/up, o_proj and lm_head hold rotated ("incoherent") weights and are quantized as they are,
with ``rotation=None``; the float model's logits equal the original's up to float rounding. Hidden states a caller
reads from the model (``output_hidden_states``) are in the rotated basis.

Supported families and what differs between them are :data:`FAMILIES`; anything else is refused before any weight
changes. Gemma3's sandwich norms (``post_attention_layernorm`` / ``post_feedforward_layernorm``, on the output of
o_proj / down_proj before the residual add) commute with ``R`` only when their weight is one constant (``RMSNorm(y R)
diag(c) = RMSNorm(y) diag(c) R`` needs ``diag(c)`` to commute with ``R``): a model whose post norms are not constant
is refused: Gemma-3-270M's are not (layer 0's post_attention_layernorm weight runs from -1.0 to 51.5), so trained
Gemma3 checkpoints are refused; tiny random ones (post norms initialised to zero) are rotated.

Measured on SmolLM2 (``benchmarks/results/cpu/residual-rotation-smollm2-2026-11-26.md``): followed by RTN the
rotation loses quality (mostly through the norm folding); followed by GPTQ it gains (k = 3 KL 1.01 -> 0.58).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kbit.calibrate.rotation import RandomHadamard
from kbit.utils.checks import check_choice, check_int, fail

#: the config attribute that marks a rotated model (saved in config.json with it; a second call refuses)
MARK = "kbit_residual_rotation"
#: ``R`` over the hidden size: a randomized Hadamard (mixes blocks of the largest power of two dividing H), or a
#: seeded random orthogonal matrix (mixes all H channels; fine here because ``R`` is never applied online)
KINDS = ("hadamard", "orthogonal")


@dataclass(frozen=True)
class RandomOrthogonal:
    """A dense random orthogonal ``R [K, K]`` (QR of a seeded float64 Gaussian, signs fixed so it is Haar
    distributed), with :class:`RandomHadamard`'s ``rotate``: ``x @ R`` along the last dimension."""

    K: int
    seed: int = 0

    @property
    def block(self) -> int:
        return self.K

    def __post_init__(self):
        check_int("K", self.K, minimum=1)
        check_int("seed", self.seed, minimum=0)

    @functools.cached_property
    def matrix(self) -> torch.Tensor:
        """``R [K, K]`` in float64 (made once: every weight of a model is multiplied by it)."""
        g = torch.Generator().manual_seed(self.seed)
        q, r = torch.linalg.qr(torch.randn(self.K, self.K, generator=g, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.K:
            fail(ValueError, "x", f"last dimension K={self.K}", tuple(x.shape))
        return x @ self.matrix.to(x.dtype)


@dataclass(frozen=True)
class Family:
    """Where one model family keeps its norms, and the norm's convention."""

    mlp_norm: str = "post_attention_layernorm"  # the norm before the MLP (its readers: gate/up, router, experts)
    post_norms: tuple[str, ...] = ()  # sandwich norms on a block's output, before the residual add
    norm_offset: float = 0.0  # the norm scales by (offset + g): Gemma's 1 + g
    fused: bool = False  # phi3: one qkv_proj [q | k | v] and one gate_up_proj


FAMILIES = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(), "qwen3": Family(), "qwen3_moe": Family(),
    "mixtral": Family(), "phi3": Family(fused=True),
    "gemma3_text": Family(mlp_norm="pre_feedforward_layernorm", norm_offset=1.0,
                          post_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
}


@dataclass(frozen=True)
class RotationReport:
    """What :func:`rotate_residual` did.

    Attributes
    ----------
    model_type : the family (``config.model_type``).
    seed : the seed of ``R`` and of the per-head ``Q`` (:class:`RandomHadamard`).
    kind : ``R``'s kind (:data:`KINDS`).
    hidden_size, block : ``R [H, H]`` and the number of channels it mixes: the Hadamard block (the largest power
        of two dividing H), or H for ``orthogonal``.
    head_dim, head_block : the same for ``Q``.
    folded_norms : how many RMSNorm weights were folded into the Linears after them.
    rotated : names of the weights changed (parameters, e.g. ``model.layers.0.self_attn.q_proj.weight``).
    online_inputs : the Linears whose input stays in the original basis (down_proj, the experts' down): candidates
        for an online rotation, not applied.
    untied_bytes : memory the untied lm_head adds (0 where the head was not tied or the final norm is all ones).
    incoherence_before, incoherence_after : the mean over the rotated matrices of the mean per-row
        ``max |w| / rms(w)`` (lower: flatter rows, less lost to k-bit rounding).
    """

    model_type: str
    seed: int
    kind: str
    hidden_size: int
    block: int
    head_dim: int
    head_block: int
    folded_norms: int
    rotated: tuple[str, ...]
    online_inputs: tuple[str, ...]
    untied_bytes: int
    incoherence_before: float
    incoherence_after: float


def max_to_rms(W: torch.Tensor) -> float:
    """The mean over rows of ``max |w| / rms(w)`` of ``W [..., K]`` (computed in float64)."""
    rows = W.detach().reshape(-1, W.shape[-1])
    total = 0.0
    for start in range(0, rows.shape[0], 4096):  # chunks: an embedding in float64 at once is gigabytes
        w = rows[start:start + 4096].double()
        rms = w.pow(2).mean(-1).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
        total += float((w.abs().amax(-1) / rms).sum())
    return total / rows.shape[0]


class _Plan:
    """The edits of one model, collected and checked before any weight changes: ``ops[param]`` is the list of
    functions applied to the float64 weight in order; ``norms`` the norm weights to reset."""

    def __init__(self):
        self.ops: dict[nn.Parameter, list[Callable]] = {}
        self.names: dict[nn.Parameter, str] = {}
        self.norms: list[tuple[nn.Parameter, float]] = []
        self.matrices: dict[nn.Parameter, None] = {}  # the rotated weights measured in the report (ordered set)

    def add(self, name: str, p: nn.Parameter, op: Callable, matrix: bool = False) -> None:
        self.ops.setdefault(p, []).append(op)
        self.names[p] = name
        if matrix:
            self.matrices[p] = None


def _cols(rot: RandomHadamard) -> Callable:
    """``W <- W R`` on the last dimension."""
    return rot.rotate


def _rows(rot: RandomHadamard) -> Callable:
    """``W <- R^T W`` on the second-to-last dimension (a writer's output rows)."""
    return lambda w: rot.rotate(w.transpose(-1, -2)).transpose(-1, -2)


def _scale_cols(g: torch.Tensor) -> Callable:
    """``W <- W diag(g)``: a norm weight folded into a reader."""
    return lambda w: w * g.to(w.dtype)


def _head_rows(q: RandomHadamard, start: int, stop: int) -> Callable:
    """``W_v <- Q^T W_v`` per head on rows ``start:stop`` (a 1-D bias: ``b <- b Q`` per head)."""
    def op(w):
        w = w.clone()
        part = w[start:stop]
        if w.dim() == 1:
            w[start:stop] = q.rotate(part.reshape(-1, q.K)).reshape(-1)
        else:
            heads = part.reshape(-1, q.K, part.shape[-1]).transpose(-1, -2)  # [heads, K_in, d]
            w[start:stop] = q.rotate(heads).transpose(-1, -2).reshape(part.shape)
        return w
    return op


def _head_cols(q: RandomHadamard) -> Callable:
    """``W_o <- W_o Q`` per head on o_proj's input columns."""
    return lambda w: q.rotate(w.reshape(w.shape[0], -1, q.K)).reshape(w.shape)


def _linear(parent: nn.Module, path: str, prefix: str, in_features: int | None = None,
            out_features: int | None = None) -> nn.Linear:
    name = f"{prefix}.{path}"
    try:
        m = parent.get_submodule(path)
    except AttributeError:
        fail(ValueError, "model", f"a module {name}", "none (an architecture rotate_residual does not know)")
    if type(m) is not nn.Linear:  # a quantized layer (KbitLinear, ...) cannot be rotated: rotate, then quantize
        fail(ValueError, name, "a float torch.nn.Linear (rotate before quantizing)", type(m).__name__)
    if in_features is not None and m.in_features != in_features:
        fail(ValueError, f"{name}.in_features", in_features, m.in_features)
    if out_features is not None and m.out_features != out_features:
        fail(ValueError, f"{name}.out_features", out_features, m.out_features)
    return m


def _norm_scale(norm: nn.Module, name: str, H: int, offset: float) -> torch.Tensor:
    """The float64 per-channel scale ``offset + g`` of an RMSNorm; refuses LayerNorm and biased norms."""
    if not type(norm).__name__.endswith("RMSNorm"):
        fail(ValueError, name, "an RMSNorm (a LayerNorm subtracts the mean, which does not commute with R)",
             type(norm).__name__)
    if getattr(norm, "bias", None) is not None:
        fail(ValueError, f"{name}.bias", "None (a norm bias does not commute with R)", "a bias")
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (H,):
        fail(ValueError, f"{name}.weight", f"a tensor of shape ({H},)", getattr(w, "shape", None))
    return w.detach().double() + offset


def _attention(plan, attn, prefix, config, family, H, g, R, Q) -> None:
    d = Q.K
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    if hasattr(attn, "v_norm"):
        fail(ValueError, f"{prefix}.v_norm", "no norm on V (it would not commute with the head rotation)",
             "a v_norm")
    if family.fused:
        readers = [("qkv_proj", _linear(attn, "qkv_proj", prefix, H, (nq + 2 * nkv) * d))]
        v_rows = ((nq + nkv) * d, (nq + 2 * nkv) * d)
    else:
        readers = [(n, _linear(attn, n, prefix, H, (nq if n == "q_proj" else nkv) * d))
                   for n in ("q_proj", "k_proj", "v_proj")]
        v_rows = (0, nkv * d)
    for n, m in readers:
        plan.add(f"{prefix}.{n}.weight", m.weight, _scale_cols(g))
        plan.add(f"{prefix}.{n}.weight", m.weight, _cols(R), matrix=True)
    v_name, v = readers[-1]
    plan.add(f"{prefix}.{v_name}.weight", v.weight, _head_rows(Q, *v_rows))
    if v.bias is not None:
        plan.add(f"{prefix}.{v_name}.bias", v.bias, _head_rows(Q, *v_rows))
    o = _linear(attn, "o_proj", prefix, nq * d, H)
    plan.add(f"{prefix}.o_proj.weight", o.weight, _head_cols(Q))
    plan.add(f"{prefix}.o_proj.weight", o.weight, _rows(R), matrix=True)
    if o.bias is not None:
        plan.add(f"{prefix}.o_proj.bias", o.bias, R.rotate)


def _mlp(plan, mlp, prefix, family, H, g, R) -> list[str]:
    """Plan one MLP or MoE block; returns the names of the Linears whose input stays unrotated."""
    if hasattr(mlp, "shared_expert") or hasattr(mlp, "shared_experts"):
        fail(ValueError, f"{prefix}.shared_expert", "no shared expert (not among the supported families)",
             "one")
    if hasattr(mlp, "experts"):
        router = mlp.gate
        w = getattr(router, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2 or w.shape[1] != H:
            fail(ValueError, f"{prefix}.gate.weight", f"a router weight [E, {H}]", getattr(w, "shape", None))
        experts = mlp.experts
        names = {n for n, _ in experts.named_parameters()}
        if names != {"gate_up_proj", "down_proj"}:
            fail(ValueError, f"{prefix}.experts", "fused experts holding gate_up_proj [E, 2I, H] and down_proj "
                 "[E, H, I] (transformers >= 5)", sorted(names) or type(experts).__name__)
        gu, down = experts.gate_up_proj, experts.down_proj
        if gu.shape[-1] != H or down.shape[-2] != H:
            fail(ValueError, f"{prefix}.experts", f"hidden size {H}", (tuple(gu.shape), tuple(down.shape)))
        for n, p in (("gate.weight", w), ("experts.gate_up_proj", gu)):
            plan.add(f"{prefix}.{n}", p, _scale_cols(g))
            plan.add(f"{prefix}.{n}", p, _cols(R), matrix=True)
        plan.add(f"{prefix}.experts.down_proj", down, _rows(R), matrix=True)
        return [f"{prefix}.experts.down_proj"]
    readers = ["gate_up_proj"] if family.fused else ["gate_proj", "up_proj"]
    for n in readers:
        m = _linear(mlp, n, prefix, H)
        plan.add(f"{prefix}.{n}.weight", m.weight, _scale_cols(g))
        plan.add(f"{prefix}.{n}.weight", m.weight, _cols(R), matrix=True)
    down = _linear(mlp, "down_proj", prefix, None, H)
    plan.add(f"{prefix}.down_proj.weight", down.weight, _rows(R), matrix=True)
    if down.bias is not None:
        plan.add(f"{prefix}.down_proj.bias", down.bias, R.rotate)
    return [f"{prefix}.down_proj"]


def _check_model(model: nn.Module) -> tuple[str, Family]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        fail(ValueError, "model", f"a decoder of one of the families {sorted(FAMILIES)}", repr(model_type))
    if getattr(config, MARK, None):
        fail(ValueError, "model", "a model whose residual stream is not rotated yet",
             f"config.{MARK} = {getattr(config, MARK)} (rotated already)")
    for flag in ("parallel_attn", "parallel_residual", "use_parallel_residual"):
        if getattr(config, flag, False):
            fail(ValueError, f"config.{flag}", "False (parallel attention/MLP is not supported)", True)
    return model_type, FAMILIES[model_type]


def _plan(model: nn.Module, seed: int, kind: str) -> tuple[_Plan, RotationReport, dict]:
    """Every edit of the model and the report's fixed fields; raises before anything changes."""
    model_type, family = _check_model(model)
    config = model.config
    base = getattr(model, "model", None)
    layers, final_norm = getattr(base, "layers", None), getattr(base, "norm", None)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(layers, nn.ModuleList) or final_norm is None or emb is None or head is None:
        fail(ValueError, "model", "model.model.layers, model.model.norm, input and output embeddings",
             type(model).__name__)
    H = config.hidden_size
    if not isinstance(emb, nn.Embedding) or emb.weight.shape[-1] != H:
        fail(ValueError, "model.embed_tokens", f"an nn.Embedding of width {H}", type(emb).__name__)
    d = getattr(layers[0].self_attn, "head_dim", None) or H // config.num_attention_heads
    R = RandomHadamard(H, seed) if kind == "hadamard" else RandomOrthogonal(H, seed)
    Q = RandomHadamard(d, seed)
    plan = _Plan()
    online = []
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        for n in family.post_norms:
            scale = _norm_scale(getattr(layer, n, None), f"{prefix}.{n}", H, family.norm_offset)
            if not torch.all(scale == scale[0]):
                fail(ValueError, f"{prefix}.{n}.weight", "one constant (a sandwich norm after the block does not "
                     "commute with the residual rotation otherwise)", f"values from {float(scale.min()):.4g} to "
                     f"{float(scale.max()):.4g}")
        for norm_name, block in (("input_layernorm", "self_attn"), (family.mlp_norm, "mlp")):
            norm = getattr(layer, norm_name, None)
            g = _norm_scale(norm, f"{prefix}.{norm_name}", H, family.norm_offset)
            plan.norms.append((norm.weight, 1.0 - family.norm_offset))
            if block == "self_attn":
                _attention(plan, layer.self_attn, f"{prefix}.self_attn", config, family, H, g, R, Q)
            else:
                online += _mlp(plan, layer.mlp, f"{prefix}.mlp", family, H, g, R)
    g = _norm_scale(final_norm, "model.norm", H, family.norm_offset)
    plan.norms.append((final_norm.weight, 1.0 - family.norm_offset))
    if type(head) is not nn.Linear or head.in_features != H:
        fail(ValueError, "lm_head", f"a float nn.Linear reading {H} features", type(head).__name__)
    tied = head.weight is emb.weight
    untie = tied and not torch.all(g == 1)
    extra = dict(untie=untie, head=head, emb=emb, head_ops=(_scale_cols(g), _cols(R)))
    plan.add("model.embed_tokens.weight", emb.weight, _cols(R), matrix=True)
    report = dict(model_type=model_type, seed=seed, kind=kind, hidden_size=H, block=R.block, head_dim=d,
                  head_block=Q.block, folded_norms=len(plan.norms), online_inputs=tuple(online),
                  untied_bytes=head.weight.numel() * head.weight.element_size() if untie else 0)
    return plan, report, extra


def residual_unsupported(model: nn.Module) -> str | None:
    """Why :func:`rotate_residual` would refuse ``model`` (its ValueError's message), or None where it would
    rotate it. Changes nothing."""
    try:
        _plan(model, 0, "hadamard")
    except ValueError as e:
        return str(e)
    return None


@torch.no_grad()
def rotate_residual(model: nn.Module, seed: int = 0, kind: str = "hadamard") -> RotationReport:
    """Rotate ``model``'s residual stream by a randomized Hadamard ``R`` in place (see the module docstring).

    Parameters
    ----------
    model : a float Hugging Face causal LM of a family in :data:`FAMILIES`, not quantized yet.
    seed : the seed of ``R`` (hidden size) and of the per-head ``Q`` (head_dim).
    kind : ``R``'s kind (:data:`KINDS`): ``"hadamard"`` (:class:`RandomHadamard`) or ``"orthogonal"``
        (:class:`RandomOrthogonal`, all H channels mixed). ``Q`` is always a randomized Hadamard.

    Returns
    -------
    RotationReport; ``model.config.kbit_residual_rotation`` records seed and blocks (a second call refuses).

    Every check runs before the first weight changes (ValueError naming what is unsupported). A tied lm_head is
    untied when the final norm's weight is not all ones (the head then holds ``E diag(g) R``, the embedding
    ``E R``): ``RotationReport.untied_bytes`` more memory, and ``config.tie_word_embeddings = False``.

    Example
    -------
    >>> report = rotate_residual(model)  # then quantize q/k/v, gate/up, o_proj, lm_head with rotation=None
    """
    check_int("seed", seed, minimum=0)
    check_choice("kind", kind, KINDS)
    plan, fields, extra = _plan(model, seed, kind)
    head = extra["head"]
    if extra["untie"]:  # the head's own tensor, copied before the embedding is rotated
        head.weight = nn.Parameter(extra["emb"].weight.detach().clone(), requires_grad=False)
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    if head.weight is not extra["emb"].weight:  # tied with an all-ones final norm: E R serves both
        fold, rot = extra["head_ops"]
        plan.add("lm_head.weight", head.weight, fold)
        plan.add("lm_head.weight", head.weight, rot, matrix=True)
    before = [max_to_rms(p) for p in plan.matrices]
    for p, ops in plan.ops.items():
        w = p.detach().double()
        for op in ops:
            w = op(w)
        p.copy_(w.to(p.dtype))
    for w, value in plan.norms:
        w.fill_(value)
    after = [max_to_rms(p) for p in plan.matrices]
    setattr(model.config, MARK, {"seed": seed, "kind": kind, "block": fields["block"],
                                 "head_block": fields["head_block"]})
    return RotationReport(**fields, rotated=tuple(plan.names[p] for p in plan.ops),
                          incoherence_before=sum(before) / len(before), incoherence_after=sum(after) / len(after))
