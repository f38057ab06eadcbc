"""Facts about the device a call runs on."""

from __future__ import annotations

import functools

import torch

from kbit import options

__all__ = ["interpreting", "sm_count"]


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``: no GPU code)."""
    return options.get().interpret


def sm_count(device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (a device, a string or an index)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
