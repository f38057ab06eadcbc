"""Expert parallel ``KbitMoE``: the experts split over the ranks in contiguous ranges, the router replicated.

A step on every rank: route all ``T`` tokens with the whole router (the same choice and weights as the unsharded
layer), run this rank's experts on the pairs routed to them with the ordinary grouped MoE op on the local stacks
(``kbit.dispatch.moe.moe_experts``), the pairs routed to other ranks' experts weighted 0 in the combine, then one
all-reduce (:func:`kbit.parallel.all_reduce_sum`) of the ``[T, H]`` output sums the ranks' parts.

Why an all-reduce and not all-to-all dispatch: every rank already holds every token (the attention before the
block is replicated or tensor parallel), and at decode sizes the ``[T, H]`` all-reduce is a few KB, one collective
of a fixed size, graph-safe and sync-free; all-to-all would need the per-rank token counts on the host (a sync) or
padded buffers of ``T * top_k`` rows. For prefill-sized ``T`` an all-to-all dispatch moves less: future work.

The pair lists keep their fixed size ``P = T * top_k`` (a CUDA graph needs fixed shapes): a pair whose expert is
another rank's is redirected to the local expert of the slot before it (:func:`localize_pairs`; its output is
computed and weighted 0), so a token's pairs form runs of equal experts, which the grouped kernels' block tables
read once; a token with no local expert goes to local expert 0. The fused router writes the pairs so in its own
launch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
from kbit.format.reference import dequantize_reference
from kbit.format.spec import KbitWeight
from kbit.nn.moe import KbitMoE, add_shared_expert
from kbit.ops.hadamard import rotate
from kbit.ops.moe import moe_reference
from kbit.ops.moe_align import MoeRouting
from kbit.ops.moe_router import localize_pairs, select_experts
from kbit.ops.quantize import unrotate_weight
from kbit.parallel.comm import AllReduceConfig, all_reduce_sum
from kbit.parallel.shard import shard_range
from kbit.utils.checks import check_int, fail
from kbit.utils.device import interpreting

__all__ = ["ExpertParallelKbitMoE", "expert_range", "localize_pairs", "shard_experts"]


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of the experts rank ``rank`` holds: contiguous, as even as possible, the first ranks one
    more where ``world`` does not divide ``num_experts`` (E = 7, 2 ranks: 0:4 and 4:7)."""
    return shard_range(num_experts, rank, world, 1)


def shard_experts(qw: KbitWeight, start: int, stop: int) -> KbitWeight:
    """Experts ``start:stop`` of a stack ``[E, N, K]`` as a stack of their own (copies: the whole can be freed)."""
    if not isinstance(qw, KbitWeight) or len(qw.shape) != 3:
        fail(TypeError, "qw", "a stacked KbitWeight [E, N, K]", getattr(qw, "shape", type(qw).__name__))
    check_int("start", start, minimum=0, maximum=qw.shape[0] - 1)
    check_int("stop", stop, minimum=start + 1, maximum=qw.shape[0])
    return KbitWeight(qw.codes[start:stop].clone(), qw.scales[start:stop].clone(),
                      qw.tensor_scale[start:stop].clone(), qw.codebook, (stop - start, *qw.shape[1:]), qw.k,
                      qw.blocksize, qw.scale_format, qw.codebook_name, qw.rotation)


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first "
                           "(or run under torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


