"""The experts of an MoE layer on k-bit weight stacks: which kernels run a step, and the step composed of them.

Grouped gate_up, fused SwiGLU, grouped down, weighted combine back to token order; sync-free and
graph-capturable for a fixed number of tokens. Steps (``P = T * top_k`` pairs as rows of a
``kbit.ops.moe_align.MoeRouting``: sorted by expert, or in router order for a GEMV-only decode step):

1. ``gu[P, 2I] = x[token of row] @ W_gate_up[expert of row].T`` (:func:`expert_matmul`);
2. ``a[P, I] = silu(gu[:, :I]) * gu[:, I:]`` (``kbit.ops.moe.silu_mul_gate_up``; where the grouped wgmma
   kernel 7 serves step 3, computed while it gathers its x tiles instead);
3. ``y[P, H] = a @ W_down[expert of row].T`` (:func:`expert_matmul`);
4. ``out[t] = sum_s w[t, s] * y[row of (t, s)]`` (``kbit.ops.moe.combine``).

Kernels for steps 1 and 3 (:class:`MoePlan`, from :func:`choose_plan`):

- ``"gemv"``: ``kbit.ops.gemv.grouped_gemv``, one launch over all pairs, each pair reading its expert's
  packed codes (any row order; when sorted, rows of one expert are adjacent, so repeated reads mostly hit
  L2). For few rows per expert.
- ``"grouped_mm"``: the touched experts dequantized to the activation dtype (``kbit.ops.dequant``; with
  ``S = min(E, P)`` slots, a fixed size, so no sync), then ``torch._grouped_mm`` on the sorted rows. For
  many rows per expert, where the dequantization is paid once per expert instead of once per row.
- ``"gemm"``: the grouped tensor-core kernels (``kbit.ops.grouped_mma``, CUDA through NVRTC): rows sorted by
  expert, cut into blocks of 8-256 rows of one expert (a block table built on the device), each block's expert
  weight read and decoded once for all its rows. CUDA with fp16/bf16 only (elsewhere :func:`grouped_gemm` runs
  the GEMV, so :func:`choose_plan` does not pick it).
- ``"pairs"``: a few tokens on a stack in layout "mma-v1", at most 64 pairs and few of them on one expert
  (``kbit.tuning.moe.PAIRS_MAX_REREAD``): the pairs as one dense GEMV over the touched experts' stacked tiles
  (``kbit.ops.gemv_mma.pairs_linear``: the dense M = 1 kernel 3, split K across CTAs), 1.09-1.60x faster than the
  grouped kernels on six MoE shapes at one token; where that launch does not apply, the grouped kernels
  (``"gemm"``) run instead. :func:`plan_for_layout` picks it.

Thresholds: ``kbit.tuning.moe``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from kbit.format.spec import KbitWeight
from kbit.ops._ids import guard, poison, poison_tokens
from kbit.ops.dequant import dequantize_tensors
from kbit.ops.gemv import grouped_gemv
from kbit.ops.gemv_mma import PAIRS_MAX, pairs_linear
from kbit.ops.grouped_mma import (
    choose_ng,
    fused_silu_ok,
    grouped_linear,
    grouped_linear_repacked,
    large_rows,
    run_blocks,
)
from kbit.ops.mma.common import kernels_available
from kbit.ops.mma.layout import unrepack_stack
from kbit.ops.moe import Uncombined, combine, silu_mul_gate_up
from kbit.ops.moe_align import MoeRouting, align, pair_order, sort_pairs
from kbit.ops.moe_blocks import block_table, tail_split
from kbit.ops.moe_router import fusable, localize_pairs, route_pairs, route_pairs_hidden, select_experts
from kbit.tuning.moe import (
    FUSED_ROUTER_MAX_T,
    GEMM_MAX_ROWS_PER_EXPERT,
    GEMV_MAX_ROWS_PER_EXPERT,
    GEMV_T1_MAX_WEIGHTS,
    PAIR_ORDER_MAX_T,
    PAIRS_MAX_REREAD,
    SORT_PAIRS_MAX_T,
    TAIL_ROWS,
    TAIL_SPLIT_BT,
    TAIL_SPLIT_MIN_E,
    pairs_rereads,
    rows_per_expert,
)
from kbit.utils.checks import fail

__all__ = ["MOE_KERNELS", "MoePlan", "choose_plan", "expert_matmul", "fused_router_applies", "gemm_supported",
           "grouped_gemm", "grouped_gemm_repacked", "grouped_mm_supported", "moe_experts", "plan_for_layout", "route",
           "route_hidden", "routed_experts", "router_workspace"]

MOE_KERNELS = ("gemv", "grouped_mm", "gemm", "pairs")
#: the layout of a stack the grouped tensor-core kernels read as it is (``kbit.ops.gemv_mma.RepackedWeight``)
_MMA_LAYOUT = "mma-v1"


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class MoePlan:
    """Kernel of each grouped step: one of :data:`MOE_KERNELS` for ``gate_up`` and ``down``."""

    gate_up: str
    down: str

    def __post_init__(self):
        for name in ("gate_up", "down"):
            if getattr(self, name) not in MOE_KERNELS:
                raise ValueError(f"MoePlan.{name}: expected one of {MOE_KERNELS}, got {getattr(self, name)!r}")

    @property
    def needs_groups(self) -> bool:
        """Whether a step needs the group tables of :func:`kbit.ops.moe_align.align` (``torch._grouped_mm``
        does); the GEMV and the fused GEMM take any row lists."""
        return "grouped_mm" in (self.gate_up, self.down)


@functools.cache
def _grouped_mm_probe(device: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        dev = torch.device(device)
        a = torch.zeros(16, 16, dtype=dtype, device=dev)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=dev)
        offs = torch.full((2,), 16, dtype=torch.int32, device=dev)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def _capability(device: str) -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.device(device))


def grouped_mm_supported(device, dtype: torch.dtype, N: int, K: int) -> bool:
    """Whether ``torch._grouped_mm`` runs sync-free on ``device`` in ``dtype`` for ``[N, K]`` weights.

    On CUDA only its CUTLASS path qualifies: bfloat16 on sm90/sm100 with 16-byte aligned rows (its fallback
    for other dtypes and GPUs copies ``offs`` to the host, a sync that also breaks graph capture). Elsewhere
    (the CPU, for tests) probed once per device and dtype: run one eager forward before capturing a graph.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if dtype != torch.bfloat16 or _capability(str(device))[0] not in (9, 10) or N % 8 or K % 8:
            return False
    return _grouped_mm_probe(str(device), dtype)


