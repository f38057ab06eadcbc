"""The experts of an MoE layer on k-bit weight stacks: grouped gate_up, fused SwiGLU, grouped down, weighted
combine back to token order. Sync-free and graph-capturable for a fixed number of tokens.

Steps (``P = T * top_k`` pairs as rows of a :class:`~kbit.ops.moe_align.MoeRouting`: sorted by expert, or in
router order for a GEMV-only decode step):

1. ``gu[P, 2I] = x[token of row] @ W_gate_up[expert of row].T`` (:func:`expert_matmul`);
2. ``a[P, I] = silu(gu[:, :I]) * gu[:, I:]`` (:func:`silu_mul`, one Triton kernel; where the grouped wgmma
   kernel 7 serves step 3, computed while it gathers its x tiles instead);
3. ``y[P, H] = a @ W_down[expert of row].T`` (:func:`expert_matmul`);
4. ``out[t] = sum_s w[t, s] * y[row of (t, s)]`` (:func:`combine`, one Triton kernel, float32 sums).

Kernels for steps 1 and 3 (:class:`MoePlan`, from :func:`choose_plan`):

- ``"gemv"``: ``kbit.ops.gemv.grouped_gemv``, one launch over all pairs, each pair reading its expert's
  packed codes (any row order; when sorted, rows of one expert are adjacent, so repeated reads mostly hit
  L2). For few rows per expert.
- ``"grouped_mm"``: the touched experts dequantized to the activation dtype (``kbit.ops.dequant``; with
  ``S = min(E, P)`` slots, a fixed size, so no sync), then ``torch._grouped_mm`` on the sorted rows. For
  many rows per expert, where the dequantization is paid once per expert instead of once per row.
- ``"gemm"``: ``kbit.ops.gemm.kbit_grouped_gemm``, the grouped tensor-core kernel (``kbit.ops.grouped_mma``,
  CUDA through NVRTC): rows sorted by expert, cut into blocks of up to 8-64 rows of one expert (a block table
  built on the device), each block's expert weight read and decoded once for all its rows. CUDA with
  fp16/bf16 only (elsewhere it would fall back to the GEMV, so :func:`choose_plan` does not pick it).

:func:`moe_reference` is the float64 oracle of the whole computation (any routing, float weights).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from kbit.format.spec import KbitWeight
from kbit.ops.moe_align import MoeRouting

__all__ = ["GEMM_MAX_ROWS_PER_EXPERT", "GEMV_MAX_ROWS_PER_EXPERT", "MOE_KERNELS", "PAIR_ORDER_MAX_T",
           "SORT_PAIRS_MAX_T", "GEMV_T1_MAX_WEIGHTS", "MoePlan", "choose_plan", "combine",
           "combine_reference", "expert_matmul", "grouped_mm_supported", "moe_experts", "moe_reference", "silu_mul",
           "silu_mul_reference"]

MOE_KERNELS = ("gemv", "grouped_mm", "gemm")
#: The GEMV reads an expert's weight once per row, the dequantize + grouped_mm path once per expert plus a
#: bf16 write and read (~4x the packed bytes at k = 4). First guess, not yet measured on the H100: GEMV up
#: to 4 rows per touched expert (benchmarks/bench_moe.py --plans sweeps both).
GEMV_MAX_ROWS_PER_EXPERT = 4
#: GEMV-only steps of up to this many tokens keep the pairs in router order (no sort: one fused routing
#: launch); longer ones sort them by expert in one more launch (``kbit.ops.moe_align.sort_pairs``), so that
#: the rows of an expert are adjacent in the GEMV's grid and its weight is re-read from L2. At T = 16,
#: P = 128 pairs: all the GEMV's programs are resident at once anyway (a guess; T = 64 measures the sort).
PAIR_ORDER_MAX_T = 16
#: The grouped tensor-core GEMM ("gemm") up to this many rows per touched expert (blocks of up to 64 rows; above,
#: dequantize + bf16 ``torch._grouped_mm``). H100, k = 4, benchmarks/results/h100/moe-2026-11-21-kernel4.md and
#: moe-lab-2026-11-21-run1.log: "gemm" beat "grouped_mm" at 256 rows an expert (Qwen3-30B T = 4096 0.55x vs
#: 0.48x bf16; Mixtral T = 1024 ~0.5x vs 0.38x) and lost at 1024 (Mixtral T = 4096: 0.42x vs 0.69x).
GEMM_MAX_ROWS_PER_EXPERT = 256
#: Steps of a fused-routing plan above this many tokens sort with ``align`` (torch's radix sort, ~30 launches)
#: instead of the one-launch ``sort_pairs`` (O(P^2) compares: ~P^2 / 64 / 2M per us, a guess).
SORT_PAIRS_MAX_T = 1024
#: At T = 1 the Triton GEMV beats the grouped GEMM on experts up to this many weights (H100, k = 4, commit
#: b471a6b: Qwen3-30B 27.1 vs 33.0 us, Qwen3-Next 29.2 vs 37.3 us; Mixtral, 58.7M and 117M weights: 151.1 vs
#: 92.0 us).
GEMV_T1_MAX_WEIGHTS = 1 << 24
_BLOCK = 1024


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


def _gemm_available() -> bool:
    from kbit.ops import gemm

    return hasattr(gemm, "kbit_grouped_gemm")


def gemm_supported(device, dtype: torch.dtype) -> bool:
    """Whether the grouped tensor-core kernel (``kbit.ops.grouped_mma``) runs on ``device`` in ``dtype``."""
    if dtype not in (torch.float16, torch.bfloat16) or torch.device(device).type != "cuda":
        return False
    from kbit.ops.grouped_mma import available

    return _gemm_available() and available(device)


def _large(P: int, E: int, device) -> bool:
    """Whether the grouped wgmma kernel (``kbit.ops.grouped_mma.large_config``, sm_90) serves the step."""
    from kbit.ops.grouped_mma import _large_rows

    return bool(_large_rows(P, E, device))


def choose_plan(T: int, top_k: int, E: int, H: int, I: int, dtype: torch.dtype, device,
                gemm: bool | None = None) -> MoePlan:
    """The kernels for a step of ``T`` tokens (module docstring); a function of shapes only.

    On CUDA (fp16/bf16, NVRTC): the GEMV at T = 1 on experts of at most :data:`GEMV_T1_MAX_WEIGHTS` weights,
    else the grouped tensor-core GEMM up to :data:`GEMM_MAX_ROWS_PER_EXPERT` rows per touched expert
    (``T * top_k / min(E, T * top_k)``), dequantize + ``torch._grouped_mm`` above where it runs.
    Elsewhere: GEMV (fp16/bf16 only) while there are at most :data:`GEMV_MAX_ROWS_PER_EXPERT` rows per touched
    expert, dequantize + ``torch._grouped_mm`` above, or whichever exists.
    ``gemm=False``: plan as if the grouped tensor-core kernel were not there (it reads layout "mma-v1"; a
    ``kbit.nn.KbitMoE`` that keeps the canonical layout plans without it).
    """
    P = T * top_k
    rows_per_expert = P / max(1, min(E, P))
    gemv_ok = dtype in (torch.float16, torch.bfloat16)
    gemm_ok = gemm is not False and gemm_supported(device, dtype)
    plan = []
    for N, K in ((2 * I, H), (H, I)):
        mm_ok = grouped_mm_supported(device, dtype, N, K)
        if gemm_ok and gemv_ok and T == 1 and N * K <= GEMV_T1_MAX_WEIGHTS:
            plan.append("gemv")
        elif gemm_ok and (rows_per_expert <= GEMM_MAX_ROWS_PER_EXPERT or not mm_ok or _large(P, E, device)):
            plan.append("gemm")
        elif gemv_ok and (rows_per_expert <= GEMV_MAX_ROWS_PER_EXPERT or not mm_ok):
            plan.append("gemv")
        elif mm_ok:
            plan.append("grouped_mm")
        else:
            raise ValueError(f"dtype: expected float16/bfloat16 (the k-bit GEMV), or a dtype torch._grouped_mm "
                             f"supports on {device} for [{N}, {K}] weights, got {dtype}")
    return MoePlan(*plan)


# ------------------------------------------------------------------------------------------------ expert matmul


def _repacked(weight) -> bool:
    """Whether ``weight`` is held in layout "mma-v1" (a ``kbit.ops.gemv_mma.RepackedWeight``)."""
    return getattr(weight, "layout", None) == "mma-v1"


def _dequantize_slots(weight: KbitWeight, routing: MoeRouting, dtype: torch.dtype):
    """(float weights ``[S or E, N, K]``, the matching ``offs``): every expert when ``S == E`` (no gather),
    else the touched experts gathered into ``S`` slots (unused slots hold expert 0, with empty groups).
    A repacked stack is unrepacked (the gathered slots only) into a temporary first."""
    from kbit.ops.dequant import dequantize_tensors

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
    kernel : ``"gemv"``, ``"grouped_mm"`` or ``"gemm"`` (:class:`MoePlan`).
    blocks : ``"gemm"`` only: the step's ``kbit.ops.grouped_mma.block_table`` (built here when None).
    act : ``"silu"``: x is a gate_up product ``[P, 2K]`` and the input is :func:`silu_mul` of it (the grouped
        kernel 7 computes it while gathering its x tiles; other kernels run :func:`silu_mul` first).

    Returns
    -------
    ``[P, N]`` in x's dtype, rows in sorted order.
    """
    if act not in (None, "silu"):
        raise ValueError(f"act: expected None or 'silu', got {act!r}")
    if _repacked(weight) and kernel == "gemm":
        from kbit.ops.grouped_mma import grouped_linear_repacked

        rows = routing.token_ids if gather else routing.row_ids
        return grouped_linear_repacked(x, rows, routing.expert_ids, weight.codes, weight.scales, weight.tensor_scale,
                                       weight.codebook, k=weight.k, blocksize=weight.blocksize,
                                       scale_format=weight.scale_format, N=weight.N, K=weight.K, blocks=blocks,
                                       sorted_rows=routing.sorted, act=act)
    if act == "silu":
        x = silu_mul(x)
    if _repacked(weight) and kernel == "gemv":
        weight = weight.canonical()
    if kernel == "gemv":
        from kbit.ops.gemv import grouped_gemv

        rows = routing.token_ids if gather else routing.row_ids
        return grouped_gemv(x, rows, routing.expert_ids, weight.codes, weight.scales, weight.tensor_scale,
                            weight.codebook, k=weight.k, blocksize=weight.blocksize,
                            scale_format=weight.scale_format, N=weight.N, K=weight.K)
    if kernel == "grouped_mm":
        if not routing.has_groups:
            raise ValueError("kernel 'grouped_mm': expected a routing with group tables (kbit.ops.moe_align.align), "
                             "got one without (pair_order / sort_pairs)")
        xs = x.index_select(0, routing.token_ids) if gather else x
        w, offs = _dequantize_slots(weight, routing, x.dtype)
        return torch._grouped_mm(xs.contiguous(), w.transpose(-2, -1), offs=offs)
    if kernel == "gemm":
        if not _gemm_available():
            raise ValueError("kernel 'gemm': kbit.ops.gemm has no kbit_grouped_gemm yet")
        from kbit.ops.gemm import kbit_grouped_gemm

        rows = routing.token_ids if gather else routing.row_ids
        return kbit_grouped_gemm(x, rows, routing.expert_ids, weight, blocks=blocks, sorted_rows=routing.sorted)
    raise ValueError(f"kernel: expected one of {MOE_KERNELS}, got {kernel!r}")


