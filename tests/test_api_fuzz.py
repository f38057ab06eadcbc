"""Fuzzing the public API (hypothesis): random arguments to ``kbit.linear``, ``KbitLinear`` and ``kbit.quantize``.

Bad arguments (dtypes, shapes, the meta device, k, blocksize, scale format, sizes, codebooks) always give a
``ValueError`` / ``TypeError`` whose message is ``"<argument>: expected <what>, got <what came>"``, the argument one
of those made bad; good arguments give the reference's numbers (bit-exact with the plain-torch reference).
"""

import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import kbit
from kbit.format import codebooks as cbs
from kbit.format.reference import quantize_reference
from kbit.nn import KbitLinear
from kbit.ops.quantize import KbitQualityWarning
from kbit.ops.reference import linear_reference, linear_tensors_reference

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NOT_FLOATS = (torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64)
FORMAT = st.tuples(st.sampled_from([2, 3, 4, 5]), st.sampled_from([32, 64, 128]), st.sampled_from(["log8", "fp16"]))


def _rand(*shape, seed=0):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def _raises_naming(bad: set, fn):
    """``fn()`` raises ValueError/TypeError "<name>: expected ..., got ..." with ``name`` in ``bad``."""
    with pytest.raises((ValueError, TypeError)) as e:
        fn()
    msg = str(e.value)
    m = re.match(r"^(\S+?): expected .+, got .+", msg, re.S)
    assert m, msg
    name = m.group(1)
    name = re.sub(r"^state_dict\['(.*)'\]$", r"\1", name)
    assert name in bad, (name, bad, msg)


# ------------------------------------------------------------------------------------------------ kbit.linear


def _pick(draw, valid: bool, good, bad):
    """One of ``good`` (a strategy) for a valid call; else one of ``good`` or ``bad``."""
    return draw(good if valid else st.one_of(good, bad))


@st.composite
def linear_calls(draw):
    N, K = draw(st.integers(1, 12)), draw(st.integers(1, 80))
    valid = draw(st.booleans())  # half the calls valid: both sides get examples
    return dict(
        N=N, K=K, fmt=draw(FORMAT), seed=draw(st.integers(0, 99)), x_lead=draw(st.lists(st.integers(0, 3), max_size=2)),
        x_dtype=_pick(draw, valid, st.sampled_from(FLOATS), st.sampled_from(NOT_FLOATS)),
        x_k=_pick(draw, valid, st.just(K), st.integers(0, 90)),
        x_meta=_pick(draw, valid, st.just(False), st.just(True)),
        bias=_pick(draw, valid, st.sampled_from([None, "ok"]),
                   st.sampled_from(["N+1", "[1]", "[1, N]", "int", "meta", "list"])),
        weight=_pick(draw, valid, st.just("ok"), st.sampled_from(["tensor", "meta codebook", "meta scales"])),
    )


def _bias(kind, N, seed):
    if kind is None:
        return None, False
    made = {"ok": lambda: _rand(N, seed=seed), "N+1": lambda: _rand(N + 1), "[1]": lambda: _rand(1),
            "[1, N]": lambda: _rand(1, N), "int": lambda: torch.zeros(N, dtype=torch.int32),
            "meta": lambda: torch.zeros(N, device="meta"), "list": lambda: [0.0] * N}[kind]()
    return made, kind != "ok" and not (kind == "[1]" and N == 1)


