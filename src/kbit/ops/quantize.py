"""``kbit.quantize`` / ``kbit.dequantize``: validate, resolve the codebook, run the Triton quantizer or the torch
reference, wrap the result in a :class:`~kbit.format.KbitWeight`, warn where it lost a row (:func:`check_quality`).

With ``rotation`` the weight is rotated along K first (``W R``, :class:`kbit.format.Rotation`, docs/format.md
"Rotation") and the result records the rotation; :func:`rotate_weight` / :func:`unrotate_weight` are the plain-torch
``W R`` / ``Y R^T`` (butterflies, no dense ``R``) that quantizing and the references use."""

from __future__ import annotations

import warnings

import torch
import triton

from kbit import options
from kbit.format import codebooks as cbs
from kbit.format.pack import PLANES, words_per_row
from kbit.format.reference import (
    FP16_MAX,
    block_scales,
    blocks,
    nearest_codes,
    normalise,
    quantize_reference,
)
from kbit.format.spec import (
    DEFAULT_BLOCKSIZE,
    DEFAULT_K,
    DEFAULT_SCALE_FORMAT,
    KbitWeight,
    Rotation,
    check_blocksize,
    check_k,
    check_scale_format,
    log8_thresholds,
    log8_values,
    padded_k,
)
from kbit.kernels.quantize import quantize_kernel
from kbit.ops._checks import check_not_meta
from kbit.utils.checks import check_choice, check_int, fail

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "triton", "torch")
FIT_SAMPLE = 1 << 22  # values used to fit a codebook to a tensor
FIT_ITERS = 40
#: a row whose relative error ``||w - q|| / ||w||`` reaches this is no closer to its weights than zeros are
CLIFF_ERROR = 1.0
_CHECK_ELEMENTS = 1 << 22  # weights a pass of the quality check reads at once (bounds its temporaries)
_LOG8_RANGE = 2.0 ** (-254 / 16)  # the smallest log8 block scale, relative to the matrix absmax
#: what ``rotation=`` takes by name
ROTATIONS = ("hadamard",)
_ROTATE_ELEMENTS = 1 << 24  # weights one butterfly pass holds at once (bounds its temporaries: 3 copies)


class KbitQualityWarning(UserWarning):
    """``kbit.quantize`` lost most of a row: its k-bit weights are no closer to the original than zeros are."""


