"""Weights held once: ``KbitLinear`` / ``KbitMoE`` in the small-M kernels' layout "mma-v1" (``repack_for_kernels``).

CPU (reference path; Triton interpreter for the fp16 kernels): after repacking a module holds no canonical copy,
its outputs are unchanged, ``state_dict`` / ``kbit.save_file`` / ``kbit.save_quantized`` write the same
tensors and metadata, and loading round-trips bit-exactly. GPU (marked ``gpu``): after a forward a module
holds 1x its k-bit weight bytes (not 2x: no cached repacked copy), and its outputs equal those of the
functional ops on the canonical tensors (which cache a repacked copy).
"""

import gc
import os
import weakref

import pytest
import torch
from torch import nn

CUDA = torch.cuda.is_available()
if not CUDA:  # kernels run under the Triton interpreter; it must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kbit.dispatch import linear as D  # noqa: E402
from kbit.dispatch.moe import MoePlan, grouped_gemm_repacked  # noqa: E402
from kbit.format.pack import unpack  # noqa: E402
from kbit.nn import KbitLinear, KbitMoE, repack_for_kernels  # noqa: E402
from kbit.ops import gemv_mma  # noqa: E402
from kbit.ops import grouped_mma as GM  # noqa: E402
from kbit.ops.mma import common as MC  # noqa: E402
from kbit.ops.mma import layout as LY  # noqa: E402

GEMV, GROUPED_MM, GEMM = MoePlan("gemv", "gemv"), MoePlan("grouped_mm", "grouped_mm"), MoePlan("gemm", "gemm")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _lin(k=4, N=48, K=300, B=32, sf="log8", bias=True, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias, dtype=torch.float32, device=device)
    return KbitLinear.from_linear(lin, k=k, blocksize=B, scale_format=sf, dtype=dtype)


def _copy(sd):
    return {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in sd.items()}


def _assert_same_state(a: dict, b: dict):
    assert list(a) == list(b)
    for n in a:
        if isinstance(a[n], torch.Tensor):
            assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
        else:
            assert a[n] == b[n], n


# ------------------------------------------------------------------------------------------------ repack / unrepack


def _repack_bits(codes, k, blocksize, N, K):
    """The layout's bit-level definition (the first implementation of ``repack``): codes of lane 4g + t in the
    order (u, h, j, r, e) (k = 2: (u, h, e, j, r)), a k-bit little-endian stream over 4k words."""
    Kp, Nt, S = LY.geometry(N, K, blocksize)
    c = torch.zeros(Nt * 16, S * 256, dtype=torch.int32)
    c[:N, :Kp] = unpack(codes, k, Kp)
    order = (0, 3, 2, 5, 4, 6, 8, 7, 1) if k == 2 else (0, 3, 2, 5, 4, 6, 7, 1, 8)  # [T, r, g, S, u, t, h, j, e] ->
    c = c.view(Nt, 2, 8, S, 8, 4, 2, 2, 2).permute(*order).reshape(Nt, S, 32, 128)
    bits = ((c[..., None] >> torch.arange(k, dtype=torch.int32)) & 1).to(torch.int64).reshape(Nt, S, 32, 4 * k, 32)
    w = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.view(Nt, S, 32, k, 4).permute(0, 1, 3, 2, 4)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("chunk", [None, 3])
