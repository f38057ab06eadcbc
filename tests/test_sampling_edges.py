"""kbit.sample at the edges of float32 (the semantics in its docstring): +inf logits, tiny temperatures, huge equal
logits, rows without a finite logit; kernel against ``sample_reference`` / ``filtered_probs_reference``
(statistical where random). The Triton interpreter on the CPU; the same tests on the GPU, plus a full vocabulary
(marked ``gpu``)."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kbit.ops import _ids  # noqa: E402
from kbit.ops.sampling import SamplingConfig, filtered_probs_reference, sample, sample_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = SamplingConfig(chunk=16, candidates=4, warps_chunk=1, warps_select=1)  # every path: fallbacks too
ARGS = [dict(), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(top_k=3, top_p=0.5)]
ARG_IDS = ["plain", "topk", "topp", "minp", "topk-topp"]


@pytest.fixture(autouse=True)
def _clear_flag():
    _ids.error_flag(DEV).zero_()
    yield
    _ids.error_flag(DEV).zero_()


def _draw(row, n, config=None, seed=3, **kw):
    tokens, logprobs = sample(row.expand(n, -1).contiguous(), seed=seed, return_logprobs=True, config=config, **kw)
    return tokens.cpu(), logprobs.cpu()


def _uniform_over(tokens, cells):
    """Draws all in ``cells`` and spread over them: each cell drawn, no cell over 3x its share (n >= 16 a cell)."""
    cells = sorted(cells)
    assert set(tokens.tolist()) <= set(cells), f"draws outside {cells[:10]}: {sorted(set(tokens.tolist()))[:10]}"
    counts = torch.bincount(tokens, minlength=max(cells) + 1)[cells]
    share = tokens.numel() / len(cells)
    assert bool((counts > 0).all()) and bool((counts < 3 * share).all()), counts.tolist()


# ------------------------------------------------------------------------------------------------ +inf


@pytest.mark.parametrize("kw", ARGS, ids=ARG_IDS)
@pytest.mark.parametrize("config", [None, TINY], ids=["default", "tiny"])
def test_one_pos_inf_logit_is_drawn(kw, config):
    row = torch.randn(1, 100, generator=torch.Generator().manual_seed(0)).to(DEV)
    row[0, 17] = math.inf
    tokens, logprobs = _draw(row, 16, config=config, **kw)
    assert tokens.tolist() == [17] * 16
    assert logprobs.tolist() == [0.0] * 16
    ref_t, ref_lp = sample_reference(row.cpu(), return_logprobs=True, **kw)
    assert ref_t.tolist() == [17] and ref_lp.tolist() == [0.0]
    greedy = sample(row, temperature=0.0, return_logprobs=True)
    assert greedy[0].tolist() == [17] and greedy[1].tolist() == [0.0]


@pytest.mark.parametrize("config", [None, TINY], ids=["default", "tiny"])
def test_several_pos_inf_logits_are_uniform(config):
    row = torch.randn(1, 90, generator=torch.Generator().manual_seed(1)).to(DEV)
    infs = [3, 17, 40, 41, 88]
    row[0, infs] = math.inf
    row[0, 5] = math.nan
    row[0, 6] = -math.inf
    tokens, logprobs = _draw(row, 160, config=config, temperature=0.7, top_k=2)
    _uniform_over(tokens, infs)
    torch.testing.assert_close(logprobs, torch.full((160,), -math.log(len(infs))))
    probs = filtered_probs_reference(row.cpu(), temperature=0.7, top_k=2)[0]
    assert (probs > 0).nonzero().flatten().tolist() == infs
    assert sample(row, temperature=0.0).tolist() == [3]  # greedy: the lowest +inf index


# ------------------------------------------------------------------------------------------------ temperature


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-20])
@pytest.mark.parametrize("kw", ARGS, ids=ARG_IDS)
def test_tiny_temperature_is_greedy(temperature, kw):
    x = torch.randn(4, 77, generator=torch.Generator().manual_seed(2)) * 10
    x[1] *= 1e30  # huge logits as well
    x[2, 60] = x[2].max() + 1e-3  # a close second place must still lose
    x = x.to(DEV)
    tokens, logprobs = sample(x, temperature=temperature, seed=5, return_logprobs=True, **kw)
    assert tokens.tolist() == x.argmax(1).tolist()
    assert logprobs.tolist() == [0.0] * 4
    ref = sample_reference(x.cpu(), temperature=temperature, **kw)
    assert ref.tolist() == x.argmax(1).tolist()


def test_tiny_temperature_ties_stay_random():
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).to(DEV)
    row[0, [9, 30, 50]] = 7.0
    tokens, logprobs = _draw(row, 96, temperature=1e-38)
    _uniform_over(tokens, [9, 30, 50])
    torch.testing.assert_close(logprobs, torch.full((96,), -math.log(3)))


# ------------------------------------------------------------------------------------------------ huge equal logits


@pytest.mark.parametrize("config", [None, TINY], ids=["default", "tiny"])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.5, top_p=0.9), dict(top_k=50)], ids=["plain", "tp", "tk"])
def test_huge_equal_logits_sample_among_ties(config, kw):
    g = torch.Generator().manual_seed(4)
    V = 300
    signs = torch.where(torch.rand(V, generator=g) < 0.03, 1.0, -1.0)
    signs[V - 1] = -1.0
    row = (signs * 3e38).reshape(1, V).to(DEV)
    top = (signs > 0).nonzero().flatten().tolist()
    n = 16 * len(top) if config is None else 24  # the tiny config's fallbacks are slow under the interpreter
    tokens, logprobs = _draw(row, n, config=config, **kw)
    assert V - 1 not in tokens.tolist()
    if config is None:
        _uniform_over(tokens, top)
    else:
        assert set(tokens.tolist()) <= set(top) and tokens.unique().numel() > 3
    torch.testing.assert_close(logprobs, torch.full_like(logprobs, -math.log(len(top))), rtol=1e-5, atol=1e-5)
    probs = filtered_probs_reference(row.cpu(), **kw)[0]
    assert (probs > 0).nonzero().flatten().tolist() == top


def test_64_identical_huge_rows():
    """The reported case: 64 identical rows of +-3e38 must not all return the last index."""
    g = torch.Generator().manual_seed(5)
    x = (torch.where(torch.rand(1, 1000, generator=g) < 0.5, 3e38, -3e38)).expand(64, -1).contiguous().to(DEV)
    tokens = sample(x, seed=11).cpu()
    top = (x[0] > 0).nonzero().flatten().cpu()
    assert bool(torch.isin(tokens, top).all())
    assert tokens.unique().numel() > 20
    assert sample(x, temperature=0.0).cpu().tolist() == [int(top[0])] * 64


# ------------------------------------------------------------------------------------------------ no finite logit


def _bad_rows(V=50):
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    x[1] = math.nan
    x[2] = -math.inf
    x[3, ::2], x[3, 1::2] = math.nan, -math.inf
    return x.to(DEV)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.0), dict(top_k=4, top_p=0.5)], ids=["plain", "greedy",
                                                                                                 "filters"])
@pytest.mark.parametrize("config", [None, TINY], ids=["default", "tiny"])
def test_rows_without_a_finite_logit(kw, config):
    x = _bad_rows()
    tokens, logprobs = sample(x, seed=1, return_logprobs=True, config=config, **kw)
    assert tokens[1:].tolist() == [-1, -1, -1]
    assert torch.isnan(logprobs[1:]).all() and not torch.isnan(logprobs[0])
    assert 0 <= int(tokens[0]) < x.shape[1]
    ref_t, ref_lp = sample_reference(x.cpu(), return_logprobs=True, **kw)
    assert ref_t[1:].tolist() == [-1, -1, -1] and torch.isnan(ref_lp[1:]).all()
    assert int(_ids.error_flag(DEV)) == _ids.ERR_LOGITS
    with pytest.raises(ValueError, match=r"logits: expected a finite or \+inf logit in every row"):
        _ids.check_errors(DEV)
    _ids.check_errors(DEV)  # cleared


def test_rows_without_a_finite_logit_debug_mode_raises():
    x = _bad_rows()
    with _ids.debug_ids(), pytest.raises(ValueError, match=r"logits: expected a finite or \+inf logit in every row "
                                                           r"\(after penalties\), got none in row\(s\) \[1, 2, 3\]"):
        sample(x, seed=1)
    assert int(_ids.error_flag(DEV)) == 0
    with _ids.debug_ids():
        assert sample(x[:1], seed=1).shape == (1,)


def test_row_max_split_over_programs():
    """A row wider than one row-max tile: the maximum is combined from several programs' partial maxima (some past
    the row's end, some over NaN / -inf only), the edge semantics as for one program."""
    from kbit.ops.sampling import _row_max_split

    V = 5000
    assert _row_max_split(4, V)[0] == 4
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(8))
    x[0, :2048] = math.nan
    x[0, 4500] = math.inf  # the only +inf, in the third program's part
    x[1, :] = -math.inf
    x[1, 4999] = 1e30  # the only finite logit, the last entry
    x[2, :2048], x[2, 2048:] = math.nan, -math.inf
    x[3, 100] = 50.0  # an ordinary row: its max in the first part
    x = x.to(DEV)
    for temperature in (1.0, 1e-38):
        tokens, logprobs = sample(x, seed=2, temperature=temperature, top_k=5, return_logprobs=True)
        assert tokens.tolist() == [4500, 4999, -1, 100]
        assert logprobs[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0] and torch.isnan(logprobs[2])
        ref_t = sample_reference(x.cpu(), temperature=temperature, top_k=5)
        assert ref_t.tolist() == [4500, 4999, -1, 100]
        assert int(_ids.error_flag(DEV)) == _ids.ERR_LOGITS
        _ids.error_flag(DEV).zero_()


