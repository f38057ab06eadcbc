"""Codebooks: the 2**k values in [-1, 1] that a code indexes, before the block scale is applied.

Named codebooks (``codebook=`` in :func:`kbit.quantize`):

``"nf"``
    Normal-float: quantiles of N(0, 1) at evenly spaced probabilities ``(i + 0.5) / 2**k``, divided by the
    largest so that +-1 are levels (each block's largest weight is exact). Symmetric, no 0 level.
``"nf0"``
    Normal-float with an exact 0 (the construction of bitsandbytes' NF4): ``2**(k-1)`` positive and
    ``2**(k-1) - 1`` negative quantiles plus 0, normalised to +-1. Asymmetric.
``"uniform"``
    ``2**k`` evenly spaced levels from -1 to 1 (no 0 level).
``"lloyd"``
    Lloyd-Max levels for absmax-normalised Gaussian blocks of the given blocksize: the lowest mean squared
    error on Gaussian weights. The outer levels sit inside +-1, so block maxima are clipped a little.
    Constants in ``lloyd_codebooks.json``, computed by ``scripts/compute_lloyd_codebooks.py``.
``"lloyd0"``
    Lloyd-Max with -1, 0 and +1 pinned (the other levels free).
``"fit"``
    Lloyd-Max on the tensor's own block-normalised values (computed at quantization time, started from
    ``"lloyd"``).

Or a tensor/sequence of ``2**k`` values: finite, sorted ascending, distinct, inside [-1, 1].
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

NAMED = ("nf", "nf0", "uniform", "lloyd", "lloyd0", "fit")

#: The codebook used when ``codebook=None``, per k, chosen on real models with `kbit eval` (docs/quality.md):
#: on all-MiniLM-L6-v2 (fp32 weights) at blocksize 32 / log8, Lloyd-Max loses 46% less than NF at k = 2 and
#: ties it at k = 5; at k = 3 and 4 the NF codebook with an exact 0 (bitsandbytes' NF4 construction) loses 26%
#: and 8% less than NF, and on SmolLM2-135M a 0 level is what keeps k = 3 usable (perplexity 78 vs 667-989).
DEFAULT_CODEBOOK = {2: "lloyd", 3: "nf0", 4: "nf0", 5: "lloyd"}

_LLOYD_FILE = Path(__file__).with_name("lloyd_codebooks.json")


def _ndtri(p: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtri(p.to(torch.float64))


def normal_float(k: int) -> torch.Tensor:
    n = 2**k
    q = _ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    return (q / q.max()).to(torch.float32)


def normal_float_zero(k: int) -> torch.Tensor:
    n = 2**k
    offset = 1 - 0.5 * (1 / (2 * (n - 1)) + 1 / (2 * n))
    pos = _ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    neg = -_ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    v = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)])
    return torch.sort(v / v.abs().max()).values.to(torch.float32)


def uniform(k: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 2**k, dtype=torch.float32)


@functools.cache
def _lloyd_table() -> dict:
    return json.loads(_LLOYD_FILE.read_text())


def lloyd(k: int, blocksize: int, pinned: bool = False) -> torch.Tensor:
    key = f"{'lloyd0' if pinned else 'lloyd'}/k{k}/b{blocksize}"
    return torch.tensor(_lloyd_table()[key], dtype=torch.float32)


def lloyd_max(
    values: torch.Tensor, init: torch.Tensor, iters: int = 50, pinned: Sequence[float] = ()
) -> torch.Tensor:
    """Lloyd-Max iterations (1-D k-means) of ``init`` on ``values``; levels equal to ``pinned`` stay put.

    Deterministic; empty cells keep their level. Returns float32 sorted levels.
    """
    x = values.reshape(-1).to(torch.float64)
    cb = init.to(device=x.device, dtype=torch.float64).clone()
    fixed = torch.zeros_like(cb, dtype=torch.bool)
    for p in pinned:
        fixed |= cb == p
    for _ in range(iters):
        mid = (cb[1:] + cb[:-1]) * 0.5
        idx = torch.bucketize(x, mid)
        sums = torch.zeros_like(cb).index_add_(0, idx, x)
        counts = torch.zeros_like(cb).index_add_(0, idx, torch.ones_like(x))
        new = torch.where((counts > 0) & ~fixed, sums / counts.clamp_min(1), cb)
        new = torch.sort(new).values
        if torch.equal(new, cb):
            break
        cb = new
    return cb.to(torch.float32)


def resolve(codebook, k: int, blocksize: int) -> tuple[torch.Tensor, str]:
    """Turn ``codebook`` (a name, ``None`` for the default, or values) into (float32 CPU tensor, name).

    ``"fit"`` resolves to its starting point (``"lloyd"``); the quantizer refines it on the tensor.
    """
    if codebook is None:
        codebook = DEFAULT_CODEBOOK[k]
    if isinstance(codebook, str):
        name = codebook
        if name == "nf":
            return normal_float(k), name
        if name == "nf0":
            return normal_float_zero(k), name
        if name == "uniform":
            return uniform(k), name
        if name in ("lloyd", "fit"):
            return lloyd(k, blocksize), name
        if name == "lloyd0":
            return lloyd(k, blocksize, pinned=True), name
        raise ValueError(f"codebook: expected one of {NAMED} or a tensor of {2**k} values, got {name!r}")
    return validate_values(codebook, k), "custom"


def validate_values(codebook, k: int) -> torch.Tensor:
    """Check a user codebook: 2**k finite, sorted, distinct values inside [-1, 1]."""
    if isinstance(codebook, torch.Tensor):
        cb = codebook.detach()
    elif isinstance(codebook, Sequence) and not isinstance(codebook, (str, bytes)):
        try:
            cb = torch.tensor([float(v) for v in codebook])
        except (TypeError, ValueError):
            raise TypeError("codebook: expected a sequence of numbers") from None
    else:
        raise TypeError(f"codebook: expected a name, a tensor or a sequence of floats, got {type(codebook).__name__}")
    if not cb.is_floating_point():
        raise TypeError(f"codebook: expected floating-point values, got dtype {cb.dtype}")
    if cb.dim() != 1 or cb.numel() != 2**k:
        raise ValueError(f"codebook: expected {2**k} values for k={k}, got shape {tuple(cb.shape)}")
    cb = cb.to("cpu", torch.float32)
    if not torch.isfinite(cb).all():
        raise ValueError("codebook: expected finite values, got NaN or Inf")
    if cb.abs().max() > 1:
        raise ValueError(f"codebook: expected values inside [-1, 1], got max |v| = {cb.abs().max().item():g}")
    d = cb[1:] - cb[:-1]
    if (d <= 0).any():
        i = int(torch.nonzero(d <= 0)[0])
        what = "distinct" if d[i] == 0 else "sorted ascending"
        raise ValueError(
            f"codebook: expected {what} values, got v[{i}] = {cb[i].item():g}, v[{i + 1}] = {cb[i + 1].item():g}"
        )
    return cb.contiguous()


def midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring levels, float32, as the format defines them."""
    cb = codebook.to(torch.float32)
    return (cb[1:] + cb[:-1]) * 0.5


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (float64 math)."""
    r = reference.to(torch.float64)
    e = approx.to(torch.float64) - r
    return 10 * math.log10(float((r * r).sum()) / max(float((e * e).sum()), 1e-300))
