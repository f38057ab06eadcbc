"""The launch plan of the swap-AB kernels: a config (:mod:`kbit.tuning.mma`) -> ``#define`` options, dynamic shared
bytes, grid, K splits and workspace size.

Pure arithmetic on the shape, the SM count and the built kernel's occupancy: :func:`make_plan` receives a ``build``
callback (``kbit.ops.gemv_mma`` passes NVRTC's ``compile_kernel``), so this module imports no kernel runtime and
tests can run it with a fake build.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kbit.tuning.mma import BIG, PIPE, SEG, LargeConfig, MmaConfig, default_config, n_groups
from kbit.tuning.mma_units import CAU_K2_RING, cau_plan, lfx_defines, read_us

__all__ = ["KERNELS", "SMEM_MAX", "WS4_PARTS", "XS_MAX", "MmaPlan", "check_config", "large_defines", "make_plan",
           "prologue_config", "table_smem", "x_staged"]

#: kernel number -> (source file, ``extern "C"`` name) in ``kbit.cuda``
KERNELS = {1: ("gemv_mma_split.cu", "kbit_gemv_mma_split"), 3: ("gemv_mma_streamk.cu", "kbit_gemv_mma_streamk"),
           4: ("mma_pipe.cu", "kbit_mma_pipe"), 7: ("wgmma.cu", "kbit_wgmma")}
#: dynamic shared memory a CTA may use on sm_90
SMEM_MAX = 227 * 1024
#: kernel 3 with x staged in shared memory: dynamic shared bytes at most where a config asks for 2 or more CTAs an
#: SM (one CTA an SM may stage up to SMEM_MAX)
XS_MAX = 110 * 1024
#: kernels 1 / 3: bytes of a CTA's (1) / warp's (3) first weights bulk-prefetched into L2 before the PDL wait, on
#: weights under BIG elements (kernel 3 and big weights were only slower with it)
L2PF = {1: 16384, 3: 0}
#: k values for which kernel 1 adds its warps' partial sums in warp order (``K1WO``: a CTA's sums the same run to
#: run) instead of with shared-memory atomics; k = 2 keeps the atomics (its decode step was slower), and only at
#: M <= 8 (with more token groups the build spills more)
K1WO_K = (3, 4, 5)
#: split-K workspace: a lane's four partial sums by one ``red.global.add.v4.f32`` (``WS4``) where a tile has more
#: parts than this (with fewer parts the read-back waits for one 16-byte load at a time and was slower)
WS4_PARTS = 4


@dataclass(frozen=True)
class MmaPlan:
    """One launch of a swap-AB kernel: what :func:`make_plan` decided."""

    kernel: int  #: 1, 3, 4 or 7
    defines: dict = field(repr=False)  #: ``#define`` options of the build (``BF16``: the activations' dtype)
    warps: int  #: warps a CTA
    grid: int  #: CTAs
    shared: int  #: dynamic shared bytes
    splits: int  #: K splits (kernels 1, 7 without stream-K)
    sps: int  #: segments a split (kernel 3 with CTA-aligned units: units a CTA)
    Nt: int  #: 16-row tiles
    S: int  #: 256-column segments
    regs: int  #: registers a thread of the build
    ctas_per_sm: int  #: the build's occupancy
    n_cnt: int  #: split-K counters
    ws_floats: int  #: fp32 partial sums of the workspace
    use_ws: bool  #: whether the launch uses the workspace

    @property
    def source(self) -> tuple[str, str]:
        """(source file, kernel name) of the build."""
        return KERNELS[self.kernel]


def table_smem(k: int, pairs: bool = False) -> int:
    """Dynamic shared bytes of the codebook lookup table plus its alignment pad (k = 2: codebook in registers);
    ``pairs``: k = 5's pair table (``P5``: 1024 entries a lane, 128-byte aligned)."""
    if k == 5 and pairs:
        return 1024 * 32 * 4 + 128
    tab = {2: 16, 3: 64 * 32 * 4, 4: 256 * 32 * 4, 5: 32 * 32 * 4}[k]
    return tab + {3: 8192, 4: 128, 5: 4096}.get(k, 16)


