"""Index safety of the ops that take ids (grouped GEMV / GEMM, the MoE steps, the combine, sampling).

A bad id must never make a kernel read or write out of bounds, and must never pass silently. Checking ids on
the host would sync (and break CUDA-graph capture), so on CUDA the ops check them on the device:

- the kernel that reads an id treats an out-of-range one as 0 (it stays in bounds) and writes NaN where the
  result depended on it (a grouped op's row; see each op's docstring);
- it ORs a bit into a small int32 **error flag** of the device (:func:`error_flag`), read lazily by
  :func:`check_errors` (a host sync: call it where the caller syncs anyway, e.g. after a generate loop or a
  test step), which raises ``ValueError`` and clears the flag.

Where ids are on the CPU (host values are free: the Triton interpreter, the torch references) and in debug mode
(:func:`debug_ids`, eager only: it syncs), the ops check the ids on the host before the launch and raise
``ValueError`` naming the argument, the expected range and the first bad value.

Grouped kernels whose CUDA source does not check ids read them through :func:`guard` (one small Triton launch:
clamped copies of the ids, a row mask and the flag) and :func:`poison` (the masked rows set to NaN), except
where the ids are in range by construction: a routing made by kbit's router (``kbit.dispatch.moe.route``, whose
kernel picks distinct ids in range even from NaN scores) is marked ``MoeRouting.checked`` and its grouped GEMMs run
without either launch (``guard(..., checked=True)``), so the id check costs an MoE step made by ``KbitMoE``
nothing. Ids from elsewhere (``align`` of a caller's ``topk_ids``, a direct ``grouped_linear``) are checked.

A helper module of kbit.ops: it imports no op.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from kbit.kernels.moe import ids_guard_kernel, poison_rows_kernel

__all__ = ["ERR_EXPERTS", "ERR_LOGITS", "ERR_PAIR_ROWS", "ERR_ROWS", "check_bounds", "check_errors", "check_ids",
           "debug_ids", "debug_mode", "error_flag", "guard", "host_checks", "poison", "poison_tokens"]

#: bits of the error flag: a token / row id, an expert id, a combine's pair row, a sampled row without a
#: finite logit
ERR_ROWS, ERR_EXPERTS, ERR_PAIR_ROWS, ERR_LOGITS = 1, 2, 4, 8
_MESSAGES = {
    ERR_ROWS: "token_ids / rows: expected ids in [0, T) (T rows of x), got an out-of-range id (its row is NaN)",
    ERR_EXPERTS: "expert_ids: expected ids in [0, E) (E experts of the stack), got an out-of-range id (its row "
                 "is NaN)",
    ERR_PAIR_ROWS: "pair_rows: expected rows in [0, P) (P = T * top_k), got an out-of-range row (its token's "
                   "output is NaN)",
    ERR_LOGITS: "logits: expected a finite or +inf logit in every row, got a row of NaN / -inf only (sampled as "
                "token -1, logprob NaN)",
}

_FLAGS: dict[torch.device, torch.Tensor] = {}
_DEBUG = [False]


def error_flag(device) -> torch.Tensor:
    """The int32 ``[1]`` error flag of ``device`` (zero while no op saw a bad id since the last
    :func:`check_errors`). Made on the first use: run one eager step before capturing a CUDA graph."""
    flag = _FLAGS.get(device)  # a tensor's device: the hot path, one lookup
    if flag is not None:
        return flag
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    flag = _FLAGS.get(dev)
    if flag is None:
        flag = _FLAGS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return flag


def check_errors(device=None) -> None:
    """Raise ``ValueError`` if an op on ``device`` (default: every device used) saw bad ids or logits since the
    last call, naming what was wrong; clears the flag. A host sync."""
    flags = [error_flag(device)] if device is not None else list({id(f): f for f in _FLAGS.values()}.values())
    code = 0
    for flag in flags:
        code |= int(flag.item())
        flag.zero_()
    if code:
        raise ValueError("; ".join(msg for bit, msg in _MESSAGES.items() if code & bit))


@contextlib.contextmanager
def debug_ids(on: bool = True):
    """Within the block, ops check ids (and sampled logits) on the host before each launch and raise at once
    (``ValueError`` naming the argument, range and value): a sync an op, so eager only, not while capturing."""
    old = _DEBUG[0]
    _DEBUG[0] = on
    try:
        yield
    finally:
        _DEBUG[0] = old


def debug_mode() -> bool:
    """Whether :func:`debug_ids` is on."""
    return _DEBUG[0]


def host_checks(t: torch.Tensor) -> bool:
    """Whether ids on ``t``'s device are checked on the host: on the CPU, or in :func:`debug_ids` mode."""
    return t.device.type != "cuda" or _DEBUG[0]


