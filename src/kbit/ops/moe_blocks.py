"""Block tables of the grouped (MoE) tensor-core kernels, built on the device without a host sync.

A **block table** cuts every run of equal expert ids of a step's rows into blocks of at most ``bm`` rows from
the run's start: ``blk[b]`` is the first row of block ``b``, ``blk[nblk] = P`` (:func:`block_table`, one CUDA
launch; :func:`block_table_torch` in torch ops on any device; :func:`block_table_reference` in Python). The
grouped kernels (``kbit.ops.grouped_mma``) run over its blocks and read ``nblk`` on the device.

A **tail split** (:func:`tail_split`) reorders the rows of a sorted step so that each expert's short last block
(at most ``TAIL_ROWS`` rows) leaves the grouped kernel 7 for kernel 4: two block tables, main and tail.

A helper module of the grouped kernels: it imports no op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kbit.cuda import compile_kernel
from kbit.ops._ids import guard
from kbit.ops.mma.common import kernels_available
from kbit.tuning.moe import TAIL_ROWS

# isort: split
# --- shared pieces of the dense swap-AB launcher (kbit.ops.gemv_mma, owned by the dense path): remap at merge ---

# --- end of the gemv_mma block ---

__all__ = ["TailSplit", "block_table", "block_table_reference", "block_table_torch", "max_blocks", "tail_split",
           "tail_split_reference"]

#: defines every build of the block-table kernels takes (they read no weights; the source needs the values)
_DEFINES = dict(K_BITS=4, BF16=0, FP16_SCALES=0)


def block_table_reference(expert_ids, bm: int) -> list[int]:
    """Python: the block starts of :func:`block_table` followed by ``P`` (``len - 1`` blocks)."""
    e = [int(v) for v in (expert_ids.tolist() if isinstance(expert_ids, torch.Tensor) else expert_ids)]
    starts, run = [], 0
    for r in range(len(e)):
        if r == 0 or e[r] != e[r - 1]:
            run = r
        if (r - run) % bm == 0:
            starts.append(r)
    return starts + [len(e)]


def _check_ids(expert_ids, bm):
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dtype != torch.int32 or expert_ids.dim() != 1:
        got = (expert_ids.dtype, tuple(expert_ids.shape)) if isinstance(expert_ids, torch.Tensor) else type(expert_ids)
        raise ValueError(f"expert_ids: expected an int32 1-D tensor, got {got}")
    if not (isinstance(bm, int) and bm >= 1):
        raise ValueError(f"bm: expected a positive int, got {bm!r}")


def block_table_torch(expert_ids: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``blk`` int32 ``[P + 1]``, ``nblk`` int32 ``[1]``) with torch ops (no host sync): ``blk[:nblk]`` the
    block starts, ``blk[nblk] = P``, entries after it ``P`` too."""
    _check_ids(expert_ids, bm)
    P = expert_ids.shape[0]
    dev = expert_ids.device
    r = torch.arange(P, device=dev, dtype=torch.int64)
    boundary = torch.ones(P, dtype=torch.bool, device=dev)
    if P > 1:
        boundary[1:] = expert_ids[1:] != expert_ids[:-1]
    run = torch.cummax(torch.where(boundary, r, torch.zeros_like(r)), 0).values if P else r
    start = (r - run) % bm == 0
    pos = torch.cumsum(start, 0) - 1
    blk = torch.full((P + 1,), P, dtype=torch.int32, device=dev)
    blk.scatter_(0, torch.where(start, pos, torch.full_like(pos, P)), r.to(torch.int32))
    blk[P] = P  # start-less rows scattered their index onto slot P: restore it
    return blk, start.sum(dtype=torch.int32).reshape(1)


