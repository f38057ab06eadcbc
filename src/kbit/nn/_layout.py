"""What the k-bit modules share: the layout they hold their weights in, changing it in place, their size checks."""

from __future__ import annotations

import operator

import torch

from kbit.utils.checks import fail

__all__ = ["CANONICAL", "capturing", "check_size", "release"]

#: ``layout`` of a module holding the canonical tensors (``docs/format.md``)
CANONICAL = "canonical"


def capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (a module must not repack its weights then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def release(old: list[torch.Tensor]) -> None:
    """Let the caching allocator reuse ``old`` (being dropped) only after the current stream's work: a repack
    on a side stream (graph warm-up) reads tensors allocated on another stream."""
    for t in old:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def check_size(name: str, v) -> int:
    """A module size (``in_features``, ``out_features``, ``num_experts``, ...): an integer (an ``int``, a numpy or
    0-d integer tensor; not a bool or a float) of at least 1; returns it as an ``int``."""
    if isinstance(v, (bool, float)) or (isinstance(v, torch.Tensor) and v.is_floating_point()):
        fail(TypeError, name, "an int", f"{type(v).__name__} {v!r}")
    try:
        n = operator.index(v)
    except TypeError:
        fail(TypeError, name, "an int", type(v).__name__)
    if n < 1:
        fail(ValueError, name, "an int >= 1", n)
    return n