def gemm_supported(device, dtype: torch.dtype) -> bool:
    """Whether the grouped tensor-core kernels (``kbit.ops.grouped_mma``) run on ``device`` in ``dtype``."""
    if dtype not in (torch.float16, torch.bfloat16) or torch.device(device).type != "cuda":
        return False
    return kernels_available(device)


def choose_plan(T: int, top_k: int, E: int, H: int, I: int, dtype: torch.dtype, device,
                gemm: bool | None = None) -> MoePlan:
    """The kernels for a step of ``T`` tokens (module docstring); a function of shapes only.

    On CUDA (fp16/bf16, NVRTC): the GEMV at T = 1 on experts of at most ``GEMV_T1_MAX_WEIGHTS`` weights,
    else the grouped tensor-core GEMM up to ``GEMM_MAX_ROWS_PER_EXPERT`` rows per touched expert
    (``T * top_k / min(E, T * top_k)``) or where kernel 7 serves the step, dequantize + ``torch._grouped_mm``
    above where it runs. Elsewhere: GEMV (fp16/bf16 only) while there are at most ``GEMV_MAX_ROWS_PER_EXPERT``
    rows per touched expert, dequantize + ``torch._grouped_mm`` above, or whichever exists.
    ``gemm=False``: plan as if the grouped tensor-core kernel were not there (it reads layout "mma-v1"; a
    ``kbit.nn.KbitMoE`` that keeps the canonical layout plans without it).
    """
    P = T * top_k
    rpe = rows_per_expert(P, E)
    gemv_ok = dtype in (torch.float16, torch.bfloat16)
    gemm_ok = gemm is not False and gemm_supported(device, dtype)
    plan = []
    for N, K in ((2 * I, H), (H, I)):
        mm_ok = grouped_mm_supported(device, dtype, N, K)
        if gemm_ok and gemv_ok and T == 1 and N * K <= GEMV_T1_MAX_WEIGHTS:
            plan.append("gemv")
        elif gemm_ok and (rpe <= GEMM_MAX_ROWS_PER_EXPERT or not mm_ok or large_rows(P, E, device)):
            plan.append("gemm")
        elif gemv_ok and (rpe <= GEMV_MAX_ROWS_PER_EXPERT or not mm_ok):
            plan.append("gemv")
        elif mm_ok:
            plan.append("grouped_mm")
        else:
            raise ValueError(f"dtype: expected float16/bfloat16 (the k-bit GEMV), or a dtype torch._grouped_mm "
                             f"supports on {device} for [{N}, {K}] weights, got {dtype}")
    return MoePlan(*plan)


