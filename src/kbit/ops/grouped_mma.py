"""Grouped (MoE) small-M linear on k-bit expert stacks with tensor cores: ``y[r] = x[rows[r]] @ W[expert_ids[r]].T``.

The grouped form of the dense swap-AB kernels (``mma.sync.m16n8k16``, layout "mma-v1"): each expert of a stack
``[E, N, K]`` is repacked as the dense launcher repacks a matrix (:func:`repack_stack`; inverse
:func:`unrepack_stack`). :func:`grouped_linear` takes canonical stacks and caches their repacked copy
(:func:`repacked_stack`); :func:`grouped_linear_repacked` takes a stack held in layout "mma-v1" (what
``kbit.nn.KbitMoE`` holds after ``repack_for_kernels``). Rows come grouped by expert (``kbit.ops.moe_align``:
sorted rows from ``sort_pairs`` / ``align``; any order is correct, but only adjacent rows of one expert share a
weight read).

Work: a block table (``kbit.ops.moe_blocks.block_table``) cuts every run of equal expert ids into blocks of at
most ``8 * ng`` rows; the kernels run persistent CTAs over the items (row tile of 16 weight rows, block) with the
block fastest, read the block count on the device (CTAs past it exit) and gather their activations ``x[rows[r]]``
(gate_up: token ids; down: ``arange(P)``). fp32 accumulation, no split K across CTAs (a graph replay equals eager
bit for bit). Which kernel and config: ``kbit.tuning.moe`` (a ``config`` argument pins one).

These are CUDA launchers only: on a device where the NVRTC kernels do not run they raise; ``kbit.dispatch.moe``
chooses the grouped GEMV there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kbit.cuda import compile_kernel
from kbit.format.spec import check_blocksize, check_k, check_scale_format, padded_k
from kbit.ops._common import e_table
from kbit.ops._ids import guard, poison
from kbit.ops.mma.common import check_repacked, kernels_available, prep_x, x_tiles, x_tiles_groups
from kbit.ops.mma.layout import SEG, repack_stack
from kbit.ops.moe_blocks import block_table, max_blocks
from kbit.tuning.mma import LargeConfig, large_ok
from kbit.tuning.mma_plan import large_defines, table_smem
from kbit.tuning.moe import (
    WGMMA_MIN_ROWS,
    GroupedMmaConfig,
    WgmmaGroupedConfig,
    block_groups,
    grouped_mma_config,
    rows_per_expert,
    wgmma_config,
)
from kbit.utils.cache import TensorCache
from kbit.utils.checks import check_tensor, fail
from kbit.utils.device import sm_count


def _wgmma_defines(k: int, cfg: WgmmaGroupedConfig) -> tuple[dict, int]:
    """(defines, dynamic shared bytes) of the grouped kernel 7: the dense kernel 7's, in its grouped form."""
    return large_defines(k, LargeConfig(warps=cfg.warps, groups=cfg.groups, stages=cfg.stages, raster=cfg.raster,
                                        x_swizzle=bool(cfg.x_swizzle), x_bulk=cfg.x_bulk), grouped=True)


__all__ = ["GroupedLaunch", "KernelBuild", "choose_ng", "clear_caches", "copy_repacked", "run_blocks",
           "fused_silu_ok", "grouped_linear", "grouped_linear_repacked", "grouped_mma_build", "large_rows",
           "repacked_stack", "wgmma_build"]

GroupedConfig = GroupedMmaConfig | WgmmaGroupedConfig


# ------------------------------------------------------------------------------------------------ repack



#: repacked copies of canonical stacks, per (codes, scales) tensor object and version
_CACHE = TensorCache(max_entries=None)  # one copy per live canonical stack


def repacked_stack(codes, scales, *, k, blocksize, scale_format, N, K):
    """:func:`repack_stack`, cached per ``codes`` and ``scales`` tensor (object and version, held weakly): a
    KbitMoE's stacks are repacked once, on the first call (run one eager step before capturing)."""
    val = _CACHE.get((codes, scales))
    if val is None:
        val = _CACHE.put((codes, scales), None,
                         repack_stack(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K))
    return val


def copy_repacked(src_codes, src_scales, dst_codes, dst_scales) -> bool:
    """Seed the cache of a copy (``dst``, equal tensors) with clones of ``src``'s repacked stack, if cached
    (benchmarks build many weight copies; repacking each costs ~0.1 s). Returns whether it did."""
    val = _CACHE.get((src_codes, src_scales))
    if val is None:
        return False
    _CACHE.put((dst_codes, dst_scales), None, tuple(t.clone() for t in val))
    return True


