"""kbit.ops.attention.decode_attention against its float64 reference (and the reference against torch's SDPA).

CPU runs go through the Triton interpreter (``TRITON_INTERPRET=1``, set here when no GPU is present) on small
shapes, in float16 (the interpreter's bfloat16 arithmetic is wrong: the op upcasts bf16 there); small pinned
configs force several splits, splits past the valid length and per-block skips. ``@pytest.mark.gpu`` cases:
bf16/fp16 at Llama-3-8B / Qwen3-30B-A3B shapes, CUDA-graph replay with a changing length, torch.compile, and
``static_attention`` against its SDPA path.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kbit.bench.timing import capture  # noqa: E402
from kbit.ops.attention import (  # noqa: E402
    MAX_SPLITS,
    DecodeAttentionConfig,
    attention_config,
    decode_attention,
    decode_attention_reference,
    fold_steps,
    folds,
    supports,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RUNNABLE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNNABLE, reason="needs a GPU or TRITON_INTERPRET=1")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # P rounded to the input dtype for P @ V; output rounding


def _qkv(B, H, G, D, L, dtype=torch.float16, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, G, D, generator=g) * 2  # scores of a few units: a peaked softmax
    k = torch.randn(B, H, L, D, generator=g)
    v = torch.randn(B, H, L, D, generator=g)
    return (t.to(dtype).to(device) for t in (q, k, v))


def _static_mask(pos, L, B, dtype, device=DEV):
    """StaticDecoder's mask: 0 for keys j <= pos, the dtype's minimum after; [B, 1, 1, L] expanded (stride 0)."""
    allowed = torch.arange(L, device=device) <= pos
    mask = torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
    return mask.view(1, 1, 1, L).expand(B, 1, 1, L)


def _check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert bool(torch.isfinite(out).all()), "non-finite output"
    bad = err > TOL[dtype] * (1 + ref.abs())
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} elements off, max error {err.max().item():.3g}; first at {idx}: "
                             f"{out[idx].item()} vs {ref[idx].item()}")


def _poison_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors: every output or partial element read must be written."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        if t.is_floating_point():
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty", empty)


# ------------------------------------------------------------------------------------------------ reference
def test_reference_matches_sdpa():
    B, H, G, D, L = 2, 3, 4, 32, 40
    q, k, v = _qkv(B, H, G, D, L, dtype=torch.float64, device="cpu")
    for pos in (0, 17, L - 1):
        mask = _static_mask(pos, L, B, torch.float64, device="cpu")
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        got = decode_attention_reference(q, k, v, mask=mask, scale=0.3)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got = decode_attention_reference(q, k, v, length=torch.tensor([pos + 1]), scale=0.3)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ kernel
CONFIGS = {
    "default": None,
    "c32b16": DecodeAttentionConfig(chunk=32, block_n=16),
    "c48b16": DecodeAttentionConfig(chunk=48, block_n=16, num_warps=2, num_stages=3),  # 3 blocks per split
    "one": DecodeAttentionConfig(chunk=512, block_n=64),  # one split: direct write, no combine
}


@needs_kernel
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("B,H,G,D,L,n", [
    (1, 2, 4, 64, 112, 1),
    (2, 2, 4, 64, 112, 15),
    (3, 1, 7, 64, 112, 17),
    (1, 2, 8, 128, 112, 100),
    (2, 1, 1, 128, 112, 112),
    (1, 1, 4, 64, 100, 100),  # L not a multiple of the block
])
def test_length_matches_reference(monkeypatch, cfg, B, H, G, D, L, n):
    q, k, v = _qkv(B, H, G, D, L, seed=B * 100 + n)
    k[:, :, n:] = math.nan  # keys past the length must never be read
    v[:, :, n:] = math.inf
    length = torch.tensor(n, dtype=torch.int32, device=DEV)
    ref = decode_attention_reference(q, k, v, length=length, out_dtype=torch.float64)
    _poison_empty(monkeypatch)
    out = decode_attention(q, k, v, length=length, config=CONFIGS[cfg])
    _check(out, ref, torch.float16)


@needs_kernel
@pytest.mark.parametrize("cfg", ["default", "c32b16"])
@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.float32, torch.bool])
def test_static_mask_matches_reference(monkeypatch, cfg, mask_dtype):
    B, H, G, D, L, pos = 2, 2, 4, 64, 96, 40
    q, k, v = _qkv(B, H, G, D, L, seed=3)
    k[:, :, pos + 1:] = math.nan
    v[:, :, pos + 1:] = math.nan
    if mask_dtype == torch.bool:
        mask = (torch.arange(L, device=DEV) <= pos).view(1, 1, 1, L).expand(B, 1, 1, L)
    else:
        mask = _static_mask(pos, L, B, mask_dtype)
    ref = decode_attention_reference(q, k, v, mask=mask, out_dtype=torch.float64)
    _poison_empty(monkeypatch)
    _check(decode_attention(q, k, v, mask=mask, config=CONFIGS[cfg]), ref, torch.float16)


@needs_kernel
def test_general_mask_length_and_scale():
    """Finite additive values are added; -inf and dtype minima exclude; with a per-row length both apply."""
    B, H, G, D, L = 3, 2, 4, 64, 80
    q, k, v = _qkv(B, H, G, D, L, seed=4)
    g = torch.Generator().manual_seed(9)
    mask = (torch.rand(B, 1, 1, L, generator=g) * -4).to(DEV)
    mask[0, ..., 5:9] = -math.inf
    mask[1, ..., 30:70] = torch.finfo(torch.float32).min
    length = torch.tensor([80, 75, 33], device=DEV)
    ref = decode_attention_reference(q, k, v, length=length, mask=mask, scale=0.05, out_dtype=torch.float64)
    out = decode_attention(q, k, v, length=length, mask=mask, scale=0.05, config=CONFIGS["c32b16"])
    _check(out, ref, torch.float16)


@needs_kernel
def test_early_exit_and_empty_rows(monkeypatch):
    """Most splits past the valid length (neutral partials), a row with no valid key gets zeros."""
    B, H, G, D, L = 2, 2, 4, 64, 256
    q, k, v = _qkv(B, H, G, D, L, seed=5)
    length = torch.tensor([3, 0], device=DEV)
    k[0, :, 3:] = math.nan
    v[0, :, 3:] = math.nan
    k[1] = math.nan
    v[1] = math.nan
    _poison_empty(monkeypatch)
    out = decode_attention(q, k, v, length=length, config=CONFIGS["c32b16"])
    ref = decode_attention_reference(q, k, v, length=length, out_dtype=torch.float64)
    _check(out, ref, torch.float16)
    assert bool((out[1] == 0).all())


@needs_kernel
def test_combine_merges_in_steps(monkeypatch):
    """More partials than one step of the second launch's merge (D = 256: 32 partials a step, 40 splits): rows whose
    second step is partly valid, wholly neutral, and a row with no valid key."""
    B, H, G, D, L = 4, 1, 4, 256, 640
    q, k, v = _qkv(B, H, G, D, L, seed=11)
    length = torch.tensor([640, 530, 20, 0], device=DEV)
    for b, n in enumerate(length.tolist()):
        k[b, :, n:] = math.nan
        v[b, :, n:] = math.nan
    _poison_empty(monkeypatch)
    out = decode_attention(q, k, v, length=length, config=DecodeAttentionConfig(chunk=16, block_n=16))
    ref = decode_attention_reference(q, k, v, length=length, out_dtype=torch.float64)
    _check(out, ref, torch.float16)
    assert bool((out[3] == 0).all())


@needs_kernel
def test_strided_inputs():
    """Query as transformers makes it (a reshape of [B, Hq, 1, D] with strides), a cache slice."""
    B, Hq, H, D, L = 2, 8, 2, 64, 64
    g = torch.Generator().manual_seed(6)
    q4 = torch.randn(B, 1, Hq, D, generator=g).to(torch.float16).to(DEV).transpose(1, 2)  # [B, Hq, 1, D]
    qg = q4.reshape(B, H, Hq // H, D)
    big = torch.randn(B, H, 2 * L, D, generator=g).to(torch.float16).to(DEV)
    k, v = big[:, :, :L], big[:, :, L:]
    n = torch.tensor([50], device=DEV)
    ref = decode_attention_reference(qg, k, v, length=n, out_dtype=torch.float64)
    _check(decode_attention(qg, k, v, length=n, config=CONFIGS["c32b16"]), ref, torch.float16)


@needs_kernel
def test_bf16_through_the_interpreter_upcast():
    q, k, v = _qkv(2, 2, 4, 64, 64, dtype=torch.bfloat16, seed=7)
    mask = _static_mask(20, 64, 2, torch.bfloat16)
    ref = decode_attention_reference(q, k, v, mask=mask, out_dtype=torch.float64)
    _check(decode_attention(q, k, v, mask=mask, config=CONFIGS["c32b16"]), ref, torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("cfg", ["default", "c32b16", "c48b16", "one"])
@pytest.mark.parametrize("B,H,G,D,L,ns", [
    (1, 2, 4, 64, 112, (1, 30, 112)),
    (2, 2, 4, 64, 112, ((15, 100), (112, 2))),  # per-row lengths
    (1, 1, 7, 128, 100, (33, 100)),
    (1, 1, 7, 128, 300, (33, 300)),  # default: 10 splits, a merge of two steps: the second launch merges
    (2, 3, 1, 64, 96, (64,)),
])
def test_prefetch_and_fold_match_reference(monkeypatch, cfg, B, H, G, D, L, ns):
    """new_from (keys before it loaded before the PDL wait) and counters (the last split merges): the same
    outputs, and the counters are zero again after every call."""
    counters = torch.zeros(B * H + 3, dtype=torch.int32, device=DEV)
    _poison_empty(monkeypatch)
    for i, n in enumerate(ns):
        q, k, v = _qkv(B, H, G, D, L, seed=50 + i)
        length = torch.tensor(n if isinstance(n, tuple) else [n], device=DEV)
        mx = int(length.max())
        k[:, :, mx:] = math.nan  # keys past every length must never be read
        v[:, :, mx:] = math.inf
        ref = decode_attention_reference(q, k, v, length=length, out_dtype=torch.float64)
        out = decode_attention(q, k, v, length=length, new_from=length - 1, counters=counters, config=CONFIGS[cfg])
        _check(out, ref, torch.float16)
        assert counters.eq(0).all(), counters


def test_fold_only_where_the_merge_is_one_step():
    """The last split merges (given counters) only where it loads every partial in one step of SB; one split
    never merges."""
    assert fold_steps(17, 4, 128) == (16, 2) and not folds(17, 4, 128)  # Llama-3-8B, batch 1, context 512
    assert fold_steps(17, 7, 128) == (8, 3) and not folds(17, 7, 128)  # Qwen2.5-7B
    assert fold_steps(3, 4, 128) == (4, 1) and folds(3, 4, 128)  # Llama-3-8B, batch 16
    assert fold_steps(6, 7, 128) == (8, 1) and folds(6, 7, 128)
    assert folds(16, 4, 128) and not folds(1, 4, 128)
    for S in range(1, 70):
        for G in (1, 3, 4, 7, 8, 16, 64):
            for D in (64, 128, 256):
                SB, steps = fold_steps(S, G, D)
                assert SB >= 1 and SB * steps >= S > SB * (steps - 1)
                assert folds(S, G, D) == (S > 1 and S <= SB)


@needs_kernel
def test_opcheck():
    q, k, v = _qkv(1, 2, 4, 64, 64, seed=8)
    n = torch.tensor([40], device=DEV)
    mask = _static_mask(30, 64, 1, torch.float16)
    c = torch.zeros(2, dtype=torch.int32, device=DEV)
    for op, args in ((torch.ops.kbit.decode_attention, (q, k, v, n, mask, None, 0.125, 32, 16, 4, 2)),
                     (torch.ops.kbit.decode_attention_counted, (q, k, v, n, None, n - 1, c, 0.125, 32, 16, 4, 2))):
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("bh,L,D,sms", [(8, 544, 128, 132), (4, 544, 128, 132), (512, 544, 128, 132),
                                        (8, 8208, 128, 132), (128, 2064, 256, 132), (1, 17, 64, 2)])
def test_pick_config(bh, L, D, sms):
    c = attention_config(bh, L, D, sms)
    splits = -(-L // c.chunk)
    assert c.chunk % c.block_n == 0 and c.block_n >= 16
    assert bh * splits <= max(bh, 4 * sms)  # about PROGRAMS_PER_SM per SM, at least one split a head
    assert splits <= MAX_SPLITS  # the last program of a head merges every split
    if bh >= 4 * sms:
        assert splits == 1
    if D > 128:
        assert c.block_n == 32


def test_config_validation():
    for kw in ({"chunk": 48, "block_n": 32}, {"chunk": 8, "block_n": 8}, {"chunk": 64, "block_n": 24},
               {"chunk": 64, "block_n": 64, "num_warps": 3}, {"chunk": 64, "num_stages": 0}):
        with pytest.raises(ValueError, match="DecodeAttentionConfig"):
            DecodeAttentionConfig(**kw)


# ------------------------------------------------------------------------------------------------ errors
_Q, _K, _V = _qkv(2, 2, 4, 64, 32)
_N = torch.tensor([5], device=DEV)
BAD = {
    "query dtype": (dict(query=_Q.float()), TypeError, "query: expected float16 or bfloat16"),
    "query type": (dict(query=_Q.tolist()), TypeError, "query: expected a torch.Tensor"),
    "key dtype": (dict(key=_K.to(torch.bfloat16)), TypeError, "key: expected query's dtype"),
    "dims": (dict(query=_Q[0]), ValueError, "query: expected 4 dimensions"),
    "D": (dict(query=_Q[..., :48], key=_K[..., :48], value=_V[..., :48]), ValueError, "power of two"),
    "G": (dict(query=torch.zeros(2, 2, 65, 64, dtype=torch.float16, device=DEV)), ValueError, "G <= 64"),
    "key shape": (dict(key=_K[:1], value=_V[:1]), ValueError, "key: expected shape"),
    "value shape": (dict(value=_V[:, :, :16]), ValueError, "value: expected"),
    "stride": (dict(key=_K.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "last dimension"),
    "length dtype": (dict(length=_N.float()), TypeError, "length: expected an int32 or int64"),
    "length shape": (dict(length=torch.tensor([1, 2, 3], device=DEV)), ValueError, "length: expected shape"),
    "length type": (dict(length=5), TypeError, "length: expected"),
    "mask dtype": (dict(mask=torch.zeros(2, 1, 1, 32, dtype=torch.int32, device=DEV)), TypeError,
                   "mask: expected bool"),
    "mask heads": (dict(mask=torch.zeros(2, 2, 1, 32, device=DEV)), ValueError, "mask: expected shape"),
    "mask len": (dict(mask=torch.zeros(2, 1, 1, 31, device=DEV)), ValueError, "mask: expected shape"),
    "scale": (dict(scale=math.nan), TypeError, "scale: expected"),
    "config": (dict(config=(32, 16)), TypeError, "config: expected"),
    "new_from dtype": (dict(length=_N, new_from=_N.float()), TypeError, "new_from: expected an int32"),
    "new_from alone": (dict(new_from=_N), ValueError, "new_from: expected to come with length"),
    "new_from shape": (dict(length=_N, new_from=torch.tensor([1, 2], device=DEV)), ValueError,
                       "new_from: expected to come with length"),
    "counters dtype": (dict(counters=torch.zeros(4, device=DEV)), TypeError, "counters: expected an int32"),
    "counters size": (dict(counters=torch.zeros(3, dtype=torch.int32, device=DEV)), ValueError,
                      "at least B \\* Hkv = 4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    kw, exc, msg = BAD[case]
    args = {"query": _Q, "key": _K, "value": _V, **kw}
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    with pytest.raises(exc, match=msg):
        decode_attention(q, k, v, **args)


def test_bad_input_device():
    q, k, v = _qkv(1, 1, 4, 64, 16, device="cpu")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            with pytest.raises(ValueError, match="CUDA device"):
                decode_attention(q, k, v)
        return
    with pytest.raises(ValueError, match="CUDA device"):
        decode_attention(q, k, v)
    with pytest.raises(ValueError, match="key: expected on"):
        decode_attention(q.cuda(), k, v.cuda())
    with pytest.raises(ValueError, match="length: expected on"):
        decode_attention(q.cuda(), k.cuda(), v.cuda(), length=torch.tensor([3]))


def test_supports():
    q, k, v = _qkv(1, 2, 4, 64, 16, device=DEV)
    assert not supports(q.float(), k.float(), v.float())
    assert not supports(q, k, v, torch.zeros(1, 2, 4, 16, device=DEV))  # a per-head mask: SDPA keeps it
    if RUNNABLE:
        assert supports(q, k, v, torch.zeros(1, 1, 1, 16, device=DEV))


def test_decode_attention_argument():
    """StaticDecoder(decode_attention=...) / static_attention(kernel=...): each choice has its own registered
    attention name; anything else is refused, naming the argument."""
    from kbit.hf.decode import DECODE_ATTENTION, STATIC_ATTENTION, attention_name

    names = [attention_name(c) for c in ("auto", "kbit", "sdpa")]
    assert tuple(DECODE_ATTENTION) == ("auto", "kbit", "sdpa")
    assert names[0] == STATIC_ATTENTION and len(set(names)) == 3
    assert all(n.startswith(STATIC_ATTENTION) and "sdpa" not in n for n in names)
    with pytest.raises(ValueError, match="decode_attention"):
        attention_name("flash")


# ------------------------------------------------------------------------------------------------ GPU
SHAPES = {"llama3-8b": (8, 4), "qwen3-30b-a3b": (4, 8)}  # (Hkv, G), D = 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("B,n,L", [(1, 529, 544), (4, 2049, 2064), (16, 100, 2064), (64, 528, 544)])
def test_gpu_model_shapes(dtype, model, B, n, L):
    H, G = SHAPES[model]
    q, k, v = _qkv(B, H, G, 128, L, dtype=dtype, seed=n)
    mask = _static_mask(n - 1, L, B, dtype)
    ref = decode_attention_reference(q, k, v, mask=mask, out_dtype=torch.float64)
    _check(decode_attention(q, k, v, mask=mask), ref, dtype)
    _check(decode_attention(q, k, v, length=torch.tensor([n], device=DEV)), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("D,G", [(64, 16), (256, 4), (128, 7), (16, 2)])
def test_gpu_head_dims(D, G):
    q, k, v = _qkv(2, 2, G, D, 1040, dtype=torch.bfloat16, seed=D)
    n = torch.tensor([1000, 37], device=DEV)
    ref = decode_attention_reference(q, k, v, length=n, out_dtype=torch.float64)
    _check(decode_attention(q, k, v, length=n), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("use_mask", [False, True, "fold"])
def test_gpu_graph_replay_changing_length(use_mask):
    B, H, G, D, L = 2, 8, 4, 128, 2064
    q, k, v = _qkv(B, H, G, D, L, dtype=torch.bfloat16, seed=11)
    n = torch.tensor([1], device=DEV)
    arange = torch.arange(L, device=DEV)
    counters = torch.zeros(B * H, dtype=torch.int32, device=DEV)

    def call():
        if use_mask == "fold":  # the fast decode step's form: prefetch before the wait, counters (33 splits here:
            # a merge of 3 steps, so a second launch merges; see folds)
            return decode_attention(q, k, v, length=n, new_from=n - 1, counters=counters)
        if use_mask:
            mask = torch.where(arange < n, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
            return decode_attention(q, k, v, mask=mask.view(1, 1, 1, L).expand(B, 1, 1, L))
        return decode_attention(q, k, v, length=n)

    graph, out = capture(call)
    for length in (1, 5, 63, 64, 65, 700, 2047, 2064, 17):
        n.fill_(length)
        graph.replay()
        eager = call()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        ref = decode_attention_reference(q, k, v, length=n, out_dtype=torch.float64)
        _check(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_torch_compile():
    q, k, v = _qkv(1, 8, 4, 128, 544, dtype=torch.bfloat16, seed=12)
    n = torch.tensor([300], device=DEV)
    fn = torch.compile(lambda q, k, v, n: decode_attention(q, k, v, length=n) * 2, fullgraph=True)
    c = torch.zeros(8, dtype=torch.int32, device=DEV)
    fc = torch.compile(lambda q, k, v, n: decode_attention(q, k, v, length=n, new_from=n - 1, counters=c) * 2,
                       fullgraph=True)
    want = decode_attention(q, k, v, length=n) * 2
    torch.testing.assert_close(fn(q, k, v, n), want)
    torch.testing.assert_close(fc(q, k, v, n), want, rtol=1e-2, atol=1e-2)  # another merge order
    assert c.eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", list(SHAPES))
def test_gpu_static_attention_matches_sdpa(dtype, model):
    from kbit.hf.decode import static_attention

    H, G = SHAPES[model]
    B, L, pos = 4, 544, 528
    g = torch.Generator().manual_seed(13)
    query = torch.randn(B, 1, H * G, 128, generator=g).to(dtype).to(DEV).transpose(1, 2)  # [B, Hq, 1, D]
    key = torch.randn(B, H, L, 128, generator=g).to(dtype).to(DEV)
    value = torch.randn(B, H, L, 128, generator=g).to(dtype).to(DEV)
    mask = _static_mask(pos, L, B, dtype)
    out, _ = static_attention(None, query, key, value, mask, scaling=128 ** -0.5)
    want, _ = static_attention(None, query, key, value, mask, scaling=128 ** -0.5, kernel="sdpa")
    assert out.shape == want.shape == (B, 1, H * G, 128)
    torch.testing.assert_close(out, want, rtol=2 * TOL[dtype], atol=2 * TOL[dtype])


@pytest.mark.gpu
def test_gpu_decoder_kernel_vs_sdpa():
    """A tiny Llama (D = 16) decoded under a CUDA graph with each attention: the same greedy tokens."""
    from test_decode import PROMPT, llama, static_greedy

    model = llama(vocab=256).to(device="cuda", dtype=torch.float16)
    ids = torch.tensor(PROMPT, device="cuda")
    t_kbit, l_kbit = static_greedy(model, ids, 8, graph=True)
    t_sdpa, l_sdpa = static_greedy(model, ids, 8, graph=True, decode_attention="sdpa")
    assert torch.equal(t_kbit, t_sdpa)
    torch.testing.assert_close(l_kbit, l_sdpa, atol=2e-2, rtol=2e-2)
