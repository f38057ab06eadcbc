"""Facts about the device a call runs on."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kbit import options

__all__ = ["cpu_decode_dtype", "interpreting", "sm_count"]


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


@functools.cache
def cpu_decode_dtype() -> torch.dtype:
    """The dtype a model decodes in fastest on this CPU: bfloat16 where the CPU multiplies bfloat16 natively
    (AVX512-BF16 or AMX, and oneDNN takes bf16: half the bytes of float32; SmolLM2-135M decoded 1.2-1.5x faster in
    bfloat16 than in float32 on 2 AVX512-BF16 cores, ``docs/notes``), else float32 (bfloat16 is emulated there)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
        native = "avx512_bf16" in flags or "amx_bf16" in flags
        supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (OSError, RuntimeError, AttributeError):  # not Linux, or a torch build without oneDNN
        return torch.float32
    return torch.bfloat16 if native and supported else torch.float32
