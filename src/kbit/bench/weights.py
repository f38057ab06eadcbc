"""The weights the harness times: kbit's quantize / dequantize, a stand-in of the format's sizes, copies and
the bytes a call reads (the roofline's numerator)."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kbit.ops.dequant import dequantize
from kbit.ops.quantize import quantize


def kbit_api() -> tuple[Callable, Callable]:
    """(quantize, dequantize) of kbit."""
    return quantize, dequantize


@dataclass
class StandInWeight:
    """Random tensors with the sizes of the kbit format, for harness self-checks (``dummy-linear``) that need
    no quantized weight. Real candidates skip it."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    codebook: torch.Tensor
    shape: tuple[int, ...]
    k: int
    blocksize: int
    scale_format: str = "log8"
    stand_in: bool = True


def stand_in_weight(shape: Sequence[int], k: int, blocksize: int, device) -> StandInWeight:
    *lead, N, K = shape
    kp = -(-K // blocksize) * blocksize
    codes = torch.randint(-2**31, 2**31 - 1, (*lead, N, kp * k // 32), dtype=torch.int32, device=device)
    scales = torch.randint(0, 255, (*lead, N, kp // blocksize), dtype=torch.uint8, device=device)
    codebook = torch.linspace(-1, 1, 2**k, device=device)
    return StandInWeight(codes, scales, torch.ones(lead, device=device), codebook, tuple(shape), k, blocksize)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements of ``t``."""
    return t.numel() * t.element_size()


def kbit_bytes(qw, experts: Sequence[int] | None = None) -> int:
    """Bytes of the canonical format that a call reads: codes + scales + tensor_scale + codebook; for an
    expert stack with ``experts`` given, only those experts' codes, scales and tensor scales."""
    parts = (qw.codes, qw.scales, qw.tensor_scale)
    if experts is None:
        return sum(tensor_bytes(t) for t in parts) + tensor_bytes(qw.codebook)
    per_expert = sum(tensor_bytes(t[0]) for t in parts)
    return len(experts) * per_expert + tensor_bytes(qw.codebook)


def clone_weight(qw):
    """An independent copy of a KbitWeight (every tensor attribute cloned, the rest shared)."""
    if dataclasses.is_dataclass(qw) and not isinstance(qw, type):
        changes = {f.name: getattr(qw, f.name).clone() for f in dataclasses.fields(qw)
                   if f.init and isinstance(getattr(qw, f.name), torch.Tensor)}
        return dataclasses.replace(qw, **changes)
    out = copy.copy(qw)
    for name, value in vars(qw).items():
        if isinstance(value, torch.Tensor):
            setattr(out, name, value.clone())
    return out
