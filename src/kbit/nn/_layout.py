"""What the k-bit modules share about the layout they hold their weights in and about changing it in place."""

from __future__ import annotations

import torch

__all__ = ["CANONICAL", "capturing", "release"]

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
