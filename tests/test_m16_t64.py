"""T64 (csrc/common.cuh: the k = 4 lookup table of 256-byte rows) in kernels 1 and 3 at M = 2..16 and in kernel 7 on
tiles of up to 64 tokens, planned only when kbit.tuning.mma_plan's knobs T64_MAX_M / T64_LARGE_GROUPS say so (off by
default): where the plan takes it (CPU, fake builds), and on the GPU bit-identical to the
same plan built without it (deterministic split-K sums on; K-sliced, LFX and kernel 7 builds, outside deterministic
mode, within fp32 reordering) and as close to the float64 reference as the kernels' own tests ask."""

import dataclasses
import types

import pytest
import torch

from kbit import cuda as KC
from kbit import options
from kbit.ops import gemv_mma as MM
from kbit.ops.mma import common as MC
from kbit.ops.mma import layout as LY
from kbit.ops.reference import gemv_reference
from kbit.tuning import mma_plan as TP
from kbit.tuning.mma import LargeConfig as Lg
from kbit.tuning.mma import MmaConfig as Mma

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and MC.kernels_available()), reason="needs the CUDA kernel (GPU + NVRTC)")


class _Built:
    """A fake build: its MINB CTAs an SM, limited by threads and shared memory (as tests/test_dense_plans.py)."""

    num_regs = 64

    def __init__(self, defines):
        self.defines = dict(defines)

    def occupancy(self, threads, shared):
        return max(1, min(max(1, self.defines.get("MINB", 1)), 2048 // threads, (228 * 1024) // (shared + 1024)))


def _plan(k, M, N, K, cfg, t64=True, pro=0):
    return TP.make_plan(k, M, N, K, "log8", cfg, sms=132, build=lambda kernel, d: _Built(d), t64=t64, pro=pro)


CFGS = (Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True), Mma(3, warps=8, min_ctas=2, ring=2),
        Mma(3, warps=16, min_ctas=1, ring=3, x_smem=True, x_slice=8), Mma(1, warps=8, min_ctas=2),
        Mma(1, warps=4, min_ctas=4))


@pytest.fixture
def t64_mid(monkeypatch):
    """T64 planned at M > 1 (off by default: measured no faster, kbit.tuning.mma_plan.T64_MAX_M)."""
    monkeypatch.setattr(TP, "T64_MAX_M", 16)
    monkeypatch.setattr(TP, "T64_LARGE_GROUPS", 8)


def test_t64_off_at_m_above_1_by_default():
    """With the default knobs no launch at M > 1 takes T64 (kernels 1, 3, 7), M = 1 keeps it."""
    for M in (1, 2, 8, 16, 32, 64):
        for cfg in (*CFGS, Lg(warps=8, groups=4, stages=6, stream_k=True), Lg(warps=12, groups=8, stages=6)):
            if getattr(cfg, "x_slice", 0) and M > 16:  # x slices of 16+ tokens do not fit
                continue
            p = _plan(4, M, 9216, 4096, cfg)
            assert bool(p.defines.get("T64")) == (M == 1 and cfg.kernel in (1, 3) and not cfg.x_slice
                                                  and cfg.min_ctas <= 3), (M, cfg, p.defines)


def test_t64_mid_m_plans(t64_mid):
    """With T64_MAX_M = 16: T64 changes exactly the plans of kernel 3 up to M = 16 and kernel 1 up to M = 8 at k = 4
    where the table fits at the config's CTAs an SM, and never a prologue at M > 1: the define and the table's bytes
    in place of the 16-entry table's, everything else as without it."""
    seen, seen_lfx = set(), set()
    for N, K in ((4096, 4096), (28672, 4096), (9216, 4096), (5120, 17408), (1000, 1000)):
        for k in (2, 4):
            for M in (2, 4, 8, 12, 16, 24):
                for cfg in CFGS:
                    on, off = _plan(k, M, N, K, cfg), _plan(k, M, N, K, cfg, t64=False)
                    if not on.defines.get("T64"):
                        assert (on.defines, on.shared) == (off.defines, off.shared)
                        continue
                    seen.add((cfg.kernel, M <= 8, bool(on.defines.get("XK")), bool(on.defines.get("XS"))))
                    assert k == 4 and M <= (TP.T64_MAX_M if cfg.kernel == 3 else 8)
                    seen_lfx.add(bool(on.defines.get("LFX")))
                    assert {n: v for n, v in on.defines.items() if n != "T64"} == off.defines
                    assert on.shared - off.shared == TP.T64_SMEM - TP.table_smem(4) and on.shared <= TP.SMEM_MAX
                    if on.defines.get("XS") and not on.defines.get("XK"):
                        assert on.shared <= TP.XS_MAX
    assert {(3, True, False, True), (3, False, True, True), (3, False, False, False), (1, True, False, False)} <= seen
    assert seen_lfx == {False, True}
    p = _plan(4, 2, 4096, 4096, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True), pro=2)
    assert "T64" not in p.defines and p.defines["PRO"] == 2