# ------------------------------------------------------------------------------------------------ choices


def large_rows(P: int, E: int, device) -> int:
    """Rows a block of the grouped kernel 7 if it serves ``P`` rows sorted by expert on ``E`` experts on
    ``device`` (sm_90, at least ``WGMMA_MIN_ROWS`` rows per touched expert), else 0."""
    dev = torch.device(device)
    if dev.type != "cuda" or not kernels_available(dev):
        return 0
    rpe = rows_per_expert(P, E)
    if rpe < WGMMA_MIN_ROWS or not large_ok(dev):
        return 0
    return 8 * wgmma_config(rpe).groups


def choose_ng(P: int, E: int, device=None, sorted_rows: bool = False) -> int:
    """8-row groups per block for ``P`` rows on ``E`` experts: with ``sorted_rows`` (each expert's rows
    adjacent) and the grouped kernel 7 serving the step on ``device`` (:func:`large_rows`) its 64-, 128- or
    256-row blocks, else ``kbit.tuning.moe.block_groups``."""
    if sorted_rows and device is not None:
        bt = large_rows(P, E, device)
        if bt:
            return bt // 8
    return block_groups(rows_per_expert(P, E))


def fused_silu_ok(x: torch.Tensor, P: int, E: int, ng: int | None = None,
                  config: GroupedConfig | None = None) -> bool:
    """Whether the grouped kernel 7 serves these rows (pinned by ``config``, else at ``ng`` as the caller's,
    default :func:`choose_ng`) and can read the gate_up product x directly (columns contiguous, even row
    stride): then ``grouped_linear_repacked(act="silu")`` computes SiLU(gate) * up while gathering x."""
    if config is not None:
        ok = isinstance(config, WgmmaGroupedConfig)
    else:
        rows_a_block = large_rows(P, E, x.device)
        ok = bool(rows_a_block) and (ng is None or 8 * ng == rows_a_block)
    return ok and x.stride(1) == 1 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0


# ------------------------------------------------------------------------------------------------ builds


@dataclass(frozen=True)
class KernelBuild:
    """What to compile for one grouped GEMM config, and how to launch it."""

    #: source file and ``extern "C"`` name (``kbit.cuda.compile_kernel``)
    file: str
    name: str
    #: compile-time defines
    defines: dict
    #: threads a CTA / 32
    warps: int
    #: dynamic shared bytes
    shared: int


def grouped_mma_build(k: int, cfg: GroupedMmaConfig, scale_format: str, bf16: bool) -> KernelBuild:
    """The build of kernel 1 or 4 (``cfg``) for ``k``-bit weights with ``scale_format`` scales, bf16 or fp16 x."""
    fp16_scales = int(scale_format == "fp16")
    W, ng = cfg.warps, cfg.groups
    if cfg.kernel == 4:
        stage = 8 * ng * 576 + W * (k * 512 + (2 if fp16_scales else 1) * 128)  # x rows, codes, scales a stage
        defines = dict(K_BITS=k, NG=ng, D=cfg.stages, MAXW=W, MINB=1, RT=1, BF16=int(bf16),
                       FP16_SCALES=fp16_scales)
        shared = cfg.stages * stage + table_smem(k)
        return KernelBuild("grouped_mma_pipe.cu", "kbit_grouped_mma_pipe", defines, W, shared)
    defines = dict(K_BITS=k, NG=ng, MAXW=W, MINB=cfg.min_blocks, BF16=int(bf16), FP16_SCALES=fp16_scales)
    return KernelBuild("grouped_mma.cu", "kbit_grouped_mma", defines, W, table_smem(k) + W * ng * 128 * 4)


def wgmma_build(k: int, cfg: WgmmaGroupedConfig, scale_format: str, bf16: bool) -> KernelBuild:
    """The build of the grouped kernel 7 (``cfg``)."""
    defines, shared = _wgmma_defines(k, cfg)
    defines.update(BF16=int(bf16), FP16_SCALES=int(scale_format == "fp16"))
    return KernelBuild("wgmma.cu", "kbit_wgmma", defines, cfg.warps, shared)


@dataclass(frozen=True)
class GroupedLaunch:
    """A compiled grouped GEMM kernel and its launch geometry."""

    #: the compiled kernel (``kbit.cuda`` kernel object)
    kernel: object
    build: KernelBuild
    #: resident CTAs an SM at ``build.warps`` warps and ``build.shared`` bytes
    occupancy: int