def large_defines(k: int, cfg: LargeConfig, grouped: bool = False) -> tuple[dict, int]:
    """(defines, dynamic shared bytes) of kernel 7 with ``cfg``; ``grouped``: the MoE form (``GRP``: x pre-tiled per
    block of a block table, no split K; ``kbit.ops.grouped_mma``)."""
    xc = 8 * cfg.groups * 128  # x bytes a 64-column chunk
    D = max(3, min(cfg.stages, 8, (SMEM_MAX - 2048 - 1024 - table_smem(k)) // xc))
    # raster, x_swizzle, x_bulk are fixed in wgmma.cu (LargeConfig checks them); their defines stay in the set so
    # that the build's key is what it was
    defines = dict(K_BITS=k, NG=cfg.groups, D=D, MAXW=cfg.warps, MINB=1, RT=1, ARCH_SPECIFIC=1, AB=2, GM=cfg.raster,
                   XSW=int(cfg.x_swizzle), XB=cfg.x_bulk, WS4=0)
    if cfg.stream_k and not grouped:
        defines["SK"] = 1
    if grouped:
        defines["GRP"] = 1
    return defines, D * xc + table_smem(k) + 1024


def x_rows_bytes(M: int, S: int) -> int:
    """Shared bytes of kernel 3's staged x (``XS`` without K slices): ``M`` rows of ``S`` segments and 64 pad bytes
    (a row of whole segments is a multiple of 128 bytes; the pad puts alternate tokens' B fragments in alternate bank
    halves, csrc/gemv_mma_streamk.cu)."""
    return M * (S * SEG + 32) * 2


def x_staged(k: int, M: int, S: int, cfg: MmaConfig) -> bool:
    """Whether kernel 3 with ``cfg`` (no K slices) stages the whole x of ``M`` rows of ``S`` segments in shared memory:
    where ``cfg`` asks for it and the rows fit beside the lookup table, in :data:`XS_MAX` at 2+ CTAs an SM and in the
    whole shared memory at one (the k = 5 pair table always runs one CTA an SM)."""
    p5 = k == 5 and cfg.pair_table
    limit = SMEM_MAX if p5 or cfg.min_ctas == 1 else XS_MAX
    return bool(cfg.x_smem) and table_smem(k, p5) + x_rows_bytes(M, S) <= limit


def _k3_defines(k, M, S, ng, cfg: MmaConfig, pro, epi, det):
    """Kernel 3's defines and shared bytes: x staged in shared memory (XS) where it fits, or in K slices (XK)."""
    p5 = int(k == 5 and cfg.pair_table)
    tab = table_smem(k, p5)
    xk = min(cfg.x_slice, S) if cfg.x_slice and not pro and not det else 0
    if xk:  # K slices of xk segments, x[:, slice] in shared memory (rows padded by 64 bytes)
        xs = 1
        shared = tab + M * (xk * SEG + 32) * 2
        if shared > SMEM_MAX:
            raise ValueError(f"config: x slices of {xk} segments for M={M} need {shared} bytes of shared memory, "
                             f"more than {SMEM_MAX}")
    else:  # x staged where it fits beside the table: in XS_MAX at 2+ CTAs an SM, in the whole shared memory at one
        # (a prologue's norm weight too: prologue_config checks it). At one CTA an SM and M = 16 the whole staged x
        # took 0.75-0.88x the time of the same config reading x from global memory on 9216..35840 x 4096..5120 and
        # 1.02-1.09x on 4096x4096 (H200, lab/xs_one_cta.py, benchmarks/results/h200/xs-one-cta-2026-11-28.log)
        xs = int(x_staged(k, M, S, cfg))
        shared = tab + xs * x_rows_bytes(M, S)
    defines = dict(K_BITS=k, NG=ng, D=1, MAXW=cfg.warps, MINB=cfg.min_ctas, PD=cfg.ring or PIPE[k], XS=xs, XK=xk)
    if p5:
        defines["P5"] = 1
    if pro:
        if not xs:
            raise ValueError(f"pro: an x prologue needs kernel 3 with x in shared memory, got config {cfg}")
        defines["PRO"] = pro
        shared += S * SEG * 2  # the norm weight
    if epi:
        defines["EPI"] = epi
    return defines, shared


def _k4_defines(k, ng, cfg: MmaConfig, scale_format):
    sv = 2 if scale_format == "fp16" else 1
    stage = 8 * ng * 576 + cfg.warps * cfg.rows_per_warp * (k * 512 + sv * 128)
    D = max(2, min(cfg.stages, (SMEM_MAX - 2048 - table_smem(k)) // stage))
    defines = dict(K_BITS=k, NG=ng, D=D, MAXW=cfg.warps, MINB=cfg.min_ctas, RT=cfg.rows_per_warp)
    return defines, D * stage + table_smem(k)


def _defines(k, M, N, K, S, scale_format, cfg, det, pro, epi, bf16=False):
    """(kernel, defines, shared bytes, warps, token groups) of ``cfg`` before the grid is known."""
    ng = n_groups(M)
    if isinstance(cfg, LargeConfig):
        defines, shared = large_defines(k, cfg)
        kernel, W, ng = 7, cfg.warps, cfg.groups
    elif cfg.kernel == 3:
        defines, shared = _k3_defines(k, M, S, ng, cfg, pro, epi, det)
        kernel, W = 3, cfg.warps
    elif cfg.kernel == 1:
        kernel, W = 1, max(1, min(cfg.warps, S))
        defines, shared = dict(K_BITS=k, NG=ng, D=1, MAXW=W, MINB=cfg.min_ctas), table_smem(k)
    else:
        defines, shared = _k4_defines(k, ng, cfg, scale_format)
        kernel, W = 4, cfg.warps
    if (pro or epi) and kernel != 3:
        raise ValueError(f"pro, epi: a prologue or epilogue needs kernel 3, got config {cfg}")
    if kernel in (1, 3):
        defines["L2PF"] = L2PF[kernel] if N * K < BIG else 0
    if kernel == 1 and ng == 1 and N * K < BIG:  # kernel 1 issues its first loads before the PDL wait
        defines["K1EARLY"] = 1
    # M1: the segment skips token 2t + 1's accumulators; not for kernel 1 at 3+ CTAs of 8 warps an SM (80 or 64
    # registers), where ptxas then spills more
    if M == 1 and (kernel == 3 or (kernel == 1 and W * cfg.min_ctas <= 16)):
        defines["M1"] = 1
    if kernel == 1:  # a CTA's warps summed in warp order (bit-stable run to run where K is not split across CTAs)
        defines["K1WO"] = int(k in K1WO_K and ng == 1)
    if kernel in (1, 3) and det:
        defines["DET"] = 1
    defines.update(BF16=int(bf16), FP16_SCALES=int(scale_format == "fp16"), WS4=0)
    return kernel, defines, shared, W, ng


def check_config(k: int, M: int, N: int, K: int, config: MmaConfig | LargeConfig, scale_format: str = "log8") -> int:
    """Raises the ``ValueError`` that :func:`make_plan` would raise for ``config`` on one launch of ``M`` rows (e.g.
    kernel 3's x slices over the shared memory), from the arithmetic alone (no build); returns the dynamic shared
    bytes of the launch. What depends on the build (occupancy, registers) is not checked."""
    S = -(-K // SEG)
    _, _, shared, _, _ = _defines(k, M, N, K, S, scale_format, config, False, 0, 0)
    if shared > SMEM_MAX:
        raise ValueError(f"config: {config} needs {shared} bytes of shared memory for M={M}, more than {SMEM_MAX}")
    return shared


def _splits(n_tiles, nsteps, slots, max_split, divide):
    """K splits: the fewest (within 5% of the best) that fill ``slots`` evenly; at most ``max_split``."""
    best, best_eff = 1, 0.0
    for s in range(1, max(1, max_split) + 1):
        if divide and nsteps % s:
            continue
        items = n_tiles * s
        eff = items / (-(-items // slots) * slots)
        if eff > best_eff * 1.05:
            best, best_eff = s, eff
        if items >= 8 * slots:
            break
    return best


def _sm_items(items: int, grid: int, sms: int) -> int:
    """The most items an SM streams when CTA c takes items c, c + grid, ... and sits on SM c % sms."""
    loads = [0] * sms
    for c in range(min(grid, items)):
        loads[c % sms] += -(-(items - c) // grid)
    return max(loads)


def _k1_grid(items: int, slots: int, sms: int) -> int:
    """Kernel 1's CTAs: the same items each (``ceil(items / ceil(items / slots))``), or every slot where that leaves
    an SM fewer items to stream. With the same items each, a grid that is not a multiple of the SMs puts two CTAs on
    some SMs and one on others: 5120 rows are 320 tiles, 160 CTAs of two, so 28 SMs stream 4 tiles while every slot
    filled gives at most 3 (H100, through the dispatcher: 5120x8192 k = 2 M = 1..4 0.84-0.86x the time, k = 4 M = 4
    0.87x, M = 1 2.7% slower; where both grids give an SM the same most items, every slot filled was 0-3% slower;
    lab/k1_grid.py, benchmarks/results/h100/k1-grid-ab-2026-11-27/)."""
    even = -(-items // -(-items // slots))
    if items <= slots or _sm_items(items, slots, sms) >= _sm_items(items, even, sms):
        return even
    return slots


def k1_layout(Nt: int, S: int, W: int, slots: int, sms: int) -> tuple[int, int, int]:
    """Kernel 1's (K splits, segments a split, CTAs) for ``Nt`` 16-row tiles of ``S`` segments, ``W`` warps a CTA
    and ``slots`` CTA slots on ``sms`` SMs: K split only where the tiles leave over a tenth of the SMs without one
    (see :func:`_grid`), then :func:`_k1_grid`."""
    splits = _splits(Nt, S, slots, S // W if 10 * Nt < 9 * sms else 1, divide=False)
    sps = -(-S // splits)
    splits = -(-S // sps)
    return splits, sps, _k1_grid(Nt * splits, slots, sms)


def _grid_k3(st, build, k, N, K, epi, ng):
    """Kernel 3's grid; CTA-aligned units or the CTA-local fix-up where their build keeps the occupancy."""
    Nt, S, W, occ, slots, sms = st["Nt"], st["S"], st["W"], st["occ"], st["slots"], st["sms"]
    defines = st["defines"]
    st.update(splits=1, sps=S, lfx=False)
    if defines["XK"]:  # the same CTAs for every K slice (the kernel reads cps = grid / n_sl)
        n_sl = -(-S // defines["XK"])
        st["grid"] = n_sl * max(1, min(slots // n_sl, -(-(Nt * defines["XK"]) // W)))
        return
    st["grid"] = max(1, min(slots, -(-(Nt * S) // W)))
    cau = cau_plan(Nt, S, W, occ, sms, epi, ng, read_us(k, N, K))
    if cau:  # CTA-aligned units add a tile's parts in warp order: deterministic too (in place of DET's slots)
        W_c, occ_c, cau_defs, sps_c, grid_c = cau
        defs_c = {**{d: v for d, v in defines.items() if d != "DET"}, **cau_defs, "MAXW": W_c, "MINB": occ_c}
        if k == 2 and ng == 1 and not epi and not defines.get("PRO"):  # measured on plain launches only
            defs_c["PD"] = max(defs_c["PD"], CAU_K2_RING)
        kern_c = build(3, defs_c)
        # occupancy 0 where the units' static slots do not fit beside a staged x (43008x5376, M = 16, one CTA of 16
        # warps an SM, H200: 205952 dynamic + 34944 static bytes; a CTA may use 232448)
        if kern_c.occupancy(W_c * 32, st["shared"]) >= occ_c:
            st.update(defines=defs_c, kern=kern_c, W=W_c, occ=occ_c, sps=sps_c, grid=grid_c)
            return
    # the CTA-local fix-up: where x is not staged (with XS it streamed slower) and not in deterministic mode
    if defines["XS"] or defines.get("DET"):
        return
    lfx = lfx_defines(Nt, S, st["grid"], W, epi, ng)
    if lfx:  # static shared slots; kept only at the same occupancy
        kern_l = build(3, {**defines, **lfx})
        if kern_l.occupancy(W * 32, st["shared"]) >= occ:
            defines.update(lfx)
            st.update(kern=kern_l, lfx=True)


def _grid(st, kernel, build, cfg, k, M, N, K, epi, ng):
    """Grid, K splits and segments a split of ``kernel`` (written into ``st``)."""
    Nt, S, W, slots = st["Nt"], st["S"], st["W"], st["slots"]
    if kernel == 3:
        _grid_k3(st, build, k, N, K, epi, ng)
    elif kernel == 7:
        n_tb = -(-M // (8 * ng))  # token blocks: each has its own split-K counters
        st["tiles"] = tiles = -(-Nt // W) * n_tb
        if st["defines"].get("SK"):
            st.update(splits=1, sps=S, grid=max(1, min(slots, tiles * S)))
        else:
            splits = _splits(tiles, S, slots, max(1, S // 4), divide=False) if tiles < 2 * slots else 1
            sps = -(-S // splits)
            splits = -(-S // sps)
            st.update(splits=splits, sps=sps, grid=max(1, min(slots, tiles * splits)))
        st["n_cnt"] = n_tb * Nt
    elif kernel == 4:  # stream-K over (row block, segment) pairs; K splits not used
        st.update(splits=1, sps=S, grid=max(1, min(slots, -(-Nt // (W * cfg.rows_per_warp)) * S)))
    else:  # kernel 1: K split only where the tiles leave over a tenth of the SMs without one
        # (H100, lab/m1_splits.py --unsplit and lab/rounds/k1split_ab.sh: with a tile for nearly every SM the split's
        # partial sums cost more than the SMs it adds: 5120x8192 k = 4 M = 1 23.2 us split, 14.2 unsplit; 2048x4096
        # (128 tiles) 6.3 / 4.6; with 96 tiles, 1536x7168, the split won at k = 3..5: 6.4 / 7.1 at k = 4 M = 2)
        splits, sps, grid = k1_layout(Nt, S, W, slots, st["sms"])
        st.update(splits=splits, sps=sps, grid=grid)


def _parts(st, kernel) -> float:
    """Partial sums a tile gets from different warps / CTAs (the split-K workspace's traffic)."""
    defines, grid, W, Nt, S = st["defines"], st["grid"], st["W"], st["Nt"], st["S"]
    if kernel == 7:
        return grid / st["tiles"] if defines.get("SK") else st["splits"]
    if kernel == 3 and defines["XK"]:
        n_sl = -(-S // defines["XK"])
        return n_sl * max(1.0, (grid // n_sl) * W / Nt)
    if kernel == 3 and (st["lfx"] or defines.get("CAU")):
        return 2.0  # LFX: at most a part from each CTA that a tile crosses into; CAU: no workspace
    if kernel == 3:
        return max(1.0, grid * W / Nt)
    return st["splits"] if kernel == 1 else 0


def _ws_floats(st, kernel, M, ng) -> int:
    defines, Nt, S = st["defines"], st["Nt"], st["S"]
    if kernel == 3 and defines.get("DET"):  # a slot a part of a tile (finish_det): parts start >= L segments apart
        L = max(Nt * S // (st["grid"] * st["W"]), 1)
        return Nt * ((S + L - 2) // L + 1) * 128 * ng
    if kernel == 1 and defines.get("DET"):  # a slot a K split of a tile
        return Nt * st["splits"] * 128 * ng if st["splits"] > 1 else 0
    return -(-M // (8 * ng)) * 8 * ng * Nt * 16  # NG * 128 floats a 16-row tile a token block (``ws_at``)


def make_plan(k: int, M: int, N: int, K: int, scale_format: str, config: MmaConfig | LargeConfig, *, sms: int, build,
         deterministic: bool = False, pro: int = 0, epi: int = 0, bf16: bool = False) -> MmaPlan:
    """The launch of ``config`` for ``M`` rows on a k-bit ``[N, K]`` weight on a GPU of ``sms`` SMs, for bf16
    activations (``bf16``) or fp16: the plan's builds are the ones the launch runs, so they are compiled once.

    ``build(kernel, defines)`` returns the built kernel (``.occupancy(threads, shared)``, ``.num_regs``);
    ``deterministic``: split-K parts added in a fixed order (``DET``); ``pro``: an x prologue (1: RMSNorm, 2:
    residual add + RMSNorm; kernel 3 with x in shared memory only); ``epi`` 1: the SiLU * up epilogue of a fused
    gate/up weight (kernel 3 only); see ``kbit.dispatch.prologue``. ``K`` is x's width: where it is not a multiple
    of 256, kernels 1, 3, 4 read x in place and take its columns from K on as zero (``XT``).
    """
    Nt, S = -(-N // 16), -(-K // SEG)
    kernel, defines, shared, W, ng = _defines(k, M, N, K, S, scale_format, config, deterministic, pro, epi, bf16)
    if K % SEG and kernel != 7:  # x read in place up to column K (kernel 7 reads a zero-padded copy)
        defines["XT"] = 1
    kern = build(kernel, defines)
    occ = kern.occupancy(W * 32, shared)
    if occ < 1 and kernel == 3 and defines.get("XS") and not pro:
        # the staged x and the build's static shared memory together pass what a CTA may use (the plan counts the
        # dynamic bytes only): read x from global memory instead
        return make_plan(k, M, N, K, scale_format, replace(config, x_smem=False), sms=sms, build=build,
                         deterministic=deterministic, pro=pro, epi=epi, bf16=bf16)
    if occ < 1:
        raise ValueError(f"config: {config} for M={M} needs {shared} bytes of dynamic shared memory beside "
                         f"{getattr(kern, 'shared_bytes', 0)} static, more than a CTA may use on this GPU")
    cap = config.grid_ctas if kernel == 1 else config.x_slice if kernel == 3 else 0
    slots = sms * (min(occ, cap) if cap else occ)  # fewer CTAs leave room for the next kernel's (PDL)
    st = dict(Nt=Nt, S=S, W=W, occ=occ, slots=slots, sms=sms, defines=defines, kern=kern, shared=shared, n_cnt=Nt)
    _grid(st, kernel, build, config, k, M, N, K, epi, ng)
    defines = st["defines"]
    ws4 = int(ng > 1 and not defines.get("DET") and _parts(st, kernel) > WS4_PARTS)
    if ws4 != defines.get("WS4", 0):
        defines["WS4"] = ws4
        st["kern"] = build(kernel, defines)
    return MmaPlan(kernel=kernel, defines=defines, warps=st["W"], grid=st["grid"], shared=shared,
                   splits=st["splits"], sps=st["sps"], Nt=Nt, S=S, regs=st["kern"].num_regs,
                   ctas_per_sm=st["occ"], n_cnt=st["n_cnt"], ws_floats=_ws_floats(st, kernel, M, ng),
                   use_ws=kernel in (3, 4) or st["splits"] > 1 or bool(defines.get("SK")))


def prologue_config(k: int, M: int, N: int, K: int, plain: MmaConfig | LargeConfig | None = None) -> MmaConfig | None:
    """The kernel-3 config (x in shared memory) of a launch with an x prologue (``kbit.dispatch.prologue``), or None
    when it does not apply (M > 8, x [M, K] and the norm weight do not fit in shared memory beside the lookup
    table, or the plain launch is not kernel 3). ``plain``: the config of the same launch without a prologue
    (``kbit.ops.gemv_mma.launch_config``: the tuned table's where it has one); where that one takes k = 5's pair
    table and x and the norm weight fit beside it, the prologue launch takes it too (the same weight read, with the
    same lookups).

    Where the plain launch is another kernel (kernel 1 on narrow weights), fusing would move the weight read to
    kernel 3, and that costs more than the separate norm and SiLU kernels save: on an H200 at M = 1, k = 2..5, the
    fused launch took 1.01-1.47x (geometric mean 1.20) the time of the norm kernel and the plain launch on the 18
    suite q/k/v points whose plain pick was kernel 1, against 0.91-1.13x (1.01) of the separate steps on the 78
    points where it was kernel 3 (``benchmarks/results/h200/prologue-sweep-2026-11-28/``)."""
    if not 1 <= M <= 8:
        return None
    if plain is not None and not (isinstance(plain, MmaConfig) and plain.kernel == 3):
        return None
    S = -(-K // SEG)
    if (k == 5 and isinstance(plain, MmaConfig) and plain.pair_table
            and table_smem(k, True) + x_rows_bytes(M, S) + S * SEG * 2 <= SMEM_MAX):
        return replace(plain, x_smem=True, x_slice=0)
    if table_smem(k) + x_rows_bytes(M, S) + S * SEG * 2 > XS_MAX:
        return None
    cfg = default_config(k, M, N, K)
    if cfg.kernel == 3 and cfg.x_smem:
        return cfg
    return MmaConfig(kernel=3, warps=8, min_ctas=2, ring=PIPE[k], x_smem=True)