@FUZZ
@given(c=linear_calls())
def test_fuzz_linear(c):
    N, K, (k, bs, sf) = c["N"], c["K"], c["fmt"]
    qw = kbit.quantize(_rand(N, K, seed=c["seed"]), k=k, blocksize=bs, scale_format=sf)
    x = _rand(*c["x_lead"], c["x_k"], seed=1).to(c["x_dtype"])
    if c["x_meta"]:
        x = x.to("meta")
    bias, bias_bad = _bias(c["bias"], N, c["seed"])
    bad = set()
    if c["x_dtype"] not in FLOATS or c["x_k"] != K or c["x_meta"]:
        bad.add("x")
    if bias_bad:
        bad.add("bias")
    weight = qw
    if c["weight"] == "tensor":  # a plain tensor where a KbitWeight belongs
        weight, bad = _rand(N, K), bad | {"weight"}
    elif c["weight"].startswith("meta"):
        name = c["weight"].split()[1]
        t = {**qw.tensors(), name: qw.tensors()[name].to("meta")}
        bad.add(name)
        call = lambda: torch.ops.kbit.linear(x, t["codes"], t["scales"], t["tensor_scale"], t["codebook"], k, bs,  # noqa: E731
                                             sf, N, K, bias)
        if isinstance(bias, list):
            return  # the op's schema takes tensors only; kbit.linear checks the type (the other branch)
        _raises_naming(bad, call)
        return
    if bad:
        _raises_naming(bad, lambda: kbit.linear(x, weight, bias))
        return
    y = kbit.linear(x, qw, bias)
    assert y.shape == (*c["x_lead"], N) and y.dtype == x.dtype
    ref = linear_tensors_reference(x, *qw.tensors().values(), k=k, blocksize=bs, scale_format=sf, N=N, K=K, bias=bias)
    assert torch.equal(y, ref)
    if x.dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(y.double(), linear_reference(x, qw, bias), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ KbitLinear

SIZES = st.integers(1, 70)
BAD_SIZES = st.one_of(st.integers(-3, 0), st.sampled_from([2.5, "8", None, True, 0.0]))


def _size_ok(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@st.composite
def kbit_linear_args(draw):
    valid = draw(st.booleans())
    return (_pick(draw, valid, SIZES, BAD_SIZES), _pick(draw, valid, SIZES, BAD_SIZES),
            _pick(draw, valid, st.sampled_from([2, 3, 4, 5]), st.sampled_from([1, 6, 0, 4.0, "4", None, True])),
            _pick(draw, valid, st.sampled_from([32, 64, 128]), st.sampled_from([16, 256, 32.0, "32"])),
            _pick(draw, valid, st.sampled_from(["log8", "fp16"]), st.sampled_from(["fp8", None, 8])))


@FUZZ
@given(args=kbit_linear_args(), bias=st.booleans(), seed=st.integers(0, 99))
def test_fuzz_kbit_linear(args, bias, seed):
    in_f, out_f, k, bs, sf = args
    bad = {name for name, ok in (("in_features", _size_ok(in_f)), ("out_features", _size_ok(out_f)),
                                 ("k", k in (2, 3, 4, 5) and type(k) is int),
                                 ("blocksize", bs in (32, 64, 128) and type(bs) is int),
                                 ("scale_format", sf in ("log8", "fp16"))) if not ok}
    kw = dict(k=k, blocksize=bs, scale_format=sf, dtype=torch.float32)
    if bad:
        _raises_naming(bad, lambda: KbitLinear(in_f, out_f, bias, **kw))
        return
    empty = KbitLinear(in_f, out_f, bias, **kw)
    torch.manual_seed(seed)
    q = KbitLinear.from_linear(nn.Linear(in_f, out_f, bias=bias), k=k, blocksize=bs, scale_format=sf)
    empty.load_state_dict(q.state_dict())
    x = _rand(2, in_f, seed=seed)
    w = q.weight()
    ref = linear_tensors_reference(x, *w.tensors().values(), k=k, blocksize=bs, scale_format=sf, N=out_f, K=in_f,
                                   bias=q.bias)
    assert torch.equal(q(x), ref) and torch.equal(empty(x), ref)
    bad_k = 2 if k != 2 else 3
    snap = {n: t.clone() for n, t in empty.state_dict().items() if isinstance(t, torch.Tensor)}
    other = KbitLinear.from_linear(nn.Linear(in_f, out_f, bias=bias), k=bad_k, blocksize=bs, scale_format=sf)
    with pytest.raises(ValueError, match="k="):
        empty.load_state_dict(other.state_dict())
    assert all(torch.equal(t, snap[n]) for n, t in empty.state_dict().items() if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------------------------------------ kbit.quantize


@st.composite
def quantize_calls(draw):
    valid = draw(st.booleans())
    ndim = _pick(draw, valid, st.integers(2, 3), st.integers(0, 1))
    return dict(
        shape=tuple(_pick(draw, valid, st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim),
                          st.lists(st.integers(0, 40), min_size=ndim, max_size=ndim))),
        dtype=_pick(draw, valid, st.sampled_from(FLOATS), st.sampled_from(NOT_FLOATS)),
        meta=_pick(draw, valid, st.just(False), st.just(True)),
        k=_pick(draw, valid, st.sampled_from([2, 3, 4, 5]), st.sampled_from([1, 6, 3.0])),
        blocksize=_pick(draw, valid, st.sampled_from([32, 64, 128]), st.sampled_from([48, 0])),
        codebook=_pick(draw, valid, st.sampled_from([None, "nf", "lloyd", "uniform", "levels"]),
                       st.sampled_from(["bogus", "short", "unsorted"])),
        scale_format=_pick(draw, valid, st.sampled_from(["log8", "fp16"]), st.just("int8")),
        backend=_pick(draw, valid, st.sampled_from(["auto", "torch"]), st.just("cuda")),
        nonfinite=_pick(draw, valid, st.just(False), st.just(True)),
    )


@FUZZ
@given(c=quantize_calls())
def test_fuzz_quantize(c):
    shape, k = c["shape"], c["k"]
    k_ok = type(k) is int and k in (2, 3, 4, 5)
    n = 2**k if k_ok else 4
    codebook = {"levels": torch.linspace(-1, 1, n), "short": torch.linspace(-1, 1, n - 1),
                "unsorted": torch.linspace(1, -1, n)}.get(c["codebook"], c["codebook"])
    W = _rand(*shape).to(c["dtype"]) if c["dtype"] != torch.bool else torch.zeros(shape, dtype=torch.bool)
    if c["nonfinite"] and W.numel() and c["dtype"] in FLOATS:
        W.view(-1)[0] = float("nan")
    if c["meta"]:
        W = W.to("meta")
    numel = 1
    for s in shape:
        numel *= s
    bad = set()
    if c["dtype"] not in FLOATS or len(shape) < 2 or numel == 0 or c["meta"] or \
            (c["nonfinite"] and c["dtype"] in FLOATS):
        bad.add("W")
    if not k_ok:
        bad.add("k")
    if c["blocksize"] not in (32, 64, 128):
        bad.add("blocksize")
    if c["codebook"] in ("bogus", "short", "unsorted"):
        bad.add("codebook")
    if c["scale_format"] not in ("log8", "fp16"):
        bad.add("scale_format")
    if c["backend"] == "cuda":
        bad.add("backend")
    kw = dict(k=k, blocksize=c["blocksize"], codebook=codebook, scale_format=c["scale_format"], backend=c["backend"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KbitQualityWarning)
        if bad:
            _raises_naming(bad, lambda: kbit.quantize(W, **kw))
            return
        qw = kbit.quantize(W, **kw)
    cb, _ = cbs.resolve(codebook, k, c["blocksize"])
    codes, scales, ts = quantize_reference(W, k, c["blocksize"], cb, c["scale_format"])
    assert torch.equal(qw.codes, codes) and torch.equal(qw.scales, scales) and torch.equal(qw.tensor_scale, ts)
    assert qw.shape == shape