def test_repack_unrepack_bytes_match_bit_definition(k, chunk, monkeypatch):
    """The byte-level repack / unrepack (fast paths at k = 2, 4; chunks of row tiles, padded or not) against the
    bit-level definition, and the general path (k = 3, 5) run at k = 2, 4 too."""
    if chunk:
        monkeypatch.setattr(LY, "_chunk_tiles", lambda S, k, device: chunk)
    g = torch.Generator().manual_seed(k)
    for N, K, B, sf in [(37, 100, 32, "log8"), (50, 300, 64, "fp16"), (1, 2880, 128, "log8"), (96, 512, 32, "log8"),
                        (100, 512, 32, "fp16"), (5, 1, 32, "log8")]:
        Kp, Nt, S = LY.geometry(N, K, B)
        codes = torch.randint(-(2**31), 2**31 - 1, (N, Kp * k // 32), generator=g, dtype=torch.int32)
        scales = torch.randint(0, 255, (N, Kp // B), generator=g, dtype=torch.uint8) if sf == "log8" else \
            (torch.rand(N, Kp // B, generator=g) + 0.1).half()
        rc, rs = LY.repack(codes, scales, k=k, blocksize=B, scale_format=sf, N=N, K=K)
        assert torch.equal(rc, _repack_bits(codes, k, B, N, K)), (N, K, B)
        c2, s2 = LY.unrepack(rc, rs, k=k, blocksize=B, N=N, K=K)
        assert torch.equal(c2, codes) and torch.equal(s2, scales), (N, K, B)
        if k in (2, 4):
            gen = torch.empty_like(rc)
            LY._to_mma(LY._pad_rows(codes, Nt, S, k), gen, k, general=True)
            assert torch.equal(gen, rc)
            full = torch.empty(16 * Nt, S * 256 * k // 32, dtype=torch.int32)
            LY._from_mma(rc, full, k, general=True)
            assert torch.equal(full[:N, : Kp * k // 32], codes)


@pytest.mark.parametrize("N", [32, 20])  # N % 16 == 0: one matrix; else expert by expert
def test_unrepack_stack_round_trip(N):
    g = torch.Generator().manual_seed(N)
    E, K, k = 3, 200, 3
    codes = torch.randint(-(2**31), 2**31 - 1, (E, N, 224 * k // 32), generator=g, dtype=torch.int32)
    scales = torch.randint(0, 255, (E, N, 7), generator=g, dtype=torch.uint8)
    rc, rs = LY.repack_stack(codes, scales, k=k, blocksize=32, scale_format="log8", N=N, K=K)
    c2, s2 = LY.unrepack_stack(rc, rs, k=k, blocksize=32, N=N, K=K)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)
    sel = torch.tensor([2, 0])
    w = LY.RepackedWeight(rc, rs, torch.ones(E), torch.linspace(-1, 1, 8), (E, N, K), k, 32)
    c3, s3 = w.canonical_tensors(sel)
    assert torch.equal(c3, codes[sel]) and torch.equal(s3, scales[sel])


# ------------------------------------------------------------------------------------------------ KbitLinear


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("B,sf", [(32, "log8"), (64, "fp16")])
def test_linear_repacked_holds_one_copy_same_outputs_and_state(k, B, sf):
    q = _lin(k, B=B, sf=sf)
    x = torch.randn(3, 5, 300)
    y0 = q(x)
    sd0 = _copy(q.state_dict())
    canonical = [weakref.ref(q.codes), weakref.ref(q.scales)]
    assert q.layout == "canonical" and "layout" not in repr(q)

    assert q.repack_for_kernels() is q and q.layout == "mma-v1" and "layout='mma-v1'" in repr(q)
    gc.collect()
    assert all(r() is None for r in canonical)  # the canonical tensors are gone, not kept beside the repacked
    _, Nt, S = LY.geometry(48, 300, B)
    assert q.codes.shape == (Nt, S, k, 32, 4) and q.scales.shape == (Nt, S, 8, 16)
    assert not any(t.shape == sd0["codes"].shape for t in q.buffers())
    assert torch.equal(q(x), y0)
    assert q.repack_for_kernels() is q  # idempotent

    # state dict: the canonical tensors, same keys, same extra state
    sd = q.state_dict()
    _assert_same_state(sd, sd0)
    fresh = KbitLinear(300, 48, k=k, blocksize=B, scale_format=sf, dtype=torch.float32)
    fresh.load_state_dict(sd)
    assert fresh.layout == "canonical" and torch.equal(fresh(x), y0)
    rep = KbitLinear(300, 48, k=k, blocksize=B, scale_format=sf, dtype=torch.float32).repack_for_kernels()
    rep.load_state_dict(sd0)
    assert rep.layout == "mma-v1" and torch.equal(rep.codes, q.codes) and torch.equal(rep.scales, q.scales)
    assert torch.equal(rep(x), y0)
    with pytest.raises((ValueError, RuntimeError)):
        KbitLinear(300, 48, k=5 if k != 5 else 4, blocksize=B, scale_format=sf).repack_for_kernels() \
            .load_state_dict(sd0)

    # weight(): canonical (unrepacked copies); kernel_weight(): the repacked buffers
    w = q.weight()
    assert torch.equal(w.codes, sd0["codes"]) and torch.equal(w.scales, sd0["scales"])
    kw = q.kernel_weight()
    assert kw.layout == "mma-v1" and kw.codes is q.codes
    assert torch.equal(kw.canonical().codes, sd0["codes"])

    q.to_canonical()
    assert q.layout == "canonical" and torch.equal(q.codes, sd0["codes"]) and torch.equal(q.scales, sd0["scales"])
    assert torch.equal(q(x), y0)


def test_linear_repacked_bytes_equal_canonical_bytes():
    """Whole tiles and segments (N % 16 == 0, K % 256 == 0, blocksize 32): the repacked buffers take exactly
    the canonical bytes."""
    q = _lin(4, N=64, K=512)
    before = _nbytes(q.buffers())
    q.repack_for_kernels()
    assert _nbytes(q.buffers()) == before


def test_linear_cpu_cache_follows_layout_and_load():
    a, b = _lin(3, seed=1), _lin(3, seed=2)
    x = torch.randn(4, 300)
    ya, yb = a(x), b(x)
    a.repack_for_kernels()
    assert torch.equal(a(x), ya)
    a.load_state_dict(b.state_dict())  # in place into a repacked module: the CPU cache must not serve a's weight
    assert a.layout == "mma-v1" and torch.equal(a(x), yb)


def test_linear_repacked_torch_compile_cpu():
    q = _lin(4).repack_for_kernels()
    x = torch.randn(3, 300)
    f = torch.compile(q, backend="eager", fullgraph=True)
    assert torch.equal(f(x), q(x))


@pytest.mark.skipif(CUDA, reason="CPU: the Triton interpreter")
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_functional_repacked_ops_equal_canonical_interpreter(k):
    """Without the CUDA kernels the dispatcher runs a weight held in layout "mma-v1" on an unrepacked temporary:
    bit-equal to the canonical call."""
    from kbit.ops.gemv import grouped_gemv

    linear = D.linear

    qw = _lin(k, N=40, K=96, bias=False).weight()
    rw = LY.RepackedWeight.from_canonical(qw)
    x = torch.randn(3, 96).half()
    kw = dict(k=k, blocksize=32, scale_format="log8", N=40, K=96)
    parts = (qw.tensor_scale, qw.codebook)
    assert torch.equal(D.linear_mma_v1(x, rw.codes, rw.scales, *parts, **kw),
                       linear(x, qw.codes, qw.scales, *parts, **kw))
    x32 = x.float()
    assert torch.equal(D.linear_mma_v1(x32, rw.codes, rw.scales, *parts, **kw),
                       linear(x32, qw.codes, qw.scales, *parts, **kw))
    assert torch.equal(torch.ops.kbit.linear_mma_v1(x32, rw.codes, rw.scales, *parts, k, 32, "log8", 40, 96),
                       linear(x32, qw.codes, qw.scales, *parts, **kw))
    # a stack of 3 experts: the grouped form
    torch.manual_seed(k)
    from kbit.ops.quantize import quantize

    st = quantize(torch.randn(3, 40, 96), k=k)
    rst = LY.RepackedWeight.from_canonical(st)
    rows = torch.tensor([0, 2, 1, 1], dtype=torch.int32)
    ids = torch.tensor([2, 0, 0, 1], dtype=torch.int32)
    assert torch.equal(grouped_gemm_repacked(x, rows, ids, rst),
                       grouped_gemv(x, rows, ids, st.codes, st.scales, st.tensor_scale, st.codebook, **kw))


def _same_file(a, b):
    """Same metadata, names, dtypes and bytes of every tensor (the header's order of the names varies between
    two saves of the same tensors: not a byte comparison)."""
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        assert fa.metadata() == fb.metadata()
        assert sorted(fa.keys()) == sorted(fb.keys())
        for n in fa.keys():
            ta, tb = fa.get_tensor(n), fb.get_tensor(n)
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), n
    assert a.stat().st_size == b.stat().st_size


def test_save_file_same_content(tmp_path):
    import kbit

    q = _lin(5, B=64)
    kbit.save_file({"proj.weight": q.weight()}, tmp_path / "a.safetensors")
    q.repack_for_kernels()
    kbit.save_file({"proj.weight": q.weight()}, tmp_path / "b.safetensors")
    _same_file(tmp_path / "a.safetensors", tmp_path / "b.safetensors")


def test_repack_for_kernels_model():
    m = nn.Sequential(_lin(4, N=48, K=300), nn.ReLU(), _lin(2, N=300, K=48))
    x = torch.randn(2, 300)
    y0 = m(x)
    assert repack_for_kernels(m) == 2 and repack_for_kernels(m) == 0
    assert all(q.layout == "mma-v1" for q in (m[0], m[2]))
    assert torch.equal(m(x), y0)


# ------------------------------------------------------------------------------------------------ KbitMoE


def _moe(k, dtype, I=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, H = 6, 64
    gu = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    dn = torch.randn(E, H, I, generator=g) / I**0.5
    return KbitMoE.from_float(gu, dn, top_k=2, k=k, dtype=dtype, router_weight=torch.randn(E, H, generator=g))


@pytest.mark.parametrize("k,I", [(4, 40), (3, 36)])  # gate_up N = 80 (whole tiles) / 72 (expert by expert)
def test_moe_repacked_holds_one_copy_same_outputs_and_state(k, I):
    m16, m32 = _moe(k, torch.float16, I), _moe(k, torch.float32, I)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    plans = [(m16, x.half(), GEMV), (m16, x.half(), GEMM), (m16, x.half(), None), (m32, x, GROUPED_MM)]
    before = [m(xx, plan=p) for m, xx, p in plans]
    sd0 = _copy(m16.state_dict())
    canonical = [weakref.ref(getattr(m16, f"{s}_{p}")) for s in ("gate_up", "down") for p in ("codes", "scales")]

    for m in (m16, m32):
        assert m.repack_for_kernels() is m and m.layout == "mma-v1" and "layout='mma-v1'" in repr(m)
    gc.collect()
    assert all(r() is None for r in canonical)
    assert m16.gate_up_codes.dim() == 6 and m16.down_scales.dim() == 5
    assert not any(t.shape == sd0["gate_up_codes"].shape for t in m16.buffers())
    for (m, xx, p), want in zip(plans, before, strict=True):
        assert torch.equal(m(xx, plan=p), want), p  # CPU: unrepacked temporaries, the same kernels
    assert m16.plan_for(1) == GEMV  # no grouped tensor-core kernel on the CPU: the plan is unchanged
    x1 = x[:1].half()  # one token: "pairs" declines off CUDA and the step runs "gemm"
    assert torch.equal(m16(x1, plan=MoePlan("pairs", "pairs")), m16(x1, plan=GEMM))

    sd = m16.state_dict()
    _assert_same_state(sd, sd0)
    assert torch.equal(m16.gate_up_weight().codes, sd0["gate_up_codes"])
    assert torch.equal(m16.down_weight().scales, sd0["down_scales"])
    cb = m16.canonical_buffers()
    assert list(cb) == list(m16._buffers) and all(torch.equal(cb[n], sd0[n]) for n in cb if cb[n] is not None)
    fresh = KbitMoE(6, 64, I, 2, k=k, dtype=torch.float16, has_router_weight=True)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x.half(), plan=GEMV), before[0])
    rep = KbitMoE(6, 64, I, 2, k=k, dtype=torch.float16, has_router_weight=True).repack_for_kernels()
    rep.load_state_dict(sd0)
    assert rep.layout == "mma-v1" and torch.equal(rep.gate_up_codes, m16.gate_up_codes)
    assert torch.equal(rep(x.half(), plan=GEMM), before[1])

    m16.to_canonical()
    assert m16.layout == "canonical"
    assert all(torch.equal(getattr(m16, n), t) for n, t in sd0.items() if isinstance(t, torch.Tensor))


def test_moe_plans_by_layout(monkeypatch):
    """Repacked: the automatic plan runs the grouped tensor-core kernel where it would run the GEMV (when that
    kernel exists), and at a few tokens the pairs' dense GEMV where N is whole 16-row tiles (gate_up 2I = 80,
    down H = 64) and few pairs share an expert; canonical with auto_repack off: planned without it."""
    import kbit.dispatch.moe as ops_moe
    import kbit.nn.moe as nn_moe

    m = _moe(4, torch.float16)
    monkeypatch.setattr(ops_moe, "gemm_supported", lambda device, dtype: True)
    monkeypatch.setattr(nn_moe, "gemm_supported", lambda device, dtype: True)
    assert m.plan_for(1) == GEMV  # T = 1 on small experts: the GEMV
    assert m.plan_for(4) == GEMM
    m.auto_repack = False
    assert m.plan_for(4) == GEMV
    m.auto_repack = True
    m.repack_for_kernels()
    # 6 experts, top 2: 1.2 expected reads a touched expert at two tokens (pairs), 1.42 at three (grouped)
    assert m.plan_for(1) == MoePlan("pairs", "pairs") == m.plan_for(2) and m.plan_for(3) == GEMM
    assert m.plan_for(1, GEMV) == GEMV  # a pinned plan is kept


# ------------------------------------------------------------------------------------------------ kbit.hf


def test_save_quantized_same_files_and_decode(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kbit.hf import load_quantized, quantize_model, save_quantized
    from kbit.hf.decode import StaticDecoder, use_kbit_moe

    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=96,
                                         max_position_embeddings=64, mlp_only_layers=[1])
    torch.manual_seed(0)
    model = quantize_model(transformers.Qwen3MoeForCausalLM(config).eval(), k=4, progress=False)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        want = model(ids).logits
    save_quantized(model, tmp_path / "a")
    assert repack_for_kernels(model) > 0  # the KbitLinear layers
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    save_quantized(model, tmp_path / "b")
    _same_file(tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors")
    for name in ("config.json",):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "b")(ids).logits, want)

    def greedy(m, n=4):
        dec = StaticDecoder(m, 1, 16)
        return [dec.prefill(ids).clone()] + [dec.step().clone() for _ in range(n)]

    use_kbit_moe(model)  # KbitMoE around the same k-bit stacks
    tokens = greedy(model)
    assert repack_for_kernels(model) == 1  # the MoE block
    assert all(torch.equal(a, b) for a, b in zip(greedy(model), tokens, strict=True))


# ------------------------------------------------------------------------------------------------ GPU


def _assert_matches(y, ref, what=None):
    """Same op on the same data: equal up to the order of fp32 partial sums (split K / stream-K workspaces)."""
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-3, (what, err)


def _alloc():
    torch.cuda.synchronize()
    gc.collect()
    return torch.cuda.memory_allocated()


def _live_blocks_recorded() -> str:
    """The allocator's blocks still allocated that were allocated while its history was recorded, largest first:
    size and the kbit / test frames of the allocation (a failing memory check names what it found)."""
    lines = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b.get("frames"):
                fr = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in b["frames"]
                      if "kbit" in f["filename"] or "test_" in f["filename"]]
                lines.append((b["size"], " <- ".join(fr[:8])))
    return "; ".join(f"{n} bytes at {fr}" for n, fr in sorted(lines, reverse=True)[:12])


def _x_copy_bytes(k, M, N, K):
    """Bytes of the x copy kernel 7 reads for M rows of bf16 x (0 where another kernel runs): x tiles of whole
    8 * NG-token blocks (``XB``: 64 rows become 128 at NG = 16) or a permuted copy, S * 256 columns each. (An
    allowance of M x K bytes failed under xdist on 2026-11-26 and 27 by about 0.5 MB, what a 64-row copy padded to
    128 rows adds here. With this allowance it failed again on 2026-11-27 by 0.54 MB with x_tmp = 0: the split-K
    workspace's size, allowed at the assertion.)"""
    dev = torch.device("cuda")
    if not gemv_mma._large_here(k, M, N, K, dev):
        return 0
    p, _ = gemv_mma.PLANS.get(k, M, N, K, "log8", None, True, dev)
    if p.kernel != 7:
        return 0
    bt = 8 * p.defines["NG"]
    rows = -(-M // bt) * bt if p.defines.get("XB") else M
    return rows * p.S * 256 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4, 3])
def test_gpu_linear_memory_1x_and_outputs_identical(k, request):
    """A KbitLinear decoded on the GPU holds its k-bit weight once (after the first small-M forward: the
    repacked layout only; the functional op on canonical tensors caches a second copy); it holds exactly what
    that cache held, and its outputs match that functional op's for the small-M kernel and the large-M paths
    (to the last bits only: the stream-K / split-K kernels add fp32 partial sums in the workspace in no fixed
    order, so two calls of the same op can differ in the last bit)."""
    from kbit.ops.quantize import quantize
    from kbit.tuning.gemm import MMA_MAX_M

    linear = D.linear

    assert MC.kernels_available("cuda")
    N, K = 8192, 4096
    torch.manual_seed(k)
    qw = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), k=k)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    small, large = (1, 4, 16, MMA_MAX_M), (MMA_MAX_M + 1, 300)
    xs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in small + large}
    wbytes = qw.nbytes

    def functional(w):
        return {M: linear(x, w.codes, w.scales, w.tensor_scale, w.codebook, k=k, N=N, K=K, bias=bias)
                for M, x in xs.items()}

    for _ in range(2):  # warm-up: kernels built, workspaces and the cuBLAS workspaces allocated
        functional(qw)
    LY._REPACKED.clear()
    base = _alloc()
    before = functional(qw)
    assert _alloc() - base - _nbytes(before.values()) >= 0.95 * wbytes  # the cached repacked copy: 2x
    LY._REPACKED.clear()
    # the copy is gone (an H100 run once kept 8.3 MB of unexplained allocator state here after one warm-up: less
    # than half the copy, so not it)
    assert _alloc() - base - _nbytes(before.values()) < 0.5 * wbytes

    q = KbitLinear.from_weight(qw, bias, dtype=torch.bfloat16)
    del qw
    held = _alloc()  # the module's canonical weight, the inputs and the reference outputs
    # the allocator's history from here on, so that the last check names what stayed allocated: in part b of the
    # GPU tests (three xdist processes) 688128 bytes stayed at k = 4 (H200, 2026-11-29, twice); alone, nothing did
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=100000)  # no C++ frames: slow to resolve
    request.addfinalizer(lambda: torch.cuda.memory._record_memory_history(enabled=None))
    torch.cuda.reset_peak_memory_stats()
    y1 = q(xs[1])  # repacks: canonical -> mma-v1, the canonical tensors freed
    assert q.layout == "mma-v1"
    # live memory is counted in allocator blocks: a cached block less than 1 MB larger than asked is handed out
    # unsplit (PyTorch's large pool), so the canonical codes can sit in a block up to 1 MB larger than they are
    # and seem to shrink when freed (H100, 2026-11-22: 211968 bytes when the kernel 7 tests ran first)
    assert abs(_alloc() - _nbytes([y1]) - held) < 0.01 * wbytes + 2**20
    temps = 0 if k == 4 else 48 * 2**20  # k = 3: a chunk's byte-level temporaries (~6 bytes a code, 8M codes)
    assert torch.cuda.max_memory_allocated() - held < 1.25 * wbytes + temps  # repacking: both layouts of a layer
    _assert_matches(y1, before[1])

    torch.cuda.reset_peak_memory_stats()
    outs = {M: q(xs[M]) for M in small}  # compared after the peak is read: the comparison makes float64 copies
    # no weight-sized temporaries; kernel 7 (sm_90, M 33..64 here) reads x from a copy (_x_copy_bytes); whether a
    # launch runs kernel 7 is the dispatcher's answer (the tuned table first), not the built-in rule alone
    x_tmp = max(_x_copy_bytes(k, M, N, K) for M in small)
    # a split-K launch adds into a zeroed fp32 [M, N] workspace made for the call (kbit.ops.gemv._launch): under
    # xdist beside other files (H100, 2026-11-27) the peak was 0.54 MB over for k = 3 and 4, about a 16-row
    # workspace (0.5 MB); run alone the test passes (which launch splits there was not found)
    split_ws = max(M * N * 4 for M in small)
    assert torch.cuda.max_memory_allocated() - held < 0.01 * wbytes + _nbytes(outs.values()) + x_tmp + split_ws
    for M in small:
        _assert_matches(outs[M], before[M], M)
    del outs
    for M in large:  # an unrepacked temporary, freed after the call
        _assert_matches(q(xs[M]), before[M], M)
    assert _alloc() - _nbytes([y1]) - held < 0.01 * wbytes, _live_blocks_recorded()
    assert not LY._REPACKED
    w = q.weight()  # the layout held is the cache's: repack of the canonical tensors, bit for bit
    rc, rs = LY.repack(w.codes, w.scales, k=k, blocksize=32, scale_format="log8", N=N, K=K)
    assert torch.equal(rc, q.codes) and torch.equal(rs, q.scales)


@pytest.mark.gpu
def test_gpu_model_of_linears_peak_near_1x():
    """Sixteen layers repacked on the first forward, one at a time: the peak stays near 1x the weights (one
    layer's two layouts at once), then exactly the weights."""
    from kbit.ops.quantize import quantize

    torch.manual_seed(0)
    layers = [KbitLinear.from_weight(quantize(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), k=4),
                                     dtype=torch.bfloat16) for _ in range(16)]
    model = nn.Sequential(*layers)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    wbytes = _nbytes(model.buffers())
    held = _alloc()
    torch.cuda.reset_peak_memory_stats()
    y = model(x)
    assert all(q.layout == "mma-v1" for q in layers)
    assert torch.cuda.max_memory_allocated() - held < 0.1 * wbytes
    assert _nbytes(model.buffers()) == wbytes and _alloc() - held - _nbytes([y]) < 0.01 * wbytes
    assert not LY._REPACKED


