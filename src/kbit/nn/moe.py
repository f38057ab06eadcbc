"""``KbitMoE``: a sparse MoE block (SwiGLU experts) whose expert weights are k-bit stacks (format version 1).

``forward(hidden[T, H], router_logits[T, E])`` -> ``[T, H]``: top-k expert choice (``kbit.ops.moe_router``),
pairs as rows (``kbit.ops.moe_align``: sorted with group tables for ``torch._grouped_mm``; for a GEMV-only
step one fused routing launch, rows in router order up to ``PAIR_ORDER_MAX_T`` tokens, else sorted in one
more launch), grouped gate_up, fused SiLU(gate) * up, grouped down, router weights and the combine back to
token order (``kbit.dispatch.moe``). Decode (T = 1) is 5 launches. No host sync: a
step of fixed T is capturable in a CUDA graph (run one eager forward first: Triton compiles, lookup tables
are built and cached).

Built from float stacks (:meth:`KbitMoE.from_float`), from quantized stacks (:meth:`KbitMoE.from_weights`),
or from a Hugging Face block (:meth:`KbitMoE.from_hf`: Mixtral, Qwen2/3-MoE, Qwen3-Next; both the fused 3-D
expert parameters of transformers >= 5 and the older per-expert ``nn.Linear`` lists).

Layouts (as ``kbit.nn.KbitLinear``): the stacks are held once, canonical or in the grouped tensor-core kernel's
layout "mma-v1" (:meth:`KbitMoE.repack_for_kernels`; by default on the first CUDA forward whose plan runs that
kernel, outside graph capture). Repacked, automatic plans run the grouped kernel wherever they would have
run the GEMV (T = 1 included), ``grouped_mm`` dequantizes the touched experts from an unrepacked temporary, and
a pinned ``"gemv"`` unrepacks the whole stack into a temporary each call; ``state_dict`` and
:meth:`gate_up_weight` / :meth:`down_weight` give the canonical layout.

Rotation (``kbit.format.Rotation``, docs/format.md): the gate_up stack may be quantized under one rotation of H
shared by all experts (``from_float(..., rotation="hadamard")``); the block then rotates the routed tokens once
(``kbit.ops.hadamard.rotate``) before the grouped GEMMs, the router and a shared expert still read x. A rotated
down stack is refused: its input (SiLU(gate) * up) is made inside the grouped kernels (``kbit.dispatch.moe``),
which have no rotation step yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kbit.dispatch.moe import (
    MoePlan,
    fused_router_applies,
    gemm_supported,
    moe_experts,
    plan_for_layout,
    route,
    route_hidden,
    router_workspace,
)
from kbit.format.pack import words_per_row
from kbit.format.reference import dequantize_reference
from kbit.format.spec import (
    DEFAULT_BLOCKSIZE,
    DEFAULT_K,
    DEFAULT_SCALE_FORMAT,
    KbitWeight,
    Rotation,
    check_blocksize,
    check_k,
    check_scale_format,
    padded_k,
)
from kbit.nn._layout import CANONICAL, apply_keeping_format, capturing, release
from kbit.ops.glue import add_rms_norm, check_norm
from kbit.ops.hadamard import rotate
from kbit.ops.moe import Uncombined, moe_reference
from kbit.ops.moe_align import MoeRouting
from kbit.ops.moe_router import ROUTERS, select_experts_reference
from kbit.ops.quantize import quantize, unrotate_weight
from kbit.utils.checks import fail
from kbit.utils.device import interpreting

# isort: split
# --- layout "mma-v1" (the dense path moves these to kbit.ops.mma.layout): remap at merge ---
from kbit.ops.mma.layout import LAYOUT as MMA_LAYOUT
from kbit.ops.mma.layout import RepackedWeight, repack_stack, unrepack_stack

# --- end of the layout block ---

__all__ = ["KbitMoE", "add_shared_expert"]

_STACKS = ("gate_up", "down")
_PARTS = ("codes", "scales", "tensor_scale", "codebook")


class KbitMoE(nn.Module):
    """Sparse MoE block with k-bit experts: ``out = sum_s w_s * down_e(silu(gate_e(x)) * up_e(x)) [+ shared]``.

    Buffers (state dict): ``gate_up_{codes,scales,tensor_scale,codebook}`` (a ``[E, 2I, H]`` stack, gate rows
    first), ``down_{...}`` (``[E, H, I]``), optional ``router_weight`` ``[E, H]`` (used when ``forward`` gets
    no logits) and ``correction_bias`` ``[E]`` (sigmoid router). Format parameters in the extra state.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size : E, H, I (I per expert).
    top_k : experts per token.
    router : ``"softmax"`` (Mixtral, Qwen3-MoE, Qwen3-Next) or ``"sigmoid"`` (DeepSeek-V3 style).
    norm_topk_prob : renormalise the top-k weights to sum to 1 (Mixtral: always; Qwen3: its config flag).
    routed_scaling_factor, n_group, topk_group : sigmoid router options (``kbit.ops.moe_router``).
    has_router_weight, has_correction_bias : allocate those buffers.
    shared_expert : optional module ``[T, H] -> [T, H]`` added to the routed output (any module, e.g. an MLP
        of ``KbitLinear``); shared_expert_gate : optional module ``[T, H] -> [T, 1]``, its sigmoid scales the
        shared expert (Qwen2-MoE / Qwen3-Next).
    k, blocksize, scale_format : format parameters of both stacks.
    dtype : activations and output dtype (fp16/bf16 on CUDA; fp32 works through ``torch._grouped_mm``).
    rotation : None, or the :class:`kbit.format.Rotation` of H the gate_up stack was quantized under (module
        docstring); fixed at construction, a state dict must match it.

    ``layout`` (``"canonical"`` or ``"mma-v1"``) and ``auto_repack`` as in ``KbitLinear`` (module docstring);
    ``auto_repack = False`` keeps the canonical layout and plans without the grouped tensor-core kernel.

    Example
    -------
    >>> moe = KbitMoE.from_float(w_gate_up, w_down, top_k=8, k=4).cuda()  # doctest: +SKIP
    >>> out = moe(hidden, router_logits)  # [T, H]  # doctest: +SKIP
    """

    #: repack on the first CUDA forward whose plan runs the grouped tensor-core kernel
    auto_repack: bool = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, *,
                 router: str = "softmax", norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 n_group: int = 1, topk_group: int = 1, has_router_weight: bool = False,
                 has_correction_bias: bool = False, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, k: int = DEFAULT_K,
                 blocksize: int = DEFAULT_BLOCKSIZE, scale_format: str = DEFAULT_SCALE_FORMAT,
                 dtype: torch.dtype = torch.bfloat16, device=None, codebook_name: str = "custom",
                 rotation: Rotation | None = None):
        super().__init__()
        E, H, I = int(num_experts), int(hidden_size), int(intermediate_size)
        if min(E, H, I) < 1:
            raise ValueError(f"num_experts, hidden_size, intermediate_size: expected positive ints, got {E}, {H}, {I}")
        if not (isinstance(top_k, int) and 1 <= top_k <= E):
            raise ValueError(f"top_k: expected an int in [1, {E}], got {top_k}")
        if router not in ROUTERS:
            raise ValueError(f"router: expected one of {ROUTERS}, got {router!r}")
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = E, H, I, top_k
        self.router, self.norm_topk_prob = router, bool(norm_topk_prob)
        self.routed_scaling_factor, self.n_group, self.topk_group = float(routed_scaling_factor), n_group, topk_group
        self.k, self.blocksize = check_k(k), check_blocksize(blocksize)
        self.scale_format = check_scale_format(scale_format)
        self.dtype, self.codebook_name = dtype, codebook_name
        if rotation is not None:
            if not isinstance(rotation, Rotation):
                fail(TypeError, "rotation", "None or a kbit.format.Rotation", type(rotation).__name__)
            rotation.check_width(H, "hidden_size")
        #: the rotation of H the gate_up stack was quantized under (None: unrotated)
        self.rotation = rotation
        self.layout = CANONICAL
        #: pin the kernels (a :class:`~kbit.dispatch.moe.MoePlan`); None = chosen per call by token count
        self.plan: MoePlan | None = None
        #: how the pairs are sorted by expert (``kbit.ops.moe_align.ALIGN_METHODS``)
        self.align_method = "sort"
        sdt = torch.uint8 if scale_format == "log8" else torch.float16
        for name, (N, K) in zip(_STACKS, ((2 * I, H), (H, I)), strict=True):
            kp = padded_k(K, blocksize)
            self.register_buffer(f"{name}_codes", torch.zeros(E, N, words_per_row(k, kp), dtype=torch.int32,
                                                              device=device))
            self.register_buffer(f"{name}_scales", torch.zeros(E, N, kp // blocksize, dtype=sdt, device=device))
            self.register_buffer(f"{name}_tensor_scale", torch.ones(E, dtype=torch.float32, device=device))
            self.register_buffer(f"{name}_codebook", torch.linspace(-1, 1, 2**k, dtype=torch.float32,
                                                                    device=device))
        self.register_buffer("router_weight", torch.zeros(E, H, dtype=dtype, device=device)
                             if has_router_weight else None)
        self.register_buffer("correction_bias", torch.zeros(E, dtype=torch.float32, device=device)
                             if has_correction_bias else None)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    # -- weights ------------------------------------------------------------------------------------------
    def _dims(self, name: str) -> tuple[int, int]:
        return (2 * self.intermediate_size, self.hidden_size) if name == "gate_up" else \
            (self.hidden_size, self.intermediate_size)

    def _canonical_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = getattr(self, f"{name}_codes"), getattr(self, f"{name}_scales")
        if self.layout == CANONICAL:
            return codes, scales
        N, K = self._dims(name)
        return unrepack_stack(codes, scales, k=self.k, blocksize=self.blocksize, N=N, K=K)

    def _stack(self, name: str) -> KbitWeight:
        N, K = self._dims(name)
        codes, scales = self._canonical_codes(name)
        return KbitWeight(codes, scales, getattr(self, f"{name}_tensor_scale"), getattr(self, f"{name}_codebook"),
                          (self.num_experts, N, K), self.k, self.blocksize, self.scale_format, self.codebook_name,
                          self.rotation if name == "gate_up" else None)

    def gate_up_weight(self) -> KbitWeight:
        """The ``[E, 2I, H]`` stack (gate rows ``[0, I)``, up rows ``[I, 2I)``) in the canonical layout, sharing
        the buffers (layout "mma-v1": unrepacked copies of codes and scales)."""
        return self._stack("gate_up")

    def down_weight(self) -> KbitWeight:
        """The ``[E, H, I]`` stack in the canonical layout (as :meth:`gate_up_weight`)."""
        return self._stack("down")

    def kernel_weights(self) -> tuple:
        """(gate_up, down) as held, sharing the buffers: ``KbitWeight`` or ``kbit.ops.gemv_mma.RepackedWeight``."""
        if self.layout == CANONICAL:
            return self._stack("gate_up"), self._stack("down")
        return tuple(RepackedWeight(*(getattr(self, f"{name}_{p}") for p in _PARTS),
                                             (self.num_experts, *self._dims(name)), self.k, self.blocksize,
                                             self.scale_format, self.codebook_name) for name in _STACKS)

    def canonical_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers (``self._buffers``, same names and order) in the canonical layout (unrepacked
        copies of the codes and scales when the module holds layout "mma-v1")."""
        out = dict(self._buffers)
        if self.layout != CANONICAL:
            for name in _STACKS:
                out[f"{name}_codes"], out[f"{name}_scales"] = self._canonical_codes(name)
        return out

    def repack_for_kernels(self) -> KbitMoE:
        """Hold both stacks in layout "mma-v1" only (in place, one stack at a time; the canonical tensors are
        dropped, so freed unless referenced elsewhere). Idempotent; returns self."""
        if self.layout != CANONICAL:
            return self
        for name in _STACKS:
            N, K = self._dims(name)
            old = [getattr(self, f"{name}_codes"), getattr(self, f"{name}_scales")]
            rc, rs = repack_stack(*old, k=self.k, blocksize=self.blocksize, scale_format=self.scale_format, N=N, K=K)
            release(old)
            del old
            setattr(self, f"{name}_codes", rc)
            setattr(self, f"{name}_scales", rs)
        self.layout = MMA_LAYOUT
        return self

    def to_canonical(self) -> KbitMoE:
        """Undo :meth:`repack_for_kernels` (bit-exact, in place). Returns self."""
        if self.layout == CANONICAL:
            return self
        for name in _STACKS:
            codes, scales = self._canonical_codes(name)
            release([getattr(self, f"{name}_codes"), getattr(self, f"{name}_scales")])
            setattr(self, f"{name}_codes", codes)
            setattr(self, f"{name}_scales", scales)
        self.layout = CANONICAL
        return self

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_weights(cls, gate_up: KbitWeight, down: KbitWeight, top_k: int, *,
                     router_weight: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.bfloat16, **kwargs) -> KbitMoE:
        """A block holding quantized stacks ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (shared, not
        copied); ``kwargs``: the router and shared-expert options of the constructor."""
        for name, qw in (("gate_up", gate_up), ("down", down)):
            if not isinstance(qw, KbitWeight) or len(qw.shape) != 3:
                raise ValueError(f"{name}: expected a stacked KbitWeight [E, N, K], got "
                                 f"{getattr(qw, 'shape', type(qw).__name__)}")
        E, I2, H = gate_up.shape
        if I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
            raise ValueError(f"down: expected shape {(E, H, I2 // 2)} for gate_up {gate_up.shape}, got {down.shape}")
        if down.rotation is not None:
            fail(ValueError, "down.rotation", "None (a rotated down stack needs a rotation step inside the grouped "
                 "kernels, kbit.dispatch.moe, which has none yet; rotate gate_up only)", down.rotation)
        for p in ("k", "blocksize", "scale_format"):
            if getattr(gate_up, p) != getattr(down, p):
                raise ValueError(f"down.{p}: expected {getattr(gate_up, p)!r} (that of gate_up), got "
                                 f"{getattr(down, p)!r}")
        m = cls(E, H, I2 // 2, top_k, k=gate_up.k, blocksize=gate_up.blocksize, scale_format=gate_up.scale_format,
                dtype=dtype, device=gate_up.device, codebook_name=gate_up.codebook_name,
                has_router_weight=router_weight is not None, has_correction_bias=correction_bias is not None,
                rotation=gate_up.rotation, **kwargs)
        for name, qw in (("gate_up", gate_up), ("down", down)):
            for p in _PARTS:
                setattr(m, f"{name}_{p}", getattr(qw, p))
        if router_weight is not None:
            m.router_weight = router_weight.detach().to(device=gate_up.device, dtype=dtype).clone()
        if correction_bias is not None:
            m.correction_bias = correction_bias.detach().to(device=gate_up.device, dtype=torch.float32).clone()
        return m

    @classmethod
    def from_float(cls, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, *, k: int = DEFAULT_K,
                   blocksize: int = DEFAULT_BLOCKSIZE, codebook=None, scale_format: str = DEFAULT_SCALE_FORMAT,
                   dtype: torch.dtype | None = None, rotation=None, seed: int = 0, **kwargs) -> KbitMoE:
        """Quantize float stacks ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` (``kbit.quantize``, one tensor
        scale per expert, on their device). ``dtype`` default: the weights' (bf16 for float32 on CUDA).
        ``rotation`` / ``seed`` (``kbit.quantize``): one rotation of H for the gate_up stack of all experts."""
        if dtype is None:
            w = w_gate_up
            dtype = w.dtype if (w.dtype in (torch.float16, torch.bfloat16) or not w.is_cuda) else torch.bfloat16
        q = {n: quantize(w.detach(), k=k, blocksize=blocksize, codebook=codebook, scale_format=scale_format,
                         rotation=rotation if n == "gate_up" else None, seed=seed)
             for n, w in (("gate_up", w_gate_up), ("down", w_down))}
        return cls.from_weights(q["gate_up"], q["down"], top_k, dtype=dtype, **kwargs)

    @classmethod
    def from_hf(cls, block: nn.Module, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE, codebook=None,
                scale_format: str = DEFAULT_SCALE_FORMAT, dtype: torch.dtype | None = None, rotation=None,
                seed: int = 0) -> KbitMoE:
        """Quantize a Hugging Face sparse MoE block: ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
        ``Qwen2MoeSparseMoeBlock``, ``Qwen3NextSparseMoeBlock``, ``DeepseekV3MoE``, ``Glm4MoeMoE`` (a ``gate``
        with the router weight, SwiGLU ``experts``; the router options from :func:`hf_routing`). The router
        weight is kept (``forward`` without logits computes them as the block does); a shared expert and its
        gate are kept as they are (not quantized; not copied). ValueError where the block's gate, on a few random
        tokens, chooses or weighs the experts otherwise (:func:`routing_mismatch`).
        ``rotation`` / ``seed``: as :meth:`from_float` (the gate_up stack only).
        """
        parts = hf_parts(block)
        w_gate_up, w_down, block_dtype = parts.pop("w_gate_up"), parts.pop("w_down"), parts.pop("dtype")
        why = routing_mismatch(block, parts)  # before the stacks are quantized (the experts differ by the rounding)
        if why is not None:
            fail(ValueError, "block", "a sparse MoE block whose routing KbitMoE reproduces",
                 f"{type(block).__name__}: {why}")
        return cls.from_float(w_gate_up, w_down, k=k, blocksize=blocksize, codebook=codebook,
                              scale_format=scale_format, dtype=dtype or block_dtype, rotation=rotation, seed=seed,
                              **parts)

    # -- forward ------------------------------------------------------------------------------------------
    def route(self, router_logits: torch.Tensor, plan: MoePlan | None = None) -> MoeRouting:
        """The step's expert choice as rows (:class:`~kbit.ops.moe_align.MoeRouting`), as ``forward`` makes it
        for ``plan`` (``kbit.dispatch.moe.route``)."""
        return route(router_logits, plan, top_k=self.top_k, E=self.num_experts, router=self.router,
                     renormalize=self.norm_topk_prob, correction_bias=self.correction_bias, n_group=self.n_group,
                     topk_group=self.topk_group, scaling=self.routed_scaling_factor, align_method=self.align_method)

    def plan_for(self, T: int, plan: MoePlan | None = None, dtype: torch.dtype | None = None,
                 device=None) -> MoePlan:
        """The kernels of a step of ``T`` tokens in ``dtype`` (default ``self.dtype``) on ``device`` (default
        the weights'): ``plan``, else ``self.plan``, else :func:`~kbit.dispatch.moe.choose_plan` (held in layout
        "mma-v1": the grouped tensor-core kernel wherever that picks the GEMV, and at a few tokens whose pairs
        seldom share an expert the pairs' dense GEMV; canonical with ``auto_repack`` off: without those kernels)."""
        if plan or self.plan:
            return plan or self.plan
        dtype, device = dtype or self.dtype, device or self.gate_up_codes.device
        return plan_for_layout(T, self.top_k, self.num_experts, self.hidden_size, self.intermediate_size, dtype,
                               device, repacked=self.layout != CANONICAL, auto_repack=self.auto_repack)

    def _maybe_repack(self, plan: MoePlan | None, x: torch.Tensor) -> bool:
        """Repack before a step whose plan runs the grouped tensor-core kernel (``auto_repack``, CUDA, not
        capturing a graph): that kernel reads layout "mma-v1", and would otherwise cache a repacked copy."""
        if (plan is None or self.layout != CANONICAL or not self.auto_repack or "gemm" not in (plan.gate_up, plan.down)
                or not gemm_supported(x.device, x.dtype) or capturing()):
            return False
        self.repack_for_kernels()
        return True

    # the MoE kernels are launched from Python, not through torch.library ops: under torch.compile the graph
    # breaks here (dynamo would trace into the launches; inductor failed to build a kernel it copied, torch 2.11)
    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor | None = None,
                plan: MoePlan | None = None) -> torch.Tensor:
        """``hidden [..., H]`` and ``router_logits [T, E]`` (T = tokens of hidden; None: computed from the
        stored ``router_weight``) -> ``[..., H]`` in hidden's dtype. ``plan`` pins the kernels. Under
        ``torch.compile`` it runs outside the graph (a graph break)."""
        H = self.hidden_size
        if hidden.shape[-1] != H:
            raise ValueError(f"hidden: expected last dimension H = {H}, got shape {tuple(hidden.shape)}")
        x = hidden.reshape(-1, H)
        if router_logits is None and self.router_weight is None:
            raise ValueError("router_logits: expected a [T, E] tensor (this block stores no router weight)")
        if router_logits is not None and tuple(router_logits.shape) != (x.shape[0], self.num_experts):
            raise ValueError(f"router_logits: expected shape {(x.shape[0], self.num_experts)}, "
                             f"got {tuple(router_logits.shape)}")
        if not x.is_cuda and not interpreting():  # no Triton here: the reference
            if router_logits is None:
                router_logits = F.linear(x, self.router_weight.to(x.dtype))
            return self._reference_forward(x, router_logits).reshape(hidden.shape)
        plan = self._step_plan(x, plan)
        ws = router_workspace(self, x.device) if router_logits is None else None
        if fused_router_applies(x, plan, ws, self.router, self.n_group):  # the router's product in the routing launch
            routing = self._route_hidden(x, ws, plan)
        else:
            routing = self.route(F.linear(x, self.router_weight.to(x.dtype)) if router_logits is None
                                 else router_logits, plan)
        return self._experts(x, routing, plan).reshape(hidden.shape)

    @torch.compiler.disable
    def forward_add_norm(self, hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         plan: MoePlan | None = None, *,
                         defer_combine: bool = False) -> tuple[torch.Tensor | Uncombined, torch.Tensor]:
        """The residual add and RMSNorm before the block, then the block: ``r = residual + hidden``,
        ``y = rms_norm(r) * weight`` (:func:`kbit.ops.glue.add_rms_norm`'s numbers); returns ``(forward(y), r)``,
        both ``[T, H]`` (hidden and residual ``[T, H]``). Where the fused router takes the step (its stored
        router weight, a decode step's tokens on CUDA), its launch makes the add and the norm as well: one launch
        fewer on the step's critical path. ``defer_combine``: there, and without a shared expert, the first
        output is the experts' outputs before their combine (``kbit.ops.moe.Uncombined``), for the caller's next
        launch to combine (``kbit.ops.moe.combine_add_rms_norm``): one launch fewer again."""
        H = self.hidden_size
        if hidden.dim() != 2 or hidden.shape[-1] != H:
            raise ValueError(f"hidden: expected shape [T, {H}], got {tuple(hidden.shape)}")
        check_norm(hidden, weight, eps, residual)
        if self.router_weight is not None and hidden.is_cuda:
            step_plan = self._step_plan(hidden, plan)
            ws = router_workspace(self, hidden.device)
            if fused_router_applies(hidden, step_plan, ws, self.router, self.n_group):
                routing, y, r = self._route_hidden(hidden, ws, step_plan, norm=(residual, weight, eps))
                return self._experts(y, routing, step_plan, defer_combine), r
        y, r = add_rms_norm(hidden, residual, weight, eps)
        return self.forward(y, plan=plan), r

    def _step_plan(self, x: torch.Tensor, pinned: MoePlan | None) -> MoePlan | None:
        """The plan of a step on ``x [T, H]`` (``pinned`` if given), after repacking the stacks where it asks."""
        plan = self.plan_for(x.shape[0], pinned, x.dtype, x.device) if x.shape[0] else None
        if self._maybe_repack(plan, x):
            plan = self.plan_for(x.shape[0], pinned, x.dtype, x.device)
        return plan

    def _route_hidden(self, x, ws, plan, norm=None):
        return route_hidden(x, self.router_weight, ws, plan, top_k=self.top_k, router=self.router,
                            renormalize=self.norm_topk_prob, correction_bias=self.correction_bias,
                            scaling=self.routed_scaling_factor, norm=norm)

    def _experts(self, x: torch.Tensor, routing: MoeRouting, plan: MoePlan | None,
                 defer_combine: bool = False) -> torch.Tensor | Uncombined:
        """The routed experts (and the shared expert) on ``x [T, H]``; ``defer_combine``: before their combine
        where that is the last step (no shared expert to add)."""
        xr = x if self.rotation is None else rotate(x, self.rotation)  # once for all experts (module docstring)
        defer = defer_combine and self.shared_expert is None
        out = moe_experts(xr, routing, *self.kernel_weights(), plan, defer_combine=defer)
        return out if defer else add_shared_expert(out, x, self.shared_expert, self.shared_expert_gate)

    def _reference_forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The forward on tensors Triton cannot run (CPU without the interpreter): the float64 reference on the
        dequantized stacks (routing by :func:`select_experts_reference`), in x's dtype."""
        w, ids = select_experts_reference(router_logits, self.top_k, router=self.router,
                                          renormalize=self.norm_topk_prob, correction_bias=self.correction_bias,
                                          n_group=self.n_group, topk_group=self.topk_group,
                                          scaling=self.routed_scaling_factor)
        gate_up = dequantize_reference(self.gate_up_weight(), torch.float64)
        if self.rotation is not None:  # the weight W itself: x is not rotated on this path
            gate_up = unrotate_weight(gate_up, self.rotation)
        out = moe_reference(x, w, ids, gate_up, dequantize_reference(self.down_weight())).to(x.dtype)
        out = add_shared_expert(out, x, self.shared_expert, self.shared_expert_gate)
        return out

    # -- state dict ---------------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        return apply_keeping_format(self, super()._apply, fn, recurse, model_dtype=("router_weight",))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout != CANONICAL:  # the file format is the canonical layout
            for name in _STACKS:
                destination[f"{prefix}{name}_codes"], destination[f"{prefix}{name}_scales"] = \
                    self._canonical_codes(name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.layout == CANONICAL:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        self.to_canonical()  # load into the canonical buffers (shape checks, in-place copies), then repack
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self.repack_for_kernels()

    def get_extra_state(self) -> dict:
        """The format parameters; ``rotation`` (of the gate_up stack) only where there is one."""
        out = {"format_version": 1, "k": self.k, "blocksize": self.blocksize, "scale_format": self.scale_format,
               "shape": [self.num_experts, self.hidden_size, self.intermediate_size], "top_k": self.top_k,
               "router": self.router, "codebook": self.codebook_name}
        if self.rotation is not None:
            out["rotation"] = self.rotation.metadata()
        return out

    def set_extra_state(self, state: dict) -> None:
        mine = self.get_extra_state()
        for key in ("format_version", "k", "blocksize", "scale_format", "shape", "top_k", "router", "rotation"):
            if state.get(key) != mine.get(key):
                raise ValueError(f"KbitMoE state: expected {key}={mine.get(key)!r}, got {state.get(key)!r} "
                                 "(build the module with the saved parameters)")
        self.codebook_name = state.get("codebook", self.codebook_name)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, top_k={self.top_k}, router={self.router!r}, "
                f"norm_topk_prob={self.norm_topk_prob}, k={self.k}, blocksize={self.blocksize}, "
                f"scale_format={self.scale_format!r}, codebook={self.codebook_name!r}, dtype={self.dtype}"
                + (f", rotation={self.rotation!r}" if self.rotation is not None else "")
                + (f", layout={self.layout!r}" if self.layout != CANONICAL else ""))


