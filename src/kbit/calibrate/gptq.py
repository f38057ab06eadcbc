"""GPTQ-style calibrated rounding into the kbit format (format version 1, kernels unchanged).

Round-to-nearest (``kbit.quantize``) picks each code on its own. GPTQ (Frantar et al., "OPTQ") rounds the
columns of ``W [N, K]`` one at a time and moves each column's rounding error onto the columns not yet
rounded, weighted by the inverse Hessian ``H = X^T X`` of the layer's calibration inputs ``X [T, K]``, so the
layer output ``X W^T`` moves less. Columns go in batches (lazy updates: the error of a batch reaches the columns
after it in one matrix product), with the upper Cholesky factor of the damped inverse Hessian.

kbit's block scales (one per ``blocksize`` weights along K) are chosen either when a block's first column is
reached, from the error-updated weights of that block (``scales="updated"``, GPTQ's groupwise rule), or from
the original weights before any rounding (``scales="original"``). The codes, scales, tensor scale and codebook
mean exactly what they mean for ``kbit.quantize``: the result is an ordinary :class:`~kbit.format.KbitWeight`.

With a rotation (``rotation="hadamard"``, as ``kbit.quantize``) the rounded weight is ``W R`` and the Hessian that
of the rotated inputs, ``R^T H R``: the layer computes ``(x R)(W R)^T``, so its output error is measured there.
"""

from __future__ import annotations

import torch

from kbit.format import codebooks as cbs
from kbit.format.pack import pack
from kbit.format.reference import block_scales, blocks
from kbit.format.spec import (
    DEFAULT_BLOCKSIZE,
    DEFAULT_K,
    DEFAULT_SCALE_FORMAT,
    KbitWeight,
    check_blocksize,
    check_k,
    check_scale_format,
    padded_k,
)
from kbit.ops.quantize import check_weight, fit_codebook, resolve_rotation, rotate_weight
from kbit.utils.checks import check_choice, check_int, check_tensor, fail

SCALE_RULES = ("updated", "original")
#: columns per lazy batch: a multiple of every blocksize, so a block's columns all sit in one batch
COLUMNS = 128
#: damping retries when the damped Hessian is still not positive definite (each multiplies damp by 10)
DAMP_RETRIES = 6


