"""The dense launch choices are the ones recorded from the tree before the restructuring (commit 64014d4, by
``lab/dense_plan_fixture.py`` into ``tests/data/dense_plans.json``): the small-M kernels' configs and launch plans
(defines, grid, shared bytes, splits, workspace), kernel 7's configs, the GEMM table's choices and split-K, the
Triton GEMV's configs and the backend each (k, M, N, K, GPU) goes to. CPU only: the device facts and the NVRTC build
are faked the same way the fixture faked them (:func:`fake_occupancy`). Changed on purpose since: kernel 1 splits K
only where its tiles leave over a tenth of the SMs without one (``kbit.tuning.mma_plan._grid``, 2026-11-27): 394
kernel-1 launches that split K then did not, and 58 split again when the rule went from CTA slots to SMs;
their grids, splits and workspace sizes were rewritten from the new plans, nothing else. Kernel 1's grid fills every
CTA slot where that leaves an SM fewer items (``_k1_grid``, 2026-11-27): the grids of 306 kernel-1 launches
rewritten, nothing else. Kernel 3's staged x rows carry 64 pad bytes (``mma_plan.x_rows_bytes``, 2026-11-28): the
shared bytes of 4038 x-staged launches rewritten (+64 a row), nothing else. CTA-aligned units at k = 2, one token
group, no prologue or epilogue, run a ring of at least ``CAU_K2_RING`` segments (``_grid_k3``, 2026-11-30): the PD
of 228 launches rewritten, nothing else."""

from __future__ import annotations

import json
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kbit.dispatch import linear as D
from kbit.ops import gemv_mma
from kbit.tuning import gemm as TG
from kbit.tuning import gemv as TV
from kbit.tuning import mma as T
from kbit.tuning import mma_plan as TP

DATA = json.loads((Path(__file__).parent / "data" / "dense_plans.json").read_text())
PAL, MS = DATA["palette"], DATA["ms"]
#: name -> (capability, SMs, device name), as in the fixture
DEVICES = {"h100": ((9, 0), 132, "NVIDIA H100 80GB HBM3"), "h100pcie": ((9, 0), 114, "NVIDIA H100 PCIe"),
           "h20": ((9, 0), 78, "NVIDIA H20"), "a100": ((8, 0), 108, "NVIDIA A100-SXM4-80GB"),
           "l40s": ((8, 9), 142, "NVIDIA L40S")}


