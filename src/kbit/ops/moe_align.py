"""Sorting the (token, expert) pairs of an MoE step by expert, on the device, without a host sync.

A step with ``T`` tokens and ``top_k`` experts per token has ``P = T * top_k`` pairs; pair ``p = t * top_k + s``
is token ``t``'s ``s``-th choice. The grouped expert kernels read the pairs as "rows"; the combine step maps
rows back to pairs. Every tensor here has a size fixed by ``T``, ``top_k`` and ``E`` (never by the routing's
values), so a step can be captured in a CUDA graph. Three ways to build a :class:`MoeRouting`:

- :func:`align`: sorted by expert, with the group tables (``offsets``, slots) that ``torch._grouped_mm``
  needs; torch ops that never synchronise (a stable sort, ``searchsorted``, ``cumsum``, ``scatter``; no
  ``nonzero``/``unique``/``bincount``/``.item()``); ~30 launches. :func:`align_reference` is its oracle.
- :func:`sort_pairs`: sorted by expert, no group tables (enough for the grouped GEMV), one Triton launch
  (O(P^2) compares: for the P of decode).
- :func:`pair_order`: the router's order, no sort, no launch (the grouped GEMV takes any row order).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kbit.kernels.moe import sort_pairs_kernel
from kbit.ops._ids import check_ids, host_checks

__all__ = ["ALIGN_METHODS", "MoeRouting", "align", "align_reference", "num_slots", "pair_order", "sort_pairs"]


@dataclass(frozen=True)
class MoeRouting:
    """The pairs of one MoE step as rows for the grouped kernels. ``P = T * top_k``, ``S = min(E, P)``.

    All tensors are on the device of the router logits; sizes depend only on (T, top_k, E). Rows are sorted
    by expert (``sorted``: from :func:`align` or :func:`sort_pairs`) or in pair order (:func:`pair_order`:
    row ``r`` is pair ``r``). The group tables (``offsets`` to ``touched``) exist only from :func:`align`.
    """

    #: float32 ``[T, top_k]``: router weight of each pair (applied when the experts' outputs are combined).
    topk_weights: torch.Tensor
    #: int32 ``[T, top_k]``: expert of each pair, in the router's slot order.
    topk_ids: torch.Tensor
    #: int32 ``[P]``: expert of each row; when ``sorted`` ascending, rows of one expert in pair order (stable).
    expert_ids: torch.Tensor
    #: int32 ``[P]``: token of each row (``pair // top_k``).
    token_ids: torch.Tensor
    #: int32 ``[P]``: the row of each pair (inverse of the sort): pair ``p``'s output is row
    #: ``pair_rows[p]``. Used by the combine step.
    pair_rows: torch.Tensor
    #: int32 ``[P]``: ``arange(P)``, the row lists of the down GEMV (its input is already one row per row).
    row_ids: torch.Tensor
    #: int32 ``[E]``: end row of each expert's group (cumulative counts; an empty group repeats the
    #: previous end). ``offsets[-1] == P``. None unless from :func:`align` (as are the next three).
    offsets: torch.Tensor | None
    #: int32 ``[S]``: the touched experts, ascending, then ``-1`` for unused slots. A "slot" is a compact
    #: expert index: kernels that work per touched expert (dequantize + grouped matmul) use slots.
    slot_experts: torch.Tensor | None
    #: int32 ``[S]``: end row of each slot's group (``offsets[slot_experts[j]]``; ``P`` for unused slots,
    #: i.e. empty groups at the end): ``torch._grouped_mm``'s ``offs`` over the slot-compacted weights.
    slot_offsets: torch.Tensor | None
    #: int32 ``[]``: how many slots are used (distinct experts touched), on the device.
    touched: torch.Tensor | None
    #: tokens, experts per token, experts (host ints, from shapes only).
    T: int
    top_k: int
    E: int
    #: rows sorted by expert (else in pair order).
    sorted: bool = True
    #: ids in range by construction (made by kbit's router, ``kbit.dispatch.moe.route``): the grouped GEMMs skip
    #: their device-side id checks (``kbit.ops._ids.guard``). False for ids from elsewhere (checked).
    checked: bool = False
    #: ``(blk, nblk)``: the grouped GEMM's block table of these rows in 8-row blocks (valid for its every
    #: ``8 * ng``), made with the routing (``kbit.ops.moe_router.route_pairs(..., blocks=)``), or None (the step
    #: builds it, ``kbit.ops.moe_blocks.block_table``).
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def has_groups(self) -> bool:
        """Whether the group tables (``offsets``, slots) are there: what ``torch._grouped_mm`` needs."""
        return self.offsets is not None

    @property
    def P(self) -> int:
        """Number of (token, expert) pairs = sorted rows."""
        return self.T * self.top_k

    @property
    def S(self) -> int:
        """Number of expert slots, ``min(E, P)``: an upper bound of the touched experts."""
        return num_slots(self.T, self.top_k, self.E)


def num_slots(T: int, top_k: int, E: int) -> int:
    """``min(E, T * top_k)``: the most experts a step of T tokens can touch."""
    return min(E, T * top_k)


def _check(topk_ids, topk_weights, E):
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        got = topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__
        raise TypeError(f"topk_ids: expected an int32/int64 tensor, got {got}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected shape [T, top_k], got {tuple(topk_ids.shape)}")
    if topk_weights is not None and topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)} (that of topk_ids), "
                         f"got {tuple(topk_weights.shape)}")
    if not (isinstance(E, int) and E >= 1):
        raise ValueError(f"E: expected a positive int, got {E}")


ALIGN_METHODS = ("sort", "count")


def _sorted_pairs(flat: torch.Tensor, E: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each sorted row int32, pair of each sorted row int64): a stable sort of ``flat`` [P].

    ``"sort"``: ``torch.sort(stable=True)`` (cub radix sort on CUDA). ``"count"``: a counting sort from a
    one-hot ``[P, E]`` cumsum (O(P * E) memory and work, plainly sync-free; the fallback should a torch
    version's sort ever read the device on the host)."""
    if method == "sort":
        return torch.sort(flat, stable=True)
    P = flat.shape[0]
    # ids out of [0, E) (unchecked on CUDA: kbit.ops._ids) go to a bucket E after the others, so every index
    # below stays in bounds and the order is a permutation; the kernels downstream flag those ids
    key = torch.where((flat < 0) | (flat >= E), E, flat).long()
    onehot = (key[:, None] == torch.arange(E + 1, device=flat.device)).to(torch.int32)
    rank = torch.cumsum(onehot, 0).gather(1, key[:, None]).squeeze(1) - 1  # earlier pairs, same expert
    start = torch.cumsum(onehot.sum(0), 0) - onehot.sum(0)  # first row of each expert
    row = start.gather(0, key) + rank
    order = torch.empty(P, device=flat.device, dtype=torch.int64).scatter_(
        0, row.long(), torch.arange(P, device=flat.device, dtype=torch.int64))
    return flat.gather(0, order), order