def damped_inverse_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` (float64), ``U^T U`` = that inverse;
    ``H [..., K, K]``, one factor per matrix.

    Columns with ``H[j, j] == 0`` (inputs never seen) get a unit diagonal, so their weights round to nearest and
    pass no error on. A matrix still not positive definite after damping is damped tenfold more (up to
    DAMP_RETRIES times).
    """
    H = H.to(torch.float64).clone()
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0
    lam = damp * diag.mean(-1)
    eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
    for _ in range(DAMP_RETRIES + 1):
        L, info = torch.linalg.cholesky_ex(H + lam[..., None, None] * eye)
        U, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        bad = (info != 0) | (info2 != 0)
        if not bool(bad.any()):
            return U
        lam = torch.where(bad, lam * 10, lam)
    fail(ValueError, "H", "a positive semi-definite Hessian X^T X", "a matrix that stays indefinite after damping")


def _check_args(W, H, damp, act_order, scales, columns, blocksize):
    check_weight(W)
    K = W.shape[-1]
    check_tensor("H", H, (torch.float16, torch.bfloat16, torch.float32, torch.float64), device=W.device)
    if tuple(H.shape) not in ((K, K), tuple(W.shape[:-2]) + (K, K)):
        fail(ValueError, "H", f"shape {(K, K)} or {tuple(W.shape[:-2]) + (K, K)}", tuple(H.shape))
    if not bool(torch.isfinite(H).all()):
        fail(ValueError, "H", "finite values", "NaN/Inf entries")
    if not isinstance(damp, (int, float)) or isinstance(damp, bool) or not damp >= 0:
        fail(ValueError, "damp", "a float >= 0", repr(damp))
    check_choice("scales", scales, SCALE_RULES)
    check_int("columns", columns, minimum=blocksize)
    if columns % blocksize:
        fail(ValueError, "columns", f"a multiple of blocksize {blocksize}", columns)
    if act_order and scales == "updated":
        fail(ValueError, "scales", "'original' with act_order=True (block scales are fixed before the columns are "
             "reordered)", repr(scales))
    if act_order and W.dim() != 2:
        fail(ValueError, "W", "a 2-D weight [N, K] with act_order=True", f"shape {tuple(W.shape)}")


@torch.no_grad()
def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    k: int = DEFAULT_K,
    blocksize: int = DEFAULT_BLOCKSIZE,
    codebook=None,
    scale_format: str = DEFAULT_SCALE_FORMAT,
    damp: float = 0.1,
    act_order: bool = False,
    scales: str = "updated",
    columns: int = COLUMNS,
    rotation=None,
    seed: int = 0,
) -> KbitWeight:
    """Quantize ``W [N, K]`` to k bits, rounding to lower the output error on inputs with Hessian ``H``.

    Parameters
    ----------
    W : float16/bfloat16/float32/float64 ``[..., N, K]``, finite (an ``nn.Linear`` weight, or a stack of them
        rounded in one loop, each with its own tensor scale as in :func:`kbit.quantize`).
    H : ``[K, K]`` (shared by the stack) or ``[..., K, K]`` (one per matrix) on W's device, ``sum_t x_t^T x_t``
        over calibration inputs ``x_t [K]`` (any positive multiple: only its shape matters).
        :class:`kbit.calibrate.Hessian` accumulates it.
    k, blocksize, codebook, scale_format : as in :func:`kbit.quantize` (``"fit"`` fits the codebook to W
        before rounding).
    damp : fraction of the mean diagonal of H added to its diagonal (GPTQ uses 0.01; 0.1 rounds better for
        held-out inputs with a few thousand calibration tokens, docs/quality.md).
    act_order : round columns in order of decreasing ``H[j, j]`` (needs ``scales="original"`` and a 2-D W).
    scales : ``"updated"`` (a block's scale from its error-updated weights when its first column is reached) or
        ``"original"`` (from W before rounding).
    columns : columns per lazy batch (a multiple of ``blocksize``).
    rotation, seed : as in :func:`kbit.quantize`: round ``W R`` on the Hessian ``R^T H R`` of the rotated inputs;
        the result records the rotation.

    Returns
    -------
    KbitWeight on W's device, the same format as ``kbit.quantize(W, k, blocksize, codebook, scale_format)``;
    with ``H`` a multiple of the identity and ``scales="original"``, its codes are those of ``kbit.quantize``.

    Example
    -------
    >>> X = torch.randn(4096, 512); W = torch.randn(256, 512)
    >>> qw = gptq_quantize(W, X.T @ X, k=3)
    """
    k = check_k(k)
    blocksize = check_blocksize(blocksize)
    scale_format = check_scale_format(scale_format)
    _check_args(W, H, damp, act_order, scales, columns, blocksize)
    cb, name = cbs.resolve(codebook, k, blocksize)
    rot = resolve_rotation(rotation, W.shape[-1], seed)
    if rot is not None:
        W = rotate_weight(W, rot)
        H = rotate_weight(rotate_weight(H, rot).transpose(-1, -2), rot)  # R^T H R (H symmetric)
    *lead, N, K = W.shape
    kp = padded_k(K, blocksize)
    Wf = W.detach().to(torch.float32).reshape(-1, N, K)
    matrix_max = Wf.abs().amax(dim=(-2, -1))
    if name == "fit":
        cb = fit_codebook(Wf, matrix_max, blocksize, scale_format, cb)
    cb = cb.to(W.device)

    Hp = torch.zeros(Wf.shape[0], kp, kp, dtype=torch.float64, device=W.device)
    Hp[:, :K, :K] = H.to(torch.float64).reshape(-1, K, K)  # padded columns: unit diagonal, pass no error on
    perm = torch.argsort(torch.diagonal(Hp[0]), descending=True, stable=True) if act_order else None
    if perm is not None:
        Hp = Hp[:, perm][:, :, perm]
    U = damped_inverse_factor(Hp, float(damp)).to(torch.float32)

    Wp = torch.nn.functional.pad(Wf, (0, kp - K))
    stored, scale, ts = block_scales(blocks(Wf, blocksize).abs().amax(-1), matrix_max, scale_format)
    if perm is not None:
        Wp = Wp[..., perm]
    codes = _round_columns(Wp, U, cb, scale, stored, matrix_max, blocksize, scale_format,
                           scales == "updated", perm, columns)
    if perm is not None:
        codes = codes[..., torch.argsort(perm)]
    codes = pack(codes.reshape(*lead, N, kp), k)
    return KbitWeight(codes, stored.reshape(*lead, N, -1), ts.to(torch.float32).reshape(lead), cb, W.shape, k,
                      blocksize, scale_format, name, rot)


def _round_columns(Wp, U, cb, scale, stored, matrix_max, blocksize, scale_format, updated, perm, columns):
    """The GPTQ loop on the padded (and permuted) weights ``Wp [B, N, Kp]`` with factors ``U [B, Kp, Kp]``;
    returns int64 codes ``[B, N, Kp]`` in ``Wp``'s column order. With ``updated``, fills ``scale`` / ``stored``
    ``[B, N, nb]`` block by block in place. A stack of B matrices goes through one loop (one op per column for
    all of them)."""
    _, N, kp = Wp.shape
    mid = cbs.midpoints(cb)  # the format's decision thresholds (kbit.format.reference.nearest_codes), made once
    codes = torch.empty(Wp.shape, dtype=torch.int64, device=Wp.device)
    block_of = (perm if perm is not None else torch.arange(kp, device=Wp.device)) // blocksize
    block_of = block_of.tolist()
    for i1 in range(0, kp, columns):
        i2 = min(i1 + columns, kp)
        W1 = Wp[..., i1:i2].clone()
        U1 = U[:, i1:i2, i1:i2]
        E1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            b = block_of[i1 + i]
            if updated and (i1 + i) % blocksize == 0:
                absmax = W1[..., i:i + blocksize].abs().amax(-1, keepdim=True)
                s_stored, s, _ = block_scales(absmax, matrix_max, scale_format)
                stored[..., b], scale[..., b] = s_stored[..., 0], s[..., 0]
            s = scale[..., b]
            w = W1[..., i]
            x = torch.where(s > 0, w / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(w))
            c = torch.bucketize(x, mid, right=False)
            codes[..., i1 + i] = c
            err = (w - cb[c] * s) / U1[:, i, i, None]
            W1[..., i:] -= err[..., None] * U1[:, None, i, i:]
            E1[..., i] = err
        Wp[..., i2:] -= E1 @ U[:, i1:i2, i2:]
    return codes


class Hessian:
    """Running ``H = sum_t x_t^T x_t`` of a linear layer's inputs (float32 on the inputs' device).

    >>> h = Hessian(512); h.add(torch.randn(8, 64, 512)); h.H.shape
    torch.Size([512, 512])
    """

    def __init__(self, in_features: int, device=None):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Add the inputs ``x [..., K]`` (any float dtype)."""
        x = x.detach().reshape(-1, self.H.shape[0]).to(device=self.H.device, dtype=torch.float32)
        self.H.addmm_(x.T, x)
        self.tokens += x.shape[0]
