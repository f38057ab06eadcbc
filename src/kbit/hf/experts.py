"""``KbitExperts``: a drop-in for the fused MoE expert modules of transformers >= 5 (``Qwen3MoeExperts``,
``MixtralExperts``, ...), holding ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` in k bits.

Same ``forward(hidden_states, top_k_index, top_k_weights)`` as those modules: for each expert that any token
was routed to, ``act(x @ gate.T) * (x @ up.T) @ down.T`` weighted by the router, through kbit's linear op on
that expert's slice of the stacked weight (the float32 reference on the CPU). Modules that store their stacks
``[E, H, 2I]``, add biases or gate with their own ``_apply_gate`` (gpt-oss) are held as ``[E, 2I, H]`` in their
own row order and computed as they compute (:meth:`KbitExperts.like`). On CUDA the routed pairs go through
``kbit.dispatch.moe``'s grouped kernels in one pass, without a host sync (CUDA graphs can hold it); on the CPU
a loop over the experts. This is the Hugging Face adapter; ``kbit.nn.KbitMoE`` also routes on the device and
reads the stacks in the tensor-core layout.

Each stacked weight is a child module (:class:`KbitStack`, ``gate_up`` and ``down``) with the buffers
``codes``, ``scales``, ``tensor_scale``, ``codebook``, so the state dict names (``...experts.gate_up.codes``) are
exactly the names ``kbit.save_file`` gives a :class:`~kbit.format.KbitWeight` saved as ``...experts.gate_up``:
one folder format serves ``kbit.load_quantized`` and transformers' ``from_pretrained``.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kbit.dispatch.linear import linear as _linear_impl
from kbit.dispatch.moe import choose_plan, expert_matmul, routed_experts
from kbit.format.pack import words_per_row
from kbit.format.spec import DEFAULT_SCALE_FORMAT, KbitWeight, padded_k
from kbit.nn._layout import apply_keeping_format
from kbit.nn.moe import is_silu
from kbit.ops.moe import combine
from kbit.ops.moe_align import align
from kbit.ops.quantize import quantize
from kbit.utils.device import interpreting

PARTS = ("codes", "scales", "tensor_scale", "codebook")
WEIGHTS = ("gate_up_proj", "down_proj")
#: the child module holding each weight. Not the transformers parameter names: transformers >= 5 rewrites
#: ``experts.gate_up_proj`` / ``experts.down_proj`` when it saves (back to per-expert tensors), which would
#: split our codes; under other names the k-bit tensors are saved as they are.
CHILDREN = {"gate_up_proj": "gate_up", "down_proj": "down"}


def _linear(x: torch.Tensor, qw: KbitWeight) -> torch.Tensor:
    return _linear_impl(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, k=qw.k, blocksize=qw.blocksize,
                        scale_format=qw.scale_format, N=qw.N, K=qw.K)


def empty_weight(shape, k: int, blocksize: int, scale_format: str = DEFAULT_SCALE_FORMAT,
                 codebook_name: str = "custom", device=None) -> KbitWeight:
    """A :class:`KbitWeight` of ``shape`` with uninitialised tensors (on ``device``, e.g. ``"meta"``): the
    shell a checkpoint is loaded into."""
    shape = tuple(int(s) for s in shape)
    lead, (N, K) = shape[:-2], shape[-2:]
    kp = padded_k(K, blocksize)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    return KbitWeight(torch.empty(lead + (N, words_per_row(k, kp)), dtype=torch.int32, device=device),
                      torch.empty(lead + (N, kp // blocksize), dtype=sdt, device=device),
                      torch.empty(lead, dtype=torch.float32, device=device),
                      torch.empty(2**k, dtype=torch.float32, device=device),
                      shape, k, blocksize, scale_format, codebook_name)


class KbitStack(nn.Module):
    """One stacked k-bit weight ``[E, N, K]`` as buffers ``codes``, ``scales``, ``tensor_scale``, ``codebook``."""

    def __init__(self, qw: KbitWeight):
        super().__init__()
        for part, t in qw.tensors().items():
            self.register_buffer(part, t)
        self.shape, self.k, self.blocksize = qw.shape, qw.k, qw.blocksize
        self.scale_format, self.codebook_name = qw.scale_format, qw.codebook_name

    def weight(self) -> KbitWeight:
        return KbitWeight(*(getattr(self, p) for p in PARTS), shape=self.shape, k=self.k, blocksize=self.blocksize,
                          scale_format=self.scale_format, codebook_name=self.codebook_name)

    def _apply(self, fn, recurse=True):  # model.to(torch.bfloat16) keeps the format's float32 tensors
        return apply_keeping_format(self, super()._apply, fn, recurse, model_dtype=())

    def extra_repr(self) -> str:
        return (f"shape={self.shape}, k={self.k}, blocksize={self.blocksize}, scale_format={self.scale_format!r}, "
                f"codebook={self.codebook_name!r}")


class KbitExperts(nn.Module):
    """MoE experts with stacked k-bit weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.

    Children ``gate_up`` and ``down`` (:class:`KbitStack`), each with the four tensors of its weight.

    The rows of ``gate_up_proj`` keep the source module's order (gate then up, or interleaved as gpt-oss stores
    them), so ``gate_fn`` (the source's own ``_apply_gate``, bound to a copy of its plain attributes, e.g.
    gpt-oss's clamped SwiGLU) reads the product as the source did; without it, ``act_fn(gate) * up`` of the two
    halves. ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]``: optional buffers, added after each product.
    ``transposed``: the source stored its stacks as ``[E, H, 2I]`` / ``[E, I, H]`` (recorded for loading).
    """

    def __init__(self, gate_up_proj: KbitWeight, down_proj: KbitWeight, act_fn, dtype: torch.dtype, *,
                 gate_fn=None, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 transposed: bool = False):
        super().__init__()
        E, two_i, H = gate_up_proj.shape
        if len(down_proj.shape) != 3 or down_proj.shape != (E, H, two_i // 2):
            raise ValueError(f"down_proj: expected shape {(E, H, two_i // 2)} for gate_up_proj {gate_up_proj.shape}, "
                             f"got {down_proj.shape}")
        for name, b, shape in (("gate_up_bias", gate_up_bias, (E, two_i)), ("down_bias", down_bias, (E, H))):
            if b is not None and tuple(b.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(b.shape)}")
        if gate_fn is None and not callable(act_fn):
            raise ValueError(f"act_fn: expected a callable (or a gate_fn), got {act_fn!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, two_i // 2
        self.act_fn, self.gate_fn, self.transposed = act_fn, gate_fn, bool(transposed)
        self.dtype = dtype
        self.gate_up = KbitStack(gate_up_proj)
        self.down = KbitStack(down_proj)
        self.register_buffer("gate_up_bias", None if gate_up_bias is None else gate_up_bias.detach().to(dtype))
        self.register_buffer("down_bias", None if down_bias is None else down_bias.detach().to(dtype))

    @classmethod
    def like(cls, source: nn.Module, gate_up_proj: KbitWeight, down_proj: KbitWeight, dtype: torch.dtype,
             gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> KbitExperts:
        """k-bit experts computing as the fused expert module ``source`` does (its activation or own gate, its
        layout), holding the given weights and biases."""
        return cls(gate_up_proj, down_proj, getattr(source, "act_fn", None), dtype, gate_fn=own_gate(source),
                   gate_up_bias=gate_up_bias, down_bias=down_bias, transposed=is_transposed(source))

    @classmethod
    def from_experts(cls, module: nn.Module, k: int, blocksize: int, codebook=None, scale_format: str = "log8",
                     device=None) -> KbitExperts:
        """Quantize a fused expert module (``kbit.quantize`` on each stacked weight, on ``device``, default the
        weight's own); its biases are kept in its dtype."""
        w = module.gate_up_proj.detach()
        stacks = source_stacks(module)
        q = [quantize(t.to(device or w.device), k=k, blocksize=blocksize, codebook=codebook,
                      scale_format=scale_format) for t in stacks]
        biases = [getattr(module, f"{n}_bias", None) for n in WEIGHTS]
        biases = [None if b is None else b.detach().to(device or w.device) for b in biases]
        return cls.like(module, *q, dtype=w.dtype, gate_up_bias=biases[0], down_bias=biases[1])

    def _apply(self, fn, recurse=True):  # the stacks keep their format; biases and the compute dtype follow fn
        return apply_keeping_format(self, super()._apply, fn, recurse, model_dtype=("gate_up_bias", "down_bias"))

    def weight(self, name: str) -> KbitWeight:
        """``"gate_up_proj"`` or ``"down_proj"`` as a stacked :class:`KbitWeight` (sharing the buffers)."""
        if name not in WEIGHTS:
            raise ValueError(f"name: expected one of {WEIGHTS}, got {name!r}")
        return getattr(self, CHILDREN[name]).weight()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """``top_k_weights``: ``[T, top_k]`` beside ``top_k_index``, or (some routers) ``[T, E]`` per expert.
        Slots routed to no expert (an id outside ``[0, E)``, as some routers mark dropped ones) add nothing.

        Where kbit's kernels run (CUDA in fp16 / bf16, or Triton's interpreter): the grouped kernels over all
        routed pairs at once (:meth:`grouped_forward`: no host sync, so a CUDA graph can hold it). Else a loop over
        the experts."""
        if (hidden_states.is_cuda and hidden_states.dtype in (torch.float16, torch.bfloat16)) or interpreting():
            return self.grouped_forward(hidden_states, top_k_index, top_k_weights)
        return self.loop_forward(hidden_states, top_k_index, top_k_weights)

    def grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                        ) -> torch.Tensor:
        """:meth:`forward` through ``kbit.dispatch.moe``: the pairs sorted by expert on the device
        (``kbit.ops.moe_align.align``), the gate_up product of every pair, biases, the gate, the down product,
        biases, and the weighted sum per token. SwiGLU experts without biases take ``routed_experts`` whole,
        under ``torch.compile`` as the op ``torch.ops.kbit.routed_experts`` (a compiled graph holds it)."""
        E, H, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        T, top_k = top_k_index.shape
        if T == 0:
            return torch.zeros_like(hidden_states)
        w = top_k_weights
        if w.shape[-1] == E != top_k:  # weights per expert
            w = w.gather(1, top_k_index.clamp(0, E - 1).long())
        valid = (top_k_index >= 0) & (top_k_index < E)
        ids = torch.where(valid, top_k_index, 0).to(torch.int32)  # in range: the kernels' guards are skipped
        w = torch.where(valid, w.float(), 0.0)
        x = hidden_states.reshape(T, H)
        if self.gate_fn is None and self.gate_up_bias is None and self.down_bias is None and is_silu(self.act_fn):
            if torch.compiler.is_compiling():
                gu, dn = self.gate_up, self.down
                out = torch.ops.kbit.routed_experts(x, ids, w, *(getattr(gu, p) for p in PARTS),
                                                    *(getattr(dn, p) for p in PARTS), gu.k, gu.blocksize,
                                                    gu.scale_format, E, H, I, True)
            else:  # directly: the op's dispatcher costs microseconds a call (kbit.nn.linear says more)
                out = routed_experts(x, ids, w, self.weight("gate_up_proj"), self.weight("down_proj"), checked=True)
            return out.reshape(hidden_states.shape)
        return self._biased_or_own_gate(x, ids, w).reshape(hidden_states.shape)

    # these experts' biases and gate functions run between kbit.dispatch.moe's Python-launched kernels, which are
    # not torch.library ops: under torch.compile dynamo would trace into the launches (inductor failed to build
    # the GEMV kernel it copied, torch 2.11), so the graph breaks here and the experts run as they run eagerly
    @torch.compiler.disable
    def _biased_or_own_gate(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        E, H, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        T, top_k = ids.shape
        routing = align(ids, E, w, checked=True)
        plan = choose_plan(T, top_k, E, H, I, x.dtype, x.device, gemm=False)  # canonical stacks: no kernel 7
        gate_up, down = self.weight("gate_up_proj"), self.weight("down_proj")
        row_expert = routing.expert_ids.long()
        h = expert_matmul(x, routing, gate_up, plan.gate_up, gather=True)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias.index_select(0, row_expert).to(h.dtype)
        if self.gate_fn is None:
            gate, up = h.chunk(2, dim=-1)
            h = self.act_fn(gate) * up
        else:
            h = self.gate_fn(h)
        y = expert_matmul(h.to(x.dtype).contiguous(), routing, down, plan.down, gather=False)
        if self.down_bias is not None:
            y = y + self.down_bias.index_select(0, row_expert).to(y.dtype)
        return combine(y, routing, x.dtype)

    def loop_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                     ) -> torch.Tensor:
        """:meth:`forward` one expert at a time: the experts any token was routed to, found on the host."""
        out = torch.zeros_like(hidden_states)
        gate_up, down = self.weight("gate_up_proj"), self.weight("down_proj")
        per_expert = top_k_weights.shape[-1] == self.num_experts != top_k_index.shape[-1]
        flat_experts = top_k_index.reshape(-1)
        for e in torch.unique(flat_experts).tolist():
            if not 0 <= e < self.num_experts:  # some routers mark dropped slots with E
                continue
            token_idx, slot = torch.where(top_k_index == e)
            x = hidden_states[token_idx]
            h = _linear(x, gate_up[e])
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[e]
            if self.gate_fn is None:
                gate, up = h.chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            else:
                h = self.gate_fn(h)
            y = _linear(h.to(x.dtype), down[e])
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            y = y * (top_k_weights[token_idx, e, None] if per_expert else top_k_weights[token_idx, slot, None])
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        own = "" if self.gate_fn is None else f", gate_fn={getattr(self.gate_fn, '__qualname__', self.gate_fn)}"
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, dtype={self.dtype}{own}"
                f"{', biases' if self.down_bias is not None else ''}")