def plan_for_layout(T: int, top_k: int, E: int, H: int, I: int, dtype: torch.dtype, device, *, repacked: bool,
                    auto_repack: bool) -> MoePlan:
    """:func:`choose_plan` for stacks held in layout "mma-v1" (``repacked``: the grouped tensor-core GEMM
    wherever that picks the GEMV, which would unrepack the stack each call) or canonical (with
    ``auto_repack`` off: planned without the grouped tensor-core kernel, which reads layout "mma-v1")."""
    p = choose_plan(T, top_k, E, H, I, dtype, device, gemm=None if (repacked or auto_repack) else False)
    if repacked and "gemv" in (p.gate_up, p.down) and gemm_supported(device, dtype):
        p = MoePlan(*("gemm" if kn == "gemv" else kn for kn in (p.gate_up, p.down)))
    if (repacked and T * top_k <= PAIRS_MAX and pairs_rereads(T, top_k, E) <= PAIRS_MAX_REREAD
            and gemm_supported(device, dtype)):
        # a few tokens on many experts: the pairs as one dense GEMV (it falls back to the grouped kernels where it
        # does not apply)
        p = MoePlan(*("pairs" if kn == "gemm" and N % 16 == 0 else kn
                      for kn, N in ((p.gate_up, 2 * I), (p.down, H))))
    return p


# ------------------------------------------------------------------------------------------------ routing


def route(router_logits: torch.Tensor, plan: MoePlan | None, *, top_k: int, E: int, router: str = "softmax",
          renormalize: bool = True, correction_bias: torch.Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, scaling: float = 1.0, align_method: str = "sort",
          experts: tuple[int, int] | None = None) -> MoeRouting:
    """The step's expert choice as rows for ``plan``. None (or a plan with ``grouped_mm``, or a router that
    ``kbit.ops.moe_router.route_pairs`` does not cover, or more than ``SORT_PAIRS_MAX_T`` tokens): torch ops,
    sorted by expert with the group tables (any kernel). Else one fused launch, rows in router order up to
    ``PAIR_ORDER_MAX_T`` tokens (a plan with the grouped GEMM: only at T = 1, its blocks need each expert's
    rows adjacent), else sorted in one more launch. ``experts``: ``(start, stop)``, the choice over the whole
    router written as the pairs of experts ``start:stop`` (expert parallel, ``kbit.ops.moe_router.localize_pairs``;
    ``E`` is then ``stop - start``)."""
    T = router_logits.shape[0]
    if plan is None or plan.needs_groups or not fusable(router, n_group) or T > SORT_PAIRS_MAX_T:
        w, ids = select_experts(router_logits, top_k, router=router, renormalize=renormalize,
                                correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                                scaling=scaling)
        if experts is not None:
            w, ids = localize_pairs(w, ids, *experts)
        return align(ids, E, w, method=align_method, checked=True)  # topk indices: in range
    blocks = _router_blocks(T, top_k, plan, router_logits.device)
    w, ids, tok, rows = route_pairs(router_logits, top_k, router=router, renormalize=renormalize,
                                    correction_bias=correction_bias, scaling=scaling, experts=experts,
                                    blocks=blocks)
    return _pairs_routing(w, ids, tok, rows, T, E, plan, blocks)


def _pairs_routing(w, ids, tok, rows, T: int, E: int, plan: MoePlan, blocks=None) -> MoeRouting:
    """The fused router's pairs of ``T`` tokens as the rows ``plan`` reads: in router order up to
    ``PAIR_ORDER_MAX_T`` tokens (with the grouped GEMM only at T = 1), else sorted by expert in one more launch."""
    if T == 1 or (T <= PAIR_ORDER_MAX_T and "gemm" not in (plan.gate_up, plan.down)):
        # the router kernel's ids are in range
        return pair_order(w, ids, tok, rows, E, checked=True, blocks=blocks)
    return sort_pairs(w, ids, rows, E, checked=True)


