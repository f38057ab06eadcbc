import pytest
import torch

from kbit.format import codebooks as cbs


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("name", ["nf", "nf0", "uniform", "lloyd", "lloyd0", "fit"])
@pytest.mark.parametrize("blocksize", [32, 64, 128])
def test_named_codebooks_are_valid(name, k, blocksize):
    cb, got = cbs.resolve(name, k, blocksize)
    assert got == name
    assert torch.equal(cbs.validate_values(cb, k), cb)
    if name in ("nf", "nf0", "uniform", "lloyd0"):
        assert cb[0] == -1 and cb[-1] == 1
    if name in ("nf0", "lloyd0"):
        assert (cb == 0).any()
    if name == "lloyd":
        assert cb.abs().max() < 1  # outer levels sit inside +-1


def test_nf4_zero_matches_bitsandbytes_construction():
    cb = cbs.normal_float_zero(4)
    # bitsandbytes' published NF4 levels
    nf4 = [-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
           0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0]
    assert torch.allclose(cb, torch.tensor(nf4), atol=1e-6)


def test_default_resolves_per_k():
    for k, name in cbs.DEFAULT_CODEBOOK.items():
        assert cbs.resolve(None, k, 32)[1] == name


@pytest.mark.parametrize("values, err, match", [
    ([0.0, 0.5, 1.0], ValueError, "expected 4 values"),
    ([-1.0, 0.5, 0.0, 1.0], ValueError, "sorted"),
    ([-1.0, 0.0, 0.0, 1.0], ValueError, "distinct"),
    ([-1.0, 0.0, 0.5, 1.5], ValueError, "inside"),
    ([-1.0, 0.0, float("nan"), 1.0], ValueError, "finite"),
    (torch.tensor([0, 1, 2, 3]), TypeError, "floating"),
    (3.0, TypeError, "expected a name"),
    ("nf5", ValueError, "expected one of"),
])
def test_bad_user_codebooks(values, err, match):
    with pytest.raises(err, match=match):
        cbs.resolve(values, 2, 32)


def test_user_codebook_accepted():
    cb, name = cbs.resolve([-1.0, -0.25, 0.25, 1.0], 2, 32)
    assert name == "custom" and cb.dtype == torch.float32