def test_finite_rows_unchanged_in_distribution():
    """The shift by the row max leaves ordinary rows' distribution as it was (reference vs draws)."""
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(7)).to(DEV) * 3 + 1e4
    kw = dict(temperature=0.8, top_k=8)
    probs = filtered_probs_reference(row.cpu(), **kw)[0].double()
    tokens, logprobs = _draw(row, 192, **kw)
    assert bool((probs[tokens] > 0).all())
    torch.testing.assert_close(logprobs.double(), probs[tokens].log(), rtol=1e-4, atol=1e-4)
    tv = 0.5 * (torch.bincount(tokens, minlength=64).double() / 192 - probs).abs().sum().item()
    assert tv < 4 * math.sqrt(8 / (2 * math.pi * 192))


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_edge_rows_full_vocabulary():
    V = 151936
    x = torch.randn(6, V, device="cuda")
    x[0, 17] = math.inf
    x[1] = math.nan
    x[2] = -math.inf
    x[3] = torch.where(torch.rand(V, device="cuda") < 0.01, 3e38, -3e38)
    x[4] *= 1e30
    tokens, logprobs = sample(x, temperature=torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-38, 0.7], device="cuda"),
                              seed=torch.tensor([3], device="cuda"), return_logprobs=True)
    t = tokens.tolist()
    assert t[0] == 17 and t[1] == t[2] == -1 and x[3, t[3]] > 0 and t[4] == int(x[4].argmax())
    assert torch.isnan(logprobs[1:3]).all() and torch.isfinite(logprobs[[0, 3, 4, 5]]).all()
    with pytest.raises(ValueError, match="logits"):
        _ids.check_errors()
    many = sample(x[3:4].expand(4096, -1).contiguous(), seed=1)
    assert many.unique().numel() > 1000  # ~1500 tied maxima, drawn uniformly