def align(topk_ids: torch.Tensor, E: int, topk_weights: torch.Tensor | None = None,
          method: str = "sort", checked: bool = False) -> MoeRouting:
    """Sort the pairs of ``topk_ids`` by expert (stable) and build the group tables; no host sync.

    Parameters
    ----------
    topk_ids : int32/int64 ``[T, top_k]``, values in ``[0, E)`` (checked on the CPU and in
        ``kbit.ops._ids.debug_ids`` mode: ``ValueError``; on CUDA not here, that would sync: the grouped kernels
        that read the rows flag them and give NaN rows).
    E : number of experts.
    topk_weights : float ``[T, top_k]`` or None (then all ones); stored as float32.
    method : ``"sort"`` or ``"count"`` (:func:`_sorted_pairs`); both give identical results.
    checked : ``topk_ids`` are in range by construction (from kbit's router): :attr:`MoeRouting.checked`.

    Example
    -------
    >>> r = align(torch.tensor([[2, 0], [2, 1]]), E=4)
    >>> r.expert_ids.tolist(), r.token_ids.tolist(), r.offsets.tolist(), r.slot_experts.tolist()
    ([0, 1, 2, 2], [0, 1, 0, 1], [1, 2, 4, 4], [0, 1, 2, -1])
    """
    _check(topk_ids, topk_weights, E)
    if method not in ALIGN_METHODS:
        raise ValueError(f"method: expected one of {ALIGN_METHODS}, got {method!r}")
    if host_checks(topk_ids):
        check_ids("topk_ids", topk_ids, E, "experts")
    T, top_k = topk_ids.shape
    dev = topk_ids.device
    P = T * top_k
    S = num_slots(T, top_k, E)
    flat = topk_ids.reshape(-1).to(torch.int32)
    expert_ids, order = _sorted_pairs(flat, E, method)  # order: the pair of each sorted row
    rows = torch.arange(P, device=dev, dtype=torch.int32)
    pair_rows = torch.empty(P, device=dev, dtype=torch.int32).scatter_(0, order, rows)
    token_ids = (order // top_k).to(torch.int32)
    experts = torch.arange(E, device=dev, dtype=torch.int32)
    offsets = torch.searchsorted(expert_ids, experts, right=True).to(torch.int32)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    present = counts > 0
    slot = torch.cumsum(present, 0, dtype=torch.int32) - 1  # slot of each touched expert
    # scatter the touched experts to their slots; untouched ones all land in a spare slot S, cut off after
    where = torch.where(present, slot, torch.full_like(slot, S)).long()
    slot_experts = torch.full((S + 1,), -1, device=dev, dtype=torch.int32)
    slot_experts = slot_experts.scatter(0, where, experts)[:S].clone()
    used = slot_experts >= 0
    slot_offsets = torch.where(used, offsets[slot_experts.clamp(min=0).long()], torch.full_like(slot_experts, P))
    touched = present.sum(dtype=torch.int32)
    if topk_weights is None:
        topk_weights = torch.ones(T, top_k, device=dev, dtype=torch.float32)
    return MoeRouting(topk_weights=topk_weights.float().contiguous(), topk_ids=topk_ids.to(torch.int32).contiguous(),
                      expert_ids=expert_ids.contiguous(), token_ids=token_ids, pair_rows=pair_rows,
                      row_ids=rows, offsets=offsets, slot_experts=slot_experts,
                      slot_offsets=slot_offsets.to(torch.int32), touched=touched, T=T, top_k=top_k, E=E,
                      checked=checked)


def _check_pairs(topk_weights, topk_ids, token_ids, row_ids):
    T, top_k = topk_ids.shape
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32 or topk_weights.shape != (T, top_k):
        raise ValueError(f"topk_weights, topk_ids: expected float32 and int32 [T, top_k], got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}, {topk_ids.dtype} {tuple(topk_ids.shape)}")
    for name, t in (("token_ids", token_ids), ("row_ids", row_ids)):
        if t.dtype != torch.int32 or t.shape != (T * top_k,):
            raise ValueError(f"{name}: expected int32 [{T * top_k}], got {t.dtype} {tuple(t.shape)}")


def pair_order(topk_weights: torch.Tensor, topk_ids: torch.Tensor, token_ids: torch.Tensor, row_ids: torch.Tensor,
               E: int, checked: bool = False, blocks: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> MoeRouting:
    """A :class:`MoeRouting` whose rows are the pairs in router order (no sort, no launch, no group tables).

    ``token_ids`` (``p // top_k``) and ``row_ids`` (``arange(P)``) come with the weights and ids from
    :func:`kbit.ops.moe_router.route_pairs`, which writes them in the same launch; ``row_ids`` also serves
    as ``pair_rows`` (the identity). ``blocks``: the block table ``route_pairs`` wrote with them (one token)."""
    _check_pairs(topk_weights, topk_ids, token_ids, row_ids)
    T, top_k = topk_ids.shape
    return MoeRouting(topk_weights=topk_weights, topk_ids=topk_ids, expert_ids=topk_ids.view(-1),
                      token_ids=token_ids, pair_rows=row_ids, row_ids=row_ids, offsets=None, slot_experts=None,
                      slot_offsets=None, touched=None, T=T, top_k=top_k, E=E, sorted=False, checked=checked,
                      blocks=blocks)


_SORT_BLOCK = 64


def sort_pairs(topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_ids: torch.Tensor, E: int,
               checked: bool = False) -> MoeRouting:
    """The pairs sorted by expert (stable, the order of :func:`align`) in one Triton launch, without group
    tables: ``expert_ids``, ``token_ids`` and ``pair_rows`` equal :func:`align`'s.

    ``row_ids``: int32 ``arange(P)`` (from :func:`kbit.ops.moe_router.route_pairs`). Cost O(P^2 / 64)
    compares per program of 64 pairs: meant for the P of decode (up to a few thousand)."""
    T, top_k = topk_ids.shape
    P = T * top_k
    _check_pairs(topk_weights, topk_ids, row_ids, row_ids)
    expert_ids = torch.empty(P, dtype=torch.int32, device=topk_ids.device)
    token_ids = torch.empty_like(expert_ids)
    pair_rows = torch.empty_like(expert_ids)
    if P:
        sort_pairs_kernel[(-(-P // _SORT_BLOCK),)](topk_ids, expert_ids, token_ids, pair_rows, P, TOP_K=top_k,
                                                   BLOCK=_SORT_BLOCK, num_warps=4)
    return MoeRouting(topk_weights=topk_weights, topk_ids=topk_ids, expert_ids=expert_ids, token_ids=token_ids,
                      pair_rows=pair_rows, row_ids=row_ids, offsets=None, slot_experts=None, slot_offsets=None,
                      touched=None, T=T, top_k=top_k, E=E, sorted=True, checked=checked)


def align_reference(topk_ids: torch.Tensor, E: int) -> dict[str, torch.Tensor]:
    """The fields of :func:`align` from Python loops (CPU int32 tensors), keyed by field name."""
    ids = topk_ids.cpu().tolist()
    T = len(ids)
    top_k = len(ids[0]) if T else topk_ids.shape[1]
    pairs = [(ids[t][s], t * top_k + s) for t in range(T) for s in range(top_k)]
    pairs.sort()  # by expert, then by pair index: a stable sort of the flat ids
    P = len(pairs)
    expert_ids = [e for e, _ in pairs]
    token_ids = [p // top_k for _, p in pairs]
    pair_rows = [0] * P
    for r, (_, p) in enumerate(pairs):
        pair_rows[p] = r
    offsets = [bisect.bisect_right(expert_ids, e) for e in range(E)]
    touched = sorted(set(expert_ids))
    S = num_slots(T, top_k, E)
    slot_experts = touched + [-1] * (S - len(touched))
    slot_offsets = [offsets[e] if e >= 0 else P for e in slot_experts]
    i32 = torch.int32
    return {"expert_ids": torch.tensor(expert_ids, dtype=i32), "token_ids": torch.tensor(token_ids, dtype=i32),
            "pair_rows": torch.tensor(pair_rows, dtype=i32), "offsets": torch.tensor(offsets, dtype=i32),
            "slot_experts": torch.tensor(slot_experts, dtype=i32),
            "slot_offsets": torch.tensor(slot_offsets, dtype=i32), "touched": torch.tensor(len(touched), dtype=i32)}