# ------------------------------------------------------------------------------------------------ element-wise


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a gate_up product: ``gu[P, 2I]`` -> ``silu(gu[:, :I]) * gu[:, I:]``, ``[P, I]`` in gu's dtype
    (float32 math, one rounding)."""
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu: expected shape [P, 2I], got {tuple(gu.shape)}")
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    P, I = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(P, I, dtype=gu.dtype, device=gu.device)
    if P == 0 or I == 0:
        return out
    from kbit.kernels.moe import silu_mul_kernel

    block = min(_BLOCK, 1 << max(4, (I - 1).bit_length()))
    silu_mul_kernel[(P, triton_cdiv(I, block))](gu, out, I, gu.stride(0), out.stride(0), BLOCK=block,
                                                num_warps=4 if block >= 512 else 1)
    return out


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    I = gu.shape[-1] // 2
    g, u = gu[..., :I].double(), gu[..., I:].double()
    return g * torch.sigmoid(g) * u


def combine(y: torch.Tensor, routing: MoeRouting, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum_s topk_weights[t, s] * y[pair_rows[t * top_k + s]]``: sorted expert outputs
    ``y[P, H]`` back to token order, ``[T, H]`` in ``out_dtype`` (default y's dtype), float32 sums."""
    T, top_k = routing.T, routing.top_k
    if y.dim() != 2 or y.shape[0] != T * top_k:
        raise ValueError(f"y: expected shape [P={T * top_k}, H], got {tuple(y.shape)}")
    if y.stride(1) != 1:
        y = y.contiguous()
    H = y.shape[1]
    out = torch.empty(T, H, dtype=out_dtype or y.dtype, device=y.device)
    if T == 0 or H == 0:
        return out
    from kbit.kernels.moe import combine_kernel

    block = min(_BLOCK, 1 << max(4, (H - 1).bit_length()))
    combine_kernel[(T, triton_cdiv(H, block))](y, routing.pair_rows, routing.topk_weights, out, H, y.stride(0),
                                               out.stride(0), TOP_K=top_k, BLOCK=block,
                                               num_warps=4 if block >= 512 else 1)
    return out


