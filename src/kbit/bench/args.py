"""Argument types of the ``kbit bench`` and ``kbit tune`` command lines: comma lists checked as they are parsed,
so that a bad value is a one-line usage error naming the option before any GPU work (argparse adds the option's
name to the message)."""
from __future__ import annotations

import argparse

from kbit.format.spec import K_VALUES

__all__ = ["bits_list", "count_list", "shape_list"]


def _ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from e
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    return out


def bits_list(text: str) -> list[int]:
    """A comma list of bit widths, each one of :data:`kbit.format.spec.K_VALUES`."""
    out = _ints(text)
    bad = [v for v in out if v not in K_VALUES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected bits in {K_VALUES}, got {bad}")
    return out


def count_list(text: str) -> list[int]:
    """A comma list of positive integers (rows, tokens)."""
    out = _ints(text)
    bad = [v for v in out if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {bad}")
    return out


def shape_list(text: str) -> list[tuple[int, int]]:
    """A comma list of ``NxK`` weight shapes (the weight is [N, K]), both sides >= 1."""
    out = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        try:
            n, k = item.split("x")
            shape = (int(n), int(k))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"shape {item!r}: expected NxK, e.g. 28672x4096") from e
        if min(shape) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r}: expected N and K >= 1")
        out.append(shape)
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma list of NxK, e.g. 28672x4096, got {text!r}")
    return out
