"""What the k-bit modules share: the layout they hold their weights in, changing it in place, their size checks."""

from __future__ import annotations

import operator

import torch

from kbit.utils.checks import fail

__all__ = ["CANONICAL", "apply_keeping_format", "capturing", "check_size", "release"]

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


#: the integer dtype of each float dtype's width: a format buffer is moved as a view of it
_SAME_WIDTH = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
               torch.float64: torch.int64}


def apply_keeping_format(module: torch.nn.Module, apply, fn, recurse: bool, model_dtype: tuple[str, ...]):
    """``Module._apply`` (``apply``: the parent class's) for a k-bit module: ``model.to(torch.bfloat16)``,
    ``.half()`` and ``.float()`` convert every floating-point buffer, but the format's float buffers (codebook,
    tensor scale, float16 scales) are part of the quantized weight and keep their dtype (``docs/format.md``);
    only the buffers named in ``model_dtype`` (bias, router weight) follow the model's dtype. The format buffers
    go through ``fn`` as integer views of the same width, so a device move still moves them."""
    held = {}
    for name, t in module._buffers.items():
        if t is not None and t.is_floating_point() and name not in model_dtype:
            held[name] = t.dtype
            module._buffers[name] = t.view(_SAME_WIDTH[t.dtype])
    try:
        out = apply(fn, recurse)
    finally:
        for name, dtype in held.items():
            module._buffers[name] = module._buffers[name].view(dtype)
    if hasattr(module, "dtype"):  # the module's compute dtype follows what fn makes of that dtype
        device = next((t.device for t in module._buffers.values() if t is not None), None)
        module.dtype = fn(torch.empty(0, dtype=module.dtype, device=device)).dtype
    return out
