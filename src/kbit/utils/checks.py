"""Argument checks: every error names the argument and says what was expected and what came.

``fail(ValueError, "k", "one of 2, 3, 4, 5", 7)`` raises ``ValueError("k: expected one of 2, 3, 4, 5, got 7")``.
"""

from __future__ import annotations

import re
from typing import NoReturn

import torch

__all__ = ["check_choice", "check_int", "check_regex", "check_tensor", "fail"]


def fail(cls: type[Exception], name: str, expected, got) -> NoReturn:
    """Raise ``cls("<name>: expected <expected>, got <got>")``."""
    raise cls(f"{name}: expected {expected}, got {got}")


def check_regex(name: str, pattern) -> str:
    """``pattern`` is a string that compiles as a regular expression; returns it."""
    if not isinstance(pattern, str):
        fail(TypeError, name, "a regular-expression string", type(pattern).__name__)
    try:
        re.compile(pattern)
    except re.error as e:
        fail(ValueError, name, "a regular expression", f"{pattern!r}, which is not one ({e})")
    return pattern


def check_tensor(name: str, t, dtypes, shape=None, device=None, contiguous: bool = False) -> torch.Tensor:
    """``t`` is a tensor of one of ``dtypes`` (a dtype or a tuple), of ``shape`` and on ``device`` where given,
    contiguous where asked; returns ``t``."""
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in dtypes:
        fail(TypeError, name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)
    if shape is not None and tuple(t.shape) != tuple(shape):
        fail(ValueError, name, f"shape {tuple(shape)}", tuple(t.shape))
    if device is not None and t.device != torch.device(device):
        fail(ValueError, name, f"device {device}", t.device)
    if contiguous and not t.is_contiguous():
        fail(ValueError, name, "a contiguous tensor", f"strides {t.stride()}")
    return t


def check_int(name: str, v, minimum: int | None = None, maximum: int | None = None) -> int:
    """``v`` is an int (not a bool) in ``[minimum, maximum]`` where given; returns it."""
    if isinstance(v, bool) or not isinstance(v, int):
        fail(TypeError, name, "an int", type(v).__name__)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        lo = "-inf" if minimum is None else minimum
        hi = "inf" if maximum is None else maximum
        fail(ValueError, name, f"an int in [{lo}, {hi}]", v)
    return v


def check_choice(name: str, v, choices) -> object:
    """``v`` is one of ``choices``; returns it."""
    if v not in tuple(choices):
        fail(ValueError, name, f"one of {tuple(choices)}", repr(v))
    return v