class ExpertParallelKbitMoE(nn.Module):
    """A ``KbitMoE`` block whose experts are split over the ranks of ``group`` (module docstring).

    Parameters
    ----------
    local : a ``KbitMoE`` holding this rank's experts ``start:stop`` (:func:`expert_range`) and no router weight
        (its ``top_k`` is at most its expert count; the block's own is ``top_k``).
    num_experts : E of the whole block.
    top_k : experts per token.
    group : the ``torch.distributed`` process group (None: the default group).
    router, norm_topk_prob, routed_scaling_factor, n_group, topk_group : the router (as ``KbitMoE``).
    router_weight : ``[E, H]`` (replicated; used when ``forward`` gets no logits) or None.
    correction_bias : ``[E]`` (sigmoid router) or None.
    shared_expert, shared_expert_gate : as ``KbitMoE``; replicated, applied after the all-reduce (once).

    ``comm``: None (the all-reduce chosen by message size, :data:`kbit.parallel.ALLREDUCE_TABLE`) or an
    :class:`~kbit.parallel.AllReduceConfig` that pins it. Run one eager forward before capturing a CUDA graph.
    """

    #: see the class docstring
    comm: AllReduceConfig | None = None

    def __init__(self, local: KbitMoE, num_experts: int, top_k: int, *, group=None, router: str = "softmax",
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1, router_weight: torch.Tensor | None = None,
                 correction_bias: torch.Tensor | None = None, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None):
        super().__init__()
        if not isinstance(local, KbitMoE):
            fail(TypeError, "local", "a KbitMoE", type(local).__name__)
        if local.router_weight is not None or local.shared_expert is not None:
            fail(ValueError, "local", "a KbitMoE without router weight or shared expert (the block holds them)",
                 "one with")
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.num_experts = check_int("num_experts", num_experts, minimum=self.world)
        self.top_k = check_int("top_k", top_k, minimum=1, maximum=self.num_experts)
        self.start, self.stop = expert_range(self.num_experts, self.rank, self.world)
        if local.num_experts != self.stop - self.start:
            fail(ValueError, "local", f"{self.stop - self.start} experts ({self.start}:{self.stop} of "
                 f"{self.num_experts} on rank {self.rank} of {self.world})", local.num_experts)
        self.local = local
        self.hidden_size, self.intermediate_size = local.hidden_size, local.intermediate_size
        self.router, self.norm_topk_prob = router, bool(norm_topk_prob)
        self.routed_scaling_factor, self.n_group, self.topk_group = float(routed_scaling_factor), n_group, topk_group
        dev = local.gate_up_codes.device
        if router_weight is not None and tuple(router_weight.shape) != (self.num_experts, self.hidden_size):
            fail(ValueError, "router_weight", f"shape {(self.num_experts, self.hidden_size)}",
                 tuple(router_weight.shape))
        self.register_buffer("router_weight", None if router_weight is None else
                             router_weight.detach().to(device=dev, dtype=local.dtype).clone())
        self.register_buffer("correction_bias", None if correction_bias is None else
                             correction_bias.detach().to(device=dev, dtype=torch.float32).clone())
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    @classmethod
    def from_moe(cls, moe: KbitMoE, *, group=None) -> ExpertParallelKbitMoE:
        """This rank's part of ``moe``: copies of its experts' codes and scales (``moe`` can be freed), the router
        and the shared expert as they are."""
        if not isinstance(moe, KbitMoE):
            fail(TypeError, "moe", "a KbitMoE", type(moe).__name__)
        rank, world = _rank_world(group)
        a, b = expert_range(moe.num_experts, rank, world)
        local = KbitMoE.from_weights(shard_experts(moe.gate_up_weight(), a, b), shard_experts(moe.down_weight(), a, b),
                                     min(moe.top_k, b - a), dtype=moe.dtype)
        local.plan, local.align_method, local.auto_repack = moe.plan, moe.align_method, moe.auto_repack
        return cls(local, moe.num_experts, moe.top_k, group=group, router=moe.router,
                   norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.routed_scaling_factor,
                   n_group=moe.n_group, topk_group=moe.topk_group, router_weight=moe.router_weight,
                   correction_bias=moe.correction_bias, shared_expert=moe.shared_expert,
                   shared_expert_gate=moe.shared_expert_gate)

    # -- routing ----------------------------------------------------------------------------------------------
    def localize(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`localize_pairs` for this rank's experts ``start:stop``."""
        return localize_pairs(weights, ids, self.start, self.stop)

    def _router_kw(self) -> dict:
        return dict(router=self.router, renormalize=self.norm_topk_prob, correction_bias=self.correction_bias,
                    scaling=self.routed_scaling_factor)

    def route(self, router_logits: torch.Tensor, plan: MoePlan | None = None) -> MoeRouting:
        """This rank's rows for the step: ``kbit.dispatch.moe.route`` on the whole router, written as the pairs
        of experts ``start:stop`` (:func:`localize_pairs`)."""
        return route(router_logits, plan, top_k=self.top_k, E=self.stop - self.start, n_group=self.n_group,
                     topk_group=self.topk_group, align_method=self.local.align_method,
                     experts=(self.start, self.stop), **self._router_kw())

    def plan_for(self, T: int, plan: MoePlan | None = None, dtype: torch.dtype | None = None,
                 device=None) -> MoePlan:
        """The kernels of a step of ``T`` tokens: every one of the ``T * top_k`` pairs runs on the local stacks."""
        local = self.local
        if plan or local.plan:
            return plan or local.plan
        return plan_for_layout(T, self.top_k, self.stop - self.start, self.hidden_size, self.intermediate_size,
                               dtype or local.dtype, device or local.gate_up_codes.device,
                               repacked=local.layout != "canonical", auto_repack=local.auto_repack)

    # -- forward ----------------------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_weight is None:
            raise ValueError("router_logits: expected a [T, E] tensor (this block stores no router weight)")
        return F.linear(x, self.router_weight.to(x.dtype))

    def partial(self, hidden: torch.Tensor, router_logits: torch.Tensor | None = None,
                plan: MoePlan | None = None) -> torch.Tensor:
        """This rank's experts' share of the routed output ``[T, H]`` (hidden's dtype): no all-reduce, no
        shared expert. ``hidden [T, H]``; ``router_logits [T, E]`` or None (from ``router_weight``)."""
        x = hidden
        if router_logits is None and self.router_weight is None:
            raise ValueError("router_logits: expected a [T, E] tensor (this block stores no router weight)")
        if router_logits is not None and tuple(router_logits.shape) != (x.shape[0], self.num_experts):
            fail(ValueError, "router_logits", f"shape {(x.shape[0], self.num_experts)}", tuple(router_logits.shape))
        if x.shape[0] == 0:
            return x.new_zeros(0, self.hidden_size)
        if not x.is_cuda and not interpreting():  # no Triton here: the reference
            return self._reference_partial(x, self.logits(x) if router_logits is None else router_logits)
        pinned, local = plan, self.local
        plan = self.plan_for(x.shape[0], pinned, x.dtype, x.device)
        if (local.layout == "canonical" and local.auto_repack and "gemm" in (plan.gate_up, plan.down)
                and gemm_supported(x.device, x.dtype) and not torch.cuda.is_current_stream_capturing()):
            local.repack_for_kernels()  # the grouped tensor-core kernel reads layout "mma-v1" (as KbitMoE does)
            plan = self.plan_for(x.shape[0], pinned, x.dtype, x.device)
        ws = router_workspace(self, x.device) if router_logits is None else None
        if fused_router_applies(x, plan, ws, self.router, self.n_group):  # the router's product in the routing launch
            routing = route_hidden(x, self.router_weight, ws, plan, top_k=self.top_k, experts=(self.start, self.stop),
                                   **self._router_kw())
        else:
            routing = self.route(self.logits(x) if router_logits is None else router_logits, plan)
        xr = x if local.rotation is None else rotate(x, local.rotation)
        return moe_experts(xr, routing, *local.kernel_weights(), plan)

    def _reference_partial(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """:meth:`partial` in float64 on the dequantized local stacks (CPU without the Triton interpreter)."""
        w, ids = select_experts(router_logits, self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                                **self._router_kw())
        w, ids = self.localize(w, ids)
        gate_up = dequantize_reference(self.local.gate_up_weight(), torch.float64)
        if self.local.rotation is not None:
            gate_up = unrotate_weight(gate_up, self.local.rotation)
        return moe_reference(x, w, ids, gate_up, dequantize_reference(self.local.down_weight())).to(x.dtype)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor | None = None,
                plan: MoePlan | None = None) -> torch.Tensor:
        """``hidden [..., H]``, ``router_logits [T, E]`` (None: from ``router_weight``) -> ``[..., H]``, the same
        on every rank: :meth:`partial` summed over the group, plus the shared expert."""
        H = self.hidden_size
        if hidden.shape[-1] != H:
            fail(ValueError, "hidden", f"last dimension H = {H}", tuple(hidden.shape))
        x = hidden.reshape(-1, H)
        out = self.partial(x, router_logits, plan)
        if self.world > 1 and out.shape[0]:
            out = all_reduce_sum(out.contiguous(), self.group, self.comm)
        out = add_shared_expert(out, x, self.shared_expert, self.shared_expert_gate)
        return out.reshape(hidden.shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, experts={self.start}:{self.stop}, top_k={self.top_k}, "
                f"rank={self.rank}/{self.world}, router={self.router!r}")
