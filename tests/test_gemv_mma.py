"""kbit.ops.gemv_mma and its layout / configs (kbit.ops.mma, kbit.tuning.mma*): repack round trip and validation
(CPU); the CUDA kernels against the float64 reference (GPU, marked ``gpu``)."""

import dataclasses

import pytest
import torch

from kbit import options
from kbit.bench.tune_build import _FakeKernel
from kbit.cuda import runtime
from kbit.dispatch import linear as D
from kbit.format.pack import pack
from kbit.ops import gemv_mma as MM
from kbit.ops.mma import common as MC
from kbit.ops.mma import layout as LY
from kbit.ops.reference import gemv_reference
from kbit.tuning import mma as T
from kbit.tuning import mma_plan as TP
from kbit.tuning import mma_units as TU
from kbit.tuning.mma import LargeConfig as Large
from kbit.tuning.mma import MmaConfig as Mma

CUDA = torch.cuda.is_available()


def make_weight(N, K_, k, B=32, sf="log8", device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    Kp = -(-K_ // B) * B
    codes = torch.randint(-(2**31), 2**31 - 1, (N, Kp * k // 32), generator=g, dtype=torch.int32)
    if sf == "log8":
        scales = torch.randint(0, 64, (N, Kp // B), generator=g, dtype=torch.uint8)
        if N > 3:
            scales[:, 0] = 255  # an all-zero block
        ts = torch.rand((), generator=g) + 0.5
    else:
        scales = (torch.rand(N, Kp // B, generator=g) + 0.05).half()
        ts = torch.ones(())
    cb = torch.sort(torch.rand(2**k, generator=g) * 2 - 1).values
    return [t.to(device) for t in (codes, scales, ts, cb)]


def rel_err(y, ref):
    assert not torch.isnan(y).any(), "NaN in output (unwritten element?)"
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 2e-3 if dtype == torch.float16 else 1.2e-2


# ------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("N,K_,B,sf", [(37, 100, 32, "log8"), (16, 256, 32, "log8"), (50, 300, 64, "fp16"),
                                       (1, 2880, 128, "log8"), (33, 64, 32, "fp16"), (5, 1, 32, "log8")])
def test_repack_round_trip(k, N, K_, B, sf):
    codes, scales, _, _ = make_weight(N, K_, k, B, sf, seed=k + N)
    rc, rs = LY.repack(codes, scales, k=k, blocksize=B, scale_format=sf, N=N, K=K_)
    nt, s = -(-N // 16), -(-(-(-K_ // B) * B) // 256)
    assert rc.shape == (nt, s, k, 32, 4) and rc.dtype == torch.int32
    assert rs.shape == (nt, s, 8, 16) and rs.dtype == scales.dtype
    c2, s2 = LY.unrepack(rc, rs, k=k, blocksize=B, N=N, K=K_)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_repack_layout_definition(k):
    """Lane 4g + t of (tile, seg): code i = 16u + 8h + 4j + 2r + e (k = 2: 16u + 8h + 4e + 2j + r) of its k-bit
    stream is W's code at row 16 tile + g + 8r, column 256 seg + 32u + 8t + 4h + 2j + e (what the kernel's
    lookups assume)."""
    N, K_ = 32, 512
    c = torch.randint(0, 2**k, (N, K_))
    rc, _ = LY.repack(pack(c, k), torch.zeros(N, K_ // 32, dtype=torch.uint8), k=k, blocksize=32,
                      scale_format="log8", N=N, K=K_)
    lanes = rc.permute(0, 1, 3, 2, 4).reshape(2, 2, 32, 4 * k).to(torch.int64) & 0xFFFFFFFF  # [tile, seg, lane, word]
    gen = torch.Generator().manual_seed(k)
    for _ in range(200):
        tile, seg, g, t, u, h, j, r, e = (int(torch.randint(0, n, (), generator=gen))
                                          for n in (2, 2, 8, 4, 8, 2, 2, 2, 2))
        i = 16 * u + 8 * h + (4 * e + 2 * j + r if k == 2 else 4 * j + 2 * r + e)
        words = lanes[tile, seg, 4 * g + t]
        stream = sum(int(w) << (32 * n) for n, w in enumerate(words.tolist()))
        code = (stream >> (i * k)) & (2**k - 1)
        assert code == c[16 * tile + g + 8 * r, 256 * seg + 32 * u + 8 * t + 4 * h + 2 * j + e]


def test_repack_padding_is_zero_weight():
    N, K_ = 20, 40
    codes, scales, _, _ = make_weight(N, K_, 3)
    _, rs = LY.repack(codes, scales, k=3, blocksize=32, scale_format="log8", N=N, K=K_)
    full = rs.view(2, 1, 8, 8, 2).permute(0, 4, 2, 1, 3).reshape(32, 8)
    assert (full[N:] == 255).all() and (full[:, 2:] == 255).all()


def test_repacked_cache_follows_tensor():
    codes, scales, _, _ = make_weight(16, 64, 4)
    a = LY.repacked(codes, scales, k=4, blocksize=32, scale_format="log8", N=16, K=64)
    assert LY.repacked(codes, scales, k=4, blocksize=32, scale_format="log8", N=16, K=64) is a
    codes.add_(1)  # in-place change -> version bump -> repacked again
    b = LY.repacked(codes, scales, k=4, blocksize=32, scale_format="log8", N=16, K=64)
    assert b is not a and not torch.equal(a[0], b[0])


def test_large_defines_x_loader():
    """Kernel 7 is built with the swizzled, bulk-copied x (XSW 1, XB 1) in both forms."""
    for cfg in (Large(8, 32), Large(8, 32, stream_k=True)):
        d = TP.large_defines(4, cfg)[0]
        assert d["XB"] == 1 and d["XSW"] == 1 and d["GM"] == 8
    assert TP.large_defines(4, Large(8, 32), grouped=True)[0]["GRP"] == 1


@pytest.mark.parametrize("field,value", [("x_bulk", 0), ("x_bulk", 2), ("x_swizzle", False), ("raster", 2),
                                         ("refill_lag", 1)])
def test_large_config_refuses_variants_kernel_7_is_not_built_with(field, value):
    with pytest.raises(ValueError, match=f"config.{field}: expected"):
        Large(8, 32, **{field: value})


@pytest.mark.parametrize("groups", [0, 1, 2, 3, 64])
def test_large_config_refuses_tiles_kernel_7_is_not_built_for(groups):
    with pytest.raises(ValueError, match=f"config.groups: expected 4, 8, 16 or 32 .*got {groups}"):
        Large(8, groups)


#: kernel 3 with K slices of x in shared memory (9 <= M <= 16 on tall, big weights, sm_90)
XK = Mma(3, warps=16, ring=3, x_smem=True, x_slice=8)


def same(cfg, t, k) -> bool:
    """``cfg`` is the config written positionally as ``t`` (kernel, warps, X, ...; kernel 3's ring 0 = PIPE[k])."""
    want = {1: lambda: Mma(1, t[1], min_ctas=t[2]), 4: lambda: Mma(4, t[1], rows_per_warp=t[2], stages=t[3]),
            3: lambda: Mma(3, t[1], min_ctas=t[2], ring=t[3] if len(t) > 3 else 0, x_smem=len(t) > 4 and bool(t[4]))}
    w = want[t[0]]()
    if t[0] == 3:
        return cfg.kernel == 3 and (cfg.warps, cfg.min_ctas, cfg.ring or T.PIPE[k], cfg.x_smem, cfg.x_slice) == (
            w.warps, w.min_ctas, w.ring or T.PIPE[k], w.x_smem, 0)
    return cfg == w


def test_mid_m_routes():
    """9 <= M <= 64 (2026-11-22, H100): x slices at M <= 16 on tall, big weights (sm_90 only); kernel 7's 32- and
    64-token tiles with stream-K; 16 warps on big weights except k = 5."""
    assert T.default_config(4, 16, 10000, 5120, sm90=True) == XK
    assert T.default_config(4, 16, 10000, 5120) != XK  # other GPUs: not measured there
    assert T.default_config(4, 16, 4096, 14336, sm90=True) != XK  # N < 8192
    assert T.default_config(4, 16, 8192, 4096, sm90=True) != XK  # N * K < 5e7
    assert T.default_config(4, 8, 10000, 5120, sm90=True) != XK  # M <= 8
    assert T.large_config(4, 24, 28672, 4096) == Large(8, 4, stages=6, x_bulk=1, stream_k=True)
    assert (T.large_config(4, 64, 57344, 8192).warps, T.large_config(4, 64, 57344, 8192).groups) == (16, 8)
    assert (T.large_config(5, 64, 57344, 8192).warps, T.large_config(5, 64, 57344, 8192).groups) == (12, 8)
    assert (T.large_config(4, 48, 4096, 14336).warps, T.large_config(4, 48, 4096, 14336).groups) == (12, 8)
    assert T.LARGE7_MIN_M == 17


def test_small_m_x_staged_routes():
    """M = 2..8 on kernel 3 (H100, m1-cfg-m2-8-2026-11-22.log): x staged in shared memory, a ring of 2, except
    M = 5..8 on weights of >= BIG elements at k != 4; 8192x28672-like weights: kernel 1 (1, 8, 2) for k = 4 at M = 1
    and k = 5 at M = 2..8."""
    for k in (2, 3, 4, 5):
        for M in (2, 4, 8):
            assert same(T.default_config(k, M, 28672, 4096, sm90=True, sms=132), (3, 8, 2, 2, 1), k)
            assert same(T.default_config(k, M, 14336, 4096, sm90=True, sms=132), (3, 8, 2, 2, 1), k)
        assert same(T.default_config(k, 4, 57344, 8192, sm90=True, sms=132), (3, 8, 2, 2, 1), k)
    assert same(T.default_config(4, 8, 57344, 8192, sm90=True, sms=132), (3, 8, 2, 2, 1), 4)
    assert same(T.default_config(3, 8, 57344, 8192, sm90=True, sms=132), (3, 8, 2, 3), 3)
    assert same(T.default_config(4, 1, 8192, 28672, sm90=True, sms=132), (1, 8, 2), 4)
    assert same(T.default_config(4, 2, 8192, 28672, sm90=True, sms=132), (1, 4, 4), 4)
    assert same(T.default_config(5, 1, 8192, 28672, sm90=True, sms=132), (1, 4, 4), 5)
    assert same(T.default_config(5, 4, 8192, 28672, sm90=True, sms=132), (1, 8, 2), 5)
    assert same(T.default_config(3, 1, 8192, 28672, sm90=True, sms=132), (1, 4, 4), 3)


def test_one_tile_cta_routes():
    """M <= 8 on WIDE < N <= 16 x 3 x SMs below BIG (2026-11-22, H100): kernel 1, a CTA a tile (3 CTAs an SM; k = 2
    up to 4 CTAs an SM); only when the SM count is known (plan passes it); a prologue launch is kernel 3, and there
    is none where the plain launch is kernel 1 (the norm runs apart)."""
    fused_config = TP.prologue_config

    assert same(T.default_config(4, 1, 6144, 4096, sms=132), (1, 8, 3), 4)
    assert same(T.default_config(3, 8, 5120, 2048, sms=132), (1, 8, 3), 3)
    assert same(T.default_config(2, 4, 8192, 4096, sms=132), (1, 8, 4), 2)
    assert same(T.default_config(2, 1, 12288, 4096, sms=132), (1, 4, 6), 2)
    assert T.default_config(2, 1, 14336, 4096, sms=132).kernel == 3  # more tiles than 6 CTAs x SMs
    assert T.default_config(4, 2, 12288, 4096, sms=132).kernel == 3  # k = 2 only
    assert same(T.default_config(4, 1, 8192, 4096, sms=132), (1, 8, 4), 4)
    assert same(T.default_config(3, 8, 7168, 5120, sms=132), (1, 8, 4), 3)
    assert T.default_config(5, 1, 8192, 4096, sms=132).kernel == 3  # k = 5 at 4 CTAs an SM: not measured (spills)
    assert same(T.default_config(4, 1, 6144, 4096, sms=100), (1, 8, 4), 4)  # more tiles than 3 CTAs x SMs
    assert T.default_config(4, 1, 6144, 4096, sms=90).kernel == 3  # more tiles than 4 CTAs x SMs
    assert same(T.default_config(4, 1, 4096, 4096, sms=132), (1, 8, 2), 4)  # N <= WIDE: as before
    assert T.default_config(4, 1, 6144, 4096).kernel == 3  # SM count unknown
    assert fused_config(4, 1, 6144, 4096).kernel == 3
    assert fused_config(4, 1, 6144, 4096, T.default_config(4, 1, 6144, 4096, sms=132)) is None


@pytest.mark.parametrize("Nt,S,grid,W,epi", [(1792, 16, 264, 8, 0), (3584, 32, 264, 8, 0), (1792, 16, 264, 8, 1),
                                            (4, 32, 264, 8, 0), (384, 16, 264, 8, 1), (100, 3, 7, 4, 0)])
def test_local_fixup_slots(Nt, S, grid, W, epi):
    """LFU / LFW of kernel 3's CTA-local fix-up: the most units (tiles; EPI: gate / up pairs) a CTA's range
    [T b W / (G W), T (b + 1) W / (G W)) touches, and (EPI) the most tiles a warp's range touches."""
    d = TU.lfx_defines(Nt, S, grid, W, epi)
    T, TW, U = Nt * S, grid * W, S * (2 if epi else 1)
    units = [(T * (b * W + W) // TW - 1) // U - (T * b * W // TW) // U + 1 for b in range(grid)
             if T * (b * W + W) // TW > T * b * W // TW]
    tiles = [(T * (w + 1) // TW - 1) // S - (T * w // TW) // S + 1 for w in range(TW)
             if T * (w + 1) // TW > T * w // TW]
    assert d == dict(LFX=1, LFU=max(units), LFW=max(tiles + [2]) if epi else 2)
    assert TU.lfx_defines(100000, 2, 1, 8, 0) is None  # one CTA over 100000 tiles: too many units


@pytest.mark.parametrize("Nt,S,W,occ,sms,epi", [(1792, 16, 8, 2, 132, 1), (384, 16, 8, 2, 132, 0),
                                                (3584, 32, 8, 2, 132, 0), (320, 8, 8, 2, 132, 0),
                                                (63, 7, 8, 2, 132, 0), (1000, 3, 4, 4, 100, 1), (64, 40, 8, 1, 16, 0)])
def test_cta_units_plan(Nt, S, W, occ, sms, epi):
    """CAU's plan: of the configured CTAs and half as many of twice the warps, the one with the fewest idle SM
    slots (the busiest CTA's units against an even share), None below CAU_MIN_EFF; LFW = the most tiles a warp's
    range touches (not EPI: at most its two partial tiles), by brute force over every warp."""
    r = TU.cau_plan(Nt, S, W, occ, sms, epi)
    tpu = 2 if epi else 1
    n_u, U = Nt // tpu, tpu * S
    opts = [(n_u / (sms * o * -(-n_u // (sms * o))), w, o) for w, o in ((W, occ), (2 * W, occ // 2)) if o >= 1]
    eff, w, o = max(opts, key=lambda t: (t[0], -t[1]))
    if eff < TU.CAU_MIN_EFF:
        assert r is None
        return
    upc = -(-n_u // (sms * o))
    grid = -(-n_u // upc)
    lfw = 1
    for b in range(grid):
        c0, cn = b * upc * U, (min(n_u, (b + 1) * upc) - b * upc) * U
        for wi in range(w):
            j0, j1 = c0 + cn * wi // w, c0 + cn * (wi + 1) // w
            if j1 > j0:
                lfw = max(lfw, (j1 - 1) // S - j0 // S + 1)
    assert r == (w, o, dict(CAU=1, LFW=lfw if epi else min(lfw, 2)), upc, grid)
    assert grid * upc >= n_u > (grid - 1) * upc


def test_cta_units_llama_shapes():
    """Llama-3-8B's fused q/k/v (6144 rows) and gate / up (28672, EPI) at K = 4096 on 132 SMs: 128 CTAs of 16
    warps, 3 tiles / 7 pairs each (2 CTAs of 8 warps an SM would leave 27% / 15% of the slots idle)."""
    assert TU.cau_plan(384, 16, 8, 2, 132, 0) == (16, 1, dict(CAU=1, LFW=2), 3, 128)
    assert TU.cau_plan(1792, 16, 8, 2, 132, 1) == (16, 1, dict(CAU=1, LFW=2), 7, 128)
    # 57344x8192: whole tiles leave 3% of ~90 us idle, more than the fix-up costs
    assert TU.cau_plan(3584, 32, 8, 2, 132, 0, est_us=100.0) is None
    assert TU.cau_plan(3584, 32, 8, 2, 132, 0, est_us=25.0) is not None


def test_x_slices_too_big_for_shared_memory():
    with pytest.raises(ValueError, match="x slices"):
        MM.plan_launch(4, 64, 10000, 5120, config=Mma(3, warps=16, ring=3, x_smem=True, x_slice=20), device="cpu")


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("M,config", [(1, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)), (16, Mma(1, warps=8)),
                                      (48, Mma(4, warps=8, rows_per_warp=1, stages=2)),
                                      (128, Large(warps=8, groups=8, stages=4))])
def test_plan_cache_compiles_each_build_once(monkeypatch, bf16, M, config):
    """The launch runs a build of the plan itself (planned for the activations' dtype): a first call compiles no
    kernel twice, e.g. once as fp16 for the plan and again as bf16 for the launch."""
    calls = []

    def compile_kernel(file, name, defines, dev):
        calls.append((file, tuple(sorted(defines.items()))))
        return _FakeKernel(defines)  # what a plan reads of a build, without NVRTC

    monkeypatch.setattr(MM.cuda, "compile_kernel", compile_kernel)
    monkeypatch.setattr(MM, "sm_count", lambda dev: 132)  # an H100, without a GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    cache = MM.PlanCache()
    p, _ = cache.get(4, M, 8192, 4096, "log8", config, bf16, torch.device("cuda"))
    assert p.defines["BF16"] == int(bf16)
    assert calls[-1] == (p.source[0], tuple(sorted(p.defines.items())))
    assert calls[-1] in calls[:-1]  # the launch's build is one the plan made (cached by compile_kernel)


@pytest.mark.parametrize("K,xt", [(4096, False), (2880, True), (520, True), (300, True)])
@pytest.mark.parametrize("M,config", [(1, Mma(1, warps=8, min_ctas=2)), (2, Mma(3, warps=8, min_ctas=2, ring=2)),
                                      (1, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)),
                                      (16, Mma(4, warps=8, stages=2)), (128, Large(warps=8, groups=8, stages=4))])
def test_x_tail_builds(K, xt, M, config):
    """Where K is not a multiple of 256, kernels 1, 3, 4 are built to read x in place up to column K (``XT``); kernel
    7 reads a zero-padded copy and is built as before. Where K is a multiple of 256 nothing changes."""
    p = TP.make_plan(4, M, 2048, K, "log8", config, sms=132, build=lambda k, d: _FakeKernel(d))
    assert p.defines.get("XT", 0) == int(xt and p.kernel != 7)


@pytest.mark.parametrize("N,K,min_ctas,splits", [
    (5120, 8192, 2, 1),   # 320 tiles, 132 SMs: unsplit (it had 4 splits: 1.6x slower)
    (2816, 4096, 4, 1),   # 176 tiles: unsplit
    (2048, 4096, 2, 1),   # 128 tiles: 4 SMs idle, unsplit (split, the dispatcher's c2 took 1.4x at k = 4)
    (1536, 7168, 2, 2),   # 96 tiles: 36 SMs idle, K split
    (576, 7168, 2, 3)])
def test_kernel1_splits_k_only_where_sms_idle(N, K, min_ctas, splits):
    """Kernel 1 splits K only where its tiles leave over a tenth of the SMs without one (lab/m1_splits.py --unsplit
    and lab/rounds/k1split_ab.sh on an H100: with a tile for nearly every SM the split took 1.1-2x the unsplit
    time)."""
    p = TP.make_plan(4, 1, N, K, "log8", Mma(1, warps=8, min_ctas=min_ctas), sms=132, build=lambda k, d: _FakeKernel(d))
    assert p.splits == splits
    assert p.grid <= 132 * min_ctas


@pytest.mark.parametrize("N,min_ctas,grid", [
    (5120, 2, 264),   # 320 tiles: the same 2 tiles each would be 160 CTAs, 28 SMs with 4 tiles; every slot: 3 at most
    (9216, 2, 264),   # 576 tiles: 192 CTAs of 3 put 6 on 60 SMs; every slot: 5 at most
    (8192, 2, 256),   # 512 tiles: 4 at most either way, so the same 2 tiles each
    (4096, 2, 256),   # 256 tiles fit the 264 slots: a CTA a tile
    (5120, 4, 320)])  # 320 tiles fit the 528 slots
def test_kernel1_grid_evens_the_sms(N, min_ctas, grid):
    """Kernel 1 fills every CTA slot only where that leaves an SM fewer tiles to stream than the same tiles a CTA
    (``mma_plan._k1_grid``; H100: 5120x8192 k = 2 M = 1..4 0.84-0.86x the time, benchmarks/results/h100/
    k1-grid-ab-2026-11-27/). Whatever the grid, the CTAs take every item once: an SM's share differs by at most one
    item where every slot is filled."""
    p = TP.make_plan(4, 1, N, 8192, "log8", Mma(1, warps=8, min_ctas=min_ctas), sms=132,
                     build=lambda k, d: _FakeKernel(d))
    assert (p.splits, p.grid) == (1, grid)
    items = p.Nt * p.splits
    share = [sum(-(-(items - c) // p.grid) for c in range(j, min(p.grid, items), 132)) for j in range(132)]
    assert sum(share) == items
    if p.grid == 132 * min_ctas:
        assert max(share) - min(share) <= 1


P5 = Mma(3, warps=16, min_ctas=1, ring=2, x_smem=True, pair_table=True)


def test_pair_table_plan():
    """k = 5 with ``pair_table``: the P5 build with the 128 KB table, x staged beside it up to the whole shared
    memory (one CTA an SM); other k ignore the flag; the flag needs kernel 3 at one CTA an SM."""
    fake = lambda k, d: _FakeKernel(d)  # noqa: E731
    p = TP.make_plan(5, 1, 16384, 16384, "log8", P5, sms=132, build=fake)
    assert p.defines["P5"] == 1 and p.defines["XS"] == 1 and p.shared == TP.table_smem(5, True) + 16384 * 2 + 64
    assert TP.table_smem(5, True) == 1024 * 32 * 4 + 128
    assert TP.make_plan(5, 16, 16384, 16384, "log8", P5, sms=132, build=fake).defines["XS"] == 0  # x: 512 KB
    assert TP.make_plan(5, 1, 8192, 53248, "log8", P5, sms=132, build=fake).defines["XS"] == 0  # 104 KB + 128 KB
    for k in (2, 3, 4):
        p = TP.make_plan(k, 1, 16384, 16384, "log8", P5, sms=132, build=fake)
        assert "P5" not in p.defines and p.shared == TP.table_smem(k) + 16384 * 2 + 64
    assert Mma.of(P5.legacy(5)) == P5
    for bad in (dict(kernel=1, warps=8, min_ctas=1), dict(kernel=3, warps=8, min_ctas=2)):
        with pytest.raises(ValueError, match="config.pair_table: expected kernel 3 at min_ctas 1"):
            Mma(**bad, pair_table=True)


def test_x_staged_in_the_whole_shared_memory_at_one_cta():
    """x is staged beside the table up to ``XS_MAX`` at two or more CTAs an SM and up to the whole shared memory at
    one (M = 16, K = 4096: 132 KB of x rows)."""
    fake = lambda k, d: _FakeKernel(d)  # noqa: E731
    one, two = Mma(3, warps=16, min_ctas=1, ring=3, x_smem=True), Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)
    p = TP.make_plan(4, 16, 4096, 4096, "log8", one, sms=132, build=fake)
    assert p.defines["XS"] == 1 and p.shared == TP.table_smem(4) + TP.x_rows_bytes(16, 16) <= TP.SMEM_MAX
    assert TP.make_plan(4, 16, 4096, 4096, "log8", two, sms=132, build=fake).defines["XS"] == 0
    assert TP.make_plan(4, 16, 4096, 14336, "log8", one, sms=132, build=fake).defines["XS"] == 0  # 459 KB


class _StaticShared(_FakeKernel):
    """A build whose static shared bytes (``static(defines)``) count against what a CTA may use: occupancy 0 where
    they and the dynamic bytes pass it, as ``kbit.cuda.runtime.Kernel.occupancy`` answers."""

    def __init__(self, defines, static):
        super().__init__(defines)
        self.shared_bytes = static(defines)

    def occupancy(self, threads, shared):
        return 0 if self.shared_bytes + shared > 232448 else super().occupancy(threads, shared)


@pytest.mark.parametrize("k, M, N, K, ring", [(2, 1, 100352, 5120, 4), (2, 8, 28672, 4096, 4), (2, 16, 28672, 4096, 2),
                                               (4, 1, 100352, 5120, 2), (2, 1, 5120, 25600, 2)])
def test_cta_units_ring_at_k2(k, M, N, K, ring):
    """CTA-aligned units at k = 2 and one token group run a ring of CAU_K2_RING segments whatever the config asks
    (a ring in the config above it stays); other k, two token groups, prologue and epilogue launches and builds
    without the units keep the config's ring."""
    cfg = Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)
    p = TP.make_plan(k, M, N, K, "log8", cfg, sms=132, build=lambda k, d: _FakeKernel(d))
    assert p.defines["PD"] == ring
    assert bool(p.defines.get("CAU")) == (N > 20000)
    if ring == TU.CAU_K2_RING:
        deep = Mma(3, warps=8, min_ctas=2, ring=6, x_smem=True)
        assert TP.make_plan(k, M, N, K, "log8", deep, sms=132, build=lambda k, d: _FakeKernel(d)).defines["PD"] == 6
        # a prologue's or an epilogue's launch keeps the config's ring (measured on plain launches only)
        for kw in (dict(pro=1), dict(epi=1)):
            p = TP.make_plan(k, M, N, K, "log8", cfg, sms=132, build=lambda k, d: _FakeKernel(d), **kw)
            assert p.defines.get("CAU") and p.defines["PD"] == 2


def test_plan_keeps_to_the_shared_memory_beside_static_bytes():
    """Builds that cannot launch for their static shared bytes are refused: CTA-aligned units' slots beside a staged
    x (43008x5376, M = 16, one CTA an SM: 205952 + 34944 bytes on the H200) leave the units out; a staged x that does
    not fit goes to global memory; a build that fits nowhere is a ``ValueError``, never a driver error at launch."""
    one = Mma(3, warps=16, min_ctas=1, ring=3, x_smem=True)
    plain = TP.make_plan(4, 16, 43008, 5376, "log8", one, sms=132, build=lambda k, d: _FakeKernel(d))
    assert plain.defines["XS"] == 1 and plain.defines.get("CAU") and plain.shared > 232448 - 34944
    slots = lambda d: 34944 if d.get("CAU") else 2048  # noqa: E731
    p = TP.make_plan(4, 16, 43008, 5376, "log8", one, sms=132, build=lambda k, d: _StaticShared(d, slots))
    assert p.defines["XS"] == 1 and not p.defines.get("CAU") and p.shared == plain.shared
    big = lambda d: 40000 if d.get("XS") else 2048  # noqa: E731
    p = TP.make_plan(4, 16, 43008, 5376, "log8", one, sms=132, build=lambda k, d: _StaticShared(d, big))
    assert p.defines["XS"] == 0 and p.shared == TP.table_smem(4)
    with pytest.raises(ValueError, match="static, more than a CTA may use"):
        TP.make_plan(4, 16, 43008, 5376, "log8", one, sms=132, build=lambda k, d: _StaticShared(d, lambda d: 240000))


def test_pair_table_in_the_search_space_at_k5_only():
    from kbit.tuning.space import search_space

    for k in (2, 3, 4, 5):
        cands = search_space(k, 1, 16384, 16384, families=("mma",), quick=True)
        assert any(c.config.pair_table for c in cands) == (k == 5)


def test_validation_errors():
    codes, scales, ts, cb = make_weight(4, 64, 4)
    kw = dict(k=4, blocksize=32, scale_format="log8", N=4, K=64)
    with pytest.raises(TypeError, match="x"):
        MM.linear_small_m(torch.randn(2, 64), codes, scales, ts, cb, **kw)
    with pytest.raises(ValueError, match="x"):
        MM.linear_small_m(torch.randn(2, 63).half(), codes, scales, ts, cb, **kw)
    with pytest.raises(ValueError, match="codes"):
        MM.linear_small_m(torch.randn(2, 64).half(), codes[:, :-1], scales, ts, cb, **kw)
    with pytest.raises(ValueError, match="k"):
        MM.linear_small_m(torch.randn(2, 64).half(), codes, scales, ts, cb, **{**kw, "k": 6})


def test_fallback_matches_reference_on_cpu():
    """Without the CUDA kernels (CPU), the dispatcher's small-M call is the Triton GEMV: same answer as the reference;
    the CUDA op itself says it cannot run here."""
    if CUDA:
        pytest.skip("CPU fallback only")
    codes, scales, ts, cb = make_weight(9, 96, 4)
    x = torch.randn(3, 96, dtype=torch.float16)
    kw = dict(k=4, blocksize=32, scale_format="log8", N=9, K=96)
    with pytest.raises(ValueError, match="CUDA device"):
        MM.linear_small_m(x, codes, scales, ts, cb, **kw)
    y = D.small_m(x, codes, scales, ts, cb, **kw)
    assert rel_err(y, gemv_reference(x, codes, scales, ts, cb, **kw)) < tol(torch.float16)


def test_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    codes, scales, ts, cb = make_weight(8, 64, 4)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (torch.randn(2, 3, 64).half(), codes, scales, ts, cb)]
        y = torch.ops.kbit.linear_small_m(*args, 4, 32, "log8", 8, 64, None)
    assert y.shape == (2, 3, 8) and y.dtype == torch.float16


# ------------------------------------------------------------------------------------- GPU
def check(N, K_, k, M, dtype, B=32, sf="log8", bias=False, x=None, seed=0, config=None):
    codes, scales, ts, cb = make_weight(N, K_, k, B, sf, device="cuda", seed=seed)
    if x is None:  # seeded: with few outputs (N = 1, M = 3) an unlucky x made the relative error exceed the bound
        gen = torch.Generator(device="cuda").manual_seed(7919 + seed)
        x = torch.randn(M, K_, dtype=dtype, device="cuda", generator=gen)
    b = torch.randn(N, dtype=dtype, device="cuda") if bias else None
    kw = dict(k=k, blocksize=B, scale_format=sf, N=N, K=K_, bias=b)
    lead = x.shape[:-1]
    torch.full((*lead, N), float("nan"), dtype=x.dtype, device="cuda")  # poison the allocator's next block
    y = MM.linear_small_m(x, codes, scales, ts, cb, config=config, **kw)
    ref = gemv_reference(x, codes, scales, ts, cb, **kw)
    assert y.shape == (*lead, N) and y.dtype == x.dtype
    err = rel_err(y, ref)
    # the kernel multiplies by the codebook rounded to x's dtype: against that reference only the output
    # rounding is left (tight); against the exact one the codebook rounding adds up to ~2**-9 (bf16) a weight,
    # which with few outputs (N = 1) can exceed the usual tolerance by chance
    ref_r = gemv_reference(x, codes, scales, ts, cb.to(x.dtype).float(), **kw)
    err_r = rel_err(y, ref_r)
    msg = f"k={k} N={N} K={K_} M={M} {x.dtype} B={B} {sf}: rel err {err:.2e} / {err_r:.2e} (rounded codebook)"
    assert err_r < tol(x.dtype) / 2 and err < 2 * tol(x.dtype), msg


gpu = pytest.mark.skipif(not (CUDA and MC.kernels_available()), reason="needs the CUDA kernel (GPU + NVRTC)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64])
def test_mma_gpu_m(k, dtype, M):
    check(2880, 5120, k, M, dtype, seed=M)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("N,K_", [(5120, 2880), (18944, 1), (1, 18944), (2880, 1), (17, 300), (4096, 4096)])
def test_mma_gpu_odd_shapes(k, N, K_):
    check(N, K_, k, 3, torch.bfloat16, bias=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("K_", [520, 1000, 1408, 2880])
@pytest.mark.parametrize("M,config", [(1, Mma(1, warps=8, min_ctas=2)), (3, Mma(1, warps=4, min_ctas=3)),
                                      (1, Mma(3, warps=8, min_ctas=2, ring=2)),
                                      (5, Mma(3, warps=8, min_ctas=2, ring=3, x_smem=True)),
                                      (12, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True, x_slice=2)),
                                      (16, Mma(4, warps=8, stages=2)), (40, Mma(4, warps=4, rows_per_warp=2)),
                                      (96, None)])
def test_mma_gpu_x_tail_read_in_place(K_, M, config):
    """K not a multiple of 256: x is read in place (no padded copy) and its columns from K on are NaN here (x is a
    view of a wider NaN-filled tensor), so a kernel that reads past K (into a block's padding columns, whose codes
    are nonzero values, or into the zero-weight padding) gives a wrong or NaN output."""
    N = 2048 + 16 * M
    wide = torch.full((M, -(-K_ // 256) * 256 + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    x = wide[:, :K_]
    x.copy_(torch.randn(M, K_, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(M)))
    assert MC.x_rows(x, -(-K_ // 256)) is x
    for k in (2, 4, 5):
        check(N, K_, k, M, torch.bfloat16, x=x, bias=True, config=config, seed=K_ + k)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 3, 8, 16, 33])
@pytest.mark.parametrize("N,K_,B,sf", [(2880, 5120, 32, "log8"), (5120, 2880, 64, "fp16"), (17, 300, 32, "log8"),
                                       (1000, 4000, 128, "log8"), (4096, 53248, 32, "log8")])
def test_mma_gpu_pair_table(M, N, K_, B, sf):
    """k = 5's pair table (``P5``: one shared load a pair of codes from the 1024-entry table) against the float64
    reference: both activation dtypes, x staged and read from global memory (K = 53248: x does not fit beside the
    table), K not a multiple of 256, bias."""
    for dtype in (torch.bfloat16, torch.float16):
        check(N, K_, 5, M, dtype, B=B, sf=sf, bias=N % 2 == 1, seed=M + N, config=P5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("K_", [1000, 2880])
def test_mma_gpu_x_tail_prepared_launch(K_):
    """The prepared decode launch (``kbit.dispatch.linear.fast_linear``) takes K not a multiple of 256 (a multiple
    of 8): x read in place, eager and in a CUDA graph, against the float64 reference."""
    N, k = 4096, 4
    codes, scales, ts, cb = make_weight(N, K_, k, device="cuda", seed=K_)
    rc, rs = LY.repack(codes, scales, k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    x = torch.randn(1, K_, dtype=torch.bfloat16, device="cuda")
    assert MM.prepare_repacked(x, rc, rs, ts, cb, **kw) is not None
    ref = gemv_reference(x, codes, scales, ts, cb, **kw)
    y = D.linear_mma_v1(x, rc, rs, ts, cb, **kw)
    assert rel_err(y, ref) < tol(torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = D.linear_mma_v1(x, rc, rs, ts, cb, **kw)
    x.copy_(torch.randn_like(x))
    g.replay()
    assert rel_err(yg, gemv_reference(x, codes, scales, ts, cb, **kw)) < tol(torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,sf", [(64, "log8"), (128, "log8"), (32, "fp16"), (64, "fp16")])
def test_mma_gpu_formats(B, sf):
    for k in (2, 3, 4, 5):
        check(1000, 4000, k, 5, torch.float16, B=B, sf=sf, bias=True)


@pytest.mark.gpu
@gpu
def test_mma_gpu_3d_noncontiguous_bias_dtypes():
    x = torch.randn(2, 3, 2 * 512, dtype=torch.float16, device="cuda")[..., ::2]
    check(300, 512, 4, 0, torch.float16, x=x, bias=True)
    x = torch.randn(1024, 5, dtype=torch.bfloat16, device="cuda").t()  # column-major
    check(700, 1024, 3, 0, torch.bfloat16, x=x)
    codes, scales, ts, cb = make_weight(64, 512, 4, device="cuda")
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    for bdt in (torch.float16, torch.bfloat16, torch.float32):
        b = torch.randn(64, dtype=bdt, device="cuda")
        kw = dict(k=4, blocksize=32, scale_format="log8", N=64, K=512, bias=b)
        y = torch.ops.kbit.linear_small_m(x, codes, scales, ts, cb, 4, 32, "log8", 64, 512, b)
        assert rel_err(y, gemv_reference(x, codes, scales, ts, cb, **kw)) < tol(torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [
    Mma(1, warps=8, min_ctas=2),
    Mma(1, warps=2, min_ctas=3),
    Mma(1, warps=8),
    Mma(3, warps=8, min_ctas=2, ring=2),
    Mma(3, warps=8, min_ctas=2, ring=3, x_smem=True),
    Mma(3, warps=4, min_ctas=4, ring=4),
    Mma(4, warps=8, stages=2),
    Mma(4, warps=4, rows_per_warp=2),
    Mma(4, warps=16, stages=2),
])
def test_mma_gpu_configs_split_k(config):
    """Kernels 1, 3, 4, several warps / depths: small N forces split K (workspace + last-arriver fix-up), twice in
    a row (the workspace and counters must be left clean); many tiles make CTAs / warps loop over items."""
    for _ in range(2):
        check(64, 8192, 4, 2, torch.float16, bias=True, config=config)
        check(2048, 768, 2, 1, torch.bfloat16, config=config)
    check(28672, 1024, 3, 9, torch.float16, bias=True, config=config)
    check(5000, 4096, 5, 17, torch.bfloat16, config=config)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K_,k,M", [(6144, 1024, 4, 16), (6144, 1024, 2, 12), (16384, 512, 2, 16),
                                      (16384, 512, 3, 9), (6144, 1024, 4, 4), (10240, 520, 2, 2), (5120, 2880, 5, 8),
                                      (12288, 1000, 2, 1), (8000, 300, 2, 7), (7168, 1000, 4, 3), (8000, 520, 3, 1)])
def test_mma_gpu_default_routes_m2_16(N, K_, k, M):
    """The default configs of 1 <= M <= 16 on these shapes (kernel 3 on mid-size and, at k = 2, tall N; kernel 1
    a tile a CTA below 16 x 3 (k = 2: 4, 6) x SMs rows)."""
    check(N, K_, k, M, torch.bfloat16, seed=M)
    check(N, K_, k, M, torch.float16, bias=True, seed=M + 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [
    Mma(3, warps=8, min_ctas=2, ring=2),
    Mma(3, warps=4, min_ctas=4, ring=3),
    Mma(3, warps=16, ring=2, x_smem=True),
    Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True),
])
def test_mma_gpu_cta_units(monkeypatch, config):
    """Kernel 3 with CTA-aligned units (``CAU``), forced on every shape (no efficiency floor): CTAs of many tiles
    with ranges longer than a tile, tiles over many warps of one CTA (64x8192: 4 CTAs), N not a multiple of 16,
    M 1..8, bias, fp16 / bf16; each twice, and bit-identical run to run (the parts are added in warp order)."""
    monkeypatch.setattr(TU, "CAU_MIN_EFF", 0.0)
    monkeypatch.setattr(TU, "CAU_IDLE_US", float("inf"))
    MM.PLANS.clear()
    try:
        for N, K_, k, M, dtype, bias in [(28672, 4096, 4, 1, torch.bfloat16, False),
                                         (6144, 1024, 2, 3, torch.float16, True),
                                         (1000, 4000, 5, 8, torch.bfloat16, False),
                                         (64, 8192, 3, 2, torch.float16, True),
                                         (12288, 2880, 2, 1, torch.bfloat16, False)]:
            assert MM.plan_launch(k, M, N, K_, config=config).defines.get("CAU") == 1
            for _ in range(2):
                check(N, K_, k, M, dtype, bias=bias, config=config, seed=N)
            codes, scales, ts, cb = make_weight(N, K_, k, 32, "log8", device="cuda", seed=1)
            x = torch.randn(M, K_, dtype=dtype, device="cuda")
            kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_, config=config)
            y1 = MM.linear_small_m(x, codes, scales, ts, cb, **kw)
            assert torch.equal(y1, MM.linear_small_m(x, codes, scales, ts, cb, **kw))
    finally:
        MM.PLANS.clear()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [3, 4, 5])
@pytest.mark.parametrize("config", [
    Mma(1, warps=8, min_ctas=2),
    Mma(1, warps=4, min_ctas=4),
    Mma(1, warps=8, min_ctas=3),
])
def test_mma_gpu_kernel1_warp_order(k, config):
    """Kernel 1 at k in ``K1WO_K`` and M <= 8 adds its warps' sums in warp order: correct (bias, N not a multiple
    of 16), and where K is not split across CTAs (splits == 1) 40 repeated calls are bit-identical (with the
    earlier shared-memory atomics 1-2 of 50 differed on 4096x4096, det-probe-2026-11-22.log)."""
    assert k in TP.K1WO_K
    assert MM.plan_launch(k, 16, 4096, 4096, config=config).defines["K1WO"] == 0
    for N, K_, M, dtype, bias in [(4096, 4096, 1, torch.bfloat16, False), (1000, 4000, 3, torch.float16, True),
                                  (4096, 2048, 8, torch.bfloat16, False)]:
        p = MM.plan_launch(k, M, N, K_, config=config)
        assert p.defines["K1WO"] == 1
        check(N, K_, k, M, dtype, bias=bias, config=config, seed=N)
        if p.splits != 1:
            continue
        codes, scales, ts, cb = make_weight(N, K_, k, 32, "log8", device="cuda", seed=1)
        x = torch.randn(M, K_, dtype=dtype, device="cuda")
        kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_, config=config)
        y1 = MM.linear_small_m(x, codes, scales, ts, cb, **kw)
        for _ in range(40):
            assert torch.equal(y1, MM.linear_small_m(x, codes, scales, ts, cb, **kw))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [
    Mma(3, warps=16, ring=3, x_smem=True, x_slice=8),
    Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True, x_slice=4),
    Mma(3, warps=4, min_ctas=2, ring=4, x_smem=True, x_slice=2),
    Mma(3, warps=16, ring=2, x_smem=True, x_slice=8),
])
def test_mma_gpu_x_slices(config):
    """Kernel 3 with K slices of x in shared memory (config[5]): a last slice shorter than the others (K = 5120:
    20 segments), one slice wider than K (K = 300), K not a multiple of 256, many slices with split tiles added
    through the workspace (twice: it must be left clean), bias, fp16 scales, blocksizes 64 / 128, M 1..32."""
    for _ in range(2):
        check(2880, 5120, 4, 16, torch.bfloat16, bias=True, config=config)
    check(64, 8192, 2, 9, torch.float16, config=config)
    check(17, 300, 5, 13, torch.float16, B=128, config=config)
    check(1000, 4000, 3, 16, torch.bfloat16, B=64, sf="fp16", bias=True, config=config)
    check(5000, 4096, 4, 1, torch.float16, config=config)
    check(4096, 2048, 2, 32, torch.bfloat16, config=config)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_mma_gpu_x_staged_one_cta(k):
    """Kernel 3 at one CTA an SM with x staged in more shared memory than two CTAs could hold (M = 9..16 rows of
    K = 4096, 74-132 KB), K not a multiple of 256, bias, both dtypes, against the float64 reference; and x rows of
    K = 5200 (201 KB), beside which CTA-aligned units' static slots of 16 warps do not fit (such a build launched
    with a driver error before the plan counted a build's static bytes)."""
    cfg = Mma(3, warps=16, min_ctas=1, ring=3, x_smem=True)
    for M in (9, 16):
        check(4096, 4096, k, M, torch.bfloat16, bias=True, config=cfg, seed=M)
        check(2064, 4000, k, M, torch.float16, config=cfg, seed=M + 1)
    p, kern = MM.PLANS.get(k, 16, 2064, 5200, "log8", cfg, True, torch.device("cuda"))
    assert p.defines["XS"] == 1 and p.shared + kern.shared_bytes <= runtime._smem_optin(torch.cuda.current_device())
    check(2064, 5200, k, 16, torch.bfloat16, config=cfg, seed=3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("M", [9, 16, 17, 24, 32, 48, 64])
def test_mma_gpu_default_routes_m9_64(monkeypatch, k, M):
    """The built-in routes of 9 <= M <= 64 (no tuned table entry) on a weight of >= 5e7 elements with N >= 8192: on
    sm_90 kernel 3 (M <= 16: CTA-aligned units where the plan takes them (this shape, below BIG weights), else x
    slices) and kernel 7 (32- and 64-token tiles, stream-K); kernel 4 elsewhere. Then the routes the GPU's tuned
    table picks, which may differ (its nearest tuned shapes vote), against the same reference."""
    N, K_ = 10000, 5120
    check(N, K_, k, M, torch.bfloat16, bias=True, seed=M)  # the tuned table's route, as a user runs it
    monkeypatch.setattr(MM, "_tuned", lambda *a: None)
    if torch.cuda.get_device_capability() == (9, 0):
        assert T.uses_large(M, N, K_, "cuda") == (M > 16)
        if M <= 16:
            d = MM.plan_launch(k, M, N, K_).defines
            if T.cau_mid(k, N, K_, torch.cuda.get_device_properties(0).multi_processor_count):
                assert d.get("CAU") == 1 and d["XK"] == 0
            else:
                assert d["XK"] == 8
    check(N, K_, k, M, torch.bfloat16, bias=True, seed=M + 2)
    check(N, K_, k, M, torch.float16, seed=M + 1)


@pytest.mark.gpu
@gpu
def test_mma_gpu_cuda_graph():
    codes, scales, ts, cb = make_weight(512, 1024, 4, device="cuda")
    kw = dict(k=4, blocksize=32, scale_format="log8", N=512, K=1024)
    x = torch.randn(2, 1024, dtype=torch.float16, device="cuda")
    MM.linear_small_m(x, codes, scales, ts, cb, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = MM.linear_small_m(x, codes, scales, ts, cb, **kw)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, gemv_reference(x, codes, scales, ts, cb, **kw)) < tol(torch.float16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K_,k,M,config", [
    # kernel 3: 4 tiles x 32 segments over thousands of warps (32 parts a tile)
    (64, 8192, 4, 1, Mma(3, warps=8, min_ctas=2, ring=2)),
    # kernel 3, x in shared memory: CTA-aligned units (q/k/v of Llama-3-8B)
    (6144, 4096, 4, 1, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)),
    # kernel 3, x in shared memory, DET slots (whole tiles a CTA: 79% busy)
    (5000, 4096, 4, 1, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)),
    (4096, 4096, 2, 2, None),  # the default route (kernel 1) at M = 2
    (64, 8192, 2, 3, Mma(1, warps=2, min_ctas=3)),  # kernel 1, split K over many CTAs
    (2048, 14336, 5, 8, Mma(1, warps=4, min_ctas=4)),  # kernel 1, 4-warp CTAs
    # x slices asked for: dropped (their parts are not in memory order)
    (2880, 5120, 4, 16, Mma(3, warps=16, ring=3, x_smem=True, x_slice=8)),
])
def test_mma_gpu_deterministic(monkeypatch, N, K_, k, M, config):
    """With deterministic algorithms on (torch's flag or kbit.options' deterministic), tiles split over several warps /
    CTAs add their parts in a fixed order: repeated calls and graph replays give bit-identical outputs (the
    default fp32 atomics in arrival order need not)."""
    on = dataclasses.replace(options.get(), deterministic=True)
    monkeypatch.setattr(options, "get", lambda: on)
    assert MC.deterministic()
    if N in (6144, 5000):
        assert ("CAU" in MM.plan_launch(k, M, N, K_, config=config).defines) == (N == 6144)
    codes, scales, ts, cb = make_weight(N, K_, k, device="cuda", seed=N + k)
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_, config=config)
    x = torch.randn(M, K_, dtype=torch.bfloat16, device="cuda")
    y0 = MM.linear_small_m(x, codes, scales, ts, cb, **kw)
    for i in range(30):
        if i % 3 == 0:  # other work on the GPU in between shifts the arrival order
            torch.randn(1 << 20, device="cuda").sum()
        assert torch.equal(MM.linear_small_m(x, codes, scales, ts, cb, **kw), y0), i
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = MM.linear_small_m(x, codes, scales, ts, cb, **kw)
    for i in range(10):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y0), i
    kw.pop("config")
    assert rel_err(y0, gemv_reference(x, codes, scales, ts, cb, **kw)) < tol(torch.bfloat16)


sm90 = pytest.mark.skipif(not (CUDA and MC.kernels_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="kernel 7 (wgmma) is sm_90a only")


@pytest.mark.gpu
@gpu
@sm90
@pytest.mark.parametrize("M", [17, 24, 33, 64])
def test_mma_gpu_small_weight_m17_64(M):
    """Small weights at M 17..64 take kernel 1 (SMALL_MID_CFG), not kernel 7; M 65..256 on them goes to
    dequantize + cuBLAS (test_large_gpu_cuda_graph_and_dispatch)."""
    assert not T.uses_large(M, 1024, 4096, "cuda") and T.large_serves(M, 1024, 4096)
    assert MM.plan_launch(4, M, 1024, 4096, device="cuda").kernel == 1
    check(1024, 4096, 4, M, torch.bfloat16, seed=5)
    check(4000, 4096, 3, M, torch.float16, bias=True, seed=6)


@pytest.mark.gpu
@gpu
@sm90
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [33, 64, 65, 128, 200, 257])
def test_large_gpu_m(k, dtype, M):
    """Kernel 7 through the default route (M 33..64 on weights of >= 2e7 elements, every M > 64): partial token
    tiles."""
    N = 2880 if M > T.MAX_M else 4000
    assert T.uses_large(M, N, 5120, "cuda")
    check(N, 5120, k, M, dtype, seed=M)


@pytest.mark.gpu
@gpu
@sm90
@pytest.mark.parametrize("config", [
    Large(warps=16, groups=8),
    Large(warps=12, groups=16),
    Large(warps=8, groups=32, stages=3),
    Large(warps=8, groups=16, stages=6),
    Large(warps=4, groups=16, stages=3),
    Large(warps=12, groups=16, stream_k=True),
    Large(warps=8, groups=32, stream_k=True),
    Large(warps=16, groups=8, stages=5),
    Large(warps=8, groups=4, stages=6, x_bulk=1, stream_k=True),
    Large(warps=12, groups=8, stages=6, x_bulk=1, stream_k=True),
])
def test_large_gpu_configs_split_k_formats(config):
    """Every tile shape, both x layouts, both x loaders (cp.async; bulk copies with the CTA barrier or empty
    mbarriers), split K and stream-K: one row block (twice: the workspace must be left clean), odd N and K with
    bias, fp16 scales, blocksizes 64 / 128, many tasks a CTA (persistent loop, raster groups)."""
    for _ in range(2):
        check(64, 8192, 4, 100, torch.float16, bias=True, config=config)
    check(1000, 4000, 3, 300, torch.bfloat16, B=64, sf="fp16", bias=True, config=config)
    check(17, 300, 5, 129, torch.float16, B=128, config=config)
    check(28672, 1024, 2, 520, torch.bfloat16, config=config)


@pytest.mark.gpu
@gpu
@sm90
def test_large_gpu_x_tiles():
    """kbit_x_tiles (kernel 7's bulk-copy x layout) equals its torch definition: partial token blocks, both
    dtypes, a strided x."""
    for M, Kw, bt, dt in [(1, 256, 128, torch.float16), (100, 512, 128, torch.bfloat16),
                          (300, 4096, 256, torch.bfloat16), (257, 768, 64, torch.float16)]:
        x = torch.randn(M, Kw + 64, dtype=dt, device="cuda")[:, :Kw]
        assert torch.equal(MC.x_tiles(x, bt, Kw // 256), MC.x_tiles_reference(x, bt, Kw // 256))


@pytest.mark.gpu
@gpu
@sm90
@pytest.mark.parametrize("M", [300, 1000, 2100])
def test_large_gpu_default_route_large_m(M):
    """The default kernel 7 configs above 256 rows (256-token tiles, bulk-copied x, no stream-K), a big weight
    beyond LARGE7_MAX_M."""
    assert T.large_serves(M, 2880, 5120) == (M <= T.LARGE7_MAX_M)
    check(2880, 5120, 4, M, torch.bfloat16, seed=M)
    check(1000, 700, 3, M, torch.float16, seed=M + 1)


@pytest.mark.gpu
@gpu
@sm90
def test_large_gpu_cuda_graph_and_dispatch():
    codes, scales, ts, cb = make_weight(512, 1024, 4, device="cuda")
    kw = dict(k=4, blocksize=32, scale_format="log8", N=512, K=1024)
    x = torch.randn(300, 1024, dtype=torch.bfloat16, device="cuda")
    assert D.choice(300, 512, 1024, 4, x.device).kernel == "gemv" and D.serves(x, 512, 1024, 4)  # kernel 7
    assert D.choice(200, 512, 1024, 4, x.device).kernel != "gemv"  # small weight, 65..256 rows: dequant + cuBLAS
    assert D.choice(3000, 512, 1024, 4, x.device).kernel != "gemv"  # beyond LARGE7_MAX_M on small weights
    y0 = D.linear(x, codes, scales, ts, cb, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = D.linear(x, codes, scales, ts, cb, **kw)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y0)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, gemv_reference(x, codes, scales, ts, cb, **kw)) < tol(torch.bfloat16)


def test_launch_config_structs_match_the_driver_abi():
    """``cuLaunchKernelEx``'s structs as the runtime declares them (CUDA 12 ``cuda.h``: CUlaunchConfig 56 bytes,
    hStream at 32, attrs at 40, numAttrs at 48; CUlaunchAttribute 72 bytes, value at 8); options.pdl toggles."""
    import ctypes

    from kbit.cuda import runtime as R

    assert ctypes.sizeof(R._LaunchConfig) == 56 and ctypes.sizeof(R._LaunchAttribute) == 72
    assert (R._LaunchConfig.hStream.offset, R._LaunchConfig.attrs.offset, R._LaunchConfig.numAttrs.offset) == \
        (32, 40, 48)
    assert R._LaunchAttribute.value.offset == 8
    with options.override(pdl=False):
        assert not R.pdl_enabled("cpu")


def test_workspace_growth_keeps_replaced_buffers():
    """A larger split-K workspace replaces the cached one, but the replaced buffers stay allocated (CUDA graphs
    captured before and prepared launchers hold their addresses); each part only grows, at least doubling."""
    dev = torch.device("cpu")
    saved, saved_old = dict(MC._WS), list(MC._WS_OLD)
    try:
        MC._WS.pop(dev, None)
        ws1, cnt1 = MC.workspace(dev, 10, 10)
        assert ws1.numel() >= 1 << 16 and cnt1.numel() >= 4096 and not ws1.any() and not cnt1.any()
        n_old = len(MC._WS_OLD)
        ws2, cnt2 = MC.workspace(dev, ws1.numel() + 1, 5)
        assert ws2.numel() >= 2 * ws1.numel() and cnt2.numel() == cnt1.numel()
        assert len(MC._WS_OLD) == n_old + 1 and MC._WS_OLD[-1][0] is ws1 and MC._WS_OLD[-1][1] is cnt1
        assert MC.workspace(dev, 100, 100)[0] is ws2  # smaller requests reuse the current buffers
    finally:
        MC._WS.clear()
        MC._WS.update(saved)
        MC._WS_OLD[:] = saved_old


def test_prepare_repacked_declines_off_gpu():
    """The prepared launcher is CUDA-only: on the CPU it checks the arguments and declines (None)."""
    N, K = 64, 512
    codes, scales, ts, cb = make_weight(N, K, 4, 32, "log8", device="cpu")
    rc, rs = LY.repack(codes, scales, k=4, blocksize=32, scale_format="log8", N=N, K=K)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    assert MM.prepare_repacked(x, rc, rs, ts, cb, k=4, scale_format="log8", N=N, K=K) is None
    with pytest.raises(ValueError):
        MM.prepare_repacked(x[:, :100], rc, rs, ts, cb, k=4, scale_format="log8", N=N, K=K)


def test_prepared_launch_argument_offsets():
    """``runtime.arg_offsets``: where the pointer arguments of a prepared launch sit in the packed buffer (native
    alignment, as ``struct.pack`` lays them out), and a clear error for an argument that is not a pointer."""
    import struct

    from kbit.cuda import runtime as R

    fmt = "QQQQQQQQQQiiiiiiiiii"
    assert R.arg_offsets(fmt, (5, 6)) == (40, 48)
    assert R.arg_offsets("iQiQ", (1, 3)) == (8, 24)
    buf = bytearray(struct.pack("@iQiQ", 1, 2, 3, 4))
    for off, v in zip(R.arg_offsets("iQiQ", (1, 3)), (77, 88), strict=True):
        struct.pack_into("@Q", buf, off, v)
    assert struct.unpack("@iQiQ", bytes(buf)) == (1, 77, 3, 88)
    with pytest.raises(ValueError, match="indices"):
        R.arg_offsets(fmt, (11,))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k,M", [(2, 1), (4, 1), (3, 8), (4, 16), (5, 40), (4, 100)])
def test_gpu_pdl_dependent_chain(k, M):
    """Each call reads the previous call's output (programmatic dependent launch: a kernel may start before the
    previous one ends and must wait before it reads x), and a torch kernel sits between two of them; eager and
    replayed from a CUDA graph, against float64 references of each step."""
    from kbit.cuda import runtime as R

    assert R.pdl_enabled("cuda") == (torch.cuda.get_device_capability()[0] >= 9)
    N, K_ = 2048, 3072
    wa = make_weight(N, K_, k, device="cuda", seed=1)
    wb = make_weight(K_, N, k, device="cuda", seed=2)
    wa[2], wb[2] = wa[2] / K_**0.5, wb[2] / N**0.5  # outputs of order 1 through the chain
    ka = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    kb = dict(k=k, blocksize=32, scale_format="log8", N=K_, K=N)
    x = torch.randn(M, K_, dtype=torch.bfloat16, device="cuda")

    def chain():
        y1 = MM.linear_small_m(x, *wa, **ka)
        y2 = MM.linear_small_m(y1, *wb, **kb)
        return y1, y2, MM.linear_small_m(y2 * 2, *wa, **ka)

    def check_chain(ys):
        refs = (gemv_reference(x, *wa, **ka), gemv_reference(ys[0], *wb, **kb),
                gemv_reference(ys[1] * 2, *wa, **ka))
        for y, r in zip(ys, refs, strict=True):
            assert rel_err(y, r) < tol(torch.bfloat16)

    check_chain(chain())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = chain()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        check_chain(ys)


# ------------------------------------------------------------------------------------- dequantize from "mma-v1"
def test_dequant_repacked_validation():
    codes, scales, ts, cb = make_weight(32, 256, 4)
    kw = dict(k=4, blocksize=32, scale_format="log8", N=32, K=256)
    rc, rs = LY.repack(codes, scales, **kw)
    with pytest.raises(TypeError, match="dtype"):
        MM.dequant_repacked(rc, rs, ts, cb, dtype=torch.float32, **kw)
    with pytest.raises(ValueError, match="rcodes"):
        MM.dequant_repacked(rc[:1], rs, ts, cb, **kw)
    with pytest.raises(ValueError, match="out"):
        MM.dequant_repacked(rc, rs, ts, cb, out=torch.empty(32, 255, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="CUDA device"):  # CPU tensors: a clear error, not a failed kernel build
        MM.dequant_repacked(rc, rs, ts, cb, **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("N,K_,B,sf", [(4096, 4096, 32, "log8"), (37, 300, 32, "log8"), (50, 300, 64, "fp16"),
                                       (1000, 4000, 128, "log8"), (16, 4100, 32, "fp16"), (2880, 5120, 64, "log8")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_repacked_bit_exact(k, N, K_, B, sf, dtype):
    from kbit.ops.dequant import dequantize_tensors

    codes, scales, ts, cb = make_weight(N, K_, k, B, sf, device="cuda", seed=N + k)
    kw = dict(k=k, blocksize=B, scale_format=sf, N=N, K=K_)
    rc, rs = LY.repack(codes, scales, **kw)
    ref = dequantize_tensors(codes, scales, ts, cb, k=k, blocksize=B, scale_format=sf, shape=(N, K_), dtype=dtype)
    torch.full((N, K_), float("nan"), dtype=dtype, device="cuda")  # poison the allocator's next block
    w = MM.dequant_repacked(rc, rs, ts, cb, dtype=dtype, **kw)
    assert w.shape == (N, K_) and w.dtype == dtype
    assert torch.equal(w, ref), f"{(w != ref).sum().item()} of {w.numel()} differ"
    out = torch.full((N, K_), float("nan"), dtype=dtype, device="cuda")
    assert MM.dequant_repacked(rc, rs, ts, cb, dtype=dtype, out=out, **kw) is out and torch.equal(out, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K_,M", [(4096, 4096, 4096), (1000, 4000, 200), (37, 300, 3000)])
def test_linear_mma_v1_dequant_route(N, K_, M):
    """Where the dispatcher picks dequantize + cuBLAS, linear_mma_v1 dequantizes from the repacked layout."""
    codes, scales, ts, cb = make_weight(N, K_, 4, device="cuda", seed=3)
    kw = dict(k=4, blocksize=32, scale_format="log8", N=N, K=K_)
    rc, rs = LY.repack(codes, scales, **kw)
    x = torch.randn(M, K_, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(N, dtype=torch.bfloat16, device="cuda")
    assert not D.serves(x, N, K_, 4) and D.choice(M, N, K_, 4, x.device).kernel == "dequant_mm"
    y = D.linear_mma_v1(x, rc, rs, ts, cb, bias=b, **kw)
    assert rel_err(y, gemv_reference(x, codes, scales, ts, cb, bias=b, **kw)) < tol(torch.bfloat16)


def test_plan_cache_clear_drops_prepared_launchers():
    """Clearing the plan cache (as labs and tests do after changing options that plans depend on) also drops the
    dispatcher's prepared launchers, which were built from the old plans."""
    D._PREPARED["probe"] = False
    MM.PLANS._d["probe"] = None
    assert len(MM.PLANS) >= 1
    MM.PLANS.clear()
    assert "probe" not in D._PREPARED and len(MM.PLANS) == 0