_LAUNCHES: dict = {}
_X_TILES: dict = {}


def _launch_for(k: int, cfg: GroupedConfig, scale_format: str, bf16: bool, device) -> GroupedLaunch:
    """The compiled launch of ``cfg``, once a process (compile_kernel hashes the source on every call)."""
    key = (k, cfg, scale_format, bf16, device)
    p = _LAUNCHES.get(key)
    if p is None:
        build = (wgmma_build if isinstance(cfg, WgmmaGroupedConfig) else grouped_mma_build)(k, cfg, scale_format,
                                                                                            bf16)
        kern = compile_kernel(build.file, build.name, build.defines, device)
        occ = kern.occupancy(build.warps * 32, build.shared)
        if occ < 1:
            raise ValueError(f"config: {cfg} needs {build.shared} bytes of dynamic shared memory beside "
                             f"{kern.shared_bytes} static, more than a CTA may use on this GPU")
        p = _LAUNCHES[key] = GroupedLaunch(kern, build, occ)
    return p


def _x_tiles_kernel(name: str, device):
    kern = _X_TILES.get((name, device))
    if kern is None:
        kern = _X_TILES[(name, device)] = compile_kernel("x_tiles.cu", name, {}, device)
    return kern


def clear_caches() -> None:
    """Forget the repacked stacks and the compiled launches (tests; a changed ``kbit.options``)."""
    _CACHE.clear()
    _LAUNCHES.clear()
    _X_TILES.clear()


# ------------------------------------------------------------------------------------------------ kernel 7


def _x_tiles_grouped(xp, rows, blk, nblk, n_max, bt, S, silu=False):
    """x rows gathered per block of a block table into kernel 7's bulk-copy tiles: ``[n_max, S * 4, bt, 64]``,
    block ``b`` holding rows ``x[rows[blk[b] + r]]``; tile rows past the block's end and blocks from ``nblk``
    on are not written (``kbit_x_tiles_g``): kernel 7 stores no output row for them, and each output row
    depends on its own x row only. ``silu``: xp is a gate_up product ``[P, 2I]`` (stride 1 in columns, even
    row stride) and the tiles hold ``silu(xp[:, :I]) * xp[:, I:]`` (``kbit.ops.moe.silu_mul_gate_up``), computed
    while tiling (``kbit_x_tiles_silu_g``, 16-byte loads of gate and up where rows and I allow it): the down
    projection's x without a separate SwiGLU pass."""
    n_ch = S * 4
    xt = torch.empty(n_max * n_ch * bt * 64, dtype=xp.dtype, device=xp.device)
    grid = (n_max, x_tiles_groups(n_ch, bt))
    ptrs = (xp.data_ptr(), xt.data_ptr(), rows.data_ptr(), blk.data_ptr(), nblk.data_ptr())
    if silu:
        kern = _x_tiles_kernel("kbit_x_tiles_silu_g", xp.device)
        I = xp.shape[1] // 2
        vec = int(I % 8 == 0 and xp.stride(0) % 8 == 0 and xp.data_ptr() % 16 == 0)
        kern(grid, 256, "QQQQQiiiiii", *ptrs, xp.stride(0), I, int(xp.dtype == torch.bfloat16), n_ch, bt, vec,
             pdl=True)
    else:
        kern = _x_tiles_kernel("kbit_x_tiles_g", xp.device)
        kern(grid, 256, "QQQQQiii", *ptrs, xp.stride(0), n_ch, bt, pdl=True)
    return xt


def _x_tiles_grouped_reference(xp, rows, blk, nblk, n_max, bt, S):
    """The definition of :func:`_x_tiles_grouped` in torch (host loop; what it leaves unwritten is zero here)."""
    n_ch = S * 4
    out = torch.zeros(n_max, n_ch * bt * 64, dtype=xp.dtype, device=xp.device)
    b_list = blk.tolist()
    for b in range(min(int(nblk.item()), n_max)):
        r = rows[b_list[b]:b_list[b + 1]].long()
        out[b] = x_tiles(xp.index_select(0, r), bt, S)[: n_ch * bt * 64] if r.numel() else 0
    return out.reshape(-1)


