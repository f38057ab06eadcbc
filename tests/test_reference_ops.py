import pytest
import torch

import kbit


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_linear_reference_matches_dense_math():
    qw = kbit.quantize(_rand(33, 70), k=4)
    x = _rand(2, 5, 70, seed=1)
    b = _rand(33, seed=2)
    y = kbit.linear_reference(x, qw, b)
    W = kbit.dequantize(qw, torch.float64)
    assert y.dtype == torch.float64 and y.shape == (2, 5, 33)
    torch.testing.assert_close(y, x.double() @ W.T + b.double())


def test_grouped_reference_matches_per_expert_linear():
    qw = kbit.quantize(_rand(4, 24, 64), k=3)
    x = _rand(5, 64, seed=1)
    tok = torch.tensor([0, 0, 3, 4, 2, 1], dtype=torch.int32)
    exp = torch.tensor([1, 3, 3, 0, 2, 1], dtype=torch.int64)
    bias = _rand(4, 24, seed=2)
    y = kbit.grouped_linear_reference(x, qw, tok, exp, bias)
    for p in range(6):
        e = int(exp[p])
        ref = kbit.linear_reference(x[int(tok[p])], qw[e], bias[e])
        torch.testing.assert_close(y[p], ref)


@pytest.mark.parametrize("call, err, match", [
    (lambda qw, qs: kbit.linear_reference(_rand(2, 63), qw), ValueError, "x: expected last dimension K = 64"),
    (lambda qw, qs: kbit.linear_reference(torch.ones(2, 64, dtype=torch.int64), qw), TypeError, "x: expected a float"),
    (lambda qw, qs: kbit.linear_reference(_rand(2, 64), qs), ValueError, r"weight: expected shape \[N, K\]"),
    (lambda qw, qs: kbit.linear_reference(_rand(2, 64), qw, _rand(7)), ValueError, "bias: expected last dimension"),
    (lambda qw, qs: kbit.grouped_linear_reference(_rand(2, 64), qs, torch.tensor([0]), torch.tensor([4])),
     ValueError, r"expert_ids: expected values in \[0, 4\)"),
    (lambda qw, qs: kbit.grouped_linear_reference(_rand(2, 64), qs, torch.tensor([0.0]), torch.tensor([1])),
     TypeError, "token_ids: expected an int32/int64 tensor"),
    (lambda qw, qs: kbit.grouped_linear_reference(_rand(2, 64), qs, torch.tensor([0, 1]), torch.tensor([1])),
     ValueError, "expert_ids: expected shape"),
])
def test_bad_input(call, err, match):
    qw = kbit.quantize(_rand(8, 64), k=4)
    qs = kbit.quantize(_rand(4, 8, 64), k=4)
    with pytest.raises(err, match=match):
        call(qw, qs)


@pytest.mark.gpu
def test_device_mix_raises():
    qw = kbit.quantize(_rand(8, 64), k=4)
    with pytest.raises(ValueError, match="x: expected device"):
        kbit.linear_reference(_rand(2, 64).cuda(), qw)
