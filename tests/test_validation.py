"""Bad input to the dense ops and KbitLinear gives a clear error, never a silent answer (issue 34: "Silent, values",
"Half-applied changes", "Quality cliff", "Unclear"); the CPU path keeps its dequantized weight (issue 33, item 5).

Every error names the argument and says what was expected and what came (``kbit.utils.checks.fail``).
"""

import gc
import re
import warnings

import pytest
import torch
from torch import nn

import kbit
from kbit.dispatch import linear as D
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops.quantize import KbitQualityWarning, row_errors
from kbit.ops.reference import linear_tensors_reference


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def qw():
    return kbit.quantize(_rand(24, 70), k=3)


def _op(x, qw, bias=None, **over):
    """``torch.ops.kbit.linear`` on qw's tensors, any of them replaced (``over``)."""
    t = {**qw.tensors(), **over}
    return torch.ops.kbit.linear(x, t["codes"], t["scales"], t["tensor_scale"], t["codebook"], qw.k, qw.blocksize,
                                 qw.scale_format, qw.N, qw.K, bias)


def _module(bias=True, k=3, layout="canonical"):
    q = KbitLinear.from_linear(nn.Linear(70, 24, bias=bias), k=k)
    return q.repack_for_kernels() if layout == "mma-v1" else q


# ------------------------------------------------------------------------------------------------ x


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64])
def test_non_float_x_is_a_type_error(qw, dtype):
    x = _rand(3, 70).to(dtype)
    for call in (lambda: kbit.linear(x, qw), lambda: _op(x, qw), lambda: _module()(x),
                 lambda: _module(layout="mma-v1")(x)):
        with pytest.raises(TypeError, match=rf"^x: expected dtype torch.float16 or .*, got {dtype}$"):
            call()


@pytest.mark.parametrize("shape", [(3, 69), (3, 71), (70, 3), (0,), ()])
def test_wrong_k_names_x_and_the_expected_k(qw, shape):
    x = torch.zeros(shape)
    for call in (lambda: kbit.linear(x, qw), lambda: _op(x, qw), lambda: _module()(x)):
        with pytest.raises(ValueError, match=r"^x: expected last dimension K=70 .*, got shape") as e:
            call()
        assert "mat1" not in str(e.value)


def test_x_not_a_tensor(qw):
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor, got list"):
        _module()([[0.0] * 70])


def test_plain_tensor_as_the_weight_is_a_type_error():
    for w in (torch.randn(24, 70), None, "w"):
        with pytest.raises(TypeError, match=r"^weight: expected a KbitWeight .*, got"):
            kbit.linear(torch.randn(2, 70), w)
        with pytest.raises(TypeError, match=r"^weight: expected a KbitWeight"):
            kbit.gemv(torch.randn(2, 70, dtype=torch.bfloat16), w)


def test_stacked_weight_is_refused_by_dense_linear():
    stacked = kbit.quantize(_rand(2, 24, 70), k=3)
    with pytest.raises(ValueError, match=r"^weight: expected a 2-D KbitWeight"):
        kbit.linear(torch.randn(2, 70), stacked)


# ------------------------------------------------------------------------------------------------ bias