def router_workspace(owner, device) -> torch.Tensor | None:
    """``owner``'s (a MoE module's) zeroed arrival counters for :func:`route_hidden` on ``device``: made on the
    first call outside CUDA-graph capture and kept (each launch leaves them zero); None while capturing without
    them, and off CUDA (the step then takes the unfused router)."""
    if torch.device(device).type != "cuda":
        return None
    ws = getattr(owner, "_router_ws", None)
    if ws is None or ws.device != device:
        if torch.cuda.is_current_stream_capturing():
            return None
        ws = torch.zeros(FUSED_ROUTER_MAX_T, dtype=torch.int32, device=device)
        owner._router_ws = ws
    return ws


def fused_router_applies(hidden: torch.Tensor, plan: MoePlan | None, counters: torch.Tensor | None,
                         router: str = "softmax", n_group: int = 1) -> bool:
    """Whether :func:`route_hidden` takes this step: a CUDA step of 1..``FUSED_ROUTER_MAX_T`` tokens in 16-bit
    activations on the fused router's path (``plan`` without group tables, a router ``route_pairs`` covers) with
    a counters workspace of at least T (:func:`router_workspace`)."""
    T = hidden.shape[0]
    return (counters is not None and plan is not None and not plan.needs_groups and fusable(router, n_group)
            and 1 <= T <= min(FUSED_ROUTER_MAX_T, counters.shape[0]) and hidden.is_cuda
            and hidden.dtype in (torch.float16, torch.bfloat16))