def test_t64_kernel7_plans(t64_mid):
    """With T64_LARGE_GROUPS = 8: kernel 7 (dense, M <= 64) takes T64 at k = 4 on tiles of at most 8 token groups,
    with the same stages where they fit; never grouped (MoE) builds."""
    for k in (2, 4):
        for groups, warps in ((4, 8), (8, 12), (8, 16), (16, 12), (32, 8)):
            cfg = Lg(warps=warps, groups=groups, stages=6, stream_k=True)
            on, off = _plan(k, 8 * groups, 28672, 4096, cfg), _plan(k, 8 * groups, 28672, 4096, cfg, t64=False)
            if k == 4 and groups <= TP.T64_LARGE_GROUPS:
                assert {n: v for n, v in on.defines.items() if n != "T64"} == off.defines and on.defines["T64"] == 1
                assert on.shared - off.shared == TP.T64_SMEM - TP.table_smem(4) and on.shared <= TP.SMEM_MAX
            else:
                assert (on.defines, on.shared) == (off.defines, off.shared)
            d, _ = TP.large_defines(k, cfg, grouped=True, t64=True)
            assert "T64" not in d


def _weight(N, K_, k, sf, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(-(2**31), 2**31 - 1, (N, K_ * k // 32), generator=g, dtype=torch.int32)
    if sf == "log8":
        scales = torch.randint(0, 64, (N, K_ // 32), generator=g, dtype=torch.uint8)
        scales[:, 0] = 255  # an all-zero block
        ts = torch.rand((), generator=g) + 0.5
    else:
        scales = (torch.rand(N, K_ // 32, generator=g) + 0.05).half()
        ts = torch.ones(())
    cb = torch.sort(torch.rand(2**k, generator=g) * 2 - 1).values
    return [t.cuda() for t in (codes, scales, ts, cb)]


def _run(p, defines, shared, x, rc, rs, ts, cb, N):
    """One launch of plan p's kernel built with defines and that many bytes of dynamic shared memory."""
    dev, M = x.device, x.shape[0]
    kern = KC.compile_kernel(*TP.KERNELS[p.kernel], defines, dev)
    x2 = MC.prep_x(x, p.S)
    x_stride = x2.stride(0)
    if p.defines.get("XB"):  # kernel 7: x as its bulk-copy tiles (as gemv_mma.launch makes them)
        x2, x_stride = MC.x_tiles(x2, 8 * p.defines["NG"], p.S), p.S * 4
    y = torch.full((M, N), float("nan"), dtype=x.dtype, device=dev)
    ws, cnt = MC.workspace(dev, p.ws_floats, p.n_cnt) if p.use_ws else (y, y)
    args = MM._kernel_args(p, rc, rs, ts, cb, x2.data_ptr(), y.data_ptr(), None, ws, cnt, M, N, x_stride,
                           y.stride(0))
    kern((p.grid,), p.warps * 32, MM._ARGS_FMT, *args, shared=shared, pdl=True)
    torch.cuda.synchronize()
    return y


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K_,M,config,det", [
    (6144, 4096, 2, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True), True),  # x staged, CTA-aligned units
    (5000, 4096, 3, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True), True),  # odd tile count
    (4100, 5120, 4, Mma(3, warps=8, min_ctas=2), True),  # x from global memory, N not a multiple of 16
    (9216, 4096, 8, Mma(3, warps=8, min_ctas=2), True),
    (6144, 4096, 12, Mma(3, warps=16, min_ctas=1, ring=2), True),  # two token groups, M not a multiple of 8
    (9216, 4096, 16, Mma(3, warps=8, min_ctas=2, ring=2), False),  # the CTA-local fix-up (LFX, not deterministic)
    (5120, 17408, 16, Mma(3, warps=16, min_ctas=1, ring=3, x_smem=True, x_slice=8), False),  # K slices (M = 16)
    (5000, 8192, 13, Mma(3, warps=16, min_ctas=1, ring=3, x_smem=True, x_slice=8), False),  # odd N and M
    (2048, 14336, 3, Mma(1, warps=8, min_ctas=2), True),  # kernel 1
    (1000, 4096, 8, Mma(1, warps=4, min_ctas=3), True),  # kernel 1, 3 CTAs an SM
    (9216, 4096, 32, Lg(warps=8, groups=4, stages=6, stream_k=True), False),  # kernel 7 (stream-K: arrival order)
    (5000, 5120, 50, Lg(warps=12, groups=8, stages=6, stream_k=True), False),  # kernel 7, odd N and M
    (4096, 14336, 64, Lg(warps=16, groups=8, stages=6, stream_k=True), False),  # kernel 7, 16 warps
])
@pytest.mark.parametrize("sf", ["log8", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_t64_mid_m_bit_identical(monkeypatch, t64_mid, N, K_, M, config, det, sf, dtype):
    """det False: split-K parts added in arrival order (K slices: deterministic mode does not take them)."""
    k = 4
    if isinstance(config, Lg) and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("kernel 7 runs on sm_90 only")
    on = dataclasses.replace(options.get(), deterministic=det)
    monkeypatch.setattr(options, "get", lambda: on)
    p = MM.plan_launch(k, M, N, K_, scale_format=sf, config=config)
    if not p.defines.get("T64"):  # the plan of this GPU leaves it out: build it from the plan's defines anyway
        assert torch.cuda.get_device_capability() != (9, 0), f"sm_90 plan without T64: {p.defines}"
        shared_t = p.shared - TP.table_smem(k) + TP.T64_SMEM
        p = types.SimpleNamespace(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})
        p.defines, p.shared = {**p.defines, "T64": 1}, shared_t
    base = {n: v for n, v in p.defines.items() if n != "T64"}
    base["BF16"] = int(dtype == torch.bfloat16)
    shared0 = p.shared - TP.T64_SMEM + TP.table_smem(k)
    codes, scales, ts, cb = _weight(N, K_, k, sf, seed=N + M)
    rc, rs = LY.repacked(codes, scales, k=k, blocksize=32, scale_format=sf, N=N, K=K_)
    x = torch.randn(M, K_, dtype=dtype, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N + M))
    y0 = _run(p, base, shared0, x, rc, rs, ts, cb, N)
    y1 = _run(p, {**base, "T64": 1}, p.shared, x, rc, rs, ts, cb, N)
    ref = gemv_reference(x, codes, scales, ts, cb, k=k, blocksize=32, scale_format=sf, N=N, K=K_)
    tol = 4e-3 if dtype == torch.float16 else 2.4e-2
    for y in (y0, y1):
        err = ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < tol, f"rel err {err:.2e}"
    if not det:  # split-K parts added in arrival order: the last bit may differ
        d = ((y0.double() - y1.double()).norm() / y0.double().norm()).item()
        assert d < 1e-2, f"T64 differs: relative {d:.2e}"
    else:
        assert torch.equal(y0, y1), f"T64 differs: max |diff| {(y0.float() - y1.float()).abs().max().item()}"
