"""kbit.ops.attention.rope_decode_attention (q/k norms + rotary + KV append fused into the decode attention) against
its float64 reference (``rope_append_reference`` then ``decode_attention_reference``) and against the unfused pair
(``kbit.ops.glue.rope_append`` then ``decode_attention``): the same cache entries bit for bit, the output within the
dtype's tolerance of both.

CPU runs go through the Triton interpreter (``TRITON_INTERPRET=1``) on small shapes in float16 (bfloat16 is upcast
there); small pinned configs put the position at a chunk boundary, in a split's later block, at 0 and at the last
position. Cache positions from ``pos`` on hold NaN (only ``pos`` may be written, nothing there read), and outputs and
partials come from a NaN-filled ``torch.empty``. ``@pytest.mark.gpu``: bf16 at Llama-3-8B / Qwen3-8B / GQA-5 shapes,
CUDA-graph replay with a changing position, torch.compile.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kbit.ops.attention import (  # noqa: E402
    DecodeAttentionConfig,
    decode_attention,
    rope_decode_attention,
    rope_decode_attention_reference,
)
from kbit.ops.glue import rope_append  # noqa: E402
from test_attention import _check, _poison_empty  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RUNNABLE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNNABLE, reason="needs a GPU or TRITON_INTERPRET=1")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6

CONFIGS = {
    "default": None,
    "c32b16": DecodeAttentionConfig(chunk=32, block_n=16),  # several splits, two blocks each
    "c48b16": DecodeAttentionConfig(chunk=48, block_n=16, num_warps=2, num_stages=3),
    "one": DecodeAttentionConfig(chunk=128, block_n=64),  # one split: the output written directly
}


def _case(B, H, G, D, L, pos, dtype, norm, seed=0, device=DEV):
    """Raw q/k/v as column slices of one fused projection output, rotary tables, caches poisoned from pos on."""
    g = torch.Generator().manual_seed(seed)
    Hq = H * G
    qkv = torch.randn(B, (Hq + 2 * H) * D + 8, generator=g) * 2  # 8 spare columns: the slices are strided
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).double() / D))
    ang = torch.arange(L).double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    kc, vc = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    kc[:, :, pos:] = math.nan  # never read: pos is the step's own key (in registers), after it nothing is valid
    vc[:, :, pos:] = math.inf
    qn = (1 + 0.2 * torch.randn(D, generator=g)) if norm else None
    kn = (1 + 0.2 * torch.randn(D, generator=g)) if norm else None
    qkv, cos, sin, kc, vc = (t.to(dtype).to(device) for t in (qkv, cos, sin, kc, vc))
    qn, kn = (None if t is None else t.to(dtype).to(device) for t in (qn, kn))
    q, k, v = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + H) * D], qkv[:, (Hq + H) * D:(Hq + 2 * H) * D]
    return dict(q=q, k=k, v=v, cos=cos, sin=sin, pos=torch.tensor([pos], device=device), k_cache=kc, v_cache=vc,
                q_norm=qn, k_norm=kn)


def _with_caches(c, k_cache, v_cache):
    return {**c, "k_cache": k_cache, "v_cache": v_cache}


def _bits_equal(a, b) -> bool:
    """Bit for bit (NaN poison included; torch.equal calls NaN unequal and -0 equal to 0)."""
    view = torch.int16 if a.element_size() == 2 else torch.int64 if a.element_size() == 8 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(view) == b.view(view)).all())


def _unfused(c, scale=None, config=None, counters=None):
    """The path the fused op replaces: rope_append (writes the caches), then decode_attention over [0, pos]."""
    kc = c["k_cache"]
    B, H, _, D = kc.shape
    qr = rope_append(c["q"], c["k"], c["v"], c["cos"], c["sin"], c["pos"], kc, c["v_cache"], c["q_norm"],
                     c["k_norm"], EPS)
    pos = c["pos"]
    return decode_attention(qr.view(B, H, -1, D), kc, c["v_cache"], length=pos + 1, new_from=pos, scale=scale,
                            config=config, counters=counters)


def _reference(c, scale=None):
    """Float64 reference on float64 copies of everything (returns the output and the caches it wrote)."""
    d = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in c.items()}
    out = rope_decode_attention_reference(**d, eps=EPS, scale=scale, out_dtype=torch.float64)
    return out, d["k_cache"], d["v_cache"]


# --------------------------------------------------------------------------------------------------- reference
def test_reference_is_rope_append_then_attention():
    B, H, G, D, L, pos = 2, 2, 3, 16, 12, 7
    c = _case(B, H, G, D, L, pos, torch.float64, True, seed=1, device="cpu")
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    from kbit.ops.attention import decode_attention_reference  # noqa: PLC0415  (the spec's parts, spelled out)
    from kbit.ops.glue import rope_append_reference  # noqa: PLC0415

    qr = rope_append_reference(c["q"], c["k"], c["v"], c["cos"], c["sin"], c["pos"], kc, vc, c["q_norm"],
                               c["k_norm"], EPS)
    want = decode_attention_reference(qr.view(B, H, G, D), kc, vc, length=torch.tensor([pos + 1]))
    got = rope_decode_attention_reference(**c, eps=EPS)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _bits_equal(c["k_cache"], kc) and _bits_equal(c["v_cache"], vc)


# --------------------------------------------------------------------------------------------------- kernel
@needs_kernel
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("B,H,G,D,L,pos,norm", [
    (1, 2, 4, 64, 96, 0, False),  # the first step: only the new key
    (2, 2, 4, 64, 96, 32, True),  # a chunk boundary of c32b16 (the new key alone in its split)
    (1, 1, 5, 128, 96, 48, False),  # GQA 5, a chunk boundary of c48b16
    (2, 1, 1, 64, 96, 95, True),  # G = 1, the last position
    (1, 2, 8, 128, 80, 57, True),  # G = 8, the new key in a split's second block
    (3, 1, 5, 64, 64, 21, False),
])
def test_matches_reference_and_unfused(monkeypatch, cfg, B, H, G, D, L, pos, norm):
    dtype = torch.float16
    c = _case(B, H, G, D, L, pos, dtype, norm, seed=B * 1000 + pos)
    ref, kr, vr = _reference(c)
    ku, vu = c["k_cache"].clone(), c["v_cache"].clone()
    kf, vf = c["k_cache"].clone(), c["v_cache"].clone()
    counters = torch.zeros(B * H + 2, dtype=torch.int32, device=DEV)
    _poison_empty(monkeypatch)
    unfused = _unfused(_with_caches(c, ku, vu), config=CONFIGS[cfg])
    out = rope_decode_attention(**_with_caches(c, kf, vf), eps=EPS, config=CONFIGS[cfg], counters=counters)
    assert counters.eq(0).all(), counters
    assert _bits_equal(kf, ku) and _bits_equal(vf, vu)  # rope_append's cache, bit for bit (poison kept)
    _check(kf[:, :, pos], kr[:, :, pos], dtype)
    _check(out, ref, dtype)
    _check(out, unfused.double(), dtype)


@needs_kernel
@pytest.mark.parametrize("cfg", ["c32b16", "default"])
def test_combine_kernel_without_counters(monkeypatch, cfg):
    c = _case(2, 2, 4, 64, 96, 70, torch.float16, True, seed=3)
    ref, _, _ = _reference(c, scale=0.2)
    _poison_empty(monkeypatch)
    _check(rope_decode_attention(**c, eps=EPS, scale=0.2, config=CONFIGS[cfg]), ref, torch.float16)


@needs_kernel
@pytest.mark.parametrize("norm", [False, True])
def test_bf16_through_the_interpreter_upcast(norm):
    dtype = torch.bfloat16
    c = _case(2, 2, 4, 64, 64, 33, dtype, norm, seed=4)
    ref, kr, _ = _reference(c)
    ku, vu = c["k_cache"].clone(), c["v_cache"].clone()
    unfused = _unfused(_with_caches(c, ku, vu), config=CONFIGS["c32b16"])
    out = rope_decode_attention(**c, eps=EPS, config=CONFIGS["c32b16"])
    if not torch.cuda.is_available():  # the interpreter computes both in float32: the same values
        assert _bits_equal(c["k_cache"], ku) and _bits_equal(c["v_cache"], vu)
    _check(c["k_cache"][:, :, 33], kr[:, :, 33], dtype)
    _check(out, ref, dtype)
    _check(out, unfused.double(), dtype)


@needs_kernel
def test_opcheck():
    c = _case(1, 2, 4, 64, 64, 40, torch.float16, True, seed=5)
    counters = torch.zeros(2, dtype=torch.int32, device=DEV)
    args = tuple(c.values())
    for op, a in ((torch.ops.kbit.rope_decode_attention, (*args, EPS, 0.125, 32, 16, 4, 2)),
                  (torch.ops.kbit.rope_decode_attention_counted, (*args, counters, EPS, 0.125, 32, 16, 4, 2))):
        torch.library.opcheck(op.default, a, test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------------------------------- errors
_C = _case(2, 2, 4, 64, 32, 5, torch.float16, False, seed=6)
BAD = {
    "q dtype": (dict(q=_C["q"].float(), k=_C["k"].float(), v=_C["v"].float()), TypeError, "q: expected dtype"),
    "q heads": (dict(q=_C["q"][:, :3 * 64]), ValueError, "q: expected Hq \\* D columns"),
    "G": (dict(q=torch.zeros(2, 65 * 2 * 64, dtype=torch.float16, device=DEV)), ValueError, "1 <= G <= 64"),
    "k width": (dict(k=_C["k"][:, :64]), ValueError, "v: expected 64 features|q, k: expected"),
    "cache dtype": (dict(k_cache=_C["k_cache"].float(), v_cache=_C["v_cache"].float()), TypeError,
                    "k_cache: expected q's dtype"),
    "cache shape": (dict(v_cache=_C["v_cache"][:, :, :16]), ValueError, "v_cache: expected shape"),
    "D": (dict(q=_C["q"][:, :8 * 8], k=_C["k"][:, :2 * 8], v=_C["v"][:, :2 * 8], cos=_C["cos"][:, :8],
               sin=_C["sin"][:, :8], k_cache=_C["k_cache"][..., :8], v_cache=_C["v_cache"][..., :8]), ValueError,
          "k_cache: expected a head dim"),
    "pos": (dict(pos=torch.tensor([1, 2], device=DEV)), ValueError, "pos: expected a one-element"),
    "pos type": (dict(pos=5), ValueError, "pos: expected"),
    "cos": (dict(cos=_C["cos"][:, :32]), ValueError, "cos: expected"),
    "sin": (dict(sin=_C["sin"][:5]), ValueError, "sin: expected cos's shape"),
    "norms": (dict(q_norm=torch.ones(64, dtype=torch.float16, device=DEV)), ValueError, "q_norm, k_norm"),
    "norm shape": (dict(q_norm=torch.ones(32, dtype=torch.float16, device=DEV),
                        k_norm=torch.ones(32, dtype=torch.float16, device=DEV)), ValueError, "q_norm: expected"),
    "eps": (dict(eps=0.0), ValueError, "eps: expected"),
    "scale": (dict(scale=math.inf), TypeError, "scale: expected"),
    "config": (dict(config=(32, 16)), TypeError, "config: expected"),
    "counters": (dict(counters=torch.zeros(3, dtype=torch.int32, device=DEV)), ValueError, "counters: expected"),
    "counters dtype": (dict(counters=torch.zeros(4, device=DEV)), TypeError, "counters: expected an int32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    kw, exc, msg = BAD[case]
    with pytest.raises(exc, match=msg):
        rope_decode_attention(**{**_C, "eps": EPS, **kw})


# --------------------------------------------------------------------------------------------------- GPU
SHAPES = {"llama3-8b": (8, 4, False), "qwen3-8b": (8, 4, True), "gqa5": (8, 5, False)}  # (Hkv, G, q/k norm)


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("B,L,pos", [(1, 544, 528), (16, 544, 63), (1, 4112, 4095), (4, 4112, 2048)])
def test_gpu_model_shapes(model, B, L, pos):
    H, G, norm = SHAPES[model]
    dtype = torch.bfloat16
    c = _case(B, H, G, 128, L, pos, dtype, norm, seed=pos)
    ref, _, _ = _reference(c)
    ku, vu = c["k_cache"].clone(), c["v_cache"].clone()
    counters = torch.zeros(B * H, dtype=torch.int32, device=DEV)
    unfused = _unfused(_with_caches(c, ku, vu), counters=counters)
    out = rope_decode_attention(**c, eps=EPS, counters=counters)
    assert _bits_equal(c["v_cache"], vu)
    if norm:  # the q/k norm's float32 sum of squares may be summed in another order: an ulp, rarely
        k, u = c["k_cache"][:, :, pos].float(), ku[:, :, pos].float()
        assert ((k - u).abs() <= u.abs() * 2 ** -7).all() and (k != u).float().mean() < 0.01
        assert _bits_equal(c["k_cache"][:, :, :pos], ku[:, :, :pos])
    else:
        assert _bits_equal(c["k_cache"], ku)
    _check(out, ref, dtype)
    _check(out, unfused.double(), dtype)


@pytest.mark.gpu
def test_gpu_graph_replay_changing_position():
    from kbit.bench.timing import capture  # noqa: PLC0415

    B, H, G, D, L = 2, 8, 4, 128, 2064
    c = _case(B, H, G, D, L, 0, torch.bfloat16, True, seed=11)
    base_k, base_v = c["k_cache"].clone(), c["v_cache"].clone()
    counters = torch.zeros(B * H, dtype=torch.int32, device=DEV)
    graph, out = capture(lambda: rope_decode_attention(**c, eps=EPS, counters=counters))
    for p in (0, 1, 63, 64, 65, 700, 2047, 2063, 17):
        for t, base in ((c["k_cache"], base_k), (c["v_cache"], base_v)):
            t.copy_(base)
            t[:, :, p:] = math.nan
        c["pos"].fill_(p)
        graph.replay()
        ref, kr, _ = _reference(_with_caches(c, base_k.clone(), base_v.clone()))
        _check(out, ref, torch.bfloat16)
        _check(c["k_cache"][:, :, p], kr[:, :, p], torch.bfloat16)
        assert counters.eq(0).all()


@pytest.mark.gpu
def test_gpu_torch_compile():
    c = _case(1, 8, 4, 128, 544, 300, torch.bfloat16, True, seed=12)
    counters = torch.zeros(8, dtype=torch.int32, device=DEV)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    want = rope_decode_attention(**_with_caches(c, kc, vc), eps=EPS, counters=counters) * 2
    fn = torch.compile(lambda q, k, v: rope_decode_attention(q, k, v, c["cos"], c["sin"], c["pos"], c["k_cache"],
                                                             c["v_cache"], c["q_norm"], c["k_norm"], EPS,
                                                             counters=counters) * 2, fullgraph=True)
    torch.testing.assert_close(fn(c["q"], c["k"], c["v"]), want, rtol=1e-2, atol=1e-2)  # another merge order
    assert _bits_equal(c["k_cache"], kc) and _bits_equal(c["v_cache"], vc)
    assert counters.eq(0).all()