def route_hidden(hidden: torch.Tensor, router_weight: torch.Tensor, counters: torch.Tensor, plan: MoePlan, *,
                 top_k: int, router: str = "softmax", renormalize: bool = True,
                 correction_bias: torch.Tensor | None = None, scaling: float = 1.0,
                 experts: tuple[int, int] | None = None,
                 norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """:func:`route` of ``F.linear(hidden, router_weight)`` with the router's product in the routing launch
    (``kbit.ops.moe_router.route_pairs_hidden``), for a step where :func:`fused_router_applies`. ``counters``:
    :func:`router_workspace`'s. ``experts``: this rank's ``(start, stop)`` (expert parallel; ids relative to
    start). ``norm``: ``(residual, weight, eps)``, hidden taken before the residual add and RMSNorm, which the
    launch makes as well; then returns ``(routing, normed hidden, new residual)``."""
    T = hidden.shape[0]
    blocks = _router_blocks(T, top_k, plan, hidden.device)
    _, w, ids, tok, rows, *normed = route_pairs_hidden(
        hidden, router_weight.to(hidden.dtype), top_k, counters=counters, router=router, renormalize=renormalize,
        correction_bias=correction_bias, scaling=scaling, experts=experts, blocks=blocks, norm=norm)
    E = router_weight.shape[0] if experts is None else experts[1] - experts[0]
    routing = _pairs_routing(w, ids, tok, rows, T, E, plan, blocks)
    return (routing, *normed) if norm is not None else routing


def _router_blocks(T: int, top_k: int, plan: MoePlan, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Buffers for the block table that ``kbit.ops.moe_router.route_pairs`` writes in the router's launch
    (``blocks=``), where the step uses one: one token and the grouped GEMM for both projections (the table
    launch, ~4 us a layer on the critical path of a decode step, goes). Else None."""
    if T != 1 or plan.gate_up != "gemm" or plan.down != "gemm":
        return None
    return (torch.empty(top_k + 1, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


# ------------------------------------------------------------------------------------------------ expert matmul


def _repacked(weight) -> bool:
    """Whether ``weight`` is held in layout "mma-v1" (a ``kbit.ops.gemv_mma.RepackedWeight``)."""
    return getattr(weight, "layout", None) == _MMA_LAYOUT


def grouped_gemm(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, weight: KbitWeight, blocks=None,
                 sorted_rows: bool = False, checked: bool = False) -> torch.Tensor:
    """``y[r] = x[rows[r]] @ W[expert_ids[r]].T`` on a stacked :class:`~kbit.format.KbitWeight` ``[E, N, K]``,
    ``[P, N]`` in x's dtype: the grouped tensor-core kernel (``kbit.ops.grouped_mma.grouped_linear``) where it
    runs, else the grouped GEMV (same semantics). ``blocks``, ``sorted_rows``, ``checked``: see
    ``grouped_linear``."""
    kw = dict(k=weight.k, blocksize=weight.blocksize, scale_format=weight.scale_format, N=weight.N, K=weight.K)
    args = (x, rows, expert_ids, weight.codes, weight.scales, weight.tensor_scale, weight.codebook)
    if not kernels_available(x.device):
        return grouped_gemv(*args, **kw)
    return grouped_linear(*args, **kw, blocks=blocks, sorted_rows=sorted_rows, checked=checked)


def grouped_gemm_repacked(x: torch.Tensor, rows: torch.Tensor, expert_ids: torch.Tensor, weight, blocks=None,
                          sorted_rows: bool = False, act: str | None = None, checked: bool = False) -> torch.Tensor:
    """:func:`grouped_gemm` on a stack held in layout "mma-v1" (``kbit.ops.gemv_mma.RepackedWeight``).
    ``act="silu"``: x is a gate_up product ``[T, 2K]`` and the input is its SwiGLU, computed by the grouped
    kernel 7 while it gathers x where it can (``kbit.ops.grouped_mma.fused_silu_ok``), else by
    ``silu_mul_gate_up`` first. Where the CUDA kernel does not run: an unrepacked temporary of the stack and the
    grouped GEMV."""
    if act not in (None, "silu"):
        fail(ValueError, "act", "None or 'silu'", act)
    K = weight.K
    if act == "silu" and (x.dim() != 2 or x.shape[1] != 2 * K):
        fail(ValueError, "x", f"a gate_up product [T, {2 * K}] (act='silu')", tuple(x.shape))
    kw = dict(k=weight.k, blocksize=weight.blocksize, scale_format=weight.scale_format, N=weight.N, K=K)
    E = weight.codes.shape[0] if weight.codes.dim() == 6 else -1
    cuda = kernels_available(x.device)
    if act == "silu" and not (cuda and sorted_rows and rows.shape[0] and fused_silu_ok(x, rows.shape[0], E)):
        x, act = silu_mul_gate_up(x), None
    if not cuda:
        codes, scales = unrepack_stack(weight.codes, weight.scales, k=weight.k, blocksize=weight.blocksize,
                                       N=weight.N, K=K)
        return grouped_gemv(x, rows, expert_ids, codes, scales, weight.tensor_scale, weight.codebook, **kw)
    return grouped_linear_repacked(x, rows, expert_ids, weight.codes, weight.scales, weight.tensor_scale,
                                   weight.codebook, **kw, blocks=blocks, sorted_rows=sorted_rows, act=act,
                                   checked=checked)


def _dequantize_slots(weight: KbitWeight, routing: MoeRouting, dtype: torch.dtype):
    """(float weights ``[S or E, N, K]``, the matching ``offs``): every expert when ``S == E`` (no gather),
    else the touched experts gathered into ``S`` slots (unused slots hold expert 0, with empty groups).
    A repacked stack is unrepacked (the gathered slots only) into a temporary first."""
    E = weight.shape[0]
    codes, scales, ts = weight.codes, weight.scales, weight.tensor_scale
    offs = routing.offsets
    idx = None
    if routing.S < E:
        idx = routing.slot_experts.clamp(min=0)
        offs = routing.slot_offsets
    if _repacked(weight):
        codes, scales = weight.canonical_tensors(idx)
        if idx is not None:
            ts = ts.index_select(0, idx)
    elif idx is not None:
        codes, scales, ts = codes.index_select(0, idx), scales.index_select(0, idx), ts.index_select(0, idx)
    w = dequantize_tensors(codes, scales, ts, weight.codebook, k=weight.k, blocksize=weight.blocksize,
                           scale_format=weight.scale_format, shape=(codes.shape[0], weight.N, weight.K),
                           dtype=dtype)
    return w, offs


def expert_matmul(x: torch.Tensor, routing: MoeRouting, weight: KbitWeight, kernel: str,
                  gather: bool, blocks=None, act: str | None = None) -> torch.Tensor:
    """``y[r] = x[token_ids[r] if gather else r] @ W[expert_ids[r]].T`` for every sorted row ``r``.

    Parameters
    ----------
    x : ``[T, K]`` (``gather``: token activations) or ``[P, K]`` (one row per sorted pair).
    routing : the step's :class:`~kbit.ops.moe_align.MoeRouting`.
    weight : stacked :class:`~kbit.format.KbitWeight` ``[E, N, K]``, or a stack held in layout "mma-v1"
        (``kbit.ops.gemv_mma.RepackedWeight``): read as it is by ``"gemm"``; ``"gemv"`` unrepacks the whole
        stack into a temporary, ``"grouped_mm"`` the touched experts.
    kernel : ``"gemv"``, ``"grouped_mm"``, ``"gemm"`` or ``"pairs"`` (:class:`MoePlan`; ``"pairs"`` needs a stack
        in layout "mma-v1" and a launch ``kbit.ops.gemv_mma.pairs_linear`` covers, else it runs ``"gemm"``).
    blocks : ``"gemm"`` only: the step's ``kbit.ops.moe_blocks.block_table`` (built there when None).
    act : ``"silu"``: x is a gate_up product ``[P, 2K]`` and the input is ``silu_mul_gate_up`` of it (the grouped
        kernel 7 computes it while gathering its x tiles; other kernels run ``silu_mul_gate_up`` first).

    Returns
    -------
    ``[P, N]`` in x's dtype, rows in sorted order.
    """
    if act not in (None, "silu"):
        raise ValueError(f"act: expected None or 'silu', got {act!r}")
    rows = routing.token_ids if gather else routing.row_ids
    if kernel == "pairs":
        y = _pairs(x, rows, routing, weight, gather, act)
        if y is not None:
            return y
        kernel = "gemm"
    if _repacked(weight) and kernel == "gemm":
        return grouped_gemm_repacked(x, rows, routing.expert_ids, weight, blocks=blocks, sorted_rows=routing.sorted,
                                     act=act, checked=routing.checked)
    if act == "silu":
        x = silu_mul_gate_up(x)
    if _repacked(weight) and kernel == "gemv":
        weight = weight.canonical()
    if kernel == "gemv":
        return grouped_gemv(x, rows, routing.expert_ids, weight.codes, weight.scales, weight.tensor_scale,
                            weight.codebook, k=weight.k, blocksize=weight.blocksize,
                            scale_format=weight.scale_format, N=weight.N, K=weight.K)
    if kernel == "grouped_mm":
        if not routing.has_groups:
            raise ValueError("kernel 'grouped_mm': expected a routing with group tables (kbit.ops.moe_align.align), "
                             "got one without (pair_order / sort_pairs)")
        # ids out of range (kbit.ops._ids): index_select would fault on a token id; an expert id falls outside
        # the groups (or into expert 0's): clamped copies, the rows NaN after
        rows, _, bad = guard(rows, x.shape[0], routing.expert_ids, routing.E, checked=routing.checked)
        xs = x.index_select(0, rows) if gather else x
        w, offs = _dequantize_slots(weight, routing, x.dtype)
        return poison(torch._grouped_mm(xs.contiguous(), w.transpose(-2, -1), offs=offs), bad)
    if kernel == "gemm":
        return grouped_gemm(x, rows, routing.expert_ids, weight, blocks=blocks, sorted_rows=routing.sorted,
                            checked=routing.checked)
    raise ValueError(f"kernel: expected one of {MOE_KERNELS}, got {kernel!r}")


def _pairs(x, rows, routing: MoeRouting, weight, gather: bool, act: str | None) -> torch.Tensor | None:
    """:func:`expert_matmul` of kernel ``"pairs"``, or None where ``kbit.ops.gemv_mma.pairs_linear`` does not
    apply (the caller runs the grouped kernels)."""
    if not _repacked(weight):
        return None
    if act == "silu":
        x = silu_mul_gate_up(x)
    # ids out of range (a routing not made by kbit's router): clamped copies, their rows NaN after
    rows, ids, bad = guard(rows, x.shape[0], routing.expert_ids, weight.codes.shape[0], checked=routing.checked)
    return pairs_linear(x, rows, ids, weight.codes, weight.scales, weight.tensor_scale, weight.codebook, k=weight.k,
                        scale_format=weight.scale_format, N=weight.N, K=weight.K, bad=bad)


# ------------------------------------------------------------------------------------------------ layer


def _tail_split_rows(hidden, routing: MoeRouting, gate_up, down) -> int:
    """The grouped kernel 7's rows a block if this step takes the tail split, else 0: both stacks held in layout
    "mma-v1", rows sorted with group ends (``align``), at least ``TAIL_SPLIT_MIN_E`` experts, kernel 7 with
    ``TAIL_SPLIT_BT``-row blocks."""
    if not (routing.sorted and routing.has_groups):
        return 0
    if not (_repacked(gate_up) and _repacked(down)) or routing.P == 0 or routing.E < TAIL_SPLIT_MIN_E:
        return 0
    bt = large_rows(routing.P, routing.E, hidden.device)
    return bt if bt == TAIL_SPLIT_BT else 0


def _experts_tail_split(hidden, routing: MoeRouting, gate_up, down, bt: int) -> torch.Tensor:
    """:func:`moe_experts` with each expert's last block of at most ``TAIL_ROWS`` rows served by kernel 4 (32-row
    blocks) instead of the grouped kernel 7 (``kbit.ops.moe_blocks.tail_split``): the rows are reordered into a
    main part and a tail part, each GEMM runs twice into one output (kernel 7 on the main part's blocks, kernel 4
    on the tail's), the tail's SiLU * up from ``silu_mul_gate_up`` over the step's last ``R`` rows (the main
    part's is made in kernel 7's x gather), and the combine reads the new rows."""
    # tail_split indexes per-expert tables by expert id: clamped ids first, the tokens of bad pairs NaN after
    tok, eids, bad = guard(routing.token_ids, hidden.shape[0], routing.expert_ids, routing.E,
                           checked=routing.checked)
    if bad is not None:
        routing = replace(routing, token_ids=tok, expert_ids=eids)
    sp = tail_split(routing, bt)
    P, ng_tail = routing.P, TAIL_ROWS // 8  # kernel 4: one block a tail

    def run(x, rows, w, y, ng, blocks, main, silu=False):
        run_blocks(x, rows, sp.expert_ids, w.codes, w.scales, w.tensor_scale, w.codebook, y, k=w.k,
                   scale_format=w.scale_format, N=w.N, ng=ng, blocks=blocks, sorted_rows=main, silu=silu,
                   checked=True)  # ids checked above

    gu = hidden.new_empty(P, gate_up.N)
    run(hidden, sp.token_ids, gate_up, gu, bt // 8, sp.main_blocks, True)
    run(hidden, sp.token_ids, gate_up, gu, ng_tail, sp.tail_blocks, False)
    y = hidden.new_empty(P, down.N)
    run(gu, routing.row_ids, down, y, bt // 8, sp.main_blocks, True, silu=True)
    run(silu_mul_gate_up(gu[P - sp.R:]), sp.tail_rows, down, y, ng_tail, sp.tail_blocks, False)
    out = combine(y, replace(routing, pair_rows=sp.pair_rows), hidden.dtype)
    return poison_tokens(out, bad, routing.pair_rows, routing.top_k)


def _check_experts(hidden, routing, gate_up, down) -> tuple[int, int, int, int]:
    """(T, H, E, I) of a valid :func:`moe_experts` call."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected shape [T, H], got {tuple(hidden.shape)}")
    T, H = hidden.shape
    if len(gate_up.shape) != 3 or len(down.shape) != 3:
        raise ValueError(f"gate_up, down: expected stacks [E, 2I, H] and [E, H, I], got {gate_up.shape}, "
                         f"{down.shape}")
    E, I2, Hg = gate_up.shape
    I = I2 // 2
    if Hg != H or I2 % 2 or tuple(down.shape) != (E, H, I):
        raise ValueError(f"down: expected shape {(E, H, I)} for gate_up {gate_up.shape} and hidden [T, {H}], "
                         f"got {down.shape}")
    if routing.T != T or routing.E != E:
        raise ValueError(f"routing: expected T={T}, E={E}, got T={routing.T}, E={routing.E}")
    return T, H, E, I


