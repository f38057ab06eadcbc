"""Weight quantizers compared by ``kbit eval``, each a function ``W [N, K] -> W_hat [N, K]`` (float32).

All rows of the comparison cost the same bits per weight, ``k + 0.25`` (plus 32 bits per matrix for log8):

``kbit/<codebook>``
    kbit format v1 defaults: blocksize 32, 8-bit log scales (``k + 8/32``), the named codebook.
``rtn-g128``
    Uniform asymmetric round-to-nearest, group 128 along K, per group a float16 minimum and a float16 step
    (like llama.cpp's Q4_1): ``k + 32/128``. A plain-torch reference, :func:`rtn_asym`.
``nf-b64``
    NF4-style (bitsandbytes): the ``nf0`` codebook (an exact 0, bitsandbytes' construction), blocksize 64,
    float16 absmax scales: ``k + 16/64``. At k = 4 this is NF4 with a float16 absmax.
``kbit/calibrated`` (``kbit eval --calibrate``)
    The library's own path on the whole model, not a weight function (:class:`ModelMethod`):
    ``kbit.quantize_model(rotation="auto", calibration=text)``: GPTQ layer by layer on the calibration text and the
    rotation docs/quality.md chose (``kbit.hf.quantize_model.auto_rotation``), the default codebook, ``k + 0.25``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kbit.format import codebooks as cbs
from kbit.format.codebooks import DEFAULT_CODEBOOK, NAMED
from kbit.format.reference import block_scales, blocks, nearest_codes, normalise
from kbit.hf.quantize_model import quantize_model
from kbit.ops.quantize import fit_codebook


@dataclass(frozen=True)
class Method:
    """One weight quantizer at ``k`` bits: ``name`` (table label), ``bits`` per weight, ``fn(W) -> W_hat``."""

    name: str
    k: int
    bits: float
    fn: Callable[[torch.Tensor], torch.Tensor]


def rtn_asym(W: torch.Tensor, k: int, group: int = 128) -> torch.Tensor:
    """Uniform asymmetric round-to-nearest of ``W [N, K]`` with ``group`` columns per (min, step) pair.

    Per group: ``lo = fp16(min)``, ``step = fp16((max - lo) / (2**k - 1))``, ``q = clamp(round((w - lo) /
    step), 0, 2**k - 1)``, ``w_hat = lo + q * step``. A last group shorter than ``group`` (K not a multiple)
    uses its own values only. Returns float32 ``[N, K]``.
    """
    if W.dim() != 2:
        raise ValueError(f"W: expected shape [N, K], got {tuple(W.shape)}")
    N, K = W.shape
    w = W.detach().to(torch.float32)
    pad = -K % group
    lo_in = torch.nn.functional.pad(w, (0, pad), value=float("inf")).reshape(N, -1, group)
    hi_in = torch.nn.functional.pad(w, (0, pad), value=float("-inf")).reshape(N, -1, group)
    lo = lo_in.amin(-1, keepdim=True).half().float()
    step = ((hi_in.amax(-1, keepdim=True) - lo) / (2**k - 1)).half().float()
    x = torch.nn.functional.pad(w, (0, pad)).reshape(N, -1, group)
    q = torch.where(step > 0, ((x - lo) / step.clamp_min(1e-30)).round().clamp(0, 2**k - 1), 0)
    return (lo + q * step).reshape(N, -1)[:, :K]


def fake_quant(W: torch.Tensor, k: int, blocksize: int = 32, codebook=None, scale_format: str = "log8"
               ) -> torch.Tensor:
    """``dequantize(quantize(W, ...), float32)`` without packing the codes: the format's own block, scale and
    nearest-code steps (:mod:`kbit.format.reference`), bit-exact with it and several times faster on the CPU."""
    cb, name = cbs.resolve(codebook, k, blocksize)
    b = blocks(W.detach(), blocksize)
    absmax = b.abs().amax(-1)
    matrix_max = absmax.amax(dim=(-2, -1))
    if name == "fit":
        cb = fit_codebook(W.detach(), matrix_max, blocksize, scale_format, cb)
    _, scale, _ = block_scales(absmax, matrix_max, scale_format)
    codes = nearest_codes(normalise(b, scale), cb)
    out = (cb[codes] * scale[..., None]).reshape(*W.shape[:-1], -1)
    return out[..., : W.shape[-1]]


@dataclass(frozen=True)
class ModelMethod:
    """A whole-model quantizer at ``k`` bits: ``quantize(model) -> model`` on a copy of the judge's float model
    (real k-bit modules; judges with ``score_model`` take it)."""

    name: str
    k: int
    bits: float
    quantize: Callable[[nn.Module], nn.Module]


def calibrated(k: int, text: str, tokenizer) -> ModelMethod:
    """``kbit/calibrated`` at ``k`` (see the module doc): ``text`` tokenized by ``tokenizer``."""
    return ModelMethod("kbit/calibrated", k, k + 0.25,
                       lambda model: quantize_model(model, k=k, rotation="auto", calibration=text,
                                                    tokenizer=tokenizer, progress=False))


def _kbit(k: int, codebook, blocksize: int = 32, scale_format: str = "log8"):
    return lambda W: fake_quant(W, k, blocksize, codebook, scale_format)


def methods(k: int, codebooks=NAMED, baselines: bool = True) -> list[Method]:
    """The quantizers compared at ``k`` bits: kbit with each of ``codebooks``, then the baselines."""
    out = [Method(f"kbit/{cb}", k, k + 0.25, _kbit(k, cb)) for cb in codebooks]
    if baselines:
        out.append(Method("rtn-g128", k, k + 0.25, lambda W: rtn_asym(W, k, 128)))
        out.append(Method("nf-b64", k, k + 0.25, _kbit(k, "nf0", blocksize=64, scale_format="fp16")))
    return out


def default_name(k: int) -> str:
    """The table label of the default codebook at ``k`` (an alias of a ``kbit/<name>`` row)."""
    return f"kbit/{DEFAULT_CODEBOOK[k]}"
