"""Values derived from tensors (a repacked weight, a codebook table), cached per source tensor.

An entry is keyed by the identity and version of each source tensor, held weakly: memory of a freed tensor
is soon reused by another one, so the address alone would not do, and an in-place change bumps the version.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["TensorCache"]


class TensorCache:
    """``get(tensors, extra)`` returns what ``put(tensors, extra, value)`` stored while every tensor of
    ``tensors`` is the same object at the same version; ``extra`` is any hashable (e.g. a dtype). An entry goes
    when its first tensor is freed; past ``max_entries`` the cache starts afresh (None: no bound, for values that
    must stay as long as their tensors do: a bound would rebuild them on every call of a model with more weights
    than that, and inside a CUDA graph capture record the rebuild into the graph)."""

    def __init__(self, max_entries: int | None = 256):
        self.max_entries = max_entries
        self._d: dict = {}
        self._lock = threading.Lock()

    def get(self, tensors: tuple[torch.Tensor, ...], extra=None):
        key = (tuple(id(t) for t in tensors), extra)
        hit = self._d.get(key)
        if hit is None:
            return None
        refs, versions, value = hit
        for r, v, t in zip(refs, versions, tensors, strict=True):
            if r() is not t or t._version != v:
                return None
        return value

    def put(self, tensors: tuple[torch.Tensor, ...], extra, value):
        """Store ``value``; returns it."""
        key = (tuple(id(t) for t in tensors), extra)
        entry = (tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors), value)
        with self._lock:
            if self.max_entries is not None and len(self._d) >= self.max_entries:
                self._d.clear()
            self._d[key] = entry
        weakref.finalize(tensors[0], self._d.pop, key, None)
        return value

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