def moe_experts(hidden: torch.Tensor, routing: MoeRouting, gate_up: KbitWeight, down: KbitWeight,
                plan: MoePlan | None = None, *, defer_combine: bool = False) -> torch.Tensor | Uncombined:
    """The routed experts of an MoE layer: ``[T, H]`` -> ``[T, H]`` in hidden's dtype (module docstring).
    ``defer_combine``: where the combine would be a launch of its own, return the expert outputs before it
    (``kbit.ops.moe.Uncombined``) for the caller's next launch to make (``kbit.ops.moe.combine_add_rms_norm``).

    Parameters
    ----------
    hidden : fp16/bf16 (any kernel) or a dtype ``torch._grouped_mm`` supports ``[T, H]``.
    routing : :func:`kbit.ops.moe_align.align` of the step's top-k choice (or :func:`route`'s routing).
    gate_up : :class:`~kbit.format.KbitWeight` ``[E, 2I, H]`` (gate rows first, then up rows), or the stack in
        layout "mma-v1" (``kbit.ops.gemv_mma.RepackedWeight``, see :func:`expert_matmul`).
    down : :class:`~kbit.format.KbitWeight` ``[E, H, I]`` (or repacked).
    plan : the kernels; default :func:`choose_plan`.

    Ids of ``routing`` out of range (a routing built from bad ``topk_ids``; :func:`route` makes none): on the CPU
    and in ``kbit.ops._ids.debug_ids`` mode ``ValueError``; on CUDA no sync: the tokens of the bad pairs get NaN
    outputs and the device's error flag is set (``kbit.ops._ids.check_errors``).
    """
    T, H, E, I = _check_experts(hidden, routing, gate_up, down)
    if T == 0:
        return hidden.new_zeros(0, H)
    plan = plan or choose_plan(T, routing.top_k, E, H, I, hidden.dtype, hidden.device)
    blocks = None
    if plan.gate_up == plan.down == "gemm" and gemm_supported(hidden.device, hidden.dtype):
        bt = _tail_split_rows(hidden, routing, gate_up, down)
        if bt:
            return _experts_tail_split(hidden, routing, gate_up, down, bt)
        ng = choose_ng(routing.P, E, hidden.device, routing.sorted)
        # one table for both GEMMs; from the group ends where align made them (a group, not a row, at a time)
        # the router's table (8-row blocks) serves every ng
        blocks = routing.blocks or block_table(routing.expert_ids, 8 * ng, routing.offsets if routing.sorted else None)
    gu = expert_matmul(hidden, routing, gate_up, plan.gate_up, gather=True, blocks=blocks)
    y = expert_matmul(gu, routing, down, plan.down, gather=False, blocks=blocks, act="silu")
    return Uncombined(y, routing, hidden.dtype) if defer_combine else combine(y, routing, hidden.dtype)