# ------------------------------------------------------------------------------------------------ Hugging Face


def add_shared_expert(out: torch.Tensor, x: torch.Tensor, shared_expert, shared_expert_gate) -> torch.Tensor:
    """``out`` plus the shared expert's output on ``x`` (times ``sigmoid(gate(x))`` where a gate is given), as
    Qwen2-MoE-style blocks add it; ``out`` as it is without a shared expert."""
    if shared_expert is None:
        return out
    s = shared_expert(x)
    if shared_expert_gate is not None:
        s = torch.sigmoid(shared_expert_gate(x)) * s
    return out + s


def is_silu(act) -> bool:
    """Whether an experts' activation is SiLU (None: the default of the modules that name none)."""
    return act is None or isinstance(act, nn.SiLU) or getattr(act, "__name__", "") == "silu" or \
        act is F.silu or type(act).__name__ in ("SiLU", "SiLUActivation")


def _expert_stacks(experts: nn.Module, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up ``[E, 2I, H]``, down ``[E, H, I]``) of fused 3-D parameters or a list of expert MLPs."""
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and \
            isinstance(experts.gate_up_proj, torch.Tensor):
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise ValueError("experts: biased experts are not supported")
        gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
        if getattr(experts, "is_transposed", False) or (gu.shape[-1] != H and gu.shape[1] == H):
            gu = gu.transpose(1, 2)  # stored [E, H, 2I]
        if dn.shape[1] != H and dn.shape[-1] == H:
            dn = dn.transpose(1, 2)  # stored [E, I, H]
        if getattr(experts, "is_concatenated", True) is False:  # interleaved [g0, u0, g1, u1, ...]
            gu = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
        check_activation(getattr(experts, "act_fn", None))
        return gu.contiguous(), dn.contiguous()
    if isinstance(experts, (nn.ModuleList, list, tuple)):
        names = None
        for cand in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):  # Qwen, Mixtral
            if all(hasattr(experts[0], n) for n in cand):
                names = cand
        if names is None:
            raise ValueError(f"experts: expected modules with gate_proj/up_proj/down_proj or w1/w3/w2, got "
                             f"{type(experts[0]).__name__}")
        for e in experts:
            check_activation(getattr(e, "act_fn", None))
            if any(getattr(e, n).bias is not None for n in names):
                raise ValueError("experts: biased experts are not supported")
        gu = torch.stack([torch.cat([getattr(e, names[0]).weight, getattr(e, names[1]).weight]) for e in experts])
        dn = torch.stack([getattr(e, names[2]).weight for e in experts])
        return gu.detach(), dn.detach()
    raise ValueError(f"experts: expected fused gate_up_proj/down_proj parameters or a ModuleList, got "
                     f"{type(experts).__name__}")


def check_activation(act) -> None:
    """ValueError unless ``act`` is SiLU: the grouped kernels and the reference compute SwiGLU experts only."""
    if not is_silu(act):
        raise ValueError(f"experts: expected SiLU (SwiGLU) experts, got activation {act!r}")


def hf_routing(block: nn.Module) -> dict:
    """The router and shared-expert options of a Hugging Face sparse MoE block, as :class:`KbitMoE` takes them:
    ``top_k``, ``router``, ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``, ``topk_group``,
    ``router_weight``, ``correction_bias``, ``shared_expert``, ``shared_expert_gate``. A gate with an
    ``e_score_correction_bias`` is a DeepSeek-V3-style sigmoid router (groups, scaling; GLM-4.5, DeepSeek-V3);
    else softmax, renormalised or not as ``norm_topk_prob`` says (Mixtral: always), or where the block names no
    such flag, as its gate's own output shows (:func:`routing_mismatch`). ValueError where the block has no
    ``gate`` with a router weight or an option cannot be found."""
    gate = getattr(block, "gate", None)
    if gate is None or getattr(block, "experts", None) is None or \
            not isinstance(getattr(gate, "weight", None), torch.Tensor):
        raise ValueError(f"block: expected a sparse MoE block with .gate (router weight [E, H]) and .experts, got "
                         f"{type(block).__name__}")

    def opt(*names, default=None):
        for o in (block, gate):
            for n in names:
                v = getattr(o, n, None)
                if v is not None and not isinstance(v, nn.Module):
                    return v
        return default

    top_k = opt("top_k", "num_experts_per_tok")
    if top_k is None:
        raise ValueError(f"block: cannot find top_k on {type(block).__name__} or its gate")
    bias = getattr(gate, "e_score_correction_bias", None)
    # tensors of the gate kbit's router would not read (ERNIE's expert statistics, a router bias): refused, since
    # a few random tokens need not show what they change
    extra = [n for n, _ in list(gate.named_parameters()) + list(gate.named_buffers())
             if n not in ("weight", "e_score_correction_bias")]
    if extra:
        raise ValueError(f"block: the gate of {type(block).__name__} holds {extra}, which kbit's router does not "
                         "read")
    out = {"top_k": int(top_k), "router_weight": gate.weight.detach(),
           "shared_expert": getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None),
           "shared_expert_gate": getattr(block, "shared_expert_gate", None)}
    if isinstance(bias, torch.Tensor):
        out.update(router="sigmoid", correction_bias=bias.detach(), n_group=int(opt("n_group", "num_group", default=1)),
                   topk_group=int(opt("topk_group", default=1)),
                   routed_scaling_factor=float(opt("routed_scaling_factor", default=1.0)),
                   norm_topk_prob=bool(opt("norm_topk_prob", default=True)))
        return out
    norm = True if "mixtral" in type(block).__name__.lower() else opt("norm_topk_prob")  # Mixtral always does
    if norm is not None:
        out.update(router="softmax", norm_topk_prob=bool(norm))
        return out
    # no flag (MiniMax, ...): the choice whose weights are the gate's own, where the gate returns them
    for norm in (True, False):
        if routing_mismatch(block, out | {"router": "softmax", "norm_topk_prob": norm}) is None:
            return out | {"router": "softmax", "norm_topk_prob": norm}
    raise ValueError(f"block: cannot find norm_topk_prob on {type(block).__name__} or its gate, and neither "
                     "choice gives its gate's routing")


#: tokens of :func:`hf_block_mismatch`'s check; its tolerance on a token's ||new - block|| / ||block||: the same k-bit
#: weights on two kernel paths differ by bf16 rounding, a missing shared expert or a wrong routing weight by more
CHECK_TOKENS, CHECK_RTOL = 8, 0.05


def _check_tokens(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:data:`CHECK_TOKENS` seeded random hidden states ``[1, T, H]`` for a router weight ``weight`` ``[E, H]``
    (on its device, in ``dtype`` or the weight's)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(1, CHECK_TOKENS, weight.shape[1], generator=g).to(device=weight.device,
                                                                         dtype=dtype or weight.dtype)


@torch.no_grad()
def routing_mismatch(block: nn.Module, routing: dict, gate_out=None) -> str | None:
    """Why the router options ``routing`` (:func:`hf_routing`'s keys) do not choose and weigh the experts as the
    block's gate does (``gate_out``: its output on some tokens; default: on :func:`_check_tokens`), else None;
    None also where the gate does not return its choice (transformers 5 routers return ``(logits, weights,
    indices)``)."""
    out = block.gate(_check_tokens(routing["router_weight"]).flatten(0, 1)) if gate_out is None else gate_out
    if not (isinstance(out, tuple) and len(out) == 3):
        return None
    logits, want_w, want_ids = out
    got_w, got_ids = select_experts_reference(
        logits.float(), routing["top_k"], router=routing["router"], renormalize=routing["norm_topk_prob"],
        correction_bias=routing.get("correction_bias"), n_group=routing.get("n_group", 1),
        topk_group=routing.get("topk_group", 1), scaling=routing.get("routed_scaling_factor", 1.0))
    want_w, want_ids = want_w.to(got_w.device), want_ids.to(got_ids.device)  # the reference runs on the CPU
    a, b = want_ids.sort(-1), got_ids.sort(-1)
    if not torch.equal(a.values.long(), b.values.long()):
        return "the gate routes tokens to other experts"
    if not torch.allclose(want_w.float().gather(-1, a.indices), got_w.float().gather(-1, b.indices), rtol=1e-2,
                          atol=1e-3):
        return "the gate weighs the experts otherwise"
    return None


@torch.no_grad()
def hf_block_mismatch(block: nn.Module, new: KbitMoE) -> str | None:
    """Why ``new`` does not stand in for ``block`` (None: it does): on :data:`CHECK_TOKENS` seeded random tokens,
    the experts each token is routed to and their weights (:func:`routing_mismatch`), then the outputs given the
    block's router logits."""
    w = new.router_weight if new.router_weight is not None else block.gate.weight
    x = _check_tokens(w, new.dtype)
    out = block.gate(x.reshape(-1, new.hidden_size))
    routing = {"router_weight": w, "top_k": new.top_k, "router": new.router, "norm_topk_prob": new.norm_topk_prob,
               "correction_bias": new.correction_bias, "n_group": new.n_group, "topk_group": new.topk_group,
               "routed_scaling_factor": new.routed_scaling_factor}
    why = routing_mismatch(block, routing, out)
    if why is not None:
        return why
    logits = out[0] if isinstance(out, tuple) else out
    ref = block(x)
    ref = (ref[0] if isinstance(ref, tuple) else ref).float()
    got = new(x, logits.to(new.dtype).reshape(-1, new.num_experts)).float()
    # per token, the median: a near-tie that one path breaks the other way (bf16 logits) moves one token, a
    # missing option all of them
    err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).median().item()
    return None if err <= CHECK_RTOL else f"its output differs by {err:.3g} of its norm (median of the tokens)"


def hf_parts(block: nn.Module) -> dict:
    """What :meth:`KbitMoE.from_hf` needs from a Hugging Face block: float stacks, :func:`hf_routing`'s options,
    dtype."""
    parts = hf_routing(block)
    E, H = parts["router_weight"].shape
    gu, dn = _expert_stacks(block.experts, H)
    if gu.shape[0] != E or gu.shape[2] != H or dn.shape[:2] != (E, H):
        raise ValueError(f"experts: expected stacks [E={E}, 2I, H={H}] and [E, H, I], got {tuple(gu.shape)} and "
                         f"{tuple(dn.shape)}")
    return {"w_gate_up": gu, "w_down": dn, **parts, "dtype": parts["router_weight"].dtype}