def check_weight(W, name: str = "W") -> torch.Tensor:
    """``W`` is a non-empty floating-point tensor ``[..., N, K]``; returns it."""
    if not isinstance(W, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor", type(W).__name__)
    if W.dtype not in FLOAT_DTYPES:
        fail(TypeError, name, f"a floating-point tensor {FLOAT_DTYPES}", W.dtype)
    if W.dim() < 2:
        fail(ValueError, name, "at least 2 dimensions [..., N, K]", f"shape {tuple(W.shape)}")
    if W.numel() == 0:
        fail(ValueError, name, "a non-empty tensor", f"shape {tuple(W.shape)}")
    return W


def fit_codebook(W: torch.Tensor, matrix_max: torch.Tensor, blocksize: int, scale_format: str,
                  init: torch.Tensor) -> torch.Tensor:
    """Lloyd-Max on the tensor's own block-normalised values (evenly spaced rows, deterministic)."""
    N, K = W.shape[-2:]
    rows = W.reshape(-1, K)
    take = max(1, min(rows.shape[0], FIT_SAMPLE // K))
    idx = torch.linspace(0, rows.shape[0] - 1, take, device=W.device).round().long()
    b = blocks(rows[idx], blocksize)[:, None]  # [take, 1, nb, B]: each sampled row as a 1-row matrix
    absmax = b.abs().amax(-1)
    _, scale, _ = block_scales(absmax, matrix_max.reshape(-1)[idx // N], scale_format)
    x = normalise(b, scale)[absmax > 0]
    if x.numel() == 0:
        return init
    cb = cbs.lloyd_max(x.clamp(-1, 1), init, iters=FIT_ITERS).cpu()
    if (cb[1:] <= cb[:-1]).any():  # two levels met (degenerate data): keep a valid codebook
        return init
    return cb


# ------------------------------------------------------------------------------------------ rotation
def resolve_rotation(rotation, K: int, seed: int = 0) -> Rotation | None:
    """``rotation=`` of :func:`quantize` as a :class:`~kbit.format.Rotation` of width ``K`` (or None):
    ``"hadamard"`` is ``Rotation.for_width(K, seed)``; a ``Rotation`` must have a block dividing K."""
    if rotation is None:
        return None
    if isinstance(rotation, Rotation):
        rotation.check_width(K, "W.shape[-1] (K)")
        return rotation
    if isinstance(rotation, str) and rotation in ROTATIONS:
        return Rotation.for_width(K, check_int("seed", seed, minimum=0))
    fail(ValueError, "rotation", f"None, one of {ROTATIONS} or a kbit.format.Rotation", repr(rotation))


def _butterflies(h: torch.Tensor, block: int) -> torch.Tensor:
    """``h`` times the orthonormal Walsh-Hadamard matrix of order ``block``, along the last dim, per block."""
    lead, K = h.shape[:-1], h.shape[-1]
    step = 1
    while step < block:  # (a, c) -> (a + c, a - c) for the pairs (i, i + step) of each group of 2 * step
        g = h.reshape(*lead, K // (2 * step), 2, step)
        h = torch.stack((g[..., 0, :] + g[..., 1, :], g[..., 0, :] - g[..., 1, :]), dim=-2).reshape(*lead, K)
        step *= 2
    return h * (1.0 / block ** 0.5)


def _rotate_rows(W: torch.Tensor, rotation: Rotation, inverse: bool) -> torch.Tensor:
    if not isinstance(W, torch.Tensor) or W.dtype not in FLOAT_DTYPES or W.dim() < 1:
        fail(TypeError, "W", f"a floating-point tensor [..., K] {FLOAT_DTYPES}", getattr(W, "dtype", type(W)))
    if not isinstance(rotation, Rotation):
        fail(TypeError, "rotation", "a kbit.format.Rotation", type(rotation).__name__)
    K = W.shape[-1]
    rotation.check_width(K, "W.shape[-1] (K)")
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    s = rotation.signs(K, dtype, W.device)
    rows = W.detach().reshape(-1, K)
    out = torch.empty(rows.shape, dtype=dtype, device=W.device)
    step = max(1, _ROTATE_ELEMENTS // K)
    for r0 in range(0, rows.shape[0], step):  # a slice of rows at a time: temporaries stay bounded
        h = rows[r0:r0 + step].to(dtype)
        out[r0:r0 + step] = _butterflies(h, rotation.block) * s if inverse else \
            _butterflies(h * s, rotation.block)
    return out.reshape(W.shape)


def rotate_weight(W: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """``W R`` along the last dim (``W [..., K]``): what a weight quantized under ``rotation`` stands for.
    float32 (float64 for a float64 ``W``)."""
    return _rotate_rows(W, rotation, inverse=False)


def unrotate_weight(Y: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """``Y R^T`` along the last dim, the inverse of :func:`rotate_weight`: ``unrotate_weight(dequantize(qw),
    qw.rotation)`` is the weight ``W`` a rotated ``qw`` approximates (references, tests). float32 (float64 for a
    float64 ``Y``)."""
    return _rotate_rows(Y, rotation, inverse=True)


def quantize(
    W: torch.Tensor,
    k: int = DEFAULT_K,
    blocksize: int = DEFAULT_BLOCKSIZE,
    codebook=None,
    scale_format: str = DEFAULT_SCALE_FORMAT,
    backend: str = "auto",
    rotation=None,
    seed: int = 0,
) -> KbitWeight:
    """Quantize ``W[..., N, K]`` (an ``nn.Linear`` weight or a stack of them) to k bits.

    Parameters
    ----------
    W : float16/bfloat16/float32/float64 tensor ``[..., N, K]``, finite. Leading dims are separate matrices
        (e.g. experts ``[E, N, K]``), each with its own tensor scale.
    k : bits per weight, 2..5.
    blocksize : 32, 64 or 128 weights along K share one scale.
    codebook : ``None`` (the default for k, :data:`kbit.format.codebooks.DEFAULT_CODEBOOK`), a name
        (``"nf"``, ``"nf0"``, ``"uniform"``, ``"lloyd"``, ``"lloyd0"``, ``"fit"``) or ``2**k`` values.
    scale_format : ``"log8"`` (8-bit log scales + one float32 per matrix) or ``"fp16"``.
    backend : ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
    rotation : ``None``; ``"hadamard"`` (``Rotation.for_width(K, seed)``: the largest power-of-two block dividing
        K); or a :class:`kbit.format.Rotation`. The weight quantized is ``W R`` (:func:`rotate_weight`, float32)
        and the result records the rotation: a layer must feed it ``x R`` (``kbit.ops.hadamard.rotate``), and
        ``dequantize`` gives ``W R`` back (:func:`unrotate_weight` undoes it).
    seed : the seed of the random signs for ``rotation="hadamard"``.

    Returns
    -------
    KbitWeight on W's device.

    Example
    -------
    >>> qw = kbit.quantize(torch.randn(256, 512), k=4)
    >>> qw.bits_per_weight  # doctest: +SKIP
    4.25...
    """
    check_weight(W)
    check_not_meta("W", W)
    k = check_k(k)
    blocksize = check_blocksize(blocksize)
    scale_format = check_scale_format(scale_format)
    check_choice("backend", backend, BACKENDS)
    if backend == "triton" and not W.is_cuda and not options.get().interpret:
        fail(ValueError, "backend", f"'auto' or 'torch' for W on {W.device} (the Triton quantizer needs CUDA or "
             "TRITON_INTERPRET=1)", "'triton'")
    cb, name = cbs.resolve(codebook, k, blocksize)
    rot = resolve_rotation(rotation, W.shape[-1], seed)

    W = W.detach()
    if rot is not None:
        if not bool(torch.isfinite(W).all()):  # before the rotation spreads a NaN over its block
            fail(ValueError, "W", "finite values", f"{int((~torch.isfinite(W)).sum())} NaN/Inf entries")
        W = rotate_weight(W, rot)
    lead = W.shape[:-2]
    matrix_max = torch.linalg.vector_norm(W.reshape(*lead, -1), ord=float("inf"), dim=-1).to(torch.float32)
    if not bool(torch.isfinite(matrix_max).all()):
        bad = int((~torch.isfinite(W)).sum())
        fail(ValueError, "W", "finite values", f"{bad} NaN/Inf entries")
    if scale_format == "fp16" and float(matrix_max.max()) > FP16_MAX:
        raise ValueError(f"W: |w| up to {float(matrix_max.max()):g} overflows fp16 scales (max {FP16_MAX:g}); "
                         "use scale_format='log8'")
    if name == "fit":
        cb = fit_codebook(W, matrix_max, blocksize, scale_format, cb)

    use_triton = backend == "triton" or (backend == "auto" and W.is_cuda)
    if use_triton:
        codes, scales, ts = _quantize_triton(W, k, blocksize, cb, scale_format, matrix_max)
    else:
        codes, scales, ts = quantize_reference(W, k, blocksize, cb, scale_format)
    qw = KbitWeight(codes, scales, ts.to(torch.float32), cb.to(W.device), W.shape, k, blocksize, scale_format,
                    name, rot)
    check_quality(W, qw, matrix_max)
    return qw


def _max_gap(codebook: torch.Tensor) -> float:
    """The farthest a value in [-1, 1] can be from its nearest level (plus 1% for scales rounded below the block
    absmax)."""
    cb = codebook.to(torch.float64).cpu()
    gaps = [float(cb[0]) + 1.0, 1.0 - float(cb[-1])]
    if cb.numel() > 1:
        gaps.append(float((cb[1:] - cb[:-1]).max()) / 2)
    return max(gaps) + 0.01


def _suspect_rows(W: torch.Tensor, qw: KbitWeight, matrix_max: torch.Tensor) -> torch.Tensor:
    """Rows (indices into ``W.reshape(-1, K)``) whose relative error may reach :data:`CLIFF_ERROR`, by a bound
    that needs one reduction over W: a block of stored scale s errs by at most ``n * (gap * s)**2`` (gap:
    :func:`_max_gap`), a block whose scale is 0 by all its energy. Where the bound leaves more than
    ``max(256, rows / 8)`` rows (k = 2 with long blocks: its worst case is loose there), those with the largest
    bound relative to their energy, rows with a zeroed block first."""
    K = W.shape[-1]
    rows = W.reshape(-1, K)
    R, N = rows.shape[0], qw.N
    mm = matrix_max.reshape(-1).to(torch.float32)
    mm = torch.where(mm > 0, mm, torch.ones_like(mm))
    big = float(mm.max()) > 1e15  # squares of larger weights overflow float32 sums: divide by the matrix absmax
    scales = qw.scales.reshape(R, -1)
    gap = _max_gap(qw.codebook)
    step = max(1, _CHECK_ELEMENTS // K)
    idx, keys = [], []
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        m = mm[torch.arange(r0, r1, device=W.device) // N]
        b = blocks(rows[r0:r1], qw.blocksize)
        sumsq = torch.linalg.vector_norm(b / m[:, None, None] if big else b, dim=-1).square_()  # [r, nb]
        if qw.scale_format == "log8":
            s = log8_values(W.device)[scales[r0:r1].long()] * (1.0 if big else m[:, None])
        else:
            s = scales[r0:r1].to(torch.float32) / (m[:, None] if big else 1.0)
        zeroed = (s == 0) & (sumsq > 0)
        bound = torch.where(s > 0, qw.blocksize * (gap * s) ** 2, sumsq).sum(-1)
        energy = sumsq.sum(-1)
        ratio = torch.where(zeroed.any(-1), float("inf"), bound / torch.where(energy > 0, energy, 1.0))
        hit = torch.nonzero((energy > 0) & (bound >= (CLIFF_ERROR * 0.999) ** 2 * energy)).reshape(-1)
        idx.append(hit + r0)
        keys.append(ratio[hit])
    idx, keys = torch.cat(idx), torch.cat(keys)
    budget = max(256, R // 8)
    if idx.numel() > budget:
        idx = idx[torch.topk(keys, budget).indices]
    return idx


def row_errors(W: torch.Tensor, qw: KbitWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 relative errors ``||w - q|| / ||w||`` of the rows ``rows`` of ``W.reshape(-1, K)`` (all by
    default; 0 for an all-zero row), ``q`` the weights ``qw`` (W quantized) stands for. The codes are found again
    from W and qw's scales, as the quantizer found them (the same float32 operations), so nothing is unpacked."""
    K = W.shape[-1]
    flat = W.reshape(-1, K)
    if rows is None:
        rows = torch.arange(flat.shape[0], device=W.device)
    scales = qw.scales.reshape(flat.shape[0], -1)
    ts = qw.tensor_scale.reshape(-1).to(torch.float32)
    cb = qw.codebook.to(W.device)
    errs = []
    step = max(1, _CHECK_ELEMENTS // K)
    for i in range(0, rows.numel(), step):
        idx = rows[i:i + step]
        b = blocks(flat[idx], qw.blocksize)  # [r, nb, B] float32, zero-padded
        if qw.scale_format == "log8":
            s = ts[idx // qw.N, None] * log8_values(W.device)[scales[idx].long()]
        else:
            s = scales[idx].to(torch.float32)
        codes = nearest_codes(normalise(b, s), cb)
        m = b.abs().amax(dim=(-2, -1), keepdim=True)  # the row's absmax: sums of squares in range
        m = torch.where(m > 0, m, torch.ones_like(m))
        d = (b / m - cb[codes] * (s[..., None] / m)).reshape(len(idx), -1)[:, :K]
        norm = (b / m).reshape(len(idx), -1).norm(dim=-1)
        errs.append(torch.where(norm > 0, d.norm(dim=-1) / torch.where(norm > 0, norm, 1.0), 0.0))
    return torch.cat(errs) if errs else torch.zeros(0, device=W.device)


def check_quality(W: torch.Tensor, qw: KbitWeight, matrix_max: torch.Tensor) -> None:
    """Warn (:class:`KbitQualityWarning`, one warning per tensor naming the worst row and its error) where a row
    lost its weights: relative error at least :data:`CLIFF_ERROR`. Gaussian weights stay far below it at every k
    (k = 2: at most ~0.6, tests/test_validation.py); it is reached when a block's range exceeds what k bits and
    the block scales hold: one outlier sets the log8 scales of a whole matrix, or a block's own outlier leaves its
    other weights far from every level. A cheap bound (:func:`_suspect_rows`) picks the rows whose error is
    computed exactly (:func:`row_errors`): the check costs one reduction over W, plus, where the bound is loose
    (k = 2, long blocks), one requantization of at most ``max(256, rows / 8)`` rows."""
    rows = _suspect_rows(W, qw, matrix_max)
    if rows.numel() == 0:
        return
    err = row_errors(W, qw, rows)
    lost = err >= CLIFF_ERROR * 0.999
    if not bool(lost.any()):
        return
    worst = int(torch.argmax(err))
    r = int(rows[worst])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(r), qw.shape[:-1]))
    row_max = float(W.reshape(-1, W.shape[-1])[r].abs().max())
    mat_max = float(matrix_max.reshape(-1)[r // qw.N])
    if qw.scale_format == "log8" and row_max < 2 * _LOG8_RANGE * mat_max:
        hint = (f"the row's absmax {row_max:.3g} is below the smallest log8 block scale, 2**-15.9 of the matrix's "
                f"absmax {mat_max:.3g}: clip the outliers"
                + (" or use scale_format='fp16'" if mat_max <= FP16_MAX else " or keep this tensor unquantized"))
    else:
        hint = (f"a block's outlier leaves its other weights far from every level (row absmax {row_max:.3g}): "
                "a larger k, a smaller blocksize or codebook='fit' keeps more")
    warnings.warn(f"kbit.quantize: row {where[0] if len(where) == 1 else where} of W {tuple(qw.shape)} lost "
                  f"its weights at k={qw.k}: relative error {float(err[worst]):.3g} (>= {CLIFF_ERROR:g}: no closer "
                  f"than zeros; {int(lost.sum())} of {W.numel() // W.shape[-1]} rows); {hint}",
                  KbitQualityWarning, stacklevel=3)


def _quantize_triton(W, k, blocksize, codebook, scale_format, matrix_max):
    *lead, N, K = W.shape
    kp = padded_k(K, blocksize)
    rows = W.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    dev = W.device
    codes = torch.empty(*lead, N, words_per_row(k, kp), dtype=torch.int32, device=dev)
    sdtype = torch.uint8 if scale_format == "log8" else torch.float16
    scales = torch.empty(*lead, N, kp // blocksize, dtype=sdtype, device=dev)
    ts = matrix_max if scale_format == "log8" else torch.ones_like(matrix_max)
    ts = ts.reshape(-1).contiguous()
    mid = cbs.midpoints(codebook).to(dev)
    planes = PLANES[k]
    w0, w1 = planes[0][0], (planes[1][0] if len(planes) > 1 else 0)
    block_k = blocksize
    while block_k < 128 and kp % (2 * block_k) == 0:
        block_k *= 2
    block_r = 32
    grid = (triton.cdiv(R, block_r), kp // block_k)
    quantize_kernel[grid](
        rows, codes, scales, ts, log8_thresholds(dev), log8_values(dev), mid,
        R, N, K, kp, rows.stride(0),
        K_BITS=k, BLOCKSIZE=blocksize, LOG8=scale_format == "log8", W0=w0, W1=w1,
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )
    return codes, scales, ts.reshape(lead)


