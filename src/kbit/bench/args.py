"""Argument types of the ``kbit bench`` and ``kbit tune`` command lines: comma lists checked as they are parsed,
so that a bad value is a one-line usage error naming the option before any GPU work (argparse adds the option's
name to the message)."""
from __future__ import annotations

import argparse

from kbit.bench.suite import suite_names
from kbit.format.spec import K_VALUES

__all__ = ["bits_list", "count_list", "name_list", "nonneg_int", "positive_float", "positive_int", "shape_list",
           "suite_name"]


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


def _int(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from e
    if v < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1 (repetitions, shapes)."""
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0 (worker processes: 0 is none)."""
    return _int(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds)."""
    try:
        v = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from e
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def name_list(text: str) -> list[str]:
    """A comma list of names (at least one)."""
    out = [v.strip() for v in text.split(",") if v.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma list of names, got {text!r}")
    return out


def suite_name(text: str) -> str:
    """The name of a model-shape suite kbit ships (``kbit/bench/suites/<name>.json``)."""
    known = suite_names()
    if text not in known:
        raise argparse.ArgumentTypeError(f"expected one of {known}, got {text!r}")
    return text