@pytest.mark.gpu
def test_gpu_moe_memory_1x_and_outputs_identical():
    """A KbitMoE (Qwen3-30B-A3B-sized layer) holds its stacks once after a forward that runs the grouped
    tensor-core kernel; outputs equal the canonical module's through the cached functional path."""
    from kbit.dispatch.moe import moe_experts

    E, top_k, H, I = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    gu = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) / H**0.5
    dn = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) / I**0.5
    m = KbitMoE.from_float(gu, dn, top_k=top_k, k=4, dtype=torch.bfloat16)
    del gu, dn
    wbytes = _nbytes(m.buffers())
    xs = {T: (torch.randn(T, H, device="cuda", generator=g).bfloat16(),
              torch.randn(T, E, device="cuda", generator=g).bfloat16()) for T in (1, 4, 64)}

    # before: the canonical stacks through kbit.ops (the grouped kernel caches a repacked copy)
    base = _alloc()
    before = {}
    for T, (x, lg) in xs.items():
        r = m.route(lg, GEMM)
        before[T] = moe_experts(x, r, m.gate_up_weight(), m.down_weight(), GEMM)
    assert _alloc() - base - _nbytes(before.values()) >= 0.95 * wbytes
    GM._CACHE.clear()

    held = _alloc()
    torch.cuda.reset_peak_memory_stats()
    out = {T: m(x, lg, plan=GEMM) for T, (x, lg) in xs.items()}
    assert m.layout == "mma-v1"
    assert abs(_alloc() - held - _nbytes(out.values())) < 0.02 * wbytes
    assert torch.cuda.max_memory_allocated() - held < 0.75 * wbytes  # one stack's two layouts at once
    for T in xs:
        assert torch.equal(out[T], before[T]), T
    auto = m(*xs[1])  # T = 1, automatic plan: the pairs' dense GEMV (it reads the repacked layout)
    assert m.plan_for(1, dtype=torch.bfloat16) == MoePlan("pairs", "pairs")
    d = (auto.double() - before[1].double()).norm() / before[1].double().norm()
    assert d < 1e-2  # another summation order than the grouped kernel's
    assert not GM._CACHE