def _large_run(xp, rows, expert_ids, rc, rs, tensor_scale, codebook, y, *, k, scale_format, N, blocks,
               cfg: WgmmaGroupedConfig, silu=False):
    """One grouped kernel 7 launch (and its x gather) over the blocks of ``blocks`` (built for ``cfg``'s rows a
    block, or fewer). ``silu``: xp is a gate_up product ``[P, 2K]``, x = SiLU(gate) * up, made while
    gathering."""
    P = rows.shape[0]
    E, Nt, S = rc.shape[0], rc.shape[1], rc.shape[2]
    dev = xp.device
    p = _launch_for(k, cfg, scale_format, xp.dtype == torch.bfloat16, dev)
    W, bt = p.build.defines["MAXW"], 8 * p.build.defines["NG"]
    blk, nblk = blocks
    n_max = max_blocks(P, E, bt)  # the kernel clamps nblk to it
    xt = _x_tiles_grouped(xp, rows.contiguous(), blk, nblk, n_max, bt, S, silu=silu)
    grid = max(1, min(sm_count(dev) * p.occupancy, -(-Nt // W) * n_max))
    ts_c, cb_c = tensor_scale.contiguous(), codebook.contiguous()
    p.kernel((grid,), W * 32, "QQQQQQQQQQiiiiiiiiiiiQQQ", rc.data_ptr(), rs.data_ptr(), ts_c.data_ptr(),
             cb_c.data_ptr(), e_table(dev).data_ptr(), xt.data_ptr(), y.data_ptr(), 0, y.data_ptr(), y.data_ptr(),
             n_max, N, S * 4, y.stride(0), S, Nt, 1, S, 0, 0, S * SEG, blk.data_ptr(), nblk.data_ptr(),
             expert_ids.contiguous().data_ptr(), shared=p.build.shared, pdl=True)
    return y


# ------------------------------------------------------------------------------------------------ launcher


def _check_ng(ng, config):
    if ng is not None and ng not in (1, 2, 4, 8):
        fail(ValueError, "ng", "one of 1, 2, 4, 8", ng)
    if config is not None and not isinstance(config, (GroupedMmaConfig, WgmmaGroupedConfig)):
        fail(TypeError, "config", "a GroupedMmaConfig or WgmmaGroupedConfig (kbit.tuning.moe)", type(config).__name__)


def _check_device(x):
    if not kernels_available(x.device):
        fail(ValueError, "x", "a tensor on a CUDA device where the NVRTC kernels run (kbit.dispatch.moe falls back "
             "to the grouped GEMV elsewhere)", x.device)


def _check_grouped(x, rows, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N,
                   K) -> int:
    """Validate a canonical grouped call (``y[r] = x[rows[r]] @ W[expert_ids[r]].T``); returns E."""
    check_k(k)
    check_blocksize(blocksize)
    check_scale_format(scale_format)
    for name, v in (("N", N), ("K", K)):
        if not (isinstance(v, int) and v >= 1):
            fail(ValueError, name, "a positive int", v)
    check_tensor("x", x, (torch.float16, torch.bfloat16))
    if x.dim() != 2 or x.shape[1] != K:
        fail(ValueError, "x", f"shape [T, {K}]", tuple(x.shape))
    if codes.dim() != 3:
        fail(ValueError, "codes", "a 3-D stack [E, N, words]", tuple(codes.shape))
    E, Kp = codes.shape[0], padded_k(K, blocksize)
    check_tensor("codes", codes, torch.int32, (E, N, Kp * k // 32), x.device, contiguous=True)
    check_tensor("scales", scales, torch.uint8 if scale_format == "log8" else torch.float16, (E, N, Kp // blocksize),
                 x.device, contiguous=True)
    check_tensor("tensor_scale", tensor_scale, torch.float32, (E,), x.device)
    check_tensor("codebook", codebook, torch.float32, (2**k,), x.device)
    check_tensor("rows", rows, torch.int32, None, x.device)
    check_tensor("expert_ids", expert_ids, torch.int32, None, x.device)
    if rows.dim() != 1 or expert_ids.shape != rows.shape:
        fail(ValueError, "expert_ids", f"shape of rows {tuple(rows.shape)} (1-D)", tuple(expert_ids.shape))
    return E


def grouped_linear(x, rows, expert_ids, codes, scales, tensor_scale, codebook, *, k, blocksize=32,
                   scale_format="log8", N, K, blocks=None, ng=None, sorted_rows=False,
                   config: GroupedConfig | None = None, checked: bool = False):
    """``y[r] = x[rows[r]] @ W[expert_ids[r]].T`` for a k-bit stack ``W [E, N, K]``: ``[P, N]`` in x's dtype.

    x: fp16/bf16 ``[T, K]`` on a device where the CUDA kernels run (``kernels_available``); rows, expert_ids: int32
    ``[P]`` on x's device, ``0 <= rows < T``, ``0 <= expert_ids < E`` (checked on the device, no sync: a row with
    an id out of range is NaN and sets the error flag, ``kbit.ops._ids``; ``ValueError`` in ``debug_ids`` mode);
    codes ``[E, N, words]``, scales
    ``[E, N, nb]``, tensor_scale float32 ``[E]``, codebook ``[2**k]`` (the grouped GEMV's arguments).
    ``blocks``: a ``kbit.ops.moe_blocks.block_table`` of expert_ids for ``8 * ng`` rows (pass one table to both
    GEMMs of an MoE step); ``ng``: default :func:`choose_ng`. ``sorted_rows``: the caller guarantees that each
    expert's rows are adjacent (one run an expert, as from ``kbit.ops.moe_align``); on sm_90 that allows the
    grouped wgmma kernel 7 when the rows an expert are many. Unsorted rows with ``sorted_rows=True`` give wrong
    results. ``config``: pin the kernel and its blocks (tests, labs; kernel 7 needs sorted rows). ``checked``:
    the caller guarantees the ids in range (a ``MoeRouting.checked`` routing): no device check (no launch).
    """
    E = _check_grouped(x, rows, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K)
    _check_ng(ng, config)
    _check_device(x)
    y = torch.empty(rows.shape[0], N, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return y
    # ids checked before the block table is built: clamped ids (monotone, so sorted rows stay sorted) add no runs
    rows, expert_ids, bad = guard(rows, x.shape[0], expert_ids, E, checked=checked)
    ng, blocks = _blocks(expert_ids, E, ng, blocks, sorted_rows, config)
    rc, rs = repacked_stack(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)
    return _run_blocks(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, bad, k=k, scale_format=scale_format,
                       N=N, ng=ng, blocks=blocks, sorted_rows=sorted_rows, config=config)


def grouped_linear_repacked(x, rows, expert_ids, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32,
                            scale_format="log8", N, K, blocks=None, ng=None, sorted_rows=False, act=None,
                            config: GroupedConfig | None = None, checked: bool = False):
    """:func:`grouped_linear` on a stack held in layout "mma-v1" (``rcodes, rscales`` from :func:`repack_stack`):
    no cache, nothing kept. ``act="silu"``: x is a gate_up product ``[T, 2K]`` (gate columns first) and the
    input is ``silu(x[:, :K]) * x[:, K:]``, computed by the grouped kernel 7 while it gathers its x tiles: only
    where :func:`fused_silu_ok` (the caller runs ``kbit.ops.moe.silu_mul_gate_up`` first elsewhere)."""
    if act not in (None, "silu"):
        fail(ValueError, "act", "None or 'silu'", act)
    if act == "silu" and (x.dim() != 2 or x.shape[1] != 2 * K):
        fail(ValueError, "x", f"a gate_up product [T, {2 * K}] (act='silu')", tuple(x.shape))
    E = rcodes.shape[0] if rcodes.dim() == 6 else -1
    check_repacked(x[:, :K] if act else x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K,
                    None, (E,))
    _check_ng(ng, config)
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        fail(ValueError, "x", "fp16/bf16 [T, K]", (x.dtype, tuple(x.shape)))
    if rows.dtype != torch.int32 or expert_ids.dtype != torch.int32 or rows.dim() != 1 or \
            expert_ids.shape != rows.shape:
        fail(ValueError, "rows, expert_ids", "int32 [P] each", (rows.dtype, tuple(rows.shape), expert_ids.dtype,
                                                               tuple(expert_ids.shape)))
    _check_device(x)
    P = rows.shape[0]
    if act == "silu" and not (sorted_rows and P and fused_silu_ok(x, P, E, ng, config)):
        fail(ValueError, "act", "None where the grouped kernel 7 cannot fuse the SiLU (fused_silu_ok)", act)
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    # before the block table (grouped_linear)
    rows, expert_ids, bad = guard(rows, x.shape[0], expert_ids, E, checked=checked)
    ng, blocks = _blocks(expert_ids, E, ng, blocks, sorted_rows, config)
    return _run_blocks(x, rows, expert_ids, rcodes, rscales, tensor_scale, codebook, y, bad, k=k,
                       scale_format=scale_format, N=N, ng=ng, blocks=blocks, sorted_rows=sorted_rows, config=config,
                       silu=act == "silu")


def run_blocks(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, *, k, scale_format, N, ng, blocks,
               sorted_rows=False, silu=False, config: GroupedConfig | None = None, checked: bool = False):
    """One grouped GEMM into ``y`` over the blocks of a given block table (``blocks``, for ``8 ng`` rows a block)
    on a repacked stack, arguments as checked by :func:`grouped_linear_repacked`: the launch an MoE step with a
    tail split makes twice (``kbit.dispatch.moe``). ``silu`` needs the grouped kernel 7. Ids out of range: as
    :func:`grouped_linear` (one more small launch before the kernel, one after: ``kbit.ops._ids.guard``); a table
    built from bad ids can hold more blocks than kernel 7 takes (``max_blocks``): the rows of the blocks it drops
    are NaN too. ``checked``: as :func:`grouped_linear`'s."""
    # the CUDA kernels read ids unchecked: clamped copies (an out-of-range id reads row / expert 0), NaN rows after
    rows, expert_ids, bad = guard(rows, x.shape[0], expert_ids, rc.shape[0], checked=checked)
    return _run_blocks(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, bad, k=k, scale_format=scale_format,
                       N=N, ng=ng, blocks=blocks, sorted_rows=sorted_rows, silu=silu, config=config)


def _run_blocks(x, rows, expert_ids, rc, rs, tensor_scale, codebook, y, bad, *, k, scale_format, N, ng, blocks,
                sorted_rows=False, silu=False, config: GroupedConfig | None = None):
    """:func:`run_blocks` on checked ids (``bad``: their ``guard`` mask, poisoned after)."""
    P = rows.shape[0]
    blk, nblk = blocks
    if blk.shape != (P + 1,) or nblk.shape != (1,) or blk.dtype != torch.int32 or nblk.dtype != torch.int32:
        fail(ValueError, "blocks", f"(int32 [{P + 1}], int32 [1]) from block_table", (blk.shape, nblk.shape))
    Nt, S = rc.shape[1], rc.shape[2]
    dev = x.device
    if config is None:
        if silu or (sorted_rows and ng * 8 == large_rows(P, rc.shape[0], dev)):
            config = wgmma_config(rows_per_expert(P, rc.shape[0]))
        else:
            config = grouped_mma_config(ng, S)
    if isinstance(config, WgmmaGroupedConfig):
        xp = x if silu else prep_x(x, S)
        _large_run(xp, rows, expert_ids, rc, rs, tensor_scale, codebook, y, k=k, scale_format=scale_format, N=N,
                   blocks=blocks, cfg=config, silu=silu)
        # the rows of the blocks kernel 7 drops (a table from bad ids) NaN too, in the same launch
        return poison(y, bad, blocks, max_blocks(P, rc.shape[0], 8 * config.groups))
    xp = prep_x(x, S)
    p = _launch_for(k, config, scale_format, x.dtype == torch.bfloat16, dev)
    W = p.build.warps
    pipelined = config.kernel == 4
    if pipelined:  # items: row blocks of W tiles x expert blocks (at most P blocks)
        grid = max(1, min(sm_count(dev) * p.occupancy, -(-Nt // W) * P))
    else:
        grid = max(1, min(sm_count(dev) * p.occupancy, Nt * P))
    rows_c, ids_c = rows.contiguous(), expert_ids.contiguous()
    ts_c, cb_c = tensor_scale.contiguous(), codebook.contiguous()
    p.kernel((grid,), W * 32, "QQQQQQQQQQQiiiii", rc.data_ptr(), rs.data_ptr(), ts_c.data_ptr(), cb_c.data_ptr(),
             e_table(dev).data_ptr(), xp.data_ptr(), rows_c.data_ptr(), ids_c.data_ptr(), blk.data_ptr(),
             nblk.data_ptr(), y.data_ptr(), N, xp.stride(0), y.stride(0), S, Nt, shared=p.build.shared,
             pdl=True)
    return poison(y, bad)


def _blocks(expert_ids, E, ng, blocks, sorted_rows, config):
    """(8-row groups a block: ``config``'s, else ``ng``, else :func:`choose_ng`; the block table, built for them
    unless given)."""
    if config is not None:
        ng = config.groups
    ng = ng or choose_ng(expert_ids.shape[0], E, expert_ids.device, sorted_rows)
    if blocks is None:
        blocks = block_table(expert_ids.contiguous(), 8 * ng)
    return ng, blocks
