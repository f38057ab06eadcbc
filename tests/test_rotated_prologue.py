"""Kernel 3 rotating its staged x (``ROT``, rotate_x.cuh; issue 35): the plan (what it refuses, on the CPU), the
builds for sm_90 through NVRTC (no GPU needed), the launches against float64 ``pre(x) R`` times the dequantized
weight (``-m gpu``), and kbit.dispatch.prologue / the fast decode step using them."""
import math

import pytest
import torch
from torch import nn

from kbit import options
from kbit.cuda import runtime, sources
from kbit.dispatch import prologue as P
from kbit.format import Rotation
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops import gemv_mma, glue
from kbit.ops._rotation import hadamard_reference, rotation_signs
from kbit.tuning.mma import PIPE, MmaConfig
from kbit.tuning.mma_plan import ROT_SCR_MAX, XS_MAX, make_plan, rot_smem, rotation_config, table_smem

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


class _Kern:
    """A fake build: the occupancy its launch bounds ask for."""

    def __init__(self, defines):
        self.defines, self.num_regs = dict(defines), 64

    def occupancy(self, threads, shared):
        return max(1, min(self.defines.get("MINB", 1), 2048 // threads, (228 * 1024) // (shared + 1024)))


def _plan(k, M, N, K, cfg, pro=0, epi=0, rot=0):
    return make_plan(k, M, N, K, "log8", cfg, sms=132, build=lambda kern, d: _Kern(d), pro=pro, epi=epi, rot=rot)


def _cfg(k, x_slice=0, x_smem=True):
    return MmaConfig(kernel=3, warps=8, min_ctas=2, ring=PIPE[k], x_smem=x_smem, x_slice=x_slice)


# ------------------------------------------------------------------------------------------------ plan (CPU)


@pytest.mark.parametrize("K,block", [(4096, 4096), (14336, 2048), (5120, 1024), (11008, 256), (576, 64),
                                     (2880, 64)])
def test_plan_rotates_whole_x(K, block):
    for M, pro in ((1, 0), (1, 2), (4, 2), (8, 0)):
        cfg = rotation_config(3, M, 1024, K, block, _cfg(3), pro=pro)
        S = -(-K // 256)
        rb = rot_smem(block, M, K, pro, table_smem(3) + (M + bool(pro)) * S * 512)
        assert (cfg is not None) == (rb is not None), (M, pro)
        if rb is None:
            continue
        assert cfg.kernel == 3 and cfg.x_smem
        p = _plan(3, M, 1024, K, cfg, pro=pro, rot=block)
        assert p.defines["ROT"] == block and p.defines["XS"] == 1 and p.defines.get("PRO", 0) == pro
        scr = p.defines.get("ROT_SCR", 0)
        assert scr == rb[1] and (scr == 0) == (block <= 256) and scr % block == 0
        assert p.defines.get("ROT_ONE", 0) == int(0 < scr and scr >= M * K)  # every row's first pass held at once
        assert p.shared <= XS_MAX and p.shared == table_smem(3) + (M + bool(pro)) * S * 512 + rb[0]
    # Llama-3-8B at M = 1: q/k/v (add + norm, block 4096) and down_proj (block 2048) hold all rows: one pass
    assert _plan(3, 1, 6144, 4096, _cfg(3), pro=2, rot=4096).defines["ROT_ONE"] == 1
    assert _plan(3, 1, 4096, 14336, _cfg(3), rot=2048).defines["ROT_ONE"] == 1
    d = _plan(3, 2, 4096, 14336, _cfg(3), rot=2048).defines  # two rows of 14336: rounds of the scratch
    assert d["ROT_ONE"] == 0 and d["ROT_SCR"] % 2048 == 0 and d["ROT_SCR"] <= ROT_SCR_MAX


def test_plan_grows_x_slices_to_whole_blocks():
    cfg = rotation_config(3, 2, 4096, 14336, 2048, _cfg(3, x_slice=3))
    assert cfg.x_slice == 8  # 2048 columns: 8 segments
    p = _plan(3, 2, 4096, 14336, cfg, rot=2048)
    assert p.defines["XK"] == 8 and p.defines["ROT"] == 2048
    assert rotation_config(3, 2, 4096, 11008, 256, _cfg(3, x_slice=3)).x_slice == 3  # any slice: whole blocks


def test_plan_refuses_what_it_cannot_rotate():
    with pytest.raises(ValueError, match="rot: a rotation block that is a power of two"):
        _plan(3, 1, 1024, 4096, _cfg(3), rot=96)
    with pytest.raises(ValueError, match="rot: a rotation block that is a power of two"):
        _plan(3, 1, 1024, 4096 + 512, _cfg(3), rot=1024)  # does not divide K
    with pytest.raises(ValueError, match="rot: x slices of 3 segments"):
        _plan(3, 1, 1024, 14336, _cfg(3, x_slice=3), rot=2048)
    with pytest.raises(ValueError, match="rot: the rotation needs kernel 3 with x in shared memory"):
        _plan(3, 1, 1024, 4096, _cfg(3, x_smem=False), rot=4096)
    with pytest.raises(ValueError, match="pro, epi, rot"):
        _plan(3, 1, 1024, 4096, MmaConfig(kernel=1, warps=8, min_ctas=2), rot=4096)
    assert rotation_config(3, 9, 1024, 4096, 4096) is None  # M > 8
    assert rotation_config(3, 1, 1024, 4096, 48) is None
    assert rotation_config(3, 8, 1024, 28672, 4096, pro=2) is None  # x [8, 28672] does not fit


def test_cpu_paths_fall_back():
    """Off CUDA, rotated_linear is the layer's own forward and add_rms_norm_linear the norm kernel's x R."""
    torch.manual_seed(0)
    lin = KbitLinear.from_linear(nn.Linear(128, 64), k=3, dtype=torch.float32, rotation="hadamard", seed=3)
    x = torch.randn(2, 128)
    assert torch.equal(P.rotated_linear(x, lin), lin(x))
    assert not P.rotated_linear_fuses(lin, 2, torch.float16, "cpu")
    signs = rotation_signs(lin.rotation, 128, "cpu")
    torch.testing.assert_close(P.rotated_linear(x, lin, signs), lin(x))
    with pytest.raises(ValueError, match=r"signs: expected a contiguous int8 tensor of shape \(128,\)"):
        P.rotated_linear(x, lin, signs.float())
    res, w = torch.randn(2, 128), 1 + 0.1 * torch.randn(128)
    z, r = P.add_rms_norm_linear(x, res, w, 1e-5, lin, signs=signs)
    h, _ = glue.rms_norm_reference(x, w, 1e-5, res)
    torch.testing.assert_close(z, lin(h), rtol=1e-4, atol=1e-4)
    assert torch.equal(r, res + x)


def _nvrtc_ok() -> bool:
    try:
        runtime.nvrtc_version()
    except Exception:  # noqa: BLE001 - no NVRTC here: the compile test is skipped
        return False
    return True


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC not loadable here (options.nvrtc_lib / KBIT_NVRTC_LIB)")
@pytest.mark.parametrize("k,M,K,block,pro,epi,x_slice", [(3, 1, 4096, 4096, 2, 0, 0), (3, 1, 14336, 2048, 0, 0, 0),
                                                         (4, 8, 4096, 64, 2, 1, 0), (2, 2, 14336, 2048, 0, 0, 8),
                                                         (5, 3, 2880, 64, 0, 0, 0), (3, 1, 8192, 8192, 2, 1, 0),
                                                         (3, 2, 14336, 2048, 0, 0, 0), (4, 4, 4096, 4096, 2, 1, 0),
                                                         (3, 5, 11008, 256, 0, 0, 5)])
def test_rotating_builds_compile_for_sm90(k, M, K, block, pro, epi, x_slice):
    cfg = rotation_config(k, M, 4096, K, block, _cfg(k, x_slice), pro=pro)
    p = _plan(k, M, 4096, K, cfg, pro=pro, epi=epi, rot=block)
    for bf16 in (0, 1):
        with options.override(cache_dir=None):
            cubin = sources.compile_source("gemv_mma_streamk.cu", {**p.defines, "BF16": bf16}, "sm_90")
        assert cubin[:4] == b"\x7fELF" and b"kbit_gemv_mma_streamk" in cubin


# ------------------------------------------------------------------------------------------------ GPU


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _lin(N, K, k, dtype, seed, block):
    """A rotated k-bit layer on CUDA with rotation block ``block`` (smaller than Rotation.for_width's: an unrotated
    weight relabelled, which the kernel cannot tell apart: it multiplies x by R and reads what is stored)."""
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=False, device="cuda")
    if Rotation.for_width(K, seed).block == block:
        q = KbitLinear.from_linear(lin, k=k, dtype=dtype, rotation="hadamard", seed=seed)
    else:
        q = KbitLinear.from_linear(lin, k=k, dtype=dtype)
        q.rotation = Rotation(seed, block)
    return q.repack_for_kernels()


def _w64(lin):
    """The layer's weight as the kernel reads it (``W R``, dequantized) in float64."""
    return dequantize_reference(lin.weight(), torch.float64)


def _pre64(x, res, w, pro, eps=1e-5):
    if pro == 0:
        return x.double()
    h, _ = glue.rms_norm_reference(x.double(), w.double(), eps, res.double() if pro == 2 else None)
    return h


CASES = [(576, 64), (2880, 64), (5120, 1024), (11008, 256), (4096, 4096), (4096, 512), (14336, 2048),
         (4096, 8), (2048, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,block", CASES)
@pytest.mark.parametrize("pro,epi", [(0, 0), (1, 0), (2, 0), (2, 1)])
def test_rot_launch_gpu(dtype, K, block, pro, epi):
    """One kernel 3 launch: y = (pre(x) R) W'^T (W' = the dequantized rotated weight), pre the identity, RMSNorm or
    residual add + RMSNorm, optionally SiLU * up of the two halves; y poisoned before. k cycles over 2..5 with the
    case (each k meets every prologue), M over 1..8 (fewer where x does not fit in shared memory)."""
    k = 2 + (CASES.index((K, block)) + pro + epi) % 4
    N = 512
    M = 1 + (K + k + pro) % 8
    while gemv_mma.rotation_launch_config(k, M, N, K, block, "cuda", pro=pro) is None:  # x too big: fewer rows
        M -= 1
    assert M >= 1
    cfg = gemv_mma.rotation_launch_config(k, M, N, K, block, "cuda", pro=pro)
    lin = _lin(N, K, k, dtype, K + k, block)
    g = torch.Generator().manual_seed(M * K + pro)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    res = torch.randn(M, K, generator=g).to(dtype).cuda()
    w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).cuda()
    signs = rotation_signs(lin.rotation, K, x.device)
    y = torch.full((M, N // 2 if epi else N), float("nan"), dtype=dtype, device="cuda")
    r = torch.full_like(res, float("nan"))
    p = (pro, res if pro == 2 else None, r if pro == 2 else None, w, 1e-5) if pro else None
    xin = x if pro else gemv_mma.prep_x(x, lin.codes.shape[1])
    gemv_mma.launch(xin, lin.codes, lin.scales, lin.tensor_scale, lin.codebook, None, y, k=k,
                    scale_format=lin.scale_format, N=N, K=K, M=M, config=cfg, pro=p, epi=epi, rot=(block, signs))
    torch.cuda.synchronize()
    h = _pre64(x, res, w, pro)
    if pro:  # the kernel rounds the normalised row to x's dtype before it rotates
        h = h.to(dtype).double()
    z = hadamard_reference(h, signs.cpu().double().to(h.device), block).double() @ _w64(lin).T.to(h.device)
    want = torch.nn.functional.silu(z[:, :N // 2]) * z[:, N // 2:] if epi else z
    assert torch.isfinite(y).all()
    assert _rel(y, want) < TOL[dtype], (M, K, block)
    if pro == 2:
        assert torch.equal(r, res + x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("K,x_slice", [(14336, 8), (11008, 5), (5120, 4)])
def test_rot_x_slices_gpu(dtype, M, K, x_slice):
    """ROT with K slices (XK): each CTA rotates the whole blocks of its slice."""
    k, N = 3, 1024
    block = Rotation.for_width(K, 0).block
    lin = _lin(N, K, k, dtype, M + K, block)
    cfg = rotation_config(k, M, N, K, block, _cfg(k, x_slice))
    assert cfg.x_slice and (cfg.x_slice * 256) % block == 0
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype).cuda()
    signs = rotation_signs(lin.rotation, K, x.device)
    y = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    gemv_mma.launch(gemv_mma.prep_x(x, lin.codes.shape[1]), lin.codes, lin.scales, lin.tensor_scale, lin.codebook,
                    None, y, k=k, scale_format=lin.scale_format, N=N, K=K, M=M, config=cfg, rot=(block, signs))
    torch.cuda.synchronize()
    want = hadamard_reference(x.double(), signs.double(), block) @ _w64(lin).T.cuda()
    assert torch.isfinite(y).all() and _rel(y, want) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K,block,pro,one", [(1, 4096, 4096, 2, 1), (4, 4096, 4096, 2, 0), (1, 14336, 2048, 0, 1),
                                               (2, 14336, 2048, 0, 0), (8, 4096, 512, 0, 0), (3, 1024, 1024, 2, 1),
                                               (7, 576, 64, 2, None), (6, 2880, 64, 1, None)])
def test_rot_modes_gpu(dtype, M, K, block, pro, one):
    """Each way rotate_x.cuh works (ROT_ONE 1: the norm / staging loop fills the scratch, one pass after; 0: rounds
    of the scratch after the staging; None: blocks of 256 columns or fewer, in registers) against float64."""
    k, N = 3, 768
    cfg = rotation_config(k, M, N, K, block, _cfg(k), pro=pro)  # x staged whole (no K slices): the mode is fixed
    plan = gemv_mma.plan_launch(k, M, N, K, config=cfg, pro=pro, rot=block)
    assert plan.defines.get("ROT_ONE") == one and plan.defines["ROT"] == block
    lin = _lin(N, K, k, dtype, M * K + pro, block)
    g = torch.Generator().manual_seed(M + K)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    res = torch.randn(M, K, generator=g).to(dtype).cuda()
    w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).cuda()
    signs = rotation_signs(lin.rotation, K, x.device)
    y = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    r = torch.full_like(res, float("nan"))
    p = (pro, res if pro == 2 else None, r if pro == 2 else None, w, 1e-5) if pro else None
    gemv_mma.launch(x if pro else gemv_mma.prep_x(x, lin.codes.shape[1]), lin.codes, lin.scales, lin.tensor_scale,
                    lin.codebook, None, y, k=k, scale_format=lin.scale_format, N=N, K=K, M=M, config=cfg, pro=p,
                    rot=(block, signs))
    torch.cuda.synchronize()
    h = _pre64(x, res, w, pro)
    h = h.to(dtype).double() if pro else h
    want = hadamard_reference(h, signs.double(), block) @ _w64(lin).T.cuda()
    assert torch.isfinite(y).all() and _rel(y, want) < TOL[dtype]


def _spy(monkeypatch):
    calls = []
    real = gemv_mma.launch

    def spy(*a, pro=None, epi=0, rot=None, **kw):
        calls.append((pro[0] if pro else 0, epi, rot[0] if rot else 0))
        return real(*a, pro=pro, epi=epi, rot=rot, **kw)

    monkeypatch.setattr(gemv_mma, "launch", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 6144, 4096), (3, 1024, 2880), (8, 28672, 4096), (2, 4096, 14336),
                                   (1, 4096, 14336)])
def test_prologue_ops_one_launch_gpu(monkeypatch, dtype, M, N, K):
    """add_rms_norm_linear (with and without SiLU * up) and rotated_linear on a rotated layer: one kernel 3 launch
    each where x (and the norm weight) fit in shared memory, no rotating launch otherwise; the same numbers as the
    unfused steps (norm kernel's x R / rotate, then forward_rotated)."""
    lin = _lin(N, K, 3, dtype, N + K, Rotation.for_width(K, 0).block)
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    res = torch.randn(M, K, generator=g).to(dtype).cuda()
    w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).cuda()
    calls = _spy(monkeypatch)
    y = P.rotated_linear(x, lin)
    assert calls == [(0, 0, lin.rotation.block)]
    assert _rel(y, lin(x)) < TOL[dtype] / 2
    fused = rotation_config(3, M, N, K, lin.rotation.block, pro=gemv_mma.PRO_ADD_NORM) is not None
    assert fused == (K != 14336 or M == 1)  # x [M, 14336] + the norm weight fit beside the table at M = 1 only
    for silu in (False, True):
        calls.clear()
        z, r = P.add_rms_norm_linear(x, res, w, 1e-5, lin, silu_mul=silu)
        if fused:
            assert calls == [(gemv_mma.PRO_ADD_NORM, gemv_mma.EPI_SILU if silu else 0, lin.rotation.block)]
        else:
            assert not [c for c in calls if c[2]]
        assert torch.equal(r, res + x)
        h, _ = glue.add_rms_norm(x, res, w, 1e-5, rotation=lin.rotation)
        want = lin.forward_rotated(h)
        if silu:
            want = glue.silu_mul(want[:, :N // 2], want[:, N // 2:])
        assert _rel(z, want) < TOL[dtype] / 2, silu
    assert P.rotated_linear_fuses(lin, M, dtype, x.device)


def _greedy(model, ids, n, graph=False):
    from kbit.hf.decode import StaticDecoder  # noqa: PLC0415 (needs transformers)

    dec = StaticDecoder(model, ids.shape[0], ids.shape[1] + n, graph=graph, fast=True)
    toks, logits = [dec.prefill(ids).clone()], [dec.logits.clone()]
    for _ in range(n - 1):
        toks.append(dec.step().clone())
        logits.append(dec.logits.clone())
    return torch.stack(toks, 1), torch.stack(logits)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_rotated_fast_step_gpu(monkeypatch, k):
    """A small random Llama quantized under rotations (bf16, CUDA; hidden 512 and intermediate 1536: blocks of 512,
    the scratch path): the fast step runs its projections as rotating kernel 3 launches (no standalone rotate),
    4 a layer a step (3 in layer 0, whose q/k/v input has no residual add yet), its greedy tokens equal the path
    without ROT (the glue kernels rotate), its logits follow the model's own forward; CUDA graphs equal eager."""
    transformers = pytest.importorskip("transformers")
    from kbit.hf import fast_decode, quantize_model  # noqa: PLC0415 (needs transformers)

    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    model = quantize_model(model, k=k, progress=False, rotation="hadamard")
    ids = torch.tensor([[1, 5, 9, 33, 2], [7, 3, 3, 60, 11]], device="cuda")
    n = 6
    with torch.no_grad():  # the model's own forward (every layer rotates its input), dynamic cache
        out = model(ids, use_cache=True)
        own = []
        for _ in range(n):
            own.append(out.logits[:, -1].float())
            out = model(own[-1].argmax(-1).view(-1, 1), past_key_values=out.past_key_values, use_cache=True)
    own = torch.stack(own)
    with monkeypatch.context() as m:  # today's path: no ROT
        m.setattr(P, "rotation_launch_config", lambda *a, **kw: None)
        ref_t, ref_l = _greedy(model, ids, n)
    rotates = []
    real_rotate = fast_decode.rotate
    monkeypatch.setattr(fast_decode, "rotate", lambda *a, **kw: rotates.append(1) or real_rotate(*a, **kw))
    calls = _spy(monkeypatch)
    t, lg = _greedy(model, ids, n)
    rot_launches = [c for c in calls if c[2]]
    assert not rotates and len(rot_launches) == (n - 1) * 7, calls
    assert sum(c[0] == gemv_mma.PRO_ADD_NORM and c[1] == gemv_mma.EPI_SILU for c in rot_launches) == (n - 1) * 2
    assert torch.equal(t, ref_t)
    assert _rel(lg, ref_l) < 1e-2 and _rel(lg, own) < 2e-2
    gt, gl = _greedy(model, ids, n, graph=True)
    assert torch.equal(gt, t) and _rel(gl, lg) < 1e-2
    assert math.isfinite(gl.sum().item())