@pytest.mark.gpu
def test_gpu_static_decoder_holds_weights_once():
    """Decoding a quantized MoE model with CUDA graphs: every KbitLinear / KbitMoE ends in layout "mma-v1"
    (repacked during the eager prefill and warm-up, not in the capture), nothing is cached beside them, and the
    graph replays equal the eager steps."""
    transformers = pytest.importorskip("transformers")
    from kbit.hf import quantize_model
    from kbit.hf.decode import StaticDecoder, use_kbit_moe

    config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval().to(device="cuda", dtype=torch.bfloat16)
    use_kbit_moe(model, k=4)
    quantize_model(model, k=4, include=[r"self_attn\.(q|k|v|o)_proj"], progress=False)
    ids = torch.tensor([[1, 5, 9, 33, 2], [7, 3, 3, 60, 11]], device="cuda")

    def run(graph):
        dec = StaticDecoder(model, 2, 16, graph=graph)
        return torch.stack([dec.prefill(ids).clone()] + [dec.step().clone() for _ in range(6)])

    eager = run(False)
    mods = [m for m in model.modules() if isinstance(m, (KbitLinear, KbitMoE))]
    assert len(mods) == 10 and all(m.layout == "mma-v1" for m in mods)
    assert not LY._REPACKED and not GM._CACHE
    assert torch.equal(run(True), eager)
    assert not LY._REPACKED and not GM._CACHE