# ------------------------------------------------------------------------------------------------ routed experts


def routed_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: KbitWeight,
                   down: KbitWeight, checked: bool = False) -> torch.Tensor:
    """SwiGLU experts of canonical stacks for a router's choice: ``hidden [T, H]``, ``topk_ids [T, top_k]`` in
    ``[0, E)``, float ``topk_weights [T, top_k]`` -> ``[T, H]`` in hidden's dtype. The pairs are sorted on the
    device (``align``), the kernels are :func:`choose_plan`'s without the grouped wgmma kernel (it reads layout
    "mma-v1"), and :func:`moe_experts` runs them; no host sync. Ids out of range: as :func:`moe_experts` says,
    unless ``checked`` (in range by construction: the guards are skipped). Under ``torch.compile`` it is the op
    ``torch.ops.kbit.routed_experts`` (the stacks passed as their tensors), so a compiled graph holds it."""
    T, top_k = topk_ids.shape
    E, I2, H = gate_up.shape
    routing = align(topk_ids, E, topk_weights, checked=checked)
    plan = choose_plan(T, top_k, E, H, I2 // 2, hidden.dtype, hidden.device, gemm=False)
    return moe_experts(hidden, routing, gate_up, down, plan)


@torch.library.custom_op("kbit::routed_experts", mutates_args=())
def _routed_experts_op(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       gu_codes: torch.Tensor, gu_scales: torch.Tensor, gu_tensor_scale: torch.Tensor,
                       gu_codebook: torch.Tensor, dn_codes: torch.Tensor, dn_scales: torch.Tensor,
                       dn_tensor_scale: torch.Tensor, dn_codebook: torch.Tensor, k: int, blocksize: int,
                       scale_format: str, E: int, H: int, I: int, checked: bool = False) -> torch.Tensor:
    fmt = dict(k=k, blocksize=blocksize, scale_format=scale_format)
    gate_up = KbitWeight(gu_codes, gu_scales, gu_tensor_scale, gu_codebook, shape=(E, 2 * I, H), **fmt)
    down = KbitWeight(dn_codes, dn_scales, dn_tensor_scale, dn_codebook, shape=(E, H, I), **fmt)
    return routed_experts(hidden, topk_ids, topk_weights, gate_up, down, checked=checked)


@_routed_experts_op.register_fake
def _(hidden, topk_ids, topk_weights, gu_codes, gu_scales, gu_tensor_scale, gu_codebook, dn_codes, dn_scales,
      dn_tensor_scale, dn_codebook, k, blocksize, scale_format, E, H, I, checked=False):
    if hidden.dim() != 2 or hidden.shape[1] != H:
        raise ValueError(f"hidden: expected shape [T, H={H}], got {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids, topk_weights: expected shape [T={hidden.shape[0]}, top_k] each, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    return hidden.new_empty(hidden.shape)

