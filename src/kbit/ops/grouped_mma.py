"""Grouped (MoE) small-M linear on k-bit expert stacks with tensor cores: ``y[r] = x[rows[r]] @ W[expert_ids[r]].T``.

The grouped form of ``kbit.ops.gemv_mma`` (swap-AB ``mma.sync.m16n8k16``, layout "mma-v1"): each expert of a
stack ``[E, N, K]`` is repacked with ``kbit.ops.gemv_mma.repack`` (:func:`repack_stack`; inverse
:func:`unrepack_stack`). :func:`grouped_linear` takes canonical stacks and caches their repacked copy
(:func:`repacked_stack`); :func:`grouped_linear_repacked` takes a stack held in layout "mma-v1" only (what
``kbit.nn.KbitMoE`` holds after ``repack_for_kernels``). Rows come grouped by expert (``kbit.ops.moe_align``:
sorted rows from ``sort_pairs`` / ``align``; any order is correct, but only adjacent rows of one expert share a
weight read).

Work: a **block table** built on the device (:func:`block_table`, one CUDA launch, no host sync) cuts every run
of equal expert ids into blocks of at most ``BM = 8 * NG`` rows from the run's start; ``blk[b]`` is the first
row of block ``b``, ``blk[nblk] = P``. The GEMM (``kbit_grouped_mma``) runs persistent CTAs over the items
(row tile of 16 weight rows, block) with the block fastest, reads ``nblk`` on the device (CTAs past it exit),
and gathers its activations ``x[rows[r]]`` (gate_up: token ids; down: ``arange(P)``). fp32 accumulation, no
split K across CTAs (a graph replay equals eager bit for bit).

Where the CUDA kernel is not available (no GPU / NVRTC, Triton interpreter) :func:`grouped_linear` falls back to
``kbit.ops.gemv.grouped_gemv``. :func:`block_table_torch` (torch ops, any device) and
:func:`block_table_reference` (Python) define the table for the CPU tests.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kbit.ops.gemv_mma import (
    _etab,
    _prep_x,
    _sms,
    _table_smem,
    _x_tiles_groups,
    _x_tiles_kernel,
    available,
    cache_get,
    cache_put,
    repack,
    unrepack,
)

__all__ = ["available", "block_table", "block_table_reference", "block_table_torch", "choose_ng", "copy_repacked",
           "grouped_linear", "grouped_linear_repacked", "repack_stack", "repacked_stack", "unrepack_stack"]


# ------------------------------------------------------------------------------------------------ repack


def repack_stack(codes: torch.Tensor, scales: torch.Tensor, *, k: int, blocksize: int, scale_format: str, N: int,
                 K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical stack ``(codes [E, N, words], scales [E, N, nb])`` -> ``(codes [E, Nt, S, k, 32, 4],
    scales [E, Nt, S, 8, 16 (x2 for fp16 bytes)])``: expert ``e`` is ``kbit.ops.gemv_mma.repack`` of its matrix.

    With ``N % 16 == 0`` (tiles never straddle two experts) the stack is repacked as one ``[E * N, K]`` matrix.
    """
    if codes.dim() != 3 or scales.dim() != 3 or codes.shape[:2] != scales.shape[:2] or codes.shape[1] != N:
        raise ValueError(f"codes, scales: expected stacks [E, {N}, ...], got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    E = codes.shape[0]
    kw = dict(k=k, blocksize=blocksize, scale_format=scale_format, K=K)
    if N % 16 == 0:
        rc, rs = repack(codes.reshape(E * N, -1), scales.reshape(E * N, -1), N=E * N, **kw)
        return rc.view(E, N // 16, *rc.shape[1:]), rs.view(E, N // 16, *rs.shape[1:])
    parts = [repack(codes[e], scales[e], N=N, **kw) for e in range(E)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def unrepack_stack(rcodes: torch.Tensor, rscales: torch.Tensor, *, k: int, blocksize: int, N: int,
                   K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_stack` (bit-exact, new tensors): canonical ``(codes [E, N, words], scales [E, N,
    nb])``."""
    E = rcodes.shape[0]
    if E == 0:
        Kp = -(-K // blocksize) * blocksize
        return (torch.empty(0, N, Kp * k // 32, dtype=torch.int32, device=rcodes.device),
                torch.empty(0, N, Kp // blocksize, dtype=rscales.dtype, device=rscales.device))
    if N % 16 == 0:
        c, s = unrepack(rcodes.reshape(E * rcodes.shape[1], *rcodes.shape[2:]),
                        rscales.reshape(E * rscales.shape[1], *rscales.shape[2:]), k=k, blocksize=blocksize,
                        N=E * N, K=K)
        return c.view(E, N, -1), s.view(E, N, -1)
    parts = [unrepack(rcodes[e], rscales[e], k=k, blocksize=blocksize, N=N, K=K) for e in range(E)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


_CACHE: dict = {}


def repacked_stack(codes, scales, *, k, blocksize, scale_format, N, K):
    """:func:`repack_stack`, cached per ``codes`` tensor (object and version, held weakly) and ``scales``
    version: a KbitMoE's stacks are repacked once, on the first call (run one eager step before capturing)."""
    val = cache_get(_CACHE, codes, scales)
    if val is None:
        val = cache_put(_CACHE, codes, scales,
                        repack_stack(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K))
    return val


def copy_repacked(src_codes, src_scales, dst_codes, dst_scales) -> bool:
    """Seed the cache of a copy (``dst``, equal tensors) with clones of ``src``'s repacked stack, if cached
    (benchmarks build many weight copies; repacking each costs ~0.1 s). Returns whether it did."""
    val = cache_get(_CACHE, src_codes, src_scales)
    if val is None:
        return False
    cache_put(_CACHE, dst_codes, dst_scales, tuple(t.clone() for t in val))
    return True


# ------------------------------------------------------------------------------------------------ block table


def choose_ng(P: int, E: int, device=None, sorted_rows: bool = False) -> int:
    """8-row groups per block (``BM = 8 NG``) for ``P`` rows on ``E`` experts: the expected rows per touched
    expert ``P / min(E, P)`` rounded up to 8, 16 or 32 (NG = 8 compiles with ~150 bytes of register spills
    (sm_90, k = 4): more rows are more blocks of 32, whose tile reads coincide in L2). With ``sorted_rows``
    (each expert's rows adjacent) and the grouped kernel 7 serving the step on ``device``
    (:func:`large_config`): its 64-, 128- or 256-row blocks."""
    if sorted_rows and device is not None:
        bt = _large_rows(P, E, device)
        if bt:
            return bt // 8
    rpe = P / max(1, min(E, P))
    if _kernel(8) == 4:  # kernel 4 holds 64-row blocks without spills
        return 1 if rpe <= 8 else 2 if rpe <= 16 else 4 if rpe <= 32 else 8
    return 1 if rpe <= 8 else 2 if rpe <= 16 else 4


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
    if not available(expert_ids.device):
        return block_table_torch(expert_ids, bm)
    from kbit.cuda import compile_kernel

    P = expert_ids.shape[0]
    blk = torch.empty(P + 1, dtype=torch.int32, device=expert_ids.device)
    nblk = torch.empty(1, dtype=torch.int32, device=expert_ids.device)
    defines = dict(K_BITS=4, BF16=0, FP16_SCALES=0)
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

#: an expert's last block goes to the tail kernel (kernel 4, 32-row blocks) when it has at most this many rows
TAIL_ROWS = 32


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
    from kbit.cuda import compile_kernel

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
    defines = dict(K_BITS=4, BF16=0, FP16_SCALES=0)
    off = routing.offsets.contiguous()
    compile_kernel("moe_blocks.cu", "kbit_moe_split", defines, dev)(
        (1,), 1024, "QiiiiQQQQQQQ", off.data_ptr(), E, P, bt, tail, blk_m.data_ptr(), nblk[0:].data_ptr(),
        blk_t.data_ptr(), nblk[1:].data_ptr(), per_e[0].data_ptr(), per_e[1].data_ptr(), per_e[2].data_ptr())
    compile_kernel("moe_blocks.cu", "kbit_moe_split_rows", defines, dev)(
        (-(-P // 256),), 256, "QQQQQQiiiQQQQ", routing.pair_rows.contiguous().data_ptr(),
        routing.expert_ids.contiguous().data_ptr(), off.data_ptr(), per_e[0].data_ptr(), per_e[1].data_ptr(),
        per_e[2].data_ptr(), P, routing.top_k, R, out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr(),
        out[3].data_ptr(), pdl=False)
    return TailSplit(out[0], out[1], out[2], out[3], (blk_m, nblk[0:1]), (blk_t, nblk[1:2]), R)


# ------------------------------------------------------------------------------------------------ kernel 7

#: the grouped kernel 7 (sm_90 wgmma, ``GRP`` of ``kbit.cuda.gemv_mma_src``) from this many rows per touched
#: expert (a first guess from the dense kernel 7, which beat kernel 4 from M ~ 64; to be measured)
LARGE_MIN_ROWS = 48


def large_config(rpe: float):
    """The grouped kernel 7 config (``kbit.ops.gemv_mma.large_config``'s tuple) for ``rpe`` rows per touched
    expert: 64-, 128- or 256-row blocks (H100, k = 4, ``benchmarks/results/h100/moe7-s11-*.log``: 64 won at
    20 rows an expert, 128 at 64-80, 256 at 256 on Mixtral and tied on Qwen3-30B). ``KBIT_GROUPED_LARGE_CFG``
    overrides (lab)."""
    if os.environ.get("KBIT_GROUPED_LARGE_CFG"):
        return tuple(int(v) for v in os.environ["KBIT_GROUPED_LARGE_CFG"].split(","))
    if rpe < 48:
        return (7, 16, 8, 4, 8, 1, 1)
    if rpe < 192:
        return (7, 12, 16, 4, 8, 1, 1)
    return (7, 8, 32, 4, 8, 1, 1)


def _large_rows(P: int, E: int, device) -> int:
    """Rows a block of the grouped kernel 7 if it serves ``P`` rows on ``E`` experts on ``device``, else 0."""
    from kbit.ops.gemv_mma import large_ok

    dev = torch.device(device)
    if dev.type != "cuda" or os.environ.get("KBIT_GROUPED_LARGE", "1") == "0" or not available(dev):
        return 0
    rpe = P / max(1, min(E, P))
    if rpe < LARGE_MIN_ROWS or not large_ok(dev):
        return 0
    return 8 * large_config(rpe)[2]


def max_blocks(P: int, E: int, bt: int) -> int:
    """At most this many blocks in a block table of ``P`` rows sorted by expert (one run an expert) cut into at
    most ``bt`` rows: the size of the grouped kernel 7's x tiles."""
    return min(P, P // bt + min(E, P))


#: SiLU tiles from 16-byte loads of gate and up where rows and I allow it (else 4-byte loads); lab switch
SILU_TILES_VEC = os.environ.get("KBIT_SILU_TILES_VEC", "1") != "0"


def _x_tiles_grouped(xp, rows, blk, nblk, n_max, bt, S, silu=False):
    """x rows gathered per block of a block table into kernel 7's bulk-copy tiles: ``[n_max, S * 4, bt, 64]``,
    block ``b`` holding rows ``x[rows[blk[b] + r]]``; tile rows past the block's end and blocks from ``nblk``
    on are not written (``kbit_x_tiles_g``): kernel 7 stores no output row for them, and each output row
    depends on its own x row only. ``silu``: xp is a gate_up product ``[P, 2I]`` (stride 1 in columns, even
    row stride) and the tiles hold ``silu(xp[:, :I]) * xp[:, I:]`` (``kbit.ops.moe.silu_mul``), computed while
    tiling (``kbit_x_tiles_silu_g``): the down projection's x without a separate SwiGLU pass."""
    n_ch = S * 4
    xt = torch.empty(n_max * n_ch * bt * 64, dtype=xp.dtype, device=xp.device)
    grid = (n_max, _x_tiles_groups(n_ch, bt))
    ptrs = (xp.data_ptr(), xt.data_ptr(), rows.data_ptr(), blk.data_ptr(), nblk.data_ptr())
    if silu:
        kern = _x_tiles_kernel("kbit_x_tiles_silu_g", xp.device)
        I = xp.shape[1] // 2
        vec = int(SILU_TILES_VEC and I % 8 == 0 and xp.stride(0) % 8 == 0 and xp.data_ptr() % 16 == 0)
        kern(grid, 256, "QQQQQiiiiii", *ptrs, xp.stride(0), I, int(xp.dtype == torch.bfloat16), n_ch, bt, vec,
             pdl=True)
    else:
        kern = _x_tiles_kernel("kbit_x_tiles_g", xp.device)
        kern(grid, 256, "QQQQQiii", *ptrs, xp.stride(0), n_ch, bt, pdl=True)
    return xt


def _x_tiles_grouped_reference(xp, rows, blk, nblk, n_max, bt, S):
    """The definition of :func:`_x_tiles_grouped` in torch (host loop; what it leaves unwritten is zero here)."""
    from kbit.ops.gemv_mma import _x_tiles

    n_ch = S * 4
    out = torch.zeros(n_max, n_ch * bt * 64, dtype=xp.dtype, device=xp.device)
    b_list = blk.tolist()
    for b in range(min(int(nblk.item()), n_max)):
        r = rows[b_list[b]:b_list[b + 1]].long()
        out[b] = _x_tiles(xp.index_select(0, r), bt, S)[: n_ch * bt * 64] if r.numel() else 0
    return out.reshape(-1)


_LPLANS: dict = {}


def _large_run(xp, rows, expert_ids, rc, rs, tensor_scale, codebook, y, *, k, scale_format, N, blocks, silu=False):
    """One grouped kernel 7 launch (and its x gather) over the blocks of ``blocks`` (built for the config's
    rows a block, or fewer). ``silu``: xp is a gate_up product ``[P, 2K]``, x = SiLU(gate) * up, made while
    gathering."""
    from kbit.cuda import compile_kernel
    from kbit.ops.gemv_mma import large_defines

    P = rows.shape[0]
    E, Nt, S = rc.shape[0], rc.shape[1], rc.shape[2]
    dev = xp.device
    cfg = large_config(P / max(1, min(E, P)))
    bf16 = xp.dtype == torch.bfloat16
    key = (k, cfg, scale_format, bf16, dev)
    p = _LPLANS.get(key)
    if p is None:
        defines, shared = large_defines(k, cfg, grouped=True)
        defines.update(BF16=int(bf16), FP16_SCALES=int(scale_format == "fp16"))
        kern = compile_kernel("wgmma.cu", "kbit_wgmma", defines, dev)
        p = _LPLANS[key] = (kern, defines, shared, kern.occupancy(cfg[1] * 32, shared))
    kern, defines, shared, occ = p
    W, bt = defines["MAXW"], 8 * defines["NG"]
    blk, nblk = blocks
    n_max = max_blocks(P, E, bt)  # the kernel clamps nblk to it
    xt = _x_tiles_grouped(xp, rows.contiguous(), blk, nblk, n_max, bt, S, silu=silu)
    grid = max(1, min(_sms(dev) * occ, -(-Nt // W) * n_max))
    ts_c, cb_c = tensor_scale.contiguous(), codebook.contiguous()
    kern((grid,), W * 32, "QQQQQQQQQQiiiiiiiiiiQQQ", rc.data_ptr(), rs.data_ptr(), ts_c.data_ptr(),
         cb_c.data_ptr(), _etab(dev).data_ptr(), xt.data_ptr(), y.data_ptr(), 0, y.data_ptr(), y.data_ptr(),
         n_max, N, S * 4, y.stride(0), S, Nt, 1, S, 0, 0, blk.data_ptr(), nblk.data_ptr(),
         expert_ids.contiguous().data_ptr(), shared=shared, pdl=True)
    return y


# ------------------------------------------------------------------------------------------------ launcher

MAX_WARPS = 8
_PLANS: dict = {}


def _kernel(ng: int, S: int | None = None) -> int:
    """Which grouped kernel serves blocks of ``8 ng`` rows: 4 = ``kbit_grouped_mma4`` (kernel 5 of the dense
    source ``kbit.cuda.gemv_mma_src``: x rows, codes and scales of each segment through a cp.async shared-memory
    pipeline that runs on across items, block scales folded into the A fragments), 1 = ``kbit_grouped_mma``
    (``kbit.cuda.grouped_mma_src``: register double buffer, x from L1/L2). ``KBIT_GROUPED_KERNEL`` overrides."""
    v = os.environ.get("KBIT_GROUPED_KERNEL")
    if v:
        return int(v)
    return 4 if ng >= GROUPED4_MIN_NG or (S is not None and S <= GROUPED4_MAX_SEG_NG1) else 1


#: kernel 4 from this many 8-row groups a block (see :func:`_kernel`)
GROUPED4_MIN_NG = 2
#: ... and for single-group blocks (T = 1..4 decode steps) on short K (at most this many 256-column segments):
#: H100, benchmarks/results/h100/moe-lab-2026-11-21-run2-decode.log, k = 4: Qwen3-30B down (K = 768) 1 token
#: 16.4 -> 12.4 us, Qwen3-Next down (K = 512) 19.3 -> 13.6 us; gate_up (K = 2048, 8 segments) 18.0 vs 19.1 us
#: stays on kernel 1
GROUPED4_MAX_SEG_NG1 = 4


def _plan4(k, ng, scale_format, bf16, dev):
    from kbit.cuda import compile_kernel

    key = (4, k, ng, scale_format, bf16, dev, os.environ.get("KBIT_GROUPED4_W"))
    p = _PLANS.get(key)
    if p is None:
        # 1-row blocks (decode): 4 warps, more CTAs (H100 moe lab run 3: Qwen3-30B down 1 token 12.4 -> 11.8 us)
        W = int(os.environ.get("KBIT_GROUPED4_W", 0)) or (16 if ng == 8 else 4 if ng == 1 else 8)
        sv = 2 if scale_format == "fp16" else 1
        stage = 8 * ng * 576 + W * (k * 512 + sv * 128)
        D = 2
        defines = dict(KERNEL=5, K_BITS=k, NG=ng, D=D, MAXW=W, MINB=1, RT=1, BF16=int(bf16),
                       FP16_SCALES=int(scale_format == "fp16"))
        kern = compile_kernel("mma_pipe.cu", "kbit_grouped_mma_pipe", defines, dev)
        shared = D * stage + _table_smem(k)
        occ = kern.occupancy(W * 32, shared)
        p = _PLANS[key] = (kern, W, shared, occ, defines)
    return p


def _plan(k, ng, S, scale_format, bf16, dev):
    """(kernel, warps, dynamic shared bytes, CTAs an SM) for one define set."""
    from kbit.cuda import compile_kernel

    if _kernel(ng, S) == 4:
        return _plan4(k, ng, scale_format, bf16, dev)
    key = (k, ng, S, scale_format, bf16, dev)
    p = _PLANS.get(key)
    if p is None:
        W = max(1, min(MAX_WARPS, S))
        minb = max(1, (512 if ng <= 2 else 256) // (32 * W))
        defines = dict(K_BITS=k, NG=ng, MAXW=W, MINB=minb, BF16=int(bf16), FP16_SCALES=int(scale_format == "fp16"))
        kern = compile_kernel("grouped_mma.cu", "kbit_grouped_mma", defines, dev)
        shared = _table_smem(k) + W * ng * 128 * 4
        occ = kern.occupancy(W * 32, shared)
        p = _PLANS[key] = (kern, W, shared, occ, defines)
    return p


def grouped_linear(x, rows, expert_ids, codes, scales, tensor_scale, codebook, *, k, blocksize=32,
                   scale_format="log8", N, K, blocks=None, ng=None,
                  sorted_rows=False):
    """``y[r] = x[rows[r]] @ W[expert_ids[r]].T`` for a k-bit stack ``W [E, N, K]``: ``[P, N]`` in x's dtype.

    x: fp16/bf16 ``[T, K]``; rows, expert_ids: int32 ``[P]`` on x's device (ids valid, not checked: that would
    sync); codes ``[E, N, words]``, scales ``[E, N, nb]``, tensor_scale float32 ``[E]``, codebook ``[2**k]``
    (``kbit.ops.gemv.grouped_gemv``'s arguments). ``blocks``: a :func:`block_table` of expert_ids for
    ``8 * ng`` rows (pass one table to both GEMMs of an MoE step); ``ng``: default :func:`choose_ng`.
    ``sorted_rows``: the caller guarantees that each expert's rows are adjacent (one run an expert, as from
    ``kbit.ops.moe_align``); on sm_90 that allows the grouped wgmma kernel 7 (:func:`large_config`) when the
    rows an expert are many. Unsorted rows with ``sorted_rows=True`` give wrong results.
    """
    from kbit.ops.gemv import _check_grouped, _fail, grouped_gemv

    E = _check_grouped(x, "rows", rows, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize,
                       scale_format, N, K)
    P = rows.shape[0]
    if ng is not None and ng not in (1, 2, 4, 8):
        _fail(ValueError, "ng", "one of 1, 2, 4, 8", ng)
    if not available(x.device):
        return grouped_gemv(x, rows, expert_ids, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                            scale_format=scale_format, N=N, K=K)
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    ng = ng or choose_ng(P, E, x.device, sorted_rows)
    if blocks is None:
        blocks = block_table(expert_ids.contiguous(), 8 * ng)
    rc, rs = repacked_stack(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)
    return _grouped_run(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, k=k, scale_format=scale_format, N=N,
                        ng=ng, blocks=blocks, sorted_rows=sorted_rows)


def grouped_linear_repacked(x, rows, expert_ids, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32,
                            scale_format="log8", N, K, blocks=None, ng=None,
                           sorted_rows=False, act=None):
    """:func:`grouped_linear` on a stack held in layout "mma-v1" (``rcodes, rscales`` from :func:`repack_stack`):
    no cache, nothing kept. Where the CUDA kernel is unavailable: an unrepacked temporary of the stack and
    ``kbit.ops.gemv.grouped_gemv``. ``act="silu"``: x is a gate_up product ``[T, 2K]`` (gate columns first) and
    the input is ``silu(x[:, :K]) * x[:, K:]`` (``kbit.ops.moe.silu_mul``); the grouped kernel 7 computes it
    while gathering its x tiles, other paths run silu_mul first."""
    from kbit.ops.gemv import _check_grouped, _fail, grouped_gemv
    from kbit.ops.gemv_mma import _check_repacked

    if act not in (None, "silu"):
        _fail(ValueError, "act", "None or 'silu'", act)
    if act == "silu":
        if x.dim() != 2 or x.shape[1] != 2 * K:
            _fail(ValueError, "x", f"a gate_up product [T, {2 * K}] (act='silu')", tuple(x.shape))
    E = rcodes.shape[0] if rcodes.dim() == 6 else -1
    _check_repacked(x[:, :K] if act else x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K,
                    None, (E,))
    if act == "silu" and not (available(x.device) and sorted_rows and rows.shape[0] and
                              _fused_silu_ok(x, rows.shape[0], E, ng)):
        from kbit.ops.moe import silu_mul

        x, act = silu_mul(x), None
    if not available(x.device):
        codes, scales = unrepack_stack(rcodes, rscales, k=k, blocksize=blocksize, N=N, K=K)
        _check_grouped(x, "rows", rows, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize,
                       scale_format, N, K)
        return grouped_gemv(x, rows, expert_ids, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                            scale_format=scale_format, N=N, K=K)
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        _fail(ValueError, "x", "fp16/bf16 [T, K]", (x.dtype, tuple(x.shape)))
    if rows.dtype != torch.int32 or expert_ids.dtype != torch.int32 or rows.dim() != 1 or \
            expert_ids.shape != rows.shape:
        _fail(ValueError, "rows, expert_ids", "int32 [P] each", (rows.dtype, tuple(rows.shape), expert_ids.dtype,
                                                                tuple(expert_ids.shape)))
    if ng is not None and ng not in (1, 2, 4, 8):
        _fail(ValueError, "ng", "one of 1, 2, 4, 8", ng)
    P = rows.shape[0]
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    ng = ng or choose_ng(P, E, x.device, sorted_rows)
    if blocks is None:
        blocks = block_table(expert_ids.contiguous(), 8 * ng)
    return _grouped_run(x, rows, expert_ids, rcodes, rscales, tensor_scale, codebook, y, k=k,
                        scale_format=scale_format, N=N, ng=ng, blocks=blocks, sorted_rows=sorted_rows,
                        silu=act == "silu")


def _fused_silu_ok(x, P, E, ng) -> bool:
    """Whether the grouped kernel 7 serves these rows (``ng`` as the caller's, default :func:`choose_ng`) and can
    read the gate_up product x directly (columns contiguous, even row stride)."""
    rows_a_block = _large_rows(P, E, x.device)
    return bool(rows_a_block) and (ng is None or 8 * ng == rows_a_block) and x.stride(1) == 1 and \
        x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0


def _grouped_run(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, *, k, scale_format, N, ng, blocks,
                 sorted_rows=False, silu=False):
    from kbit.ops.gemv import _fail

    P = rows.shape[0]
    blk, nblk = blocks
    if blk.shape != (P + 1,) or nblk.shape != (1,) or blk.dtype != torch.int32 or nblk.dtype != torch.int32:
        _fail(ValueError, "blocks", f"(int32 [{P + 1}], int32 [1]) from block_table", (blk.shape, nblk.shape))
    Nt, S = rc.shape[1], rc.shape[2]
    dev = x.device
    if silu:  # grouped_linear_repacked checked that kernel 7 serves these rows
        return _large_run(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, k=k, scale_format=scale_format,
                          N=N, blocks=blocks, silu=True)
    xp = _prep_x(x, S)
    if sorted_rows and ng * 8 == _large_rows(P, rc.shape[0], dev):
        return _large_run(xp, rows, expert_ids, rc, rs, tensor_scale, codebook, y, k=k, scale_format=scale_format,
                          N=N, blocks=blocks)
    kern, W, shared, occ, defines = _plan(k, ng, S, scale_format, x.dtype == torch.bfloat16, dev)
    if defines.get("KERNEL") == 5:  # items: row blocks of W tiles x expert blocks (at most P blocks)
        grid = max(1, min(_sms(dev) * occ, -(-Nt // W) * P))
    else:
        grid = max(1, min(_sms(dev) * occ, Nt * P))
    rows_c, ids_c = rows.contiguous(), expert_ids.contiguous()
    ts_c, cb_c = tensor_scale.contiguous(), codebook.contiguous()
    kern((grid,), W * 32, "QQQQQQQQQQQiiiii", rc.data_ptr(), rs.data_ptr(), ts_c.data_ptr(), cb_c.data_ptr(),
         _etab(dev).data_ptr(), xp.data_ptr(), rows_c.data_ptr(), ids_c.data_ptr(), blk.data_ptr(),
         nblk.data_ptr(), y.data_ptr(), N, xp.stride(0), y.stride(0), S, Nt, shared=shared,
         pdl=defines.get("KERNEL") == 5)
    return y