def block_table(expert_ids: torch.Tensor, bm: int, offsets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table of :func:`block_table_torch`, one CUDA launch where the kernel is available, else
    :func:`block_table_torch`. Entries past ``blk[nblk]`` are unspecified. ``offsets``: the int32 ``[E]`` group
    ends of rows sorted by expert (``MoeRouting.offsets``); given, the table is made a group at a time
    (``kbit_moe_blocks_off``, work ~E) instead of a row at a time (``kbit_moe_blocks``, work ~P)."""
    _check_ids(expert_ids, bm)
    if offsets is not None and (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32
                                or offsets.dim() != 1 or offsets.device != expert_ids.device):
        got = (offsets.dtype, tuple(offsets.shape), offsets.device) if isinstance(offsets, torch.Tensor) \
            else type(offsets)
        raise ValueError(f"offsets: expected an int32 1-D tensor on {expert_ids.device}, got {got}")
    if not kernels_available(expert_ids.device):
        return block_table_torch(expert_ids, bm)
    P = expert_ids.shape[0]
    blk = torch.empty(P + 1, dtype=torch.int32, device=expert_ids.device)
    nblk = torch.empty(1, dtype=torch.int32, device=expert_ids.device)
    defines = _DEFINES
    if offsets is not None and offsets.shape[0] > 0:
        kern = compile_kernel("moe_blocks.cu", "kbit_moe_blocks_off", defines, expert_ids.device)
        off = offsets.contiguous()
        kern((1,), 1024, "QiiiQQ", off.data_ptr(), off.shape[0], P, bm, blk.data_ptr(), nblk.data_ptr())
        return blk, nblk
    kern = compile_kernel("moe_blocks.cu", "kbit_moe_blocks", defines, expert_ids.device)
    ids = expert_ids.contiguous()
    kern((1,), 1024, "QiiQQ", ids.data_ptr(), P, bm, blk.data_ptr(), nblk.data_ptr())
    return blk, nblk


# ------------------------------------------------------------------------------------------------ tail split


class TailSplit(NamedTuple):
    """Rows of a sorted MoE step reordered into a main part (each expert's rows but a short last block; the
    grouped kernel 7's blocks of ``bt`` rows) and a tail part (those last blocks; one kernel-4 block each): see
    :func:`tail_split`. All on the device; sizes depend on ``P`` and ``E`` only."""

    #: int32 ``[P]``: expert / token of each new row; the combine's row of each pair
    expert_ids: torch.Tensor
    token_ids: torch.Tensor
    pair_rows: torch.Tensor
    #: int32 ``[P]``: a tail row's row in a buffer of the step's last ``R`` rows (0 for main rows)
    tail_rows: torch.Tensor
    #: the block tables (``blk``, ``nblk``) of the main part (``bt`` rows a block) and of the tail part
    main_blocks: tuple
    tail_blocks: tuple
    #: rows of the tail buffer: the tail part lies in the last ``R = min(P, TAIL_ROWS * E)`` rows
    R: int


def tail_split_reference(expert_ids, offsets, pair_rows, top_k: int, bt: int, tail: int = TAIL_ROWS):
    """Python definition of :func:`tail_split` (host lists): (expert_ids, token_ids, pair_rows, tail_rows,
    main block starts + [P_main], tail block starts + [P])."""
    eid, off, pr = expert_ids.tolist(), offsets.tolist(), pair_rows.tolist()
    E, P = len(off), len(eid)
    starts = [0] + off[:-1]
    cnt = [off[e] - starts[e] for e in range(E)]
    t = [c % bt if 0 < c % bt <= tail else 0 for c in cnt]
    m = [c - tt for c, tt in zip(cnt, t, strict=True)]
    p_main = sum(m)
    base_m = [sum(m[:e]) for e in range(E)]
    base_t = [p_main + sum(t[:e]) for e in range(E)]
    R = min(P, tail * E)
    n_of = [0] * P
    for i in range(P):
        e = eid[i]
        j = i - starts[e]
        n_of[i] = base_m[e] + j if j < m[e] else base_t[e] + j - m[e]
    eid2, tok2, rows_t = [0] * P, [0] * P, [0] * P
    for p in range(P):
        n = n_of[pr[p]]
        eid2[n], tok2[n] = eid[pr[p]], p // top_k
        rows_t[n] = max(0, n - (P - R))
    pr2 = [n_of[pr[p]] for p in range(P)]
    blk_m = [base_m[e] + i * bt for e in range(E) for i in range(-(-m[e] // bt))] + [p_main]
    blk_t = [base_t[e] for e in range(E) if t[e]] + [P]
    return eid2, tok2, pr2, rows_t, blk_m, blk_t


def tail_split(routing, bt: int, tail: int = TAIL_ROWS) -> TailSplit:
    """The step's rows (``kbit.ops.moe_align.MoeRouting`` from ``align``: sorted, with group ends) reordered so
    that each expert's last block, when it has ``1..tail`` rows, leaves the grouped kernel 7 (whose cost a block
    is that of a full block: the weight tile's lookups) for kernel 4. Two CUDA launches (``kbit_moe_split``,
    ``kbit_moe_split_rows``), no host sync; :func:`tail_split_reference` is the definition."""
    if not routing.sorted or routing.offsets is None:
        raise ValueError("routing: expected rows sorted by expert with group ends (kbit.ops.moe_align.align)")
    if not 1 <= tail <= 32 or bt < tail:
        raise ValueError(f"tail: expected 1..32 and at most bt={bt}, got {tail}")
    dev = routing.expert_ids.device
    P, E = routing.expert_ids.shape[0], routing.offsets.shape[0]
    R = min(P, tail * E)
    i32 = dict(dtype=torch.int32, device=dev)
    blk_m, blk_t = torch.empty(P + 1, **i32), torch.empty(P + 1, **i32)
    nblk = torch.empty(2, **i32)
    per_e = torch.empty(3, E, **i32)  # base_m, base_t, m_cnt
    out = torch.empty(4, P, **i32)  # expert_ids, token_ids, pair_rows, tail_rows
    defines = _DEFINES
    off = routing.offsets.contiguous()
    # kbit_moe_split_rows indexes by pair row and by expert: both clamped into range (the flag set if not)
    pair_rows, expert_ids, _ = guard(routing.pair_rows, P, routing.expert_ids, E, "pair_rows", "rows of the step")
    compile_kernel("moe_blocks.cu", "kbit_moe_split", defines, dev)(
        (1,), 1024, "QiiiiQQQQQQQ", off.data_ptr(), E, P, bt, tail, blk_m.data_ptr(), nblk[0:].data_ptr(),
        blk_t.data_ptr(), nblk[1:].data_ptr(), per_e[0].data_ptr(), per_e[1].data_ptr(), per_e[2].data_ptr())
    compile_kernel("moe_blocks.cu", "kbit_moe_split_rows", defines, dev)(
        (-(-P // 256),), 256, "QQQQQQiiiQQQQ", pair_rows.contiguous().data_ptr(),
        expert_ids.contiguous().data_ptr(), off.data_ptr(), per_e[0].data_ptr(), per_e[1].data_ptr(),
        per_e[2].data_ptr(), P, routing.top_k, R, out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr(),
        out[3].data_ptr(), pdl=False)
    return TailSplit(out[0], out[1], out[2], out[3], (blk_m, nblk[0:1]), (blk_t, nblk[1:2]), R)


def max_blocks(P: int, E: int, bt: int) -> int:
    """At most this many blocks in a block table of ``P`` rows sorted by expert (one run an expert) cut into at
    most ``bt`` rows: the size of the grouped kernel 7's x tiles."""
    return min(P, P // bt + min(E, P))
