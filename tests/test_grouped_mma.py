"""kbit.ops.grouped_mma and kbit.ops.moe_blocks: block table and stack repack (CPU), the grouped GEMM's fallbacks in
kbit.dispatch.moe; the grouped CUDA kernels against the float64 reference, the CUDA block table, sync-freedom (GPU,
marked ``gpu``)."""

import pytest
import torch

from kbit.bench.timing import capture
from kbit.dispatch import moe as D
from kbit.ops import gemv as G
from kbit.ops import grouped_mma as GR
from kbit.ops import moe_blocks as MB
from kbit.ops.mma import common as MC
from kbit.ops.mma import layout as LY
from kbit.ops.moe import silu_mul_gate_up, silu_mul_gate_up_reference
from kbit.tuning import mma as TM
from kbit.tuning.moe import WgmmaGroupedConfig, grouped_mma_config

CUDA = torch.cuda.is_available()


def make_stack(E, N, K_, k, B=32, sf="log8", device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    Kp = -(-K_ // B) * B
    codes = torch.randint(-(2**31), 2**31 - 1, (E, N, Kp * k // 32), generator=g, dtype=torch.int32)
    if sf == "log8":
        scales = torch.randint(0, 64, (E, N, Kp // B), generator=g, dtype=torch.uint8)
        scales[:, :, 0] = 255  # an all-zero block
        ts = torch.rand(E, generator=g) + 0.5
    else:
        scales = (torch.rand(E, N, Kp // B, generator=g) + 0.05).half()
        ts = torch.ones(E)
    cb = torch.sort(torch.rand(2**k, generator=g) * 2 - 1).values
    return [t.to(device) for t in (codes, scales, ts, cb)]


def routing_ids(T, top_k, E, seed=0, skew=True, sort=True, device="cpu"):
    """(rows = token ids, expert ids) of T tokens' top-k choice; skewed: uneven groups, unused experts."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits += torch.linspace(4, -4, E)  # low experts popular, high ones mostly empty
    ids = torch.topk(logits, top_k, dim=1).indices.reshape(-1).to(torch.int32)
    tok = torch.arange(T * top_k, dtype=torch.int32) // top_k
    if sort:
        ids, order = torch.sort(ids, stable=True)
        tok = tok[order]
    return tok.to(device), ids.to(device)


def rel_err(y, ref):
    assert not torch.isnan(y).any(), "NaN in output (unwritten element?)"
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def no_sync(fn):
    """``fn()`` under ``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def tol(dtype):
    return 2e-3 if dtype == torch.float16 else 1.2e-2


# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("P,E,bm,sort", [(0, 4, 8, True), (1, 4, 8, True), (7, 3, 8, True), (100, 5, 8, True),
                                         (300, 8, 16, True), (3000, 128, 64, True), (200, 4, 8, False),
                                         (64, 1, 8, True), (65, 1, 64, True)])
def test_block_table_torch_vs_reference(P, E, bm, sort):
    g = torch.Generator().manual_seed(P + E)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    if sort:
        ids = torch.sort(ids).values
    ref = MB.block_table_reference(ids, bm)
    blk, nblk = MB.block_table_torch(ids, bm)
    nb = int(nblk)
    assert nb == len(ref) - 1 and blk.tolist()[: nb + 1] == ref
    assert (blk[nb:] == P).all()
    # the blocks partition the rows; each is one expert, at most bm rows, starting bm-aligned within its run
    for b in range(nb):
        r0, r1 = ref[b], ref[b + 1]
        assert 1 <= r1 - r0 <= bm and (ids[r0:r1] == ids[r0]).all()
    if sort and P:
        assert nb <= -(-P // bm) + min(E, P)


def test_block_table_errors():
    with pytest.raises(ValueError, match="expert_ids"):
        MB.block_table_torch(torch.zeros(4, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="bm"):
        MB.block_table_torch(torch.zeros(4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="offsets"):
        MB.block_table(torch.zeros(4, dtype=torch.int32), 8, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("E,N,K_,B,sf", [(3, 32, 300, 32, "log8"), (2, 20, 256, 64, "fp16"), (4, 16, 64, 32, "log8")])
def test_repack_stack(k, E, N, K_, B, sf):
    codes, scales, _, _ = make_stack(E, N, K_, k, B, sf, seed=k + E)
    rc, rs = LY.repack_stack(codes, scales, k=k, blocksize=B, scale_format=sf, N=N, K=K_)
    for e in range(E):
        c1, s1 = LY.repack(codes[e], scales[e], k=k, blocksize=B, scale_format=sf, N=N, K=K_)
        assert torch.equal(rc[e], c1) and torch.equal(rs[e], s1)
        c2, s2 = LY.unrepack(rc[e], rs[e], k=k, blocksize=B, N=N, K=K_)
        assert torch.equal(c2, codes[e]) and torch.equal(s2, scales[e])


def test_repacked_stack_cached():
    codes, scales, _, _ = make_stack(2, 16, 256, 4)
    a = GR.repacked_stack(codes, scales, k=4, blocksize=32, scale_format="log8", N=16, K=256)
    assert GR.repacked_stack(codes, scales, k=4, blocksize=32, scale_format="log8", N=16, K=256) is a
    codes.add_(1)  # new version: repacked again
    assert GR.repacked_stack(codes, scales, k=4, blocksize=32, scale_format="log8", N=16, K=256) is not a


def test_choose_ng():
    assert GR.choose_ng(8, 128) == 1 and GR.choose_ng(512, 128) == 1 and GR.choose_ng(2048, 128) == 2
    assert GR.choose_ng(8192, 128) == 8 and GR.choose_ng(4096, 128) == 4  # 64 rows: kernel 4's largest block
    assert GR.choose_ng(100000, 128) == 8
    assert GR.choose_ng(128, 8) == 2 and GR.choose_ng(2, 8) == 1


def test_grouped_gemm_fallback_matches_reference():
    """Without the CUDA kernel (CPU / interpreter) kbit.dispatch.moe.grouped_gemm is the grouped GEMV: same
    semantics; the CUDA launcher itself refuses such a device."""
    from kbit.format.spec import KbitWeight

    E, N, K_, k = 4, 24, 64, 4
    codes, scales, ts, cb = make_stack(E, N, K_, k)
    w = KbitWeight(codes, scales, ts, cb, (E, N, K_), k, 32, "log8", "custom")
    tok, ids = routing_ids(5, 2, E)
    x = torch.randn(5, K_).to(torch.float16)
    y = D.grouped_gemm(x, tok, ids, w)
    ref = G.grouped_gemv_reference(x, tok, ids, codes, scales, ts, cb, k=k, N=N, K=K_)
    assert y.shape == (10, N) and rel_err(y, ref) < 2e-3
    with pytest.raises(ValueError, match="CUDA"):
        GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, k=k, N=N, K=K_)


def test_grouped_linear_errors():
    codes, scales, ts, cb = make_stack(2, 16, 64, 4)
    x = torch.randn(3, 64).half()
    tok, ids = routing_ids(3, 1, 2)
    kw = dict(k=4, N=16, K=64)
    with pytest.raises(ValueError, match="x"):
        GR.grouped_linear(x[:, :32], tok, ids, codes, scales, ts, cb, **kw)
    with pytest.raises((TypeError, ValueError), match="rows"):
        GR.grouped_linear(x, tok.long(), ids, codes, scales, ts, cb, **kw)
    with pytest.raises(ValueError, match="expert_ids"):
        GR.grouped_linear(x, tok, ids[:2], codes, scales, ts, cb, **kw)
    with pytest.raises(ValueError, match="ng"):
        GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, ng=3, **kw)


def test_grouped_gemm_repacked_act_silu_fallback_and_errors():
    """``act="silu"`` off the CUDA kernel: silu_mul_gate_up first, then the plain path (same result); bad act / x
    shape, in the dispatcher and in the CUDA launcher."""
    E, N, K_, k = 3, 24, 64, 4
    codes, scales, ts, cb = make_stack(E, N, K_, k)
    rc, rs = LY.repack_stack(codes, scales, k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    rw = LY.RepackedWeight(rc, rs, ts, cb, (E, N, K_), k, 32)
    tok, ids = routing_ids(5, 2, E)
    rows = torch.arange(10, dtype=torch.int32)
    gu = torch.randn(10, 2 * K_).to(torch.float16)
    y = D.grouped_gemm_repacked(gu, rows, ids, rw, sorted_rows=True, act="silu")
    assert torch.equal(y, D.grouped_gemm_repacked(silu_mul_gate_up(gu), rows, ids, rw, sorted_rows=True))
    kw = dict(k=k, N=N, K=K_, sorted_rows=True)
    for fn in (lambda x, act: D.grouped_gemm_repacked(x, rows, ids, rw, sorted_rows=True, act=act),
               lambda x, act: GR.grouped_linear_repacked(x, rows, ids, rc, rs, ts, cb, act=act, **kw)):
        with pytest.raises(ValueError, match="act"):
            fn(gu, "gelu")
        with pytest.raises(ValueError, match="x"):
            fn(gu[:, :K_], "silu")


def test_choose_plan_picks_gemm_when_available(monkeypatch):
    moe = D
    monkeypatch.setattr(moe, "gemm_supported", lambda device, dtype: True)
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype, N, K: True)
    bf = torch.bfloat16
    gemm = moe.MoePlan("gemm", "gemm")
    assert moe.choose_plan(1, 8, 128, 2048, 768, bf, "cpu") == moe.MoePlan("gemv", "gemv")  # small experts
    assert moe.choose_plan(1, 2, 8, 4096, 14336, bf, "cpu") == gemm
    assert moe.choose_plan(4, 8, 128, 2048, 768, bf, "cpu") == gemm
    assert moe.choose_plan(1024, 8, 128, 2048, 768, bf, "cpu") == gemm  # 64 rows an expert
    assert moe.choose_plan(256, 2, 8, 4096, 14336, bf, "cpu") == gemm
    assert moe.choose_plan(1024, 2, 8, 4096, 14336, bf, "cpu") == gemm  # 256 rows an expert
    assert moe.choose_plan(4096, 2, 8, 4096, 14336, bf, "cpu") == moe.MoePlan("grouped_mm", "grouped_mm")


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("P,E,bm,sort", [(1, 8, 8, True), (37, 8, 8, True), (2048, 8, 64, True),
                                         (10240, 512, 16, True), (40960, 512, 8, True), (5000, 64, 8, False),
                                         (32768, 128, 256, True), (40961, 512, 24, False), (1023, 3, 256, True),
                                         (70001, 8, 64, True), (3000, 2500, 8, True)])
def test_gpu_block_table_cuda(P, E, bm, sort):
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    if sort:
        ids = torch.sort(ids).values
    blk, nblk = MB.block_table(ids.cuda(), bm)
    ref = MB.block_table_reference(ids, bm)
    nb = int(nblk)
    assert nb == len(ref) - 1 and blk[: nb + 1].tolist() == ref
    if sort:  # from the group ends (kbit_moe_blocks_off), as align makes them
        offsets = torch.searchsorted(ids, torch.arange(E, dtype=torch.int32), right=True).to(torch.int32)
        blk, nblk = MB.block_table(ids.cuda(), bm, offsets.cuda())
        nb = int(nblk)
        assert nb == len(ref) - 1 and blk[: nb + 1].tolist() == ref


KERNEL_CASES = [(4, dt, E, T) for dt in ("bf16", "fp16") for E in (8, 128) for T in (1, 4, 16, 64, 300)]
KERNEL_CASES += [(k, "bf16", E, T) for k in (2, 3, 5) for E, T in ((8, 4), (128, 300), (8, 64))]
KERNEL_CASES += [(k, "fp16", 128, 16) for k in (2, 3, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,dt,E,T", KERNEL_CASES)
def test_gpu_grouped_kernel_vs_reference(k, dt, E, T):
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    top_k = 2 if E == 8 else 8
    for N, K_, B, sf in ((272, 512, 32, "log8"), (200, 320, 64, "fp16" if k == 4 else "log8")):
        codes, scales, ts, cb = make_stack(E, N, K_, k, B, sf, device="cuda", seed=k + T)
        tok, ids = routing_ids(T, top_k, E, seed=T, device="cuda")
        x = torch.randn(T, K_, device="cuda").to(dtype)
        kw = dict(k=k, blocksize=B, scale_format=sf, N=N, K=K_)
        y = GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, **kw)
        ref = G.grouped_gemv_reference(x, tok, ids, codes, scales, ts, cb, **kw)
        assert y.shape == (T * top_k, N) and y.dtype == dtype
        assert rel_err(y, ref) < tol(dtype), (N, K_, B, sf)
        # down-like (no gather: rows = arange) on the same table, and every block size
        xs = torch.randn(T * top_k, K_, device="cuda").to(dtype)
        rows = torch.arange(T * top_k, device="cuda", dtype=torch.int32)
        ref2 = G.grouped_gemv_reference(xs, rows, ids, codes, scales, ts, cb, **kw)
        for ng in (1, 8) if T >= 64 else (None,):
            y2 = GR.grouped_linear(xs, rows, ids, codes, scales, ts, cb, ng=ng, **kw)
            assert rel_err(y2, ref2) < tol(dtype), ng
        assert torch.equal(y2, GR.grouped_linear(xs, rows, ids, codes, scales, ts, cb, ng=ng, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["1", "4"])
@pytest.mark.parametrize("k,dt,T,K_", [(4, "bf16", 1, 1280), (4, "fp16", 64, 2048), (3, "bf16", 16, 768),
                                       (5, "fp16", 300, 1280), (2, "bf16", 4, 256)])
def test_gpu_grouped_both_kernels(monkeypatch, kernel, k, dt, T, K_):
    """Kernels 1 and 4 forced (the default picks by block rows and K), blocks of 8..64 rows, long and short K."""
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    E, top_k, N = 16, 4, 336
    codes, scales, ts, cb = make_stack(E, N, K_, k, 32, "log8", device="cuda", seed=T + K_)
    tok, ids = routing_ids(T, top_k, E, seed=T, device="cuda")
    x = torch.randn(T, K_, device="cuda").to(dtype)
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    ref = G.grouped_gemv_reference(x, tok, ids, codes, scales, ts, cb, **kw)
    for ng in (1, 2, 4, 8) if kernel == "4" else (1, 2, 4):
        cfg = grouped_mma_config(ng, -(-K_ // 256), kernel=int(kernel))
        y = GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, config=cfg, **kw)
        assert rel_err(y, ref) < tol(dtype), ng


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["1", "4"])
@pytest.mark.parametrize("ids", [[5, 5, 2, 9], [2, 5, 5, 9], [7, 7, 7, 7], [1, 2, 3, 4]])
def test_gpu_grouped_first_block_guess(kernel, ids):
    """One token's pairs with repeated experts (the router gives in-range ids even for NaN scores, so two slots
    can share one): fewer blocks than pairs, and block b's first row past b, where kernels 1 and 4 guess a CTA's
    first expert as that of row b before the table arrives."""
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    E, N, K_, k = 12, 336, 512, 4
    codes, scales, ts, cb = make_stack(E, N, K_, k, 32, "log8", device="cuda", seed=sum(ids))
    eid = torch.tensor(ids, dtype=torch.int32, device="cuda")
    tok = torch.zeros(len(ids), dtype=torch.int32, device="cuda")
    rows = torch.arange(len(ids), dtype=torch.int32, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    x1 = torch.randn(1, K_, device="cuda").bfloat16()
    xs = torch.randn(len(ids), K_, device="cuda").bfloat16()
    for x, r in ((x1, tok), (xs, rows)):
        ref = G.grouped_gemv_reference(x, r, eid, codes, scales, ts, cb, **kw)
        for ng in (1, 2):
            cfg = grouped_mma_config(ng, -(-K_ // 256), kernel=int(kernel))
            y = GR.grouped_linear(x, r, eid, codes, scales, ts, cb, config=cfg, **kw)
            assert rel_err(y, ref) < tol(torch.bfloat16), (ng, x.shape[0])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["1", "4"])
@pytest.mark.parametrize("K_,T", [(1408, 1), (2880, 64), (520, 16)])
def test_gpu_grouped_x_tail_ignored(kernel, K_, T):
    """K not a multiple of 256 (GLM-4.5-Air's expert down, gpt-oss): x's columns from K on are NaN here (a view of a
    wider NaN-filled tensor), so a launch that reads past K (into a block's padding columns, whose codes are nonzero
    values, or into the zero-weight padding) gives NaN or wrong rows."""
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    E, top_k, N, k = 16, 4, 336, 4
    codes, scales, ts, cb = make_stack(E, N, K_, k, 32, "log8", device="cuda", seed=K_ + T)
    tok, ids = routing_ids(T, top_k, E, seed=T, device="cuda")
    wide = torch.full((T, -(-K_ // 256) * 256 + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    x = wide[:, :K_]
    x.copy_(torch.randn(T, K_, device="cuda"))
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    ref = G.grouped_gemv_reference(x, tok, ids, codes, scales, ts, cb, **kw)
    for ng in (1, 2) if kernel == "1" else (2, 8):
        cfg = grouped_mma_config(ng, -(-K_ // 256), kernel=int(kernel))
        y = GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, config=cfg, **kw)
        assert rel_err(y, ref) < tol(torch.bfloat16), ng


@pytest.mark.gpu
def test_gpu_grouped_kernel_unsorted_rows_and_no_sync():
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    E, N, K_ = 16, 256, 512
    codes, scales, ts, cb = make_stack(E, N, K_, 4, device="cuda")
    tok, ids = routing_ids(40, 4, E, sort=False, device="cuda")
    x = torch.randn(40, K_, device="cuda").bfloat16()
    kw = dict(k=4, blocksize=32, scale_format="log8", N=N, K=K_)
    y = GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, **kw)
    ref = G.grouped_gemv_reference(x, tok, ids, codes, scales, ts, cb, **kw)
    assert rel_err(y, ref) < tol(torch.bfloat16)
    assert torch.equal(y, no_sync(lambda: GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, **kw)))


PAIRS_CASES = [  # (N, K, P, x rows, k, dtype, scale format): MoE-like expert shapes at a few tokens
    (1536, 2048, 8, 1, 4, "bf16", "log8"),  # Qwen3-30B-A3B gate_up, one token
    (2048, 768, 8, 8, 3, "fp16", "log8"),  # its down (K = 3 segments)
    (5760, 2880, 4, 1, 5, "bf16", "fp16"),  # gpt-oss gate_up (K not a multiple of 256)
    (4096, 1408, 8, 8, 2, "bf16", "log8"),  # GLM-4.5-Air down
    (2816, 4096, 10, 1, 4, "fp16", "log8"),  # ten pairs (Qwen3-Next)
    (4096, 14336, 2, 2, 4, "bf16", "log8"),  # Mixtral-8x7B down: two pairs
    (1536, 2048, 32, 4, 4, "bf16", "log8"),  # Qwen3-30B-A3B gate_up, four tokens
    (2048, 768, 64, 64, 4, "bf16", "log8"),  # its down at eight tokens: 64 pairs, the most a launch takes
    (28672, 4096, 4, 2, 4, "fp16", "log8"),  # Mixtral-8x7B gate_up, two tokens
]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K_,P,R,k,dt,sf", PAIRS_CASES)
def test_gpu_pairs_linear_vs_reference(N, K_, P, R, k, dt, sf):
    """A few tokens' pairs (pair p reads x row p R / P) as one dense GEMV over the stacked experts
    (kbit.ops.gemv_mma.pairs_linear): against the float64 reference with a repeated expert, a CUDA-graph replay with
    other ids, no host sync, a bad id's row NaN (the rest unchanged), and one pair more than a launch takes
    declined."""
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    from kbit.ops import gemv_mma as GV
    from kbit.ops._ids import guard

    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    E = 12
    codes, scales, ts, cb = make_stack(E, N, K_, k, 32, sf, device="cuda", seed=N + P)
    rc, rs = GR.repacked_stack(codes, scales, k=k, blocksize=32, scale_format=sf, N=N, K=K_)
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    if P > 1:
        ids[1] = ids[0]  # a repeated expert (the router gives in-range ids even for NaN scores)
    ids = ids.cuda()
    x = torch.randn(R, K_, device="cuda").to(dtype)
    rows = (torch.arange(P, device="cuda") * R // P).int()
    kw = dict(k=k, blocksize=32, scale_format=sf, N=N, K=K_)

    def run(i, bad=None, r=rows):
        return GV.pairs_linear(x, r, i, rc, rs, ts, cb, k=k, scale_format=sf, N=N, K=K_, bad=bad)

    y = run(ids)
    assert y is not None, "the stacked shape's dense pick is not a kernel-3 build pairs_linear covers"
    if P == GV.PAIRS_MAX:  # one pair more than a launch takes: declined (the caller runs the grouped kernels)
        assert run(torch.cat([ids, ids[:1]]), r=torch.cat([rows, rows[:1]])) is None
    ref = G.grouped_gemv_reference(x, rows, ids, codes, scales, ts, cb, **kw)
    assert rel_err(y, ref) < tol(dtype)
    assert rel_err(no_sync(lambda: run(ids)), ref) < tol(dtype)
    ids_g = ids.clone()
    graph, yg = capture(lambda: run(ids_g))
    other = torch.flip(ids, [0]).contiguous()
    ids_g.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(yg, G.grouped_gemv_reference(x, rows, other, codes, scales, ts, cb, **kw)) < tol(dtype)
    bad_ids = ids.clone()
    bad_ids[P - 1] = E + 3
    crows, clamped, bad = guard(rows, x.shape[0], bad_ids, E)
    yb = run(clamped, bad, crows)
    assert torch.isnan(yb[P - 1]).all()
    if P > 1:
        assert rel_err(yb[:P - 1], ref[:P - 1]) < tol(dtype)


@pytest.mark.gpu
def test_gpu_pairs_linear_stack_of_many_experts(monkeypatch):
    """The pairs launch stages the stack's tensor scales in shared memory before its PDL wait (``GRP_MAXE`` of
    ``common.cuh``, ``PAIRS_MAX_EXPERTS``): each pair's rows take its own expert's scale, up to the last of 512
    experts (scales far apart, so a wrong one shows), and a stack of 513 is declined (the grouped kernels run it).
    The stacked shape is small, so its dense pick (kernel 1) is pinned to the kernel-3 config the launch builds on."""
    if not MC.kernels_available("cuda"):
        pytest.skip("CUDA kernel not available")
    from kbit.ops import gemv_mma as GV

    monkeypatch.setattr(GV, "launch_config", lambda *a: TM.MmaConfig(3, 8, 2, ring=2, x_smem=True))
    monkeypatch.setattr(GV, "_PAIRS", {})
    N, K_, k = 64, 512, 4
    E = GV.PAIRS_MAX_EXPERTS
    codes, scales, ts, cb = make_stack(E + 1, N, K_, k, device="cuda", seed=3)
    ts = (torch.arange(E + 1, device="cuda", dtype=torch.float32) + 1) * 1e-3  # every expert's scale its own
    rc, rs = GR.repacked_stack(codes, scales, k=k, blocksize=32, scale_format="log8", N=N, K=K_)
    ids = torch.tensor([E - 1, 0, 300, E - 1, 65], dtype=torch.int32, device="cuda")
    x = torch.randn(1, K_, device="cuda").bfloat16()
    rows = torch.zeros(ids.shape[0], dtype=torch.int32, device="cuda")
    y = GV.pairs_linear(x, rows, ids, rc[:E], rs[:E], ts[:E], cb, k=k, N=N, K=K_)
    assert y is not None
    ref = G.grouped_gemv_reference(x, rows, ids, codes[:E], scales[:E], ts[:E], cb, k=k, blocksize=32,
                                   scale_format="log8", N=N, K=K_)
    assert rel_err(y, ref) < tol(torch.bfloat16)
    assert GV.pairs_linear(x, rows, ids, rc, rs, ts, cb, k=k, N=N, K=K_) is None


LARGE_CFGS = ["7,16,8,4,8,1,1", "7,12,16,4,8,1,1", "7,8,32,4,8,1,1", "7,8,32,3,8,1,1"]


def wgmma_cfg(s: str) -> WgmmaGroupedConfig:
    """A grouped kernel 7 config from its old positional form "7,warps,groups,stages,raster,x_swizzle,x_bulk"."""
    _, W, ng, D_, gm, xsw, xb = (int(v) for v in s.split(","))
    return WgmmaGroupedConfig(warps=W, groups=ng, stages=D_, raster=gm, x_swizzle=bool(xsw), x_bulk=xb)


def _sm90():
    return CUDA and MC.kernels_available("cuda") and TM.large_ok("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", LARGE_CFGS)
@pytest.mark.parametrize("k,dt,sf,sort", [(4, "bf16", "log8", True), (4, "fp16", "fp16", True),
                                          (2, "bf16", "log8", False), (3, "fp16", "log8", True),
                                          (5, "bf16", "log8", True)])
def test_gpu_grouped_large_vs_reference(monkeypatch, cfg, k, dt, sf, sort):
    """The grouped kernel 7 (sm_90 wgmma) forced at every row count, each block size: skewed routing (full,
    partial and single-row blocks), odd N (tiles of two experts not aligned), K not a multiple of 256, gather
    (gate_up) and no gather (down); unsorted rows (``sorted_rows=False``) take the other kernels."""
    if not _sm90():
        pytest.skip("needs sm_90 and the CUDA kernels")
    monkeypatch.setattr(GR, "WGMMA_MIN_ROWS", 0)
    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    E, T, top_k = 8, 600, 2
    for N, K_ in ((1000, 1100), (512, 256)):
        codes, scales, ts, cb = make_stack(E, N, K_, k, 32, sf, device="cuda", seed=k + N)
        tok, ids = routing_ids(T, top_k, E, seed=N, sort=sort, device="cuda")
        x = torch.randn(T, K_, device="cuda").to(dtype)
        kw = dict(k=k, blocksize=32, scale_format=sf, N=N, K=K_, sorted_rows=sort,
                  config=wgmma_cfg(cfg) if sort else None)
        y = GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, **kw)
        kr = {a: b for a, b in kw.items() if a not in ("sorted_rows", "config")}
        ref = G.grouped_gemv_reference(x, tok, ids, codes, scales, ts, cb, **kr)
        assert rel_err(y, ref) < tol(dtype), (N, K_)
        xs = torch.randn(T * top_k, K_, device="cuda").to(dtype)
        rows = torch.arange(T * top_k, device="cuda", dtype=torch.int32)
        y2 = GR.grouped_linear(xs, rows, ids, codes, scales, ts, cb, **kw)
        ref2 = G.grouped_gemv_reference(xs, rows, ids, codes, scales, ts, cb, **kr)
        assert rel_err(y2, ref2) < tol(dtype), (N, K_)


def tile_rows_written(blk, nblk, n_max, bt, S):
    """bool ``[n_max, S * 4, bt, 64]``: the tile entries the grouped x gather writes (rows inside each block)."""
    b_list, nb = blk.tolist(), int(nblk)
    keep = torch.zeros(n_max, S * 4, bt, 64, dtype=torch.bool, device=blk.device)
    for b in range(min(nb, n_max)):
        keep[b, :, : b_list[b + 1] - b_list[b]] = True
    return keep


@pytest.mark.gpu
def test_gpu_grouped_large_x_tiles_no_sync_and_graph(monkeypatch):
    """The grouped x gather equals its torch definition; the kernel 7 step runs without a host sync and a CUDA
    graph replay equals eager bit for bit."""
    if not _sm90():
        pytest.skip("needs sm_90 and the CUDA kernels")
    monkeypatch.setattr(GR, "WGMMA_MIN_ROWS", 0)
    for E, T, top_k, K_, bt in ((16, 40, 4, 512, 64), (8, 300, 2, 768, 128), (4, 700, 2, 256, 256)):
        tok, ids = routing_ids(T, top_k, E, seed=T, device="cuda")
        x = torch.randn(T, K_, device="cuda").bfloat16()
        blk, nblk = MB.block_table(ids, bt)
        P, S = T * top_k, K_ // 256
        n_max = MB.max_blocks(P, E, bt)
        a = GR._x_tiles_grouped(x, tok, blk, nblk, n_max, bt, S)
        b = GR._x_tiles_grouped_reference(x, tok, blk, nblk, n_max, bt, S)
        keep = tile_rows_written(blk, nblk, n_max, bt, S)
        assert torch.equal(a.view(keep.shape)[keep], b.view(keep.shape)[keep]), (E, T, K_, bt)
    E, N, K_, T = 8, 768, 1024, 512
    codes, scales, ts, cb = make_stack(E, N, K_, 4, device="cuda")
    tok, ids = routing_ids(T, 2, E, device="cuda")
    x = torch.randn(T, K_, device="cuda").bfloat16()
    kw = dict(k=4, blocksize=32, scale_format="log8", N=N, K=K_, sorted_rows=True)
    def step():
        return GR.grouped_linear(x, tok, ids, codes, scales, ts, cb, **kw)

    y = step()
    assert torch.equal(y, no_sync(step))
    graph, y3 = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y3)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_gpu_grouped_large_silu_tiles_and_act(monkeypatch, dt):
    """SiLU * up computed while gathering the grouped kernel 7's x tiles: the tiles match those of silu_mul_gate_up's
    output (to an ulp: exp and division may round differently), and ``act="silu"`` matches it + the plain
    call and the float64 reference; I not a multiple of 256; no host sync; graph replay equals eager."""
    if not _sm90():
        pytest.skip("needs sm_90 and the CUDA kernels")
    monkeypatch.setattr(GR, "WGMMA_MIN_ROWS", 0)
    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    close = dict(rtol=1e-2, atol=1e-3) if dt == "bf16" else dict(rtol=2e-3, atol=1e-4)
    for E, T, top_k, I, bt in ((16, 40, 4, 512, 64), (8, 300, 2, 300, 128), (4, 700, 2, 768, 256)):
        tok, ids = routing_ids(T, top_k, E, seed=T, device="cuda")
        P, S = T * top_k, -(-I // 256)
        gu = (torch.randn(P, 2 * I, device="cuda") * 2).to(dtype)
        rows = torch.arange(P, device="cuda", dtype=torch.int32)
        blk, nblk = MB.block_table(ids, bt)
        n_max = MB.max_blocks(P, E, bt)
        nb = int(nblk)
        a = GR._x_tiles_grouped(gu, rows, blk, nblk, n_max, bt, S, silu=True)
        act = torch.zeros(P, S * 256, device="cuda", dtype=dtype)
        act[:, :I] = silu_mul_gate_up(gu)
        b = GR._x_tiles_grouped_reference(act, rows, blk, nblk, n_max, bt, S)
        keep = tile_rows_written(blk, nblk, n_max, bt, S)
        a, b = a.view(keep.shape)[keep], b.view(keep.shape)[keep]
        assert a.numel() == P * S * 256 and nb <= n_max
        torch.testing.assert_close(a.float(), b.float(), **close)
        assert torch.equal(a == 0, b == 0)  # the columns past I: zeros in both

        N = 520
        codes, scales, ts, cb = make_stack(E, N, I, 4, 32, "log8", device="cuda", seed=I)
        rc, rs = LY.repack_stack(codes, scales, k=4, blocksize=32, scale_format="log8", N=N, K=I)
        kw = dict(k=4, N=N, K=I, sorted_rows=True,
                  config=wgmma_cfg({64: "7,16,8,4,8,1,1", 128: "7,12,16,4,8,1,1", 256: "7,8,32,4,8,1,1"}[bt]))
        y = GR.grouped_linear_repacked(gu, rows, ids, rc, rs, ts, cb, act="silu", **kw)
        y0 = GR.grouped_linear_repacked(silu_mul_gate_up(gu), rows, ids, rc, rs, ts, cb, **kw)
        ref = G.grouped_gemv_reference(silu_mul_gate_up_reference(gu).to(dtype), rows, ids, codes, scales, ts, cb, k=4,
                                       N=N, K=I)
        assert rel_err(y, ref) < tol(dtype) and rel_err(y, y0) < tol(dtype), (E, T, I)

        def step(a=(gu, rows, ids, rc, rs, ts, cb), kw=kw):
            return GR.grouped_linear_repacked(*a, act="silu", **kw)

        assert torch.equal(y, no_sync(step))
        graph, y3 = capture(step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y3)