@pytest.mark.gpu
def test_gpu_auto_repack_off_keeps_canonical_and_no_cache():
    """``auto_repack = False``: the module stays canonical, small M runs the Triton GEMV (no repacked copy
    cached anywhere), large M the dispatcher's kernels; results match the float64 reference."""
    from kbit.ops.reference import gemv_reference

    q = _lin(4, N=4096, K=4096, bias=False, dtype=torch.bfloat16, device="cuda")
    q.auto_repack = False
    m = KbitMoE.from_float(*(t.cuda().bfloat16() for t in (torch.randn(8, 256, 512) / 512**0.5,
                                                             torch.randn(8, 512, 128) / 128**0.5)),
                           top_k=2, k=4, dtype=torch.bfloat16)
    m.auto_repack = False
    for M in (1, 16, 300):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        w = q.weight()
        ref = gemv_reference(x, w.codes, w.scales, w.tensor_scale, w.codebook, k=4, N=4096, K=4096)
        assert ((q(x).double() - ref).norm() / ref.norm()).item() < 1.2e-2, M
        h = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16)
        assert torch.isfinite(m(h, torch.randn(M, 8, device="cuda").bfloat16()).float()).all()
        assert "gemm" not in (m.plan_for(M).gate_up, m.plan_for(M).down)
    assert q.layout == m.layout == "canonical"
    assert not LY._REPACKED and not GM._CACHE