def check_ids(name: str, ids: torch.Tensor, n: int, what: str) -> None:
    """Host check: every value of ``ids`` in ``[0, n)`` (``what`` says what n counts), else ``ValueError``."""
    if ids.numel() == 0:
        return
    v = ids.detach().reshape(-1).to("cpu", torch.int64)
    bad = (v < 0) | (v >= n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}: expected ids in [0, {n}) ({what}), got {int(v[i])} at position {i}")


def check_bounds(P: int, T: int, E: int) -> None:
    """A grouped op with ``P > 0`` rows needs ``T >= 1`` rows of x and ``E >= 1`` experts (an id out of range
    reads row / expert 0 instead): from shapes, so free."""
    if P and T < 1:
        raise ValueError(f"x: expected at least one row for {P} token_ids, got 0")
    if P and E < 1:
        raise ValueError(f"codes: expected at least one expert for {P} expert_ids, got 0")


def guard(rows: torch.Tensor, T: int, expert_ids: torch.Tensor, E: int, rows_name: str = "token_ids",
          rows_what: str = "rows of x", checked: bool = False):
    """(rows, expert_ids, bad): on the host path (:func:`host_checks`) the ids checked (``ValueError``) and
    returned as they are, ``bad`` None; on CUDA one launch: copies with out-of-range ids clamped into range
    (ids sorted by expert stay sorted), an int8 mask ``bad [P]`` of the rows with either id out of range, and the
    flag set (:func:`check_errors`). ``T``, ``E`` at least 1. ``rows_name``, ``rows_what``: the host error's words.
    ``checked``: the ids are in range by construction (kbit's router made them): on CUDA returned as they are,
    no launch (the MoE decode step's hot path)."""
    check_bounds(rows.shape[0], T, E)
    if host_checks(rows):
        check_ids(rows_name, rows, T, rows_what)
        check_ids("expert_ids", expert_ids, E, "experts of the stack")
        return rows, expert_ids, None
    if checked:
        return rows, expert_ids, None
    P = rows.shape[0]
    rows_c, eids_c = torch.empty_like(rows), torch.empty_like(expert_ids)
    bad = torch.empty(P, dtype=torch.int8, device=rows.device)
    if P:
        block = 1024
        ids_guard_kernel[(-(-P // block),)](rows.contiguous(), expert_ids.contiguous(), rows_c, eids_c, bad,
                                            error_flag(rows.device), P, T, E, BLOCK=block, num_warps=4)
    return rows_c, eids_c, bad


def poison(y: torch.Tensor, bad: torch.Tensor | None, blocks=None, n_max: int = 0) -> torch.Tensor:
    """``y[bad] = NaN`` in place (rows of a :func:`guard` mask; nothing for None), one launch; returns y. With
    ``blocks`` (a ``kbit.ops.moe_blocks.block_table``), the rows of the blocks past ``n_max`` too (the grouped
    kernel 7 takes at most ``n_max``; a table built from bad ids can hold more)."""
    if bad is None or not y.numel():
        return y
    P, N = y.shape
    if y.stride(1) != 1:  # a strided view (not from kbit's ops): the same in torch ops
        mask = bad.view(torch.bool)
        if blocks is not None:
            lim = torch.where(blocks[1] > n_max, blocks[0][min(n_max, P):min(n_max, P) + 1], P)
            mask = mask | (torch.arange(P, device=y.device) >= lim)
        return y.masked_fill_(mask[:, None], float("nan"))
    blk, nblk = blocks if blocks is not None else (bad, bad)
    poison_rows_kernel[(P,)](y, y.stride(0), N, bad, blk, nblk, n_max, P, DROP=blocks is not None,
                             BLOCK=min(1024, triton.next_power_of_2(N)), num_warps=4)
    return y


def poison_tokens(out: torch.Tensor, bad: torch.Tensor | None, pair_rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out[t] = NaN`` in place for each token ``t`` with a pair whose row (``pair_rows[t * top_k + s]``) a
    :func:`guard` mask marks (nothing for None); returns out."""
    if bad is not None and out.numel():
        tok_bad = bad.view(torch.bool)[pair_rows.long()].view(-1, top_k).any(1)
        out.masked_fill_(tok_bad[:, None], float("nan"))
    return out