@pytest.mark.parametrize("shape", [(1,), (23,), (25,), (1, 24), (24, 1)])
def test_bias_shape_is_exact(qw, shape):
    x = _rand(3, 70)
    with pytest.raises(ValueError, match=r"^bias: expected shape \(24,\), got " + re.escape(str(tuple(shape)))):
        kbit.linear(x, qw, torch.zeros(shape))
    q = _module()
    q.bias = torch.zeros(shape)
    with pytest.raises(ValueError, match=r"^bias: expected shape \(24,\)"):
        q(x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_bias_dtype_is_float(qw, dtype):
    with pytest.raises(TypeError, match=rf"^bias: expected dtype .*, got {dtype}$"):
        kbit.linear(_rand(3, 70), qw, torch.zeros(24, dtype=dtype))


def test_bias_and_x_not_tensors(qw):
    with pytest.raises(TypeError, match="^bias: expected a torch.Tensor or None, got list"):
        kbit.linear(_rand(3, 70), qw, [0.0] * 24)
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor, got list"):
        kbit.linear([[0.0] * 70], qw)


# ------------------------------------------------------------------------------------------------ meta tensors


@pytest.mark.parametrize("name", ["codes", "scales", "tensor_scale", "codebook"])
def test_meta_weight_tensor_raises_instead_of_uninitialised_memory(qw, name):
    """A meta tensor among CPU ones sends the call to the op's fake implementation; it validates too."""
    t = qw.tensors()[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: expected device cpu.*, got meta"):
        _op(_rand(3, 70), qw, **{name: t})


def test_meta_bias_raises(qw):
    with pytest.raises(ValueError, match=r"^bias: expected device cpu, got meta"):
        kbit.linear(_rand(3, 70), qw, torch.zeros(24, device="meta"))
    q = _module()
    q.bias = torch.zeros(24, device="meta")
    with pytest.raises(ValueError, match=r"^bias: expected device cpu, got meta"):
        q(_rand(3, 70))


def test_all_meta_outside_tracing_raises(qw):
    m = qw.to("meta")
    with pytest.raises(ValueError, match=r"^x: expected a tensor with data .*, got a tensor on the meta device"):
        kbit.linear(torch.zeros(3, 70, device="meta"), m)
    with pytest.raises(ValueError, match=r"^x: expected a tensor with data"):
        KbitLinear.from_weight(m, dtype=torch.float32)(torch.zeros(3, 70, device="meta"))


def test_x_on_another_device_than_the_module():
    q = _module().to("meta")
    with pytest.raises(ValueError, match=r"^x: expected device meta .*, got cpu"):
        q(_rand(3, 70))


def test_torch_compile_validates_in_the_fake(qw):
    q = _module()
    f = torch.compile(q, backend="eager", fullgraph=True)
    x = _rand(3, 70)
    assert torch.equal(f(x), q(x))
    with pytest.raises(Exception, match="x: expected dtype"):  # dynamo wraps it
        f(x.to(torch.int32))


@pytest.mark.gpu
def test_gpu_device_mismatch_and_dtypes(qw):
    x = _rand(3, 70, dtype=torch.bfloat16).cuda()
    with pytest.raises(ValueError, match=r"^codes: expected device cuda"):
        kbit.linear(x, qw)
    g = qw.cuda()
    with pytest.raises(ValueError, match=r"^bias: expected device cuda"):
        kbit.linear(x, g, torch.zeros(24))
    with pytest.raises(ValueError, match=r"^bias: expected shape \(24,\)"):
        kbit.linear(x, g, torch.zeros(1, device="cuda"))
    with pytest.raises(TypeError, match=r"^x: expected dtype"):
        kbit.linear(x.to(torch.int32), g)
    q = KbitLinear.from_weight(g, dtype=torch.bfloat16)
    for m in (1, 100):
        with pytest.raises(TypeError, match=r"^x: expected"):
            q(torch.zeros(m, 70, dtype=torch.int32, device="cuda"))
        with pytest.raises(ValueError, match=r"^x: expected"):
            q(torch.zeros(m, 69, dtype=torch.bfloat16, device="cuda"))


# ------------------------------------------------------------------------------------------------ KbitLinear sizes


@pytest.mark.parametrize("args, cls, name", [
    ((0, 8), ValueError, "in_features"), ((-1, 8), ValueError, "in_features"), ((8, 0), ValueError, "out_features"),
    ((8, -5), ValueError, "out_features"), ((2.5, 8), TypeError, "in_features"), ((8, 8.0), TypeError, "out_features"),
    (("8", 8), TypeError, "in_features"), ((True, 8), TypeError, "in_features"), ((8, None), TypeError, "out_features"),
])
def test_kbit_linear_sizes(args, cls, name):
    with pytest.raises(cls, match=rf"^{name}: expected an int"):
        KbitLinear(*args)


def test_kbit_linear_accepts_integer_likes():
    q = KbitLinear(torch.tensor(64), torch.Size([8])[0], dtype=torch.float32)
    assert (q.in_features, q.out_features) == (64, 8) and type(q.in_features) is int


@pytest.mark.parametrize("kw, cls, name", [
    (dict(k=6), ValueError, "k"), (dict(k=4.0), TypeError, "k"), (dict(blocksize=48), ValueError, "blocksize"),
    (dict(scale_format="fp8"), ValueError, "scale_format"), (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(dtype="bfloat16"), TypeError, "dtype"),
])
def test_kbit_linear_format_arguments(kw, cls, name):
    with pytest.raises(cls, match=rf"^{name}: expected"):
        KbitLinear(64, 8, **kw)


# ------------------------------------------------------------------------------------------------ load_state_dict


def _snapshot(m):
    return {n: t.clone() for n, t in m.state_dict().items() if isinstance(t, torch.Tensor)}, m.get_extra_state(), \
        m.layout


def _unchanged(m, snap):
    tensors, extra, layout = snap
    now = {n: t for n, t in m.state_dict().items() if isinstance(t, torch.Tensor)}
    assert now.keys() == tensors.keys()
    for n, t in tensors.items():
        assert torch.equal(now[n], t), n
    assert m.get_extra_state() == extra and m.layout == layout


def _other(**kw):
    a = dict(in_features=70, out_features=24, bias=True, k=3, blocksize=32, scale_format="log8")
    a.update(kw)
    lin = nn.Linear(a["in_features"], a["out_features"], bias=a["bias"])
    return KbitLinear.from_linear(lin, k=a["k"], blocksize=a["blocksize"], scale_format=a["scale_format"])


@pytest.mark.parametrize("layout", ["canonical", "mma-v1"])
@pytest.mark.parametrize("kw", [dict(k=2), dict(k=4), dict(k=5), dict(blocksize=64), dict(blocksize=128),
                                dict(scale_format="fp16"), dict(in_features=71), dict(out_features=23)])
def test_load_state_dict_mismatch_changes_nothing(layout, kw):
    """The issue's example (k differs) and every other format parameter: the error comes before any copy."""
    q = _module(layout=layout)
    x = _rand(2, 70)
    y = q(x)
    snap = _snapshot(q)
    sd = _other(**kw).state_dict()
    for strict in (True, False):
        with pytest.raises((ValueError, TypeError)):
            q.load_state_dict(sd, strict=strict)
        _unchanged(q, snap)
    sd.pop("_extra_state")  # without the format parameters the tensors' shapes and dtypes still tell
    with pytest.raises((ValueError, TypeError)):
        q.load_state_dict(sd, strict=False)
    _unchanged(q, snap)
    assert torch.equal(q(x), y)


@pytest.mark.parametrize("key, value, cls, match", [
    ("codebook", torch.linspace(-1, 1, 16), ValueError, r"state_dict\['codebook'\]: expected shape \(8,\)"),
    ("codes", None, TypeError, r"state_dict\['codes'\]: expected dtype torch.int32"),
    ("scales", None, TypeError, r"state_dict\['scales'\]: expected dtype torch.uint8"),
    ("tensor_scale", torch.ones(1), ValueError, r"state_dict\['tensor_scale'\]: expected shape \(\)"),
    ("bias", torch.zeros(1), ValueError, r"state_dict\['bias'\]: expected shape \(24,\)"),
    ("bias", torch.zeros(24, dtype=torch.int32), TypeError, r"state_dict\['bias'\]: expected dtype float"),
    ("_extra_state", {"k": 3}, ValueError, "KbitLinear state: expected format_version=1"),
    ("_extra_state", "k=3", TypeError, "KbitLinear state: expected a dict"),
])
def test_load_state_dict_bad_tensor_changes_nothing(key, value, cls, match):
    q = _module()
    snap = _snapshot(q)
    sd = _other().state_dict()
    sd[key] = value if value is not None else sd[key].to(torch.float32)
    with pytest.raises(cls, match=match):
        q.load_state_dict(sd)
    _unchanged(q, snap)


def test_load_state_dict_strict_missing_or_unexpected_changes_nothing():
    q = _module()
    snap = _snapshot(q)
    sd = _other().state_dict()
    del sd["codebook"]
    with pytest.raises(ValueError, match=r"^state_dict: expected the keys .* missing \['codebook'\]"):
        q.load_state_dict(sd)
    _unchanged(q, snap)
    sd = _other().state_dict()
    sd["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        q.load_state_dict(sd)
    _unchanged(q, snap)


def test_load_state_dict_inside_a_model_names_the_key():
    model = nn.Sequential(nn.Linear(70, 70), _module())
    snap = _snapshot(model[1])
    sd = nn.Sequential(nn.Linear(70, 70), _other(k=2)).state_dict()
    with pytest.raises(ValueError, match="KbitLinear state: expected k=3, got 2"):
        model.load_state_dict(sd)
    _unchanged(model[1], snap)
    sd = nn.Sequential(nn.Linear(70, 70), _other()).state_dict()
    sd["1.codebook"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"state_dict\['1.codebook'\]"):
        model.load_state_dict(sd)


def test_load_state_dict_good_state_still_loads_both_layouts():
    src = _other()
    x = _rand(2, 70)
    for layout in ("canonical", "mma-v1"):
        q = _module(layout=layout)
        q.load_state_dict(src.state_dict())
        assert q.layout == layout
        assert torch.equal(q(x), src(x))


# ------------------------------------------------------------------------------------------------ CPU weight cache


@pytest.fixture
def count_dequant(monkeypatch):
    calls = []
    real = D.dequantize_reference

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(D, "dequantize_reference", counting)
    return calls


@pytest.mark.parametrize("layout", ["canonical", "mma-v1"])
def test_cpu_forward_dequantizes_once(count_dequant, layout):
    q = _module(layout=layout)
    x = _rand(1, 70)
    ys = [q(x) for _ in range(5)]
    assert len(count_dequant) == 1
    w = q.weight()
    ref = linear_tensors_reference(x, w.codes, w.scales, w.tensor_scale, w.codebook, k=w.k, blocksize=w.blocksize,
                                   scale_format=w.scale_format, N=w.N, K=w.K, bias=q.bias)
    for y in ys:
        assert torch.equal(y, ref)


def test_cpu_cache_follows_changes(count_dequant):
    q = _module()
    x = _rand(1, 70)
    q(x)
    with torch.no_grad():
        q.scales.add_(1)  # in place: the version changes
    w = q.weight()
    ref = x @ dequantize_reference(w).T + q.bias
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)
    assert len(count_dequant) == 2
    q.codebook = q.codebook.flip(0).clone()  # a new buffer
    torch.testing.assert_close(q(x), x @ dequantize_reference(q.weight()).T + q.bias, rtol=1e-5, atol=1e-5)
    assert len(count_dequant) == 3
    q.repack_for_kernels()  # a new layout: new tensors
    torch.testing.assert_close(q(x), x @ dequantize_reference(q.weight()).T + q.bias, rtol=1e-5, atol=1e-5)
    assert len(count_dequant) == 4


def test_cpu_cache_opt_out_and_release(count_dequant):
    gc.collect()
    D.CPU_WEIGHTS.clear()
    q = _module()
    q.cache_cpu_weight = False
    x = _rand(1, 70)
    for _ in range(3):
        q(x)
    assert len(count_dequant) == 3 and len(D.CPU_WEIGHTS) == 0
    q.cache_cpu_weight = True
    q(x)
    assert len(D.CPU_WEIGHTS) == 1
    del q
    gc.collect()
    assert len(D.CPU_WEIGHTS) == 0  # the entry goes with its codes


def test_functional_linear_caches_on_cpu(count_dequant, qw):
    x = _rand(2, 70)
    b = _rand(24, seed=3)
    ys = [kbit.linear(x, qw, b) for _ in range(3)]
    assert len(count_dequant) == 1
    ref = linear_tensors_reference(x, *qw.tensors().values(), k=qw.k, blocksize=qw.blocksize,
                                   scale_format=qw.scale_format, N=qw.N, K=qw.K, bias=b)
    assert all(torch.equal(y, ref) for y in ys)


def test_inference_tensors_are_not_cached(count_dequant):
    with torch.inference_mode():
        q = _module()
        x = _rand(1, 70)
        q(x), q(x)
    assert len(count_dequant) == 2


# ------------------------------------------------------------------------------------------------ quality cliff


def _outlier(shape=(16, 256), value=1e6, at=(0, 0)):
    W = _rand(*shape, seed=7)
    W[at] = value
    return W


def test_outlier_warns_once_naming_row_and_error():
    """The issue's example: one 1e6 in a 16 x 256 matrix at k = 2 gives the other rows relative errors ~2.5."""
    W = _outlier()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        qw = kbit.quantize(W, k=2)
    cliff = [r for r in rec if issubclass(r.category, KbitQualityWarning)]
    assert len(cliff) == 1
    err = row_errors(W, qw)
    worst = int(err.argmax())
    msg = str(cliff[0].message)
    assert f"row {worst} of W (16, 256)" in msg and f"relative error {float(err[worst]):.3g}" in msg
    assert "16 of 16 rows" in msg and "keep this tensor unquantized" in msg  # 1e6 overflows fp16 scales
    assert err[1:].min() > 2  # the other rows' values: no closer than zeros
    assert cliff[0].filename == __file__  # points at the caller


def test_row_errors_match_the_float64_dequantization():
    for shape, k, bs, sf in [((16, 256), 2, 32, "log8"), ((3, 7, 100), 3, 64, "fp16"), ((5, 33), 5, 128, "log8")]:
        W = _rand(*shape, seed=k)
        W.view(-1)[:40] = 0  # a zero block
        qw = kbit.quantize(W, k=k, blocksize=bs, scale_format=sf)
        d = (W.double() - dequantize_reference(qw).double()).norm(dim=-1) / W.double().norm(dim=-1).clamp_min(1e-300)
        torch.testing.assert_close(row_errors(W, qw).double(), d.reshape(-1), rtol=1e-5, atol=1e-6)


def test_stacked_weight_names_matrix_and_row():
    W = _rand(3, 16, 256)
    W[1, 5, 3] = 1e6
    with pytest.warns(KbitQualityWarning, match=r"row \(1, \d+\) of W \(3, 16, 256\) .* 16 of 48 rows"):
        kbit.quantize(W, k=2)


def test_block_outlier_warns_with_its_hint():
    W = _rand(64, 256)
    W[3, 2] = 200.0
    with pytest.warns(KbitQualityWarning, match=r"row 3 of W .* a block's outlier .* codebook='fit'"):
        kbit.quantize(W, k=2, blocksize=128)


def test_fp16_scales_keep_the_outlier_matrix():
    W = _rand(16, 256, seed=7) * 1e-3
    W[0, 0] = 1000.0  # rows of ~1e-3 fall below log8's range (1000 * 2**-15.9); fp16 scales hold them
    with pytest.warns(KbitQualityWarning, match="16 of 16 rows.*use scale_format='fp16'"):
        kbit.quantize(W, k=2)
    with pytest.warns(KbitQualityWarning, match="row 0 of W .* 1 of 16 rows"):  # the outlier's own block
        qw = kbit.quantize(W, k=2, scale_format="fp16")
    assert float(row_errors(W, qw)[1:].max()) < 0.7


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("blocksize", [32, 128])
def test_no_false_alarm_on_gaussian(k, blocksize):
    W = _rand(256, 1024, seed=k)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KbitQualityWarning)
        for codebook in (None, "nf", "nf0", "uniform", "lloyd", "lloyd0"):
            for sf in ("log8", "fp16"):
                qw = kbit.quantize(W, k=k, blocksize=blocksize, codebook=codebook, scale_format=sf)
                assert float(row_errors(W, qw).max()) < 0.7  # far from the cliff (measured max 0.62: uniform, k=2)


def test_zero_rows_and_zero_matrix_do_not_warn():
    W = _rand(8, 64)
    W[2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", KbitQualityWarning)
        kbit.quantize(W, k=2)
        kbit.quantize(torch.zeros(4, 64), k=2)
