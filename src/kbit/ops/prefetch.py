"""``prefetch_l2(*tensors)``: start pulling tensors' bytes into the L2 cache, asynchronously (sm_90).

A decode step leaves HBM idle while its small kernels run (norms, rotary, attention: ~10 us a layer on
Llama-3-8B). Issued before them, a prefetch of the next k-bit GEMV's codes and scales lets that GEMV read them
from L2. The op launches one small kernel (``kbit.cuda.prefetch_src``) with programmatic dependent launch; it
returns at once and changes no value, so correctness never depends on it. Elsewhere (no NVRTC, before sm_90, CPU,
``KBIT_PREFETCH=0``) it does nothing.
"""
from __future__ import annotations

import os

import torch

__all__ = ["prefetch_l2"]

CHUNK = 16384  # bytes a bulk prefetch
THREADS = 32  # one warp a CTA, a CTA on every SM: the SMs' copy engines work through the prefetches in parallel
_KERNELS: dict = {}
_SMS: dict = {}


def _sms(device: torch.device) -> int:
    n = _SMS.get(device)
    if n is None:
        n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("KBIT_PREFETCH", "1") == "0":
        return False
    from kbit.cuda import runtime

    return runtime.available() and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_l2(*tensors: torch.Tensor | None) -> None:
    """Prefetch up to four tensors (contiguous storage; ``None`` skipped) of one CUDA device into L2."""
    ts = [t for t in tensors if t is not None]
    if not ts:
        return
    if len(ts) > 4:
        raise ValueError(f"tensors: at most 4, got {len(ts)}")
    for t in ts:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors: expected torch.Tensor or None, got {type(t).__name__}")
        if t.device != ts[0].device:
            raise ValueError(f"tensors: all on one device, got {ts[0].device} and {t.device}")
    dev = ts[0].device
    if not _enabled(dev):
        return
    kern = _KERNELS.get(dev)
    if kern is None:
        from kbit.cuda import compile_kernel
        from kbit.cuda.prefetch_src import SOURCE

        kern = _KERNELS[dev] = compile_kernel(SOURCE, "kbit_l2_prefetch", {}, dev)
    ptrs = [t.data_ptr() for t in ts] + [0] * (4 - len(ts))
    sizes = [t.numel() * t.element_size() if t.is_contiguous() else 0 for t in ts] + [0] * (4 - len(ts))
    total = sum(sizes)
    if total == 0:
        return
    ctas = max(1, min(_sms(dev), -(-total // CHUNK)))
    kern((ctas,), THREADS, "QQQQqqqqqi", *ptrs, *sizes, total, CHUNK, pdl=True)