def hidden_size_of(module: nn.Module) -> int | None:
    """H of a fused expert module, from its attributes or config (None where it names none)."""
    for o in (module, getattr(module, "config", None)):
        for n in ("hidden_dim", "hidden_size"):
            v = getattr(o, n, None)
            if isinstance(v, int):
                return v
    return None


def is_transposed(module: nn.Module) -> bool:
    """Whether a fused expert module stores ``gate_up_proj [E, H, 2I]`` (gpt-oss, Llama-4): transformers' layout
    flag where set, else the stacks' shapes against H (ValueError where they cannot tell)."""
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    gu = module.gate_up_proj
    H = hidden_size_of(module)
    if H is None or (gu.shape[1] == H) == (gu.shape[2] == H):
        raise ValueError(f"{type(module).__name__}: cannot tell whether gate_up_proj {tuple(gu.shape)} is [E, 2I, H] "
                         f"or [E, H, 2I] (hidden size {H}, no is_transposed flag)")
    return gu.shape[1] == H


def own_gate(module: nn.Module):
    """The module's own ``_apply_gate`` (e.g. gpt-oss's clamped SwiGLU on interleaved gate / up), bound to a copy
    of its plain attributes (alpha, limit, act_fn, ...; not its weights); None where it has transformers' default
    or none (then ``act_fn(gate) * up``)."""
    fn = type(module).__dict__.get("_apply_gate")
    if fn is None or getattr(fn, "__name__", "") == "_default_apply_gate":
        return None
    holder = types.SimpleNamespace(**{n: v for n, v in vars(module).items() if not n.startswith("_")})
    return types.MethodType(fn, holder)


def source_stacks(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's stacks as ``[E, 2I, H]`` and ``[E, H, I]`` (rows in its own order), transposed where stored
    otherwise."""
    gu, dn = module.gate_up_proj.detach(), module.down_proj.detach()
    if is_transposed(module):
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    return gu.contiguous(), dn.contiguous()