def fake_occupancy(defines: dict, threads: int, shared: int) -> int:
    """CTAs an SM of a fake build: its MINB (launch bounds), limited by threads and shared memory."""
    return max(1, min(max(1, defines.get("MINB", 1)), 2048 // threads, (228 * 1024) // (shared + 1024)))


class FakeKernel:
    def __init__(self, defines):
        self.defines, self.num_regs = dict(defines), 64

    def occupancy(self, threads, shared):
        return fake_occupancy(self.defines, threads, shared)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``use(name)`` makes torch.cuda answer as GPU ``name`` and the NVRTC build return a :class:`FakeKernel`."""
    from kbit.utils import device as udev

    monkeypatch.setattr(gemv_mma.cuda, "compile_kernel", lambda file, name, defines, device: FakeKernel(defines))
    # the fixture records the built-in rules; a tuned table shipped for a GPU (tuned-h100.json) would answer first
    monkeypatch.setattr(D, "tuned_candidate", lambda *args: None)
    monkeypatch.setattr(gemv_mma, "tuned_candidate", lambda *args: None)

    def use(name):
        cap, sms, dev_name = DEVICES[name]
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: dev_name)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: types.SimpleNamespace(multi_processor_count=sms, name=dev_name))
        udev._sm_count.cache_clear()
        D._choice.cache_clear()
        return torch.device("cuda", 0)

    yield use
    udev._sm_count.cache_clear()
    D._choice.cache_clear()


def mma_config(t) -> T.MmaConfig | T.LargeConfig:
    """The dataclass of a positional config of the old tree: (kernel, warps, X, ...) with per-kernel meanings."""
    t = list(t)
    if t[0] == 7:
        return T.LargeConfig.of(tuple(t))
    if t[0] == 1:
        return T.MmaConfig(1, t[1], min_ctas=t[2], grid_ctas=t[3] if len(t) > 3 else 0)
    if t[0] == 4:
        return T.MmaConfig(4, t[1], rows_per_warp=t[2], stages=t[3] if len(t) > 3 else 3,
                           min_ctas=t[4] if len(t) > 4 else 1)
    return T.MmaConfig(3, t[1], min_ctas=t[2], ring=t[3] if len(t) > 3 else 0, x_smem=bool(len(t) > 4 and t[4]),
                       x_slice=t[5] if len(t) > 5 else 0)


def same_config(a, b, k) -> bool:
    """Equal up to kernel 3's ring depth 0 meaning PIPE[k]."""
    if isinstance(a, T.MmaConfig) and a.kernel == 3:
        a, b = replace(a, ring=a.ring or T.PIPE[k]), replace(b, ring=b.ring or T.PIPE[k])
    return a == b


def test_default_configs():
    for key, row in DATA["default_config"].items():
        k, N, K, sm90, sms = key.split(",")
        k, N, K, sm90, sms = int(k), int(N), int(K), bool(int(sm90)), None if sms == "None" else int(sms)
        for M, i in zip(MS, row, strict=True):
            got, want = T.default_config(k, M, N, K, sm90=sm90, sms=sms), json.loads(PAL[i])
            assert same_config(mma_config(want), got, k), (key, M, got)
            assert same_config(T.MmaConfig.of(want), got, k) and got.legacy(k) == tuple(want), (key, M, got)


def test_large_configs_and_routes():
    for key, row in DATA["large_config"].items():
        k, N, K = map(int, key.split(","))
        for M, i in zip(MS, row, strict=True):
            assert T.large_config(k, M, N, K) == mma_config(json.loads(PAL[i])), (key, M)
    for key, row in DATA["large_serves"].items():
        N, K = map(int, key.split(","))
        for M, v in zip(MS, row, strict=True):
            assert T.large_serves(M, N, K) == bool(v), (key, M)


def test_prologue_configs():
    for key, row in DATA["fused_config"].items():
        k, N, K = map(int, key.split(","))
        for M, i in zip(MS, row, strict=True):
            want, got = json.loads(PAL[i]), TP.prologue_config(k, M, N, K)
            assert (want is None) == (got is None), (key, M)
            if want is not None:
                assert same_config(mma_config(want), got, k), (key, M, got)


def test_gemv_configs(fake_gpu):
    for key, row in DATA["gemv_config"].items():
        k, N, K, gpu = key.split(",")
        k, N, K = int(k), int(N), int(K)
        dev = fake_gpu("h100") if gpu == "h100" else None
        for M, i in zip(MS, row, strict=True):
            assert TV.gemv_config(k, min(M, 8), N, K, dev).as_dict() == json.loads(PAL[i]), (key, M)


@pytest.mark.parametrize("gpu", sorted(DEVICES))
def test_gemm_choices_and_backends(fake_gpu, monkeypatch, gpu):
    dev = fake_gpu(gpu)
    sms = DEVICES[gpu][1]
    for key, row in DATA["choose"].items():
        k, N, K, name, mma = key.split(",")
        if name != gpu:
            continue
        k, N, K = int(k), int(N), int(K)
        for M, i in zip(MS, row, strict=True):
            monkeypatch.setattr(D, "kernels_available", lambda device=None, _v=mma == "1": _v)
            D._choice.cache_clear()
            ch = D.choice(M, N, K, k, dev)
            got = [ch.kernel, ch.config.as_dict(), TG.split_k(ch.config, M, N, -(-K // 32) * 32, sms)]
            assert got == json.loads(PAL[i]), (key, M)
    for key, row in DATA["route"].items():
        k, N, K, name = key.split(",")
        if name != gpu:
            continue
        k, N, K = int(k), int(N), int(K)
        for M, i in zip(MS, row, strict=True):
            got = []
            for mma in (True, False):
                monkeypatch.setattr(D, "kernels_available", lambda device=None, _v=mma: _v)
                D._choice.cache_clear()
                kern = D.choice(M, N, K, k, dev).kernel
                if kern == "gemv" and mma:
                    kern = "mma7" if T.uses_large(M, N, K, dev) else "mma"
                got.append(kern)
            assert ",".join(got) == PAL[i], (key, M)


def enc(d: dict) -> str:
    return ",".join(f"{k}={d[k]}" for k in sorted(d))


@pytest.mark.parametrize("gpu", ["h100", "a100", "h20"])
def test_launch_plans(fake_gpu, monkeypatch, gpu):
    """Every launch of ``linear_small_m`` / ``linear_repacked`` (kernel 7, or chunks of <= 64 rows with the default
    config) and of the prologue / epilogue, planned through ``kbit.ops.gemv_mma.plan_launch``."""
    dev = fake_gpu(gpu)
    n = 0
    for key, launches in DATA["plan"].items():
        k, M, N, K, name, sf, det, pro, epi = key.split(",")
        if name != gpu:
            continue
        k, M, N, K, pro, epi = int(k), int(M), int(N), int(K), int(pro), int(epi)
        S = -(-K // 256)
        if not pro and not epi:
            large = T.uses_large(M, N, K, dev)
            assert isinstance(launches[0][0], list) == large
            if not large:  # chunks of at most MAX_M rows
                assert [m for m, _ in launches] == sorted({min(T.MAX_M, M - m0) for m0 in range(0, M, T.MAX_M)})
        torch.use_deterministic_algorithms(det == "1")
        try:
            for first, want in launches:
                if isinstance(first, list):
                    cfg, m = mma_config(first), M
                    if pro or epi:
                        assert same_config(cfg, TP.prologue_config(k, M, N, K), k)
                    else:
                        assert cfg == T.large_config(k, M, N, K)
                else:
                    cfg, m = None, first
                p = gemv_mma.plan_launch(k, m, N, S * 256, sf, cfg, dev, pro=pro, epi=epi)
                file, kname = p.source
                wsrc, wdefs = PAL[want[0]].split("|")
                wdefs = ",".join(d for d in wdefs.split(",") if not d.startswith("KERNEL="))
                got = [f"{file}:{kname}|{enc(p.defines)}", p.warps, p.grid, p.shared, p.splits, p.sps, p.n_cnt,
                       p.ws_floats, int(p.use_ws), p.ctas_per_sm]
                assert got == [f"{wsrc}|{wdefs}", *want[1:]], (key, first)
                n += 1
        finally:
            torch.use_deterministic_algorithms(False)
    assert n > 2000


def test_rule_tables_are_checked_and_fall_back():
    """A rule with an unknown condition is an error naming it; a GPU without its own table takes default.json's."""
    with pytest.raises(ValueError, match="rule condition"):
        T._matches({"N_minimum": 1}, 4, 1, 4096, 4096, False, None)
    from kbit.tuning import tables

    assert tables.section("no-such-gpu", "mma") == tables.section("generic", "mma") != {}
    assert tables.section("h100", "gemm") and not tables.section("generic", "gemm")
    assert T.default_config(4, 1, 4096, 4096, gpu="no-such-gpu") == T.default_config(4, 1, 4096, 4096)


def test_backend_option_steers_the_choice(fake_gpu, monkeypatch):
    """``kbit.options`` backend: "triton" keeps the CUDA small-M kernels out of the choice (the table decides);
    "auto" and "cuda" let them serve; the choice is cached per options, so an override takes effect at once."""
    from kbit import options

    dev = fake_gpu("h100")
    monkeypatch.setattr(D, "kernels_available", lambda device=None: True)
    assert D.choice(16, 4096, 4096, 4, dev).kernel == "gemv"
    with options.override(backend="triton"):
        assert D.choice(16, 4096, 4096, 4, dev) == TG.gemm_choice(16, 4096, 4096, 4, dev)
    with options.override(backend="cuda"):
        assert D.choice(16, 4096, 4096, 4, dev).kernel == "gemv"
    x = torch.randn(2, 64, dtype=torch.float16)
    w = torch.randn(8, 64)
    from kbit.ops.quantize import quantize

    q = quantize(w, k=4)
    kw = dict(k=4, blocksize=q.blocksize, scale_format=q.scale_format, N=8, K=64)
    with options.override(backend="torch"):  # the float32 reference (on the CPU it is that anyway)
        y = D.linear(x, q.codes, q.scales, q.tensor_scale, q.codebook, **kw)
    from kbit.ops.reference import linear_tensors_reference

    assert torch.equal(y, linear_tensors_reference(x, q.codes, q.scales, q.tensor_scale, q.codebook, **kw))