def combine_reference(y: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    rows = y.double()[routing.pair_rows.long()].view(routing.T, routing.top_k, y.shape[1])
    return (routing.topk_weights.double()[..., None] * rows).sum(1)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------ layer


#: The tail split (:func:`_experts_tail_split`) where the grouped kernel 7 runs blocks of this many rows (H100,
#: k = 4, Qwen3-30B-A3B T = 4096, scripts/moe_tail_lab.py, benchmarks/results/h100/moe-tail-s22-2026-11-23.log:
#: gate_up 602.7 -> 458.3 + 77.5 us, down 394.0 -> 311.9 + 44.8 us; whole layer 1129.8 -> 1056.6 us,
#: benchmarks/results/h100/moe-s22-tail-2026-11-23.md), on stacks of at least ``TAIL_SPLIT_MIN_E`` experts (Mixtral,
#: 8 experts at T = 4096: 5367.1 -> 5397.6 us, a few tails do not pay for the extra launches). ``KBIT_MOE_TAIL=0``
#: turns it off.
TAIL_SPLIT_BT = 256
TAIL_SPLIT_MIN_E = 64


def _tail_split_rows(hidden, routing: MoeRouting, gate_up, down) -> int:
    """The grouped kernel 7's rows a block if this step takes the tail split, else 0: both stacks held in layout
    "mma-v1", rows sorted with group ends (``align``), at least ``TAIL_SPLIT_MIN_E`` experts, kernel 7 with
    ``TAIL_SPLIT_BT``-row blocks."""
    from kbit.ops.grouped_mma import _large_rows

    if os.environ.get("KBIT_MOE_TAIL", "1") == "0" or not (routing.sorted and routing.has_groups):
        return 0
    if not (_repacked(gate_up) and _repacked(down)) or routing.P == 0 or routing.E < TAIL_SPLIT_MIN_E:
        return 0
    bt = _large_rows(routing.P, routing.E, hidden.device)
    return bt if bt == TAIL_SPLIT_BT else 0


def _experts_tail_split(hidden, routing: MoeRouting, gate_up, down, bt: int) -> torch.Tensor:
    """``moe_experts`` with each expert's last block of at most ``TAIL_ROWS`` rows served by kernel 4 (32-row
    blocks) instead of the grouped kernel 7 (``kbit.ops.grouped_mma.tail_split``): the rows are reordered into
    a main part and a tail part, each GEMM runs twice into one output (kernel 7 on the main part's blocks,
    kernel 4 on the tail's), the tail's SiLU * up from ``silu_mul`` over the step's last ``R`` rows (the main
    part's is made in kernel 7's x gather), and the combine reads the new rows."""
    from dataclasses import replace

    from kbit.ops.grouped_mma import TAIL_ROWS, _grouped_run, tail_split

    sp = tail_split(routing, bt)
    P, ng_tail = routing.P, TAIL_ROWS // 8  # kernel 4: one block a tail

    def run(x, rows, w, y, ng, blocks, main, silu=False):
        _grouped_run(x, rows, sp.expert_ids, w.codes, w.scales, w.tensor_scale, w.codebook, y, k=w.k,
                     scale_format=w.scale_format, N=w.N, ng=ng, blocks=blocks, sorted_rows=main, silu=silu)

    gu = hidden.new_empty(P, gate_up.N)
    run(hidden, sp.token_ids, gate_up, gu, bt // 8, sp.main_blocks, True)
    run(hidden, sp.token_ids, gate_up, gu, ng_tail, sp.tail_blocks, False)
    y = hidden.new_empty(P, down.N)
    run(gu, routing.row_ids, down, y, bt // 8, sp.main_blocks, True, silu=True)
    run(silu_mul(gu[P - sp.R:]), sp.tail_rows, down, y, ng_tail, sp.tail_blocks, False)
    return combine(y, replace(routing, pair_rows=sp.pair_rows), hidden.dtype)


def moe_experts(hidden: torch.Tensor, routing: MoeRouting, gate_up: KbitWeight, down: KbitWeight,
                plan: MoePlan | None = None) -> torch.Tensor:
    """The routed experts of an MoE layer: ``[T, H]`` -> ``[T, H]`` in hidden's dtype (module docstring).

    Parameters
    ----------
    hidden : fp16/bf16 (any kernel) or a dtype ``torch._grouped_mm`` supports ``[T, H]``.
    routing : :func:`kbit.ops.moe_align.align` of the step's top-k choice.
    gate_up : :class:`~kbit.format.KbitWeight` ``[E, 2I, H]`` (gate rows first, then up rows), or the stack in
        layout "mma-v1" (``kbit.ops.gemv_mma.RepackedWeight``, see :func:`expert_matmul`).
    down : :class:`~kbit.format.KbitWeight` ``[E, H, I]`` (or repacked).
    plan : the kernels; default :func:`choose_plan`.
    """
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
    if T == 0:
        return hidden.new_zeros(0, H)
    plan = plan or choose_plan(T, routing.top_k, E, H, I, hidden.dtype, hidden.device)
    blocks = None
    if plan.gate_up == plan.down == "gemm" and gemm_supported(hidden.device, hidden.dtype):
        from kbit.ops.grouped_mma import block_table, choose_ng

        bt = _tail_split_rows(hidden, routing, gate_up, down)
        if bt:
            return _experts_tail_split(hidden, routing, gate_up, down, bt)

        ng = choose_ng(routing.P, E, hidden.device, routing.sorted)
        # one table for both GEMMs; from the group ends where align made them (a group, not a row, at a time)
        blocks = block_table(routing.expert_ids, 8 * ng, routing.offsets if routing.sorted else None)
    gu = expert_matmul(hidden, routing, gate_up, plan.gate_up, gather=True, blocks=blocks)
    y = expert_matmul(gu, routing, down, plan.down, gather=False, blocks=blocks, act="silu")
    return combine(y, routing, hidden.dtype)


def moe_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """float64 ``out[t] = sum_s w[t, s] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = topk_ids[t, s]``.

    w_gate_up: float ``[E, 2I, H]`` (gate rows, then up rows); w_down: ``[E, H, I]``.
    """
    x = hidden.double()
    I = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64, device=x.device)
    ids = topk_ids.long()
    for e in range(w_gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ w_gate_up[e].double().T
        a = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        y = a @ w_down[e].double().T
        out.index_add_(0, tok, y * topk_weights[tok, slot].double()[:, None])
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64)."""
    d = (out.double() - ref.double()).norm()
    return float(d / ref.double().norm().clamp_min(math.ulp(0.0)))
